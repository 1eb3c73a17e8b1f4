"""`megatron-specrl` console entry point: train, convert, check-resync, bench-rollout, bench-train, bench-resync,
doctor, launch."""

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
    from megatron_specrl.config.resolve import resolve
    # the resolve step, once: the plan, the dry run's print-out and train() all read this frozen config
    cfg = resolve(load_config(resolve_recipe(recipe), overrides))
    from megatron_specrl.plan import build_plan, print_plan
    # layout, model, data and memory, before anything is written; a run loads model.path now, so a
    # shape-only config (examples/models/) passes the dry-run only
    plan = build_plan(cfg, loads_model=not args.dry_run)
    if args.dry_run:   # the engine and trainer.resume (read only), as the run checks them first (run.build.build_run)
        from megatron_specrl.run.build import check_engine_installed
        from megatron_specrl.run.checkpointing import find_resume
        check_engine_installed(cfg.rollout.engine)
        find_resume(cfg, Path(cfg.output_dir))
        print(to_yaml(cfg), end="")
        print_resolved(cfg)
    print_plan(plan)
    if args.dry_run:
        return 0
    from megatron_specrl.trainer import train
    train(cfg)
    return 0


def print_resolved(cfg) -> None:
    """--dry-run's block of the values the resolved config's unset (auto) keys took, and its experimental
    features: the lines train() logs (config.resolve.resolved_choices)."""
    from megatron_specrl.config.resolve import resolved_choices
    resolved = resolved_choices(cfg)
    print("resolved auto values:")
    for line in resolved.lines() or ["(none: every key is set)"]:
        print(f"  {line}")
    for line in resolved.experimental:
        print(f"  warning: {line}")


def cmd_convert(args) -> int:
    """The layout check (plan.check_convert_layout) runs before any rank is spawned, and a failed conversion
    leaves no output directory behind that it created."""
    import shutil

    from megatron_specrl.learner.convert import build_parser as convert_parser, convert_main
    from megatron_specrl.plan import check_convert_layout
    if not any(a in ("-h", "--help") for a in args.rest):
        parsed = convert_parser().parse_args(args.rest)
        hf_dir = Path(parsed.hf) if parsed.direction == "hf-to-mcore" else Path(parsed.ckpt) / "hf"
        if not (hf_dir / "config.json").is_file():   # named by its flag (the plan's check says model.path)
            raise ConfigError(f"--hf {parsed.hf}: no config.json there (a local HF checkpoint directory)"
                              if parsed.direction == "hf-to-mcore" else
                              f"--ckpt {parsed.ckpt}: no hf/config.json there; pass a directory written by `convert "
                              "hf-to-mcore` or a training checkpoint's learner/ (checkpoints/step_*/learner)")
        check_convert_layout(hf_dir, parsed.tp, parsed.pp, parsed.ep)
        out = Path(parsed.out)
        existed = out.exists()
        if existed and (not out.is_dir() or any(out.iterdir())):   # its files would be overwritten or mixed in
            raise ConfigError(f"--out {out} already exists" + (" and is not empty" if out.is_dir() else "")
                              + "; pass a new directory")
        rc = convert_main(args.rest)
        if rc != 0 and not existed and out.exists():
            shutil.rmtree(out, ignore_errors=True)
        return rc
    return convert_main(args.rest)


def cmd_check_resync(args) -> int:
    from megatron_specrl.diagnostics.check import build_parser as check_parser, check_resync_main
    if not any(a in ("-h", "--help") for a in args.rest):
        from megatron_specrl.run.build import check_engine_installed
        parsed = check_parser().parse_args(args.rest)
        check_resync_layout(parsed)   # before Ray and the ranks start
        check_engine_installed(parsed.engine)
    return check_resync_main(args.rest)


def check_resync_layout(parsed) -> None:
    """check-resync's --model / --tp / --pp / --ep / --engine-tp checked with the rule `train` checks learner.tp /
    pp / ep and rollout.engine_tp with (shape.layout_failures): otherwise a size that does not fit the model fails
    in a Megatron or vLLM assert inside a Ray actor, after the model is built."""
    from megatron_specrl.models.families.shape import CLI_KEYS, layout_failures
    from megatron_specrl.models.resolve import TINY
    from megatron_specrl.plan import ModelShape, load_hf_config
    if parsed.model not in TINY and not (Path(parsed.model) / "config.json").is_file():
        raise ConfigError(f"--model {parsed.model}: no config.json there (a local HF checkpoint directory, "
                          f"or one of {sorted(TINY)})")
    failures = layout_failures(ModelShape.from_hf(load_hf_config(parsed.model)), where=parsed.model, tp=parsed.tp,
                               pp=parsed.pp, ep=parsed.ep, engine_tp=parsed.engine_tp, keys=CLI_KEYS)
    if failures:
        raise PlanError(failures)


def cmd_bench_rollout(args) -> int:
    from megatron_specrl.benchmarks.rollout import bench_rollout_main
    return bench_rollout_main(args.rest)


def cmd_bench_train(args) -> int:
    from megatron_specrl.benchmarks.train import bench_train_main
    return bench_train_main(args.rest)


def cmd_bench_resync(args) -> int:
    from megatron_specrl.benchmarks.resync import bench_resync_main
    return bench_resync_main(args.rest)


def cmd_doctor(args) -> int:
    from megatron_specrl.diagnostics.doctor import doctor_main
    return doctor_main(args.rest)


def cmd_launch(args) -> int:
    from megatron_specrl.cluster.launch import launch_main
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
        ("bench-train", cmd_bench_train, "benchmark the whole step, synchronous and asynchronous, side by side"),
        ("bench-resync", cmd_bench_resync, "benchmark one weight resync from the learner to the engine"),
        ("doctor", cmd_doctor, "check the install (imports, pins, GPUs) and the learner's code paths against HF"),
        ("launch", cmd_launch, "render or submit a Slurm + Ray launch for a recipe"),
    ]:
        s = sub.add_parser(name, help=text, description=text, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(func=func)
    return p


PASSTHROUGH = ("train", "convert", "check-resync", "bench-rollout", "bench-train", "bench-resync", "doctor", "launch")


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
