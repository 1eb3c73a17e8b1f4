"""Review of the KL in the reward (algorithm.use_kl_in_reward / kl_penalty / kl_ctrl) and DAPO's
filter metric (algorithm.filter_metric) against verl.

FIX tests (fail on the code before this review, pass after):
  test_readme_kl_in_reward_row_names_the_schema_keys: the row's `kl_ctrl.type` / `kl_coef` / ... cell
    documented no `algorithm.kl_ctrl` and three keys the schema does not have (`algorithm.kl_coef`,
    `target_kl`, `horizon`) for the README / schema parity check (test_review_recipes_verl failed on it);
  test_readme_says_the_filter_counts_correct_answers_only_with_acc: the incorrect_score row still said the
    filter counts s > 0 as correct whatever the metric, and the filter row tied the rounds and the kept
    group of one to `acc` only.
PIN tests (no bug found; pass before and after):
  test_pin_kl_after_the_filter_over_rounds_uses_recomputed_logprobs_and_kept_responses.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_specrl.algorithms.kl_reward import RewardKLController
from megatron_specrl.config import AlgorithmConfig, KLControlConfig, load_config
from megatron_specrl.rollout.speculative import RolloutSample
from megatron_specrl.trainer import train_step
from test_kl_in_reward import POLICY_LP, REF_LP, Learner, stand_in_run
from test_review_recipes_verl import _config_tables, _documented_keys

ROOT = Path(__file__).resolve().parent.parent


def _row(readme: str, start: str) -> str:
    return next(line for line in readme.splitlines() if line.startswith(start))


# --------------------------------------------------------------------------- FIX: README rows

def test_readme_kl_in_reward_row_names_the_schema_keys():
    """The row's first cell, as the README / schema parity check reads it, names exactly the three
    AlgorithmConfig keys (kl_ctrl's sub-keys as `.type` etc., not as `algorithm.` keys of their own)."""
    readme = (ROOT / "README.md").read_text()
    row = _row(readme, "| `algorithm.use_kl_in_reward`")
    documented = _documented_keys(row)
    assert documented == {"algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl"}
    assert documented <= {f"algorithm.{k}" for k in AlgorithmConfig.model_fields}
    for sub in KLControlConfig.model_fields:                 # type, kl_coef, horizon, target_kl
        assert f"`.{sub}`" in row.split(" | ")[0], sub
    assert "algorithm.kl_coef" not in _documented_keys(_config_tables(readme))


def test_readme_says_the_filter_counts_correct_answers_only_with_acc():
    readme = (ROOT / "README.md").read_text()
    inc = _row(readme, "| `algorithm.incorrect_score`")
    assert "dynamic-sampling filter count s > 0 as correct either way" not in inc
    assert "filter_metric: acc" in inc
    filt = _row(readme, "| `algorithm.dynamic_sampling`")
    assert "With `acc`: (correct:" not in filt                       # rounds / group of one: every metric
    assert "Under any metric a group of one" in filt


# --------------------------------------------------------------------------- PIN: the step over rounds

ROLLOUT_LP = -0.3


def test_pin_kl_after_the_filter_over_rounds_uses_recomputed_logprobs_and_kept_responses():
    """DAPO over two rounds (round 0's group all correct: dropped; round 1's mixed: kept) with top-p
    (recompute_old_logprobs forced on): the KL is the learner's tempered log-probs against the
    reference's (0.5 a token, not the rollout's processed 0.4), on the kept samples only, and the
    adaptive beta moves once, by verl's update with n = the kept responses (2, not the 4 generated)."""
    cfg = load_config(None, ["algorithm.name=dapo", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_tries=2",
                             "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                             "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_ctrl.horizon=100",
                             "algorithm.kl_ctrl.target_kl=0.1", "rollout.top_p=0.9", "rollout.n_samples=2",
                             "trainer.prompts_per_step=1", "rollout.max_new_tokens=8"])
    assert cfg.learner.recompute_old_logprobs
    rounds = {"p0": [[9, 1], [8, 1]], "p1": [[9, 1], [9, 9, 1]]}     # reward: 1 for a 2-token response
    order = iter(["p0", "p1"])

    def rollout(prompts, n, version, step, next_prompts):
        (pid, ids), = prompts
        return [RolloutSample(pid, k, ids, r, [ROLLOUT_LP] * len(r), "stop", 0, 0)
                for k, r in enumerate(rounds[pid])], {}

    ctrl = RewardKLController("adaptive", 0.1, 0.1, 100)
    learner = Learner()     # scores every token POLICY_LP
    run = stand_in_run(
        cfg=cfg, learner=learner, reward_kl=ctrl,
        ref=SimpleNamespace(compute_logprobs=lambda b: torch.full(b["input_ids"].shape, REF_LP) * b["attention_mask"]),
        next_prompts=lambda: [(next(order), [5, 6])],
        rollout=SimpleNamespace(run=rollout), train_records={p: SimpleNamespace(id=p) for p in rounds},
        reward_fn=lambda text, record: float(text == "2"),
        tokenizer=SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: [str(len(i)) for i in ids]))
    metrics = train_step(run, 1)
    batch = learner.batches[0]
    assert metrics["dapo/rounds"] == 2 and batch["input_ids"].shape[0] == 2 and learner.scored == 1
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(POLICY_LP - REF_LP)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 2 / 100))
    # the kept group: scores 1 / 0 less 0.1 x 0.5 per token (2 and 3 tokens), then GRPO's normalisation
    r = torch.tensor([1 - 0.1 * 0.5 * 2, 0 - 0.1 * 0.5 * 3])
    want = (r - r.mean()) / (r.std() + 1e-6)
    assert torch.allclose(batch["advantages"][:, 2], want, atol=1e-5)
