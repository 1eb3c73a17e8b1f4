"""Every metric key the package emits is documented in megatron_specrl/metrics/keys.py, and
docs/metrics.md is the page generated from it.

The emitted keys are collected statically, so a key added anywhere in the package fails here until it
is documented: every string literal of the form `namespace/name` (a dict key, a subscript, a tuple of
keys), and every f-string that builds a key from a `namespace/` prefix, whose prefix must be one of
metric_keys.FAMILIES (which lists its keys from the constants the code iterates over)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import megatron_specrl
from megatron_specrl.metrics import keys as metric_keys
from megatron_specrl.metrics.keys import METRICS, families, lookup, render, undocumented

PACKAGE = Path(megatron_specrl.__file__).resolve().parent
KEY = re.compile(r"^[a-z][a-z0-9_]*/[A-Za-z0-9_@.{}/]+$")
PREFIX = re.compile(r"^[a-z][a-z0-9_]*/")

# `namespace/name` strings in the package that are not metric keys
NOT_METRICS = {"application/json",   # an HTTP content type (engines)
               "draft_trees/1",      # the draft trees' file format tag
               "logs/engines",       # the engines' default log directory
               "tok/step"}           # a unit in bench-rollout's printed table
# f-string prefixes that build no metric key
NOT_METRIC_PREFIXES = {"off/",      # bench-rollout's "speedup vs off" column labels: off/<mode>
                       "patches/"}  # the patch file a vLLM engine's refusal names (engines/vllm/required_patches.py)


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() == "metrics/keys.py":    # the registry itself: its strings document keys, emit none
            continue
        yield path, ast.parse(path.read_text(), filename=str(path))


def emitted_literals() -> dict[str, str]:
    """`namespace/name` string constants (outside f-strings) -> the first file holding one."""
    found: dict[str, str] = {}
    for path, tree in _sources():
        in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings
                    and KEY.match(node.value)):
                found.setdefault(node.value, str(path.relative_to(PACKAGE)))
    return found


def fstring_prefixes() -> dict[str, str]:
    """The literal head of every f-string that starts with `namespace/` -> the first file holding one."""
    found: dict[str, str] = {}
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                head = node.values[0].value
                if isinstance(head, str) and PREFIX.match(head) and len(node.values) > 1:
                    found.setdefault(head, str(path.relative_to(PACKAGE)))
    return found


def test_docs_metrics_md_is_generated_from_the_registry():
    page = metric_keys.DOC
    assert page.is_file(), f"{page} missing: run python -m megatron_specrl.metrics.keys"
    assert page.read_text() == render(), "docs/metrics.md is stale: run python -m megatron_specrl.metrics.keys"


def test_check_mode_reports_a_stale_page(tmp_path, capsys):
    out = tmp_path / "metrics.md"
    assert metric_keys.main(["--out", str(out), "--check"]) == 1            # missing
    assert metric_keys.main(["--out", str(out)]) == 0 and out.read_text() == render()
    assert metric_keys.main(["--out", str(out), "--check"]) == 0
    out.write_text(render().replace("| `spec/reuse_ratio` |", "| `spec/reuse` |"))
    assert metric_keys.main(["--out", str(out), "--check"]) == 1
    assert "stale" in capsys.readouterr().err


def test_every_literal_metric_key_in_the_package_is_documented():
    literals = emitted_literals()
    keys = {k: where for k, where in literals.items() if k not in NOT_METRICS}
    missing = {k: keys[k] for k in undocumented(keys)}
    assert not missing, f"metric keys emitted but not in megatron_specrl/metrics/keys.py METRICS: {missing}"
    # the scan sees the keys it must: a sample of each emitting module
    for k in ("spec/reuse_ratio", "tree/accept_rate", "resync/seconds", "eval/accuracy", "dapo/kept_fraction",
              "actor/reward_kl_penalty", "critic/returns/mean", "engine/restarts", "time/step_s", "reward/mean"):
        assert k in keys, k


def test_every_fstring_built_key_has_a_documented_family():
    prefixes = {p: where for p, where in fstring_prefixes().items() if p not in NOT_METRIC_PREFIXES}
    fams = families()
    unknown = {p: where for p, where in prefixes.items() if p not in fams}
    assert not unknown, (f"keys built from a prefix with no metric_keys.FAMILIES entry (list its keys there, or "
                         f"add the prefix to NOT_METRIC_PREFIXES here if it builds no metric): {unknown}")
    assert {"train/", "critic/", "tree_cost/", "tree_calib/", "eval/pass@"} <= set(prefixes)
    missing = [k for keys in fams.values() for k in keys if lookup(k) is None]
    assert not missing, f"family keys not documented: {missing}"


def test_learner_train_step_keys_are_the_train_family():
    """LearnerWorker.train_step's keys beyond POLICY_METRICS / CRITIC_METRICS (grad_norm, lr, the
    engine/learner log-prob difference), read from its source: a new one must join families()."""
    from megatron_specrl.learner import worker
    tree = ast.parse(Path(worker.__file__).read_text())
    extra: set[str] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in ("train_step", "_reduce_metrics"):
            for node in ast.walk(fn):
                if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str) \
                        and isinstance(node.value, ast.Name) and node.value.id in ("extra", "out"):
                    extra.add(node.slice.value)
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
                    extra |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    assert {"grad_norm", "lr", "rollout_learner_logprob_abs_diff"} <= extra
    train = set(families()["train/"])
    assert {f"train/{k}" for k in extra} <= train


def test_loss_functions_report_only_keys_the_learner_reduces():
    """The loss functions' metric dicts, run on a small batch: each key is one the worker all-reduces
    (POLICY_METRICS / CRITIC_METRICS), so each reaches metrics.jsonl as a documented train/ or critic/ key."""
    import torch

    from megatron_specrl.config import LossConfig
    from megatron_specrl.learner import losses
    from megatron_specrl.learner.worker import CRITIC_METRICS, POLICY_METRICS
    g = torch.Generator().manual_seed(0)
    B, T = 3, 5
    lp = -torch.rand(B, T, generator=g)
    batch = {"loss_mask": torch.ones(B, T), "old_logprobs": lp - 0.1, "advantages": torch.randn(B, T, generator=g),
             "rollout_logprobs": lp - 0.05, "ref_logprobs": lp - 0.2}
    seen: set[str] = set()
    for kw in ({}, {"kl_coef": 0.1, "entropy_coef": 0.01, "tis": "token"}):
        _, met = losses.rl_policy_objective(lp, torch.rand(B, T, generator=g), batch, LossConfig(**kw))
        seen |= set(met) | {"loss"}
    assert seen <= set(POLICY_METRICS), seen - set(POLICY_METRICS)
    _, met = losses.value_loss(torch.rand(B, T), torch.rand(B, T), torch.rand(B, T), torch.ones(B, T))
    assert set(met) | {"loss", "vf_loss"} <= set(CRITIC_METRICS)
    assert not undocumented(f"train/{k}" for k in seen) and not undocumented(f"critic/{k}" for k in met)


def test_rollout_metrics_of_a_speculative_step_are_documented():
    """The rollout's metric dicts themselves, built on the tabular test engine, in every mode, over a
    few steps (drafts from the second on) with a policy that moves each step."""
    from megatron_specrl.engines.protocol import SamplingSettings, samples_coupled
    from megatron_specrl.rollout.acceptance import MODES
    from megatron_specrl.rollout.speculative import SpeculativeRollout
    from megatron_specrl.rollout.store import TrajectoryStore
    from tests.helpers.tabular_engine import TabularEngine, TabularPolicy
    prompts = [("p0", [1, 2]), ("p1", [3])]
    seen: set[str] = set()
    modes = [m for m in MODES if m != "coupled" or samples_coupled(TabularEngine(TabularPolicy(8)))]
    for mode in modes:
        engine = TabularEngine(TabularPolicy(8), version=1)
        ro = SpeculativeRollout(engine, TrajectoryStore(), mode=mode, lenience=1.5, sampling=SamplingSettings(),
                                max_new_tokens=6, seed=0)
        for version in (1, 2, 3):
            engine.set_policy(TabularPolicy(8, update_seed=version, drift=0.3), version)
            _, metrics = ro.run(prompts, 2, version, step=version)
            assert not undocumented(metrics), (mode, undocumented(metrics))
            seen |= set(metrics)
    assert {"spec/reuse_ratio", "spec/accepted_tokens", "spec/lenient_bias"} <= seen
    assert "coupled" not in modes or "spec/coupled_refreshed" in seen


def test_the_registry_is_well_formed():
    for key, entry in METRICS.items():
        assert KEY.match(key) or "/" not in key, key
        unit, meaning = entry
        assert unit and meaning.endswith((".", ")")), key
    assert lookup("eval/pass@4") == "eval/pass@{n}" and lookup("eval/pass@") is None
    assert lookup("spec/nope") is None


@pytest.mark.parametrize("row", [
    {"step": 3, "spec/reuse_ratio": 0.5, "train/loss": 0.1, "tree_cost/ry": 2.0, "eval/pass@8": 0.25},
])
def test_a_metrics_row_is_documented(row):
    assert undocumented(row) == []
    assert undocumented({**row, "spec/new_counter": 1.0}) == ["spec/new_counter"]
