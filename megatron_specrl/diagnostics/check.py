"""check-resync: after a weight sync, does the engine serve exactly the learner's policy?

Two independent checks, because each catches what the other cannot:
- weights: the engine's tensors (read back in the vLLM worker, see readout.py) vs the
  learner's full HF state cast to the engine's dtype and fused like vLLM. Exact in fp32
  and in bf16 (measured max 0.0), so a wrong k/v or gate/up order, a dropped bucket or a
  wrong layer index shows up by name.
- log-probs: a probe batch (prompts + engine-generated responses) scored by the engine
  twice (the sampling log-probs of `generate`, and a `score` prefill; both read the prompt
  from the prefix cache, as verification does) and by the learner's `compute_logprobs`. This
  is mapping-independent (a bug symmetric in both directions of hf_mapping still shows)
  and catches a sync that forgot to reset the prefix cache: a prompt cached before the
  update is then served with stale KV (exact weights with wrong log-probs say which). Its tolerance depends on the
  engine dtype (LOGPROB_TOL): a bf16 engine rounds weights and activations.

With SGLang (--engine sglang) only the log-prob check runs: its weights live in its scheduler process,
reachable through its request API only (reads_weights).

`logprob_check(run)` is the cheap variant the trainer runs every `check_resync_every` steps.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field

import torch

from megatron_specrl.diagnostics.readout import (
    WeightRow, compare_weights, merge_tp_shards, read_weights_in_worker,
)
from megatron_specrl.engines.protocol import GenerateRequest, InActor, RunsInWorkers, SamplingSettings, ScoreRequest
from megatron_specrl.resync.lifecycle import engines_of, sync_weights
from megatron_specrl.rollout.batch import build_batch
from megatron_specrl.rollout.speculative import RolloutSample

__all__ = ["Probe", "CheckReport", "compare_weights", "make_probe_prompts", "probe_logprobs", "resync",
           "read_engine_weights", "learner_hf_state", "run_check", "check_resync", "logprob_check", "check_resync_main"]

T1 = SamplingSettings(temperature=1.0)

# Mean |engine - learner| log-prob per response token that still counts as "in sync", by engine
# dtype. fp32: the same arithmetic up to summation order (measured mean <= 1e-6). bf16 against the
# fp32 learner, weights exact after the cast, probe of random-token prompts: untrained tiny Llama
# mean 1.0e-3 (max 4e-3 per token), warmed-up tiny Llama mean 1.0e-2..1.7e-2 over 3 seeds (max 0.94
# per token: peaked distributions amplify bf16 activation rounding). 5e-2 leaves ~3x over the worst
# measured mean and stays under a k/v swap (mean 0.19 untrained, 9.2 warmed up). In bf16 the exact
# weight comparison is the sharp check; the log-prob one catches gross errors (mapping, stale KV).
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 5e-2}


def logprob_tol_for(engine_dtype: str) -> float:
    if engine_dtype not in LOGPROB_TOL:
        raise ValueError(f"no log-prob tolerance for engine dtype {engine_dtype!r}; known: {sorted(LOGPROB_TOL)}")
    return LOGPROB_TOL[engine_dtype]


# ----------------------------------------------------------------------------- probe batch
def make_probe_prompts(vocab_size: int, n: int = 8, min_len: int = 40, max_len: int = 72, seed: int = 0,
                       exclude: tuple[int, ...] = ()) -> list[list[int]]:
    """Random-token prompts, long enough (>= one 32-token KV block) to be prefix-cached."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in set(exclude)]
    return [[rng.choice(allowed) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


@dataclass
class Probe:
    """Per response token: the learner's log-prob and the engine's from generate and from score."""
    version: int
    prompts: list[list[int]]
    responses: list[list[int]]
    gen: list[list[float]]
    score: list[list[float]]
    learner: list[list[float]]
    cached: list[int]               # prompt tokens the engine took from its prefix cache

    def diffs(self) -> tuple[torch.Tensor, torch.Tensor]:
        flat = lambda xs: torch.tensor([v for x in xs for v in x], dtype=torch.float64)  # noqa: E731
        ref = flat(self.learner)
        return (flat(self.score) - ref).abs(), (flat(self.gen) - ref).abs()

    def metrics(self) -> dict[str, float]:
        s, g = self.diffs()
        both = torch.maximum(s, g)
        stat = lambda t, f: float(f(t)) if t.numel() else 0.0  # noqa: E731
        return {"resync/logprob_abs_diff": stat(both, torch.mean),
                "resync/logprob_max_abs_diff": stat(both, torch.max),
                "resync/score_logprob_abs_diff": stat(s, torch.mean),
                "resync/gen_logprob_abs_diff": stat(g, torch.mean),
                "resync/probe_tokens": float(both.numel())}

    def token_rows(self) -> list[tuple]:
        """(seq, pos, token, learner, score, gen, |score-l|, |gen-l|) for every response token."""
        rows = []
        for i, (p, r) in enumerate(zip(self.prompts, self.responses)):
            for j, tok in enumerate(r):
                l, s, g = self.learner[i][j], self.score[i][j], self.gen[i][j]
                rows.append((i, len(p) + j, tok, l, s, g, abs(s - l), abs(g - l)))
        return rows

    def train_batch(self, pad_id: int) -> dict[str, torch.Tensor]:
        """The probe as a learner batch (advantages +1/-1 alternating), to make one train step."""
        return _batch(self.prompts, self.responses, pad_id, self.gen,
                      advantages=[1.0 if i % 2 == 0 else -1.0 for i in range(len(self.prompts))])


def _batch(prompts, responses, pad_id, logprobs=None, advantages=None) -> dict[str, torch.Tensor]:
    """The probe as the trainer's learner batch (rollout.batch.build_batch)."""
    samples = [RolloutSample("probe", i, list(p), list(r), list(logprobs[i]) if logprobs else [0.0] * len(r),
                             "stop", 0, -1) for i, (p, r) in enumerate(zip(prompts, responses))]
    adv = torch.tensor(advantages, dtype=torch.float32) if advantages is not None else torch.zeros(len(samples))
    return build_batch(samples, adv, pad_id)


def probe_logprobs(engine, learner, version: int, prompts: list[list[int]], max_new_tokens: int = 16,
                   pad_id: int = 0, seed: int = 0) -> Probe:
    """Engine generates (reading its prefix cache) and re-scores; the learner scores the same tokens."""
    gens = engine.generate([GenerateRequest(p, max_new_tokens, seed=seed + i) for i, p in enumerate(prompts)],
                           T1, version)
    responses = [list(g.token_ids) for g in gens]
    scores = engine.score([ScoreRequest(p, r) for p, r in zip(prompts, responses)], T1, version)
    lp = learner.compute_logprobs(_batch(prompts, responses, pad_id))
    learner_lps = [lp[i, len(p):len(p) + len(r)].tolist() for i, (p, r) in enumerate(zip(prompts, responses))]
    return Probe(version, [list(p) for p in prompts], responses, [list(g.logprobs) for g in gens],
                 [list(s.logprobs) for s in scores], learner_lps, [g.num_cached_tokens for g in gens])


# ----------------------------------------------------------------------------- sync + readout
def _set_skip_cache_reset(actor, flag: bool) -> None:   # runs inside the EngineActor (Ray __ray_call__)
    actor.engine.skip_cache_reset = flag


def set_skip_cache_reset(engine, flag: bool) -> None:
    """Toggle the engines' debug flag (in Ray actors without restarting them)."""
    import ray
    for e in engines_of(engine):
        if isinstance(e, InActor) and e.actor is not None:
            ray.get(e.actor.__ray_call__.remote(_set_skip_cache_reset, flag))
        else:
            e.skip_cache_reset = flag


def resync(learner, engine, version: int, bucket_bytes: int = 64 << 20, miswire: dict[str, str] | None = None,
           skip_cache_reset: bool = False, route=None,
           dtype: str = "float32") -> dict[str, float]:
    """sync_weights with the classic bugs injectable (wrong k/v or gate/up order, no cache reset);
    `route`: the transport to check (resync.routes; None = object store); `dtype`: the engine's."""
    if skip_cache_reset:
        set_skip_cache_reset(engine, True)
    try:
        return sync_weights(learner, engine, version, bucket_bytes, route=route, dtype=dtype, miswire=miswire)
    finally:
        if skip_cache_reset:
            set_skip_cache_reset(engine, False)


def read_engine_weights(engine) -> dict[str, dict[str, torch.Tensor]]:
    """{engine name: {vLLM name: fp32 tensor}} for every engine behind `engine`."""
    out = {}
    # a safetensors blob crosses any process boundary (multiprocess vLLM); with engine TP > 1 each
    # worker holds a shard, merged back into full tensors with the layouts the workers report
    kwargs = {"as_bytes": True, "with_layout": True}
    for e in engines_of(engine):
        if not reads_weights(e):
            raise NotImplementedError(f"engine {e.name} has no weight readout (check-resync --no-weights)")
        if isinstance(e, InActor):   # a Ray engine: the call runs in its actor
            results = e.wait(e.submit("run_in_workers", read_weights_in_worker, kwargs), "read_weights")
        elif isinstance(e, RunsInWorkers):
            results = e.run_in_workers(read_weights_in_worker, kwargs)
        else:
            raise NotImplementedError(f"engine {e.name} ({type(e).__name__}) has no weight readout")
        out[e.name] = merge_tp_shards(results)
    return out


def reads_weights(engine) -> bool:
    """Whether the engine's tensors can be read back: it runs functions in its workers (vLLM's, in-process or
    in a Ray actor). SGLang's scheduler holds the weights in another process that we reach through its
    request API only, so with SGLang check-resync compares log-probs alone."""
    cls = getattr(engine, "engine_cls", type(engine))   # a RayEngine's engine class, else the engine's own
    return isinstance(cls, type) and issubclass(cls, RunsInWorkers)


def learner_hf_state(learner, bucket_bytes: int = 64 << 20, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """The learner's full HF state on the driver, through the same bucket stream a sync uses
    but with the correct mapping: the reference a buggy sync is compared against. With `dtype`
    (the engine's) it is streamed in fp32 and cast here, independently of the sync's own cast."""
    state = _learner_fp32_state(learner, bucket_bytes)
    if dtype is None:
        return state
    from megatron_specrl.resync.buckets import cast_floating, wire_dtype
    dt = wire_dtype(dtype)
    return {n: cast_floating(t, dt) for n, t in state.items()}


def _learner_fp32_state(learner, bucket_bytes: int) -> dict[str, torch.Tensor]:
    from megatron_specrl.learner.worker import LearnerWorker
    if isinstance(learner, LearnerWorker):       # in process (world 1); otherwise a LearnerGroup of Ray actors
        return {n: t.float() if t.is_floating_point() else t for n, t in learner.iter_hf_state()}
    import ray
    from megatron_specrl.resync.buckets import Bucket
    from megatron_specrl.resync.routes import bucket_streams
    rank0, others = bucket_streams(learner, bucket_bytes)
    state = {}
    for ref in rank0:
        state.update(Bucket.from_wire(ray.get(ref)).unflatten())
    for stream in others:
        for _ in stream:
            pass
    return state


# ----------------------------------------------------------------------------- report
@dataclass
class CheckReport:
    version: int
    weight_rows: dict[str, list[WeightRow]]      # engine name -> rows
    probe: Probe | None
    weight_tol: float = 1e-6
    logprob_tol: float = 1e-4
    notes: list[str] = field(default_factory=list)
    engine_dtype: str = "float32"

    @property
    def weight_max_abs(self) -> float:
        return max((r.max_abs for rows in self.weight_rows.values() for r in rows), default=0.0)

    @property
    def logprob_abs_diff(self) -> float:
        return self.probe.metrics()["resync/logprob_abs_diff"] if self.probe else 0.0

    def failures(self) -> list[str]:
        out = [f"{eng}: {r.name} max |diff| {r.max_abs:.3g} > {self.weight_tol:g} {r.note}".rstrip()
               for eng, rows in self.weight_rows.items() for r in rows if not r.ok(self.weight_tol)]
        if self.probe is not None:
            m = self.probe.metrics()
            if not m["resync/probe_tokens"]:   # a mean over nothing is 0: nothing was compared
                out.append("log-prob probe has no response token to compare (every response empty)")
            elif not m["resync/logprob_abs_diff"] <= self.logprob_tol:
                out.append(f"mean |engine - learner| log-prob {m['resync/logprob_abs_diff']:.3g} > {self.logprob_tol:g} "
                           f"(score path {m['resync/score_logprob_abs_diff']:.3g}, generate path "
                           f"{m['resync/gen_logprob_abs_diff']:.3g})")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures()


def run_check(learner, engine, version: int, prompts: list[list[int]] | None, *, compare_tensors: bool = True,
              max_new_tokens: int = 16, pad_id: int = 0, seed: int = 0, bucket_bytes: int = 64 << 20,
              weight_tol: float = 1e-6, logprob_tol: float | None = None,
              engine_dtype: str = "float32") -> CheckReport:
    """Both checks against the engine serving `version` (call after a sync). The engine's weights
    are compared with the learner's cast to `engine_dtype`; `logprob_tol` None = LOGPROB_TOL of it."""
    if logprob_tol is None:
        logprob_tol = logprob_tol_for(engine_dtype)
    rows = {}
    if compare_tensors:
        ref = learner_hf_state(learner, bucket_bytes, dtype=engine_dtype)
        rows = {name: compare_weights(w, ref) for name, w in read_engine_weights(engine).items()}
    probe = probe_logprobs(engine, learner, version, prompts, max_new_tokens, pad_id, seed) if prompts else None
    return CheckReport(version, rows, probe, weight_tol, logprob_tol, engine_dtype=engine_dtype)


def logprob_check(engine, learner, version: int, prompts: list[list[int]], max_new_tokens: int = 32,
                  pad_id: int = 0, engine_dtype: str = "float32") -> dict[str, float]:
    """Trainer hook (trainer.check_resync_every): engine vs learner log-probs on a few prompts at
    the serving version; the probe's sampling seed follows the version, so reruns repeat it. A mean
    difference over the dtype's tolerance (or a probe with no response token) is said on the console
    and logged as resync/logprob_check_failed = 1: an engine serving other weights than the learner's
    trains the policy on another policy's samples, and a metric alone goes unnoticed."""
    from megatron_specrl.rollout.speculative import stable_seed
    if not prompts:
        return {}
    probe = probe_logprobs(engine, learner, version, prompts, max_new_tokens, pad_id,
                           seed=stable_seed("resync-probe", version) % (1 << 31))
    metrics = probe.metrics()
    tol = logprob_tol_for(engine_dtype)
    diff, tokens = metrics["resync/logprob_abs_diff"], metrics["resync/probe_tokens"]
    failed = not tokens or not diff <= tol
    metrics["resync/logprob_check_failed"] = float(failed)
    if failed:
        from rich.console import Console
        what = "no response token to compare" if not tokens else f"mean |engine - learner| log-prob {diff:.3g}"
        Console(stderr=True).print(f"[bold red]resync check at weight version {version}: {what} (tolerance "
                                   f"{tol:g} for a {engine_dtype} engine); the engine may serve other weights "
                                   f"than the learner's: run `megatron-specrl check-resync`[/bold red]")
    return metrics


def print_report(report: CheckReport, console=None, show_tensors: int = 40, show_tokens: int = 16) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    fmt = lambda x: f"{x:.3e}" if math.isfinite(x) else str(x)  # noqa: E731
    for eng, rows in report.weight_rows.items():
        worst = sorted(rows, key=lambda r: -r.max_abs if not math.isnan(r.max_abs) else 0)[:show_tensors]
        t = Table(title=f"weights: {eng} vs learner (version {report.version}; {len(rows)} tensors, "
                        f"worst {len(worst)} shown)")
        for c in ("tensor", "max |diff|", "mean |diff|", "checksum engine", "checksum learner", "note"):
            t.add_column(c, justify="left" if c in ("tensor", "note") else "right")
        for r in worst:
            style = None if r.ok(report.weight_tol) else "bold red"
            t.add_row(r.name, fmt(r.max_abs), fmt(r.mean_abs), f"{r.checksum_engine:.9g}",
                      f"{r.checksum_learner:.9g}", r.note, style=style)
        console.print(t)
    p = report.probe
    if p is not None:
        t = Table(title=f"log-probs per probe sequence (version {report.version})")
        for c in ("seq", "prompt", "cached", "response", "mean |score-l|", "max |score-l|", "mean |gen-l|",
                  "max |gen-l|"):
            t.add_column(c, justify="right")
        for i, (pr, r) in enumerate(zip(p.prompts, p.responses)):
            ds = [abs(a - b) for a, b in zip(p.score[i], p.learner[i])] or [0.0]
            dg = [abs(a - b) for a, b in zip(p.gen[i], p.learner[i])] or [0.0]
            t.add_row(str(i), str(len(pr)), str(p.cached[i]), str(len(r)), fmt(sum(ds) / len(ds)), fmt(max(ds)),
                      fmt(sum(dg) / len(dg)), fmt(max(dg)))
        console.print(t)
        tok = Table(title=f"worst {show_tokens} probe tokens")
        for c in ("seq", "pos", "token", "learner", "engine score", "engine gen", "|score-l|", "|gen-l|"):
            tok.add_column(c, justify="right")
        for row in sorted(p.token_rows(), key=lambda r: -max(r[6], r[7]))[:show_tokens]:
            tok.add_row(*map(str, row[:3]), *(f"{v:.6f}" for v in row[3:6]), fmt(row[6]), fmt(row[7]))
        console.print(tok)
        m = p.metrics()
        console.print(f"log-prob |engine - learner| over {int(m['resync/probe_tokens'])} tokens: mean "
                      f"{m['resync/logprob_abs_diff']:.3e} (tol {report.logprob_tol:g} for a {report.engine_dtype} "
                      f"engine), max {m['resync/logprob_max_abs_diff']:.3e}")
    if report.weight_rows:   # none read back: --no-weights, or an engine without a readout (SGLang)
        console.print(f"weights max |diff| {report.weight_max_abs:.3e} (tol {report.weight_tol:g}; learner weights "
                      f"cast to {report.engine_dtype})")
    else:
        console.print("weights: not compared")
    for n in report.notes:
        console.print(f"[yellow]note:[/] {n}")
    fails = report.failures()
    console.print("[bold green]check-resync PASSED[/]" if not fails else
                  "[bold red]check-resync FAILED[/]\n  " + "\n  ".join(fails))


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-specrl check-resync", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="HF checkpoint dir, or a tiny model (tiny-llama, "
                   "tiny-qwen2, tiny-qwen3, tiny-qwen3-moe)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models); the learner's DP size is "
                   "raised to it when --dp is smaller")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: --ep)")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="the engine to check (SGLang: "
                   "log-probs only, its weights cannot be read back)")
    p.add_argument("--engine-tp", type=int, default=1, help="the engine's tensor parallel size (its workers' "
                   "shards are read and merged)")
    p.add_argument("--train-step", action="store_true", help="one optimizer step on the probe batch before the sync")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of that step")
    p.add_argument("--swap-kv", action="store_true", help="inject a bug: sync k_proj and v_proj swapped")
    p.add_argument("--swap-gate-up", action="store_true", help="inject a bug: sync gate_proj and up_proj swapped")
    p.add_argument("--swap-experts", action="store_true", help="inject a bug: sync experts 0 and 1 of every MoE "
                   "layer swapped")
    p.add_argument("--skip-cache-reset", action="store_true",
                   help="inject a bug: keep the prefix cache across the sync (implies --train-step)")
    p.add_argument("--weight-tol", type=float, default=1e-6)
    p.add_argument("--logprob-tol", type=float, default=None,
                   help=f"mean |engine - learner| log-prob allowed (default by engine dtype: {LOGPROB_TOL})")
    p.add_argument("--engine-dtype", choices=sorted(LOGPROB_TOL), default="float32",
                   help="the engine's dtype: the sync casts to it and the checks expect it")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--transport", choices=["ray", "broadcast"], default="ray", help="how the sync moves the buckets")
    p.add_argument("--no-weights", action="store_true", help="log-prob check only (no tensor readout)")
    p.add_argument("--show-tensors", type=int, default=40)
    p.add_argument("--show-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="engine logs (default: a temporary directory)")
    return p


def _miswire(args) -> dict[str, str] | None:
    """The CLI's bug flags as the one injected renaming (learner.hf_mapping.MISWIRINGS)."""
    from megatron_specrl.learner.hf_mapping import MISWIRINGS
    renames = {k: v for flag, wiring in MISWIRINGS.items() if getattr(args, flag) for k, v in wiring.items()}
    return renames or None


def _model_dir(model: str):
    from megatron_specrl.config import ModelConfig
    from megatron_specrl.models.resolve import resolve_model
    return resolve_model(ModelConfig(path=model, warmup_steps=0), seed=0)


def _prompt_ids_for(model_dir, n: int, seed: int) -> tuple[list[list[int]], int]:
    from transformers import AutoConfig, AutoTokenizer
    cfg = AutoConfig.from_pretrained(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    special = tuple(i for i in (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) if i is not None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return make_probe_prompts(min(cfg.vocab_size, len(tok)), n, seed=seed, exclude=special), pad


def check_resync_main(argv: list[str] | None = None, learner=None, engine=None) -> int:
    """CLI. Exit 0 if weights and log-probs match, 1 if not. `learner` / `engine` reuse
    existing ones (tests); otherwise a LearnerGroup (Ray actors) and a Ray vLLM engine are built."""
    import tempfile

    import ray
    from rich.console import Console

    from megatron_specrl.cluster.actors import build_actors, init_ray
    from megatron_specrl.config import LearnerConfig, RolloutConfig

    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)   # logs and pipes: do not squeeze tensor names to 10 chars
    model_dir = _model_dir(args.model)
    prompts, pad_id = _prompt_ids_for(model_dir, args.num_prompts, args.seed)
    bucket_bytes = args.bucket_mb << 20
    if (learner is None) != (engine is None):
        raise ValueError("pass both a learner and an engine, or neither (then both are built)")
    started_ray = learner is None and init_ray()
    built = None                    # what this call started, and so shuts down
    try:
        if learner is None:
            dp = args.dp or args.ep
            console.print(f"learner: TP={args.tp} x PP={args.pp} x DP={dp} (EP={args.ep}; {args.tp * args.pp * dp} "
                          f"Ray actors), {args.engine} engine TP={args.engine_tp}, {model_dir}")
            built = build_actors(model_dir, LearnerConfig(tp=args.tp, pp=args.pp, dp=dp, ep=args.ep, lr=args.lr),
                                 RolloutConfig(engine=args.engine, kv_cache_gb=0.25, engine_dtype=args.engine_dtype,
                                               engine_tp=args.engine_tp).resolved(), seed=args.seed,
                                 log_dir=args.log_dir or tempfile.mkdtemp(prefix="check-resync-"),
                                 engine_seed=args.seed)
            learner, engine = built.learner, built.engine
        from megatron_specrl.resync.routes import make_route
        report = check_resync(learner, engine, prompts, pad_id=pad_id, train_step=args.train_step,
                              miswire=_miswire(args),
                              skip_cache_reset=args.skip_cache_reset, route=make_route(args.transport),
                              compare_tensors=not args.no_weights,
                              max_new_tokens=args.max_new_tokens, seed=args.seed, bucket_bytes=bucket_bytes,
                              weight_tol=args.weight_tol, logprob_tol=args.logprob_tol,
                              engine_dtype=args.engine_dtype)
        print_report(report, console, args.show_tensors, args.show_tokens)
        return 0 if report.passed else 1
    finally:
        if built is not None:
            built.shutdown()
        if started_ray:
            ray.shutdown()


def check_resync(learner, engine, prompts, *, pad_id: int = 0, train_step: bool = False,
                 miswire: dict[str, str] | None = None, skip_cache_reset: bool = False, route=None,
                 **check_kwargs) -> CheckReport:
    """The CLI's sequence: probe (warms the prefix cache) -> optional train step -> resync (bugs
    injectable) -> both checks on the same prompts."""
    version = engine.weight_version
    seed = check_kwargs.get("seed", 0)
    notes = []
    before = probe_logprobs(engine, learner, version, prompts, check_kwargs.get("max_new_tokens", 16), pad_id, seed)
    if skip_cache_reset and not train_step:
        train_step = True
        notes.append("--skip-cache-reset implies --train-step (stale KV only differs under new weights)")
    if train_step:
        batch = before.train_batch(pad_id)
        learner.train_step(batch)
        after = learner.compute_logprobs(batch)
        moved = ((after - batch["old_logprobs"]).abs() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        notes.append(f"the train step moved the learner's probe log-probs by {float(moved):.3e} on average")
    resync(learner, engine, version + 1, check_kwargs.get("bucket_bytes", 64 << 20), miswire=miswire,
           skip_cache_reset=skip_cache_reset, route=route,
           dtype=check_kwargs.get("engine_dtype", "float32"))
    blind = [e.name for e in engines_of(engine) if not reads_weights(e)]
    if check_kwargs.get("compare_tensors", True) and blind:
        check_kwargs["compare_tensors"] = False
        notes.append(f"no weight readout from {', '.join(blind)} (SGLang's weights live in its scheduler process): "
                     "the log-prob check alone")
    report = run_check(learner, engine, version + 1, prompts, pad_id=pad_id, **check_kwargs)
    report.notes = notes + report.notes
    return report


if __name__ == "__main__":
    sys.exit(check_resync_main(sys.argv[1:]))
