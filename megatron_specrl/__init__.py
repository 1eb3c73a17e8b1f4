"""megatron-specrl: on-policy RL for LLMs with speculative rollouts on a Megatron-core learner."""

__version__ = "0.1.0"
