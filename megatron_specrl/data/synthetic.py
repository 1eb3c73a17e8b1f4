"""Built-in verifiable task: multi-term addition with a worked trace.

A tiny model learns the format in a short warm-up and then gets a
fraction of the sums right, which leaves room for RL to improve it.
Answers are checked exactly, so the reward is noiseless.

    prompt:   "Q:3+4+2="
    response: "3+4=7;7+2=9;A:9"  (+ EOS)
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

ANSWER_RE = re.compile(r"A:(-?\d+)\s*$")


@dataclass(frozen=True)
class ArithmeticProblem:
    terms: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return "Q:" + "+".join(str(t) for t in self.terms) + "="

    @property
    def answer(self) -> int:
        return sum(self.terms)

    @property
    def trace(self) -> str:
        """Worked solution: running sums, then the final answer."""
        steps, acc = [], self.terms[0]
        for t in self.terms[1:]:
            steps.append(f"{acc}+{t}={acc + t}")
            acc += t
        return ";".join(steps) + f";A:{acc}"


def make_problems(n: int, seed: int, min_terms: int = 3, max_terms: int = 6, max_value: int = 9) -> list[ArithmeticProblem]:
    rng = random.Random(seed)
    return [
        ArithmeticProblem(tuple(rng.randint(1, max_value) for _ in range(rng.randint(min_terms, max_terms))))
        for _ in range(n)
    ]


def make_records(n: int, seed: int, **kw) -> list[dict]:
    """Dataset rows with stable ids (the id is a function of the seed and index, not of order)."""
    return [
        {"id": f"arith-{seed}-{i}", "prompt": p.prompt, "answer": str(p.answer), "solution": p.trace}
        for i, p in enumerate(make_problems(n, seed, **kw))
    ]


def extract_answer(response: str) -> int | None:
    """The integer after the final 'A:', or None when the response is malformed."""
    m = ANSWER_RE.search(response.strip())
    return int(m.group(1)) if m else None


def corpus(n: int = 2000, seed: int = 12345) -> list[str]:
    """Text the tiny tokenizer is trained on: prompts and worked traces."""
    return [p.prompt + p.trace for p in make_problems(n, seed)]
