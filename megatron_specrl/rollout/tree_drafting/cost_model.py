"""How long a draft is worth, measured on the engine that runs it (rollout.drafter.cost_model).

A drafted engine step costs more than a plain one, and how much more depends on the hardware and the
batch: on a GPU a decode step is memory-bound and a few more verified tokens cost almost nothing; on
this CPU a step costs 5-9 ms whatever it holds and each draft token about a twentieth of a request
(docs/benchmarks/). A fixed draft length or token budget is right on one of them and wrong on the other.

The model: every engine step's seconds against the requests it ran (r) and the draft tokens it
verified (d), fitted by least squares as ms = a + b r + c d over recent steps (the sums decay by
`decay` a step, so the fit follows the batch as it changes; `fit_step_cost` solves them). The c in
effect is the fit's less two standard errors: what the steps show a draft token costs, so that steps
slowed by other work on shared cores (which scatter the fit, and once made a CI run's fit price every
draft out) draft more freely rather than not at all; a fit whose residual is as large as the mean
step takes no effect. A step of r requests gaining g tokens each on average runs at rho = r g / (a + b r + c D)
tokens per ms, D the step's draft tokens. One more draft token, accepted with probability p, adds p
tokens and c ms: it raises the step's tokens per second exactly when p > c rho. So the drafter drafts,
per request, every token whose probability of being accepted is above `threshold()` = c rho, and none
where the first is below it (zero included):

- a tree draft's j-th token is accepted with about its path probability (the product of the tree's
  conditional frequencies along the path, calibrated per source: drafter.Calibration), which the trees
  already cut at a minimum: the threshold is that minimum;
- an own draft (the sample's last-epoch response, rollout.verify=decode) carries no probability: its
  j-th token's is estimated from the engine's outcomes per depth (`DepthAcceptance`): of the own drafts
  verified to depth j whose first j-1 tokens were accepted, the share whose j-th was.

The step's threshold spreads its fixed cost a over the running requests, as if each were as likely to
finish last; but a rollout ends with its last request, and a token gained there saves 1/g of a step of
that request alone, a + b ms. A request's own draft (its sample's last-epoch response) predicts where it
ends: the one with the most own draft left (within a step's gain of it) drafts at `last_threshold()`,
the threshold of a one-request step.

Replay after a crash: the rejection sampler draws its random numbers per verified draft token, so the
samples of a seeded rollout depend on the draft lengths, and the draft lengths on the fit. Seconds are
not reproducible; the fit in effect therefore changes only where the run's state is saved (`commit`,
from drafter.state_dict at a checkpoint, or after every rollout where the run keeps no checkpoints:
the engine's `cost_refit` setting), and is saved with the trees. A resumed run then drafts every
replayed step as the killed run did. Until the first commit with enough measured steps (`min_steps`
steps, of which `min_drafted` verified drafts, so that c is told apart from a and b) the drafter keeps
its rules without the model (rollout.drafter.token_budget and min_prob), as it does in a step of more
or fewer requests than any step the fit in effect was measured on (a linear fit extrapolated from a
6-request batch to a 256-request one set every threshold to 1 on this CPU: nothing was drafted).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# least-squares sums over steps for seconds = a + b r + c d (r: requests in the step, d: draft tokens;
# cost_yy for the residual, and from it how well the steps pin c down)
STEP_COST_SUMS = ("cost_n", "cost_r", "cost_d", "cost_rr", "cost_rd", "cost_dd", "cost_y", "cost_ry", "cost_dy",
                  "cost_yy")

SOURCES = ("own", "prompt", "shared")


class StepCostFit(NamedTuple):
    """ms = a + b r + c d, with c's standard error and the residual's standard deviation (ms)."""
    a: float
    b: float
    c: float
    c_error: float
    residual_ms: float


def add_step_cost(sums: dict, requests: float, drafts: float, seconds: float) -> None:
    """One step into the fit's sums (the TreeDrafter's counters, or any dict of STEP_COST_SUMS)."""
    r, d, y = float(requests), float(drafts), float(seconds)
    for key, v in (("cost_n", 1.0), ("cost_r", r), ("cost_d", d), ("cost_rr", r * r), ("cost_rd", r * d),
                   ("cost_dd", d * d), ("cost_y", y), ("cost_ry", r * y), ("cost_dy", d * y), ("cost_yy", y * y)):
        sums[key] = sums.get(key, 0.0) + v


def fit_step_cost(sums: dict) -> StepCostFit | None:
    """(ms per step, ms per request, ms per draft token) from STEP_COST_SUMS by least squares, with the
    standard error of the last and the residual's standard deviation; None with fewer than 10 steps. A
    coefficient the steps cannot tell apart (no step drafted, or every step ran as many requests) gets the
    minimum-norm solution, so read it with the steps' ranges. Decayed sums weigh steps unequally; their
    total weight stands for the number of steps in the errors (an approximation that only matters when
    the decay is strong)."""
    g = {k: float(sums.get(k, 0.0)) for k in STEP_COST_SUMS}
    n = g["cost_n"]
    if n < 10:
        return None
    xtx = np.array([[n, g["cost_r"], g["cost_d"]],
                    [g["cost_r"], g["cost_rr"], g["cost_rd"]],
                    [g["cost_d"], g["cost_rd"], g["cost_dd"]]])
    xty = np.array([g["cost_y"], g["cost_ry"], g["cost_dy"]])
    scale = np.sqrt(np.maximum(np.diag(xtx), 1e-30))          # columns of very different size
    # one pseudo-inverse gives the minimum-norm solution and the coefficients' covariance (up to the variance)
    inverse = np.linalg.pinv(xtx / np.outer(scale, scale), rcond=1e-10)
    coef = inverse @ (xty / scale) / scale
    rss = max(g["cost_yy"] - float(coef @ xty), 0.0)          # at the least-squares solution
    var = rss / max(n - 3.0, 1.0)
    c_var = var * float(inverse[2, 2]) / scale[2] ** 2
    return StepCostFit(*(float(1000 * x) for x in coef), 1000 * float(np.sqrt(max(c_var, 0.0))),
                       1000 * float(np.sqrt(var)))


class DepthAcceptance:
    """Per draft source and depth j (1-based), decayed counts of drafts verified to depth j whose first
    j-1 tokens were accepted (`reached`) and of those whose j-th was (`accepted`). The probability that
    the first j tokens of a draft are all accepted is the product of the conditional shares to j, each
    with `prior` pseudo-counts at `prior_rate` (an own draft is the policy's own earlier sample: most of
    its tokens come true)."""

    def __init__(self, max_k: int, prior: float = 2.0, prior_rate: float = 0.9):
        self.max_k, self.prior, self.prior_rate = int(max_k), float(prior), float(prior_rate)
        self.reached = {s: [0.0] * self.max_k for s in SOURCES}
        self.accepted = {s: [0.0] * self.max_k for s in SOURCES}

    def observe(self, source: str, verified: int, accepted: int) -> None:
        reached, acc = self.reached[source], self.accepted[source]
        for j in range(min(verified, accepted + 1, self.max_k)):
            reached[j] += 1.0
            if j < accepted:
                acc[j] += 1.0

    def decay(self, factor: float) -> None:
        for table in (self.reached, self.accepted):
            for s in SOURCES:
                table[s] = [v * factor for v in table[s]]

    def cumulative(self, source: str) -> list[float]:
        """P(the first j tokens all accepted), j = 1..max_k."""
        out, p = [], 1.0
        for r, a in zip(self.reached[source], self.accepted[source]):
            p *= (a + self.prior * self.prior_rate) / (r + self.prior)
            out.append(p)
        return out

    def depth(self, source: str, threshold: float) -> int:
        """How many tokens of a draft from `source` each have a probability of acceptance above
        `threshold` (the probabilities fall with depth)."""
        n = 0
        for p in self.cumulative(source):
            if p <= threshold:
                break
            n += 1
        return n

    def state_dict(self) -> dict:
        return {"reached": {s: list(v) for s, v in self.reached.items()},
                "accepted": {s: list(v) for s, v in self.accepted.items()}}

    def load_state_dict(self, state: dict) -> None:
        for table, saved in ((self.reached, state["reached"]), (self.accepted, state["accepted"])):
            for s in SOURCES:
                values = [float(v) for v in saved.get(s, ())][:self.max_k]
                table[s] = values + [0.0] * (self.max_k - len(values))


class DraftCostModel:
    """The decayed step-cost sums, the fit in effect, and each source's acceptance per depth."""

    def __init__(self, max_k: int, decay: float = 0.98, min_steps: int = 10, min_drafted: int = 5,
                 errors: float = 2.0, max_residual: float = 1.0):
        self.decay, self.min_steps, self.min_drafted = float(decay), int(min_steps), int(min_drafted)
        self.errors, self.max_residual = float(errors), float(max_residual)
        self.c_error: float | None = None  # the standard error of the last committed fit's c (ms), for metrics
        self.sums: dict[str, float] = dict.fromkeys(STEP_COST_SUMS, 0.0)
        self.drafted_steps = 0.0          # decayed count of measured steps that verified draft tokens
        self.coef: tuple[float, float, float] | None = None   # ms, ms per request, ms per draft token
        # the fewest and most requests of the steps measured, and those of the fit in effect: it decides
        # only inside that range (a fit of 6-request steps says nothing of a 256-request step's cost)
        self.seen: list[int] | None = None
        self.span: tuple[int, int] | None = None
        self.depths = DepthAcceptance(max_k)

    def observe_step(self, requests: int, drafts: int, seconds: float) -> None:
        for k in self.sums:
            self.sums[k] *= self.decay
        self.drafted_steps = self.drafted_steps * self.decay + (drafts > 0)
        add_step_cost(self.sums, requests, drafts, seconds)
        r = int(requests)
        self.seen = [r, r] if self.seen is None else [min(self.seen[0], r), max(self.seen[1], r)]
        self.depths.decay(self.decay)

    def commit(self) -> bool:
        """The fit of the steps so far takes effect, if there are enough of them; whether one is in effect.
        The cost of a draft token in effect is the one the steps show: the fit's c less `errors` standard
        errors. Steps slowed by something else on the machine (another job on shared cores, a CI runner's
        other tests) scatter, and an over-rated c would stop drafting where it pays; what noise cannot
        tell from zero drafts as freely as a GPU's memory-bound step. A fit whose residual is as large as
        the mean step (steps timed while the machine ran something else) says nothing: the fit in effect
        before it, or the rules, stay."""
        if self.sums["cost_n"] >= self.min_steps and self.drafted_steps >= self.min_drafted:
            fit = fit_step_cost(self.sums)
            mean_ms = 1000 * self.sums["cost_y"] / self.sums["cost_n"]
            if fit is not None and fit.residual_ms < self.max_residual * mean_ms:
                c = fit.c - self.errors * fit.c_error
                self.coef, self.span = (max(fit.a, 0.0), max(fit.b, 0.0), max(c, 0.0)), tuple(self.seen)
                self.c_error = fit.c_error
        return self.coef is not None

    def threshold(self, running: int, tokens_per_request: float, drafts: int) -> float | None:
        """The acceptance probability a draft token needs this step (c x the step's tokens per ms, for
        `running` requests gaining `tokens_per_request` each with `drafts` draft tokens, the last step's);
        None while no fit is in effect, or where it saw no step of that many requests."""
        if self.coef is None or not self.span[0] <= running <= self.span[1]:
            return None
        a, b, c = self.coef
        ms = a + b * running + c * drafts
        if ms <= 0.0:
            return 0.0
        return min(1.0, c * running * max(tokens_per_request, 1.0) / ms)

    def last_threshold(self, tokens_per_request: float, threshold: float) -> float | None:
        """The threshold for a request predicted to be the rollout's last to finish (the longest own draft
        left): a rollout ends with its last request, so a token it gains saves 1/g of a step of that
        request alone (a + b ms), where any other request's saves only its share of the step; the step's
        `threshold` spreads the fixed cost a evenly over the running requests, as if each were as likely to
        be last. Never above `threshold`; None where the fit saw no one-request step."""
        last = self.threshold(1, tokens_per_request, 0)
        return None if last is None else min(last, threshold)

    def state_dict(self) -> dict:
        return {"coef": None if self.coef is None else list(self.coef), "c_error": self.c_error,
                "span": None if self.span is None else list(self.span), "depths": self.depths.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        coef = state.get("coef")
        self.coef = None if coef is None else tuple(float(x) for x in coef)
        self.c_error = None if state.get("c_error") is None else float(state["c_error"])
        span = state.get("span")
        self.span = None if coef is None else (int(span[0]), int(span[1])) if span else (1, 1 << 30)
        if state.get("depths") is not None:
            self.depths.load_state_dict(state["depths"])
