"""CUDA-only: a real SGLang engine on a GPU. The same engine class on SGLang's CPU path, against HF
transformers, is tests/integration/engines/test_sglang_engine.py; its plumbing against fakes,
tests/unit/engines/test_sglang_engine.py.
"""

import pytest
import torch
from megatron_specrl.engines.protocol import (
    GenerateRequest, ScoreRequest,
)
from megatron_specrl.engines.sglang import (
    SGLangEngine,
)


from megatron_specrl.engines.protocol import SamplingSettings

T1 = SamplingSettings()

def _sglang_gpu_available():
    try:
        import sglang  # noqa: F401
        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _sglang_gpu_available(), reason="needs CUDA and sglang")
def test_sglang_gpu_integration(tiny_llama):
    """On a GPU box: sampling log-probs == scoring log-probs, ban holds, update + flush."""
    eng = SGLangEngine(str(tiny_llama), name="sglang-gpu", log_dir="/tmp/specrl-sgl-test")
    try:
        prompt = list(range(5, 60))
        g = eng.generate([GenerateRequest(prompt, 16, seed=0)], T1, 0)[0]
        s = eng.score([ScoreRequest(prompt, g.token_ids)], T1, 0)[0]
        assert max(abs(a - b) for a, b in zip(g.logprobs, s.logprobs)) < 1e-3
        b = eng.generate([GenerateRequest(prompt, 4, seed=0, ban_first_token=g.token_ids[0])], T1, 0)[0]
        assert b.token_ids[0] != g.token_ids[0]
        from safetensors.torch import load_file
        w = load_file(str(tiny_llama / "model.safetensors"))
        eng.update_weights([(k, (v * 1.1).cuda()) for k, v in w.items()], 1)
        eng.finish_update(1)
        g2 = eng.generate([GenerateRequest(prompt, 4, seed=0)], T1, 1)[0]
        assert g2.num_cached_tokens == 0
    finally:
        eng.shutdown()


