"""Resuming a checkpoint that is not this run's: one ConfigError naming the mismatch, raised
before Ray, the learner or any engine starts (no traceback from deep inside an actor)."""

import json
import shutil

import pytest

from megatron_specrl import checkpoint as ckpt
from megatron_specrl.config import ConfigError, load_config
from megatron_specrl.models.resolve import tokenizer_fingerprint


class _ReachedRay(Exception):
    pass


def _checkpoint(root, model_dir, hf_config=None, loader=None, critic=False, step=2, keep=2):
    tmp = ckpt.begin(root / "checkpoints", step)
    hf = tmp / "learner" / "hf"
    hf.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, hf / f.name)
    if hf_config is not None:
        (hf / "config.json").write_text(json.dumps(hf_config))
    if critic:
        (tmp / "critic").mkdir()
    (tmp / "learner" / "shard.bin").write_bytes(f"weights of step {step}".encode())
    state = {"step": step, "weight_version": step, "tokenizer": tokenizer_fingerprint(model_dir),
             "model_dir": str(model_dir),
             "loader": loader or {"epoch": 0, "position": 8, "seed": 0, "shuffle": True, "num_records": 16}}
    return ckpt.commit(tmp, state, keep=keep)


def _build(tmp_path, tiny_llama, monkeypatch, *extra):
    import megatron_specrl.actors as actors
    from megatron_specrl.run_setup import build_run

    def reached(*a, **k):
        raise _ReachedRay
    monkeypatch.setattr(actors, "init_ray", reached)
    cfg = load_config(None, [f"output_dir={tmp_path}", f"model.path={tiny_llama}", "data.num_synthetic=16",
                             "trainer.prompts_per_step=8", "data.num_eval=0", "trainer.seed=0", *extra])
    return build_run(cfg)


def test_the_same_models_checkpoint_gets_past_the_checks(tmp_path, tiny_llama, monkeypatch):
    _checkpoint(tmp_path, tiny_llama)
    with pytest.raises(_ReachedRay):
        _build(tmp_path, tiny_llama, monkeypatch)


def test_another_models_checkpoint_is_refused(tmp_path, tiny_llama, monkeypatch):
    other = json.loads((tiny_llama / "config.json").read_text())
    other["num_hidden_layers"] += 2
    _checkpoint(tmp_path, tiny_llama, hf_config=other)
    with pytest.raises(ConfigError, match=r"model mismatch: checkpoint .*step_00000002.*\(num_hidden_layers \d+ vs \d+"):
        _build(tmp_path, tiny_llama, monkeypatch)


def test_a_checkpoint_over_other_data_is_refused(tmp_path, tiny_llama, monkeypatch):
    _checkpoint(tmp_path, tiny_llama, loader={"epoch": 0, "position": 8, "seed": 0, "shuffle": True,
                                              "num_records": 64})
    with pytest.raises(ConfigError, match=r"trainer.resume: checkpoint .*step_00000002.*num_records=64"):
        _build(tmp_path, tiny_llama, monkeypatch)


def test_ppo_from_a_checkpoint_without_a_critic_is_refused(tmp_path, tiny_llama, monkeypatch):
    _checkpoint(tmp_path, tiny_llama)
    with pytest.raises(ConfigError, match=r"checkpoint .*step_00000002 has no critic"):
        _build(tmp_path, tiny_llama, monkeypatch, "algorithm.name=ppo")


def test_another_optimizer_layout_is_refused_before_ray(tmp_path, tiny_llama, monkeypatch):
    """The learner refuses it too, but from inside its Ray actor: a RayTaskError traceback."""
    c = _checkpoint(tmp_path, tiny_llama)
    (c / "learner" / "specrl_learner.json").write_text(json.dumps(
        {"tp": 1, "pp": 1, "dp": 1, "role": "policy", "distributed_optimizer": True}))
    manifest = json.loads((c / ckpt.MANIFEST).read_text())
    manifest["files"]["learner/specrl_learner.json"] = ckpt.file_checksum(c / "learner" / "specrl_learner.json")
    (c / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"Megatron distributed optimizer state.*learner.distributed_optimizer=true"):
        _build(tmp_path, tiny_llama, monkeypatch)
    with pytest.raises(_ReachedRay):
        _build(tmp_path, tiny_llama, monkeypatch, "learner.distributed_optimizer=true")


def test_resume_never_in_an_earlier_runs_directory_is_refused(tmp_path, tiny_llama, monkeypatch):
    """trainer.resume=never there trimmed the earlier run's metrics.jsonl to nothing, overwrote its
    config.yaml, and left its later checkpoints for a resume=auto to continue: refused before writing."""
    _checkpoint(tmp_path, tiny_llama)
    (tmp_path / "config.yaml").write_text("earlier run\n")
    with pytest.raises(ConfigError, match=r"trainer.resume=never: .* holds an earlier run \(checkpoint step_00000002\)"):
        _build(tmp_path, tiny_llama, monkeypatch, "trainer.resume=never")
    assert (tmp_path / "config.yaml").read_text() == "earlier run\n"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match=r"holds an earlier run \(metrics.jsonl\)"):
        _build(fresh, tiny_llama, monkeypatch, "trainer.resume=never")
    with pytest.raises(_ReachedRay):                     # an empty directory starts
        _build(tmp_path / "empty", tiny_llama, monkeypatch, "trainer.resume=never")
