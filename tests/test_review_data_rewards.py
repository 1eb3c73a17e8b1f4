"""Review: data loading and reward edge cases a verl user hits (MATH gold answers, chat rows)."""

import json

import pytest

from megatron_specrl.config import DataConfig
from megatron_specrl.data.datasets import DatasetError, PromptRecord, load_records
from megatron_specrl.rewards import get_reward


def rec(answer: str) -> PromptRecord:
    return PromptRecord(id="r", prompt="p", answer=answer, meta={})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_math_verify_gold_with_an_escaped_dollar():
    """MATH's money answers are '\\$18.90' (from '\\boxed{\\$18.90}'): an escaped '$' is not a math
    delimiter, so the gold must still be boxed, or math-verify parses nothing and every response scores 0."""
    r = get_reward("math_verify")
    assert r("The total is \\boxed{\\$18.90}.", rec("\\$18.90")) == 1.0
    assert r("The total is \\boxed{18.90}.", rec("\\$18.90")) == 1.0
    assert r("The total is \\boxed{18.80}.", rec("\\$18.90")) == 0.0
    assert r("so $\\boxed{2}$", rec("$2$")) == 1.0                 # a delimited gold is still read as is


def test_math_verify_scores_the_last_boxed_answer():
    """A response that corrects itself ('\\boxed{3} ... wait, \\boxed{4}') is scored on its final boxed
    answer; math-verify alone reads all the boxed answers as the set {3, 4}, which equals neither."""
    r = get_reward("math_verify")
    text = "I think \\boxed{3}.\n\nWait, 2+2 is \\boxed{4}."
    assert r(text, rec("4")) == 1.0
    assert r(text, rec("3")) == 0.0
    assert r("\\boxed{3}, \\boxed{4}", rec("3")) == 0.0          # hedging two answers is not rewarded
    assert r("so $\\boxed{\\frac{1}{2}}$ is it", rec("0.5")) == 1.0
    assert r("Answer: 34", rec("34")) == 1.0                       # no \\boxed: the whole response, as before


@pytest.mark.parametrize("content", [None, [{"type": "text", "text": "hi"}], 3])
def test_a_chat_message_without_text_content_names_the_row(tmp_path, content):
    rows = [{"prompt": [{"role": "user", "content": "fine"}], "answer": "1"},
            {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": content}], "answer": "2"}]
    with pytest.raises(DatasetError, match=r"line 2: .*content"):
        load_records(DataConfig(source=write_jsonl(tmp_path / "chat.jsonl", rows), format="math"))


def test_gsm8k_bad_answer_names_the_configured_field(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "final": "seven"}])
    with pytest.raises(DatasetError, match="'final'"):
        load_records(DataConfig(source=path, format="gsm8k", answer_key="final"))


@pytest.mark.parametrize("answer", ["", "   ", "\\boxed{}"])
def test_an_empty_math_answer_names_the_row(tmp_path, answer):
    """An empty ground truth makes every response of that prompt score 0: refused when loading."""
    rows = [{"problem": "p1", "answer": "1"}, {"problem": "p2", "answer": answer}]
    with pytest.raises(DatasetError, match="line 2: .*empty"):
        load_records(DataConfig(source=write_jsonl(tmp_path / "m.jsonl", rows), format="math"))


def test_synthetic_eval_found_by_the_last_draw_is_not_refused():
    """Two-term sums have 81 prompts; 220 train problems leave few, and only the last, largest eval draw
    finds 2 outside the train set: that draw succeeded, so it must not raise the 'cannot draw' error."""
    cfg = DataConfig(num_synthetic=220, num_eval=2, synthetic_terms=(2, 2))
    evals = load_records(cfg, split="eval", seed=0)
    train = {r.prompt for r in load_records(cfg, split="train", seed=0)}
    assert len(evals) == 2 and not train & {r.prompt for r in evals}


def test_verl_gsm8k_parquet_loads_as_gsm8k(tmp_path):
    """verl's own GSM8K parquet (examples/data_preprocess/gsm8k.py): chat prompt, the final number in
    reward_model.ground_truth, the worked solution under extra_info. data.format=gsm8k reads it as is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": "Q? Let's think step by step and output the final answer "
                                                   "after \"####\"."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
             "extra_info": {"split": "train", "index": 0, "answer": "36*2=72\n#### 72", "question": "Q?"}}]
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    recs = load_records(DataConfig(source=str(path), format="gsm8k", id_key="extra_info.index"))
    assert [(r.id, r.answer) for r in recs] == [("0", "72")]
    assert recs[0].meta["messages"][0]["content"].startswith("Q?")
    assert get_reward("gsm8k")("36*2 = 72\n#### 72", recs[0]) == 1.0
