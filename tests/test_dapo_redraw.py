"""A prompt drawn again by a later DAPO round of the same step (the loader wrapped at an epoch end, or a
small dataset) is a fresh sample, not the group the earlier round just produced (and maybe just dropped).

Every round stores its samples at once (rollout/speculative.py, step 5), so a later round of the step
drafts from them: trajectories of the current weights. `lenient` then accepts every token (p == q)
and `coupled` redraws with the same noise under the same weights: the identical group comes back.
`exact` accepts y_t with p(y_t) and replaces from p without y_t with the round's own randomness, so its
sample is exact and independent of the draft whatever the draft is: it keeps reusing.
On the tabular engine, whose response distribution is enumerable (tests/tabular_engine.py).
"""

import copy

import numpy as np
import pytest
import torch

from megatron_specrl.algorithms.dapo import dapo_keep_mask
from megatron_specrl.rollout.dynamic import filter_rounds
from megatron_specrl.rollout.store import TrajectoryStore
from tabular_engine import TabularEngine
from test_coupled import _rollout
from test_speculative_exactness import NEW, OLD, PROMPT, L, _compare

N = 3000
COLLISION = sum(v * v for v in NEW.sequence_distribution(tuple(PROMPT), L).values())   # P(two draws agree)


def _last_epoch(prompts, n, mode):
    """Step 0 under OLD at weight version 0: the drafts step 1 (version 1) starts from."""
    store = TrajectoryStore()
    _rollout(TabularEngine(OLD), store, mode=mode).run(prompts, n, 0, step="0.0")
    return store


def _two_rounds(mode, n=N):
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
    assert metrics["spec/redraws"] == N
    pvalue, tv = _compare([tuple(s.response_ids) for s in second], NEW)
    assert pvalue > 1e-3, f"{mode}: redrawn samples differ from the policy (p={pvalue:.2e}, tv={tv:.3f})"
    if mode == "coupled":
        assert all(store.get("p", k).noise_seed != after_first.get("p", k).noise_seed for k in range(N))


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
