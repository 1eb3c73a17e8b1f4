"""VLLMEngine at its limits, each on an engine of its own (a second in-process engine's shutdown tears
down vLLM's process groups, so these never share the session engine of test_vllm_engine.py, which runs
before them): a verification at the model's last position, and NaN log-probs from generation.

An engine actor that dies while it starts names the reason in the one line the user reads (Ray's
own first line says only that the actor died in its creation task).
"""

import os
import random
import numpy as np
import pytest
import torch
from megatron_specrl.engines.ray_engine import death_cause



# ---- VLLMEngine at its limits, each on an engine of its own (a second in-process engine's shutdown tears

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.engines.protocol import (  # noqa: E402
    EngineError, GenerateRequest, SamplingSettings, ScoreRequest,
)

BLOCK = 32


def rand_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 263) for _ in range(n)]


def _engine(model, tmp_path, name):
    from megatron_specrl.engines.vllm import VLLMEngine
    return VLLMEngine(str(model), name=name, seed=0, max_model_len=128, kv_cache_gb=0.05, block_size=BLOCK,
                      log_dir=tmp_path)


def test_score_at_the_models_last_position_verifies_all_but_the_last_token(tmp_path):
    """rollout.max_model_len = max_position_embeddings: the engine gets no position beyond it, and a
    verification filling it left vLLM no room for its one sampled token (the whole score batch
    failed). It verifies all but the last token (protocol.score), with HF's tempered log-probs; a
    shorter request in the same batch is untouched."""
    from transformers import AutoModelForCausalLM

    from megatron_specrl.models.tiny import build_tiny_model
    model_dir = build_tiny_model(tmp_path / "pos128", arch="llama", seed=0, max_position_embeddings=128)
    prompt, cont, cont2 = rand_ids(40, 31), rand_ids(88, 32), rand_ids(30, 33)
    sampling = SamplingSettings(temperature=0.7, top_p=0.9)
    eng = _engine(model_dir, tmp_path, "vllm-pos128")
    try:
        assert eng.llm.llm_engine.model_config.max_model_len == 128
        full, part = eng.score([ScoreRequest(prompt, cont, seed=1), ScoreRequest(prompt, cont2, seed=1)], sampling, 0)
    finally:
        eng.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def tempered(c):
        ids = torch.tensor([prompt + c])
        with torch.no_grad():
            lp = (hf(ids).logits[0, :-1].float() / 0.7).log_softmax(-1)
        return lp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(prompt) - 1:].numpy()

    assert len(full.logprobs) == len(full.sample_logprobs) == len(full.replacements) == len(cont) - 1
    assert np.allclose(full.logprobs, tempered(cont)[:-1], atol=1e-4)
    assert len(part.logprobs) == len(cont2) and np.allclose(part.logprobs, tempered(cont2), atol=1e-4)


def test_nan_log_probs_from_generation_are_an_engine_error(tiny_llama, tmp_path):
    """NaN weights in the engine (a corrupted resync) gave NaN log-probs that reached the learner as
    TIS weights / PPO old log-probs; generate() refuses them, naming the engine."""
    from safetensors.torch import load_file
    eng = _engine(tiny_llama, tmp_path, "vllm-nan")
    try:
        ok = eng.generate([GenerateRequest(rand_ids(10, 41), 4, seed=0)], SamplingSettings(), 0)[0]
        assert len(ok.logprobs) == 4 and np.isfinite(ok.logprobs).all()
        name = "model.norm.weight"
        weight = load_file(str(tiny_llama / "model.safetensors"))[name]
        eng.update_weights([(name, torch.full_like(weight, float("nan")))], 1)
        eng.finish_update(1)
        with pytest.raises(EngineError, match=r"\[vllm-nan\] generate: log-prob nan"):
            eng.generate([GenerateRequest(rand_ids(10, 41), 4, seed=0)], SamplingSettings(), 1)
    finally:
        eng.shutdown()


# ---- An engine actor that dies while it starts names the reason in the one line the user reads (Ray's

CREATION = ("The actor died because of an error raised in its creation task, \x1b[36mray::EngineActor.__init__()"
            "\x1b[39m (pid=29384, ip=192.0.2.2, actor_id=ea34, repr=<EngineActor object at 0x7f>)\n"
            "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
            '  File "/work/main/megatron_specrl/engines/vllm/args.py", line 43, in bind_cpu_workers\n'
            "    raise ValueError(f\"engine tensor_parallel_size={n} needs a CPU per worker; \"\n{}")


@pytest.mark.parametrize("tail, expected", [
    ("ValueError: engine tensor_parallel_size=4 needs a CPU per worker; this process may use 2",
     "its start raised ValueError: engine tensor_parallel_size=4 needs a CPU per worker; this process may use 2"),
    ("megatron_specrl.engines.protocol.EngineError: [vllm-0] vLLM failed to start: RuntimeError('no KV room')\n"
     "--- last engine log lines ---\n2026-11-24 12:38:05,172 INFO starting vLLM engine",
     "its start raised EngineError: [vllm-0] vLLM failed to start: RuntimeError('no KV room')"),
])
def test_a_start_failure_names_the_exception(tail, expected):
    assert death_cause(RuntimeError(CREATION.replace("{}", tail))) == expected


def test_other_deaths_keep_rays_first_line():
    assert death_cause(RuntimeError("The actor died unexpectedly before finishing this task.\n  more")) == \
        "The actor died unexpectedly before finishing this task."
    assert death_cause(RuntimeError("")) == "RuntimeError"
    # a creation-task death whose traceback ends in no exception line: Ray's line, not a guess
    assert death_cause(RuntimeError("The actor died because of an error raised in its creation task, x\n  ^^^")) == \
        "The actor died because of an error raised in its creation task, x"
