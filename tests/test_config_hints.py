"""Unknown config keys name ours: verl's names, a leaf under the wrong section, a misspelling."""

from __future__ import annotations

import pytest

from megatron_specrl import config_hints
from megatron_specrl.config import ConfigError, RunConfig, load_config

RECIPE = "examples/tiny-cpu-grpo.yaml"
KNOWN = config_hints.schema_keys(RunConfig)


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, list(overrides))
    return str(e.value)


def test_every_verl_name_points_at_one_of_our_keys():
    # the map cannot rot: each target's first word is a key of the schema, and no verl name is ours too
    for verl, ours in config_hints.VERL_NAMES.items():
        assert ours.split()[0] in KNOWN, (verl, ours)
        assert verl not in KNOWN, verl


@pytest.mark.parametrize("override, expected", [
    ("trainer.test_freq=5", "unknown config key 'trainer.test_freq' (verl's name; here: trainer.eval_every)"),
    ("data.train_batch_size=8", "(verl's name; here: trainer.prompts_per_step)"),
    # a verl subtree: pydantic reports only 'actor_rollout_ref'; the error names the leaf
    ("actor_rollout_ref.rollout.n=4", "unknown config key 'actor_rollout_ref.rollout.n' (verl's name; here: rollout.n_samples)"),
    # verl's rollout keys without their actor_rollout_ref. prefix
    ("rollout.n=4", "unknown config key 'rollout.n' (verl's name; here: rollout.n_samples)"),
    ("algorithm.filter_groups.enable=true", "(verl's name; here: algorithm.dynamic_sampling)"),
    ("trainer.lr=0.1", "unknown config key 'trainer.lr' (did you mean 'learner.lr'?)"),
    ("trainer.eval_evry=3", "unknown config key 'trainer.eval_evry' (did you mean 'trainer.eval_every'?)"),
    ("rollout.valkwargs.n=2", "(did you mean 'rollout.val_kwargs.n'?)"),
])
def test_unknown_key_error_names_our_key(override, expected):
    assert expected in _error(override)


def test_no_hint_when_nothing_is_close_and_every_leaf_is_named():
    assert _error("zzz_unrelated=1").endswith("unknown config key 'zzz_unrelated'")
    msg = _error("actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_epochs=2")
    assert "'actor_rollout_ref.actor.optim.lr' (verl's name; here: learner.lr)" in msg
    assert "'actor_rollout_ref.actor.ppo_epochs' (verl's name; here: learner.ppo_epochs)" in msg
    assert "\n" not in msg


def test_schema_keys_walks_nested_sections_only():
    assert {"rollout.val_kwargs.n", "learner.loss.clip_high", "algorithm.kl_ctrl.kl_coef",
            "rollout.engine_kwargs.vllm", "output_dir"} <= set(KNOWN)
    assert "rollout" not in KNOWN and "rollout.val_kwargs" not in KNOWN


def test_hydra_style_mapping_without_spaces_is_named():
    # Hydra reads {n:2} as a mapping; YAML reads a key "n:2" with no value, which the schema would then
    # report as an unknown key 'rollout.val_kwargs.n:2'
    msg = _error("rollout.val_kwargs={do_sample:true,n:2}")
    assert msg.startswith("override 'rollout.val_kwargs={do_sample:true,n:2}': 'do_sample:true' is read as a key")
    assert "rollout.val_kwargs.k=v" in msg
    cfg = load_config(RECIPE, ["rollout.val_kwargs={do_sample: true, n: 2, temperature: 0.6}",
                               "rollout.cudagraph_capture_sizes=[1,2,4]", "ray.address=ray://head:10001"])
    assert (cfg.rollout.val_kwargs.do_sample, cfg.rollout.val_kwargs.n) == (True, 2)
    assert cfg.rollout.cudagraph_capture_sizes == [1, 2, 4] and cfg.ray.address == "ray://head:10001"


def test_verl_rollout_keys_that_are_ours_under_its_prefix():
    assert ("'actor_rollout_ref.rollout.gpu_memory_utilization' (verl's name; here: rollout.gpu_memory_utilization)"
            in _error("actor_rollout_ref.rollout.gpu_memory_utilization=0.5"))
    assert "(verl's name; here: trainer.total_steps (steps:" in _error("trainer.total_epochs=3")
