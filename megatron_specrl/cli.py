"""`megatron-specrl` console entry point: train, convert, check-resync, bench-rollout, launch."""

from __future__ import annotations

import argparse
import sys

from megatron_specrl.config import ConfigError, load_config, resolve_recipe, to_yaml

def _split_recipe_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def cmd_train(args) -> int:
    recipe, overrides = _split_recipe_and_overrides(args.items)
    cfg = load_config(resolve_recipe(recipe), overrides)
    from megatron_specrl.config import check_model_divisibility
    from megatron_specrl.models.resolve import model_shape
    check_model_divisibility(cfg, *model_shape(cfg.model))
    if args.dry_run:
        print(to_yaml(cfg), end="")
        return 0
    from megatron_specrl.trainer import train
    train(cfg)
    return 0


def cmd_convert(args) -> int:
    from megatron_specrl.learner.convert import convert_main
    return convert_main(args.rest)


def cmd_check_resync(args) -> int:
    from megatron_specrl.resync.check import check_resync_main
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
    t = sub.add_parser("train", help="run RL training from a recipe",
                       description="Run RL training. RECIPE is a YAML file or a name under examples/ "
                                   "(default: the embedded tiny CPU GRPO run); key=value overrides follow.")
    t.add_argument("items", nargs="*", metavar="RECIPE|key=value")
    t.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, run nothing")
    t.set_defaults(func=cmd_train)
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


PASSTHROUGH = ("convert", "check-resync", "bench-rollout", "launch")


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
    except ConfigError as e:
        print(f"megatron-specrl: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
