"""Benchmark speculative rollout modes side by side: see megatron_specrl/bench_rollout.py."""

import sys

from megatron_specrl.bench_rollout import bench_rollout_main

if __name__ == "__main__":
    sys.exit(bench_rollout_main(sys.argv[1:]))
