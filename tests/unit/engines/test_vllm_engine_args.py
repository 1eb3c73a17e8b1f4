"""verl's engine keys (rollout.enforce_eager, cudagraph_capture_sizes, max_num_seqs,
max_num_batched_tokens, engine_kwargs.vllm / .sglang) reach vLLM and SGLang as their arguments.

Before 2026-11-25 every vLLM engine ran eager (enforce_eager=True hard-coded), on GPUs too: no CUDA
graphs, a kernel launch per op every decode step. The GPU arguments are built here with the engine's
pure argument builder (engines/vllm/args.llm_args), since no GPU is on this machine.

The vLLM engine's sampling edges. No vLLM engine is started: the two bugs
sit in code that runs before the engine (the temperature vLLM would change) or after it (reading the
verification columns), and are driven here through the patch's own math (`verify_rows`).

1. A verification row the model did not compute finitely (NaN / +inf logits) came back with a
   "replacement" drawn from NaN probabilities: the vocabulary's last token (coupled: token 0) with
   NaN log-probs. Acceptance rejects at the NaN, so the exact and coupled rollouts took that token as
   the first new one and stored / handed the learner a NaN log-prob. Such rows now have none (-1):
   the extension samples the position, and generate() refuses non-finite log-probs.
2. vLLM raises a temperature in (0, 0.01) to 0.01 with only a warning: rollouts were sampled and
   verified at 0.01 while the learner tempered with the configured temperature. The engine refuses
   it where log-probs matter (training generate, score); eval (need_logprobs=False) is unchanged.
"""

import sys
import types
import pytest
from megatron_specrl.config import ConfigError, RolloutConfig, load_config, resolve_recipe
from megatron_specrl.engines import factory
import os



# ---- verl's engine keys (rollout.enforce_eager, cudagraph_capture_sizes, max_num_seqs,



def test_gpu_engines_run_cuda_graphs_unless_told_and_cpu_engines_run_eager(tmp_path):
    gpu = _args(tmp_path, on_cpu=False)
    assert gpu["enforce_eager"] is False                    # verl's enforce_eager: false
    assert "kv_cache_memory_bytes" not in gpu and "enable_chunked_prefill" not in gpu
    assert "max_num_seqs" not in gpu and "max_num_batched_tokens" not in gpu   # vLLM's own defaults
    assert gpu["speculative_config"]["method"] == "custom_class" and gpu["async_scheduling"] is False
    assert _args(tmp_path, on_cpu=False, enforce_eager=True)["enforce_eager"] is True
    cpu = _args(tmp_path, on_cpu=True)
    assert cpu["enforce_eager"] is True                     # no inductor compile at start
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] == 8192
    assert _args(tmp_path, on_cpu=True, enforce_eager=False)["enforce_eager"] is False   # asked: honoured


def test_capture_sizes_scheduler_limits_and_engine_kwargs_reach_vllm(tmp_path):
    kw = _args(tmp_path, on_cpu=False, cudagraph_capture_sizes=[8, 1, 2, 8], max_num_seqs=256,
               max_num_batched_tokens=4096,
               engine_args={"compilation_config": {"cudagraph_mode": "PIECEWISE"}, "max_logprobs": 5},
               known_args={"compilation_config", "max_logprobs"})
    assert kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 8]}
    assert kw["max_num_seqs"] == 256 and kw["max_num_batched_tokens"] == 4096 and kw["max_logprobs"] == 5
    with pytest.raises(ValueError, match="needs CUDA graphs"):
        _args(tmp_path, on_cpu=False, enforce_eager=True, cudagraph_capture_sizes=[1])
    # a GPU recipe's capture sizes tried on a CPU (enforce_eager unset: eager there) start, capturing nothing
    assert "compilation_config" not in _args(tmp_path, on_cpu=True, cudagraph_capture_sizes=[1, 2])
    # a CPU engine prefills a whole sequence a step (no chunked prefill): a smaller budget is refused
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=100: .* at least the engine's max_model_len, 273"):
        _args(tmp_path, on_cpu=True, max_num_batched_tokens=100)
    assert _args(tmp_path, on_cpu=True, max_num_batched_tokens=300)["max_num_batched_tokens"] == 300




def test_config_refuses_in_one_line_what_the_engines_could_not_honour():
    recipe = resolve_recipe("tiny-cpu-grpo")
    bad = {
        ("rollout.engine_kwargs.vllm.max_model_len=4",): "rollout.engine_kwargs.vllm.max_model_len: set through "
                                                         "rollout.max_model_len",
        ("rollout.engine_kwargs.sglang.tp_size=2",): "rollout.engine_kwargs.sglang.tp_size: set through "
                                                     "rollout.engine_tp",
        ("rollout.enforce_eager=true", "rollout.cudagraph_capture_sizes=[1,2]"): "needs CUDA graphs",
        ("rollout.cudagraph_capture_sizes=[0]",): "expected a non-empty list of batch sizes >= 1",
        ("rollout.engine=sglang", "rollout.max_num_batched_tokens=4096"): "engine_kwargs.sglang.chunked_prefill_size",
        ("rollout.max_num_seqs=0",): "rollout.max_num_seqs",
    }
    for overrides, message in bad.items():
        with pytest.raises(ConfigError) as e:
            load_config(recipe, list(overrides))
        assert message in str(e.value) and "\n" not in str(e.value), (overrides, str(e.value))
    cfg = load_config(recipe, ["rollout.max_num_seqs=64", "rollout.engine_kwargs.vllm.disable_log_stats=true"])
    assert cfg.rollout.max_num_seqs == 64 and cfg.rollout.engine_kwargs.vllm == {"disable_log_stats": True}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_factory_hands_each_engine_its_own_engine_kwargs(monkeypatch, tmp_path, engine):
    if engine == "sglang":   # not installable here; the factory only needs the class
        fake = types.ModuleType("megatron_specrl.engines.sglang")
        fake.SGLangEngine = object
        monkeypatch.setitem(sys.modules, "megatron_specrl.engines.sglang", fake)
    cfg = RolloutConfig(engine=engine, enforce_eager=False, cudagraph_capture_sizes=[4], max_num_seqs=32,
                        engine_kwargs={"vllm": {"disable_log_stats": True},
                                       "sglang": {"chunked_prefill_size": 1024}}).resolved()
    _, kw = factory.engine_kwargs(cfg, str(tmp_path), tmp_path, 0, 0)
    assert (kw["enforce_eager"], kw["cudagraph_capture_sizes"], kw["max_num_seqs"]) == (False, [4], 32)
    assert kw["engine_args"] == ({"disable_log_stats": True} if engine == "vllm" else {"chunked_prefill_size": 1024})
    assert ("max_num_batched_tokens" in kw) == (engine == "vllm")
    assert ("seed_requests" in kw) == (engine == "vllm")      # SGLang keeps its sampling_seed


def test_sglang_gets_the_keys_in_its_own_names():
    from tests.helpers.sglang import FakeSGLang

    from megatron_specrl.engines.sglang import SGLangEngine

    def server_args(**kw):
        return SGLangEngine("m", engine=FakeSGLang(), use_ban_processor=False, log_dir="/tmp/specrl-sgl-test",
                            **kw).server_args

    plain = server_args()
    assert "disable_cuda_graph" not in plain and "cuda_graph_bs" not in plain   # SGLang's CUDA graphs
    args = server_args(enforce_eager=None, cudagraph_capture_sizes=[16, 1, 4], max_num_seqs=128,
                       engine_args={"chunked_prefill_size": 2048})
    assert args["cuda_graph_bs"] == [1, 4, 16] and args["max_running_requests"] == 128
    assert args["chunked_prefill_size"] == 2048
    assert server_args(enforce_eager=True)["disable_cuda_graph"] is True
    with pytest.raises(ValueError, match=r"^rollout\.engine_kwargs\.sglang\.random_seed: set through trainer\.seed"):
        server_args(engine_args={"random_seed": 1})








# ---- The vLLM engine's sampling edges. No vLLM engine is started: the two bugs

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")








from tests.helpers.vllm_rows import EOS, S, _args, _columns, _logits  # noqa: F401










