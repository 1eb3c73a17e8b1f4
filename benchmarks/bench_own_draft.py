"""Drafted generation at fixed weights, side by side: own drafts, tree drafts, plain decoding.

bench-rollout measures rollouts under training, where the weights move every step and its timings
move 15-30% between runs. This isolates the decode loop: one in-process engine with tree drafting
on a warmed-up model, 16 prompts x 8 samples of the model's task; a first round gives every sample
an "old" response (and fills the prompts' trees), then each round generates all 128 again under
three arms, in alternating order (ABC CBA ...), with fresh seeds:

- `own`:   rollout.verify=decode: each sample drafts its own old response while it follows it,
           then the prompt's tree (GenerateRequest.own_draft);
- `tree`:  rollout.draft=tree alone (the tree's most frequent path);
- `plain`: no drafts.

All arms are exact samples of the same policy (tests/integration/engines/test_tree_drafting.py); the script prints the
median seconds per generation, engine steps, drafted and accepted tokens, requests running per engine
step (how much of the loop is the batch's tail), the ratios to `plain`, and for the drafting arms the
fitted cost of a decode step (ms = a + b x requests + c x draft tokens, as bench-rollout prints it).

    python benchmarks/bench_own_draft.py --model ~/.cache/megatron_specrl/warmup/warmup-<hash> [--rounds 12]
        [--profile tree]    # cProfile that arm's generations (its timings then include the profiler)
        [--temperature 0]   # greedy: `own` then drafts exactly what it will generate (every draft token
                            # accepted), so own / plain is the most any drafter can gain on this machine

The model: a warm-up checkpoint (the first `megatron-specrl bench-rollout` run writes one; its
warmup.json names the task, which sets the prompts here).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ARMS = ("own", "tree", "plain")


def arm_counts(drafter_stats: dict, results) -> dict:
    """A generation's counts: the tree drafter's, which count only the steps where a request that opted
    in to drafting ran; for an arm whose requests did not (`plain`), the steps follow from the outputs,
    one token a request and step: the longest output's length in engine steps (as bench-rollout counts
    `off`'s decode steps) and every output token a request-step."""
    out = dict(drafter_stats)
    if not out.get("engine_steps"):
        lengths = [len(r.token_ids) for r in results]
        out["engine_steps"] = float(max(lengths, default=0))
        out["request_steps"] = float(sum(lengths))
        out["generated_tokens"] = float(sum(lengths))
    return out


# vLLM's phases of an engine step, timed with --phases (the engine runs in this process): (class path, method, label)
PHASES = (
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "execute_model", "model forward (execute_model)"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_sample", "sampling / rejection sampling"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "propose_draft_token_ids", "drafter (propose_draft_token_ids)"),
    ("vllm.v1.core.sched.scheduler.Scheduler", "schedule", "scheduler: schedule"),
    ("vllm.v1.core.sched.scheduler.Scheduler", "update_from_output", "scheduler: update_from_output"),
    ("vllm.v1.engine.output_processor.OutputProcessor", "process_outputs", "output processing"),
)


def time_phases(totals: dict) -> None:
    """Wrap each PHASES method so that its wall-clock seconds add up in totals[label]. Wall clock, not
    cProfile: a profiler inflates vLLM's many small Python calls and so misstates their share."""
    import importlib

    for path, name, label in PHASES:
        module, cls_name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), cls_name)
        inner = getattr(cls, name)

        def timed(*a, _inner=inner, _label=label, **k):
            t = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - t
        setattr(cls, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="warm-up checkpoint dir (HF format, with warmup.json)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--profile", choices=ARMS, help="cProfile this arm's generations; print the top functions")
    ap.add_argument("--profile-out", help="also write the profile here (pstats format) to sort it other ways")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="0: greedy, so `own` drafts its exact output (a perfect drafter's ceiling)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the engine's dtype (rollout.engine_dtype); bfloat16 uses AMX where the CPU has it")
    ap.add_argument("--draft-tokens", type=int, default=16, help="rollout.drafter.tokens: the longest draft")
    ap.add_argument("--token-budget", type=int, default=2048,
                    help="rollout.drafter.token_budget: about how many draft tokens a step verifies")
    ap.add_argument("--min-prob", type=float, default=0.1, help="rollout.drafter.min_prob")
    ap.add_argument("--phases", action="store_true",
                    help="also print each arm's wall-clock ms per generation in vLLM's step phases (forward, "
                         "sampling, drafter, scheduler, output processing)")
    args = ap.parse_args()
    model = Path(args.model).expanduser()
    if not (model / "warmup.json").is_file():
        raise SystemExit(f"--model {model}: no warmup.json there (pass a dir under ~/.cache/megatron_specrl/warmup/)")

    from transformers import AutoTokenizer

    from megatron_specrl.data.synthetic import make_problems
    from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings
    from megatron_specrl.rollout.tree_drafting.cost_model import STEP_COST_SUMS, fit_step_cost
    from megatron_specrl.engines.vllm import VLLMEngine

    task = json.loads((model / "warmup.json").read_text())["task"]
    tok = AutoTokenizer.from_pretrained(str(model))
    problems = make_problems(args.prompts, 5, task["min_terms"], task["max_terms"], task["max_value"])
    prompts = [tok(p.prompt)["input_ids"] for p in problems]
    sampling = SamplingSettings(temperature=args.temperature)
    L, n = args.max_new_tokens, args.samples
    with tempfile.TemporaryDirectory() as tmp:
        engine = VLLMEngine(str(model), name="bench-own", seed=0, max_model_len=256, kv_cache_gb=1.0, draft="tree",
                            dtype=args.dtype, drafter={"tokens": args.draft_tokens, "token_budget": args.token_budget,
                                                       "min_prob": args.min_prob},
                            log_dir=Path(tmp) / "logs")

        def requests(arm: str, seed0: int, old=None):
            return [GenerateRequest(p, L, seed=seed0 + i * n + k, draft_key=None if arm == "plain" else f"p{i}",
                                    response_start=len(p),
                                    own_draft=list(old[i * n + k].token_ids) if arm == "own" else None)
                    for i, p in enumerate(prompts) for k in range(n)]

        old = engine.generate(requests("tree", 0), sampling, 0)
        engine.generate(requests("tree", 500), sampling, 0)
        engine.draft_stats()
        profile = cProfile.Profile() if args.profile else None
        phase_totals: dict[str, float] = {}
        phases = {a: {} for a in ARMS}
        if args.phases:
            time_phases(phase_totals)
        times = {a: [] for a in ARMS}
        stats = {a: [] for a in ARMS}
        for r in range(args.rounds):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                before = dict(phase_totals)
                t = time.perf_counter()
                if arm == args.profile:
                    profile.enable()
                results = engine.generate(requests(arm, 10_000 * (r + 1), old), sampling, 0)
                if arm == args.profile:
                    profile.disable()
                times[arm].append(time.perf_counter() - t)
                for label, total in phase_totals.items():
                    phases[arm][label] = phases[arm].get(label, 0.0) + total - before.get(label, 0.0)
                stats[arm].append(arm_counts(engine.draft_stats(), results))
        engine.shutdown()

    plain = statistics.median(times["plain"])
    print(f"{args.prompts} prompts x {n} samples, <= {L} tokens, temperature {args.temperature:g}, "
          f"{args.rounds} rounds per arm (median):")
    for arm in ARMS:
        med = statistics.median(times[arm])

        def mean(key):
            return statistics.mean(s.get(key, 0.0) for s in stats[arm])

        print(f"  {arm:6s} {med * 1000:7.0f} ms  {plain / med:4.2f}x plain  engine steps {mean('engine_steps'):5.1f}  "
              f"drafted {mean('draft_tokens'):7.0f} (own {mean('own_draft_tokens'):6.0f})  "
              f"accepted {mean('accepted_tokens'):6.0f}  requests running / step "
              f"{mean('request_steps') / max(mean('engine_steps'), 1):5.1f}")
        if mean('draft_s'):
            print(f"         drafter {1000 * mean('draft_s'):.0f} ms of the {1000 * mean('loop_s'):.0f} ms decode loop, "
                  f"{1e6 * mean('draft_s') / max(mean('request_steps'), 1):.1f} us per request-step")
        fit = fit_step_cost({k: sum(s.get(k, 0.0) for s in stats[arm]) for k in STEP_COST_SUMS})
        if fit is not None:
            print(f"         decode step cost (fit over its steps): {fit[0]:.1f} ms + {fit[1]:.3f} ms x requests + "
                  f"{fit[2]:.4f} ms x draft tokens")

    if args.phases:
        print(f"wall-clock ms per generation in vLLM's step phases (means of {args.rounds}; the rest of a generation "
              "is request intake, prefill bookkeeping and LLM.generate's loop):")
        for arm in ARMS:
            mean_s = statistics.mean(times[arm])
            parts = ", ".join(f"{label} {1000 * phases[arm].get(label, 0.0) / args.rounds:.1f}"
                              for _, _, label in PHASES)
            print(f"  {arm:6s} {1000 * mean_s:6.1f}: {parts}")

    if profile is not None:
        print(f"cProfile of `{args.profile}` ({args.rounds} generations), by own time:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        if args.profile_out:
            profile.dump_stats(args.profile_out)


if __name__ == "__main__":
    main()
