"""megatron-specrl bench-train: the whole training step, synchronous and asynchronous
(trainer.max_staleness), crossed with plain rollouts (`off`) and the recipe's speculative mode, and the
exact overlap (`async+exact`: trainer.overlap=exact with coupled rollouts, refreshed under the new weights),
side by side in one run on the same recipe, seeds and data.

Each arm is one `megatron-specrl train` process (its own Ray, engines and learner, so what one arm binds
or warms cannot leak into the next), run one after the other in the order the arms are given, for every
seed. Per arm: the median step seconds from step 5 on, the training loop's and the process's wall time,
the learner's and the engines' idle fractions (time/learner_idle_s, time/engine_idle_s over time/step_s),
the staleness and the held-out accuracy at the end, and for the exact overlap the refresh's figures (kept
tokens, seconds, its decode steps over the rollout's), with mean, min and max over seeds; then each arm
against the first, seed by seed (`paired_with`: step and rollout time ratios, the held-out difference);
the curve of held-out accuracy lands in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = {
    "sync+off": ["trainer.max_staleness=0", "rollout.spec_mode=off", "rollout.draft=none"],
    "sync+default": ["trainer.max_staleness=0"],
    # the default mode with drafts sized by the token budget and min_prob alone (no decode-step cost model)
    "sync+default+nocost": ["trainer.max_staleness=0", "rollout.drafter.cost_model=false"],
    "async+off": ["trainer.max_staleness=1", "rollout.spec_mode=off", "rollout.draft=none"],
    "async+default": ["trainer.max_staleness=1"],
    "async+exact": ["trainer.max_staleness=0", "trainer.overlap=exact", "rollout.spec_mode=coupled",
                    "rollout.coupled_refresh=1"],
}
FIRST_TIMED_STEP = 5   # the engines' and learner's warm-up steps are left out of the medians


def _parse(argv):
    p = argparse.ArgumentParser(prog="megatron-specrl bench-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config key=value overrides of the recipe")
    p.add_argument("--recipe", default="tiny-cpu-grpo")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--steps", type=int, default=128, help="trainer.total_steps of every arm")
    p.add_argument("--seeds", type=int, default=1, help="repeat over trainer.seed = base, base+1, ...")
    p.add_argument("--seed", type=int, default=1, help="base seed")
    p.add_argument("--output-dir", default="outputs/bench-train")
    p.add_argument("--json", dest="json_path", default=None, help="write every run's rows and the summary here")
    args = p.parse_args(argv)
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {', '.join(unknown)}; arms: {', '.join(ARMS)}")
    if args.steps <= FIRST_TIMED_STEP:
        p.error(f"--steps {args.steps}: the medians count steps {FIRST_TIMED_STEP} on; give more steps")
    return args


def summarize_run(rows: list[dict], wall_s: float) -> dict[str, float]:
    """One run's figures from its metrics.jsonl rows."""
    steps = [r for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r]
    timed = [r for r in steps if r["step"] >= FIRST_TIMED_STEP]
    total = sum(r["time/step_s"] for r in timed)
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {
        "step_s_median": statistics.median(r["time/step_s"] for r in timed),
        "loop_s": sum(r["time/step_s"] for r in steps),
        "wall_s": wall_s,
        "rollout_s_median": statistics.median(r.get("time/rollout_s", 0.0) for r in timed),
        "train_s_median": statistics.median(r.get("time/train_s", 0.0) for r in timed),
        "learner_idle": sum(r.get("time/learner_idle_s", 0.0) for r in timed) / total,
        "engine_idle": sum(r.get("time/engine_idle_s", 0.0) for r in timed) / total,
        "staleness_mean": statistics.fmean(r.get("async/staleness_mean", 0.0) for r in steps),
        # the exact overlap's refresh (0 for the other arms: no step logs it)
        "refresh_kept_token_frac": _mean_of(timed, "refresh/kept_token_frac"),
        "refresh_s_median": statistics.median(r.get("time/refresh_s", 0.0) for r in timed),
        "refresh_decode_steps_ratio": (sum(r.get("refresh/decode_steps", 0.0) for r in timed)
                                       / max(sum(r.get("spec/decode_steps", 0.0) for r in timed
                                                 if "refresh/decode_steps" in r), 1.0)),
        "eval_start": evals[0][1] if evals else float("nan"),
        "eval_end": evals[-1][1] if evals else float("nan"),
    }


def _mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else 0.0


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def run_arm(args, arm: str, seed: int, root: Path) -> tuple[list[dict], float]:
    out = root / f"seed{seed}" / arm.replace("+", "-")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "megatron_specrl.cli", "train", args.recipe, *args.overrides, *ARMS[arm],
           f"output_dir={out}", f"trainer.seed={seed}", f"trainer.total_steps={args.steps}", "trainer.resume=never",
           "logging.wandb=false", "logging.plots=false", "trainer.export_hf=false"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=dict(os.environ))     # the child's progress bar is this run's progress
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench-train: arm {arm} seed {seed} failed with exit code {proc.returncode}: "
                         f"{' '.join(cmd)}")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return rows, wall


def paired_with(base: list[dict], other: list[dict]) -> dict[str, dict[str, float] | float]:
    """One arm against the base arm (the first given), seed by seed: each seed's two runs share their
    prompts, starting weights and held-out set, so their ratio (and difference) leaves out what moves
    with the seed. Step and rollout time as ratios of the medians (their `spread` over seeds), held-out
    accuracy at the end as the mean difference with its standard error (0 with one seed): the same seed
    follows its own trajectory in each arm, and whether the arms' ranges overlap says little at a few
    seeds (two arms of one distribution, n seeds each, have every seed of one inside the other's range
    with probability (n - 1) / (2 (2n - 1)): 0.2 at three)."""
    if len(base) != len(other) or not base:
        raise ValueError(f"paired_with: {len(base)} base runs against {len(other)}: pair them seed by seed")
    out = {f"{name}_ratio": spread([o[key] / b[key] if b[key] > 0 else float("nan") for b, o in zip(base, other)])
           for key, name in (("step_s_median", "step"), ("rollout_s_median", "rollout"))}
    diffs = [o["eval_end"] - b["eval_end"] for b, o in zip(base, other)]
    out["eval_end_diff"] = statistics.fmean(diffs)
    out["eval_end_diff_error"] = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
    return out


def _spread_text(v: dict[str, float], fmt: str) -> str:
    """A `spread` as "mean (min-max)"."""
    return f"{v['mean']:{fmt}} ({v['min']:{fmt}}-{v['max']:{fmt}})"


def _row(name: str, s: dict[str, dict[str, float]]) -> str:
    def f(key, fmt):
        return _spread_text(s[key], fmt)
    return (f"| {name} | {f('step_s_median', '.3f')} | {f('loop_s', '.1f')} | {f('wall_s', '.1f')} | "
            f"{f('learner_idle', '.2f')} | {f('engine_idle', '.2f')} | {f('staleness_mean', '.2f')} | "
            f"{f('eval_start', '.3f')} | {f('eval_end', '.3f')} | {f('refresh_kept_token_frac', '.3f')} | "
            f"{f('refresh_s_median', '.3f')} | {f('refresh_decode_steps_ratio', '.2f')} |")


def bench_train_main(argv: list[str]) -> int:
    from megatron_specrl.diagnostics.machine import describe, machine

    args = _parse(argv)
    arms = args.arms.split(",")
    host = machine()
    print(f"machine: {describe(host)}", flush=True)
    root = Path(args.output_dir)
    runs, per_arm = [], {a: [] for a in arms}
    for seed in range(args.seed, args.seed + args.seeds):
        for arm in arms:
            print(f"bench-train: seed {seed} {arm} ...", flush=True)
            rows, wall = run_arm(args, arm, seed, root)
            s = summarize_run(rows, wall)
            per_arm[arm].append(s)
            runs.append({"arm": arm, "seed": seed, "summary": s, "rows": rows})
            print(f"bench-train: seed {seed} {arm}: step {s['step_s_median']:.3f} s (median from step "
                  f"{FIRST_TIMED_STEP}), loop {s['loop_s']:.1f} s, wall {s['wall_s']:.1f} s, learner idle "
                  f"{s['learner_idle']:.0%}, engine idle {s['engine_idle']:.0%}, held-out {s['eval_start']:.3f} -> "
                  f"{s['eval_end']:.3f}", flush=True)
    spreads = {a: {k: spread([s[k] for s in per_arm[a]]) for k in per_arm[a][0]} for a in arms}
    print(f"\n{args.seeds} seed(s), {args.steps} steps, recipe {args.recipe} {' '.join(args.overrides)}")
    print("| arm | step s (median) | loop s | wall s | learner idle | engine idle | staleness | held-out start | "
          "held-out end | refresh kept tokens | refresh s | refresh / rollout decode steps |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for a in arms:
        print(_row(a, spreads[a]))
    paired = {a: paired_with(per_arm[arms[0]], per_arm[a]) for a in arms[1:]}
    if paired:
        print(f"\nEach arm against {arms[0]}, seed by seed (ratios: mean (min-max) over seeds; held-out: mean "
              "difference, its standard error):")
        print(f"| arm | step s / {arms[0]}'s | rollout s / {arms[0]}'s | held-out end − {arms[0]}'s |")
        print("| --- | --- | --- | --- |")
        for a, p in paired.items():
            print(f"| {a} | {_spread_text(p['step_ratio'], '.3f')} | {_spread_text(p['rollout_ratio'], '.3f')} | "
                  f"{p['eval_end_diff']:+.3f} ± {p['eval_end_diff_error']:.3f} |")
    ratios = {}
    for spec in ("off", "default"):
        s, a = f"sync+{spec}", f"async+{spec}"
        if s in spreads and a in spreads:
            ratios[spec] = spreads[s]["step_s_median"]["mean"] / spreads[a]["step_s_median"]["mean"]
            print(f"async over sync ({spec}): {ratios[spec]:.2f}x per step (medians' means)")
    for base in ("sync+off", "sync+default", "async+default"):
        if base in spreads and "async+exact" in spreads:
            key = "async+exact over " + base
            ratios[key] = spreads[base]["step_s_median"]["mean"] / spreads["async+exact"]["step_s_median"]["mean"]
            print(f"{key}: {ratios[key]:.2f}x per step (medians' means)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"machine": host, "args": vars(args), "spread": spreads,
                                                    "ratios": ratios, "paired": paired, "runs": runs}, indent=1))
    return 0
