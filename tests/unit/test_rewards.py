"""Rewards: right / wrong / malformed for each built-in, registry errors, user rewards.
"""

import json
import pytest
from megatron_specrl.config import DataConfig
from megatron_specrl.data.datasets import PromptRecord
from megatron_specrl.rewards import (
    UnknownRewardError, default_reward_for, get_reward, list_rewards, register_reward,
)
from tests.helpers.records import rec  # noqa: F401



def test_arithmetic():
    r = get_reward("arithmetic")
    assert r("3+4=7;7+2=9;A:9", rec("9")) == 1.0
    assert r("3+4=7;7+2=10;A:10", rec("9")) == 0.0
    assert r("3+4=7;7+2=9;A:", rec("9")) == 0.0            # malformed: no final answer
    assert r("A:9 trailing junk", rec("9")) == 0.0          # answer must end the response
    assert r("", rec("9")) == 0.0


def test_gsm8k():
    r, strict = get_reward("gsm8k"), get_reward("gsm8k_strict")
    assert r("3+4=7 so\n#### 7", rec("7")) == 1.0
    assert r("It costs $1,500.", rec("1500")) == 1.0          # last number, separators and $ ignored
    assert r("#### 7.0", rec("7")) == 1.0
    assert r("#### 8 but maybe 7", rec("7")) == 0.0           # '####' wins over the last number
    assert r("first 7 then 8", rec("7")) == 0.0
    assert r("no number at all", rec("7")) == 0.0
    assert strict("the answer is 7", rec("7")) == 0.0 and strict("#### 7", rec("7")) == 1.0


def test_math_verify():
    r = get_reward("math_verify")
    assert r("so the answer is $\\boxed{\\frac{1}{2}}$", rec("\\frac{1}{2}")) == 1.0
    assert r("The result is \\boxed{0.5}", rec("\\frac{1}{2}")) == 1.0   # equivalent forms
    assert r("Answer: 34", rec("34")) == 1.0                              # DAPO-Math answer line
    assert r("\\boxed{3}", rec("\\frac{1}{2}")) == 0.0
    assert r("I have no idea", rec("34")) == 0.0
    assert r("\\boxed{\\frac{1}{", rec("34")) == 0.0                      # malformed latex
    assert r("__import__('os').system('echo pwned')", rec("0")) == 0.0    # never evaluated




def test_registry_errors_and_user_reward():
    with pytest.raises(UnknownRewardError) as e:
        get_reward("nope")
    assert "nope" in str(e.value) and "arithmetic" in str(e.value) and "math_verify" in str(e.value)

    @register_reward("test_length_bonus")
    def length_bonus(response: str, record: PromptRecord) -> float:
        return min(1.0, len(response) / 10)

    assert get_reward("test_length_bonus") is length_bonus and "test_length_bonus" in list_rewards()
    assert get_reward("test_length_bonus")("12345", rec("0")) == 0.5
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_length_bonus")(lambda text, record: 0.0)
    register_reward("test_length_bonus", overwrite=True)(lambda text, record: 0.25)
    assert get_reward("test_length_bonus")("x", rec("0")) == 0.25


def test_default_reward_for(tmp_path):
    assert default_reward_for(DataConfig()) == "arithmetic"
    g = tmp_path / "g.jsonl"
    g.write_text(json.dumps({"question": "q", "answer": "x\n#### 3"}) + "\n")
    assert default_reward_for(DataConfig(source=str(g))) == "gsm8k"
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"problem": "q", "answer": "3"}) + "\n")
    assert default_reward_for(DataConfig(source=str(m))) == "math_verify"
    assert default_reward_for(DataConfig(source=str(g), format="math")) == "math_verify"


def test_gsm8k_final_answer_is_the_number(tmp_path):
    from megatron_specrl.data.datasets import DatasetError, gsm8k_final_answer, load_records
    cases = {"#### 42 apples": "42", "x\n#### 1,234": "1234", "#### $5": "5", "#### -3": "-3", "#### 7.": "7",
             "#### 3.50 dollars": "3.50", "#### - $1,000.25 total": "-1000.25", "#### 72\n": "72",
             "#### apples": None, "no hashes": None}
    assert {k: gsm8k_final_answer(k) for k in cases} == cases
    # the gold answer now scores: it used to be '42 apples', which no response could match
    rows = tmp_path / "g.jsonl"
    rows.write_text(json.dumps({"question": "q", "answer": "6 * 7 = 42\n#### 42 apples"}) + "\n")
    [record] = load_records(DataConfig(source=str(rows), format="gsm8k", num_eval=0))
    assert record.answer == "42"
    assert get_reward("gsm8k")("so 6*7=42\n#### 42", record) == 1.0
    assert get_reward("gsm8k_strict")("#### 42 apples", record) == 1.0
    # a '####' with no number after it fails the row, naming it, instead of scoring 0 forever
    rows.write_text(json.dumps({"question": "q", "answer": "lots\n#### many"}) + "\n")
    with pytest.raises(DatasetError, match="no number after its last '####'"):
        load_records(DataConfig(source=str(rows), format="gsm8k", num_eval=0))


def test_reward_by_dotted_path():
    assert get_reward("megatron_specrl.rewards.gsm8k_reward") is get_reward("gsm8k")
    for bad, needle in [("megatron_specrl.rewards.nothing_here", "has no attribute 'nothing_here'"),
                        ("no_such_module_xyz.fn", "cannot import module 'no_such_module_xyz'"),
                        ("megatron_specrl.rewards.MATH_VERIFY_TIMEOUT_S", "is a int, not a function")]:
        with pytest.raises(UnknownRewardError) as e:
            get_reward(bad)
        assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None, "0.5x"])
def test_a_reward_that_is_not_a_finite_number_is_named_before_training(bad):
    """One NaN reward makes its group's advantages, the loss and every gradient NaN: score_samples names
    the reward function, the record and the response instead of handing it on."""
    from types import SimpleNamespace

    from megatron_specrl.algorithms.rewards_step import score_samples
    from megatron_specrl.config import AlgorithmConfig
    from megatron_specrl.rewards import RewardError
    from megatron_specrl.rollout.speculative import RolloutSample

    def flaky_reward(text, record):
        return bad if record.id == "b" else 1.0

    records = {p: PromptRecord(id=p, prompt="1+1=", answer="2") for p in "ab"}
    samples = [RolloutSample(p, 0, [5], [9, 1], [-0.1, -0.1], "stop", 0, 0) for p in "ab"]
    tok = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: ["A:2" for _ in ids])
    with pytest.raises(RewardError, match=r"reward .*flaky_reward returned .* for record 'b' \(response 'A:2'\)"):
        score_samples(samples, records, flaky_reward, tok, AlgorithmConfig(), 16)
    rewards, _, _ = score_samples(samples[:1], records, flaky_reward, tok, AlgorithmConfig(), 16)
    assert rewards.tolist() == [1.0]
