"""The resolve step: validation refuses, RunConfig.resolve_auto fills the keys left unset (auto) with the
same values as before it was split from validation, and megatron_specrl.config.resolve.resolve makes the one
frozen config a run reads (reward.name checked). Its choices and experimental features are logged once by
train() and printed by --dry-run; the CLI, train(), build_run and the engine factory do not resolve again,
and the run holds the draft model's directory in that same config."""

import logging
from pathlib import Path

import pytest

from megatron_specrl.config import ConfigError, RolloutConfig, RunConfig, load_config
from megatron_specrl.config.resolve import experimental_features, resolve, resolved_choices
from tests.helpers.import_graph import imports_of, internal_graph

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("rollout.verify", "learner.recompute_old_logprobs", "learner.loss.loss_scale_factor",
        "trainer.gen_prompts_per_step", "rollout.drafter.tokens")

# Recorded from the code before the resolve step was split out of RunConfig's validator (same recipes,
# same values): verify, recompute_old_logprobs, loss_scale_factor, gen_prompts_per_step, draft tokens
RECIPES = {
    "llama-3.1-70b-dapo-8node": ("prefill", True, 12288.0, 192, 16),
    "qwen2.5-32b-dapo-4node": ("prefill", True, 16384.0, 192, 16),
    "qwen2.5-7b-dapo-1node": ("prefill", True, 8192.0, 96, 16),
    "tiny-cpu-dapo": ("decode", False, 64.0, 16, 16),
    "tiny-cpu-grpo-long": ("decode", False, 96.0, 16, 16),
    "tiny-cpu-grpo": ("decode", False, 64.0, 16, 16),
    "tiny-cpu-ppo": ("decode", False, 64.0, 16, 16),
}
OVERRIDES = [   # on tiny-cpu-grpo, recorded the same way
    ([], ("decode", False, 64.0, 16, 16)),
    (["rollout.draft=none"], ("prefill", False, 64.0, 16, 16)),
    (["rollout.spec_mode=lenient"], ("prefill", False, 64.0, 16, 16)),
    (["rollout.spec_mode=off"], ("prefill", False, 64.0, 16, 16)),
    (["rollout.engine_dtype=bfloat16"], ("decode", True, 64.0, 16, 16)),
    (["rollout.top_p=0.9"], ("decode", True, 64.0, 16, 16)),
    (["learner.precision=bfloat16", "learner.distributed_optimizer=true"], ("decode", True, 64.0, 16, 16)),
    (["algorithm.dynamic_sampling=true", "trainer.gen_prompts_per_step=48"], ("decode", False, 64.0, 48, 16)),
    (["learner.loss.loss_scale_factor=10"], ("decode", False, 10.0, 16, 16)),
    (["rollout.draft=model", "rollout.draft_model=x"], ("prefill", False, 64.0, 16, 4)),
]


def _values(cfg: RunConfig) -> tuple:
    r, le = cfg.rollout, cfg.learner
    return (r.verify, le.recompute_old_logprobs, le.loss.loss_scale_factor, cfg.trainer.gen_prompts_per_step,
            r.drafter.tokens)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipes_resolve_as_before(recipe):
    cfg = resolve(load_config(ROOT / "examples" / f"{recipe}.yaml"))
    choices = resolved_choices(cfg)
    assert _values(cfg) == RECIPES[recipe]
    chosen = choices.as_dict()
    for key, value in zip(KEYS, RECIPES[recipe]):
        if key in chosen:
            assert chosen[key] == value


@pytest.mark.parametrize("overrides,expected", OVERRIDES)
def test_overrides_resolve_as_before(overrides, expected):
    cfg = resolve(load_config(ROOT / "examples" / "tiny-cpu-grpo.yaml", overrides))
    assert _values(cfg) == expected


def test_validation_fills_nothing_the_resolve_step_fills():
    cfg = RunConfig.model_validate({"rollout": {"draft": "tree"}})
    assert _values(cfg) == ("auto", None, None, None, None)          # the validator left them unset
    done = resolve(cfg)
    assert _values(done) == ("decode", False, 64.0, 16, 16)
    assert _values(cfg) == ("auto", None, None, None, None)          # resolve() fills a copy
    choices = resolved_choices(done)
    assert [c.key for c in choices.choices] == list(KEYS[-1:] + ("rollout.drafter.cost_refit",) + KEYS[:1] + KEYS[1:4])
    assert done.rollout.drafter.cost_refit == "checkpoint"           # the run keeps checkpoints (every 32 steps)
    assert resolve(load_config(None, ["rollout.draft=tree", "trainer.checkpoint_every=0"])).rollout.drafter.cost_refit \
        == "rollout"
    assert resolve(load_config(None, ["rollout.draft=none"])).rollout.drafter.cost_refit is None   # nothing to size
    assert all(c.why for c in choices.choices)
    assert resolved_choices(resolve(done)).choices == choices.choices   # nothing left: the same report


def test_explicit_values_are_kept_and_not_reported():
    cfg = load_config(ROOT / "examples" / "tiny-cpu-grpo.yaml",
                      ["rollout.verify=prefill", "learner.recompute_old_logprobs=true",
                       "learner.loss.loss_scale_factor=3", "trainer.gen_prompts_per_step=16",
                       "rollout.drafter.tokens=5", "rollout.draft=tree", "rollout.drafter.cost_refit=checkpoint"])
    assert resolved_choices(resolve(cfg)).choices == []
    assert _values(cfg) == ("prefill", True, 3.0, 16, 5)


def test_refusals_stay_validation():
    with pytest.raises(ConfigError, match="rollout.verify=decode with rollout.spec_mode=lenient"):
        load_config(None, ["rollout.verify=decode", "rollout.spec_mode=lenient", "rollout.draft=tree"])
    with pytest.raises(ConfigError, match="recompute_old_logprobs=false with rollout.engine_dtype=bfloat16"):
        load_config(None, ["learner.recompute_old_logprobs=false", "rollout.engine_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="differs from trainer.prompts_per_step"):
        load_config(None, ["trainer.gen_prompts_per_step=32"])
    with pytest.raises(ConfigError, match="data.num_synthetic=8 is below trainer.prompts_per_step=16"):
        load_config(None, ["data.num_synthetic=8"])


def test_a_rollout_config_resolves_as_the_run_does():
    """The Python API: a RolloutConfig built directly (no trainer) resolves like a recipe's."""
    r = RolloutConfig(draft="tree", spec_mode="exact")
    assert r.verify == "auto" and r.drafter.tokens is None         # built: nothing filled behind the user's back
    done = r.resolved()
    assert (done.verify, done.drafter.tokens) == ("decode", 16)
    assert r.verify == "auto"                                      # resolved() is a copy
    assert done.is_resolved and not r.is_resolved                  # ... and frozen, as the run's is
    assert RolloutConfig(draft="model", draft_model="x").resolved().verify == "prefill"
    assert RolloutConfig(draft="model", draft_model="x").resolved().drafter.tokens == 4
    assert RolloutConfig(spec_mode="lenient", draft="tree").resolved().verify == "prefill"
    run = resolve(load_config(None, ["rollout.draft=tree", "trainer.checkpoint_every=0"]))   # no checkpoints, as alone
    assert run.rollout == RolloutConfig(draft="tree").resolved()


class _Stop(Exception):
    pass


def _stub_build_run(monkeypatch) -> list:
    """train()'s build_run replaced by one that records the config it is handed, then stops the run."""
    from megatron_specrl import trainer
    seen = []

    def build_run(cfg):
        seen.append(cfg)
        raise _Stop
    monkeypatch.setattr(trainer, "build_run", build_run)
    return seen


def _train_until_build_run(monkeypatch, cfg) -> RunConfig:
    """train(cfg) up to build_run: the config build_run was handed."""
    from megatron_specrl import trainer
    seen = _stub_build_run(monkeypatch)
    with pytest.raises(_Stop):
        trainer.train(cfg)
    return seen[0]


def _count_resolve_calls(monkeypatch) -> list:
    """Every call of the resolve step from here on, wherever it was imported (its results, in order)."""
    from megatron_specrl import trainer
    from megatron_specrl.config import resolve as resolve_module
    calls, real = [], resolve_module.resolve

    def counted(cfg):
        calls.append(real(cfg))
        return calls[-1]
    monkeypatch.setattr(resolve_module, "resolve", counted)
    monkeypatch.setattr(trainer, "resolve", counted)
    return calls


def test_choices_are_logged_once(caplog, monkeypatch):
    cfg = resolve(load_config(ROOT / "examples" / "tiny-cpu-grpo.yaml"))
    with caplog.at_level(logging.INFO, logger="megatron_specrl.config.resolve"):
        _train_until_build_run(monkeypatch, cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_specrl.config.resolve"]
    assert lines == [f"resolved {line}" for line in resolved_choices(cfg).lines()]
    assert "resolved rollout.verify=decode  (spec_mode=exact with draft=tree verifies in the decode loop)" in lines


@pytest.mark.parametrize("overrides,needle", [
    (["rollout.spec_mode=coupled", "rollout.draft=none"], "rollout.spec_mode=coupled is experimental"),
    (["rollout.runahead=2"], "rollout.runahead=2 is experimental"),
    (["rollout.draft=model", "rollout.draft_model=x"], "rollout.draft=model is experimental"),
])
def test_experimental_features_warn_once(caplog, monkeypatch, overrides, needle):
    cfg = load_config(ROOT / "examples" / "tiny-cpu-grpo.yaml", overrides)
    with caplog.at_level(logging.INFO, logger="megatron_specrl.config.resolve"):
        _train_until_build_run(monkeypatch, cfg)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(needle)


def test_experimental_keys_say_so():
    r = RolloutConfig.model_fields
    for key in ("spec_mode", "runahead", "draft"):
        assert "Experimental:" in r[key].description, key
    assert experimental_features(load_config(ROOT / "examples" / "tiny-cpu-grpo.yaml")) == []
    # SGLang runs through the real engine in CI (tests/integration/engines/test_sglang_engine.py): no warning
    sglang = load_config(ROOT / "examples" / "tiny-cpu-grpo.yaml", ["rollout.engine=sglang"])
    assert "Experimental" not in r["engine"].description and experimental_features(sglang) == []


def test_reward_name_is_checked_by_the_resolve_step():
    cfg = load_config(None, ["reward.name=nope"])        # validation no longer imports the rewards
    with pytest.raises(ConfigError, match=r"invalid value for 'reward.name': 'nope' \(Value error, unknown reward"):
        resolve(cfg)
    resolve(load_config(None, ["reward.name=gsm8k"]))


def test_config_imports_no_reward_code():
    graph = internal_graph(imports_of(ROOT / "megatron_specrl"))
    assert "megatron_specrl.rewards" not in graph["megatron_specrl.config"]
    # nor through another module of the package
    seen, todo = set(), ["megatron_specrl.config"]
    while todo:
        for t in graph[todo.pop()] - seen:
            seen.add(t)
            todo.append(t)
    assert "megatron_specrl.rewards" not in seen


def test_dry_run_prints_the_resolved_values(capsys):
    from megatron_specrl.cli import main
    assert main(["train", "tiny-cpu-grpo", "--dry-run", "rollout.runahead=2"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("resolved auto values:"):].splitlines()
    assert block[1:8] == [
        "  rollout.draft=tree  (vLLM verifies sampled tree drafts exactly on CPU)",
        "  rollout.drafter.tokens=16  (a tree draft costs only its verification)",
        "  rollout.drafter.cost_refit=checkpoint  (a resumed run replays the steps since its checkpoint with the "
        "fit saved there)",
        "  rollout.verify=decode  (spec_mode=exact with draft=tree verifies in the decode loop)",
        "  learner.recompute_old_logprobs=false  (fp32 engine and learner, no top_p / top_k: their log-probs agree)",
        "  learner.loss.loss_scale_factor=64.0  (rollout.max_new_tokens)",
        "  trainer.gen_prompts_per_step=16  (trainer.prompts_per_step)"]
    assert block[8].startswith("  warning: rollout.runahead=2 is experimental")


def test_the_resolved_config_is_frozen():
    loaded = load_config(ROOT / "examples" / "tiny-cpu-grpo.yaml")
    cfg = resolve(loaded)
    assert cfg.is_resolved and not loaded.is_resolved
    for section, key, value in [(cfg, "output_dir", "elsewhere"), (cfg.rollout, "temperature", 0.5),
                                (cfg.rollout.drafter, "tokens", 3), (cfg.learner.loss, "clip_low", 0.1),
                                (cfg, "rollout", RolloutConfig())]:
        with pytest.raises(TypeError, match="the resolved config is frozen; set the key in the recipe or as a "
                                            "key=value override"):
            setattr(section, key, value)
    before = cfg.rollout.temperature
    loaded.rollout.temperature = 0.5 if before != 0.5 else 0.7   # a loaded config stays editable ...
    assert cfg.rollout.temperature == before                     # ... and the resolved one is its copy
    located = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"draft_model": "/d"})})
    assert located.is_resolved and located.rollout.is_resolved     # as run.build.prepare_model derives it
    with pytest.raises(TypeError, match="frozen"):
        RolloutConfig().resolved().verify = "prefill"


def test_the_cli_resolves_once_and_train_reads_that_config(monkeypatch, capsys):
    """`megatron-specrl train`: one resolve step; train() and build_run get its result, not resolved again."""
    from megatron_specrl import plan
    from megatron_specrl.cli import main
    calls = _count_resolve_calls(monkeypatch)
    monkeypatch.setattr(plan, "build_plan", lambda cfg, loads_model: None)   # no model built for the plan
    monkeypatch.setattr(plan, "print_plan", lambda p: None)
    seen = _stub_build_run(monkeypatch)
    with pytest.raises(_Stop):
        main(["train", "tiny-cpu-grpo", "rollout.runahead=2"])
    assert len(calls) == 1 and seen[0] is calls[0]
    calls.clear()
    assert main(["train", "tiny-cpu-grpo", "--dry-run"]) == 0 and len(calls) == 1   # the dry run prints its choices
    assert "resolved auto values:" in capsys.readouterr().out


def test_train_resolves_a_loaded_config_once_and_a_resolved_one_not_again(monkeypatch):
    calls = _count_resolve_calls(monkeypatch)
    resolved = resolve(load_config(ROOT / "examples" / "tiny-cpu-grpo.yaml"))
    assert _train_until_build_run(monkeypatch, resolved) is resolved and calls == []
    handed = _train_until_build_run(monkeypatch, load_config(ROOT / "examples" / "tiny-cpu-grpo.yaml"))
    assert calls == [handed] and handed.is_resolved   # the Python API: train(load_config(...))


def test_build_run_and_the_engines_take_the_resolved_config_as_given():
    from megatron_specrl.engines.factory import engine_kwargs
    from megatron_specrl.run.build import build_run
    with pytest.raises(ValueError, match=r"build_run takes the resolved config: megatron_specrl\.config\.resolve"):
        build_run(load_config(None))
    with pytest.raises(ValueError, match="the engines take a resolved RolloutConfig"):
        engine_kwargs(RolloutConfig(draft="tree"), "m", "logs", 0, 0)
    with pytest.raises(ValueError, match="the engines take a resolved RolloutConfig"):
        engine_kwargs(load_config(None).rollout, "m", "logs", 0, 0)   # filled, but not the resolve step's
    rollout = resolve(load_config(None, ["rollout.draft=tree"])).rollout
    assert engine_kwargs(rollout, "m", "logs", 0, 0)[1]["drafter"] is rollout.drafter   # read, not re-resolved


def test_the_run_holds_the_draft_models_directory(tmp_path, tiny_llama, monkeypatch):
    """rollout.draft_model is located once at run assembly (a tiny model's name builds one, stubbed here):
    the config the engines and Run.cfg get holds its directory, frozen as the resolve step left it."""
    import shutil

    from megatron_specrl.run import build
    draft_dir = tmp_path / "draft"
    shutil.copytree(tiny_llama, draft_dir)
    monkeypatch.setattr(build, "resolve_draft_model", lambda model, name, policy_dir, terms: draft_dir)
    seen = []

    def start_actors(cfg, model, out):   # what the engines are built from (cfg.rollout), then Run(cfg=cfg)
        seen.append(cfg)
        raise _Stop
    monkeypatch.setattr(build, "start_actors", start_actors)
    cfg = resolve(load_config(None, [f"output_dir={tmp_path / 'run'}", f"model.path={tiny_llama}",
                                     "rollout.draft=model", "rollout.draft_model=tiny-llama", "data.num_synthetic=16",
                                     "trainer.prompts_per_step=8", "data.num_eval=0"]))
    with pytest.raises(_Stop):
        build.build_run(cfg)
    run_cfg = seen[0]
    assert run_cfg.rollout.draft_model == str(draft_dir) and cfg.rollout.draft_model == "tiny-llama"
    assert run_cfg.is_resolved and run_cfg.rollout.is_resolved
    assert run_cfg.model_dump(exclude={"rollout"}) == cfg.model_dump(exclude={"rollout"})
    assert f"draft_model: {draft_dir}" in (tmp_path / "run" / "config.yaml").read_text()
