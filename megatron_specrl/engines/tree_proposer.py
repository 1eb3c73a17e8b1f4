"""Moved: vLLM's tree proposer is engines/vllm/tree_proposer.py, the request keys are the drafter's
(rollout/tree_drafting/drafter.py). This module only keeps the name that
patches/vllm_0_32_0_coupled_sampling.py imports from here; it goes when that patch imports RESPONSE_START
from the drafter."""

from megatron_specrl.rollout.tree_drafting.drafter import RESPONSE_START  # noqa: F401
