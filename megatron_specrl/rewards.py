"""Verifiable rewards: a name -> function registry, chosen by `reward.name` (or by the data format).

A reward function maps (response text, PromptRecord) to a float and must never
raise on model output: a malformed response is simply worth 0.0. Model output is
never passed to Python's eval; math answers are compared with math-verify.

Built-ins (what each accepts as a response's final answer; record.answer is the gold answer):

    arithmetic    the synthetic task: the response must end in 'A:<integer>' equal to the answer
    gsm8k         the number after the last '####', else the last number anywhere; ',' and '$' ignored
    gsm8k_strict  only a '#### <number>' final answer counts (verl's strict GSM8K scoring)
    math_verify   math-verify's equivalence of the response's final answer (\\boxed{}, $...$,
                  'Answer: ...') with the gold answer (LaTeX, fractions, decimals, sets, ...)

A user reward is either registered by name (imported before the run starts):

    @register_reward("my_task")
    def my_task(response: str, record: PromptRecord) -> float: ...

or named by a dotted path, `reward.name=my_package.my_module.my_task`, imported when the config loads.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import re
import threading
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Callable

from megatron_specrl.data import synthetic
from megatron_specrl.data.datasets import PromptRecord, file_format, last_boxed

if TYPE_CHECKING:   # a type only: the config imports this module to validate reward.name
    from megatron_specrl.config import DataConfig

RewardFn = Callable[[str, PromptRecord], float]

_REGISTRY: dict[str, RewardFn] = {}
log = logging.getLogger(__name__)


class RewardError(ValueError):
    """A reward function returned something that is not a finite number."""


class UnknownRewardError(KeyError):
    """No reward registered under that name; the message lists the known names."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn(response_text, record) -> float` under `name`."""
    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and not overwrite and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered; pass overwrite=True to replace it")
        _REGISTRY[name] = fn
        return fn
    return deco


def get_reward(name: str) -> RewardFn:
    """A registered reward by name, or a user function by dotted path `package.module.function`."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "." in name.strip(".") and " " not in name:
        return _import_reward(name)
    raise UnknownRewardError(f"unknown reward {name!r}; registered rewards: {', '.join(sorted(_REGISTRY))}, "
                             f"or a dotted path package.module.function")


def _import_reward(path: str) -> RewardFn:
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:   # ModuleNotFoundError, or the user module failing while it imports
        detail = " ".join(f"{type(e).__name__}: {e}".split())
        raise UnknownRewardError(f"reward {path!r}: cannot import module {module_name!r} ({detail})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise UnknownRewardError(f"reward {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise UnknownRewardError(f"reward {path!r}: {attr!r} is a {type(fn).__name__}, not a function "
                                 f"fn(response, record) -> float")
    return fn


def list_rewards() -> list[str]:
    return sorted(_REGISTRY)


# --------------------------------------------------------------------------- arithmetic

@register_reward("arithmetic")
def arithmetic_reward(response: str, record: PromptRecord) -> float:
    """Synthetic task: 1.0 when the response ends in 'A:<integer>' (surrounding whitespace aside) and that
    integer equals record.answer; else 0.0 (malformed, or a non-integer gold answer, included)."""
    got = synthetic.extract_answer(response)
    if got is None:
        return 0.0
    try:
        return float(got == int(record.answer))
    except ValueError:
        return 0.0


# --------------------------------------------------------------------------- gsm8k

_NUM_RE = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_HASH_RE = re.compile(r"####\s*(-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+)")


def _to_decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip())
    except (InvalidOperation, ValueError):
        return None


def _numbers_equal(pred: str | None, gold: str) -> float:
    if pred is None:
        return 0.0
    a, b = _to_decimal(pred), _to_decimal(gold)
    return float(a is not None and b is not None and a == b)


@register_reward("gsm8k")
def gsm8k_reward(response: str, record: PromptRecord) -> float:
    """1.0 when the number after the last '####' in the response, or without one the last number anywhere
    in it, equals record.answer as a decimal (',' separators and '$' ignored, so '$1,500' = '1500' and
    '7.0' = '7'); text after the number ('#### 42 apples') is ignored. Else 0.0."""
    hashes = _HASH_RE.findall(response)
    if hashes:
        return _numbers_equal(hashes[-1], record.answer)
    nums = _NUM_RE.findall(response)
    return _numbers_equal(nums[-1] if nums else None, record.answer)


@register_reward("gsm8k_strict")
def gsm8k_strict_reward(response: str, record: PromptRecord) -> float:
    """Like gsm8k, but only a '#### <number>' final answer counts (verl's strict GSM8K scoring): a
    response without '####' scores 0.0."""
    hashes = _HASH_RE.findall(response)
    return _numbers_equal(hashes[-1] if hashes else None, record.answer)


# --------------------------------------------------------------------------- math-verify

MATH_VERIFY_TIMEOUT_S = 5


_MATH_DELIMITER_RE = re.compile(r"(?<!\\)\$")   # a '$' that opens or closes math; '\$' is a dollar sign
_BOXED_BRACE_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _gold_text(answer: str) -> str:
    """The gold as math-verify should read it: as given when already boxed or $-delimited, else boxed.
    An escaped '\\$' (MATH's money answers, '\\$18.90') delimits nothing: unboxed, math-verify parses
    nothing from it and every response would score 0."""
    delimited = "\\boxed" in answer or _MATH_DELIMITER_RE.search(answer)
    return answer if delimited else f"\\boxed{{{answer}}}"


def _pred_text(response: str) -> str:
    """The part of the response math-verify reads: its last \\boxed{...} when it has one, else all of it.
    math-verify joins every boxed answer of a text into a set, so a response that corrects itself
    ('\\boxed{3} ... wait, \\boxed{4}') would be scored as {3, 4}, equal to neither."""
    start = max(response.rfind("\\boxed"), response.rfind("\\fbox"))
    if start < 0 or not _BOXED_BRACE_RE.match(response, start):   # '\\boxed 5': math-verify reads it all
        return response
    boxed = last_boxed(response)
    return response if boxed is None else f"\\boxed{{{boxed}}}"


def _math_verify_score(response: str, answer: str, timeout_s: int | None) -> float:
    """math-verify parse + verify; its own timeouts use SIGALRM, so only in a main thread."""
    from math_verify import parse, verify

    try:
        gold = parse(_gold_text(answer), parsing_timeout=timeout_s)
        pred = parse(_pred_text(response), parsing_timeout=timeout_s)
        if not gold or not pred:
            return 0.0
        return float(verify(gold, pred, timeout_seconds=timeout_s))
    except Exception:  # math-verify or sympy choking on odd output is a wrong answer, not a crash
        return 0.0


class _SubprocessScorer:
    """Off the main thread SIGALRM is unavailable: score in a child process that can be killed."""

    def __init__(self):
        self._pool = None
        self._lock = threading.Lock()

    def __call__(self, response: str, answer: str, timeout_s: float) -> float:
        with self._lock:
            if self._pool is None:
                self._pool = multiprocessing.get_context("spawn").Pool(1)
            job = self._pool.apply_async(_math_verify_score, (response, answer, MATH_VERIFY_TIMEOUT_S))
            try:
                return job.get(timeout=timeout_s)
            except multiprocessing.TimeoutError:
                log.warning("math_verify timed out after %.0fs; scoring 0.0", timeout_s)
                self._pool.terminate()
                self._pool = None
                return 0.0


_subprocess_scorer = _SubprocessScorer()


@register_reward("math_verify")
def math_verify_reward(response: str, record: PromptRecord) -> float:
    """1.0 when math-verify finds the response's final answer (the last \\boxed{}, else $...$ or
    'Answer: ...') equivalent to record.answer (LaTeX or plain; a gold answer without \\boxed or an
    unescaped $ is boxed first);
    unparsable output or a parse / verify timeout (5 s) scores 0.0."""
    if threading.current_thread() is threading.main_thread():
        return _math_verify_score(response, record.answer, MATH_VERIFY_TIMEOUT_S)
    return _subprocess_scorer(response, record.answer, 3 * MATH_VERIFY_TIMEOUT_S)


# --------------------------------------------------------------------------- defaults

_FORMAT_REWARD = {"synthetic": "arithmetic", "gsm8k": "gsm8k", "math": "math_verify", "plain": "math_verify"}


def default_reward_for(data_cfg: DataConfig) -> str:
    """The reward used when reward.name is unset: arithmetic (synthetic), gsm8k, or math_verify (math, plain)."""
    if data_cfg.source == "synthetic":
        return "arithmetic"
    return _FORMAT_REWARD[file_format(data_cfg.source, data_cfg)]


__all__ = ["RewardFn", "UnknownRewardError", "register_reward", "get_reward", "list_rewards",
           "arithmetic_reward", "gsm8k_reward", "gsm8k_strict_reward", "math_verify_reward",
           "default_reward_for"]
