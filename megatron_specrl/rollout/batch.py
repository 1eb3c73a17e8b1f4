"""Rollout samples -> the learner's padded batch tensors.

Every per-token tensor is aligned with input_ids: the value at t is about token
input_ids[t] (predicted from the logits at t-1). The loss mask covers response
tokens including a final EOS and never padding; pad and EOS may be different
ids or the same one, the mask comes from lengths, not from token values.
"""

from __future__ import annotations

import torch

from megatron_specrl.rollout.speculative import RolloutSample


def build_batch(samples: list[RolloutSample], advantages: torch.Tensor, pad_id: int,
                pad_to_multiple: int = 1) -> dict[str, torch.Tensor]:
    """advantages: [N] (one per sample, broadcast over its tokens) or [N, T] already token-aligned."""
    if not samples:
        raise ValueError("cannot build a learner batch from zero rollout samples")
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    T = max(lengths)
    T = -(-T // pad_to_multiple) * pad_to_multiple
    N = len(samples)
    input_ids = torch.full((N, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(N, T, dtype=torch.long)
    loss_mask = torch.zeros(N, T)
    rollout_logprobs = torch.zeros(N, T)
    token_adv = torch.zeros(N, T)
    for i, s in enumerate(samples):
        P, R = len(s.prompt_ids), len(s.response_ids)
        if len(s.logprobs) != R:
            raise ValueError(f"sample {s.prompt_id}/{s.sample_idx}: {R} response tokens but {len(s.logprobs)} log-probs")
        if P == 0:
            raise ValueError(f"sample {s.prompt_id}/{s.sample_idx} has an empty prompt")
        input_ids[i, : P + R] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention_mask[i, : P + R] = 1
        loss_mask[i, P: P + R] = 1.0
        rollout_logprobs[i, P: P + R] = torch.tensor(s.logprobs, dtype=torch.float32)
        if advantages.dim() == 1:
            token_adv[i, P: P + R] = float(advantages[i])
        else:
            token_adv[i] = advantages[i, :T] * loss_mask[i]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "rollout_logprobs": rollout_logprobs,
        "old_logprobs": rollout_logprobs.clone(),
        "advantages": token_adv,
    }
