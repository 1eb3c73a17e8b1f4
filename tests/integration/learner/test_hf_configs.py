"""Real HF configs (Llama 3.1, Qwen2.5) through the converter: fields that change the math are either

The tests of this subject that start processes or engines; the rest are in tests/unit/learner/test_hf_configs.py.
"""

from __future__ import annotations
import pytest


from tests.helpers.hf_configs import LLAMA31_8B, _tiny_llama31  # noqa: F401

@pytest.mark.slow
def test_sharded_bf16_llama31_explicit_head_dim_matches_hf(tiny_llama, tmp_path):
    """Megatron learner (fp32, TP2) on a sharded bf16 Llama-3.1-style checkpoint with head_dim=48:
    logits, log-probs and gradients equal HF transformers' (loaded in fp32) at 1e-5."""
    from tests.helpers.learner import _run
    d = _tiny_llama31(tmp_path / "l31", tiny_llama, head_dim=48)
    out = tmp_path / "run"
    out.mkdir()
    _run(d, out, 2, [(2, 1, 1, None)])


