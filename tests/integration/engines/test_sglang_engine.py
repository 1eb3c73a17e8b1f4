"""SGLangEngine against a real sglang 0.5.23 engine on the CPU and the tiny Llama (one engine per module),
checked against HF transformers in fp32.

SGLang runs here without its CUDA kernels: SGLANG_USE_CPU_ENGINE=1, the torch-native attention backend and
the import-time stand-ins of patches/sglang_0_5_23_cpu_imports.py (engines/sglang/engine.py, CPU_SERVER_ARGS).
Tests run in file order: those at the starting weights first, then the weight update, then the speculative
rollout under the updated weights.
"""

import importlib.util
import random

import numpy as np
import pytest
import torch

from megatron_specrl.engines.protocol import (
    GenerateRequest, RolloutEngine, SamplingSettings, ScoreRequest, WeightVersionMismatch,
)
from tests.helpers.engines import hf_logprobs

# not imported at collection: importing SGLang patches transformers and reads SGLANG_USE_CPU_ENGINE once
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                                   reason="SGLang: tools/setup_env.sh (CPU) or the sglang extra")]
T1 = SamplingSettings()
GREEDY = SamplingSettings(temperature=0.0, need_logprobs=False)
VOCAB_LO, VOCAB_HI = 3, 263          # skip pad / eos / bos so responses never stop early


def rand_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    from megatron_specrl.engines.sglang import SGLangEngine
    eng = SGLangEngine(str(tiny_llama), name="sglang-test", seed=0, max_model_len=256,
                       log_dir=tmp_path_factory.mktemp("sglang-logs"))
    yield eng
    eng.shutdown()


def hf_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def maxdiff(a, b):
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def test_engine_starts_on_cpu_with_the_stand_ins_in_its_processes_only(engine):
    """SGLang's processes run its CPU path (the switch, and through it the stand-ins' .pth); this process
    is left as it was, so engines and processes it starts later see neither."""
    import os
    from pathlib import Path
    assert engine.on_cpu and engine.server_args["device"] == "cpu" and isinstance(engine, RolloutEngine)
    h = engine.health()
    assert h.alive and h.weight_version == 0 and h.detail["child_pids"]
    for pid in h.detail["child_pids"]:
        assert b"SGLANG_USE_CPU_ENGINE=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert "SGLANG_USE_CPU_ENGINE" not in os.environ and importlib.util.find_spec("sgl_kernel") is None
    with pytest.raises(WeightVersionMismatch):
        engine.generate([GenerateRequest(rand_ids(8, 0), 4)], T1, weight_version=3)


def test_an_idle_engine_leaves_the_cores_to_others(engine):
    """Between requests SGLang's processes block on their sockets (sleep_on_idle, CPU_SERVER_ARGS): without
    it the idle scheduler spun a whole core, taken from the learner that trains while the engine waits."""
    import time
    import psutil
    engine.generate([GenerateRequest(rand_ids(8, 1), 4)], T1, engine.weight_version)   # then nothing to do
    procs = [psutil.Process(pid) for pid in engine.health().detail["child_pids"]]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    t0 = time.monotonic()
    time.sleep(3.0)
    busy = [(sum(p.cpu_times()[:2]) - b) / (time.monotonic() - t0) for p, b in zip(procs, before)]
    assert max(busy) < 0.3, busy        # a spinning scheduler: ~1.0 (one core)


def test_greedy_tokens_equal_hf(engine, hf_model):
    prompts = [rand_ids(12 + 9 * i, 10 + i) for i in range(3)]
    gens = engine.generate([GenerateRequest(p, 12) for p in prompts], GREEDY, 0)
    for p, g in zip(prompts, gens):
        assert g.token_ids == hf_greedy(hf_model, p, 12) and g.weight_version == 0


def test_prompt_and_sampling_logprobs_equal_hf_log_softmax(engine, hf_model):
    prompts = [rand_ids(20 + 7 * i, 100 + i) for i in range(4)]
    gens = engine.generate([GenerateRequest(p, 16, seed=i) for i, p in enumerate(prompts)], T1, 0)
    scores = engine.score([ScoreRequest(p, g.token_ids) for p, g in zip(prompts, gens)], T1, 0)
    for p, g, s in zip(prompts, gens, scores):
        ref = hf_logprobs(hf_model, p, g.token_ids)
        assert maxdiff(s.logprobs, ref) < 1e-4 and maxdiff(g.logprobs, ref) < 1e-4
    # the vocabulary's last id, which SGLang reports as 0 in input_token_logprobs (requests._same_ids)
    last = hf_model.config.vocab_size - 1
    cont = [last, 5, last, 0]
    s = engine.score([ScoreRequest(prompts[0], cont)], T1, 0)[0]
    assert maxdiff(s.logprobs, hf_logprobs(hf_model, prompts[0], cont)) < 1e-4


def test_a_requests_seed_decides_its_tokens(engine):
    """patches/sglang_0_5_23_seeded_sampling.py in SGLang's scheduler (unpatched, SGLang samples from one
    generator per process and the same seeded requests drew other tokens each time): the same requests draw
    the same tokens after other work and beside other companions, in another order; other seeds draw others.
    Log-probs agree to fp32's last bits (a prompt prefilled beside others, or from the radix cache)."""
    prompts = [rand_ids(10 + i, 300 + i) for i in range(4)]
    reqs = [GenerateRequest(p, 16, seed=50 + i) for i, p in enumerate(prompts)]
    first = engine.generate(reqs, T1, 0)
    engine.generate([GenerateRequest(rand_ids(9, 7), 20, seed=1)], T1, 0)
    again = engine.generate(reqs[::-1] + [GenerateRequest(rand_ids(12, 8), 20)], T1, 0)[3::-1]
    assert [g.token_ids for g in again] == [g.token_ids for g in first]
    assert max(maxdiff(a.logprobs, b.logprobs) for a, b in zip(first, again)) < 1e-5
    other = engine.generate([GenerateRequest(p, 16, seed=90 + i) for i, p in enumerate(prompts)], T1, 0)
    assert sum(a.token_ids != b.token_ids for a, b in zip(first, other)) >= 3


@pytest.fixture(scope="module")
def new_weights(tiny_llama):
    """The tiny Llama perturbed, with a sharper LM head (verification under it accepts)."""
    from safetensors.torch import load_file
    g = torch.Generator().manual_seed(0)
    new = {k: v * (1 + 0.3 * torch.randn(v.shape, generator=g)) for k, v in load_file(
        str(tiny_llama / "model.safetensors")).items()}
    new["lm_head.weight"] = new["lm_head.weight"] * 30
    return new


@pytest.fixture(scope="module")
def hf_new(tiny_llama, new_weights):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    model.load_state_dict(new_weights, strict=False)
    return model


def test_update_weights_serves_the_new_weights(engine, new_weights, hf_new):
    """Two buckets inside SGLang's weight-update window, then the radix cache flushed and the version set:
    greedy tokens and log-probs follow HF under the new weights, and nothing cached under the old ones
    is served (sglang 0.5.23 refused the update outside begin_weight_update / end_weight_update). The new
    weights are perturbed, with a sharper LM head, so that verification under them accepts (next test)."""
    prompt = rand_ids(40, 7)
    before = engine.generate([GenerateRequest(prompt, 12)], GREEDY, 0)[0]
    items = sorted(new_weights.items())
    engine.update_weights(items[: len(items) // 2], 1)
    engine.update_weights(items[len(items) // 2:], 1)
    with pytest.raises(WeightVersionMismatch):          # half-loaded weights are never served
        engine.generate([GenerateRequest(prompt, 2)], T1, 0)
    engine.finish_update(1)
    assert engine.weight_version == 1 and engine.health().alive
    after = engine.generate([GenerateRequest(prompt, 12)], GREEDY, 1)[0]
    assert after.num_cached_tokens == 0                   # flushed: the prompt's old KV is gone
    assert after.token_ids == hf_greedy(hf_new, prompt, 12) != before.token_ids
    s = engine.score([ScoreRequest(prompt, after.token_ids)], T1, 1)[0]
    assert maxdiff(s.logprobs, hf_logprobs(hf_new, prompt, after.token_ids)) < 1e-4
    with pytest.raises(WeightVersionMismatch):
        engine.update_weights(items[:1], 1)


def test_exact_rollout_extends_verified_responses_from_the_radix_cache(engine):
    """`exact` through SGLang: last epoch's responses verified by a prompt-log-prob prefill under the new
    weights, the accepted prefix extended; the extension reads the verified KV from the radix cache."""
    from megatron_specrl.rollout.speculative import SpeculativeRollout
    from megatron_specrl.rollout.store import Trajectory, TrajectoryStore

    class Recording:
        def __init__(self, inner):
            self.inner, self.extended = inner, []

        def generate(self, requests, sampling, weight_version):
            out = self.inner.generate(requests, sampling, weight_version)
            self.extended += list(zip(requests, out))
            return out

        def __getattr__(self, name):
            return getattr(self.inner, name)

    prompt, L = rand_ids(30, 3), 24
    own = engine.generate([GenerateRequest(prompt, 12, seed=k) for k in range(6)], T1, 1)
    drafts = [g.token_ids for g in own] + [rand_ids(12, 50 + k) for k in range(2)]   # mostly kept / rejected
    store = TrajectoryStore()
    for k, d in enumerate(drafts):
        store.put("p", k, Trajectory(d, [-1.0] * len(d), "length", 0))
    rec = Recording(engine)
    roll = SpeculativeRollout(rec, store, mode="exact", lenience=1.0, sampling=T1, max_new_tokens=L, seed=0)
    samples, metrics = roll.run([("p", prompt)], len(drafts), 1, step=1)
    assert len(samples) == len(drafts) and metrics["spec/drafts"] == len(drafts)
    assert metrics["spec/accepted_tokens"] > 0 and all(len(s.response_ids) <= L for s in samples)
    extensions = [(r, g) for r, g in rec.extended if len(r.prompt_ids) > len(prompt) or r.ban_first_token is not None]
    assert extensions and all(g.num_cached_tokens > 0 for _, g in extensions)
    assert metrics["spec/cached_prompt_tokens"] >= sum(g.num_cached_tokens for _, g in extensions) > 0


class DropBan:
    """A wrong `exact`: the extension samples the full distribution, the rejected token not banned."""

    def __init__(self, inner):
        self.inner = inner

    def generate(self, requests, sampling, weight_version):
        from dataclasses import replace
        return self.inner.generate([replace(r, ban_first_token=None) for r in requests], sampling, weight_version)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_exact_samples_the_new_policy_through_sglang(engine, hf_new):
    """Chi-square at temperature 1 (SGLang's only verifiable setting): one-token responses of `exact`, each
    seeded with the same one-token draft, follow the new policy; the same rollout without the ban in the
    extension does not."""
    from scipy.stats import chisquare

    from megatron_specrl.rollout.speculative import SpeculativeRollout
    from megatron_specrl.rollout.store import Trajectory, TrajectoryStore
    prompt, n = rand_ids(8, 5), 600
    with torch.no_grad():
        p = hf_new(torch.tensor([prompt])).logits[0, -1].double().softmax(-1).numpy()
    draft = int(p.argmax())
    assert 0.1 < p[draft] < 0.95                          # accepted and rejected both often (0.82 here)
    keep = p * n >= 5                                     # rare outcomes pooled into one bin
    pvalues = []
    for wrap in (lambda e: e, DropBan):
        store = TrajectoryStore()
        for k in range(n):
            store.put("p", k, Trajectory([draft], [-1.0], "length", 0))
        roll = SpeculativeRollout(wrap(engine), store, mode="exact", lenience=1.0, sampling=T1, max_new_tokens=1,
                                  seed=1)
        samples, _ = roll.run([("p", prompt)], n, 1, step=2)
        counts = np.bincount([s.response_ids[0] for s in samples], minlength=len(p)).astype(float)
        obs = np.append(counts[keep], counts[~keep].sum())
        exp = np.append(p[keep], p[~keep].sum()) * n
        pvalues.append(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
    print(f"exact through SGLang: chi-square p = {pvalues[0]:.3g}; without the ban p = {pvalues[1]:.3g}")
    assert pvalues[0] > 1e-3 and pvalues[1] < 1e-6


def test_killed_mid_generate_raises_engine_error_then_restart(engine):
    """Last in the module (it restarts the engine at version 0). A SIGQUIT to this process (a child's report
    of an exception) leaves it serving. SIGKILL of SGLang's scheduler while a batch decodes: the call raises the one-line EngineError naming the process and the signal (before, SGLang's
    SubprocessWatchdog sent SIGQUIT to this process, whose handler killed it and every child of it), health
    says why, and restart() ends the old engine's processes and serves a fresh engine at version 0."""
    import os
    import signal
    import threading

    import psutil

    from megatron_specrl.engines.protocol import EngineError
    old = engine.health().detail["child_pids"]
    reqs = [GenerateRequest(rand_ids(64, 200 + i), 160, seed=i) for i in range(64)]
    # what SGLang's scheduler and detokenizer send this process when they fail by an exception: SGLang's
    # handler killed this process and every child of it; now it is logged and the engine serves on
    os.kill(os.getpid(), signal.SIGQUIT)
    assert len(engine.generate(reqs[:2], T1, engine.weight_version)) == 2 and engine.health().alive
    killer = threading.Timer(0.5, os.kill, (old[0], signal.SIGKILL))   # the scheduler; the batch takes seconds
    killer.start()
    try:
        with pytest.raises(EngineError) as ei:
            engine.generate(reqs, T1, engine.weight_version)
    finally:
        killer.join()
    first = str(ei.value).splitlines()[0]
    assert first == f"[sglang-test] generate: engine process died: SGLang's scheduler_0 (pid {old[0]}) was killed by SIGKILL"
    assert ei.value.engine == "sglang-test" and any("died" in line for line in ei.value.last_log_lines)
    h = engine.health()
    assert not h.alive and h.detail["death_cause"] == f"SGLang's scheduler_0 (pid {old[0]}) was killed by SIGKILL"
    with pytest.raises(EngineError, match="flush_cache: engine process died"):   # every call, not only generate
        engine.reset_prefix_cache()

    engine.restart()
    h = engine.health()
    assert h.alive and engine.weight_version == 0 and set(h.detail["child_pids"]).isdisjoint(old)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in old)
    out = engine.generate(reqs[:8], T1, 0)
    assert len(out) == 8 and all(r.token_ids and len(r.token_ids) == len(r.logprobs) for r in out)
