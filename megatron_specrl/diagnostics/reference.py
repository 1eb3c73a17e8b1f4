"""An HF transformers reference of the learner's RL objective on a small synthetic batch: the
log-probs and gradients `megatron-specrl doctor` compares the Megatron learner with (the learner
layout tests compare TP / PP / DP layouts against the same reference)."""

from __future__ import annotations

import torch

B, T = 4, 12


def make_batch(hf_dir, seed: int = 0) -> dict:
    """Right-padded batch with ragged lengths, random advantages and perturbed old log-probs."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(str(hf_dir))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    lengths = torch.tensor([T, T - 3, T - 1, T - 5])
    am = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = torch.where(am.bool(), ids, torch.full_like(ids, cfg.pad_token_id))
    loss_mask = am.float().clone()
    loss_mask[:, :4] = 0
    return {
        "input_ids": ids, "attention_mask": am, "loss_mask": loss_mask,
        "advantages": torch.randn(B, 1, generator=g).expand(B, T).contiguous() * loss_mask,
        "noise": 0.3 * torch.randn(B, T, generator=g),
        "ref_noise": 0.2 * torch.randn(B, T, generator=g),
    }


def hf_reference(hf_dir, batch, loss_cfg, device="cpu"):
    """HF logits, log-probs and grads (HF names) of the same RL objective, computed on `device`
    (doctor: the GPU) and returned on the CPU."""
    from transformers import AutoModelForCausalLM

    from megatron_specrl.learner.losses import rl_policy_objective
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = model(batch["input_ids"]).logits
    logp = torch.log_softmax(logits.float(), -1)
    lp = logp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)[:, :-1]
    z = lp.new_zeros(lp.shape[0], 1)
    lp, ent = torch.cat([z, lp], 1), torch.cat([z, ent], 1)
    full = complete_batch(batch, lp.detach())
    loss, _ = rl_policy_objective(lp, ent, full, loss_cfg)
    loss.backward()
    grads = dict(checkpoint_layout((n, p.grad.cpu()) for n, p in model.named_parameters()))
    return logits.detach().cpu(), (lp.detach() * batch["attention_mask"]).cpu(), grads


def checkpoint_layout(named):
    """HF modules' tensors under the names the checkpoint files use: transformers >= 5 holds an MoE
    layer's experts fused (mlp.experts.gate_up_proj [E, 2F, H], gate first; down_proj [E, H, F]),
    its checkpoints one tensor per expert (mlp.experts.{e}.gate_proj.weight ...)."""
    for name, t in named:
        if name.endswith(".mlp.experts.gate_up_proj"):
            base, f = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}{e}.gate_proj.weight", t[e, :f]
                yield f"{base}{e}.up_proj.weight", t[e, f:]
        elif name.endswith(".mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                yield f"{base}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def complete_batch(batch, logprobs):
    """The batch with rollout / old / reference log-probs: `logprobs` plus the batch's noise."""
    out = {k: v for k, v in batch.items() if k not in ("noise", "ref_noise")}
    m = batch["attention_mask"].float()
    out["rollout_logprobs"] = (logprobs + batch["noise"]) * m
    out["old_logprobs"] = out["rollout_logprobs"]
    out["ref_logprobs"] = (logprobs + batch["ref_noise"]) * m
    return out


def loss_config():
    from megatron_specrl.config import LossConfig
    return LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, kl_coef=0.1, kl_type="low_var_kl",
                      entropy_coef=0.01, tis="off", agg_mode="token-mean")
