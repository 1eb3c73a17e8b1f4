"""PPO's step logs both value means: the critic's values on the rollout batch (verl's
`critic/values/mean`, from algorithms.ppo) and the critic's own value mean during its update
(`critic/value_mean`, from its train step); one must not overwrite the other."""

from types import SimpleNamespace

import torch

from megatron_specrl.rollout.speculative import RolloutSample
from megatron_specrl.trainer import train_step
from test_kl_in_reward import stand_in_run


class Critic:
    def compute_values(self, batch):
        return torch.full(batch["input_ids"].shape, 0.25)   # the rollout batch's values: mean 0.25

    def train_step(self, batch):
        return {"loss": 0.1, "value_mean": 0.75, "vf_clipfrac": 0.0, "vf_loss": 0.1}


def _run():
    cfg = SimpleNamespace(
        algorithm=SimpleNamespace(name="ppo", dynamic_sampling=False, gamma=1.0, lam=1.0, overlong_buffer=0,
                                  incorrect_score=0.0, use_kl_in_reward=False, filter_metric="acc"),
        rollout=SimpleNamespace(runahead=0, n_samples=2, max_new_tokens=4, temperature=1.0),
        trainer=SimpleNamespace(rollout_data_dir=None, prompts_per_step=1))
    samples = [RolloutSample("p0", k, [5, 6], [9, 10, 1], [-0.1] * 3, "stop", 0, 0) for k in range(2)]
    return stand_in_run(cfg=cfg, critic=Critic(), learner=SimpleNamespace(train_step=lambda batch: {"loss": 0.0}),
                        rollout=SimpleNamespace(run=lambda *a, **kw: (samples, {"spec/rollout_s": 0.0})))


def test_rollout_batch_values_and_critic_update_values_are_both_logged():
    metrics = train_step(_run(), 1)
    assert metrics["critic/values/mean"] == 0.25      # algorithms.ppo: the rollout batch's values
    assert metrics["critic/value_mean"] == 0.75       # the critic's train step
    assert metrics["critic/vf_loss"] == 0.1 and "critic/returns/mean" in metrics
