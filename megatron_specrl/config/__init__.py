"""A run's configuration: the schema and its loading (schema), what the unset keys become (resolve), hints
for unknown keys (hints), where the learner ranks and engines go (placement) and the generated
docs/configuration.md (docs). The schema's public names are importable from here; the plan check that holds
a config against the models, data and memory is megatron_specrl.plan."""

from megatron_specrl.config.schema import (
    DRAFT_TOKENS_AUTO, EXAMPLES, OWNED_ENGINE_ARGS, RESYNC_TRANSPORTS, AlgorithmConfig, Choice, ClusterConfig,
    ConfigError, DataConfig, DrafterConfig, EngineKwargs, KLControlConfig, LearnerConfig, LoggingConfig, LossConfig,
    ModelConfig, RayConfig, RewardConfig, RolloutConfig, RunConfig, TrainerConfig, ValKwargs, check_engine_args,
    load_config, resolve_recipe, to_yaml,
)

__all__ = [
    "DRAFT_TOKENS_AUTO",
    "EXAMPLES",
    "OWNED_ENGINE_ARGS",
    "RESYNC_TRANSPORTS",
    "AlgorithmConfig",
    "Choice",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "DrafterConfig",
    "EngineKwargs",
    "KLControlConfig",
    "LearnerConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainerConfig",
    "ValKwargs",
    "check_engine_args",
    "load_config",
    "resolve_recipe",
    "to_yaml",
]
