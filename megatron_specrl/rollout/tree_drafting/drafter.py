"""Engine-independent side of tree drafting: which requests draft from which prompt's tree, what each
step adds to the trees, how long a draft may be, and the counters. vLLM's proposer
(engines/vllm/tree_proposer.py) and SGLang's NGRAM worker patch (patches/sglang_0_5_23_tree_proposer.py)
both drive one `TreeDrafter` once per engine step and only translate their engine's batch to it.

Per engine step:
    drafter.begin_step(running)                     # draft length and cut-off for this batch size
    for each running request:
        draft = drafter.request(req_id, opts, seq, end, gained, verified)
    drafter.end_step(alive)                         # requests not seen this step and not alive have ended

- `opts()` is read once per request (the first step it is seen): RequestOpts(key, response_start,
  prompt_len, runahead), or None for a request that did not opt in (no draft key): never drafted,
  never counted;
- `seq(a, b)` returns the request's tokens [a, b) (prompt + output so far), `end` their number now;
- `verified`: how many tokens of the request's last draft this step verified, from an engine that
  verifies a draft in the next step and may cut it (vLLM); draft_tokens counts verified draft tokens
  (accept_rate = accepted / verified), proposed_tokens all proposed ones;
- the tokens a request gained since the last step (accepted draft tokens + the bonus or recovered
  token) extend its sequence in its prompt's tree at once, so sibling samples of one step draft from
  each other in flight; the tree keeps them after the request ends (later epochs);
- the draft is the tree's proposal from the longest suffix of the response, up to K tokens, where K
  shrinks as more requests run (a step verifies about `token_budget` tokens) and the path-probability
  cut-off `min_prob` relaxes as the batch empties (DAS and FastGRPO size drafts the same way);
- the path probabilities are the trees' frequencies scaled per source by a calibration learned from
  the engine's own samples (`Calibration`: is the token the engine sampled next the tree's first
  proposal, as often as the tree's frequency says?), so that paths the trees have seen once or twice
  (the first epoch's in-flight siblings) are drafted a token or two deep instead of K;
- every response also enters one shared tree of all prompts' responses (`SHARED_KEY`, SuffixDecoding's
  global tree), and a request drafts from both: it takes the shared tree's draft unless its own
  prompt's draft has the higher expected accepted length (`DraftTrees.propose_scored`; extending both
  trees and proposing from both is one `extend_and_propose` call, one compiled call with
  `impl=compiled`, rollout/tree_drafting/compiled_trees.py). Rollouts of
  different prompts share much of their text (on the arithmetic task, the steps of a sum; on real
  tasks, phrasing and formulas), and a sample that leaves its prompt's paths usually finds itself in
  the shared tree: replayed on a training run's tokens it cut the decode steps per rollout from 41.5
  to 19.9 (docs/benchmarks/). The shared tree is rebuilt from its newest half once it passes `shared_nodes`
  states (`DraftTrees.keep_newest`), between or during batches;
- a request that carries an own draft (`OWN_DRAFT`: its sample's last-epoch response, rollout.verify=
  decode) drafts that response's next K tokens instead, for as long as its response equals the own
  draft's prefix; from its first differing token on it drafts from the tree. The engine's rejection
  sampler accepts a point-mass draft token y with p(y) and otherwise samples p without y: exactly the
  `exact` rule's verification, done a few tokens per decode step instead of in one prefill. The own
  draft is not cut by probability: stopping it where its old log-probs fall below `min_prob` drafted
  6% fewer tokens but took more engine steps and was no faster on this CPU (docs/benchmarks/);
- a response the rollout took without the engine (rollout.verify=prefill: its draft accepted whole, or
  ended by the verification's replacement) comes in through `add_responses` between batches and enters
  its prompt's tree and the shared tree once, as an engine request's response would, so that the trees
  count every epoch's samples under either verification (verify=decode runs every sample in the engine).

Besides the token counters, two clocks (seconds since the last take_stats, in the engine's process):
`draft_s`, the drafter's own time inside its steps, and `loop_s`, from the first to the last step in
which a request of ours ran: the engine's decode loop for the batch, without its intake and the
first prefill. bench-rollout reads them to show where a rollout's time goes.

And what a decode step costs: each engine step's seconds (from one call of the drafter to the next:
the forward that verifies the drafts, sampling, scheduling, drafting) against the requests it ran and
the draft tokens it verified, kept as the sums of a least-squares fit (`STEP_COST_SUMS`; sums add
across engines and rollouts) so that `fit_step_cost` gives ms = a + b x requests + c x draft tokens.
On a GPU c should be near 0 (a decode step is memory-bound); on this CPU a step costs 5-9 ms
whatever it holds and a draft token about a twentieth of a request (docs/benchmarks/). Steps whose interval
held anything else are left out: the first step of a batch, a step that took in a new request (its
prefill), and the gap between two batches.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Container, Sequence


from megatron_specrl.config import DRAFT_TOKENS_AUTO, DrafterConfig
from megatron_specrl.rollout.tree_drafting.cost_model import STEP_COST_SUMS, DraftCostModel, add_step_cost
from megatron_specrl.rollout.tree_drafting.trees import DraftTrees

DRAFT_KEY = "specrl_draft_key"
RESPONSE_START = "specrl_response_start"
RUNAHEAD = "specrl_runahead"          # a run-ahead request: its tokens feed the tree, counted apart
OWN_DRAFT = "specrl_own_draft"        # token ids drafted first, while the response follows them

SHARED_KEY = "\x00shared"            # the tree of all prompts' responses (no prompt id starts with NUL)
_ADDED = "\x00added"                 # request ids of add_responses' sequences (no engine's request id)

# The drafter's settings: rollout.drafter's (config.DrafterConfig, whose field defaults are the only place
# they are written; `tokens` comes to the drafter as max_k, `fresh_prompts` is the engine's), and these,
# the proposer's own, no config key:
# max_depth None: max_match + max_k, the deepest trie node a proposal reads (a match of up to max_match
# tokens continued by up to max_k); counts kept deeper would only cost time on every token extended;
# calibration_prior: pseudo-counts that hold a source at 1 until it has evidence (`Calibration`, on with
# rollout.drafter.calibrate); calibration_decay: what an engine step keeps of the evidence so far
# cost_decay: what an engine step keeps of the step-cost fit's sums and the per-depth acceptance counts
# (cost_model.DraftCostModel; about fifty steps' worth counts)
PROPOSER_ONLY = {"max_depth": None, "max_match": 16, "calibration_prior": 2.0, "calibration_decay": 0.8,
                 "cost_decay": 0.98}
DEFAULTS = {**DrafterConfig().model_dump(), **PROPOSER_ONLY}

# draft_tokens (and own_ / shared_draft_tokens): the draft tokens the engine verified, accept_rate's
# denominator; proposed_tokens: all the drafter proposed (vLLM's scheduler may verify fewer: it cuts a
# draft to the step's token budget or max_model_len, and drops it for a preempted request)
# requests: those of the rollout that the drafter saw start (run-ahead ones left out); request_steps /
# requests is how many steps a request ran on average, against engine_steps, what the batch took
# the calibration's evidence over the rollout, per source (prompt: the request's prompt's tree; shared):
# first tokens the engine's next token matched, and the sum of the frequencies the tree gave them
CALIBRATION_SUMS = ("calib_prompt_hits", "calib_prompt_expected", "calib_shared_hits", "calib_shared_expected")
# undrafted_request_steps: request steps that proposed no draft; threshold_sum / threshold_steps: the cost
# model's acceptance threshold summed over the steps it set one (cost_model.DraftCostModel.threshold);
# last_request_steps: request steps drafted at the threshold of the rollout's predicted last request
COUNTERS = ("draft_tokens", "accepted_tokens", "generated_tokens", "request_steps", "requests", "engine_steps",
            "runahead_tokens", "own_draft_tokens", "shared_draft_tokens", "proposed_tokens", "draft_s",
            "undrafted_request_steps", "threshold_sum", "threshold_steps", "last_request_steps",
            *STEP_COST_SUMS, *CALIBRATION_SUMS)
SOURCES = ("prompt", "shared")


class Calibration:
    """How far each draft source's tree frequencies are to be trusted, learned from the engine's own
    samples. A tree's frequency is an empirical count: a path one in-flight sibling took has frequency
    1 at every node, yet in the first epoch (no earlier responses, only siblings a few tokens ahead)
    the engine's next token is that sibling's 2-8% of the time. Drafting such paths whole verified 10
    draft tokens for every one accepted and made the first epoch 1.9-2.9x slower than plain decoding
    on this CPU (docs/benchmarks/2026-11-25-avx512.md).

    Every engine step, each source's first proposed token for a request (proposed whether or not it was
    drafted or cut) is checked against the token the engine then sampled at that position, which is the
    policy's sample whether the token came from a draft or not (an exact rejection sampler). kappa =
    (hits + prior) / (expected + prior), capped at 1, where `expected` sums the tree's frequencies of
    those first tokens: the share of the tree's frequency that comes true. Each draft token's path
    probability is scaled by kappa (kappa^j at the j-th token), so `min_prob` cuts a distrusted source's
    drafts after a token or two and a trusted one's (kappa near 1, later epochs) not at all; and the two
    sources compete on the scaled expected lengths. Evidence decays by `decay` a step (about five steps'
    worth counts), so a source comes back as soon as its first tokens come true again (the next epoch's
    trees). Kept with the trees in checkpoints, so a resumed run drafts as the crashed one would have."""

    def __init__(self, prior: float, decay: float):
        self.prior, self.decay = float(prior), float(decay)
        self.hits, self.expected = [0.0, 0.0], [0.0, 0.0]

    def kappas(self) -> tuple[float, float]:
        return tuple(min(1.0, (h + self.prior) / (e + self.prior)) for h, e in zip(self.hits, self.expected))

    def observe(self, source: int, hit: bool, expected: float) -> None:
        self.hits[source] += hit
        self.expected[source] += expected

    def step(self) -> None:
        self.hits = [h * self.decay for h in self.hits]
        self.expected = [e * self.decay for e in self.expected]

    def state_dict(self) -> dict:
        return {"hits": list(self.hits), "expected": list(self.expected)}

    def load_state_dict(self, state: dict) -> None:
        self.hits = [float(x) for x in state["hits"]]
        self.expected = [float(x) for x in state["expected"]]


def settings_env(drafter: DrafterConfig | None = None, **overrides) -> str:
    """The settings as the engines hand them to their workers: rollout.drafter whole (its model_dump)
    and the proposer's own (PROPOSER_ONLY), `overrides` on top (tests, tools). Checked here, in the
    process that starts the engine, so that a bad one fails before the engine loads anything (in the
    worker it would fail inside vLLM's or SGLang's start-up)."""
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tree proposer settings {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    settings = {**DEFAULTS, **(drafter or DrafterConfig()).model_dump(), **overrides}
    trees_class(settings["impl"])
    return json.dumps(settings)


def as_drafter(drafter: DrafterConfig | dict | None, draft: str = "tree") -> DrafterConfig:
    """An engine's drafter settings: rollout.drafter (a dict of its keys is taken too), its unset
    `tokens` resolved for `draft` as the config's resolve step does (config.DRAFT_TOKENS_AUTO)."""
    if drafter is None:
        drafter = DrafterConfig()
    elif isinstance(drafter, dict):
        drafter = DrafterConfig(**drafter)
    if drafter.tokens is None:
        drafter = drafter.model_copy(update={"tokens": DRAFT_TOKENS_AUTO[draft]})
    if drafter.cost_refit is None:     # no run: no checkpoint to replay from
        drafter = drafter.model_copy(update={"cost_refit": "rollout"})
    return drafter


def read_settings(text: str | None) -> dict:
    return dict(DEFAULTS, **json.loads(text or "{}"))


def trees_class(impl: str) -> type[DraftTrees]:
    """The draft trees' implementation: both give the same drafts; the compiled one takes about half
    the drafter's time inside vLLM (docs/benchmarks/2026-11-23-avx512.md)."""
    if impl == "python":
        return DraftTrees
    if impl == "compiled":
        try:
            from megatron_specrl.rollout.tree_drafting.compiled_trees import CompiledDraftTrees
        except ImportError as e:
            raise ImportError(f"rollout.drafter.impl=compiled needs numba ({e}); pip install numba, or set "
                              "rollout.drafter.impl=python (the same drafts, about twice the drafter's time)") from None
        return CompiledDraftTrees
    raise ValueError(f"unknown draft trees impl {impl!r}: 'compiled' or 'python'")


@dataclass(frozen=True)
class RequestOpts:
    key: str               # the prompt's tree
    response_start: int    # the response starts at this position (an extension's prompt ends with its prefix)
    prompt_len: int        # tokens that were in the request when it arrived
    runahead: bool = False
    own_draft: tuple[int, ...] = ()   # drafted first while the response equals its prefix
    # where the engine ends the request: its sequence's last position (prompt + max_tokens; None:
    # unknown) and the tokens that stop it. vLLM's runner hands over every token a step sampled,
    # also those after a stop token or past max_tokens, which its scheduler then drops
    max_end: int | None = None
    stops: frozenset = frozenset()


def opts_from_params(params: dict | None, prompt_len: int, max_tokens: int | None = None,
                     stops=()) -> RequestOpts | None:
    """The opt-in dict both engines carry per request (vLLM extra_args, SGLang custom_params)."""
    key = (params or {}).get(DRAFT_KEY)
    if key is None:
        return None
    start = int(params.get(RESPONSE_START, prompt_len))
    if not 0 <= start <= prompt_len:
        raise ValueError(f"{RESPONSE_START}={start} outside the prompt (length {prompt_len})")
    own = tuple(int(t) for t in params.get(OWN_DRAFT) or ())
    return RequestOpts(str(key), start, int(prompt_len), bool(params.get(RUNAHEAD)), own,
                       None if max_tokens is None else int(prompt_len) + int(max_tokens),
                       frozenset(int(t) for t in stops if t is not None))


class TreeDrafter:
    def __init__(self, max_k: int, max_model_len: int, settings: dict | DrafterConfig | None = None):
        """`settings`: rollout.drafter (a DrafterConfig, or read_settings' dict of it and PROPOSER_ONLY's
        keys); unset keys take DEFAULTS, which are DrafterConfig's own defaults."""
        if isinstance(settings, DrafterConfig):
            settings = settings.model_dump()
        s = dict(DEFAULTS, **(settings or {}))
        self.max_k, self.max_model_len = int(max_k), int(max_model_len)
        self.min_prob, self.token_budget = float(s["min_prob"]), int(s["token_budget"])
        self.shared_nodes = int(s["shared_nodes"])   # 0: each prompt's own tree only
        max_depth = int(s["max_match"]) + self.max_k if s["max_depth"] is None else int(s["max_depth"])
        self._trees_cls = trees_class(s["impl"])
        self.trees = self._trees_cls(max_depth=max_depth, max_match=int(s["max_match"]),
                                     max_nodes=int(s["max_nodes"]))
        # request id -> [response start, tokens of the response already in the tree, last draft length,
        # run-ahead (0/1), last position the engine keeps, stop tokens, the last draft's source (cost_model.
        # SOURCES), where its own draft ends (its predicted end; None without one)]; None for requests that
        # did not opt in
        self._live: dict[str, list | None] = {}
        self._own: dict[str, tuple[int, ...]] = {}   # request id -> own draft, while its response follows it
        # request id -> (length, counter of its source or None) of its last draft, until the engine says
        # how many of its tokens it verified (`request(..., verified=)`); not for run-ahead requests
        self._unverified: dict[str, tuple[int, str | None]] = {}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._k_max, self._step_min_prob, self._seen, self._drafting = 0, 0.0, set(), False
        self._step_t0 = 0.0
        self._loop: list[float] | None = None   # [first, last] drafting step's clock since take_stats
        # the last drafting step, for the step-cost fit: [its clock, requests, draft tokens], its request
        # ids, and whether this step took in a new request (a prefill in the interval: left out)
        self._last_step: list[float] | None = None
        self._last_ids: set = set()
        self._step_running, self._step_drafts, self._step_joined = 0, 0, False
        self._step_verified: int | None = None   # draft tokens the engine said it verified this step
        self._shared_after_rebuild = 0   # the shared tree's states after its last keep_newest
        self.calibration = (Calibration(s["calibration_prior"], s["calibration_decay"]) if s["calibrate"]
                            else None)
        self._kappas: tuple[float, float] | None = None        # this step's, None: uncalibrated
        # request id -> each source's first proposed token and its frequency, checked against the
        # request's next token in the next step
        self._firsts: dict[str, tuple[tuple[int, float], ...]] = {}
        # the decode-step cost model (None: rollout.drafter.cost_model off), when its fit takes effect, and
        # this step's acceptance threshold from it (None: no fit in effect: token_budget and min_prob rule)
        self.cost = DraftCostModel(self.max_k, float(s["cost_decay"])) if s["cost_model"] else None
        self.cost_refit = s["cost_refit"] or "rollout"
        self._threshold: float | None = None
        # the threshold of the rollout's predicted last request (cost_model.DraftCostModel.last_threshold),
        # and the most tokens a request of the last step and of this one was predicted to have left
        self._last_threshold: float | None = None
        self._most_left, self._step_most_left = 0, 0
        self._step_gained, self._step_requests = 0, 0      # this step's tokens and requests (ours)
        self._tokens_per_request, self._last_drafts = 1.0, 0   # the last drafting step's

    # -- draft length rules ----------------------------------------------------------------
    def draft_len(self, running: int) -> int:
        return max(0, min(self.max_k, self.token_budget // max(running, 1) - 1))

    def draft_min_prob(self, running: int) -> float:
        """min_prob while full drafts for every running request would fill the step's budget, less
        as the batch empties: in the tail a longer, less likely draft costs almost nothing and can
        only add accepted tokens."""
        fill = min(1.0, running * (self.max_k + 1) / self.token_budget)
        return self.min_prob * fill

    # -- one engine step ---------------------------------------------------------------------
    def begin_step(self, running: int) -> None:
        self._step_t0 = time.perf_counter()
        self._threshold = (None if self.cost is None else
                           self.cost.threshold(running, self._tokens_per_request, self._last_drafts))
        self._last_threshold = None
        if self._threshold is None:
            self._k_max, self._step_min_prob = self.draft_len(running), self.draft_min_prob(running)
        else:      # every token whose chance of acceptance beats its cost, up to rollout.drafter.tokens
            self._k_max, self._step_min_prob = self.max_k, self._threshold
            self._last_threshold = self.cost.last_threshold(self._tokens_per_request, self._threshold)
        self._most_left, self._step_most_left = self._step_most_left, 0
        self._step_gained, self._step_requests = 0, 0
        self._seen, self._drafting = set(), False
        self._step_running, self._step_drafts, self._step_joined = running, 0, False
        self._step_verified = None
        self._kappas = self.calibration.kappas() if self.calibration is not None else None

    def request(self, req_id: str, opts: Callable[[], RequestOpts | None],
                seq: Callable[[int, int], Sequence[int]], end: int, gained: int | None = None,
                verified: int | None = None) -> list[int] | None:
        """The draft for this request this step ([] for none); None when the request is not ours.
        `gained`: tokens the engine sampled for it this step if it knows (0: a partial prefill,
        nothing to do); by default the tokens past what the tree already holds.
        `verified`: for an engine that verifies a draft in the step after the one that proposed it and
        may verify fewer of its tokens (vLLM: the scheduler cuts a draft to the step's token budget and
        max_model_len, and drops a preempted request's), how many of the request's last draft this step
        verified: then each draft counts (draft_tokens, own_ / shared_draft_tokens) when that number
        comes. None: an engine that verifies the whole draft (SGLang, in the step that drafts it), which
        counts when proposed. proposed_tokens counts every draft when proposed."""
        self._seen.add(req_id)
        live = self._live.get(req_id, 0)
        if live == 0:
            live = self._start(req_id, opts(), seq)
            self._step_joined = True
        elif req_id not in self._last_ids:   # back after steps away (preempted: its prefill is in this step)
            self._step_joined = True
        if live is None:
            return None
        if verified is not None:
            self._count_verified(req_id, live, int(verified))
        if gained == 0:
            return []
        start, consumed, last_draft, runahead, max_end, stops = live[:6]
        self._drafting = self._drafting or not runahead
        new = list(seq(start + consumed, end))
        n = len(new) if gained is None else gained
        # the engine keeps the tokens up to the first stop token or up to max_end and ends the request
        # there: the rest never enters the trees or the counters, and a request that ended drafts nothing
        kept = min(len(new), max(0, max_end - start - consumed))
        ended = kept < len(new) or start + consumed + kept >= max_end
        for j in range(kept):
            if new[j] in stops:
                kept, ended = j + 1, True
                break
        accepted = max(0, min(n - 1, last_draft))
        if kept < len(new):
            n = max(0, n - (len(new) - kept))
            accepted = min(accepted, n)
            del new[kept:]
        if self.cost is not None and last_draft > 0 and new and not runahead:
            self.cost.depths.observe(live[6], last_draft, accepted)
        c = self.counters
        firsts = self._firsts.pop(req_id, None)
        if firsts is not None and new:    # what the trees proposed last step against what the engine sampled
            for i, (token, freq) in enumerate(firsts):
                if freq > 0:                  # (-1, 0.0): the tree had no continuation
                    hit = new[0] == token
                    self.calibration.observe(i, hit, freq)
                    c[CALIBRATION_SUMS[2 * i]] += hit
                    c[CALIBRATION_SUMS[2 * i + 1]] += freq
        own = self._own.get(req_id)
        if own is not None and tuple(new) != own[consumed:consumed + len(new)]:
            del self._own[req_id]   # the response left its own draft: the tree drafts from here on
            own = None
        new_in_tree = False
        # a step gains at most the draft + 1 tokens: no draft past max_end (vLLM's scheduler would verify it)
        k = 0 if ended else min(self._k_max, max_end - end - 1)
        ids = (req_id, (req_id, SHARED_KEY)) if self.shared_nodes else (req_id,)
        kind = None        # the counter of the draft's source, besides draft_tokens
        source = "prompt"
        threshold, min_prob = self._threshold, self._step_min_prob
        if live[7] is not None and not ended and not runahead:
            left = live[7] - end
            self._step_most_left = max(self._step_most_left, left)
            # predicted to be the rollout's last request: each token it gains ends the rollout sooner
            if (self._last_threshold is not None and self._most_left > 0
                    and left >= max(1.0, self._most_left - self._tokens_per_request)):
                threshold = min_prob = self._last_threshold
                self.counters["last_request_steps"] += 1
        if own is not None and end - start < len(own):
            if threshold is not None:   # as deep as each token's estimated acceptance beats its cost
                k = min(k, self.cost.depths.depth("own", threshold))
            draft = list(own[end - start:end - start + max(k, 0)])
            kind, source = "own_draft_tokens", "own"
        elif k > 0:
            # the shared tree's draft unless the prompt's own expects more accepted tokens
            draft, from_shared, first = self.trees.extend_and_propose(ids, new, k, min_prob, self._kappas)
            if self.calibration is not None and not ended:
                self._firsts[req_id] = first
            new_in_tree = True
            if from_shared:
                kind, source = "shared_draft_tokens", "shared"
        else:
            draft = []
        if new:
            if not new_in_tree:
                for tree_id in ids:
                    self.trees.extend(tree_id, new)
            live[1] = end - start
            if runahead:       # feeds the tree; kept out of this rollout's counters
                c["runahead_tokens"] += n
            else:
                c["generated_tokens"] += n
                c["request_steps"] += 1
                c["accepted_tokens"] += accepted
                self._step_gained += n
                self._step_requests += 1
        if stops and draft:   # the request would end at a drafted stop token: verify no token after it
            draft = next((draft[:j + 1] for j, t in enumerate(draft) if t in stops), draft)
        live[2], live[6] = len(draft), source
        if new and not runahead and not draft:
            c["undrafted_request_steps"] += 1
        if not runahead:       # as its accepted tokens: kept out of this rollout's counters
            c["proposed_tokens"] += len(draft)
            if verified is not None:          # counted when the engine says how many it verified
                self._unverified[req_id] = (len(draft), kind)
            else:
                c["draft_tokens"] += len(draft)
                if kind:
                    c[kind] += len(draft)
        self._step_drafts += len(draft)   # the step verifies them all the same (the step-cost fit)
        return draft

    def holds_requests(self) -> bool:
        """Whether a request that opted in is live here (not yet released): an engine step that skips the
        drafter (vLLM's plain steps) must not leave one unreleased, its sequence unfinished in the trees."""
        return any(live is not None for live in self._live.values())

    def _count_verified(self, req_id: str, live: list, verified: int) -> None:
        """The engine verified `verified` tokens of the request's last draft (proposed in an earlier
        step): they count as drafted; the rest, cut by the engine, were never verified."""
        n = min(max(verified, 0), live[2])
        live[2] = n                    # what this step's gain can have accepted
        self._step_verified = (self._step_verified or 0) + n
        last = self._unverified.pop(req_id, None)
        if last is not None:
            n = min(n, last[0])
            self.counters["draft_tokens"] += n
            if last[1]:
                self.counters[last[1]] += n

    def end_step(self, alive: Container | None = None) -> None:
        """`alive`: the request ids the engine still holds, if it can tell. A request it holds but did
        not run this step (preempted, or left out of a full step) keeps its place: when it is back its
        sequence goes on, instead of starting over and entering its whole response into the trees a
        second time. None: every request not seen this step has ended."""
        self.counters["engine_steps"] += self._drafting   # only steps where a request of ours ran
        last, self._last_step = self._last_step, None
        if self._drafting:
            if self.calibration is not None:
                self.calibration.step()
            now = time.perf_counter()
            self.counters["draft_s"] += now - self._step_t0
            self._loop = [self._loop[0] if self._loop else self._step_t0, now]
            # the interval since the last step's call is that step's cycle: its drafts verified in this
            # step's forward, if the two steps are consecutive steps of one batch without a prefill
            # (the last step's draft tokens, or those of them this step verified where the engine says)
            if last is not None and not self._step_joined and self._seen & self._last_ids:
                drafts = last[2] if self._step_verified is None else self._step_verified
                add_step_cost(self.counters, last[1], drafts, self._step_t0 - last[0])
                if self.cost is not None:
                    self.cost.observe_step(last[1], drafts, self._step_t0 - last[0])
            self._last_step = [self._step_t0, self._step_running, self._step_drafts]
            if self._step_requests:
                self._tokens_per_request = self._step_gained / self._step_requests
            self._last_drafts = self._step_drafts
            if self._threshold is not None:
                self.counters["threshold_sum"] += self._threshold
                self.counters["threshold_steps"] += 1
        self._last_ids = self._seen
        for req_id in [r for r in self._live if r not in self._seen and (alive is None or r not in alive)]:
            self._release(req_id)
        self._bound_shared()

    def _bound_shared(self) -> None:
        """The shared tree rebuilt from its newest half once past its bound; where the running requests
        alone hold more than that (long responses, large batches), only once it has doubled since the
        last rebuild: a rebuild costs the tree's size, so rebuilding every step would cost the batch's
        tokens a step."""
        if not self._live:               # no running requests: back under the bound at once
            self._shared_after_rebuild = 0
        nodes = self.trees.nodes_of(SHARED_KEY) if self.shared_nodes else 0
        if nodes > max(self.shared_nodes, 2 * self._shared_after_rebuild):
            self.trees.keep_newest(SHARED_KEY, self.shared_nodes // 2)
            self._shared_after_rebuild = self.trees.nodes_of(SHARED_KEY)

    def finish(self, req_id: str, seq: Callable[[int, int], Sequence[int]] | None = None,
               end: int | None = None, opts: Callable[[], RequestOpts | None] | None = None) -> None:
        """The engine ended the request (between steps). `seq`/`end`: its final sequence, for an engine
        whose drafter never sees a request's last step (SGLang without its overlap scheduler): what it
        gained since the last step enters the trees and the counters as a step's gain would (cut at a
        stop token and at max_end; already there: nothing), and nothing is drafted. Its place is then
        released; the trees keep its tokens. A request the drafter does not hold: nothing, unless `opts`
        comes with it (SGLang: one that finishes in its prefill, a stop token first or max_new_tokens
        reached, is in no decode step): then it starts and ends here, its response (an extension's
        prefix included) entering the trees and its tokens the counters as one request step, as vLLM's
        proposer counts a request's prefill step."""
        held = req_id in self._live
        if seq is not None and (self._live.get(req_id) is not None or (not held and opts is not None)):
            k_max, self._k_max = self._k_max, 0       # no draft: the request has ended
            try:
                self.request(req_id, opts or (lambda: None), seq, end)
            finally:
                self._k_max = k_max
        self._release(req_id)

    def add_responses(self, responses: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Whole responses (prompt id, token ids) that the rollout took without the engine generating
        them (rollout.verify=prefill: a draft accepted whole, or ended by the verification's
        replacement) enter the trees as an engine request's response does: its prompt's tree and the
        shared tree, the keys used as a request's start uses them, the shared tree's bound applied as
        after a step. Nothing counts: the engine generated and drafted none of these tokens (an
        extension's accepted prefix enters the trees uncounted the same way)."""
        for i, (key, tokens) in enumerate(responses):
            rid = (_ADDED, i)
            ids = ((rid, key), ((rid, SHARED_KEY), SHARED_KEY)) if self.shared_nodes else ((rid, key),)
            for tree_id, tree_key in ids:
                self.trees.start(tree_id, str(tree_key), [int(t) for t in tokens])
                self.trees.finish(tree_id)
        if responses:
            self._bound_shared()

    def _release(self, req_id: str) -> None:
        """An ended request leaves the drafter; the trees keep its tokens."""
        self._own.pop(req_id, None)
        self._firsts.pop(req_id, None)
        self._unverified.pop(req_id, None)   # a draft the engine never verified: never counted
        if self._live.pop(req_id, None) is not None:
            self.trees.finish(req_id)
            if self.shared_nodes:
                self.trees.finish((req_id, SHARED_KEY))

    def _start(self, req_id: str, opts: RequestOpts | None, seq) -> list[int] | None:
        if opts is None:
            self._live[req_id] = None
            return None
        prefix = list(seq(opts.response_start, opts.prompt_len))
        self.trees.start(req_id, opts.key, prefix)
        if self.shared_nodes:
            self.trees.start((req_id, SHARED_KEY), SHARED_KEY, prefix)
        if opts.own_draft and tuple(prefix) == opts.own_draft[:len(prefix)]:
            self._own[req_id] = opts.own_draft
        max_end = self.max_model_len if opts.max_end is None else min(opts.max_end, self.max_model_len)
        self.counters["requests"] += not opts.runahead
        predicted_end = opts.response_start + len(opts.own_draft) if opts.own_draft else None
        live = self._live[req_id] = [opts.response_start, opts.prompt_len - opts.response_start, 0,
                                     int(opts.runahead), max_end, opts.stops, "prompt", predicted_end]
        return live

    # -- driver-side calls -------------------------------------------------------------------
    def take_stats(self) -> dict[str, float]:
        """Counters since the last call, and the trees' size now."""
        out = {k: float(v) for k, v in self.counters.items()}
        out["loop_s"] = self._loop[1] - self._loop[0] if self._loop else 0.0
        if self.cost is not None and self.cost.coef is not None:   # the fit in effect in these steps: summed
            out["fit_engines"] = 1.0                                   # over engines with this count
            out["fit_ms"], out["fit_ms_per_request"], out["fit_ms_per_draft_token"] = self.cost.coef
            out["fit_ms_per_draft_token_error"] = self.cost.c_error or 0.0
        if self.cost is not None and self.cost_refit == "rollout":   # the next rollout's
            self.cost.commit()
        self.counters, self._loop, self._last_step = dict.fromkeys(COUNTERS, 0), None, None
        # the next rollout's first step is sized from nothing of this one's (a run resumed from a checkpoint
        # never ran this rollout's last step, and an exact rollout's samples depend on its draft lengths)
        self._most_left = self._step_most_left = 0
        self._tokens_per_request, self._last_drafts = 1.0, 0
        st = self.trees.sizes()   # not stats(): that walks every stored sequence, every rollout
        out["nodes"] = float(st["nodes"])
        out["memory_mb"] = st["memory_bytes"] / 2**20
        out["keys"] = float(st["keys"] - self.trees.has_key(SHARED_KEY))
        out["shared_nodes"] = float(self.trees.nodes_of(SHARED_KEY))
        return out

    def state_dict(self) -> dict:
        """The trees, the calibration and the cost model, for a checkpoint: the cost fit of the steps so
        far takes effect here, so that a run resumed from this state drafts as this one goes on to."""
        state = self.trees.state_dict()
        if self.calibration is not None:
            state["calibration"] = self.calibration.state_dict()
        if self.cost is not None:
            self.cost.commit()
            state["cost_model"] = self.cost.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Trees saved by an earlier run, rebuilt under this drafter's settings (a resumed run may have
        changed rollout.drafter.max_nodes or .tokens since the checkpoint was written)."""
        t = self.trees
        self.trees = self._trees_cls.from_state_dict(state, max_depth=t.max_depth, max_match=t.max_match,
                                                     max_nodes=t.max_nodes)
        self._live.clear()
        self._own.clear()
        self._unverified.clear()
        self._firsts.clear()
        self._shared_after_rebuild = 0
        if self.calibration is not None and state.get("calibration") is not None:
            self.calibration.load_state_dict(state["calibration"])
        if self.cost is not None and state.get("cost_model") is not None:
            self.cost.load_state_dict(state["cost_model"])
