"""Verification with and without reading the shared prompt from vLLM's prefix cache, side by side.

A step verifies the n samples of each prompt together. vLLM skips the prefix cache for every
prompt-log-prob request, so without our capped lookup (patches/vllm_0_32_0_batched_prompt_logprobs,
`_make_cache_cap`) each sample re-prefills the whole prompt; with it, only the first sample of a
prompt does (block-aligned, never past the continuation's start). This runs one in-process engine
on the tiny default model with random-token prompts and drafts, alternates the two arms in ABBA order
(the cap patch applied / reverted, the prefix cache reset before every call), checks that both give the
same ScoreResults, and prints median seconds per verification and the ratio.

    python benchmarks/bench_verify_cache.py [--prompts 16] [--samples 8] [--prompt-len 256] [--draft-len 72]

The arms differ only in the prompt's share of the prefill: with the ~22-token prompts of the
bench-rollout recipes (shorter than one 32-token CPU block) nothing is read from the cache.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--draft-len", type=int, default=72)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()

    import megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs as verify
    from megatron_specrl.engines.protocol import SamplingSettings, ScoreRequest
    from megatron_specrl.engines.vllm import VLLMEngine
    from megatron_specrl.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        engine = VLLMEngine(str(model), name="bench-verify", seed=0, max_model_len=args.prompt_len + args.draft_len + 8,
                            kv_cache_gb=1.0, log_dir=Path(tmp) / "logs")
        vocab = engine.llm.llm_engine.model_config.get_vocab_size()
        rng = random.Random(0)
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        reqs = [ScoreRequest(p, [rng.randrange(3, vocab) for _ in range(args.draft_len)], seed=i * args.samples + k)
                for i, p in enumerate(prompts) for k in range(args.samples)]
        sampling = SamplingSettings(temperature=1.0)
        cap = verify._PATCHES[2]

        def run(cached: bool):
            cap.apply() if cached else cap.revert()
            engine.llm.reset_prefix_cache()
            t = time.perf_counter()
            out = engine.score(reqs, sampling, 0)
            return time.perf_counter() - t, out

        run(True), run(False)                                       # warm-up
        times = {True: [], False: []}
        results = {}
        for i in range(args.repeats):
            for cached in ((True, False) if i % 2 == 0 else (False, True)):     # ABBA: no order bias
                dt, results[cached] = run(cached)
                times[cached].append(dt)
        cap.apply()
        engine.shutdown()

    if results[True] != results[False]:
        sys.exit("verification results differ between the arms")
    read = sum(r.num_cached_tokens for r in results[True])
    total = len(reqs) * args.prompt_len
    with_cache, without = statistics.median(times[True]), statistics.median(times[False])
    print(f"{len(reqs)} verifications ({args.prompts} prompts x {args.samples} samples), prompts of {args.prompt_len} "
          f"tokens, drafts of {args.draft_len}; {args.repeats} alternating runs per arm")
    print(f"prompt tokens read from the cache: {read} of {total} ({read / total:.0%})")
    print(f"median seconds per verification: cache read {with_cache:.3f}, no cache {without:.3f}; "
          f"ratio {without / with_cache:.2f}x")


if __name__ == "__main__":
    main()
