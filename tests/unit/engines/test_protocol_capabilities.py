"""Engines say what they can do: capabilities are declared by an engine's class (engines/protocol.py),
and the package tests them with isinstance, never by probing for a method."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_specrl.engines.protocol import (
    DraftsFromTrees, EngineCapabilities, InActor, RoutesToEngines, RunsInWorkers, SleepsWhileTraining,
    engines_behind, samples_coupled, verifies_processed_distribution,
)

PACKAGE = Path(__file__).resolve().parents[3] / "megatron_specrl"

# the methods of the declared capabilities (and the flags): probing for any of them is asking an engine
# what it can do behind the protocol's back
CAPABILITY_NAMES = (
    "draft_stats", "draft_state", "load_draft_state", "add_to_draft_trees",     # DraftsFromTrees
    "release_memory", "resume_memory",                                          # SleepsWhileTraining
    "run_in_workers",                                                           # RunsInWorkers
    "submit", "submit_actor", "actor", "pid", "wait_started", "restart",        # InActor
    "engines",                                                                  # RoutesToEngines
    "verifies_processed_distribution", "samples_coupled",                       # EngineCapabilities
)


def _probes() -> list[str]:
    names = "|".join(CAPABILITY_NAMES)
    probe = re.compile(rf"""\b(?:hasattr|getattr)\(\s*[^,()]+(?:\([^()]*\))?\s*,\s*["'](?:{names})["']""")
    return [f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
            for path in sorted(PACKAGE.rglob("*.py"))
            for i, line in enumerate(path.read_text().splitlines(), 1) if probe.search(line)]


def test_no_capability_probes_in_the_package():
    assert _probes() == []


def test_the_probe_pattern_finds_probes(tmp_path):
    """The grep above must see the shapes the probes had."""
    names = "|".join(CAPABILITY_NAMES)
    probe = re.compile(rf"""\b(?:hasattr|getattr)\(\s*[^,()]+(?:\([^()]*\))?\s*,\s*["'](?:{names})["']""")
    for line in ('state = engine.draft_state() if hasattr(engine, "draft_state") else None',
                 'if taken and hasattr(self.engine, "add_to_draft_trees"):',
                 'return bool(getattr(engine, "verifies_processed_distribution", False))',
                 "if getattr(e, 'actor', None) is not None:",
                 'if engines and getattr(engines[0], "pid", None):',
                 'return list(getattr(engine, "engines", [engine]))'):
        assert probe.search(line), line
    assert not probe.search('return getattr(self.engine, method)(*args, **kwargs)')


def _declares(cls, *caps) -> None:
    for cap in caps:
        assert issubclass(cls, cap), f"{cls.__name__} does not declare {cap.__name__}"


def test_vllm_engine_declares_what_it_implements():
    cls = pytest.importorskip("megatron_specrl.engines.vllm").VLLMEngine
    _declares(cls, EngineCapabilities, DraftsFromTrees, SleepsWhileTraining, RunsInWorkers)
    assert not issubclass(cls, InActor) and not issubclass(cls, RoutesToEngines)
    assert verifies_processed_distribution(cls) and samples_coupled(cls)


def test_sglang_engines_declare_what_they_implement():
    from megatron_specrl.engines.sglang import SGLangEngine, SGLangHTTPEngine
    for cls in (SGLangEngine, SGLangHTTPEngine):
        _declares(cls, EngineCapabilities, DraftsFromTrees, SleepsWhileTraining)
        assert not issubclass(cls, RunsInWorkers) and not issubclass(cls, InActor)
        # score() at temperature 1 without top-k / top-p only, no position-keyed noise
        assert not verifies_processed_distribution(cls) and not samples_coupled(cls)


class _Plain(EngineCapabilities):
    name = "plain"


class _Scoring(EngineCapabilities):
    name = "scoring"
    verifies_processed_distribution = True
    samples_coupled = True


def test_ray_engine_forwards_its_engine_class_capabilities():
    from megatron_specrl.engines.ray_engine import RayEngine
    _declares(RayEngine, EngineCapabilities, DraftsFromTrees, SleepsWhileTraining, RunsInWorkers, InActor)
    handle = object.__new__(RayEngine)            # no actor: only the class-level answers
    handle.engine_cls, handle.engine_kwargs, handle.name = _Plain, {"draft": "tree"}, "p"
    assert not handle.verifies_processed_distribution and not handle.samples_coupled
    assert handle.draft_stats() == {} and handle.draft_state() is None
    handle.add_to_draft_trees([object()])         # nothing to forward to: no round trip
    with pytest.raises(ValueError, match="does not draft from trees"):
        handle.load_draft_state({})
    with pytest.raises(NotImplementedError, match="runs nothing in workers"):
        handle.run_in_workers(print)
    handle.engine_cls = _Scoring
    assert verifies_processed_distribution(handle) and samples_coupled(handle)


def test_router_declares_and_forwards():
    from megatron_specrl.engines.router import EngineRouter
    _declares(EngineRouter, EngineCapabilities, DraftsFromTrees, RoutesToEngines)

    class Drafting(_Scoring, DraftsFromTrees):
        def __init__(self, name):
            self.name, self.added = name, []

        def draft_stats(self):
            return {"draft_tokens": 2.0, "engine_steps": 3.0}

        def draft_state(self):
            return {"of": self.name}

        def load_draft_state(self, state):
            self.loaded = state

        def add_to_draft_trees(self, responses):
            self.added += responses

    a, b = Drafting("a"), _Plain()
    router = EngineRouter([a, b])
    assert engines_behind(router) == [a, b] and engines_behind(a) == [a]
    assert not router.verifies_processed_distribution    # every engine must have it
    assert EngineRouter([a, Drafting("c")]).samples_coupled
    assert router.draft_stats() == {"draft_tokens": 2.0, "engine_steps": 3.0, "engine_steps_longest": 3.0}
    assert router.draft_state() == {"engines": [{"of": "a"}, None]}
    router.load_draft_state({"engines": [{"x": 1}, None]})
    assert a.loaded == {"x": 1}
    with pytest.raises(ValueError, match="does not draft from trees"):
        router.load_draft_state({"engines": [None, {"x": 1}]})


def test_an_engine_that_does_not_declare_has_no_capability():
    """Methods alone are not a declaration: the flags and the drafting calls go by the class."""
    class Undeclared:
        verifies_processed_distribution = True
        samples_coupled = True

        def draft_stats(self):
            return {"nodes": 1.0}

    from megatron_specrl.rollout.speculative import tree_metrics
    assert not verifies_processed_distribution(Undeclared()) and not samples_coupled(Undeclared)
    assert not isinstance(Undeclared(), DraftsFromTrees)
    assert tree_metrics(Undeclared()) == {}


def test_the_test_engines_declare_what_they_implement():
    from tests.helpers.capabilities import DraftsNothing, Routes
    from tests.helpers.tabular_engine import TabularEngine, TabularPolicy

    _declares(TabularEngine, EngineCapabilities)
    assert not issubclass(TabularEngine, DraftsFromTrees)            # no trees: the rollout sends it none
    full, t1_only = TabularEngine(TabularPolicy(4)), TabularEngine(TabularPolicy(4), replacements=False)
    assert verifies_processed_distribution(full) and samples_coupled(full)
    assert not verifies_processed_distribution(t1_only) and not samples_coupled(t1_only)
    _declares(DraftsNothing, EngineCapabilities, DraftsFromTrees)
    _declares(Routes, RoutesToEngines)
    assert engines_behind(Routes([full, t1_only])) == [full, t1_only]


def test_tree_drafting_is_what_the_engine_was_built_with():
    from megatron_specrl.engines.ray_engine import RayEngine
    from megatron_specrl.engines.router import EngineRouter
    from megatron_specrl.engines.sglang import SGLangHTTPEngine

    class Trees(_Plain, DraftsFromTrees):
        draft_stats = draft_state = load_draft_state = add_to_draft_trees = lambda self, *a: None

    def ray(cls, draft):
        handle = object.__new__(RayEngine)
        handle.engine_cls, handle.engine_kwargs = cls, {"draft": draft}
        return handle

    assert ray(Trees, "tree").tree_drafting and not ray(Trees, "none").tree_drafting
    assert not ray(_Plain, "tree").tree_drafting                   # its class keeps no trees
    assert EngineRouter([ray(Trees, "tree"), Trees()]).tree_drafting
    assert not EngineRouter([ray(Trees, "tree"), _Plain()]).tree_drafting
    sglang = object.__new__(SGLangHTTPEngine)
    for draft in ("tree", "none"):
        sglang.draft = draft
        assert sglang.tree_drafting == (draft == "tree")


# ---- What each engine can do is one table (protocol.ENGINE_KINDS): the engine classes declare their row,
# the config's cross-checks and the engines' guards read it.

def test_each_engine_class_declares_its_row_of_the_table():
    from megatron_specrl.engines.protocol import ENGINE_KINDS
    from megatron_specrl.engines.sglang import SGLangEngine, SGLangHTTPEngine
    from megatron_specrl.engines.vllm import VLLMEngine

    for cls, kind in ((VLLMEngine, "vllm"), (SGLangEngine, "sglang"), (SGLangHTTPEngine, "sglang")):
        row = ENGINE_KINDS[kind]
        assert cls.engine_kind is row
        assert (verifies_processed_distribution(cls), samples_coupled(cls)) == (
            row.verifies_processed_distribution, row.samples_coupled)


def test_the_config_reads_the_table(monkeypatch):
    """A capability given to an engine in the table is accepted by the config, and the engines that have
    one are named from it."""
    import dataclasses

    from megatron_specrl.config import ConfigError, load_config
    from megatron_specrl.engines.protocol import ENGINE_KINDS
    from tests.helpers.paths import REPO_ROOT

    recipe = REPO_ROOT / "examples/tiny-cpu-grpo.yaml"
    runahead = ["rollout.engine=sglang", "rollout.draft=tree", "rollout.runahead=2"]
    with pytest.raises(ConfigError, match="run-ahead requests are built into the vLLM engine only"):
        load_config(recipe, runahead)
    monkeypatch.setitem(ENGINE_KINDS, "sglang", dataclasses.replace(ENGINE_KINDS["sglang"], runs_ahead=True))
    assert load_config(recipe, runahead).rollout.runahead == 2
    monkeypatch.setitem(ENGINE_KINDS, "other", dataclasses.replace(ENGINE_KINDS["vllm"], label="Other"))
    with pytest.raises(ConfigError, match=r"position-keyed sampling is built into the vLLM or Other engine only; "
                                          r"use rollout.engine=vllm or rollout.engine=other or another spec_mode"):
        load_config(recipe, ["rollout.engine=sglang", "rollout.spec_mode=coupled"])


def test_sglangs_guards_name_the_engines_that_can():
    from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings, ScoreRequest
    from megatron_specrl.engines.sglang import build_generate_payload, build_score_payload

    with pytest.raises(NotImplementedError, match=r"run-ahead requests need the vLLM engine"):
        build_generate_payload([GenerateRequest([1, 2], 4, draft_key="p", response_start=2, runahead=True)],
                               SamplingSettings(), draft="tree")
    with pytest.raises(NotImplementedError, match=r"verification needs the vLLM engine"):
        build_score_payload([ScoreRequest([1, 2], [3])], SamplingSettings(temperature=0.5))
