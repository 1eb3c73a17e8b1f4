"""How far the trees' drafts are from the best single-chain drafter, at fixed weights.

vLLM 0.32 verifies one chain of draft tokens per request, and a point-mass draft token x is accepted with
probability p(x). The chain that gains the most tokens, token by token, is the policy's own argmax
continuation: its first token is accepted with probability max p. Replayed on tokens the policy really
sampled, that drafter's token is accepted exactly where the sampled token is the argmax of the policy's
distribution at that position (the policy's samples are what they are whatever was drafted; see
benchmarks/replay_drafts.py). So one teacher-forced forward over each sampled response gives the decode steps
a rollout would take with drafts that were the policy's own greedy continuation: a bound on what any
draft source (trees, a draft model, EAGLE / MTP heads) can gain with single-chain verification.

It samples `--rounds` earlier rollouts of 16 prompts x 8 samples (the trees' history, as in a run that has
seen every prompt that often) and one more, all at the same weights, with HF transformers (no engine:
only the tokens matter), and replays the last rollout three ways under the engine's draft-length rule
(`TreeDrafter.draft_len`: about `--token-budget` tokens verified a step):

- `plain`:  one token a step;
- `tree`:   the TreeDrafter the engines run, its prompt and shared trees holding the earlier rounds;
- `argmax`: the policy's greedy continuation as the draft.

With `--draft-model DIR` (repeatable) it also replays draft models as vLLM's `draft_model` method runs them
(rollout.draft=model): each proposes its own greedy chain of `--draft-model-tokens` tokens, accepted up to
the first position where it differs from the sampled token (teacher-forced on the sampled tokens: the
chain's accepted prefix is exactly those tokens), beside `argmax@K`, the policy's own chain of the same
length. So a candidate draft model can be judged on the policy's samples without running it in an engine;
the draft model's own forwards are not priced.

It prints decode steps per rollout, request-steps, draft tokens accepted per request-step, how many
request-steps had a draft and how often its first token was accepted, and how often the sampled token
was the argmax (the argmax drafter's per-token acceptance).

    python benchmarks/draft_bound.py --model ~/.cache/megatron_specrl/warmup/warmup-<hash> [--rounds 5]
        [--temperature 1.0] [--top-p 1.0] [--step-cost A,B,C]   # and the decode loops priced at that cost
        [--draft-model DIR [--draft-model DIR ...] --draft-model-tokens 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def chain_steps(hits: Sequence[Sequence[bool]], draft_len: Callable[[int], int]) -> dict:
    """Decode steps of one rollout whose requests draft chains accepted where `hits` says.

    hits[i][t]: whether request i's draft token for response position t would be accepted (the drafter
    proposes the sampled token there). As in the engine and in replay_drafts.replay_step: the prefill
    step samples every request's first token; each later step verifies a chain of up to
    draft_len(requests the last step ran) tokens per running request, keeps the accepted prefix and
    samples one more token (bonus or recovered); the rollout runs until its longest request ends."""
    pos = [1 if len(h) else 0 for h in hits]
    running = [i for i, h in enumerate(hits) if len(h)]
    steps, request_steps, accepted, drafted = 1 if running else 0, 0, 0, 0
    first_drafted = first_accepted = cost_requests = 0
    while running:
        n_running = len(running)
        k = draft_len(n_running)
        running = [i for i in running if pos[i] < len(hits[i])]
        if not running:
            break
        steps += 1
        cost_requests += n_running   # as replay_step counts them for the step-cost price
        for i in running:
            h, p = hits[i], pos[i]
            rest = len(h) - p
            chain = min(k, rest)
            a = 0
            while a < chain and h[p + a]:
                a += 1
            pos[i] += min(a + 1, rest)
            request_steps += 1
            accepted += a
            drafted += chain
            if chain:
                first_drafted += 1
                first_accepted += a > 0
    return {"steps": steps, "request_steps": request_steps, "accepted": accepted, "drafted": drafted,
            "first_drafted": first_drafted, "first_accepted": first_accepted, "cost_requests": cost_requests}


def argmax_hits(model, rows: list[dict]) -> list[list[bool]]:
    """Per response position: whether the sampled token is the argmax of `model`'s logits there (the
    policy's: its own greedy draft; a draft model's: its draft, while the chain so far was accepted)."""
    import torch
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            n = len(r["prompt_ids"])
            am = model(ids).logits[0, n - 1:-1].argmax(-1).tolist()
            out.append([a == t for a, t in zip(am, r["response_ids"])])
    return out


def sample_round(model, prompts: list[list[int]], samples: int, max_new_tokens: int, temperature: float,
                 top_p: float, eos: int) -> list[dict]:
    """`samples` responses to each prompt (HF generate; temperature 0: greedy), cut after EOS."""
    import torch
    rows = []
    for pi, p in enumerate(prompts):
        x = torch.tensor([p] * samples)
        kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else dict(do_sample=False)
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=eos, **kw)
        for s in range(samples):
            r = out[s, len(p):].tolist()
            r = r[:r.index(eos) + 1] if eos in r else r
            rows.append({"prompt_id": f"p{pi}", "sample_idx": s, "prompt_ids": p, "response_ids": r})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF checkpoint of the task (a warm-up checkpoint)")
    ap.add_argument("--rounds", type=int, default=5, help="earlier rollouts of every prompt in the trees")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--draft-tokens", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--step-cost", default=None, metavar="A,B,C",
                    help="price each decode loop at A ms a step + B ms a request + C ms a draft token "
                         "(benchmarks/bench_verify_cost.py prints a GPU's; bench-rollout a CPU's)")
    ap.add_argument("--draft-model", action="append", default=[], metavar="DIR",
                    help="an HF draft model with the policy's vocabulary, replayed as rollout.draft=model drafts")
    ap.add_argument("--draft-model-tokens", type=int, default=4, help="the draft models' chain length (draft_tokens)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    from replay_drafts import loop_ms, parse_step_cost, plain_loop_ms, replay_step   # the engine loop's replay

    cost = parse_step_cost(args.step_cost)
    model_dir = Path(args.model).expanduser()
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: not an HF checkpoint directory (no config.json)")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: the trees need at least one earlier rollout")
    if args.draft_model_tokens < 1:
        raise SystemExit(f"--draft-model-tokens {args.draft_model_tokens}: a draft model drafts at least one token")
    from megatron_specrl.config import ConfigError
    from megatron_specrl.models.resolve import check_draft_model
    for d in args.draft_model:
        try:
            check_draft_model(Path(d).expanduser(), model_dir)
        except ConfigError as e:
            raise SystemExit(f"--draft-model {d}: {str(e).split(': ', 1)[1]}") from None

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_specrl.data.synthetic import make_problems
    from megatron_specrl.diagnostics.machine import machine
    from megatron_specrl.rollout.tree_drafting.drafter import TreeDrafter

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    info = model_dir / "warmup.json"
    task = json.loads(info.read_text())["task"] if info.is_file() else {}
    problems = make_problems(args.prompts, seed=args.seed, min_terms=task.get("min_terms", 3),
                             max_terms=task.get("max_terms", 6), max_value=task.get("max_value", 9))
    prompts = [tok(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    sample = lambda: sample_round(model, prompts, args.samples, args.max_new_tokens, args.temperature,  # noqa: E731
                                  args.top_p, tok.eos_token_id)
    history = [sample() for _ in range(args.rounds)]
    rows = sample()

    settings = {"token_budget": args.token_budget}
    drafter = TreeDrafter(args.draft_tokens, 1 << 20, settings)
    for k, old in enumerate(history):
        replay_step(drafter, old, f"h{k}", None, args.max_new_tokens)
    tree = replay_step(drafter, rows, "last", None, args.max_new_tokens)
    hits = argmax_hits(model, rows)
    argmax = chain_steps(hits, drafter.draft_len)
    plain = chain_steps([[False] * len(r["response_ids"]) for r in rows], lambda running: 0)
    k_model = args.draft_model_tokens
    drafts = {}   # with --draft-model: the policy's own chain of the same length beside each draft model's
    if args.draft_model:
        drafts[f"argmax@{k_model}"] = chain_steps(hits, lambda running: k_model)
    for d in args.draft_model:
        draft = AutoModelForCausalLM.from_pretrained(Path(d).expanduser()).eval()
        drafts[f"model:{Path(d).name}"] = chain_steps(argmax_hits(draft, rows), lambda running: k_model)
    result = {
        "plain": plain, "argmax": argmax, **drafts,
        "tree": {k: tree[k] for k in ("steps", "request_steps", "accepted", "drafted", "first_drafted",
                                      "first_accepted", "cost_requests")},
        "argmax_token_rate": statistics.mean(h for hs in hits for h in hs),
        "mean_response_tokens": statistics.mean(len(r["response_ids"]) for r in rows),
        "settings": vars(args), "machine": machine(),   # the sampled tokens depend on the CPU's kernels
    }
    print(f"{len(rows)} requests, {result['mean_response_tokens']:.1f} tokens a response, {args.rounds} earlier "
          f"rollouts in the trees, temperature {args.temperature}, top-p {args.top_p}")
    names = ("plain", "tree", "argmax", *drafts)
    w = max(map(len, names))
    print(f"{'drafts':>{w}} {'decode steps':>13} {'request-steps':>14} {'accepted / request-step':>24} "
          f"{'drafted / request-step':>23} {'first draft token accepted':>27}")
    for name in names:
        r = result[name]
        n = max(r["request_steps"], 1)
        print(f"{name:>{w}} {r['steps']:>13} {r['request_steps']:>14} {r['accepted'] / n:>24.2f} "
              f"{r['first_drafted'] / n:>23.0%} {r['first_accepted'] / max(r['first_drafted'], 1):>27.3f}")
    print(f"sampled token = the policy's argmax at {result['argmax_token_rate']:.3f} of positions")
    if cost:
        plain_ms = plain_loop_ms([tree], cost)   # replay_step prices plain decoding of the same responses
        result["loop_ms"] = {"plain": plain_ms, "tree": loop_ms([tree], cost), "argmax": loop_ms([argmax], cost),
                             **{name: loop_ms([r], cost) for name, r in drafts.items()}}   # drafting unpriced
        print("decode loop at " + args.step_cost + ": " + ", ".join(
            f"{name} {ms:.0f} ms ({plain_ms / ms:.2f}x)" for name, ms in result["loop_ms"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
