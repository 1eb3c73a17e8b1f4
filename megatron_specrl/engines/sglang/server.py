"""How an SGLang server is started for tree drafting (rollout.draft=tree): its NGRAM worker's arguments, the
environment its scheduler processes need for patches/sglang_0_5_23_tree_proposer.py, and the entry point
that applies the patch there.
"""

from __future__ import annotations

from megatron_specrl.config import DrafterConfig
from megatron_specrl.engines.protocol import EngineError
from megatron_specrl.rollout.tree_drafting.drafter import as_drafter, settings_env

def tree_server_args(draft_tokens: int) -> dict:
    """sglang.Engine / launch_server arguments for draft="tree": the NGRAM worker with one verify root
    and `draft_tokens` draft nodes per request, drafting chains (BFS breadth 1, so top-k 1, which
    also keeps paged attention backends allowed), exact acceptance (thresholds 1: accept a draft
    token with its target probability), and a token-sized n-gram corpus (the patch never uses it;
    SGLang preallocates `capacity` trie nodes)."""
    if draft_tokens < 1:
        raise ValueError(f"draft_tokens must be at least 1, got {draft_tokens}")
    return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": int(draft_tokens) + 1,
            "speculative_ngram_min_bfs_breadth": 1, "speculative_ngram_max_bfs_breadth": 1,
            "speculative_accept_threshold_single": 1.0, "speculative_accept_threshold_acc": 1.0,
            "speculative_ngram_capacity": 1024}


def tree_server_env(drafter: DrafterConfig | dict | None = None) -> dict[str, str]:
    """Environment SGLang's scheduler processes need for the tree patch (they inherit it): rollout.drafter
    whole, as JSON (rollout/tree_drafting/drafter.settings_env)."""
    from megatron_specrl.patches.sglang_0_5_23_tree_proposer import SETTINGS_ENV
    from megatron_specrl.patches.sglang_engine_patches import ENV
    return {SETTINGS_ENV: settings_env(as_drafter(drafter)), ENV: "1"}


PLUGIN_GROUP, PLUGIN_NAME = "sglang.srt.plugins", "specrl_patches"


def check_plugin_installed() -> None:
    """SGLang's scheduler processes take the tree patch only through our plugin entry point: without
    it the NGRAM worker would silently draft from its own n-gram corpus instead of our trees."""
    from importlib.metadata import entry_points
    if not any(ep.name == PLUGIN_NAME for ep in entry_points(group=PLUGIN_GROUP)):
        raise EngineError(f"the {PLUGIN_GROUP} entry point {PLUGIN_NAME} is not installed (setup.py declares "
                          "it): reinstall the project (pip install -e .) before draft='tree' with SGLang", "sglang")
