"""Turn `model.path` into an HF checkpoint directory on disk.

A tiny model's name (TINY: tiny-llama, tiny-qwen2, tiny-qwen3, tiny-qwen3-moe) builds that model
and warms it up on the synthetic task (cached by config hash); anything else must be a local HF
checkpoint directory: nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from megatron_specrl.config import ConfigError, ModelConfig
from megatron_specrl.models.cache import build_once
from megatron_specrl.models.families import FAMILIES

TINY = {family.tiny_name: model_type for model_type, family in FAMILIES.items()}   # tiny model name -> its family


def cache_root() -> Path:
    return Path(os.environ.get("MEGATRON_SPECRL_CACHE", Path.home() / ".cache" / "megatron_specrl"))


_TINY_MARKER = "specrl_tiny.json"   # build_tiny_model writes it last


def resolve_model(model_cfg: ModelConfig, seed: int = 0, task_terms: tuple[int, int] | None = None) -> Path:
    """`task_terms`: the synthetic task's (min, max) terms, which the tiny model is warmed up on."""
    if model_cfg.path in TINY:
        base = cache_root() / f"{model_cfg.path}-seed{seed}"
        if not (base / _TINY_MARKER).is_file():
            from megatron_specrl.models.tiny import build_tiny_model
            build_once(base, _TINY_MARKER, lambda tmp: build_tiny_model(tmp, arch=TINY[model_cfg.path], seed=seed))
        if model_cfg.warmup_steps == 0:
            return base
        from megatron_specrl.models.warmup import warmup_sft
        return Path(warmup_sft(base, cache_root() / "warmup", steps=model_cfg.warmup_steps,
                               lr=model_cfg.warmup_lr, seed=seed, terms=task_terms))
    path = Path(model_cfg.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path={model_cfg.path!r} is not a local HF checkpoint directory "
                          f"(no config.json) and not one of {sorted(TINY)}")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"model.path={model_cfg.path!r} has no *.safetensors weights (the learner does not read "
                          "PyTorch .bin checkpoints)")
    return path


def tokenizer_fingerprint(model_dir: Path) -> str:
    """Identifies the tokenizer, so a resume with another tokenizer is refused."""
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        f = Path(model_dir) / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def read_hf_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def resolve_draft_model(model_cfg: ModelConfig, draft_model: str | None, policy_dir: Path,
                        task_terms: tuple[int, int] | None = None) -> Path:
    """rollout.draft_model's directory, checked against the policy's (check_draft_model). A tiny
    model's name gives that model as model.path would (its warm-up included): a frozen copy of the
    starting policy when the policy is that tiny model, which shows on a laptop how a fixed draft
    model's acceptance falls as the policy trains."""
    if draft_model in TINY:
        draft_dir = resolve_model(model_cfg.model_copy(update={"path": draft_model}), seed=0, task_terms=task_terms)
    else:
        draft_dir = Path(draft_model) if draft_model else None
    check_draft_model(draft_dir, policy_dir)
    return draft_dir


def check_draft_model(draft_dir: str | Path | None, policy_dir: str | Path) -> None:
    """rollout.draft=model's draft model, before any engine starts: an HF directory whose vocabulary is
    the policy's. vLLM verifies draft tokens by id; a draft with another vocabulary would fail inside
    the engine's worker (or, with the same size but other tokens, draft nothing that is accepted)."""
    if not draft_dir:
        raise ConfigError("rollout.draft=model needs rollout.draft_model: the HF directory of a smaller model with "
                          "the policy's tokenizer")
    cfg_file = Path(draft_dir) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"rollout.draft_model={str(draft_dir)!r}: no config.json there (expected an HF model "
                          "directory)")
    try:
        draft = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise ConfigError(f"rollout.draft_model={str(draft_dir)!r}: config.json is not JSON ({e})") from None
    policy = read_hf_config(Path(policy_dir))
    if draft.get("vocab_size") != policy.get("vocab_size"):
        raise ConfigError(f"rollout.draft_model={str(draft_dir)!r}: vocab_size {draft.get('vocab_size')} is not the "
                          f"policy's {policy.get('vocab_size')}; the draft model must share the policy's tokenizer")
