"""Declared capabilities for test engines (engines/protocol.py): a fake derives from what it implements.
`DraftsNothing` declares DraftsFromTrees with calls that do nothing, for fakes that take own drafts or
run-ahead requests (which need a tree-drafting engine) without keeping trees; a fake that keeps some
overrides the calls it implements."""

from __future__ import annotations

from megatron_specrl.engines.protocol import DraftsFromTrees, EngineCapabilities, RoutesToEngines


class DraftsNothing(EngineCapabilities, DraftsFromTrees):
    def draft_stats(self) -> dict[str, float]:
        return {}

    def draft_state(self) -> dict | None:
        return None

    def load_draft_state(self, state: dict) -> None:
        pass

    def add_to_draft_trees(self, responses) -> None:
        pass


class Routes(RoutesToEngines):
    """A router that is only its engines (what engines_of / the recovery code see of one)."""

    def __init__(self, engines):
        self.engines = list(engines)
