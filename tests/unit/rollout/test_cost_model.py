"""The drafter's decode-step cost model (rollout/tree_drafting/cost_model.py): the acceptance threshold it
derives from a fit, the per-depth acceptance of own drafts, when a fit takes effect (after each rollout, or
only at checkpoints so that a resumed run drafts as the killed run did), and the drafts it sizes, driven
as the patched vLLM runner drives the proposer (tests/helpers/proposer.py)."""

import pytest

from megatron_specrl.rollout.tree_drafting.cost_model import DepthAcceptance, DraftCostModel
from tests.helpers.proposer import Batch, _proposer


def _measured(model: DraftCostModel, steps: int = 40, drafted: bool = True) -> None:
    for i in range(steps):
        r, d = 1 + i % 30, (7 * i) % 50 if drafted else 0
        model.observe_step(r, d, (5.0 + 0.2 * r + 0.05 * d) / 1000)


def test_a_fit_takes_effect_only_when_committed_with_enough_drafted_steps():
    model = DraftCostModel(max_k=8)
    _measured(model, drafted=False)
    assert not model.commit() and model.threshold(8, 1.0, 0) is None   # c cannot be told from a and b
    _measured(model)
    assert model.threshold(8, 1.0, 0) is None                           # measured, not yet in effect
    assert model.commit()
    a, b, c = model.coef
    assert (a, b, c) == pytest.approx((5.0, 0.2, 0.05), rel=1e-6)
    # a draft token pays where its chance of acceptance beats c x the step's tokens per ms
    assert model.threshold(20, 1.5, 40) == pytest.approx(0.05 * 20 * 1.5 / (5.0 + 0.2 * 20 + 0.05 * 40))
    assert model.threshold(1, 1.0, 0) < model.threshold(30, 1.0, 0)      # the tail drafts deeper
    assert model.span == (1, 30) and model.threshold(31, 1.0, 0) is None  # no step of 31 requests was measured


def test_the_fit_recovers_noisy_step_costs_and_prices_a_draft_token_at_what_the_steps_show():
    """Steps scattered by other work on the machine: the fit still finds a, b and c with a standard error
    that covers them, and the c in effect is the fit's less two errors (exact steps: the fit's own)."""
    import numpy as np

    from megatron_specrl.rollout.tree_drafting.cost_model import fit_step_cost
    rng = np.random.default_rng(0)

    def fitted(noise_ms, c=0.05):
        model = DraftCostModel(max_k=8, decay=1.0)
        for i in range(400):
            r, d = 1 + i % 30, (7 * i) % 50
            model.observe_step(r, d, (5.0 + 0.2 * r + c * d + noise_ms * rng.standard_normal()) / 1000)
        assert model.commit()
        return model, fit_step_cost(model.sums)

    quiet, fit = fitted(0.0)
    assert fit.c_error == pytest.approx(0.0, abs=1e-6) and quiet.coef[2] == pytest.approx(0.05, rel=1e-6)
    noisy, fit = fitted(1.0)
    assert fit.residual_ms == pytest.approx(1.0, rel=0.15)
    assert abs(fit.c - 0.05) < 4 * fit.c_error and 0.002 < fit.c_error < 0.02
    assert noisy.coef[2] == pytest.approx(max(fit.c - 2 * fit.c_error, 0.0)) and noisy.c_error == fit.c_error
    swamped, fit = fitted(5.0, c=0.002)   # c cannot be told from zero: drafts cost nothing the steps show
    assert fit.c < 2 * fit.c_error and swamped.coef[2] == 0.0
    loaded = DraftCostModel(max_k=8, decay=1.0)   # steps as noisy as they are long: the fit takes no effect
    for i in range(400):
        r, d = 1 + i % 30, (7 * i) % 50
        loaded.observe_step(r, d, (5.0 + 0.2 * r + 0.05 * d) * (1 + 20 * (i % 5 == 0) * rng.random()) / 1000)
    assert not loaded.commit() and loaded.threshold(8, 1.0, 0) is None


def test_own_draft_acceptance_is_counted_per_depth():
    d = DepthAcceptance(max_k=4, prior=2.0, prior_rate=0.9)
    for _ in range(10):
        d.observe("own", verified=4, accepted=2)        # the first two come true, the third is rejected
    p = d.cumulative("own")
    assert p[0] == pytest.approx(11.8 / 12) and p[1] == pytest.approx((11.8 / 12) ** 2)
    assert p[2] == pytest.approx(p[1] * 1.8 / 12)      # reached ten times, never accepted
    assert p[3] == pytest.approx(p[2] * 0.9)           # never reached: the prior alone
    assert [d.depth("own", t) for t in (0.99, 0.5, 0.1, 0.0)] == [0, 2, 4, 4]
    assert d.cumulative("prompt") == pytest.approx([0.9 ** j for j in range(1, 5)])   # other sources apart


def _request_draft(p, own=None):
    b = Batch()
    b.add("a", [50, 51], "q", own=own)
    return p.propose_batch(b, b.requests, [b.sample(0, [1])])[0]


def test_the_fit_in_effect_sets_how_deep_a_tree_draft_goes(monkeypatch):
    """Paths [1 2 3 4 5] and [1 2 7 8 9]: after token 1, token 2 is certain and the next one a coin toss.
    Without a fit the drafter keeps its min_prob rule (0.9 in a full step: stop at the toss); a fit whose draft tokens
    cost nothing drafts the whole path; one that makes a step's tokens dear drafts only the sure token;
    cost_model=false keeps the rule whatever the fit."""
    drafts = {}
    for name, coef, cost_model in (("rule", None, True), ("free", (1.0, 0.0, 0.0), True),
                                   ("dear", (1.0, 0.0, 0.7), True), ("off", (1.0, 0.0, 0.0), False)):
        p = _proposer(monkeypatch, k=4, min_prob=0.9, token_budget=5, cost_model=cost_model)   # a full step
        p.trees.insert("q", [1, 2, 3, 4, 5])
        p.trees.insert("q", [1, 2, 7, 8, 9])
        if coef is not None and p.drafter.cost is not None:
            p.drafter.cost.load_state_dict({"coef": list(coef)})
        drafts[name] = _request_draft(p)
    assert drafts["rule"] == [2] and drafts["off"] == [2]
    assert len(drafts["free"]) == 4 and drafts["free"][0] == 2
    assert drafts["dear"] == [2]                    # 0.5 < threshold 0.7 x 1 token / 1 ms


def test_an_own_draft_is_cut_where_its_estimated_acceptance_falls_below_the_threshold(monkeypatch):
    p = _proposer(monkeypatch, k=6, min_prob=0.0)
    p.drafter.cost.load_state_dict({"coef": [1.0, 0.0, 0.5],     # threshold 0.5 for one request
                                    "depths": {"reached": {"own": [10, 10, 10]}, "accepted": {"own": [10, 10, 0]}}})
    assert _request_draft(p, own=[1, 2, 3, 4, 5, 6, 7]) == [2, 3]
    q = _proposer(monkeypatch, k=6, min_prob=0.0, cost_model=False)   # the rule: the whole own draft
    assert _request_draft(q, own=[1, 2, 3, 4, 5, 6, 7]) == [2, 3, 4, 5, 6, 7]


def test_the_request_predicted_to_finish_last_drafts_at_the_threshold_of_a_step_of_its_own(monkeypatch):
    """Two requests following their own drafts (last epoch's responses, 20 and 6 tokens): in a two-request
    step the threshold (1 here) drafts nothing; the one predicted to finish last (the most own draft left)
    drafts at the threshold of a step of one request (0.5), as deep as its tokens' estimated acceptance
    beats that. Not in a rollout's first step, before any request's prediction was seen."""
    p = _proposer(monkeypatch, k=6, min_prob=0.0)
    p.drafter.cost.load_state_dict({"coef": [1.0, 0.0, 0.5],
                                    "depths": {"reached": {"own": [10, 10, 10]}, "accepted": {"own": [10, 10, 0]}}})
    long, short = list(range(100, 120)), list(range(200, 206))
    b = Batch()
    b.add("a", [50, 51], "q", own=long)
    b.add("b", [50, 51], "q", own=short)
    first = p.propose_batch(b, b.requests, [b.sample(0, long[:1]), b.sample(1, short[:1])])
    assert first == [[], []] and p.take_stats()["last_request_steps"] == 0
    b = Batch()                                   # the next rollout: the same requests, one step further
    b.add("a", [50, 51], "q", own=long)
    b.add("b", [50, 51], "q", own=short)
    p.propose_batch(b, b.requests, [b.sample(0, long[:1]), b.sample(1, short[:1])])
    second = p.propose_batch(b, b.requests, [b.sample(0, long[1:2]), b.sample(1, short[1:2])])
    assert second == [long[2:4], []]
    assert p.take_stats()["last_request_steps"] == 1


@pytest.mark.parametrize("refit", ["rollout", "checkpoint"])
def test_a_new_fit_takes_effect_after_a_rollout_or_only_where_state_is_saved(monkeypatch, refit):
    """With cost_refit=checkpoint the fit changes only in state_dict (a checkpoint), which saves it: a
    drafter loaded from that state drafts with the same fit, so a resumed run replays as it went."""
    p = _proposer(monkeypatch, k=4, cost_refit=refit)
    _measured(p.drafter.cost)
    stats = p.take_stats()
    assert (p.drafter.cost.coef is not None) == (refit == "rollout")
    assert "fit_ms" not in stats                            # the fit in effect in the steps it reports: none
    again = p.take_stats()
    assert ("fit_ms" in again) == (refit == "rollout") and again.get("fit_engines", 0.0) == (refit == "rollout")
    state = p.state_dict()
    assert state["cost_model"]["coef"] == pytest.approx([5.0, 0.2, 0.05], rel=1e-6)
    q = _proposer(monkeypatch, k=4, cost_refit=refit)
    q.load_state_dict(state)
    assert q.drafter.cost.coef == pytest.approx(p.drafter.cost.coef)


def test_the_drafter_counts_steps_without_a_draft_and_the_threshold_it_set(monkeypatch):
    p = _proposer(monkeypatch, k=4, min_prob=0.0)
    p.drafter.cost.load_state_dict({"coef": [1.0, 0.0, 0.25]})
    p.trees.insert("q", [1, 2, 3])
    b = Batch()
    b.add("a", [50, 51], "q")
    b.add("b", [50, 51], "q")
    drafts = p.propose_batch(b, b.requests, [b.sample(0, [1]), b.sample(1, [9])])   # b: nothing to draft
    assert drafts == [[2, 3], []]
    s = p.take_stats()
    assert s["undrafted_request_steps"] == 1 and s["request_steps"] == 2
    assert s["threshold_steps"] == 1 and s["threshold_sum"] == pytest.approx(0.25 * 2 / (1.0 + 0.0))


def test_a_rollout_s_first_step_is_sized_alike_in_a_run_and_in_its_resumed_copy(monkeypatch):
    """The threshold reads the last step's tokens per request and draft tokens; a rollout's first step
    must not read them from the previous rollout's last step, which a run resumed from a checkpoint never
    ran: its first step would be sized otherwise, and an exact rollout's samples depend on draft lengths."""
    def next_rollout(p):
        b = Batch()
        b.add("c", [50, 51], "q")
        b.add("d", [50, 51], "q")
        p.propose_batch(b, b.requests, [b.sample(0, [1]), b.sample(1, [1])])
        return p.take_stats()["threshold_sum"]

    p = _proposer(monkeypatch, k=4, min_prob=0.0)
    p.drafter.cost.load_state_dict({"coef": [1.0, 0.0, 0.25]})
    p.trees.insert("q", [1, 2, 3, 4, 5])
    b = Batch()
    b.add("a", [50, 51], "q")
    b.add("b", [50, 51], "q")
    p.propose_batch(b, b.requests, [b.sample(0, [1]), b.sample(1, [1])])
    p.propose_batch(b, b.requests, [b.sample(0, [2, 3, 4]), b.sample(1, [2, 3, 4])])   # 3 tokens a request
    p.take_stats()
    q = _proposer(monkeypatch, k=4, min_prob=0.0)
    q.load_state_dict(p.state_dict())
    assert next_rollout(p) == pytest.approx(next_rollout(q)) == pytest.approx(0.25 * 2 / 1.0)
