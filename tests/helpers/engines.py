"""The prompt and the sharpening of the tiny Llama (tests/integration/engines/conftest.py: `sharp_llama`) whose
engine tests see clear acceptance and rejection."""

from __future__ import annotations

import random


EOS = 1
SHARPEN = 12.0
PROMPT = [random.Random(0).randrange(3, 263) for _ in range(8)]


def hf_logprobs(model, prompt, cont) -> list[float]:
    """HF transformers' log-probs of `cont`'s tokens after `prompt` (fp32 log_softmax): what an engine's
    prompt and sampling log-probs are compared with."""
    import torch
    ids = torch.tensor([list(prompt) + list(cont)])
    with torch.no_grad():
        lp = model(ids).logits[0, :-1].float().log_softmax(-1)
    tgt = ids[0, 1:]
    return lp[torch.arange(len(tgt)), tgt][len(prompt) - 1:].tolist()
