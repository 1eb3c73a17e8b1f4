"""Benchmark the per-prompt draft trees: the pure-Python automata (megatron_specrl/rollout/tree_drafting/trees.py)
and the compiled ones (rollout/tree_drafting/compiled_trees.py), side by side in one run (`--impl`).

Synthetic arithmetic traces (vocabulary of 40: digits, '+', '=', ' ', and 27 other tokens), one
base trace of 96 tokens per key; every sequence of a key is the base with 5% of its tokens
replaced at random. Prints:

* in-flight engine steps: 128 requests (16 keys x 8 samples), each extending by 1-4 tokens of its
  own trace and then proposing up to 16 tokens; ms per step (all 128 requests) and us per request.
  Run twice: with last epoch's 128 sequences already in the trees, and with empty trees (first
  epoch: drafts come from siblings only). Also how many proposed tokens the trace actually
  continued with (a draft-quality sanity check, not part of the budget).
* inserting a finished set of 128 x 96 tokens from scratch.
* one request stuck in a repetition loop (period 1 and 7) for 8192 tokens: per-token work stays
  bounded by max_depth instead of growing with the loop's length.
* rebuilding ~100k tokens from state_dict(), and the memory estimate per token.

    python benchmarks/bench_draft_tree.py [--repeats 5] [--seed 0] [--impl python,compiled]

Each implementation runs every section with the same random traces; the last line prints the compiled
trees' in-flight cost per request as a ratio of the Python trees'. The compiled trees' first use
compiles them (or loads numba's cache), outside the timed sections.

Budget (the task's): < 1.5 ms per in-flight step, < 50 ms per 128 x 96 insert, < 2 s per 100k rebuild.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_specrl.rollout.tree_drafting.drafter import trees_class
from megatron_specrl.rollout.tree_drafting.trees import DraftTrees

VOCAB = 40
PLUS, EQ, SPACE = 10, 11, 12
KEYS, SAMPLES, LENGTH = 16, 8, 96


def base_trace(rng: random.Random, length: int = LENGTH) -> list[int]:
    """Char-level tokens of a worked sum "a+b=c c+d=e ...", now and then an other token, cut to `length`."""
    out: list[int] = []
    acc = rng.randint(1, 99)
    while len(out) < length:
        term = rng.randint(1, 99)
        nxt = acc + term
        for ch in f"{acc}+{term}={nxt} ":
            out.append({"+": PLUS, "=": EQ, " ": SPACE}.get(ch, ord(ch) - 48 if ch.isdigit() else 13))
        acc = nxt
        if rng.random() < 0.1:
            out.append(rng.randrange(13, VOCAB))
    return out[:length]


def mutate(rng: random.Random, base: list[int], rate: float = 0.05) -> list[int]:
    return [rng.randrange(VOCAB) if rng.random() < rate else t for t in base]


def make_epoch(rng: random.Random, bases: dict[str, list[int]]) -> list[tuple[str, list[int]]]:
    return [(key, mutate(rng, base)) for key, base in bases.items() for _ in range(SAMPLES)]


def in_flight(trees: DraftTrees, epoch: list[tuple[str, list[int]]], rng: random.Random):
    """Drive one epoch of 128 requests step by step.

    Returns ([(wall s, cpu s, requests) per step], tokens proposed, proposed tokens the trace continued with)."""
    pos = [0] * len(epoch)
    for i, (key, _) in enumerate(epoch):
        trees.start(i, key)
    step_times = []
    proposed = correct = 0
    live = list(range(len(epoch)))
    while live:
        plan = [(i, rng.randint(1, 4)) for i in live]
        drafts = []
        chunks = [epoch[i][1][pos[i]:pos[i] + n] for i, n in plan]
        t0, c0 = time.perf_counter(), time.process_time()
        for (i, _), chunk in zip(plan, chunks):
            drafts.append(trees.extend_and_propose((i,), chunk, 16)[0])   # what the engines call
        step_times.append((time.perf_counter() - t0, time.process_time() - c0, len(plan)))
        still = []
        for (i, n), draft in zip(plan, drafts):
            pos[i] += n
            seq = epoch[i][1]
            proposed += len(draft)
            for a, b in zip(draft, seq[pos[i]:]):
                if a != b:
                    break
                correct += 1
            if pos[i] >= len(seq):
                trees.finish(i)
            else:
                still.append(i)
        live = still
    return step_times, proposed, correct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", default="python,compiled", help="comma-separated: python, compiled")
    args = ap.parse_args()
    per_request = {}
    for impl in args.impl.split(","):
        cls = trees_class(impl)
        warm = cls()                 # compile (or load the cache) before timing
        warm.start(0, "k", [1, 2, 3])
        warm.extend_and_propose([0], [4], 4)
        print(f"== {impl}: {cls.__name__}")
        per_request[impl] = run(cls, args)
    if len(per_request) == 2 and "python" in per_request and "compiled" in per_request:
        print(f"in-flight cpu per request (extend + propose), compiled / python: last epoch in trees "
              f"{per_request['compiled'][0] / per_request['python'][0]:.2f}, empty trees "
              f"{per_request['compiled'][1] / per_request['python'][1]:.2f}")


def run(trees_cls: type[DraftTrees], args) -> tuple[float, float]:
    """Every section with one implementation; returns the in-flight us per request (warm, empty trees)."""
    rng = random.Random(args.seed)
    bases = {f"prompt-{k}": base_trace(rng) for k in range(KEYS)}
    out = []

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall times include other processes; "
          "cpu = this process's time)")
    print(f"python {sys.version.split()[0]}; {KEYS} keys x {SAMPLES} samples x {LENGTH} tokens, vocab {VOCAB}, "
          f"5% mutations; {trees_cls.__name__}(max_depth=32, max_match=16)")
    for warm in (True, False):
        steps, prop, corr = [], 0, 0
        for _ in range(args.repeats):
            trees = trees_cls()
            if warm:
                for key, seq in make_epoch(rng, bases):
                    trees.insert(key, seq)
            t, p, c = in_flight(trees, make_epoch(rng, bases), rng)
            steps += t
            prop += p
            corr += c
        full = [(w, c) for w, c, n in steps if n == KEYS * SAMPLES]   # steps with all 128 requests live
        per_req_us = 1e6 * sum(c for _, c, _ in steps) / sum(n for _, _, n in steps)
        label = "in-flight, last epoch in trees" if warm else "in-flight, empty trees (siblings only)"
        for name, col in (("wall", 0), ("cpu", 1)):
            ms = sorted(x[col] * 1e3 for x in full)
            print(f"{label}, {name} time of {len(ms)} full steps (128 requests: extend 1-4 tokens + propose 16): "
                  f"median {statistics.median(ms):.3f} ms, p10 {ms[len(ms) // 10]:.3f}, "
                  f"p90 {ms[len(ms) * 9 // 10]:.3f}, mean {statistics.mean(ms):.3f} ms")
        out.append(per_req_us)
        print(f"    {per_req_us:.1f} us cpu per request (all steps); {prop / sum(n for _, _, n in steps):.1f} tokens "
              f"proposed per request-step, {corr / max(prop, 1):.0%} of them continue the trace")

    times = []
    for _ in range(args.repeats):
        epoch = make_epoch(rng, bases)
        t0, c0 = time.perf_counter(), time.process_time()
        trees = trees_cls()
        for key, seq in epoch:
            trees.insert(key, seq)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    st = trees.stats()
    print(f"insert 128 x 96 tokens from scratch: wall median {statistics.median(w for w, _ in times) * 1e3:.1f} ms, "
          f"cpu median {statistics.median(c for _, c in times) * 1e3:.1f} ms, "
          f"min {min(c for _, c in times) * 1e3:.1f} ms; {st['nodes']} nodes (states) for {st['tokens']} tokens, "
          f"memory_bytes {st['memory_bytes'] / 1e6:.2f} MB ({st['memory_bytes'] / st['tokens']:.0f} B a token)")

    for period in (1, 7):
        loop = [i % period for i in range(8192)]
        t0 = time.process_time()
        trees = trees_cls()
        trees.start("r", "loop")
        for i in range(0, len(loop), 4):
            trees.extend("r", loop[i:i + 4])
            trees.propose("r", 16)
        dt = time.process_time() - t0
        print(f"degenerate repetition loop (period {period}), 8192 tokens in flight, 4 a step + propose: "
              f"cpu {dt * 1e3:.1f} ms ({dt * 1e6 / 2048:.1f} us a step)")

    big = trees_cls()
    n_keys = n_tokens = 0
    while n_tokens < 100_000:
        key = f"prompt-{n_keys}"
        base = base_trace(rng)
        for _ in range(SAMPLES):
            big.insert(key, mutate(rng, base))
        n_keys += 1
        n_tokens += SAMPLES * len(base)
    state = big.state_dict()
    t0 = time.perf_counter()
    restored = trees_cls.from_state_dict(state)
    dt = time.perf_counter() - t0
    t0 = time.perf_counter()
    st = restored.stats()
    dst = time.perf_counter() - t0
    print(f"rebuild from state_dict: {st['tokens']} tokens, {st['keys']} keys in {dt:.3f} s; "
          f"{st['nodes']} nodes, memory_bytes {st['memory_bytes'] / 1e6:.1f} MB "
          f"({st['memory_bytes'] / st['tokens']:.0f} B a token, {st['memory_bytes'] / st['nodes']:.0f} B a node); "
          f"stats() took {dst * 1e3:.1f} ms")
    return out[0], out[1]


if __name__ == "__main__":
    main()
