"""KL in the reward (verl's `algorithm.use_kl_in_reward`): every response token's reward is lowered by
beta x KL_t(policy || reference), classic RLHF PPO's leash on the initial policy, with beta fixed or
adapted towards a target KL (Ziegler et al. 2019, verl's AdaptiveKLController).

Where the KL loss (learner.loss.kl_coef) puts the penalty in the gradient, this puts it in the
return: PPO's GAE spreads it over earlier tokens, and GRPO / DAPO rank a group's samples by score
minus their summed KL (verl's GRPO advantage uses the token rewards' sum too).
"""

from __future__ import annotations

import torch

from megatron_specrl.learner.losses import kl_penalty


class RewardKLController:
    """beta, the KL penalty's coefficient, and its update after each step (verl's Fixed / Adaptive
    KLController: adaptive multiplies beta by 1 + clip(KL / target - 1, -0.2, 0.2) x n / horizon,
    n being the step's number of responses). Its state goes into run checkpoints: a resumed
    adaptive run goes on with the beta it had reached."""

    def __init__(self, kind: str, kl_coef: float, target_kl: float, horizon: int):
        if kind not in ("fixed", "adaptive"):
            raise ValueError(f"algorithm.kl_ctrl.type must be fixed or adaptive, not {kind!r}")
        self.kind, self.value, self.target, self.horizon = kind, float(kl_coef), float(target_kl), int(horizon)

    def update(self, current_kl: float, n_responses: int) -> None:
        if self.kind == "adaptive":
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_responses / self.horizon

    def state_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """An adaptive run resumes with the beta it had reached; a run resumed under another
        controller type starts from its own configured kl_coef (the saved beta belonged to the other)."""
        if state.get("kind") == self.kind == "adaptive":
            self.value = float(state["value"])


def kl_cost(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, ctrl: RewardKLController,
            kind: str = "kl") -> tuple[torch.Tensor, dict[str, float]]:
    """(beta x KL estimate per response token, metrics), then beta's update; the caller subtracts the
    cost from the token rewards (verl's apply_kl_penalty: token_level_scores - beta x kld).

    All [B, T], aligned with input_ids; `logprobs` are the policy's that sampled the batch (the PPO
    ratio's old log-probs), `kind` one of learner.losses.KL_TYPES (verl's kl_penalty names). The
    metric `actor/reward_kl_penalty` is the mean over responses of each one's per-token mean KL,
    as verl logs it, and `actor/reward_kl_penalty_coeff` the beta applied this step."""
    mask = mask.to(torch.float32)
    kld = kl_penalty(logprobs.to(torch.float32), ref_logprobs.to(torch.float32), kind) * mask
    beta = ctrl.value
    current_kl = float((kld.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean())
    ctrl.update(current_kl, mask.shape[0])
    return beta * kld, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
