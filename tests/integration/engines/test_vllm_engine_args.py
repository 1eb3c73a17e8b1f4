"""verl's engine keys (rollout.enforce_eager, cudagraph_capture_sizes, max_num_seqs,

The tests of this subject that start processes or engines; the rest are in tests/unit/engines/test_vllm_engine_args.py.
"""

from megatron_specrl.engines.protocol import EngineCapabilities, GenerateResult
from megatron_specrl.rollout.speculative import SpeculativeRollout
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore
import pytest
from megatron_specrl.engines.vllm import vllm_engine_arg_names
import numpy as np
import torch
from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings  # noqa: E402
from megatron_specrl.engines.vllm import verify_columns  # noqa: E402


from tests.helpers.vllm_rows import EOS, S, VOCAB, _args, _columns, _logits  # noqa: F401

def test_engine_kwargs_are_checked_against_vllms_engine_args_before_it_starts(tmp_path):
    names = vllm_engine_arg_names()
    assert {"disable_log_stats", "max_logprobs", "compilation_config"} <= names
    assert _args(tmp_path, on_cpu=True, engine_args={"max_logprobs": 3})["max_logprobs"] == 3
    with pytest.raises(ValueError, match=r"^rollout\.engine_kwargs\.vllm\.max_num_seq: not an engine argument"):
        _args(tmp_path, on_cpu=True, engine_args={"max_num_seq": 3})        # a typo: vLLM never sees it
    with pytest.raises(ValueError, match=r"^rollout\.engine_kwargs\.vllm\.seed: set through trainer\.seed"):
        _args(tmp_path, on_cpu=True, engine_args={"seed": 3})


@pytest.mark.parametrize("gpu", [False, True])
def test_a_gpu_engine_builds_vllm_with_cuda_graphs_and_unseeded_requests(monkeypatch, tmp_path, gpu):
    """The engine itself (vLLM's LLM replaced by a recorder): on a GPU, CUDA graphs and generate
    requests without per-request seeds (vLLM's CUDA sampler loops over seeded requests one kernel each,
    every step); on CPU, eager and seeded (resume replays the same samples). Asked-for values win."""
    import vllm

    from megatron_specrl.patches.vllm_engine_patches import ENV
    from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings
    from megatron_specrl.engines.vllm import VLLMEngine

    built = []

    class RecordingLLM:
        def __init__(self, **kwargs):
            built.append(kwargs)

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setenv(ENV, "0")
    eng = VLLMEngine(str(tmp_path), name="rec", log_dir=str(tmp_path), max_num_seqs=64,
                     engine_args={"max_logprobs": 5})
    assert built[-1]["enforce_eager"] is (not gpu) and built[-1]["max_num_seqs"] == 64
    assert built[-1]["max_logprobs"] == 5 and built[-1]["block_size"] == (16 if gpu else 32)
    req = GenerateRequest([3, 4, 5], 4, seed=11)
    assert eng._sampling_params(req, SamplingSettings()).seed == (None if gpu else 11)
    eng = VLLMEngine(str(tmp_path), name="rec", log_dir=str(tmp_path), seed_requests=True, enforce_eager=True)
    assert eng._sampling_params(req, SamplingSettings()).seed == 11 and built[-1]["enforce_eager"] is True


def test_an_engine_whose_feature_needs_a_patch_pinned_elsewhere_refuses_to_start(monkeypatch, tmp_path):
    """Tree drafting on a vLLM release its patch was not written for: refused before vLLM is built (the
    recorder sees no LLM), naming the patch and the installed release (engines/vllm/required_patches.py)."""
    import vllm

    from megatron_specrl.engines.vllm import VLLMEngine
    from megatron_specrl.engines.vllm.required_patches import PatchNotApplicable

    built = []
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: built.append(kwargs))
    monkeypatch.setattr(vllm, "__version__", "0.99.0+cpu")
    with pytest.raises(PatchNotApplicable, match=r"tree drafting \(rollout.draft=tree\) needs "
                                                 r"patches/vllm_0_32_0_tree_proposer.py, .*installed vllm is 0.99.0"):
        VLLMEngine(str(tmp_path), name="pinned", log_dir=str(tmp_path), draft="tree", verification=False)
    assert built == []


class _OnGPU:
    """A bucket tensor as a broadcast receiver hands it over on a GPU (none here): device cuda:0."""
    device = __import__("torch").device("cuda", 0)

    def __init__(self, value):
        self.value = value

    def detach(self):
        return self

    def cpu(self):
        return self.value


@pytest.mark.parametrize("tp", [1, 2])
def test_an_engine_with_tp_workers_hands_them_cpu_tensors(monkeypatch, tp):
    """With engine_tp > 1 vLLM's workers are processes: a CUDA tensor in collective_rpc's arguments
    would be rebuilt on cuda:0 in every worker. The engine moves such tensors to the host first
    (the shared-memory queue passes CPU tensors as raw buffers); one worker in-process takes them as
    they are."""
    import threading


    from megatron_specrl.engines.vllm import VLLMEngine

    sent = []

    class LLM:
        def collective_rpc(self, fn, kwargs):
            sent.append(kwargs["named_tensors"])
            return [len(kwargs["named_tensors"])]

    eng = VLLMEngine.__new__(VLLMEngine)
    eng.name, eng.tensor_parallel_size, eng.llm = "e", tp, LLM()
    eng._lock, eng._version, eng._pending_version = threading.Lock(), 0, None
    eng._log = __import__("logging").getLogger("test")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    on_host = torch.ones(3)
    eng.update_weights([("a", _OnGPU(torch.zeros(2))), ("b", on_host)], version=1)
    (a, got_a), (b, got_b) = sent[0]
    assert got_b.device.type == "cpu" and torch.equal(got_b, on_host)
    assert isinstance(got_a, torch.Tensor) if tp > 1 else isinstance(got_a, _OnGPU)




@pytest.mark.parametrize("coupled_seed", [None, 5], ids=["exact", "coupled"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_rows_with_nonfinite_logits_have_no_replacement(coupled_seed, bad):
    draft = [4, 9, 11, 13]
    cols = _columns(3, draft, _logits(4, {1: bad, 3: bad}), seed=2, coupled_seed=coupled_seed)
    res = verify_columns(cols, 3, draft, EOS, 0, coupled=coupled_seed is not None)
    assert np.isnan(res.sample_logprobs[1]) and np.isnan(res.sample_logprobs[3])   # passed on: acceptance counts it
    assert res.replacements[1] == res.replacements[3] == -1, res.replacements
    assert not res.replacement_stops[1] and not res.replacement_stops[3]
    assert res.replacements[0] >= 0 and np.isfinite(res.replacement_sample_logprobs[0])   # finite rows keep theirs


def _bare_engine():
    from megatron_specrl.engines.vllm import VLLMEngine
    eng = VLLMEngine.__new__(VLLMEngine)   # no vLLM: the checks run before any engine call
    eng.logprobs_mode, eng.draft = "processed_logprobs", "none"
    return eng


def test_vllm_raises_small_temperatures_to_its_minimum():
    """What the refusal guards against, pinned to the installed vLLM (its constant is private)."""
    from vllm import SamplingParams
    from vllm.sampling_params import _MAX_TEMP

    from megatron_specrl.engines.vllm import VLLM_MIN_TEMPERATURE
    assert _MAX_TEMP == VLLM_MIN_TEMPERATURE
    assert SamplingParams(temperature=0.005).temperature == VLLM_MIN_TEMPERATURE


@pytest.mark.parametrize("t", [0.005, 1e-4])
def test_temperatures_vllm_would_change_are_refused_where_log_probs_matter(t):
    from megatron_specrl.engines.protocol import ScoreRequest
    eng = _bare_engine()
    req = GenerateRequest([3, 4, 5], 4, seed=1)
    with pytest.raises(ValueError, match=r"below vLLM's smallest, 0.01"):
        eng._sampling_params(req, SamplingSettings(temperature=t))
    with pytest.raises(ValueError, match=r"below vLLM's smallest, 0.01"):
        eng.score([ScoreRequest([3, 4, 5], [6])], SamplingSettings(temperature=t), 0)
    # eval (no log-probs) keeps vLLM's behaviour; 0.01 itself and greedy are untouched
    assert eng._sampling_params(req, SamplingSettings(temperature=t, need_logprobs=False)).temperature == 0.01
    assert eng._sampling_params(req, SamplingSettings(temperature=0.01)).temperature == 0.01
    assert eng._sampling_params(req, SamplingSettings(temperature=0.0)).temperature == 0.0


class _Engine(EngineCapabilities):
    """score() through the patch's math and verify_columns: row 0 keeps the draft token, row 1 is
    non-finite; generate() a fixed finite continuation."""

    verifies_processed_distribution = True
    samples_coupled = True
    name = "fake-vllm"

    def __init__(self, bad: float):
        self.bad, self.generated = bad, []

    def score(self, requests, sampling, version):
        out = []
        for i, r in enumerate(requests):
            logits = _logits(len(r.continuation_ids), {1: self.bad}, i)
            logits[0, r.continuation_ids[0]] = 50.0   # the draft's first token has all the mass: kept
            cols = _columns(len(r.prompt_ids), r.continuation_ids, logits, r.seed, r.coupled_seed)
            out.append(verify_columns(cols, len(r.prompt_ids), r.continuation_ids, EOS, version,
                                      coupled=r.coupled_seed is not None))
        return out

    def generate(self, requests, sampling, version):
        self.generated += requests
        return [GenerateResult([5] * r.max_new_tokens, [-0.5] * r.max_new_tokens, "length", 0, version)
                for r in requests]


@pytest.mark.parametrize("mode", ["exact", "coupled"])
def test_rollouts_never_take_a_token_drawn_from_nan_probabilities(mode):
    """Drafts whose verification row 1 is NaN: every sample rejects there (u < NaN is False) and must
    sample position 1 in the extension, never keep the NaN row's draw and its NaN log-prob."""
    L = 4
    store = TrajectoryStore()
    drafts = [[4 + k, 20 + k, 30, 31] for k in range(6)]
    for k, d in enumerate(drafts):
        store.put("p", k, Trajectory(d, [-1.0] * L, "length", 0, noise_seed=100 + k if mode == "coupled" else None))
    engine = _Engine(float("nan"))
    roll = SpeculativeRollout(engine, store, mode=mode, lenience=1.0, sampling=S, max_new_tokens=L, seed=3)
    samples, metrics = roll.run([("p", [2, 3, 6])], len(drafts), 1, step=1)
    for s, d in zip(samples, drafts):
        assert all(np.isfinite(s.logprobs)), (s.response_ids, s.logprobs)
        # d[0] kept, the NaN row rejected: position 1 on are the extension's tokens
        assert s.response_ids == [d[0]] + [5] * (L - 1), (d, s.response_ids)
    assert metrics["spec/nonfinite_logprobs"] >= len(drafts)
    assert all(np.isfinite(store.get("p", k).logprobs).all() for k in range(len(drafts)))


