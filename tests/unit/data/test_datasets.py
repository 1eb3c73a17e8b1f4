"""Data loading: formats, field errors, stable ids, resumable loader order, prompt rendering.

Review: data loading and reward edge cases a verl user hits (MATH gold answers, chat rows).
"""

import json
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from megatron_specrl.config import DataConfig
from megatron_specrl.data.datasets import (
    DatasetError, PromptLoader, PromptRecord, PromptTooLongError, file_format, last_boxed, load_records,
    render_all, render_prompt,
)
from megatron_specrl.rewards import get_reward



# ---- Data loading: formats, field errors, stable ids, resumable loader order, prompt rendering.

def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm has 1,200 hens and buys 300 more.", "answer": "1200+300=1500\n#### 1,500"},
]
MATH_ROWS = [  # MATH / DeepScaleR style
    {"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "solution": "We get $\\boxed{\\frac{3}{4}}$.",
     "level": "Level 1"},
    {"problem": "Compute $2^{10}$.", "answer": "1024", "solution": "It is \\boxed{1024}."},
]
DAPO_ROWS = [  # verl's DAPO-Math-17k parquet layout
    {"data_source": "math_dapo",
     "prompt": [{"role": "user", "content": "Solve: 2+2. Put your answer after 'Answer:'."}],
     "ability": "MATH", "reward_model": {"ground_truth": "4", "style": "rule-lighteval/MATH_v2"},
     "extra_info": {"index": "a1b2"}},
    {"data_source": "math_dapo",
     "prompt": [{"role": "user", "content": "Solve: 3*3."}],
     "ability": "MATH", "reward_model": {"ground_truth": "9", "style": "rule-lighteval/MATH_v2"},
     "extra_info": {"index": "c3d4"}},
]


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_gsm8k_both_file_types(tmp_path, writer):
    path = writer(tmp_path / ("d.jsonl" if writer is write_jsonl else "d.parquet"), GSM8K_ROWS)
    for fmt in ("gsm8k", "auto"):
        recs = load_records(DataConfig(source=str(path), format=fmt))
        assert [r.answer for r in recs] == ["7", "1500"]
        assert recs[0].prompt.startswith("Tom has")
        assert recs[0].meta["format"] == "gsm8k" and "#### 7" in recs[0].meta["solution"]
    assert file_format(path, DataConfig(source=str(path))) == "gsm8k"


def test_math_formats(tmp_path):
    recs = load_records(DataConfig(source=str(write_jsonl(tmp_path / "m.jsonl", MATH_ROWS)), format="math"))
    assert [r.answer for r in recs] == ["\\frac{3}{4}", "1024"]   # boxed solution, then explicit answer
    auto = load_records(DataConfig(source=str(tmp_path / "m.jsonl")))
    assert [r.answer for r in auto] == ["\\frac{3}{4}", "1024"] and auto[0].meta["format"] == "math"


def test_dapo_math_parquet_chat_prompt(tmp_path):
    path = write_parquet(tmp_path / "dapo.parquet", DAPO_ROWS)
    cfg = DataConfig(source=str(path), id_key="extra_info.index")
    recs = load_records(cfg)
    assert [(r.id, r.answer) for r in recs] == [("a1b2", "4"), ("c3d4", "9")]
    assert recs[0].prompt.startswith("Solve: 2+2")
    assert recs[0].meta["messages"] == [{"role": "user", "content": DAPO_ROWS[0]["prompt"][0]["content"]}]
    assert recs[0].meta["format"] == "math"


def test_plain_format_with_custom_keys(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"q": "1+1?", "a": 2, "uid": "x"}, {"q": "2+2?", "a": 4, "uid": "y"}])
    recs = load_records(DataConfig(source=str(path), format="plain", prompt_key="q", answer_key="a", id_key="uid"))
    assert [(r.id, r.prompt, r.answer) for r in recs] == [("x", "1+1?", "2"), ("y", "2+2?", "4")]


def test_missing_field_names_field_file_and_row(tmp_path):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}, {"prompt": "c"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError) as e:
        load_records(DataConfig(source=str(path), format="plain"))
    msg = str(e.value)
    assert "'answer'" in msg and "bad.jsonl" in msg and "line 3" in msg

    ppath = write_parquet(tmp_path / "bad.parquet", [{"question": "q", "other": "x"}])
    with pytest.raises(DatasetError) as e:
        load_records(DataConfig(source=str(ppath), format="plain", prompt_key="question", answer_key="final"))
    assert "'final'" in str(e.value) and "bad.parquet" in str(e.value) and "row 0" in str(e.value)

    with pytest.raises(DatasetError, match="question"):  # gsm8k row without the question field
        load_records(DataConfig(source=str(write_jsonl(tmp_path / "g.jsonl", [{"answer": "#### 3"}])), format="gsm8k"))
    with pytest.raises(DatasetError, match="not found"):
        load_records(DataConfig(source=str(tmp_path / "nope.jsonl")))
    with pytest.raises(DatasetError, match="jsonl or .parquet"):
        load_records(DataConfig(source=str(write_jsonl(tmp_path / "x.csv", rows))))


def test_stable_ids_across_shuffles_and_reloads(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(20)] + [{"prompt": "p3", "answer": "3"}]
    path = write_jsonl(tmp_path / "noid.jsonl", rows)
    a = load_records(DataConfig(source=str(path), format="plain"))
    shuffled_rows = list(reversed(rows[:20])) + rows[20:]
    b = load_records(DataConfig(source=str(write_jsonl(tmp_path / "noid2.jsonl", shuffled_rows)), format="plain"))
    ids_a = {r.prompt + "/" + r.answer: r.id for r in a[:20]}
    ids_b = {r.prompt + "/" + r.answer: r.id for r in b[:20]}
    assert ids_a == ids_b                                  # id is a function of the content, not the position
    assert len({r.id for r in a}) == 21                    # the duplicate got a deterministic suffix
    assert a[20].id == a[3].id + "#1"
    assert [r.id for r in load_records(DataConfig(source=str(path), format="plain"))] == [r.id for r in a]

    loader = PromptLoader(a, batch_size=7, seed=3)
    epoch0 = [r.id for _ in range(3) for r in loader.next_batch()]
    assert sorted(epoch0) == sorted(r.id for r in a)       # one epoch = the same set, permuted
    assert epoch0 != [r.id for r in a]


def test_synthetic_train_and_eval():
    cfg = DataConfig(num_synthetic=100, num_eval=20)
    train, train2 = load_records(cfg, "train", seed=5), load_records(cfg, "train", seed=5)
    ev = load_records(cfg, "eval", seed=5)
    assert len(train) == 100 and len(ev) == 20
    assert [r.id for r in train] == [r.id for r in train2]
    assert not {r.prompt for r in ev} & {r.prompt for r in train}
    assert not {r.id for r in ev} & {r.id for r in train}
    assert int(train[0].answer) == sum(int(t) for t in train[0].prompt[2:-1].split("+"))
    assert load_records(DataConfig(num_eval=0), "eval") == []


def test_synthetic_terms_set_the_trace_length():
    long = load_records(DataConfig(num_synthetic=50, num_eval=10, synthetic_terms=(8, 12)), "train", seed=5)
    assert all(8 <= len(r.prompt[2:-1].split("+")) <= 12 for r in long)
    assert all(len(r.meta["solution"].split(";")) == len(r.prompt[2:-1].split("+")) for r in long)


def test_loader_state_round_trip_gives_identical_order():
    recs = [PromptRecord(id=str(i), prompt=f"p{i}", answer="0", meta={}) for i in range(10)]
    ref = PromptLoader(recs, batch_size=4, seed=11)
    full = [[r.id for r in ref.next_batch()] for _ in range(8)]  # spans several epochs
    assert ref.epoch == 3

    run = PromptLoader(recs, batch_size=4, seed=11)
    first = [[r.id for r in run.next_batch()] for _ in range(3)]
    state = json.loads(json.dumps(run.state_dict()))          # survives a checkpoint file
    resumed = PromptLoader(recs, batch_size=4, seed=11)
    resumed.load_state_dict(state)
    rest = [[r.id for r in resumed.next_batch()] for _ in range(5)]
    assert first + rest == full

    peeker = PromptLoader(recs, batch_size=4, seed=11)
    for expected in full:                                      # peeking (also across an epoch) takes nothing
        assert [r.id for r in peeker.peek_batch()] == expected
        assert [r.id for r in peeker.next_batch()] == expected

    assert [r.id for r in PromptLoader(recs, 10, seed=0, shuffle=False).next_batch()] == [str(i) for i in range(10)]
    with pytest.raises(ValueError, match="num_records"):
        PromptLoader(recs[:5], batch_size=4, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        PromptLoader(recs, batch_size=11, seed=0)


def test_every_prompt_is_checked_against_max_prompt_len_at_start(tiny_llama):
    """A prompt longer than data.max_prompt_len would stop the run at the step that draws it: all are
    rendered when the run starts, and refused with the count and the longest, or left out with verl's
    data.filter_overlong_prompts. The ids kept are render_prompt's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    recs = [PromptRecord(id=f"r{i}", prompt="Q:" + "1+" * i + "1=", answer=str(i + 1)) for i in range(6)]
    lengths = {r.id: len(render_prompt(r, tok, False)) for r in recs}
    limit = lengths["r3"]
    with pytest.raises(PromptTooLongError, match=rf"2 of 6 train prompts are longer than data.max_prompt_len={limit} "
                                                 rf"\(the longest: record 'r5', {lengths['r5']} tokens\)"):
        render_all(recs, tok, False, limit, drop_overlong=False, split="train")
    kept, ids = render_all(recs, tok, False, limit, drop_overlong=True, split="train")
    assert [r.id for r in kept] == ["r0", "r1", "r2", "r3"]
    assert ids == {r.id: render_prompt(r, tok, False) for r in kept}


def test_render_prompt(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    rec = PromptRecord(id="a", prompt="Q:3+4+2=", answer="9", meta={})
    ids = render_prompt(rec, tok, apply_chat_template=None)  # auto, no template: raw text
    with pytest.raises(DatasetError, match="has no chat template"):   # asked for, and absent: refused
        render_prompt(rec, tok, apply_chat_template=True)
    assert ids == tok("Q:3+4+2=", add_special_tokens=False).input_ids
    assert tok.bos_token_id not in ids and tok.decode(ids) == "Q:3+4+2="

    tok.chat_template = ("{% for m in messages %}<|bos|>{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    chat = PromptRecord(id="b", prompt="hi", answer="1",
                        meta={"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    text = tok.decode(render_prompt(chat, tok, apply_chat_template=True))
    assert text == "<|bos|>system:be brief\n<|bos|>user:hi\nassistant:"
    assert tok.decode(render_prompt(chat, tok, apply_chat_template=None)) == text   # auto: as verl, templated
    assert tok.decode(render_prompt(chat, tok, apply_chat_template=False)) == "hi"


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("no box") is None and last_boxed("\\boxed{unclosed") is None


def test_a_batch_never_holds_a_record_twice():
    """10 records in batches of 4: each epoch gives two batches of distinct records and leaves out the
    last two of its shuffle (verl's drop_last), instead of running a batch on into the next epoch,
    where it could take a record it already holds."""
    recs = [PromptRecord(id=str(i), prompt=f"p{i}", answer="0", meta={}) for i in range(10)]
    loader = PromptLoader(recs, batch_size=4, seed=11)
    by_epoch: dict[int, list[str]] = {}
    for _ in range(40):
        batch = [r.id for r in loader.next_batch()]
        assert len(set(batch)) == 4
        by_epoch.setdefault(loader.epoch, []).extend(batch)
    assert all(len(ids) == 8 and len(set(ids)) == 8 for ids in by_epoch.values())   # 2 batches an epoch
    assert len({frozenset(ids) for ids in by_epoch.values()}) > 1                     # different ones left out


# ---- Review: data loading and reward edge cases a verl user hits (MATH gold answers, chat rows).

def rec(answer: str) -> PromptRecord:
    return PromptRecord(id="r", prompt="p", answer=answer, meta={})


def _write_rows(path, rows):
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
        load_records(DataConfig(source=_write_rows(tmp_path / "chat.jsonl", rows), format="math"))


def test_gsm8k_bad_answer_names_the_configured_field(tmp_path):
    path = _write_rows(tmp_path / "g.jsonl", [{"question": "q", "final": "seven"}])
    with pytest.raises(DatasetError, match="'final'"):
        load_records(DataConfig(source=path, format="gsm8k", answer_key="final"))


@pytest.mark.parametrize("answer", ["", "   ", "\\boxed{}"])
def test_an_empty_math_answer_names_the_row(tmp_path, answer):
    """An empty ground truth makes every response of that prompt score 0: refused when loading."""
    rows = [{"problem": "p1", "answer": "1"}, {"problem": "p2", "answer": answer}]
    with pytest.raises(DatasetError, match="line 2: .*empty"):
        load_records(DataConfig(source=_write_rows(tmp_path / "m.jsonl", rows), format="math"))


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
