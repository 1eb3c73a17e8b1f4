"""Engine fixtures of this folder: a sharpened tiny Llama, and HF transformers' tiny Llama to compare engines with."""

import shutil

import pytest
import torch

from tests.helpers.engines import EOS, PROMPT, SHARPEN


@pytest.fixture(scope="module")
def sharp_llama(tiny_llama, tmp_path_factory):
    """tiny Llama, LM head x12; EOS's row a scaled copy of the top token's at PROMPT."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    out = tmp_path_factory.mktemp("sharp-llama")
    shutil.copytree(tiny_llama, out, dirs_exist_ok=True)
    w = load_file(str(tiny_llama / "model.safetensors"))
    m = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        top = int(m(torch.tensor([PROMPT])).logits[0, -1].argmax())
    head = w["lm_head.weight"] * SHARPEN
    head[EOS] = 0.97 * head[top]
    w["lm_head.weight"] = head.contiguous()
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    """HF transformers' tiny Llama in fp32 (tests.helpers.engines.hf_logprobs scores with it)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
