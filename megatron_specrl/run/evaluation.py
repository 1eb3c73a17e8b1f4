"""Held-out accuracy every trainer.eval_every steps (and at step 0): plain generation, no drafts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings
from megatron_specrl.rollout.speculative import stable_seed

if TYPE_CHECKING:
    from megatron_specrl.run.state import Run


def evaluate(run: Run) -> dict[str, float]:
    """Accuracy on the held-out prompts (plain generation, no drafts): greedy, or with
    rollout.val_kwargs.do_sample n seeded samples a prompt. eval/accuracy and eval/reward_mean are
    means over every sample (verl's mean@n); with n > 1 also eval/pass@n, the share of prompts with a
    correct sample."""
    if not run.eval_records:
        return {}
    vk = run.cfg.rollout.val_kwargs
    sampling = (SamplingSettings(vk.temperature, vk.top_p, vk.top_k, need_logprobs=False) if vk.do_sample
                else SamplingSettings(temperature=0.0, need_logprobs=False))
    n = vk.n if vk.do_sample else 1
    records = [r for r in run.eval_records for _ in range(n)]
    # the first sample keeps greedy eval's seed; others are seeded by their index (the same at every eval)
    reqs = [GenerateRequest(run.eval_prompt_ids[r.id], run.cfg.rollout.max_new_tokens,
                            seed=stable_seed("eval", r.id) if k == 0 else stable_seed("eval", r.id, k))
            for r in run.eval_records for k in range(n)]
    results = run.engine.generate(reqs, sampling, run.version)
    texts = run.tokenizer.batch_decode([r.token_ids for r in results], skip_special_tokens=True)
    scores = [float(run.reward_fn(t, rec)) for t, rec in zip(texts, records)]
    metrics = {"eval/reward_mean": sum(scores) / len(scores),
               "eval/accuracy": sum(s > 0 for s in scores) / len(scores)}
    if n > 1:
        solved = [any(s > 0 for s in scores[i:i + n]) for i in range(0, len(scores), n)]
        metrics[f"eval/pass@{n}"] = sum(solved) / len(solved)
    return metrics
