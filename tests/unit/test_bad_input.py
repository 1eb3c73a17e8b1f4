"""Bad input as a new user meets it: one line naming the key / file / row / flag, before work starts,
nothing already written lost. Each test is a case that gave a traceback, a late error or an unclear
one before (config, data rows, model directory, tokenizer, parallel layout, resume path, convert,
check-resync). Cheap: validation functions, build_run up to Ray, the CLI with its workers stubbed.
"""

import json
import shutil
import pytest
from megatron_specrl import checkpoint as ckpt
from megatron_specrl.cli import main
from megatron_specrl.config import ConfigError, DataConfig, load_config
from megatron_specrl.config.resolve import resolve
from megatron_specrl.data.datasets import DatasetError, PromptRecord, load_file, render_all, render_prompt

class _Reached(Exception):
    """A stub was called: the check under test did not stop the work first."""


def _one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


# --------------------------------------------------------------------------- config

def test_override_with_bad_yaml_syntax_is_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["learner.tp=[1"])
    assert "learner.tp=[1" in _one_line_error(e)


def test_recipe_with_bad_yaml_is_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learner: [1, 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    assert "not valid YAML" in _one_line_error(e)


def test_unresolvable_interpolation_is_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["learner.tp=${nope}"])
    assert "nope" in _one_line_error(e)


@pytest.mark.parametrize("key", ["rollout.top_k", "rollout.val_kwargs.top_k"])
def test_top_k_below_minus_one_is_refused_at_config_time(key):
    """vLLM refuses top_k < -1 only when it first samples (SamplingParams), after the engines started."""
    with pytest.raises(ConfigError, match=rf"'{key}': -5"):
        load_config(None, [f"{key}=-5"])
    load_config(None, [f"{key}=0"])   # 0 and -1: off


def test_fewer_synthetic_prompts_than_a_round_is_refused_at_config_time():
    """Was caught only in build_run, after the tiny model's build and warm-up, blaming the overlong filter."""
    with pytest.raises(ConfigError, match=r"data.num_synthetic=8 is below trainer.prompts_per_step=16"):
        load_config(None, ["data.num_synthetic=8", "trainer.prompts_per_step=16"])


# --------------------------------------------------------------------------- the trainer's own layout check

def _fit(overrides, **shape):
    """plan.model_fit_failures, the lines the run's start-up check (plan.check_model_fits) raises, for a
    Llama-shaped model with `shape`'s fields changed."""
    from megatron_specrl.plan import ModelShape, model_fit_failures
    fields = dict(model_type="llama", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=256, vocab=264,
                  tied=False, qkv_bias=False, max_positions=512)
    return model_fit_failures(load_config(None, overrides), ModelShape(**dict(fields, **shape)))


def test_trainer_divisibility_checks_intermediate_size():
    [line] = _fit(["learner.tp=2"], ffn=255)
    assert line.startswith("learner.tp=2 does not divide intermediate_size=255 of model.path=")


def test_trainer_divisibility_checks_engine_tp_against_kv_heads():
    """vLLM takes engine_tp > kv heads only as a multiple of them; engine_tp < kv heads must divide them."""
    [line] = _fit(["rollout.engine_tp=2"], heads=6, kv_heads=3)
    assert line.startswith("rollout.engine_tp=2 does not divide num_key_value_heads=3")
    assert _fit(["rollout.engine_tp=4"], heads=8, kv_heads=2) == []   # replicated


def test_trainer_divisibility_checks_max_model_len_against_positions():
    assert _fit(["rollout.max_model_len=1024"]) == ["rollout.max_model_len=1024 exceeds the model's "
                                                    "max_position_embeddings=512"]


# --------------------------------------------------------------------------- data rows

def _jsonl(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_non_utf8_line_names_the_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DatasetError, match=r"d.jsonl: line 2 is not valid UTF-8 \(byte 0xe9"):
        load_file(p, DataConfig())


def test_null_field_is_named_null_not_missing(tmp_path):
    p = _jsonl(tmp_path, [{"prompt": "x", "answer": None}])
    with pytest.raises(DatasetError, match=r"line 1: answer field 'answer' is null"):
        load_file(p, DataConfig())


@pytest.mark.parametrize("prompt, what", [
    ([{"role": "user"}], r"message 0 has no 'content' \(keys: \['role'\]\)"),
    ([], r"is an empty list of chat messages"),
    ([{"role": "user", "content": "a"}, "b"], r"message 1 is a str, expected a \{'role'"),
    ([{"role": 3, "content": "a"}], r"message 0 has role of type int"),
])
def test_malformed_chat_row_names_the_message(tmp_path, prompt, what):
    p = _jsonl(tmp_path, [{"prompt": prompt, "answer": "1"}])
    with pytest.raises(DatasetError, match=r"line 1: prompt field 'prompt' " + what):
        load_file(p, DataConfig())


def test_empty_prompt_is_refused(tmp_path):
    p = _jsonl(tmp_path, [{"prompt": "ok", "answer": "1"}, {"prompt": "  ", "answer": "2"}])
    with pytest.raises(DatasetError, match=r"line 2: prompt field 'prompt' is empty"):
        load_file(p, DataConfig())


def test_mapping_answer_is_refused(tmp_path):
    """data.answer_key=reward_model (not reward_model.ground_truth): every reward would silently be 0."""
    p = _jsonl(tmp_path, [{"prompt": "q", "reward_model": {"ground_truth": "4", "style": "rule"}}])
    with pytest.raises(DatasetError, match=r"answer field 'reward_model' is a mapping \(keys: \['ground_truth'"):
        load_file(p, DataConfig(answer_key="reward_model"))


class _Tok:
    chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"

    def apply_chat_template(self, messages, **kw):
        from jinja2.exceptions import TemplateError
        raise TemplateError("Conversation roles must alternate\nuser/assistant/user/assistant/...")

    def __call__(self, text, add_special_tokens=True):
        class _E:
            input_ids = []
        return _E()


def test_chat_template_refusing_a_row_names_the_record():
    rec = PromptRecord("r7", "hi", "1", {"source": "d.jsonl", "messages": [{"role": "assistant", "content": "hi"}]})
    with pytest.raises(DatasetError) as e:
        render_prompt(rec, _Tok(), None)
    assert "record 'r7' (d.jsonl)" in _one_line_error(e) and "roles must alternate" in str(e.value)


def test_prompt_rendering_to_no_tokens_is_refused():
    """An empty user turn of a chat row (raw text, no BOS): the engines refuse it at the step that draws it."""
    rec = PromptRecord("r1", "", "1", {"source": "d.jsonl", "messages": [{"role": "user", "content": ""}]})
    with pytest.raises(DatasetError, match=r"train record 'r1' \(d.jsonl\) renders to no tokens"):
        render_all([rec], _Tok(), False, 64, False, "train")


# --------------------------------------------------------------------------- build_run up to Ray

def _build(out, model_dir, monkeypatch, *extra):
    import megatron_specrl.cluster.actors as actors
    from megatron_specrl.run.build import build_run

    def reached(*a, **k):
        raise _Reached
    monkeypatch.setattr(actors, "init_ray", reached)
    cfg = load_config(None, [f"output_dir={out}", f"model.path={model_dir}", "data.num_synthetic=16",
                             "trainer.prompts_per_step=8", "data.num_eval=0", *extra])
    return build_run(resolve(cfg))


def _model_copy(tmp_path, tiny_llama, name="model", drop=(), **config):
    d = tmp_path / name
    shutil.copytree(tiny_llama, d)
    for f in drop:
        (d / f).unlink()
    if config:
        c = json.loads((d / "config.json").read_text())
        c.update(config)
        (d / "config.json").write_text(json.dumps(c))
    return d


def test_model_dir_without_tokenizer_is_one_line_before_ray(tmp_path, tiny_llama, monkeypatch):
    d = _model_copy(tmp_path, tiny_llama, drop=[p.name for p in tiny_llama.glob("tokenizer*")])
    with pytest.raises(ConfigError, match=r"model.path='.*model': cannot load its tokenizer") as e:
        _build(tmp_path / "out", d, monkeypatch)
    _one_line_error(e)


def test_tokenizer_larger_than_the_model_vocab_is_refused(tmp_path, tiny_llama, monkeypatch):
    d = _model_copy(tmp_path, tiny_llama, vocab_size=200)
    with pytest.raises(ConfigError, match=r"the tokenizer has 264 tokens, more than the model's vocab_size=200"):
        _build(tmp_path / "out", d, monkeypatch)


def test_trainer_path_checks_intermediate_size(tmp_path, tiny_llama, monkeypatch):
    d = _model_copy(tmp_path, tiny_llama, intermediate_size=255)
    with pytest.raises(ConfigError, match=r"learner.tp=2 does not divide intermediate_size=255"):
        _build(tmp_path / "out", d, monkeypatch, "learner.tp=2")


def test_a_failed_start_keeps_the_earlier_runs_config_yaml(tmp_path, tiny_llama, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text("the earlier run's\n")
    d = _model_copy(tmp_path, tiny_llama, vocab_size=200)
    with pytest.raises(ConfigError):
        _build(out, d, monkeypatch)
    assert (out / "config.yaml").read_text() == "the earlier run's\n"


def test_too_few_file_prompts_does_not_blame_the_overlong_filter(tmp_path, tiny_llama, monkeypatch):
    data = _jsonl(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)])
    with pytest.raises(DatasetError) as e:
        _build(tmp_path / "out", tiny_llama, monkeypatch, f"data.source={data}")
    msg = str(e.value)
    assert "filter_overlong_prompts" not in msg and "4 train prompts, fewer than trainer.prompts_per_step=8" in msg


# --------------------------------------------------------------------------- resume

def _fake_checkpoint(root, step=2):
    tmp = ckpt.begin(root, step)
    (tmp / "learner").mkdir()
    (tmp / "learner" / "shard.bin").write_bytes(b"w")
    return ckpt.commit(tmp, {"step": step}, keep=3)


def _resume_problem(tmp_path, resume):
    from megatron_specrl.run.checkpointing import find_resume
    with pytest.raises(ConfigError) as e:
        find_resume(load_config(None, [f"trainer.resume={resume}"]), tmp_path / "out")
    return _one_line_error(e)


def test_resume_at_the_checkpoints_directory_points_at_its_newest(tmp_path):
    c = _fake_checkpoint(tmp_path / "run" / "checkpoints")
    assert f"a directory of checkpoints, not one: pass one of its step_* directories (the newest complete: {c})" \
        in _resume_problem(tmp_path, tmp_path / "run" / "checkpoints")
    assert "a directory of checkpoints" in _resume_problem(tmp_path, tmp_path / "run")   # the output_dir


def test_resume_inside_a_checkpoint_names_the_checkpoint(tmp_path):
    c = _fake_checkpoint(tmp_path / "checkpoints")
    assert f"a part of checkpoint {c}; pass trainer.resume='{c}'" in _resume_problem(tmp_path, c / "learner")


def test_resume_at_a_missing_or_unrelated_directory(tmp_path):
    assert "not a directory (nothing there)" in _resume_problem(tmp_path, tmp_path / "nope")
    (tmp_path / "other").mkdir()
    assert "not a checkpoint (no manifest.json" in _resume_problem(tmp_path, tmp_path / "other")


def test_manifest_without_a_file_list_is_a_problem_not_a_keyerror(tmp_path):
    c = _fake_checkpoint(tmp_path / "checkpoints")
    (c / ckpt.MANIFEST).write_text("{}")
    assert ckpt.verify(c) == "manifest has no file list"


def test_dry_run_checks_the_resume_path(tmp_path, capsys):
    rc = main(["train", "tiny-cpu-grpo", "--dry-run", f"output_dir={tmp_path / 'out'}",
               f"trainer.resume={tmp_path / 'nope'}"])
    assert rc == 2
    assert "trainer.resume=" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- convert, check-resync

def test_convert_names_its_flag_for_a_missing_model(tmp_path, capsys):
    assert main(["convert", "hf-to-mcore", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert f"--hf {tmp_path / 'nope'}: no config.json" in capsys.readouterr().err
    assert main(["convert", "mcore-to-hf", "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert f"--ckpt {tmp_path / 'nope'}: no hf/config.json" in capsys.readouterr().err


def test_convert_refuses_a_non_empty_out_before_spawning(tmp_path, tiny_llama, monkeypatch, capsys):
    import megatron_specrl.learner.convert as convert

    def reached(*a, **k):
        raise _Reached
    monkeypatch.setattr(convert, "convert_main", reached)
    out = tmp_path / "existing"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"keep me")
    assert main(["convert", "hf-to-mcore", "--hf", str(tiny_llama), "--out", str(out)]) == 2
    assert f"--out {out} already exists and is not empty" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == b"keep me"


def test_hf_to_mcore_called_directly_checks_the_layout_before_spawning(tmp_path, tiny_llama, monkeypatch):
    import torch.multiprocessing as mp

    from megatron_specrl.learner.convert import hf_to_mcore
    from megatron_specrl.plan import PlanError

    def reached(*a, **k):
        raise _Reached
    monkeypatch.setattr(mp, "spawn", reached)
    with pytest.raises(PlanError, match=r"--tp=3 does not divide"):
        hf_to_mcore(tiny_llama, tmp_path / "o", tp=3)


@pytest.mark.parametrize("argv, line", [
    (["--tp", "3"], "--tp=3 does not divide num_attention_heads=4 and num_key_value_heads=2 and "
                    "intermediate_size=256 of tiny-llama"),
    (["--pp", "3"], "--pp=3 does not divide num_hidden_layers=2 of tiny-llama"),
    (["--engine-tp", "8"], "--engine-tp=8 does not divide num_attention_heads=4 of tiny-llama"),
    (["--engine-tp", "0"], "parallel sizes must be >= 1"),
])
def test_check_resync_checks_its_layout_before_ray(argv, line, monkeypatch, capsys):
    import megatron_specrl.diagnostics.check as check

    def reached(*a, **k):
        raise _Reached
    monkeypatch.setattr(check, "check_resync_main", reached)
    assert main(["check-resync", *argv]) == 2
    assert line in capsys.readouterr().err
