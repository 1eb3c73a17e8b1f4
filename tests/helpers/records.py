"""A prompt record with a gold answer, as a reward function receives it."""

from __future__ import annotations

from megatron_specrl.data.datasets import PromptRecord


def rec(answer: str) -> PromptRecord:
    return PromptRecord(id="r", prompt="p", answer=answer, meta={})


