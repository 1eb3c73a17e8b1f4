"""`megatron-specrl` console entry point: train, convert, check-resync, bench-rollout, launch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_specrl.config import ConfigError, load_config, resolve_recipe, to_yaml
from megatron_specrl.data.datasets import DatasetError
from megatron_specrl.engines.protocol import EngineError
from megatron_specrl.plan import PlanError
from megatron_specrl.rewards import RewardError

def _split_recipe_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def train_parser() -> argparse.ArgumentParser:
    t = argparse.ArgumentParser(prog="megatron-specrl train",
                                description="Run RL training. RECIPE is a YAML file or a name under examples/ "
                                            "(default: the embedded tiny CPU GRPO run); key=value overrides follow.")
    t.add_argument("items", nargs="*", metavar="RECIPE|key=value")
    t.add_argument("--dry-run", action="store_true",
                   help="validate, check the plan (layout, model, data, memory per GPU) and print it; run nothing")
    return t


def cmd_train(args) -> int:
    args = train_parser().parse_intermixed_args(args.rest)   # flags anywhere: RECIPE --dry-run key=value
    recipe, overrides = _split_recipe_and_overrides(args.items)
    cfg = load_config(resolve_recipe(recipe), overrides)
    from megatron_specrl.plan import build_plan, print_plan
    plan = build_plan(cfg)    # layout, model, data and memory, before anything is written
    if args.dry_run:
        print(to_yaml(cfg), end="")
    print_plan(plan)
    if args.dry_run:
        return 0
    from megatron_specrl.trainer import train
    train(cfg)
    return 0


def cmd_convert(args) -> int:
    """The plan's divisibility check runs before any rank is spawned, and a failed conversion
    leaves no output directory behind that it created."""
    import shutil

    from megatron_specrl.learner.convert import build_parser as convert_parser, convert_main
    from megatron_specrl.plan import check_convert_layout
    if not any(a in ("-h", "--help") for a in args.rest):
        parsed = convert_parser().parse_args(args.rest)
        hf_dir = Path(parsed.hf) if parsed.direction == "hf-to-mcore" else Path(parsed.ckpt) / "hf"
        check_convert_layout(hf_dir, parsed.tp, parsed.pp)
        out = Path(parsed.out)
        existed = out.exists()
        rc = convert_main(args.rest)
        if rc != 0 and not existed and out.exists():
            shutil.rmtree(out, ignore_errors=True)
        return rc
    return convert_main(args.rest)


def cmd_check_resync(args) -> int:
    from megatron_specrl.diagnostics.check import check_resync_main
    return check_resync_main(args.rest)


def cmd_bench_rollout(args) -> int:
    from megatron_specrl.bench_rollout import bench_rollout_main
    return bench_rollout_main(args.rest)


def cmd_launch(args) -> int:
    from megatron_specrl.launch import launch_main
    return launch_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-specrl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, func, text in [("train", cmd_train, "run RL training from a recipe")]:
        s = sub.add_parser(name, help=text, description=text, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(func=func)
    for name, func, text in [
        ("convert", cmd_convert, "convert checkpoints between HF safetensors and Megatron TP/PP layouts"),
        ("check-resync", cmd_check_resync, "compare engine weights and log-probs with the learner's"),
        ("bench-rollout", cmd_bench_rollout, "benchmark speculative rollout modes side by side"),
        ("launch", cmd_launch, "render or submit a Slurm + Ray launch for a recipe"),
    ]:
        s = sub.add_parser(name, help=text, description=text, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(func=func)
    return p


PASSTHROUGH = ("train", "convert", "check-resync", "bench-rollout", "launch")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in PASSTHROUGH:   # these parse their own flags, --help included
        args = parser.parse_args(argv[:1])
        args.rest = argv[1:]
    else:
        args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PlanError as e:
        for line in e.failures:
            print(f"megatron-specrl: plan error: {line}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"megatron-specrl: config error: {e}", file=sys.stderr)
        return 2
    except DatasetError as e:   # raised when the run starts (prompt lengths need the tokenizer)
        print(f"megatron-specrl: data error: {e}", file=sys.stderr)
        return 2
    except RewardError as e:    # a user reward function's NaN, at the step that met it (checkpoints kept)
        print(f"megatron-specrl: reward error: {e}", file=sys.stderr)
        return 2
    except EngineError as e:    # died again after the restart and retry (checkpoints kept; resume continues)
        print(f"megatron-specrl: engine error: [{e.engine}] {e.message}", file=sys.stderr)
        for line in e.last_log_lines[-20:]:
            print(f"  {e.engine}| {line}", file=sys.stderr)
        return 1                # not 2: launch requeues the job (a config error it would not)


if __name__ == "__main__":
    sys.exit(main())
