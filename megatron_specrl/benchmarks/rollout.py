"""`megatron-specrl bench-rollout`: the same RL run under every rollout mode, side by side.

Modes: `off` (plain generation), `exact` and `lenient` (last epoch's response verified in one
prefill, decoded from the first rejection), `coupled` (the same, every (prompt, sample) drawn with
position-keyed noise kept across epochs: exact samples, reused where the argmax survives), `tree`
(plain generation with speculative decoding from per-prompt trees of earlier responses inside
vLLM), and `exact+tree` / `lenient+tree` / `coupled+tree` (both); `exact+tree+decode` verifies
last epoch's response inside the decode loop, as the sample's own draft (rollout.verify=decode).
Same recipe, seed and data order for each mode, run one after another in one process; a small
dataset so every prompt comes back each epoch (drafts exist from epoch 2 on). Per epoch it
reports rollout seconds, reuse ratio, generated tokens per request per decode step, decode steps
per rollout, verification seconds, rollout reward and held-out greedy accuracy (what the policy
learned, which rollout reward alone hides: lenient reuses old, possibly better, samples), and the
rollout-time ratio against `off`. `--seeds N` repeats everything over N seeds and prints each
summary's spread, so "within noise" has a number. `--engines vllm,sglang` runs every mode through each
engine side by side (modes labelled `exact@sglang`, each compared with its own engine's `off`); an engine
runs the modes it can on this machine (ENGINE_KINDS: SGLang on a CPU runs `off`, `exact` and `lenient`,
drafting nothing and without coupled noise) and the others are listed as skipped.

The default recipe is tiny-cpu-grpo-long (~67-token worked traces): with the ~27-token traces of
tiny-cpu-grpo, a rollout on this CPU is mostly fixed per-request cost rather than decoding, which
is not the regime RLVR runs in.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from megatron_specrl.rollout.tree_drafting.cost_model import STEP_COST_SUMS, fit_step_cost

MODES = ("off", "exact", "lenient", "coupled", "tree", "exact+tree", "lenient+tree", "coupled+tree")
STEADY_FROM_EPOCH = 3


RUNAHEAD_REQUESTS = 64   # the `+runahead` modes: run-ahead requests per rollout


def mode_overrides(mode: str, draft_model: str | None = None) -> list[str]:
    """`exact+tree` -> spec_mode=exact, draft=tree; `tree` alone is plain generation with tree drafts;
    `exact+tree+decode` verifies last epoch's responses inside the decode loop (rollout.verify=decode)
    instead of in a prefill; `+runahead` (with tree drafting) adds RUNAHEAD_REQUESTS run-ahead requests
    per rollout, so a mode with and without it measures run-ahead's gain on its own; `+noshared` drafts
    from each prompt's own tree only (rollout.drafter.shared_nodes=0), which measures the shared tree's;
    `+pytrees` keeps the trees in pure Python (rollout.drafter.impl=python: the same drafts, so the same
    tokens), which measures the compiled trees' gain; `+nocalib` drafts from the trees' raw frequencies
    (rollout.drafter.calibrate=false), which measures the calibration's; `+nocost` sizes drafts by the token
    budget and min_prob alone (rollout.drafter.cost_model=false), which measures the cost model's. `model` / `exact+model` draft
    from a draft model (rollout.draft=model; its rollout.draft_model among the overrides). Not in the
    default list."""
    spec, *extras = mode.split("+")
    if spec == "model":
        spec, extras = "off", ["model", *extras]
    if extras == ["model"] and spec in ("off", "exact", "lenient", "coupled"):   # a draft model drafts
        if not draft_model:
            raise SystemExit(f"bench mode {mode!r} drafts from a draft model: pass --draft-model (an HF directory "
                             "with the policy's tokenizer, or a tiny model's name for the frozen starting policy)")
        return [f"rollout.spec_mode={spec}", "rollout.draft=model", "rollout.runahead=0", "rollout.verify=prefill",
                f"rollout.draft_model={draft_model}"]
    if spec == "tree":
        spec, extras = "off", ["tree", *extras]
    decode = spec == "exact" and extras[:2] == ["tree", "decode"]
    rest = [e for e in extras if e != "decode"] if decode else extras
    flags = []
    while rest[1:] and rest[-1] in ("noshared", "pytrees", "nocalib", "nocost") and rest[-1] not in flags:
        flags.append(rest.pop())
    known = spec in ("off", "exact", "lenient", "coupled") and rest in ([], ["tree"], ["tree", "runahead"])
    if not known:
        raise SystemExit(f"unknown bench mode {mode!r}; modes: {', '.join(MODES)}, exact+tree+decode, any "
                         "+tree mode with +runahead, then any of +noshared, +pytrees, +nocalib, +nocost; `model` and "
                         "exact/lenient/coupled+model (rollout.draft=model: pass rollout.draft_model=...)")
    runahead = RUNAHEAD_REQUESTS if "runahead" in rest else 0
    out = [f"rollout.spec_mode={spec}", f"rollout.draft={'tree' if rest else 'none'}", f"rollout.runahead={runahead}",
           f"rollout.verify={'decode' if decode else 'prefill'}"]
    return (out + (["rollout.drafter.shared_nodes=0"] if "noshared" in flags else [])
            + (["rollout.drafter.impl=python"] if "pytrees" in flags else [])
            + (["rollout.drafter.calibrate=false"] if "nocalib" in flags else [])
            + (["rollout.drafter.cost_model=false"] if "nocost" in flags else []))


def split_label(label: str) -> tuple[str, str | None]:
    """`exact+tree@sglang` -> ("exact+tree", "sglang"); a label without an engine runs the recipe's."""
    mode, _, engine = label.partition("@")
    return mode, engine or None


def off_of(label: str) -> str:
    """The `off` run a mode is compared with: its own engine's."""
    _, engine = split_label(label)
    return "off" if engine is None else f"off@{engine}"


def engine_modes(engine: str, modes: list[str], draft_model: str | None = None,
                 on_gpu: bool | None = None) -> tuple[list[str], list[str]]:
    """(modes the engine runs here, modes it skips), from its row of ENGINE_KINDS: the drafts it builds
    with on this device, coupled noise, run-ahead requests."""
    from megatron_specrl.engines.protocol import ENGINE_KINDS
    if engine not in ENGINE_KINDS:
        raise SystemExit(f"unknown engine {engine!r}; engines: {', '.join(ENGINE_KINDS)}")
    if on_gpu is None:
        import torch
        on_gpu = torch.cuda.is_available()
    kind = ENGINE_KINDS[engine]
    ok, skipped = [], []
    for m in modes:
        o = dict(x.split("=", 1) for x in mode_overrides(m, draft_model))
        runs = (o["rollout.draft"] in (kind.drafts if on_gpu else kind.cpu_drafts)
                and (o["rollout.spec_mode"] != "coupled" or kind.samples_coupled)
                and (o["rollout.runahead"] == "0" or kind.runs_ahead))
        (ok if runs else skipped).append(m)
    return ok, skipped


def _parse(argv):
    p = argparse.ArgumentParser(prog="megatron-specrl bench-rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config key=value overrides (recipe keys)")
    p.add_argument("--recipe", default="tiny-cpu-grpo-long")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--prompts", type=int, default=32, help="dataset size (prompts per epoch)")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--engines", default=None,
                   help="comma-separated rollout.engine values run side by side (vllm,sglang), each over the "
                        "modes it runs on this machine; default: the recipe's engine, modes unlabelled")
    p.add_argument("--draft-model", default=None,
                   help="the `model` modes' rollout.draft_model: an HF directory with the policy's tokenizer, or a "
                        "tiny model's name (its warm-up included: the frozen starting policy)")
    p.add_argument("--seeds", type=int, default=1, help="repeat over trainer.seed = base, base+1, ...")
    p.add_argument("--seed", type=int, default=None, help="base seed (default: the recipe's trainer.seed)")
    p.add_argument("--eval-prompts", type=int, default=128,
                   help="held-out prompts for greedy accuracy at the start and after every epoch (0: off)")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--json", dest="json_path", default=None, help="write per-epoch results and a summary here")
    p.add_argument("--plot", dest="plot_path", default=None,
                   help="write a PNG of the curves here (every seed's; with --seeds > 1 their mean too)")
    return p.parse_args(argv)


def per_epoch(rows: list[dict], steps_per_epoch: int, verify_in_decode: bool = False) -> list[dict]:
    """Sum the step rows of each epoch; `eval_accuracy` is the eval logged at the epoch's last step.
    `verify_in_decode`: the run verified its drafts in the decode loop (rollout.verify=decode)."""
    steps = [r for r in rows if "spec/rollout_s" in r]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    epochs = []
    for e in range(math.ceil(len(steps) / steps_per_epoch)):
        chunk = steps[e * steps_per_epoch:(e + 1) * steps_per_epoch]
        total = lambda k: sum(r.get(k, 0.0) for r in chunk)
        response_tokens = sum(r.get("response/mean_len", 0.0) for r in chunk)
        generated = total("spec/generated_tokens")
        # verified in a prefill (exact, coupled), a rejected draft's first new token is the verification's
        # draw: a response token, not reused, that spec/generated_tokens (the extension's) leaves out; in
        # the decode loop the engine samples it, so it is among the generated tokens already
        replaced = 0.0 if verify_in_decode else total("spec/replaced_tokens")
        # tokens per request per decode step: counted by the tree proposer; 1 without drafting
        # (a draft model: vLLM counts request-steps that verified a draft, each giving its accepted
        # draft tokens and one sampled token; every running request drafts, so nearly all of them)
        request_steps = total("tree/request_steps") or total("draft_model/drafts")
        drafted_tokens = (total("tree/generated_tokens")
                          or total("draft_model/accepted_tokens") + total("draft_model/drafts"))
        epochs.append({
            "epoch": e + 1,
            "rollouts": len(chunk),
            # generation rounds: DAPO's dynamic sampling rolls out up to max_sampling_tries batches a step
            # (every per-step figure here sums them); one a step otherwise
            "rounds": total("dapo/rounds") or len(chunk),
            "rollout_s": total("spec/rollout_s"),
            "verify_s": total("spec/verify_s"),
            "generate_s": total("spec/extend_s"),     # the engine's generation call(s)
            "loop_s": total("tree/loop_s"),           # tree drafting: its decode loop, first to last step
            "draft_s": total("tree/draft_s"),         # tree drafting: the drafter's own time
            "draft_tokens": total("tree/draft_tokens") + total("draft_model/draft_tokens"),
            "draft_accepted": total("tree/accepted_tokens") + total("draft_model/accepted_tokens"),
            # sums of the decode-step cost fit (tree drafting): ms = a + b requests + c draft tokens
            "step_cost_sums": {k: total(f"tree_cost/{k.removeprefix('cost_')}") for k in STEP_COST_SUMS},
            # requests running in a decode step, summed over steps (one token each without drafts)
            "request_steps": request_steps or generated,
            # the engine's requests (tree drafting counts them; without it every sample is one)
            "requests": total("tree/requests") or total("spec/samples"),
            "generated_tokens": generated,
            "accepted_tokens": total("spec/accepted_tokens"),
            "replaced_tokens": replaced,
            "reuse_ratio": total("spec/accepted_tokens") / max(total("spec/accepted_tokens") + generated + replaced, 1),
            "tokens_per_step": drafted_tokens / request_steps if request_steps else 1.0,
            "decode_steps": total("spec/decode_steps") / len(chunk),
            "reward": sum(r.get("reward/mean", 0.0) for r in chunk) / len(chunk),
            "mean_response_len": response_tokens / len(chunk),
            "eval_accuracy": evals.get(chunk[-1].get("step")),
        })
    return epochs


def summarize(results: dict[str, list[dict]]) -> dict[str, float]:
    """Steady state (epochs >= STEADY_FROM_EPOCH): per mode rollout seconds, speedup vs off, reuse,
    tokens per decode step, decode steps per rollout, verification share of off's rollout time;
    mean reward over all epochs; the final held-out accuracy."""
    steady = {m: [e for e in eps if e["epoch"] >= STEADY_FROM_EPOCH] for m, eps in results.items()}
    secs = {m: sum(e["rollout_s"] for e in eps) for m, eps in steady.items()}
    summary = {}
    for m, eps in steady.items():
        acc = sum(e["accepted_tokens"] for e in eps)
        gen = sum(e["generated_tokens"] + e.get("replaced_tokens", 0.0) for e in eps)
        summary[f"reuse_ratio_{m}"] = acc / max(acc + gen, 1)
        summary[f"rollout_s_{m}"] = secs[m]
        # generated tokens per request-step over the steady epochs: their sums' ratio (each epoch's ratio
        # weighted by its request-steps), as reuse and every other ratio here, not a mean of epoch ratios
        request_steps = sum(e["request_steps"] for e in eps)
        summary[f"tokens_per_step_{m}"] = (
            sum(e["tokens_per_step"] * e["request_steps"] for e in eps) / request_steps if request_steps
            else sum(e["tokens_per_step"] for e in eps) / max(len(eps), 1))
        summary[f"decode_steps_{m}"] = sum(e["decode_steps"] for e in eps) / max(len(eps), 1)
        summary[f"verify_s_{m}"] = sum(e["verify_s"] for e in eps)
        # where the time goes, per rollout: verification, the generation call (of which the decode
        # loop and the drafter, when drafting from trees), and the driver's own work (the rest)
        n = max(sum(e["rollouts"] for e in eps), 1)
        summary[f"rounds_per_step_{m}"] = sum(e.get("rounds", e["rollouts"]) for e in eps) / n
        generate = sum(e["generate_s"] for e in eps)
        for key in ("verify_s", "generate_s", "loop_s", "draft_s"):
            summary[f"per_rollout_{key}_{m}"] = sum(e[key] for e in eps) / n
        summary[f"per_rollout_other_s_{m}"] = (secs[m] - summary[f"verify_s_{m}"] - generate) / n
        steps = sum(e["decode_steps"] * e["rollouts"] for e in eps)
        summary[f"ms_per_decode_step_{m}"] = 1000 * generate / max(steps, 1)
        # how full the batch is: a rollout's requests running per decode step, on average; drafts
        # finish most requests in a few steps and leave the rest of the steps to the batch's tail
        summary[f"running_per_step_{m}"] = sum(e["request_steps"] for e in eps) / max(steps, 1)
        # steps a request ran, on average, against the decode steps the batch took: the gap is its tail
        requests = sum(e.get("requests", 0.0) for e in eps)
        if requests:
            summary[f"steps_per_request_{m}"] = sum(e["request_steps"] for e in eps) / requests
        fit = fit_step_cost({k: sum(e.get("step_cost_sums", {}).get(k, 0.0) for e in eps) for k in STEP_COST_SUMS})
        if fit is not None:
            for name, value in (("ms", fit.a), ("ms_per_request", fit.b), ("ms_per_draft_token", fit.c),
                                ("ms_per_draft_token_error", fit.c_error), ("residual_ms", fit.residual_ms)):
                summary[f"step_cost_{name}_{m}"] = value
        draft_s = sum(e["draft_s"] for e in eps)
        if draft_s:
            # the drafter runs on the engine's critical path between two forwards: what it costs per
            # request and step says how much of a (much shorter) GPU decode step it would take
            summary[f"draft_us_per_request_step_{m}"] = 1e6 * draft_s / max(sum(e["request_steps"] for e in eps), 1)
        drafted = sum(e["draft_tokens"] for e in eps)
        if drafted:
            summary[f"draft_accept_rate_{m}"] = sum(e["draft_accepted"] for e in eps) / drafted
        summary[f"reward_{m}"] = sum(e["reward"] for e in results[m]) / max(len(results[m]), 1)
        if results[m] and results[m][-1].get("eval_accuracy") is not None:
            summary[f"final_eval_accuracy_{m}"] = results[m][-1]["eval_accuracy"]
    # against the same engine's `off`, and over every epoch, the first ones too: what a run of as many epochs
    # gains (the first epoch has no earlier rollouts to draft from; many RLVR runs see their data once or twice)
    total = {m: sum(e["rollout_s"] for e in eps) for m, eps in results.items()}
    for m in secs:
        off = off_of(m)
        if off not in secs:
            continue
        if m != off and secs[m] > 0:
            summary[f"speedup_{m}"] = secs[off] / secs[m]
            summary[f"speedup_all_epochs_{m}"] = total[off] / max(total[m], 1e-9)
        if secs[off] > 0:
            summary[f"verify_share_{m}"] = summary[f"verify_s_{m}"] / secs[off]
    summary["steady_from_epoch"] = STEADY_FROM_EPOCH
    return summary


def spread(summaries: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per summary key across seeds: mean, min, max."""
    keys = [k for k in summaries[0] if all(k in s for s in summaries)]
    return {k: {"mean": statistics.fmean(s[k] for s in summaries), "min": min(s[k] for s in summaries),
                "max": max(s[k] for s in summaries)} for k in keys}


PLOT_PANELS = (("rollout_s", "rollout seconds / epoch"), ("reuse_ratio", "reuse ratio"),
               ("reward", "mean rollout reward"), ("eval_accuracy", "held-out greedy accuracy"))


def plot_series(runs: list[dict]) -> dict[str, dict[str, list[tuple[int, list[int], list[float]]]]]:
    """Per panel key (PLOT_PANELS) and mode: one (seed, epochs, values) series per seed, from the
    runs as the JSON holds them ({"seed", "epochs": {mode: per-epoch rows}}); a missing value (an
    epoch without an eval) is NaN, which matplotlib leaves as a gap."""
    out: dict[str, dict[str, list]] = {key: {} for key, _ in PLOT_PANELS}
    for run in runs:
        for m, eps in run["epochs"].items():
            x = [e["epoch"] for e in eps]
            for key, _ in PLOT_PANELS:
                y = [math.nan if e.get(key) is None else float(e[key]) for e in eps]
                out[key].setdefault(m, []).append((run["seed"], x, y))
    return out


def plot(runs: list[dict], path: str):
    """Every seed's curves, one colour per mode: with one seed its line; with more, each seed's line
    thin and the mean over seeds (per epoch) bold, labelled. Returns the (closed) figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = plot_series(runs)
    n_seeds = len(runs)
    fig, axes = plt.subplots(1, len(PLOT_PANELS), figsize=(17, 3.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes, PLOT_PANELS):
        for i, (m, per_seed) in enumerate(series[key].items()):
            colour = colours[i % len(colours)]
            if n_seeds == 1:
                (_, x, y), = per_seed
                ax.plot(x, y, marker="o", color=colour, label=m)
                continue
            for seed, x, y in per_seed:
                ax.plot(x, y, color=colour, alpha=0.35, linewidth=1, gid=f"{m}/seed{seed}")
            epochs = sorted({e for _, x, _ in per_seed for e in x})
            mean = []
            for e in epochs:
                vals = [y[x.index(e)] for _, x, y in per_seed if e in x and not math.isnan(y[x.index(e)])]
                mean.append(statistics.fmean(vals) if vals else math.nan)
            ax.plot(epochs, mean, marker="o", color=colour, linewidth=2, label=f"{m} (mean)", gid=f"{m}/mean")
        ax.set_title(title if n_seeds == 1 else f"{title} ({n_seeds} seeds)")
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def run_mode(args, mode: str, seed: int, root: Path, steps_per_epoch: int, console: Console) -> list[dict]:
    from megatron_specrl.config import load_config, resolve_recipe
    from megatron_specrl.metrics.sinks import read_metrics
    from megatron_specrl.trainer import train

    spec, engine = split_label(mode)
    out = root / f"seed{seed}" / mode.replace("+", "-").replace("@", "-")
    cfg = load_config(resolve_recipe(args.recipe), [
        *args.overrides, *mode_overrides(spec, args.draft_model), *([f"rollout.engine={engine}"] if engine else []),
        f"output_dir={out}", f"trainer.seed={seed}",
        f"data.num_synthetic={args.prompts}", f"trainer.prompts_per_step={args.prompts_per_step}",
        f"trainer.total_steps={steps_per_epoch * args.epochs}", "trainer.resume=never",
        "trainer.checkpoint_every=0", f"trainer.eval_every={steps_per_epoch if args.eval_prompts else 0}",
        f"data.num_eval={args.eval_prompts}", "trainer.export_hf=false", f"trainer.rollout_data_dir={out / 'rollouts'}",
        "logging.wandb=false", "logging.plots=false",
    ])
    shutil.rmtree(out, ignore_errors=True)      # a re-run of the bench replaces its own scratch run
    train(cfg)
    epochs = per_epoch(read_metrics(out / "metrics.jsonl"), steps_per_epoch,
                       verify_in_decode=cfg.rollout.verify == "decode")
    for e in epochs:
        acc = "-" if e["eval_accuracy"] is None else f"{e['eval_accuracy']:.3f}"
        console.print(f"seed {seed} {mode:>14} epoch {e['epoch']}: rollout {e['rollout_s']:.2f}s, reuse "
                      f"{e['reuse_ratio']:.2f}, {e['tokens_per_step']:.2f} tok/step, {e['decode_steps']:.0f} "
                      f"decode steps, verify {e['verify_s']:.2f}s, reward {e['reward']:.3f}, eval {acc}")
    return epochs


def epoch_table(results: dict[str, list[dict]], modes: list[str], args, steps_per_epoch: int, seed: int) -> Table:
    table = Table(title=f"seed {seed}: rollout per epoch ({args.prompts} prompts, {steps_per_epoch} steps/epoch)")
    for col in ["epoch", *[f"{m} s" for m in modes], *[f"{m} reuse" for m in modes if m != "off"],
                *([f"{m} eval" for m in modes] if args.eval_prompts else []),
                *[f"{off_of(m)}/{m}" for m in modes if m != off_of(m) and off_of(m) in modes]]:
        table.add_column(col, justify="right")
    for i in range(args.epochs):
        row = [str(i + 1)]
        row += [f"{results[m][i]['rollout_s']:.2f}" for m in modes]
        row += [f"{results[m][i]['reuse_ratio']:.2f}" for m in modes if m != "off"]
        if args.eval_prompts:
            row += ["-" if results[m][i]["eval_accuracy"] is None else f"{results[m][i]['eval_accuracy']:.3f}"
                    for m in modes]
        row += [f"{results[off_of(m)][i]['rollout_s'] / max(results[m][i]['rollout_s'], 1e-9):.2f}x"
                for m in modes if m != off_of(m) and off_of(m) in modes]
        table.add_row(*row)
    return table


def summary_table(spreads: dict[str, dict[str, float]], modes: list[str], n_seeds: int) -> Table:
    def cell(key, fmt="{:.2f}"):
        if key not in spreads:
            return "-"
        v = spreads[key]
        text = fmt.format(v["mean"])
        return text if n_seeds == 1 else f"{text} [{fmt.format(v['min'])}-{fmt.format(v['max'])}]"

    table = Table(title=f"summary, epochs {STEADY_FROM_EPOCH}+ ({n_seeds} seed{'s' if n_seeds > 1 else ''}: "
                        "mean [min-max])")
    for col in ["mode", "speedup vs off", "all epochs", "reuse", "tok/step", "decode steps/rollout",
                "verify / off rollout", "reward", "held-out acc."]:
        table.add_column(col, justify="right")
    for m in modes:
        base = m == off_of(m)
        table.add_row(m, "1" if base else cell(f"speedup_{m}", "{:.2f}x"),
                      "1" if base else cell(f"speedup_all_epochs_{m}", "{:.2f}x"), cell(f"reuse_ratio_{m}"),
                      cell(f"tokens_per_step_{m}"), cell(f"decode_steps_{m}", "{:.1f}"),
                      cell(f"verify_share_{m}", "{:.1%}"), cell(f"reward_{m}", "{:.3f}"),
                      cell(f"final_eval_accuracy_{m}", "{:.3f}"))
    return table


def time_table(spreads: dict[str, dict[str, float]], modes: list[str], n_seeds: int) -> Table:
    """Where a rollout's time goes (seconds per rollout, epochs STEADY_FROM_EPOCH on, mean over seeds):
    verification, the engine's generation call and, with tree drafting, its decode loop and the
    drafter inside it; the call less the loop is request intake, the first prefill and outputs;
    `other` is the driver's own work. Milliseconds per decode step = generation call / decode steps;
    steps per request (the engine steps a request ran, on average) against the decode steps, and
    requests running per step, show how much of the loop serves the batch's tail; with tree drafting,
    what a decode step costs, fitted over its steps: ms = a + b x requests + c x draft tokens; and the
    drafter's own microseconds per request and decode step (it runs between two forwards: on a GPU,
    whose decode steps are far shorter than this CPU's, it decides whether drafting pays)."""
    def cell(key, fmt="{:.3f}"):
        return fmt.format(spreads[key]["mean"]) if key in spreads else "-"

    table = Table(title=f"where the time goes, seconds per rollout, epochs {STEADY_FROM_EPOCH}+ "
                        f"(mean of {n_seeds} seed{'s' if n_seeds > 1 else ''})")
    for col in ["mode", "verification", "generation call", "decode loop (tree)", "drafter (tree)", "other",
                "decode steps", "steps / request", "requests running / step", "ms / decode step", "draft accepted",
                "drafter us / request-step", "ms / step (fit)"]:
        table.add_column(col, justify="right")
    for m in modes:
        table.add_row(m, cell(f"per_rollout_verify_s_{m}"), cell(f"per_rollout_generate_s_{m}"),
                      cell(f"per_rollout_loop_s_{m}"), cell(f"per_rollout_draft_s_{m}"),
                      cell(f"per_rollout_other_s_{m}"), cell(f"decode_steps_{m}", "{:.1f}"),
                      cell(f"steps_per_request_{m}", "{:.1f}"), cell(f"running_per_step_{m}", "{:.1f}"),
                      cell(f"ms_per_decode_step_{m}", "{:.1f}"), cell(f"draft_accept_rate_{m}", "{:.0%}"),
                      cell(f"draft_us_per_request_step_{m}", "{:.1f}"),
                      "-" if f"step_cost_ms_{m}" not in spreads else
                      f"{cell(f'step_cost_ms_{m}', '{:.1f}')}+{cell(f'step_cost_ms_per_request_{m}', '{:.3f}')}r"
                      f"+{cell(f'step_cost_ms_per_draft_token_{m}', '{:.4f}')}"
                      f"(±{cell(f'step_cost_ms_per_draft_token_error_{m}', '{:.4f}')})d")
    table.caption = ("ms / step (fit): a decode step's cost fitted over the tree drafter's steps, r = requests in "
                     "the step, d = draft tokens it verifies; ± one standard error of the draft token's cost")
    return table


def bench_rollout_main(argv: list[str]) -> int:
    from megatron_specrl.config import load_config, resolve_recipe
    from megatron_specrl.diagnostics.machine import describe, machine

    args = _parse(argv)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        mode_overrides(m, args.draft_model)   # unknown modes fail before any work
    skipped = {}
    if args.engines:   # each engine's modes, labelled mode@engine
        labelled = []
        for engine in [e for e in args.engines.split(",") if e]:
            ok, skipped[engine] = engine_modes(engine, modes, args.draft_model)
            labelled += [f"{m}@{engine}" for m in ok]
        modes = labelled
    if args.prompts % args.prompts_per_step:
        raise SystemExit("--prompts must be a multiple of --prompts-per-step")
    if args.seeds < 1:
        raise SystemExit("--seeds must be >= 1")
    base_seed = args.seed if args.seed is not None else load_config(resolve_recipe(args.recipe),
                                                                    list(args.overrides)).trainer.seed
    steps_per_epoch = args.prompts // args.prompts_per_step
    root = Path(args.output_dir or tempfile.mkdtemp(prefix="specrl-bench-"))
    console = Console(width=200)
    host = machine()   # timings and, through the kernels, the sampled tokens depend on it
    console.print(f"machine: {describe(host)}")
    for engine, names in skipped.items():
        if names:
            console.print(f"{engine} skips {', '.join(names)}: not on this machine (its row of ENGINE_KINDS)")
    runs = []
    for seed in range(base_seed, base_seed + args.seeds):
        results = {}
        for m in modes:
            # which run the trainer's progress bar and step lines below belong to; its epochs print when it ends
            console.print(f"[bold]seed {seed} {m}[/bold]: run {len(runs) * len(modes) + len(results) + 1} of "
                          f"{args.seeds * len(modes)}, {args.epochs} epochs x {steps_per_epoch} steps")
            results[m] = run_mode(args, m, seed, root, steps_per_epoch, console)
        console.print(epoch_table(results, modes, args, steps_per_epoch, seed))
        runs.append({"seed": seed, "epochs": results, "summary": summarize(results)})
    spreads = spread([r["summary"] for r in runs])
    console.print(summary_table(spreads, modes, len(runs)))
    console.print(time_table(spreads, modes, len(runs)))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "runs": runs, "spread": spreads, "machine": host,
            "config": {"recipe": args.recipe, "prompts": args.prompts, "epochs": args.epochs, "modes": modes,
                       "steps_per_epoch": steps_per_epoch, "seeds": [r["seed"] for r in runs],
                       "overrides": list(args.overrides), "engines": args.engines,
                       "skipped": skipped}}, indent=1))
    if args.plot_path:
        plot(runs, args.plot_path)
    return 0


if __name__ == "__main__":
    sys.exit(bench_rollout_main(sys.argv[1:]))
