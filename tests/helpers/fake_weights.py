"""A small HF-named state dict (mixed dtypes, three layers) for the resync bucket and transport tests."""

import torch


def model_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [("model.embed_tokens.weight", torch.randn(64, 16, generator=g))]
    for i in range(3):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", torch.randn(16, 16, generator=g)),
                (p + "self_attn.k_proj.weight", torch.randn(8, 16, generator=g).to(torch.bfloat16)),
                (p + "mlp.gate_proj.weight", torch.randn(32, 16, generator=g)),
                (p + "input_layernorm.weight", torch.ones(16))]
    out += [("model.norm.weight", torch.ones(16)), ("lm_head.weight", torch.randn(64, 16, generator=g))]
    return out


def recorded_tensors(pulled: list[str]):
    """model_tensors() as a lazy source (like the learner's collective gather) that appends each
    name to `pulled` as it is taken: shows how far a consumer drained it."""
    for name, tensor in model_tensors():
        pulled.append(name)
        yield name, tensor
