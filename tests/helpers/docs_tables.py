"""Reading the documented configuration keys."""

from __future__ import annotations

import re


def _config_tables(page: str) -> str:
    """The key rows of a docs page's tables (docs/algorithms.md: the settings table and the loss table)."""
    return "\n".join(line for line in page.splitlines() if line.startswith("| `"))


def _documented_keys(rows: str) -> set[str]:
    """`section.key` and the bare `key`s that follow it in the same cell: `rollout.a`, `b` -> rollout.a, rollout.b.
    Only the first cell (the verl column names verl's keys, not ours)."""
    keys = set()
    for row in rows.splitlines():
        cell = row.split(" | ")[0].lstrip("| ")
        section = None
        for name in re.findall(r"`([a-z_.*]+)`", cell):
            m = re.match(r"(rollout|learner\.loss|learner|algorithm)\.([a-z_*]+)$", name)
            if m:
                section = m.group(1)
                keys.add(name)
            elif section and re.fullmatch(r"[a-z_]+", name):
                keys.add(f"{section}.{name}")
    return keys


