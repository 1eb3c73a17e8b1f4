"""A checkpoint written by hand, and a run built until it would start Ray: what a resume checks first."""

import json
import shutil

from megatron_specrl import checkpoint as ckpt
from megatron_specrl.config import load_config
from megatron_specrl.config.resolve import resolve
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
    import megatron_specrl.cluster.actors as actors
    from megatron_specrl.run.build import build_run

    def reached(*a, **k):
        raise _ReachedRay
    monkeypatch.setattr(actors, "init_ray", reached)
    cfg = load_config(None, [f"output_dir={tmp_path}", f"model.path={tiny_llama}", "data.num_synthetic=16",
                             "trainer.prompts_per_step=8", "data.num_eval=0", "trainer.seed=0", *extra])
    return build_run(resolve(cfg))
