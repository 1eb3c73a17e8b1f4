"""Rewards: right / wrong / malformed for each built-in, registry errors, user rewards.

The tests of this subject that start processes or engines; the rest are in tests/unit/test_rewards.py.
"""

import threading
from megatron_specrl.rewards import (
    get_reward,
)


from tests.helpers.records import rec

def test_math_verify_off_the_main_thread():
    """SIGALRM timeouts only work in the main thread; elsewhere a killable child process scores."""
    out = {}
    t = threading.Thread(target=lambda: out.update(
        ok=get_reward("math_verify")("\\boxed{42}", rec("42")),
        bad=get_reward("math_verify")("\\boxed{41}", rec("42"))))
    t.start()
    t.join(timeout=120)
    assert out == {"ok": 1.0, "bad": 0.0}


