"""The small protocol every rollout engine speaks (vLLM, SGLang, routers of them).

Everything is token ids in, token ids + log-probs out: the rollout code never
hands text to an engine, so tokenizer drift cannot silently change a trajectory.
Every call carries the weight version the caller believes is loaded; an engine
serving another version raises instead of answering.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, runtime_checkable

import torch


class EngineError(RuntimeError):
    """An engine died, timed out or ran out of memory. Carries its last log lines."""

    def __init__(self, message: str, engine: str = "", last_log_lines: list[str] | None = None):
        self.engine = engine
        self.last_log_lines = list(last_log_lines or [])
        tail = "\n".join(self.last_log_lines[-20:])
        super().__init__(f"[{engine}] {message}" + (f"\n--- last engine log lines ---\n{tail}" if tail else ""))


class WeightVersionMismatch(RuntimeError):
    """A response was (or would be) produced under weights other than the caller expects."""


@dataclass
class SamplingSettings:
    """Distribution the policy samples from; part of both verification and resampling."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Eval needs no log-probs: then any temperature (0 = greedy) is fine on any engine.
    need_logprobs: bool = True


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int | None = None
    # Token that must not be produced at the *first* generated position only
    # (the exact speculative rule's resample at the first rejection).
    ban_first_token: int | None = None


@dataclass
class GenerateResult:
    token_ids: list[int]
    logprobs: list[float]          # log-prob of each generated token under the serving weights
    finish_reason: str             # "stop" (EOS / stop token) or "length"
    num_cached_tokens: int = 0     # prompt tokens served from the prefix cache
    weight_version: int = -1


@dataclass
class ScoreRequest:
    prompt_ids: list[int]
    continuation_ids: list[int]


@dataclass
class ScoreResult:
    logprobs: list[float]          # one per continuation token, under the serving weights
    weight_version: int = -1


@dataclass
class EngineHealth:
    alive: bool
    weight_version: int
    detail: dict = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    name: str

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: list[GenerateRequest], sampling: SamplingSettings,
                 weight_version: int) -> list[GenerateResult]: ...

    def score(self, requests: list[ScoreRequest], sampling: SamplingSettings,
              weight_version: int) -> list[ScoreResult]:
        """Log-probs of given continuations in one prefill; leaves the prefix cache warm."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load (a bucket of) HF-named full tensors. Does not bump the version by itself
        unless `finish_update` is called; see resync.lifecycle."""
        ...

    def finish_update(self, version: int) -> None:
        """Bump weight_version and reset the prefix cache (nothing served in between)."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def health(self) -> EngineHealth: ...

    def shutdown(self) -> None: ...


def check_version(engine_name: str, serving: int, expected: int) -> None:
    if serving != expected:
        raise WeightVersionMismatch(
            f"engine {engine_name} serves weight version {serving}, caller expects {expected}")

