"""Where the learner differed from verl without saying so (review s19):

1. PPO's critic has its own lr warm-up (`algorithm.critic_lr_warmup_steps`, verl's
   `critic.optim.lr_warmup_steps`, default none): `learner.lr_warmup_steps` warms up the policy only, so the
   critic's first step trains at the full `algorithm.critic_lr` while the actor's trains at 0.
2. `seq-mean-token-sum-norm`: ours is Dr. GRPO's mean over sequences (independent of the microbatch split
   and of DP); verl's is not one number (below), so README states the factor instead of "carries over".
3. A row longer than `learner.max_tokens_per_microbatch` is an error (verl asserts the same), and a config
   whose longest possible row (data.max_prompt_len + rollout.max_new_tokens) does not fit is refused.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from megatron_specrl.config import ConfigError, LearnerConfig, load_config
from megatron_specrl.learner import losses as L

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------- 1. critic warm-up
def test_critic_lr_warmup_steps_is_its_own_key_default_off():
    cfg = load_config(ROOT / "examples/tiny-cpu-ppo.yaml", ["learner.lr_warmup_steps=5"])
    assert cfg.algorithm.critic_lr_warmup_steps == 0
    assert load_config(None, ["algorithm.critic_lr_warmup_steps=3"]).algorithm.critic_lr_warmup_steps == 3
    with pytest.raises(ConfigError, match="critic_lr_warmup_steps"):
        load_config(None, ["algorithm.critic_lr_warmup_steps=-1"])


def _settings_per_role(cfg) -> dict[str, LearnerConfig]:
    """What run_setup.build_run hands each learner group (actors.build_actors with fake groups / engine)."""
    from megatron_specrl import actors, run_setup
    from megatron_specrl.engines import factory

    captured_kwargs = {}

    class Stop(Exception):
        pass

    def capture(*args, **kwargs):
        captured_kwargs.update(kwargs, _args=args)
        raise Stop

    with mock.patch.object(actors, "init_ray"), mock.patch.object(actors, "build_actors", capture), \
            mock.patch.object(run_setup, "cluster_gpus", lambda: []), \
            mock.patch.object(run_setup, "plan_placement", lambda cfg, gpus: mock.Mock(
                learner_gpus_per_rank=0.0, gpus_per_engine=None)), \
            mock.patch.object(run_setup, "resolve_transport", lambda *a: "ray"):
        with pytest.raises(Stop):
            run_setup.build_run(cfg)
    args = captured_kwargs.pop("_args")

    seen = {}

    def fake_group(settings, seed, role="policy", **kw):
        seen[role] = settings
        return mock.Mock()

    with mock.patch.object(actors, "LearnerGroup", fake_group), \
            mock.patch.object(factory, "make_engine", lambda *a, **k: mock.Mock()):
        actors.build_actors(*args, **captured_kwargs)
    return seen


def _first_step_lr(settings: LearnerConfig) -> float:
    """The lr LearnerWorker.train_step sets for its first step (train_steps 0), on a bare worker."""
    from megatron_specrl.learner.worker import LearnerWorker
    w = object.__new__(LearnerWorker)
    w.settings, w.train_steps = settings, 0
    w.optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=settings.lr)
    lr = w._set_lr()
    assert w.optimizer.param_groups[0]["lr"] == lr
    return lr


def test_critic_first_step_uses_full_critic_lr_while_actor_warms_up(tiny_llama, tmp_path):
    cfg = load_config(ROOT / "examples/tiny-cpu-ppo.yaml",
                      [f"model.path={tiny_llama}", "model.warmup_steps=0", f"output_dir={tmp_path / 'run'}",
                       "learner.lr=1e-3", "learner.lr_warmup_steps=4", "algorithm.critic_lr=5e-4",
                       "logging.wandb=false", "data.num_eval=0"])
    seen = _settings_per_role(cfg)
    assert set(seen) == {"policy", "critic"}
    assert _first_step_lr(seen["policy"]) == 0.0          # verl's warm-up: lr x 0 / 4 on the first step
    assert seen["critic"].lr == 5e-4 and seen["critic"].lr_warmup_steps == 0
    assert _first_step_lr(seen["critic"]) == 5e-4         # verl's critic.optim: no warm-up by default
    # and the critic's own key warms the critic up (only)
    cfg.algorithm.critic_lr_warmup_steps = 2
    seen = _settings_per_role(cfg)
    assert seen["critic"].lr_warmup_steps == 2 and seen["policy"].lr_warmup_steps == 4
    assert _first_step_lr(seen["critic"]) == 0.0


def test_readme_maps_the_critic_warmup_key_to_verl():
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `algorithm.gamma`"))
    assert "`critic_lr_warmup_steps`" in row and "critic.optim.lr_warmup_steps" in row


# ------------------------------------------------------------------------- 2. seq-mean-token-sum-norm scale
def _loss_mat():
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    mask[4] = 0                                           # an empty response
    return loss_mat, mask


def test_seq_mean_token_sum_norm_by_hand_and_split_invariant():
    """Ours: sum over the mini-batch's sequences of (token sum / F), over the number of non-empty sequences
    (Dr. GRPO's 1/G), the same for any microbatch split when the global denominator is passed."""
    loss_mat, mask = _loss_mat()
    F = 5.0
    sums = [sum(float(loss_mat[i, t]) for t in range(5) if mask[i, t]) for i in range(6)]
    n_seq = sum(1 for i in range(6) if mask[i].sum() > 0)
    by_hand = sum(s / F for s in sums) / n_seq
    whole = L.aggregate(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=F)
    assert whole.item() == pytest.approx(by_hand, rel=1e-12)
    denom = L.aggregation_denominator(mask, "seq-mean-token-sum-norm")
    for cut in ([2, 4], [1, 3, 5], [5]):
        parts = torch.tensor_split(torch.arange(6), cut)
        split = sum(L.aggregate(loss_mat[p], mask[p], "seq-mean-token-sum-norm", denom, F) for p in parts)
        assert split.item() == pytest.approx(by_hand, rel=1e-12)


def test_verl_seq_mean_token_sum_norm_is_ours_times_the_microbatch_size_legacy_workers():
    """verl's default (legacy) workers, fixed microbatches of m: each microbatch's loss is its token sum / F
    (no division by its sequences), scaled by 1 / gradient_accumulation = m / mini; summed over the
    mini-batch that is m x ours. With use_dynamic_bsz (scale n_mb / mini) it depends on the packing."""
    loss_mat, mask = _loss_mat()
    mask[4] = 1                                           # verl's count is rows, ours non-empty rows: equal here
    F, mini, m = 5.0, 6, 2
    ours = L.aggregate(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=F).item()
    verl_fixed = sum(float((loss_mat[i:i + m] * mask[i:i + m]).sum()) / F * (m / mini) for i in range(0, mini, m))
    assert verl_fixed == pytest.approx(m * ours, rel=1e-12)

    def verl_dynamic(packs):
        return sum(float((loss_mat[p] * mask[p]).sum()) / F * (len(p) / mini) for p in packs)
    a = verl_dynamic([[0, 1, 2], [3, 4, 5]])
    b = verl_dynamic([[0], [1, 2, 3, 4, 5]])
    assert a != pytest.approx(b, rel=1e-6)                # the same mini-batch, two losses
    # verl's new engine workers (use_legacy_worker_impl=disable): the sum over a rank's microbatches of
    # token sum / F, averaged over DP: (sequences per DP rank) x ours
    dp = 2
    per_rank = [range(0, 3), range(3, 6)]
    verl_engine = sum(float((loss_mat[list(r)] * mask[list(r)]).sum()) / F for r in per_rank) / dp
    assert verl_engine == pytest.approx(mini / dp * ours, rel=1e-12)


def test_readme_states_the_seq_mean_token_sum_norm_factor_against_verl():
    readme = (ROOT / "README.md").read_text()
    assert "verl's values carry over unchanged under these keys:" not in readme
    row = next(line for line in readme.splitlines() if line.startswith("| `learner.loss.agg_mode`"))
    assert "ppo_micro_batch_size_per_gpu" in row and "grad_clip" in row
    factor = next(line for line in readme.splitlines() if line.startswith("| `learner.loss.loss_scale_factor`"))
    assert "legacy" in factor


# ------------------------------------------------------------------------ 3. rows over the token budget
def test_a_row_over_the_token_budget_is_an_error_naming_length_and_budget():
    from megatron_specrl.learner.worker import split_microbatches
    assert split_microbatches([0, 1, 2], [8, 10, 4], 32, 20) == [[0, 1], [2]]
    assert split_microbatches([0, 1], [20, 20], 32, 20) == [[0], [1]]      # exactly the budget fits
    with pytest.raises(ValueError) as e:
        split_microbatches([0, 1, 2], [8, 21, 4], 32, 20)
    msg = str(e.value)
    assert "\n" not in msg and "21" in msg and "learner.max_tokens_per_microbatch=20" in msg
    # fixed-size microbatches have no token budget
    assert split_microbatches([0, 1], [500, 9], 1, None) == [[0], [1]]


def test_config_refuses_a_token_budget_below_the_longest_possible_row():
    base = ["data.max_prompt_len=64", "rollout.max_new_tokens=64", "rollout.max_model_len=256"]
    assert load_config(None, base + ["learner.max_tokens_per_microbatch=128"]).learner.max_tokens_per_microbatch == 128
    with pytest.raises(ConfigError) as e:
        load_config(None, base + ["learner.max_tokens_per_microbatch=100"])
    msg = str(e.value)
    assert "\n" not in msg
    for key in ("learner.max_tokens_per_microbatch=100", "data.max_prompt_len", "rollout.max_new_tokens", "128"):
        assert key in msg, (key, msg)
    assert load_config(None, base).learner.max_tokens_per_microbatch is None   # unset: no budget to check


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "examples").glob("*.yaml")))
def test_shipped_recipes_fit_their_longest_row_in_the_token_budget(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "examples" / f"{recipe}.yaml")
    budget = cfg.learner.max_tokens_per_microbatch
    assert budget is None or budget >= cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
