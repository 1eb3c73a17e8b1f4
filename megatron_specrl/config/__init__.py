"""A run's configuration, from recipe to checked plan: the schema and its loading (schema), what the
unset keys become (resolve), hints for unknown keys (hints), the plan check before a run queues (plan)
and the generated docs/configuration.md (docs). The schema's public names are importable from here."""

from megatron_specrl.config.schema import (
    DRAFT_TOKENS_AUTO, EXAMPLES, OWNED_ENGINE_ARGS, RESYNC_TRANSPORTS, AlgorithmConfig, Choice, ClusterConfig,
    ConfigError, DataConfig, DrafterConfig, EngineKwargs, KLControlConfig, LearnerConfig, LoggingConfig, LossConfig,
    ModelConfig, RayConfig, RewardConfig, RolloutConfig, RunConfig, TrainerConfig, ValKwargs, check_engine_args,
    load_config, resolve_recipe, to_yaml,
)
