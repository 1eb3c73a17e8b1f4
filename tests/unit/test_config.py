"""Recipes + overrides: good ones resolve, bad ones fail with one line naming the key and value.

Unknown config keys name ours: verl's names, a leaf under the wrong section, a misspelling.
"""

from __future__ import annotations
import pytest
from megatron_specrl.cli import main
from megatron_specrl.config import ConfigError, load_config, to_yaml
from megatron_specrl.config import hints as config_hints
from megatron_specrl.config import RunConfig
from tests.helpers.paths import REPO_ROOT



# ---- Recipes + overrides: good ones resolve, bad ones fail with one line naming the key and value.

ROOT = REPO_ROOT
RECIPES = sorted((ROOT / "examples").glob("tiny-cpu-*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_validates(recipe):
    cfg = load_config(recipe)
    assert cfg.rollout.spec_mode in ("exact", "lenient")
    assert cfg.output_dir.startswith("outputs/")


def test_overrides_are_dotted_and_typed():
    cfg = load_config(ROOT / "examples/tiny-cpu-grpo.yaml",
                      ["learner.tp=2", "rollout.spec_mode=exact", "learner.loss.clip_high=0.28", "output_dir=/tmp/x"])
    assert cfg.learner.tp == 2 and cfg.rollout.spec_mode == "exact"
    assert cfg.learner.loss.clip_high == 0.28 and cfg.output_dir == "/tmp/x"


@pytest.mark.parametrize("override, needle", [
    ("learner.tpp=2", "unknown config key 'learner.tpp'"),
    ("rollout.lenience=0.5", "'rollout.lenience': 0.5"),
    ("rollout.max_new_tokens=-8", "'rollout.max_new_tokens': -8"),
    ("learner.lr=fast", "'learner.lr': 'fast'"),
    ("rollout.spec_mode=greedy", "'rollout.spec_mode': 'greedy'"),
    ("algorithm.name=reinforce", "'algorithm.name'"),
    ("rollout.max_model_len=32", "rollout.max_model_len=32"),
    ("learner.dp=3", "learner.dp * learner.mini_batches = 3"),
    ("nokey", "not of the form key=value"),
    ("data.synthetic_terms=[6,3]", "'data.synthetic_terms'"),
    ("rollout.temperature=0.005", "'rollout.temperature': 0.005"),   # vLLM would sample at 0.01
    ("rollout.temperature=2.5", "'rollout.temperature': 2.5"),
])
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "examples/tiny-cpu-grpo.yaml", [override])
    assert needle in str(err.value)


def test_spec_mode_off_survives_yaml(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  spec_mode: off\n")
    assert load_config(recipe).rollout.spec_mode == "off"
    assert load_config(None, ["rollout.spec_mode=off"]).rollout.spec_mode == "off"


def test_malformed_recipe_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_config(tmp_path / "missing.yaml")


def test_cli_dry_run_prints_resolved_config(capsys):
    assert main(["train", "tiny-cpu-grpo", "rollout.n_samples=4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "n_samples: 4" in out and "spec_mode: exact" in out and "draft: tree" in out and "verify: decode" in out






def test_engine_dtype_and_recompute_old_logprobs():
    recipe = ROOT / "examples/tiny-cpu-grpo.yaml"
    fp32 = load_config(recipe)
    assert fp32.rollout.engine_dtype == "float32" and fp32.learner.recompute_old_logprobs is False
    assert load_config(recipe, ["learner.recompute_old_logprobs=true"]).learner.recompute_old_logprobs is True
    bf16 = load_config(recipe, ["rollout.engine_dtype=bfloat16"])
    assert bf16.rollout.engine_dtype == "bfloat16"
    assert bf16.learner.recompute_old_logprobs is True              # learner log-probs in the PPO ratio
    assert "recompute_old_logprobs: true" in to_yaml(bf16)          # resolved, so a resume reads the same
    with pytest.raises(ConfigError) as err:
        load_config(recipe, ["rollout.engine_dtype=bfloat16", "learner.recompute_old_logprobs=false"])
    assert "learner.recompute_old_logprobs=false with rollout.engine_dtype=bfloat16" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(recipe, ["rollout.engine_dtype=float16"])
    assert "'rollout.engine_dtype': 'float16'" in str(err.value) and "\n" not in str(err.value)


def test_sampling_settings_and_speculative_modes():
    """vLLM verifies under any temperature / top-p / top-k; SGLang only at temperature 1 untruncated.
    Truncation makes the rollout's (processed) log-probs differ from the learner's (tempered) ones,
    so the PPO ratio's old log-probs are recomputed by the learner."""
    recipe = ROOT / "examples/tiny-cpu-grpo.yaml"
    for mode in ("exact", "lenient"):
        cfg = load_config(recipe, [f"rollout.spec_mode={mode}", "rollout.temperature=0.7", "rollout.top_p=0.9"])
        assert cfg.learner.recompute_old_logprobs is True
        assert load_config(recipe, [f"rollout.spec_mode={mode}", "rollout.top_k=20"]).learner.recompute_old_logprobs
        for bad in (["rollout.temperature=0.7"], ["rollout.top_p=0.9"], ["rollout.top_k=20"]):
            with pytest.raises(ConfigError, match="rollout.engine=sglang needs temperature 1"):
                load_config(recipe, [f"rollout.spec_mode={mode}", "rollout.engine=sglang", *bad])
    assert load_config(recipe, ["rollout.temperature=0.7"]).learner.recompute_old_logprobs is False   # no truncation
    load_config(recipe, ["rollout.spec_mode=off", "rollout.engine=sglang", "rollout.top_p=0.9"])
    with pytest.raises(ConfigError, match="recompute_old_logprobs=false with rollout.top_p=0.9"):
        load_config(recipe, ["rollout.top_p=0.9", "learner.recompute_old_logprobs=false"])


def test_loss_settings_follow_verl():
    recipe = ROOT / "examples/tiny-cpu-grpo.yaml"
    lc = load_config(recipe).learner.loss
    assert lc.dual_clip_c == 3.0 and lc.kl_type == "low_var_kl" and lc.agg_mode == "token-mean"
    assert load_config(recipe, ["learner.loss.dual_clip_c=null"]).learner.loss.dual_clip_c is None   # off
    for name in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"):
        assert load_config(recipe, [f"learner.loss.kl_type={name}"]).learner.loss.kl_type == name
    with pytest.raises(ConfigError) as err:
        load_config(recipe, ["learner.loss.kl_type=low-var"])
    assert str(err.value).startswith("invalid value for 'learner.loss.kl_type': 'low-var'") and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="'learner.loss.dual_clip_c': 1.0"):
        load_config(recipe, ["learner.loss.dual_clip_c=1.0"])
    # Dr. GRPO: the constant defaults to the max response length; an explicit one is kept
    norm = load_config(recipe, ["learner.loss.agg_mode=seq-mean-token-sum-norm", "rollout.max_new_tokens=48"])
    assert norm.learner.loss.loss_scale_factor == 48
    assert load_config(recipe, ["learner.loss.agg_mode=seq-mean-token-sum-norm",
                                "learner.loss.loss_scale_factor=4096"]).learner.loss.loss_scale_factor == 4096
    ppo = load_config(ROOT / "examples/tiny-cpu-ppo.yaml", ["learner.loss.agg_mode=seq-mean-token-sum-norm"])
    assert ppo.learner.loss.loss_scale_factor == ppo.rollout.max_new_tokens   # the critic gets it too


def test_reward_name_from_the_cli(tmp_path, monkeypatch, capsys):
    recipe = ROOT / "examples/tiny-cpu-grpo.yaml"
    assert load_config(recipe).reward.name is None                  # picked from the data, as before
    for name in ("math_verify", "gsm8k", "gsm8k_strict", "arithmetic", "megatron_specrl.rewards.gsm8k_reward"):
        assert load_config(recipe, [f"reward.name={name}"]).reward.name == name
    (tmp_path / "my_rewards_mod.py").write_text("def score(response, record):\n    return float('yes' in response)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(recipe, ["reward.name=my_rewards_mod.score"])
    from megatron_specrl.rewards import default_reward_for, get_reward
    fn = get_reward(cfg.reward.name or default_reward_for(cfg.data))   # what build_run does
    assert fn("yes", None) == 1.0 and fn("no", None) == 0.0
    for bad, needle in [("my_rewards_mod.nothere", "has no attribute 'nothere'"),
                        ("nope", "unknown reward 'nope'")]:
        with pytest.raises(ConfigError) as err:   # the resolve step checks the name (the config schema imports no rewards)
            from megatron_specrl.config.resolve import resolve
            resolve(load_config(recipe, [f"reward.name={bad}"]))
        assert f"'reward.name': '{bad}'" in str(err.value) and needle in str(err.value)
    assert main(["train", "tiny-cpu-grpo", "reward.name=gsm8k_strict", "--dry-run"]) == 0
    assert "name: gsm8k_strict" in capsys.readouterr().out


def test_tree_drafting_keys_reach_both_engines_and_sglang_refuses_runahead():
    from megatron_specrl.engines.factory import engine_kwargs
    cfg = load_config(ROOT / "examples/tiny-cpu-grpo.yaml",
                      ["rollout.draft=tree", "rollout.drafter.tokens=12", "rollout.drafter.min_prob=0.2"])
    _, kwargs = engine_kwargs(cfg.rollout.resolved(), "m", "logs", 0, 0)
    assert kwargs["draft"] == "tree" and kwargs["drafter"].tokens == 12
    assert kwargs["drafter"].min_prob == 0.2
    cfg = load_config(ROOT / "examples/tiny-cpu-grpo.yaml",
                      ["rollout.draft=tree", "rollout.engine=sglang", "rollout.drafter.tokens=6",
                       "rollout.drafter.token_budget=512"])
    cls, kwargs = engine_kwargs(cfg.rollout.resolved(), "m", "logs", 0, 0)
    assert cls.__name__ == "SGLangEngine" and kwargs["draft"] == "tree" and kwargs["drafter"].tokens == 6
    assert kwargs["drafter"].token_budget == 512
    with pytest.raises(ConfigError, match="rollout.runahead=2 with rollout.engine=sglang"):
        load_config(ROOT / "examples/tiny-cpu-grpo.yaml",
                    ["rollout.draft=tree", "rollout.engine=sglang", "rollout.runahead=2"])
    with pytest.raises(ConfigError, match="rollout.draft"):
        load_config(ROOT / "examples/tiny-cpu-grpo.yaml", ["rollout.draft=ngram"])
    cfg = load_config(ROOT / "examples/tiny-cpu-grpo.yaml", ["rollout.draft=tree", "rollout.drafter.shared_nodes=0"])
    assert engine_kwargs(cfg.rollout.resolved(), "m", "logs", 0, 0)[1]["drafter"].shared_nodes == 0
    with pytest.raises(ConfigError, match="rollout.drafter.shared_nodes=4000000 must be below rollout.drafter.max_nodes"):
        load_config(ROOT / "examples/tiny-cpu-grpo.yaml", ["rollout.drafter.shared_nodes=4000000"])


def test_verification_in_the_decode_loop_needs_exact_and_tree_drafting():
    recipe = ROOT / "examples/tiny-cpu-grpo.yaml"
    assert load_config(recipe, ["rollout.draft=tree", "rollout.verify=decode"]).rollout.verify == "decode"
    assert load_config(recipe).rollout.verify == "decode"     # the main job's default (README), from `auto`
    # `auto` resolves to decode only where it can run, so switching the mode or the drafter alone works.
    for overrides, want in ((["rollout.spec_mode=lenient"], "prefill"), (["rollout.spec_mode=off"], "prefill"),
                            (["rollout.draft=none"], "prefill"), (["rollout.verify=prefill"], "prefill")):
        assert load_config(recipe, overrides).rollout.verify == want, overrides
    assert load_config(ROOT / "examples/qwen2.5-7b-dapo-1node.yaml").rollout.verify == "prefill"   # exact, no tree
    for overrides in (["rollout.draft=none", "rollout.verify=decode"], ["rollout.spec_mode=lenient", "rollout.verify=decode"]):
        with pytest.raises(ConfigError, match="rollout.verify=decode with rollout.spec_mode="):
            load_config(recipe, overrides)
    with pytest.raises(ConfigError, match="rollout.verify"):
        load_config(recipe, ["rollout.draft=tree", "rollout.verify=engine"])


def test_transport_names_have_one_source():
    """config.RESYNC_TRANSPORTS is the list: the config accepts exactly those (and auto), every name
    has a route, and the resolver takes each one it may choose."""
    import typing

    from megatron_specrl.config import RESYNC_TRANSPORTS, TrainerConfig
    from megatron_specrl.resync.choose import TRANSPORTS
    from megatron_specrl.resync.routes import ROUTES, make_route

    literal = typing.get_args(TrainerConfig.model_fields["resync_transport"].annotation)
    assert set(literal) == {"auto", *RESYNC_TRANSPORTS}
    assert TRANSPORTS == RESYNC_TRANSPORTS
    assert set(ROUTES) == set(RESYNC_TRANSPORTS)
    assert all(make_route(name).name == name for name in RESYNC_TRANSPORTS)
    with pytest.raises(ConfigError, match="resync_transport"):
        load_config(None, ["trainer.resync_transport=nccl"])


def test_unset_spec_mode_keeps_the_policys_distribution():
    """Unset, spec_mode is exact: never lenient (biased toward old samples) nor coupled (its samples
    reuse noise the policy was trained on), which change what the policy learns."""
    from megatron_specrl.config import RolloutConfig
    assert RolloutConfig().spec_mode == "exact"
    assert RolloutConfig(engine="sglang").spec_mode == "exact"
    assert RolloutConfig(spec_mode="coupled").spec_mode == "coupled"


def test_overlong_buffer_is_checked_for_every_algorithm():
    """score_samples adds the overlong penalty whenever algorithm.overlong_buffer > 0, whatever the
    algorithm; a buffer >= max_new_tokens must fail at load time for grpo and ppo too, not with
    overlong_penalty's ValueError after the first rollout (or, at ==, penalise every response)."""
    for recipe in ("tiny-cpu-grpo.yaml", "tiny-cpu-ppo.yaml", "tiny-cpu-dapo.yaml"):
        with pytest.raises(ConfigError, match="overlong_buffer"):
            load_config(ROOT / "examples" / recipe, ["rollout.max_new_tokens=32", "algorithm.overlong_buffer=32"])
        assert load_config(ROOT / "examples" / recipe, ["rollout.max_new_tokens=32",
                                                         "algorithm.overlong_buffer=8"]).algorithm.overlong_buffer == 8


def test_group_relative_algorithms_need_two_samples_a_prompt():
    """GRPO / DAPO advantages of a group of one are 0: a run with rollout.n_samples=1 would learn
    nothing, silently (verl asserts rollout.n > 1 for GRPO). PPO's critic does not need groups."""
    for recipe in ("tiny-cpu-grpo.yaml", "tiny-cpu-dapo.yaml"):
        with pytest.raises(ConfigError, match="needs rollout.n_samples >= 2, got 1"):
            load_config(ROOT / "examples" / recipe, ["rollout.n_samples=1"])
    assert load_config(ROOT / "examples" / "tiny-cpu-ppo.yaml", ["rollout.n_samples=1"]).rollout.n_samples == 1


# ---- Unknown config keys name ours: verl's names, a leaf under the wrong section, a misspelling.

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
