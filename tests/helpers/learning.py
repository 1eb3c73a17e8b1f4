"""What a learning test asserts, so that it holds on every CPU kind.

Floating-point results differ between AVX2, AVX-512 and AMX, so two machines follow different
trajectories from the same seed. A learning assertion therefore rests on a statistic that many steps
average, in a setting where learning is far above the run-to-run spread: the train reward's mean over
the last quarter of the steps against the first quarter's, on a prompt set small enough that every
prompt returns every other step (RL then raises its reward quickly and steadily). A single held-out
evaluation at the start and the end is not such a statistic (a greedy answer flips on a small weight
change; docs/development.md has the figures): held-out accuracy is a benchmark figure, over seeds.
"""

from __future__ import annotations


def reward_quarters(rows: list[dict], key: str = "reward/mean") -> tuple[float, float]:
    """Mean train reward over the first and the last quarter of the logged train steps."""
    rewards = [r[key] for r in rows if key in r]
    k = max(1, len(rewards) // 4)
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def assert_reward_rose(rows: list[dict], margin: float) -> None:
    first, last = reward_quarters(rows)
    assert last - first >= margin, (f"train reward, first quarter {first:.3f} -> last quarter {last:.3f}: "
                                    f"rose by less than {margin}")
