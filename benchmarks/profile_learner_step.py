"""Where one learner train step goes: the batch's transfer to the rank, the old log-prob recompute, forward,
backward, the optimizer, and the Python around them (the schedule's, the microbatch split, the metrics).

`time/train_s` is the driver's view of the whole call; this splits it. One learner rank of the recipe's
layout in this process (the run's rank is a Ray actor with the same code), on a batch rebuilt from a run's
dumped rollouts (trainer.rollout_data_dir: prompts and responses token for token, so the batch has the
run's shapes: every dumped step's batch), each trained `--repeats` times after one warm-up step; each
phase is timed by wrapping the function that does it, medians over the train steps. The transfer is
timed apart: ray.put of the batch and a call of a Ray actor that takes it (what
LearnerGroup.call_with_batch does), against the same call with an empty payload.

    python benchmarks/profile_learner_step.py --dump <run>/rollouts [--recipe tiny-cpu-grpo] [--repeats 3]
        [--metrics <run>/metrics.jsonl]   # the run's time/train_s beside the split, step by step
        [--threads 2]                      # torch threads of the rank (default: what Ray gives a run's rank)
        [--profile]                        # cProfile one step: the Python functions that cost most

The log-probs of the rollout are not dumped; the batch carries the learner's own (scored once), which
changes what the loss computes, not what it costs. The old log-prob recompute runs only where
learner.recompute_old_logprobs resolves true (the stale overlap, bf16, top_p / top_k); its row is the
cost of the one forward it adds (`_score`), timed apart as well.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # as rank_env gives the run's ranks
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Timers:
    """Seconds per label, summed within a step; `wrap` times every call of obj.name."""

    def __init__(self):
        self.now: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.now[label] += time.perf_counter() - t
        setattr(obj, name, timed)

    @contextmanager
    def step(self):
        self.now = defaultdict(float)
        t = time.perf_counter()
        yield
        self.now["total"] = time.perf_counter() - t
        self.steps.append(dict(self.now))

    def median(self, label: str) -> float:
        return statistics.median(s.get(label, 0.0) for s in self.steps)


def rebuild_batches(dump_dir: Path, pad_id: int) -> dict[int, dict]:
    """The learner batch of every dumped step (build_batch), with GRPO advantages of its scores."""
    import torch

    from megatron_specrl.algorithms.advantages import grpo_advantages
    from megatron_specrl.rollout.batch import build_batch
    from megatron_specrl.rollout.dump import read_rollouts
    from megatron_specrl.rollout.speculative import RolloutSample

    out = {}
    for step, rows in read_rollouts(dump_dir).items():
        samples = [RolloutSample(r["prompt_id"], r["sample_idx"], r["prompt_ids"], r["response_ids"],
                                 [-1.0] * len(r["response_ids"]), r["finish_reason"], r["num_reused"],
                                 r["weight_version"]) for r in rows]
        adv = grpo_advantages(torch.tensor([r["score"] for r in rows]), [s.prompt_id for s in samples])
        batch = build_batch(samples, torch.zeros(len(samples)), pad_id)
        batch["advantages"] = adv[:, None] * batch["loss_mask"]
        out[step] = batch
    return out


def transfer_seconds(batch, repeats: int) -> tuple[float, float, int]:
    """(median s of ray.put + an actor call taking the batch, median s of the same call with no payload,
    the torch threads of an actor started as LearnerGroup starts a CPU rank)."""
    import ray

    from megatron_specrl.learner.group import rank_env

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)   # a Ray of its own

    @ray.remote
    class Sink:
        def take(self, batch):
            return len(batch) if batch is not None else 0

        def threads(self):
            import torch
            return torch.get_num_threads()

    sink = Sink.options(num_cpus=0.01, runtime_env={"env_vars": rank_env(0.0)}).remote()
    rank_threads = ray.get(sink.threads.remote())
    with_batch, empty = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        ray.get(sink.take.remote(ray.put(batch)))
        with_batch.append(time.perf_counter() - t)
        t = time.perf_counter()
        ray.get(sink.take.remote(None))
        empty.append(time.perf_counter() - t)
    ray.shutdown()
    return statistics.median(with_batch), statistics.median(empty), rank_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", required=True, type=Path, help="a run's trainer.rollout_data_dir")
    ap.add_argument("--recipe", default="tiny-cpu-grpo")
    ap.add_argument("--repeats", type=int, default=3, help="train steps on each dumped batch")
    ap.add_argument("--metrics", type=Path, default=None, help="the run's metrics.jsonl: its time/train_s")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: a run's learner rank's)")
    ap.add_argument("--profile", action="store_true", help="cProfile one more step; print the top functions")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()

    import torch
    from megatron.core.pipeline_parallel import schedules

    from megatron_specrl.config import load_config
    from megatron_specrl.config.resolve import resolve
    from megatron_specrl.config.schema import resolve_recipe
    from megatron_specrl.learner import worker as worker_module
    from megatron_specrl.learner.ports import free_port
    from megatron_specrl.run.build import prepare_model

    cfg = resolve(load_config(resolve_recipe(args.recipe), args.overrides))
    cfg, model = prepare_model(cfg)
    batches = rebuild_batches(args.dump, model.pad_id)
    for batch in batches.values():
        batch["temperature"] = cfg.rollout.temperature
    put_s, call_s, rank_threads = transfer_seconds(batches[max(batches)], repeats=20)
    torch.set_num_threads(args.threads or rank_threads)   # default: the run's rank's

    w = worker_module.LearnerWorker(0, 1, "127.0.0.1", free_port(), cfg.learner, seed=cfg.trainer.seed)
    w.load_hf(str(model.model_dir))
    for batch in batches.values():   # the rollout's log-probs are not dumped: the model's own stand in
        batch["old_logprobs"] = batch["rollout_logprobs"] = w.compute_logprobs(batch)
    timers = Timers()
    fwd, bwd, sched = "forward (model, log-probs, loss)", "backward", "schedule"
    others = ("microbatch split", "zero grad", "grad sync and clip", "optimizer step (AdamW)", "metrics reduce")
    timers.wrap(w, "_score", "old log-prob recompute")
    timers.wrap(w, "_microbatches", others[0])
    timers.wrap(schedules, "forward_step", fwd)          # our forward_step_func and the loss on its output
    timers.wrap(schedules, "backward_step", bwd)
    timers.wrap(w, "_run_schedule", sched)
    timers.wrap(w.optimizer, "zero_grad", others[1])
    timers.wrap(w, "_finalize_grads", others[2])
    timers.wrap(w.optimizer, "step", others[3])
    timers.wrap(w, "_reduce_metrics", others[4])

    w.train_step(dict(batches[min(batches)]))   # warm-up: allocations, first-call imports
    rank_s: dict[int, list[float]] = defaultdict(list)
    recompute = []
    for _ in range(args.repeats):
        for step, batch in batches.items():
            with timers.step():
                w.train_step(dict(batch))
            rank_s[step].append(timers.steps[-1]["total"])
            t = time.perf_counter()
            w._score(batch, to_all=True)
            recompute.append(time.perf_counter() - t)
    recompute_on = bool(cfg.learner.recompute_old_logprobs)
    for st in timers.steps:   # per step, then medians: the derived rows are differences of one step's timers
        st["python"] = st.get(sched, 0.0) - st.get(fwd, 0.0) - st.get(bwd, 0.0)
        st["rest"] = st["total"] - st.get(sched, 0.0) - sum(st.get(k, 0.0) for k in others) \
            - (st.get("old log-prob recompute", 0.0) if recompute_on else 0.0)

    s = cfg.learner
    shapes = [tuple(b["input_ids"].shape) for b in batches.values()]
    resp = statistics.mean(float(b["loss_mask"].sum()) for b in batches.values())
    print(f"recipe {args.recipe}: {len(batches)} dumped batches of {shapes[0][0]} rows x {min(x[1] for x in shapes)}-"
          f"{max(x[1] for x in shapes)} tokens (mean {resp:.0f} response tokens), micro_batch_size "
          f"{s.micro_batch_size}, mini_batches {s.mini_batches}, ppo_epochs {s.ppo_epochs}, recompute_old_logprobs "
          f"{s.recompute_old_logprobs}, torch threads {torch.get_num_threads()} (a run's rank: {rank_threads}); "
          f"medians over {len(timers.steps)} train steps ({args.repeats} per batch)")
    total = timers.median("total")
    rows = [("batch transfer (driver: ray.put, then an actor call that takes the batch)", put_s, False),
            ("  the same call with no payload", call_s, False),
            ("old log-prob recompute (one forward-only pass; " + ("in the step)" if recompute_on
                                                                 else "off in this recipe)"),
             statistics.median(recompute), recompute_on),
            (fwd, timers.median(fwd), True), (bwd, timers.median(bwd), True),
            ("the schedule's Python (Megatron's forward_backward around them)", timers.median("python"), True),
            *((k, timers.median(k), True) for k in others),
            ("rest of train_step (lr, metric averages)", timers.median("rest"), True),
            ("train_step in the rank", total, True)]
    print("| phase | s | share of train_step |\n| --- | --- | --- |")
    for label, sec, inside in rows:
        print(f"| {label} | {sec:.3f} | {f'{sec / total:.0%}' if inside else '-'} |")
    if args.metrics is not None:
        logged = {r["step"]: r["time/train_s"] for r in map(json.loads, args.metrics.read_text().splitlines())
                  if "time/train_s" in r}
        gaps = [logged[k] - statistics.median(v) for k, v in rank_s.items() if k in logged and k > 1]
        print("step | run's time/train_s | this rank's train_step\n" + "\n".join(
            f"{k} | {logged[k]:.3f} | {statistics.median(v):.3f}" for k, v in rank_s.items() if k in logged))
        if gaps:   # step 1 warms the run's rank up
            print(f"the run's time/train_s (the driver's learn(), steps {min(k for k in rank_s if k > 1)}-"
                  f"{max(rank_s)}): median {statistics.median(logged[k] for k in rank_s if k > 1 and k in logged):.3f}; "
                  f"less this rank's train_step on the same batch: median {statistics.median(gaps):.3f} s")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        w.train_step(dict(batches[max(batches)]))
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    w.shutdown()


if __name__ == "__main__":
    main()
