"""rollout.drafter: one typed object whose field defaults are the only place the drafter's defaults are
written, handed whole from the config through the factory and the engine's environment variable to the
proposer's TreeDrafter; the old flat rollout.draft_* keys are refused with the new name."""

import json

import pytest

from megatron_specrl.config import ConfigError, DrafterConfig, RolloutConfig, load_config
from megatron_specrl.rollout.tree_drafting import drafter as tree_drafter
from megatron_specrl.engines.factory import engine_kwargs
from megatron_specrl.rollout.tree_drafting.drafter import DEFAULTS, PROPOSER_ONLY, TreeDrafter, read_settings, settings_env

OLD_KEYS = {"draft_tokens": ("tokens", 8), "draft_min_prob": ("min_prob", 0.2),
            "draft_token_budget": ("token_budget", 512), "draft_max_nodes": ("max_nodes", 2_000_000),
            "draft_impl": ("impl", "python"), "draft_calibrate": ("calibrate", "false"),
            "draft_fresh_prompts": ("fresh_prompts", "true"), "draft_shared_nodes": ("shared_nodes", 0)}


@pytest.mark.parametrize("old", sorted(OLD_KEYS))
def test_old_flat_key_on_the_command_line_is_refused_with_the_new_name(old):
    new, value = OLD_KEYS[old]
    with pytest.raises(ConfigError) as err:
        load_config("examples/tiny-cpu-grpo.yaml", [f"rollout.{old}={value}"])
    assert str(err.value) == f"rollout.{old} was renamed: use rollout.drafter.{new}"
    assert load_config("examples/tiny-cpu-grpo.yaml", [f"rollout.drafter.{new}={value}"])   # the new key works


def test_old_flat_key_in_a_recipe_is_refused_with_the_new_name(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  draft: tree\n  draft_token_budget: 8192\n")
    with pytest.raises(ConfigError, match=r"^rollout.draft_token_budget was renamed: use "
                                          r"rollout.drafter.token_budget$"):
        load_config(recipe)


def test_defaults_are_written_once():
    """The proposer's defaults are DrafterConfig's; only the proposer's own knobs are added."""
    assert DEFAULTS == {**DrafterConfig().model_dump(), **PROPOSER_ONLY}
    assert not set(PROPOSER_ONLY) & set(DrafterConfig.model_fields)
    assert not hasattr(tree_drafter, "DRAFTER_DEFAULTS")


@pytest.mark.parametrize("overrides", [[], ["rollout.drafter.min_prob=0.25", "rollout.drafter.token_budget=512",
                                            "rollout.drafter.max_nodes=50000", "rollout.drafter.shared_nodes=0",
                                            "rollout.drafter.impl=python", "rollout.drafter.calibrate=false",
                                            "rollout.drafter.tokens=7"]])
def test_drafter_settings_reach_the_proposer_unchanged(overrides):
    cfg = load_config("examples/tiny-cpu-grpo.yaml", ["rollout.draft=tree", *overrides])
    _, kwargs = engine_kwargs(cfg.rollout.resolved(), "m", "logs", 0, 0)
    assert kwargs["drafter"] == cfg.rollout.resolved().drafter   # passed whole, not rebuilt
    text = settings_env(kwargs["drafter"])                       # what VLLMEngine puts in SPECRL_TREE_PROPOSER
    back = read_settings(text)                                   # what TreeProposer reads in the worker
    assert {k: back[k] for k in DrafterConfig.model_fields} == cfg.rollout.drafter.model_dump()
    assert {k: back[k] for k in PROPOSER_ONLY} == PROPOSER_ONLY
    d = TreeDrafter(kwargs["drafter"].tokens, 4096, back)
    dr = cfg.rollout.drafter
    assert (d.max_k, d.min_prob, d.token_budget, d.shared_nodes, d.trees.max_nodes, d.calibration is not None) == \
        (dr.tokens, dr.min_prob, dr.token_budget, dr.shared_nodes, dr.max_nodes, dr.calibrate)
    assert type(d.trees) is tree_drafter.trees_class(dr.impl)


def test_a_drafter_config_and_its_dict_give_the_same_drafter():
    dr = DrafterConfig(tokens=5, min_prob=0.0, token_budget=64, impl="python")
    a, b = TreeDrafter(5, 1024, dr), TreeDrafter(5, 1024, read_settings(settings_env(dr)))
    assert (a.min_prob, a.token_budget, a.shared_nodes) == (b.min_prob, b.token_budget, b.shared_nodes)


def test_unset_tokens_resolve_by_draft():
    assert engine_kwargs(RolloutConfig(draft="tree").resolved(), "m", "l", 0, 0)[1]["drafter"].tokens == 16
    assert engine_kwargs(RolloutConfig(draft="model", draft_model="x").resolved(), "m", "l", 0, 0)[1]["drafter"].tokens == 4
    assert tree_drafter.as_drafter({"min_prob": 0.0}, "tree") == DrafterConfig(tokens=16, min_prob=0.0, cost_refit="rollout")


def test_settings_env_refuses_unknown_keys():
    with pytest.raises(ValueError, match="unknown tree proposer settings"):
        settings_env(min_probability=0.1)
    assert json.loads(settings_env(min_prob=0.3))["min_prob"] == 0.3
