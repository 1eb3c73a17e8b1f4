"""SpeculativeRollout checks what the engine can serve when it is built, not at its first run(), and
resolves verify=None as rollout.verify=auto does (decode for exact on a tree-drafting engine)."""

from __future__ import annotations

import pytest

from megatron_specrl.config import RolloutConfig
from megatron_specrl.engines.protocol import EngineCapabilities, SamplingSettings
from megatron_specrl.rollout.speculative import SpeculativeRollout, resolve_verify
from megatron_specrl.rollout.store import TrajectoryStore
from tests.helpers.capabilities import DraftsNothing


class Plain(EngineCapabilities):
    """Verifies under any distribution; draws no trees."""
    name = "plain"
    verifies_processed_distribution = True

    def generate(self, requests, sampling, weight_version):
        raise AssertionError("a refused rollout must not reach the engine")

    score = generate


class Trees(Plain, DraftsNothing):
    name = "trees"


class BuiltWithoutTrees(Trees):
    """A tree-drafting engine class built with rollout.draft=none (as VLLMEngine(draft="none"))."""
    name = "no-trees"

    @property
    def tree_drafting(self):
        return False


def _roll(engine, **kw):
    args = dict(mode="exact", lenience=1.0, sampling=SamplingSettings(), max_new_tokens=4, seed=0)
    return SpeculativeRollout(engine, TrajectoryStore(), **{**args, **kw})


def test_verify_defaults_as_the_config_resolves_it():
    assert _roll(Trees()).verify == "decode"                       # exact + tree drafting
    assert _roll(Trees(), mode="lenient").verify == "prefill"
    assert _roll(Plain()).verify == "prefill"
    assert _roll(BuiltWithoutTrees()).verify == "prefill"
    assert _roll(Trees(), verify="prefill").verify == "prefill"    # an explicit choice stays
    assert [resolve_verify(m, t) for m, t in (("exact", True), ("exact", False), ("coupled", True))] == \
        ["decode", "prefill", "prefill"]


@pytest.mark.parametrize("verify, expected", [("auto", "decode"), ("prefill", "prefill"), ("decode", "decode")])
def test_from_config_takes_the_rollout_settings(verify, expected):
    cfg = RolloutConfig(spec_mode="exact", temperature=0.7, top_p=0.9, max_new_tokens=12, runahead=2,
                        verify=verify)
    roll = SpeculativeRollout.from_config(Trees(), TrajectoryStore(), cfg, seed=5)
    assert (roll.mode, roll.verify, roll.max_new_tokens, roll.seed, roll.runahead) == ("exact", expected, 12, 5, 2)
    assert (roll.sampling.temperature, roll.sampling.top_p, roll.sampling.top_k) == (0.7, 0.9, cfg.top_k)


@pytest.mark.parametrize("engine, kw, match", [
    (Plain(), dict(sampling=SamplingSettings(temperature=0.0)), "greedy decoding has no distribution"),
    (Plain(), dict(verify="decode"), "does not draft from trees"),
    (BuiltWithoutTrees(), dict(verify="decode"), "does not draft from trees"),
    (Plain(), dict(runahead=2, verify="prefill"), "rollout.runahead=2: engine plain does not draft from trees"),
    (Trees(), dict(verify="decode", mode="lenient"), "only the exact rule"),
    (Trees(), dict(verify="sometimes"), "is not one of"),
])
def test_settings_the_engine_cannot_serve_fail_when_the_rollout_is_built(engine, kw, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        _roll(engine, **kw)


def test_what_an_engine_can_serve_is_built():
    _roll(Trees(), runahead=2)                                      # run-ahead feeds the trees
    _roll(Plain(), mode="off", sampling=SamplingSettings(temperature=0.0))   # greedy without drafts
