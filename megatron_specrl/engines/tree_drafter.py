"""Moved: the drafter is rollout/tree_drafting/drafter.py. This module only keeps the names that
patches/sglang_0_5_23_tree_proposer.py imports from here; it goes when that patch imports them from the
drafter."""

from megatron_specrl.rollout.tree_drafting.drafter import TreeDrafter, opts_from_params, read_settings  # noqa: F401
