"""What verifying a draft costs inside one decode step: a forward over q new tokens per sequence
against the usual one, at RL batch sizes, with a KV cache of `--context` tokens behind each sequence.

Tree drafting trades decode steps for wider ones: on the 2-core CPU a drafted step cost 2-2.6x a plain
one (README, "Where the time goes"), which is what keeps the exact mode below 2.5x there. On a GPU a
decode step is memory-bound (weights and KV read once per step), so q tokens should cost about what one
does until the step turns compute-bound. This prints the ratio side by side for each batch size, so the
decode-step counts measured on CPU (`bench-rollout`'s 'steps / rollout') can be turned into a GPU estimate.
It also fits the measured steps as ms = a + b x requests + c x draft tokens, the form `bench-rollout` fits on
CPU, and prints the `benchmarks/replay_drafts.py --step-cost a,b,c` that prices a bench run's recorded steps
(its dumps: the requests and draft tokens of every engine step) at this GPU's cost.

HF transformers, random weights in the model's shape (no download), eager PyTorch with SDPA: no CUDA
graphs and no vLLM scheduler or sampler, so the plain step's fixed launch cost is larger than vLLM's
and its per-step Python is missing; the ratios are the model forward's alone.

    python benchmarks/bench_verify_cost.py                       # Qwen2.5-7B shape, bf16, on the GPU
    python benchmarks/bench_verify_cost.py --shape tiny --batch 4,8,16,32 --context 64 --queries 1,2,4   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the step-cost fit: megatron_specrl (numpy only)

SHAPES = {
    # name: (hidden, layers, heads, kv_heads, ffn, vocab)
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936),
    "tiny": (128, 2, 4, 2, 256, 264),
}


def build(shape: str, dtype, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    hidden, layers, heads, kv, ffn, vocab = SHAPES[shape]
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                      max_position_embeddings=32768, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)          # built in the target dtype: no fp32 copy of a 7B model
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval(), cfg


def filled_cache(cfg, batch: int, context: int, dtype, device):
    """A DynamicCache holding `context` random keys and values per sequence (timing needs no real ones)."""
    from transformers import DynamicCache
    cache = DynamicCache(config=cfg)
    hd = cfg.hidden_size // cfg.num_attention_heads
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(batch, cfg.num_key_value_heads, context, hd, dtype=dtype, device=device)
        cache.update(k, torch.randn_like(k), layer)
    return cache


@torch.no_grad()
def step_ms(model, cache, batch: int, context: int, q: int, device, repeats: int) -> float:
    """Median ms of one forward over q new tokens per sequence (the cache cropped back after each)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(0, model.config.vocab_size, (batch, q), device=device)
    pos = torch.arange(context, context + q, device=device)
    times = []
    for i in range(repeats + 2):
        sync()
        t0 = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, cache_position=pos, position_ids=pos[None].expand(batch, q),
              use_cache=True, logits_to_keep=q)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        cache.crop(-q)      # drop this forward's q tokens (a negative length: the form every version takes)
        assert cache.get_seq_length() == context, cache.get_seq_length()
    return sorted(times)[len(times) // 2] * 1e3


def fit_step_cost(rows: list[dict]) -> tuple[float, float, float]:
    """(a, b, c) of ms = a + b r + c d over the measured (batch, q) grid, by the engines' own least squares
    (rollout/tree_drafting/cost_model.fit_step_cost): r = batch requests, d = batch x (q - 1) draft tokens (a drafted step
    verifies q - 1 draft tokens and samples one more)."""
    from megatron_specrl.rollout.tree_drafting.cost_model import add_step_cost
    from megatron_specrl.rollout.tree_drafting.cost_model import fit_step_cost as fit_sums
    sums: dict = {}
    for row in rows:
        for q, ms in row["ms"].items():
            add_step_cost(sums, row["batch"], row["batch"] * (int(q) - 1), ms / 1e3)
    fit = fit_sums(sums)
    if fit is None:
        raise ValueError(f"{sum(len(r['ms']) for r in rows)} (batch, q) points: the step-cost fit needs 10")
    return fit.a, fit.b, fit.c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--batch", default="32,128,256")
    ap.add_argument("--queries", default="1,4,8,16", help="new tokens per sequence in one forward (1 = plain decode)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = [int(x) for x in args.batch.split(",")]
    if len(batches) * len(args.queries.split(",")) < 10:
        raise SystemExit(f"--batch {args.batch} x --queries {args.queries}: the step-cost fit needs 10 (batch, q) "
                         "points; pass more values")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, cfg = build(args.shape, dtype, device)
    qs = [int(x) for x in args.queries.split(",")]
    rows = []
    print(f"{args.shape} {str(dtype).removeprefix('torch.')} on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, "
          f"context {args.context}")
    print("batch  " + "  ".join(f"q={q}: ms (x q=1)" for q in qs))
    for b in batches:
        cache = filled_cache(cfg, b, args.context, dtype, device)
        ms = {q: step_ms(model, cache, b, args.context, q, device, args.repeats) for q in qs}
        rows.append({"batch": b, "ms": ms, "ratio": {q: ms[q] / ms[qs[0]] for q in qs}})
        print(f"{b:5d}  " + "  ".join(f"{ms[q]:8.2f} ({ms[q] / ms[qs[0]]:.2f}x)" for q in qs), flush=True)
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    a, b, c = fit_step_cost(rows)
    print(f"fit: ms / step = {a:.3f} + {b:.4f} r + {c:.5f} d (r requests, d draft tokens); price a bench run's steps "
          f"with: python benchmarks/replay_drafts.py <bench output>/rollouts --step-cost {a:.3f},{b:.4f},{c:.5f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "dtype": str(dtype), "context": args.context, "rows": rows,
                       "fit_ms": {"a": a, "b": b, "c": c}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
