"""The model families the learner builds, maps and plans for: model_type -> its family module.

One module per family (llama.py, qwen2.py, qwen3.py, qwen3_moe.py) says everything the rest of the
code asks by model_type (base.Family lists the questions); shape.py holds the shape they read from an
HF config and the parallel-layout rule every entry point checks it with. Adding a family is a module
here and a line in FAMILIES.
"""

from __future__ import annotations

from megatron_specrl.models.families import llama, qwen2, qwen3, qwen3_moe
from megatron_specrl.models.families.base import Family

FAMILIES: dict[str, Family] = {f.model_type: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY)}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# reads a config of a model_type no family covers as a plain dense decoder (ModelShape.from_hf), so the plan can
# still size it while model_provider.check_hf_config refuses it
DENSE_DECODER = Family()


class UnsupportedModelType(ValueError):
    """A config whose model_type no family here covers."""


def family_of(hf_config) -> Family:
    """The family of an HF config (transformers' PretrainedConfig, or anything with a model_type)."""
    return family_named(hf_config.model_type)


def family_named(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise UnsupportedModelType(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    return FAMILIES[model_type]
