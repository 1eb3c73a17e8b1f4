"""`megatron-specrl bench-rollout`: the same RL run with spec_mode off, exact and lenient, side by side.

Same recipe, seed and data order for each mode, run one after another in one
process; a small dataset so every prompt comes back each epoch (drafts exist
from epoch 2 on). Prints per-epoch rollout seconds, generated tokens, reuse
ratio, rollout reward and held-out greedy accuracy (what the policy learned,
which rollout reward alone hides: lenient reuses old, possibly better, samples),
and the off/exact and off/lenient rollout-time ratios.

The default recipe is tiny-cpu-grpo-long (~67-token worked traces): with the
~27-token traces of tiny-cpu-grpo, a rollout on this CPU is mostly fixed
per-request cost rather than decoding, which is not the regime RLVR runs in.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

MODES = ("off", "exact", "lenient")
STEADY_FROM_EPOCH = 3


def _parse(argv):
    p = argparse.ArgumentParser(prog="megatron-specrl bench-rollout", description=__doc__)
    p.add_argument("overrides", nargs="*", help="config key=value overrides (recipe keys)")
    p.add_argument("--recipe", default="tiny-cpu-grpo-long")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--prompts", type=int, default=32, help="dataset size (prompts per epoch)")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--eval-prompts", type=int, default=128,
                   help="held-out prompts for greedy accuracy at the start and after every epoch (0: off)")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--json", dest="json_path", default=None, help="write per-epoch results and a summary here")
    p.add_argument("--plot", dest="plot_path", default=None, help="write a PNG of the curves here")
    return p.parse_args(argv)


def per_epoch(rows: list[dict], steps_per_epoch: int) -> list[dict]:
    """Sum the step rows of each epoch; `eval_accuracy` is the eval logged at the epoch's last step."""
    steps = [r for r in rows if "spec/rollout_s" in r]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    epochs = []
    for e in range(math.ceil(len(steps) / steps_per_epoch)):
        chunk = steps[e * steps_per_epoch:(e + 1) * steps_per_epoch]
        total = lambda k: sum(r.get(k, 0.0) for r in chunk)
        response_tokens = sum(r.get("response/mean_len", 0.0) for r in chunk)
        epochs.append({
            "epoch": e + 1,
            "rollout_s": total("spec/rollout_s"),
            "generated_tokens": total("spec/generated_tokens"),
            "accepted_tokens": total("spec/accepted_tokens"),
            "reuse_ratio": total("spec/accepted_tokens") / max(total("spec/accepted_tokens")
                                                               + total("spec/generated_tokens"), 1),
            "reward": sum(r.get("reward/mean", 0.0) for r in chunk) / len(chunk),
            "mean_response_len": response_tokens / len(chunk),
            "eval_accuracy": evals.get(chunk[-1].get("step")),
        })
    return epochs


def summarize(results: dict[str, list[dict]]) -> dict[str, float]:
    steady = {m: [e for e in eps if e["epoch"] >= STEADY_FROM_EPOCH] for m, eps in results.items()}
    secs = {m: sum(e["rollout_s"] for e in eps) for m, eps in steady.items()}
    summary = {}
    for m, eps in steady.items():
        acc = sum(e["accepted_tokens"] for e in eps)
        gen = sum(e["generated_tokens"] for e in eps)
        summary[f"reuse_ratio_{m}"] = acc / max(acc + gen, 1)
        summary[f"rollout_s_{m}"] = secs[m]
        summary[f"reward_{m}"] = sum(e["reward"] for e in results[m]) / max(len(results[m]), 1)
        if results[m] and results[m][-1].get("eval_accuracy") is not None:
            summary[f"final_eval_accuracy_{m}"] = results[m][-1]["eval_accuracy"]
    if "off" in secs:
        for m in secs:
            if m != "off" and secs[m] > 0:
                summary[f"speedup_{m}"] = secs["off"] / secs[m]
    summary["steady_from_epoch"] = STEADY_FROM_EPOCH
    return summary


def plot(results: dict[str, list[dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.5))
    for m, eps in results.items():
        x = [e["epoch"] for e in eps]
        axes[0].plot(x, [e["rollout_s"] for e in eps], marker="o", label=m)
        axes[1].plot(x, [e["reuse_ratio"] for e in eps], marker="o", label=m)
        axes[2].plot(x, [e["reward"] for e in eps], marker="o", label=m)
        axes[3].plot(x, [e["eval_accuracy"] for e in eps], marker="o", label=m)
    for ax, title in zip(axes, ["rollout seconds / epoch", "reuse ratio", "mean rollout reward",
                                "held-out greedy accuracy"]):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bench_rollout_main(argv: list[str]) -> int:
    from megatron_specrl.cli import resolve_recipe
    from megatron_specrl.config import load_config
    from megatron_specrl.metrics import read_metrics
    from megatron_specrl.trainer import train

    args = _parse(argv)
    modes = [m for m in args.modes.split(",") if m]
    if args.prompts % args.prompts_per_step:
        raise SystemExit("--prompts must be a multiple of --prompts-per-step")
    steps_per_epoch = args.prompts // args.prompts_per_step
    root = Path(args.output_dir or tempfile.mkdtemp(prefix="specrl-bench-"))
    results: dict[str, list[dict]] = {}
    for mode in modes:
        cfg = load_config(resolve_recipe(args.recipe), [
            *args.overrides, f"rollout.spec_mode={mode}", f"output_dir={root / mode}",
            f"data.num_synthetic={args.prompts}", f"trainer.prompts_per_step={args.prompts_per_step}",
            f"trainer.total_steps={steps_per_epoch * args.epochs}", "trainer.resume=never",
            "trainer.checkpoint_every=0", f"trainer.eval_every={steps_per_epoch if args.eval_prompts else 0}",
            f"data.num_eval={args.eval_prompts}", "trainer.export_hf=false",
            "logging.wandb=false", "logging.plots=false",
        ])
        train(cfg)
        results[mode] = per_epoch(read_metrics(root / mode / "metrics.jsonl"), steps_per_epoch)

    console = Console(width=200)
    table = Table(title=f"rollout per epoch ({args.prompts} prompts, {steps_per_epoch} steps/epoch)")
    for col in ["epoch", *[f"{m[:3]} s" for m in modes], *[f"{m[:3]} gen" for m in modes],
                *[f"{m[:3]} reuse" for m in modes if m != "off"], *[f"{m[:3]} reward" for m in modes],
                *([f"{m[:3]} eval" for m in modes] if args.eval_prompts else []),
                *[f"off/{m[:3]}" for m in modes if m != "off" and "off" in modes]]:
        table.add_column(col, justify="right")
    for i in range(args.epochs):
        row = [str(i + 1)]
        row += [f"{results[m][i]['rollout_s']:.2f}" for m in modes]
        row += [f"{results[m][i]['generated_tokens']:.0f}" for m in modes]
        row += [f"{results[m][i]['reuse_ratio']:.2f}" for m in modes if m != "off"]
        row += [f"{results[m][i]['reward']:.3f}" for m in modes]
        if args.eval_prompts:
            row += [f"{results[m][i]['eval_accuracy']:.3f}" for m in modes]
        if "off" in modes:
            row += [f"{results['off'][i]['rollout_s'] / max(results[m][i]['rollout_s'], 1e-9):.2f}x"
                    for m in modes if m != "off"]
        table.add_row(*row)
    console.print(table)
    summary = summarize(results)
    console.print({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()})
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"epochs": results, "summary": summary,
                                                    "config": {"prompts": args.prompts, "epochs": args.epochs,
                                                               "steps_per_epoch": steps_per_epoch}}, indent=1))
    if args.plot_path:
        plot(results, args.plot_path)
    return 0


if __name__ == "__main__":
    sys.exit(bench_rollout_main(sys.argv[1:]))
