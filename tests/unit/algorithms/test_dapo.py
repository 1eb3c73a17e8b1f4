"""The RL math against verl and DAPO's -1 / 1 task-reward scale.

FIX tests (fail on the code before this review, pass after):
  algorithm.incorrect_score (DAPO's -1 / 1): test_incorrect_score_puts_the_task_reward_on_dapos_scale,
  test_graded_scores_keep_their_order_and_accuracy, test_the_dapo_filter_counts_correct_answers_on_dapos_scale,
  test_incorrect_score_must_be_below_one, test_dapo_recipes_train_on_dapos_reward_scale,
  test_readme_states_the_reward_scale_the_penalty_is_added_to;
  the filter's group of one (verl keeps it): test_the_dapo_filter_keeps_a_group_of_one_as_verl_does.
PIN tests (no bug found: ours against an independent computation of verl's definitions; pass before and after):
  test_pin_*.

DAPO's group filter by verl's `filter_groups.metric` (algorithm.filter_metric): acc keeps groups
with 0 < correct < G; score keeps groups whose task rewards differ (graded rewards whose samples all
count correct); seq_reward keeps groups whose shaped rewards differ (equal answers, different length
penalties). The filter values come out of score_samples; filter_rounds keeps by them.

DAPO's generation batch (`trainer.gen_prompts_per_step`, verl's `data.gen_batch_size`): a round rolls out
more prompts than a step trains on, so the group filter usually fills a step in one round.

DAPO dynamic sampling over rollout rounds (the step's DAPO filter): fills the batch, or fails clearly
(no hang).
"""

from __future__ import annotations
import math
from types import SimpleNamespace
import pytest
import torch
from pydantic import ValidationError
from megatron_specrl.algorithms.advantages import gae, grpo_advantages, terminal_rewards, whiten
from megatron_specrl.algorithms.dapo import overlong_penalty
from megatron_specrl.algorithms.rewards_step import score_samples
from megatron_specrl.config import AlgorithmConfig, load_config
from megatron_specrl.data.datasets import PromptRecord
from megatron_specrl.learner.losses import aggregate, kl_penalty, policy_loss
from megatron_specrl.rollout.dynamic import filter_rounds
from megatron_specrl.rollout.speculative import RolloutSample
from megatron_specrl.config import ConfigError
from megatron_specrl.data.datasets import PromptLoader
from megatron_specrl.plan import ModelShape, engine_memory
from megatron_specrl.algorithms.dapo import DynamicSamplingError
from tests.helpers.paths import REPO_ROOT



# ---- The RL math against verl and DAPO's -1 / 1 task-reward scale.

ROOT = REPO_ROOT

# --------------------------------------------------------------------------- helpers


def _batch(spec: list[tuple[str, float, int]]):
    """[(prompt id, reward-function score, response length)] -> (samples, records, reward_fn, tokenizer).
    The 'response text' is the sample's index, so the reward function looks its score up."""
    samples = [RolloutSample(pid, i, [5], [7] * n, [-0.1] * n, "stop", 0, 0) for i, (pid, _, n) in enumerate(spec)]
    records = {pid: PromptRecord(id=pid, prompt="q", answer="a") for pid, _, _ in spec}
    scores = {str(i): s for i, (_, s, _) in enumerate(spec)}
    texts = iter(range(len(spec)))
    tok = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: [str(next(texts)) for _ in ids])
    return samples, records, (lambda text, record: scores[text]), tok


# --------------------------------------------------------------------------- FIX: DAPO's reward scale

def test_incorrect_score_puts_the_task_reward_on_dapos_scale():
    """DAPO's task reward is -1 / 1 (verl recipe/dapo: math_dapo.compute_score -> 1.0 / -1.0); the overlong
    penalty (0 .. -penalty) is added to it. With algorithm.incorrect_score=-1 a 0 / 1 reward function gives
    DAPO's shaped rewards; accuracy stays in [0, 1] and is what the filter receives."""
    L, buf = 16, 4
    spec = [("p", 1.0, 5), ("p", 0.0, 5), ("p", 1.0, 16), ("p", 0.0, 14)]
    samples, records, fn, tok = _batch(spec)
    alg = AlgorithmConfig(incorrect_score=-1.0, overlong_buffer=buf, overlong_penalty=1.0)
    rewards, acc, m = score_samples(samples, records, fn, tok, alg, L)
    # independently: DAPO's reward = (1 if correct else -1) + min(-(len - (L - buf)) / buf * factor, 0)
    want = [(1.0 if s > 0 else -1.0) + min(-(n - (L - buf)) / buf * 1.0, 0.0) for _, s, n in spec]
    assert rewards.tolist() == pytest.approx(want)          # [1, -1, 0, -1.5]
    assert acc.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert m["reward/accuracy"] == 0.5 and m["reward/task_mean"] == 0.0
    assert m["reward/mean"] == pytest.approx(sum(want) / 4)


def test_graded_scores_keep_their_order_and_accuracy():
    """A user reward with partial credit: the map is affine (order kept), and accuracy counts score > 0,
    as eval/accuracy does, not the mapped value's sign."""
    samples, records, fn, tok = _batch([("p", 0.0, 3), ("p", 0.25, 3), ("p", 1.0, 3)])
    rewards, acc, m = score_samples(samples, records, fn, tok, AlgorithmConfig(incorrect_score=-1.0), 8)
    assert rewards.tolist() == [-1.0, -0.5, 1.0]
    assert acc.tolist() == [0.0, 1.0, 1.0] and m["reward/accuracy"] == pytest.approx(2 / 3)


def test_the_dapo_filter_counts_correct_answers_on_dapos_scale():
    """On -1 / 1 with the overlong penalty a correct but overlong answer's reward is <= 0: the filter must
    still count it correct (a group of such and correct answers is all-correct: dropped), and a group
    whose wrong answers are -1 must still count as all-wrong."""
    L, buf = 8, 4
    spec = [("solved", 1.0, 8), ("solved", 1.0, 3),        # correct; the first shaped to 1 - 1 = 0
            ("failed", 0.0, 3), ("failed", 0.0, 3),        # all wrong: -1 each
            ("mixed", 1.0, 8), ("mixed", 0.0, 3)]          # informative
    alg = AlgorithmConfig(incorrect_score=-1.0, overlong_buffer=buf, overlong_penalty=1.0)

    def round_(idx):
        samples, records, fn, tok = _batch(spec)
        rewards, acc, metrics = score_samples(samples, records, fn, tok, alg, L)
        return samples, rewards, acc, metrics

    samples, rewards, metrics = filter_rounds(round_, target_groups=1, max_tries=1)
    assert [s.prompt_id for s in samples] == ["mixed", "mixed"]
    assert rewards.tolist() == [0.0, -1.0]                 # shaped rewards go on to the advantages
    assert 0.0 <= metrics["reward/accuracy"] <= 1.0 and metrics["reward/accuracy"] == 0.5


def test_incorrect_score_must_be_below_one():
    """At 1 every score maps to 1 (no signal); above 1 the order of scores would flip."""
    for bad in (1.0, 2.0):
        with pytest.raises(ValidationError, match="incorrect_score"):
            AlgorithmConfig(incorrect_score=bad)
    assert AlgorithmConfig().incorrect_score == 0.0


@pytest.mark.parametrize("recipe", ["tiny-cpu-dapo", "qwen2.5-7b-dapo-1node", "qwen2.5-32b-dapo-4node",
                                    "llama-3.1-70b-dapo-8node"])
def test_dapo_recipes_train_on_dapos_reward_scale(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "examples" / f"{recipe}.yaml")
    assert cfg.algorithm.incorrect_score == -1.0 and cfg.algorithm.overlong_buffer > 0
    for other in ("tiny-cpu-grpo", "tiny-cpu-ppo"):
        assert load_config(ROOT / "examples" / f"{other}.yaml").algorithm.incorrect_score == 0.0


def test_algorithms_page_states_the_reward_scale_the_penalty_is_added_to():
    readme = (ROOT / "docs" / "algorithms.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `algorithm.overlong_buffer`"))
    assert "which is 0 / 1 here" not in row and "incorrect_score" in row
    assert any(line.startswith("| `algorithm.incorrect_score` |") for line in readme.splitlines())


# --------------------------------------------------------------------------- PIN: verl's definitions

def _verl_grpo(scores, index, eps=1e-6, norm=True):
    """verl's compute_grpo_outcome_advantage, written out: per-group mean and unbiased std (a group of
    one: mean 0, std 1)."""
    groups: dict = {}
    for s, i in zip(scores, index):
        groups.setdefault(i, []).append(s)
    out = []
    for s, i in zip(scores, index):
        g = groups[i]
        if len(g) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(g) / len(g)
            std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1))
        out.append((s - mean) / (std + eps) if norm else s - mean)
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_pin_grpo_matches_verls_group_statistics(norm):
    """Group mean, unbiased std, eps 1e-6, norm_adv_by_std_in_grpo; all-equal groups give 0 (verl: 0 / eps);
    on DAPO's -1 / 1 scale std-normalised advantages are those of 0 / 1 (up to eps)."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 2, (40,), generator=g).float().tolist()
    scores[:5] = [1.0] * 5                               # an all-correct group (ids a0 below)
    index = [f"a{i // 5}" for i in range(40)]
    ours = grpo_advantages(torch.tensor(scores), index, normalize_std=norm)
    assert ours.tolist() == pytest.approx(_verl_grpo(scores, index, norm=norm), abs=1e-5)
    assert ours[:5].tolist() == [0.0] * 5
    dapo = grpo_advantages(torch.tensor([2 * s - 1 for s in scores]), index, normalize_std=norm)
    assert dapo.tolist() == pytest.approx((ours * (1.0 if norm else 2.0)).tolist(), abs=1e-4)


def test_pin_gae_and_whitening_match_verls_recursion():
    """verl's compute_gae_advantage_return (terminal reward on the last response token, padding after it
    skipped, value after the end 0) then masked_whiten (unbiased var, eps 1e-8)."""
    g = torch.Generator().manual_seed(1)
    B, T, gamma, lam = 3, 6, 0.9, 0.8
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.float32)
    values = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    scores = torch.tensor([1.0, -1.0, 0.5])
    r = terminal_rewards(scores, mask).double()
    adv, ret = gae(r, values, mask.double(), gamma, lam)
    for b in range(B):
        n = int(mask[b].sum())
        a_next, v_next = 0.0, 0.0
        for t in reversed(range(n)):
            rew = float(scores[b]) if t == n - 1 else 0.0
            a_next = rew + gamma * v_next - float(values[b, t]) + gamma * lam * a_next
            v_next = float(values[b, t])
            assert float(adv[b, t]) == pytest.approx(a_next, abs=1e-9)
            assert float(ret[b, t]) == pytest.approx(a_next + float(values[b, t]), abs=1e-9)
    sel = adv[mask.bool()]
    want = (sel - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + 1e-8)
    assert whiten(adv, mask.double())[mask.bool()].tolist() == pytest.approx(want.tolist(), abs=1e-9)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_pin_policy_loss_clip_higher_dual_clip_and_tis(mode):
    """Per token: max(-A r, -A clip(r, 1 - 0.2, 1 + 0.28)), for A < 0 min(that, -A c) with c = 10 (DAPO's
    recipe), times min(exp(old - rollout), 2) (token TIS), aggregated as verl's agg_loss names; an empty
    response does not count in the seq-mean denominators."""
    g = torch.Generator().manual_seed(2)
    B, T = 4, 5
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float64)
    lp = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5 - 1
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8
    roll = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * 2
    loss, _ = policy_loss(lp, old, adv, mask, 0.2, 0.28, 10.0, mode, roll, "token", 2.0, None, 5.0)
    per_seq, ntok = [], 0.0
    for b in range(B):
        s = 0.0
        for t in range(T):
            if not mask[b, t]:
                continue
            a, ratio = float(adv[b, t]), math.exp(float(lp[b, t] - old[b, t]))
            x = max(-a * ratio, -a * min(max(ratio, 0.8), 1.28))
            if a < 0:
                x = min(x, -a * 10.0)
            s += x * min(math.exp(float(old[b, t] - roll[b, t])), 2.0)
        n = float(mask[b].sum())
        ntok += n
        if n:
            per_seq.append((s, n))
    if mode == "token-mean":
        want = sum(s for s, _ in per_seq) / ntok
    elif mode == "seq-mean-token-sum":
        want = sum(s for s, _ in per_seq) / len(per_seq)
    elif mode == "seq-mean-token-mean":
        want = sum(s / n for s, n in per_seq) / len(per_seq)
    else:
        want = sum(s / 5.0 for s, _ in per_seq) / len(per_seq)
    assert float(loss) == pytest.approx(want, rel=1e-9)


def test_pin_kl_estimators_and_entropy_sign():
    """k1 = d, k2 = d^2 / 2, k3 = e^-d - 1 + d clamped to [-10, 10] (d = logp - ref), in float64."""
    d = torch.tensor([-30.0, -2.0, -0.1, 0.0, 0.3, 5.0], dtype=torch.float64)
    ref = torch.zeros_like(d)
    assert kl_penalty(d, ref, "k1").tolist() == d.tolist()
    assert kl_penalty(d, ref, "k2").tolist() == pytest.approx((0.5 * d * d).tolist())
    k3 = [min(max(math.exp(-max(min(x, 20), -20)) - 1 + max(min(x, 20), -20), -10), 10) for x in d.tolist()]
    assert kl_penalty(d, ref, "low_var_kl").tolist() == pytest.approx(k3)
    ent = torch.tensor([[1.0, 2.0, 9.0]])
    assert float(aggregate(ent, torch.tensor([[1.0, 1.0, 0.0]]))) == 1.5   # padding's entropy does not count


def test_pin_overlong_penalty_matches_dapos_formula_at_every_length():
    """verl's DAPO reward manager: min(-(len - (L - buffer)) / buffer * factor, 0), len in [0, L]."""
    L, buf, f = 20, 6, 0.5
    lengths = list(range(0, L + 1))
    want = [min(-(n - (L - buf)) / buf * f, 0.0) for n in lengths]
    assert overlong_penalty(lengths, L, buf, f).tolist() == pytest.approx(want)


# --------------------------------------------------------------------------- FIX: a group of one in the filter

def test_the_dapo_filter_keeps_a_group_of_one_as_verl_does():
    """rollout.n_samples=1 with algorithm.dynamic_sampling (PPO: the config allows it) makes every group a
    single sample, whose accuracy is 0 or 1: all were dropped and the run stopped after max_sampling_tries
    rounds calling the task too easy or too hard. verl's filter keeps `std > 0 or len == 1`."""
    from megatron_specrl.algorithms.dapo import dapo_keep_mask
    assert dapo_keep_mask(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]), ["a", "b", "c", "c", "d", "d"]).tolist() == \
        [True, True, False, False, True, True]
    spec = [("a", 1.0, 3), ("b", 0.0, 3)]

    def round_(idx):
        samples, records, fn, tok = _batch(spec)
        rewards, acc, metrics = score_samples(samples, records, fn, tok, AlgorithmConfig(), 8)
        return samples, rewards, acc, metrics

    samples, rewards, _ = filter_rounds(round_, target_groups=2, max_tries=1)
    assert [s.prompt_id for s in samples] == ["a", "b"] and rewards.tolist() == [1.0, 0.0]


# ---- DAPO's group filter by verl's `filter_groups.metric` (algorithm.filter_metric): acc keeps groups

L, BUF = 8, 4
SPEC = [("graded", 0.3, 3), ("graded", 0.7, 3),       # both correct (> 0), different scores
        ("long", 1.0, 3), ("long", 1.0, 8),           # both correct, one inside the overlong buffer
        ("same", 1.0, 3), ("same", 1.0, 3),           # nothing differs
        ("mixed", 1.0, 3), ("mixed", 0.0, 3)]         # right and wrong


def _kept(metric: str, n: int) -> list[str]:
    """The first n groups the filter keeps from one round (in arrival order, so a group kept that
    should not be shows up in place of a later one)."""
    alg = AlgorithmConfig(filter_metric=metric, overlong_buffer=BUF, overlong_penalty=1.0, dynamic_sampling=True)

    def round_(idx):
        samples, records, fn, tok = _batch(SPEC)
        rewards, values, metrics = score_samples(samples, records, fn, tok, alg, L)
        return samples, rewards, values, metrics

    samples, _, _ = filter_rounds(round_, target_groups=n, max_tries=1)
    return list(dict.fromkeys(s.prompt_id for s in samples))


@pytest.mark.parametrize("metric, kept", [("acc", ["mixed"]), ("score", ["graded", "mixed"]),
                                          ("seq_reward", ["graded", "long", "mixed"]),
                                          ("seq_final_reward", ["graded", "long", "mixed"])])
def test_groups_are_kept_by_the_chosen_metric(metric, kept):
    assert _kept(metric, len(kept)) == kept


def test_filter_values_are_the_metrics_own():
    samples, records, fn, tok = _batch(SPEC)
    for metric, want in [("acc", [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]),
                         ("score", [0.3, 0.7, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])]:
        samples, records, fn, tok = _batch(SPEC)
        _, values, _ = score_samples(samples, records, fn, tok, AlgorithmConfig(filter_metric=metric), L)
        assert values.tolist() == pytest.approx(want)
    samples, records, fn, tok = _batch(SPEC)
    rewards, values, _ = score_samples(samples, records, fn, tok,
                                       AlgorithmConfig(filter_metric="seq_reward", overlong_buffer=BUF), L)
    assert values is rewards and rewards[3] == pytest.approx(0.0)     # 1 - 1 at max_new_tokens


def test_seq_final_reward_with_kl_in_reward_is_refused_and_unknown_metrics_too():
    with pytest.raises(ValidationError, match="seq_final_reward with use_kl_in_reward"):
        AlgorithmConfig(filter_metric="seq_final_reward", use_kl_in_reward=True)
    with pytest.raises(ValidationError, match="filter_metric"):
        AlgorithmConfig(filter_metric="std")
    AlgorithmConfig(filter_metric="seq_reward", use_kl_in_reward=True)     # before the KL: fine


# ---- DAPO's generation batch (`trainer.gen_prompts_per_step`, verl's `data.gen_batch_size`): a round rolls out

DAPO = ["algorithm.name=dapo", "algorithm.dynamic_sampling=true", "trainer.prompts_per_step=8"]


def test_unset_means_a_round_is_a_step():
    cfg = load_config(None, DAPO)
    assert cfg.trainer.gen_prompts_per_step == 8
    assert cfg.trainer.round_prompts_key() == "trainer.prompts_per_step=8"
    cfg = load_config(None, [*DAPO, "trainer.gen_prompts_per_step=24"])
    assert cfg.trainer.gen_prompts_per_step == 24
    assert cfg.trainer.round_prompts_key() == "trainer.gen_prompts_per_step=24"


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.prompts_per_step=8", "trainer.gen_prompts_per_step=24"], "without algorithm.dynamic_sampling"),
    ([*DAPO, "trainer.gen_prompts_per_step=4"], "below trainer.prompts_per_step=8"),
])
def test_refused_where_no_filter_chooses_or_a_round_is_smaller_than_a_step(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_loader_draws_whole_rounds():
    """The run's loader is cut into rounds: each draw is a round's prompts, no prompt twice in an epoch."""
    records = [PromptRecord(id=f"p{i}", prompt=f"{i}+1=", answer=str(i + 1)) for i in range(50)]
    loader = PromptLoader(records, batch_size=load_config(None, [*DAPO, "trainer.gen_prompts_per_step=24"])
                          .trainer.gen_prompts_per_step, seed=1)
    first, second = loader.next_batch(), loader.next_batch()
    assert len(first) == len(second) == 24 and not {r.id for r in first} & {r.id for r in second}
    assert loader.epoch == 0 and len(loader.next_batch()) == 24 and loader.epoch == 1   # 2 left over: dropped


def test_the_plan_counts_a_rounds_sequences_in_the_engines_kv():
    shape = ModelShape("llama", hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1000,
                       tied=False, qkv_bias=False, max_positions=4096)
    one = engine_memory(load_config(None, [*DAPO, "rollout.n_samples=4"]), shape, 80 << 30)
    three = engine_memory(load_config(None, [*DAPO, "rollout.n_samples=4", "trainer.gen_prompts_per_step=24"]),
                          shape, 80 << 30)
    assert (one.sequences_per_engine, three.sequences_per_engine) == (32, 96)
    assert three.kv_batch == 3 * one.kv_batch


# ---- DAPO dynamic sampling over rollout rounds (the step's DAPO filter): fills the batch, or fails clearly

def _samples(group_rewards: dict[str, list[float]]):
    samples, rewards = [], []
    for pid, rs in group_rewards.items():
        for k, r in enumerate(rs):
            samples.append(RolloutSample(pid, k, [5], [9, 1], [-0.1, -0.1], "stop", 0, 0))
            rewards.append(r)
    t = torch.tensor(rewards)
    return samples, t, t.clone(), {"spec/rollout_s": 0.5, "reward/mean": float(t.mean()),
                                   "spec/nonfinite_logprobs": 1.0, "runahead/requests": 2.0}


def test_all_groups_filtered_raises_after_max_tries():
    calls = []

    def round_(idx):
        calls.append(idx)
        return _samples({f"a{idx}": [1.0, 1.0], f"b{idx}": [0.0, 0.0]})   # all-correct / all-wrong

    with pytest.raises(DynamicSamplingError, match="0/2 groups after 3 rounds"):
        filter_rounds(round_, target_groups=2, max_tries=3)
    assert calls == [0, 1, 2]


def test_rounds_accumulate_until_the_batch_is_full():
    rounds = [{"a": [1.0, 0.0], "b": [1.0, 1.0]}, {"c": [0.0, 0.0], "d": [0.0, 1.0], "e": [1.0, 0.0]}]
    samples, rewards, metrics = filter_rounds(lambda idx: _samples(rounds[idx]), target_groups=2, max_tries=4)
    assert [s.prompt_id for s in samples] == ["a", "a", "d", "d"]       # exactly 2 informative groups
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert metrics["dapo/rounds"] == 2 and metrics["spec/rollout_s"] == 1.0   # seconds add up over rounds
    assert metrics["spec/nonfinite_logprobs"] == 2.0 and metrics["runahead/requests"] == 4.0   # so do counts


def test_step_counts_add_up_over_rounds_and_ratios_come_from_the_sums():
    """A step of two DAPO rounds decoded in both: its decode and engine steps, request steps and the
    step-cost sums are the rounds' sums; accept rate and tokens per step are those of the summed counts
    (bench-rollout divides summed tokens by request steps: averaged steps inflated it by the rounds)."""
    tree = [{"spec/decode_steps": 20.0, "tree/engine_steps": 20.0, "tree/request_steps": 100.0,
             "tree/generated_tokens": 500.0, "tree/draft_tokens": 800.0, "tree/accepted_tokens": 400.0,
             "tree/accept_rate": 0.5, "tree/tokens_per_step": 5.0, "tree_cost/n": 19.0},
            {"spec/decode_steps": 10.0, "tree/engine_steps": 10.0, "tree/request_steps": 20.0,
             "tree/generated_tokens": 40.0, "tree/draft_tokens": 200.0, "tree/accepted_tokens": 20.0,
             "tree/accept_rate": 0.1, "tree/tokens_per_step": 2.0, "tree_cost/n": 9.0}]
    rounds = [{"a": [1.0, 1.0]}, {"b": [1.0, 0.0]}]

    def round_(idx):
        samples, rewards, task, metrics = _samples(rounds[idx])
        return samples, rewards, task, {**metrics, **tree[idx]}

    _, _, m = filter_rounds(round_, target_groups=1, max_tries=2)
    assert m["spec/decode_steps"] == 30.0 and m["tree/engine_steps"] == 30.0 and m["tree/request_steps"] == 120.0
    assert m["tree_cost/n"] == 28.0
    assert m["tree/accept_rate"] == 420.0 / 1000.0 and m["tree/tokens_per_step"] == 540.0 / 120.0


def test_filter_decides_on_task_rewards_and_returns_shaped_ones():
    """DAPO's overlong shaping must not flip the filter: a group all correct by task reward is
    dropped even if shaping made one of its rewards negative, and kept groups carry shaped rewards."""
    def round_(idx):
        samples, task, _, metrics = _samples({"solved": [1.0, 1.0], "mixed": [1.0, 0.0]})
        shaped = task - torch.tensor([0.0, 1.5, 0.25, 0.0])
        return samples, shaped, task, metrics
    samples, rewards, _ = filter_rounds(round_, target_groups=1, max_tries=1)
    assert [s.prompt_id for s in samples] == ["mixed", "mixed"]
    assert rewards.tolist() == [0.75, 0.0]


def test_a_prompt_kept_in_an_earlier_round_is_not_kept_again():
    """A later round can draw a prompt again (the loader's epoch ended between rounds). Kept twice,
    its two groups would share the prompt id, which GRPO groups by: one merged group of 2G samples
    with another baseline (and a step holding a prompt twice). The repeat is dropped instead."""
    from megatron_specrl.algorithms.advantages import grpo_advantages
    from megatron_specrl.algorithms.rewards_step import group_ids_of

    rounds = [{"a": [1.0, 0.0, 0.0, 0.0], "x": [1.0, 1.0, 1.0, 1.0]},
              {"a": [1.0, 1.0, 1.0, 0.0], "b": [0.0, 1.0, 0.0, 0.0]}]
    samples, rewards, metrics = filter_rounds(lambda idx: _samples(rounds[idx]), target_groups=2, max_tries=4)
    assert [s.prompt_id for s in samples] == ["a"] * 4 + ["b"] * 4
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    adv = grpo_advantages(rewards, group_ids_of(samples), normalize_std=False)
    assert adv[:4].tolist() == [0.75, -0.25, -0.25, -0.25]        # group a's own baseline (mean 0.25)
