"""Speculative rollout: verify last epoch's responses in one engine prefill, extend from the first rejection.

Per (prompt, sample k) at step t:
  1. draft y, old log-probs q  <- TrajectoryStore (missing -> plain generation)
  2. verify: engine.score(prompt, y) -> p_t under the current weights and the sampling settings
     (processed: temperature, top-k, top-p), plus a replacement r_t per position drawn from p_t's
     distribution with y_t excluded (also warms the prefix cache)
  3. accept token by token (acceptance.decide) until the first rejection n; `exact` then takes r_n
     as the first new token (a replacement equal to EOS ends the response). `coupled` draws every
     token of a (prompt, sample) with position-keyed noise kept across epochs
     (rollout/coupled.py): the verification returns the coupled draw c_t under the new weights at
     every position, the draft survives while c_t == y_t, and c_n is the first new token
     (acceptance.coupled_prefix); the extension continues with the same noise
  4. extend: engine.generate(prompt + y[:n] (+ r_n), the rest of the L tokens), hitting the prefix
     cache; skipped when the response is already finished (EOS or length L)
  5. assemble prefix + continuation and store it for the next epoch.
With tree drafting, a response that needs no extension (the engine generates none of it) enters its
prompt's draft trees through the engine (`add_to_draft_trees`) before the extension batch, once, as
an extension's prefix does when its request starts and as every sample does under verify=decode.
All requests of a step go to the engine as one verification batch and one extension batch.

A pair that an earlier DAPO round of this step already rolled out (a prompt drawn again: the
loader wrapped at an epoch end) finds that round's sample in the store, drawn under the current
weights. `lenient` would accept all of it (p == q) and `coupled` redraw it with the same noise: the
same group again, one the filter may just have dropped. So `lenient` and `coupled` roll such a
pair out without its draft (`coupled` with noise of its own for the round), as a first draw of
the step would be sampled. `exact` keeps the draft: it accepts y_t with p(y_t) and replaces with
the round's own randomness, so its sample is exact and independent of the draft.

With rollout.verify=decode (`exact` with tree drafting) steps 2-4 happen inside the engine's decode
loop instead: every request starts from the prompt with its draft y as an own draft, which the
engine's proposer drafts first, K tokens a step, while the response still equals y's prefix; the
rejection sampler accepts y_t with p_t(y_t) and otherwise samples p_t without y_t, which is the
`exact` rule, so the samples have the same distribution. It verifies only the K tokens of each step
(not all of y after the first rejection), has no separate prefill and extension batch, and from the
first rejection the tree drafts. The reused count is the common prefix of y and the response (the
first new token differs from y_n by construction).

Log-probs: every response token carries its processed log-prob under the current weights (the
distribution that sampled or accepted it), in the samples and in the store; the learner's tempered
log-probs differ from these only under top-k / top-p (README, "Speculative rollouts").
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np

from megatron_specrl.engines.protocol import (
    DraftResponse, DraftsFromTrees, GenerateRequest, GenerateResult, RolloutEngine, SamplingSettings, ScoreRequest,
    ScoreResult, labels_with, samples_coupled, untruncated_t1, verifies_processed_distribution,
)
from megatron_specrl.rollout.acceptance import MODES, coupled_prefix, decide
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore


@dataclass
class RolloutSample:
    prompt_id: str
    sample_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]      # current-policy processed log-prob of every response token
    finish_reason: str
    num_reused: int            # leading response tokens taken from the draft
    weight_version: int
    noise_seed: int | None = None   # spec_mode=coupled: the seed of its position-keyed noise


@dataclass
class _Plan:
    prompt_id: str
    sample_idx: int
    prompt_ids: list[int]
    draft: Trajectory | None
    draft_ids: list[int] = field(default_factory=list)
    draft_finish_reason: str = "length"
    p_logprobs: list[float] = field(default_factory=list)   # processed, of the draft tokens
    accepted: int = 0
    ban: int | None = None          # exclude at the first generated position (engines without replacements)
    prefix_ids: list[int] = field(default_factory=list)          # accepted draft (+ exact's replacement)
    prefix_logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"   # when no generation is needed
    needs_generation: bool = True
    noise_seed: int | None = None   # coupled: the seed of this (prompt, sample)'s position-keyed noise
    refreshed: bool = False         # coupled: the noise was re-drawn this step (rollout.coupled_refresh, or a redraw)
    redraw: bool = False            # an earlier round of this step drew the pair: its draft is this step's sample


def _step_of(round_name) -> str:
    """The step a rollout round belongs to: "7" of "7.1" (a DAPO round) and of "7.refresh"."""
    return str(round_name).split(".")[0]


def stable_seed(*parts) -> int:
    """A 63-bit seed from strings/ints, identical across processes and Python runs."""
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def tree_metrics(engine) -> dict[str, float]:
    """`tree/*` metrics of this rollout from engines that draft from trees (rollout.draft=tree):
    tokens drafted and accepted, generated tokens per request per engine step (1 without drafts),
    engine steps, the decode loop's and the drafter's seconds, the trees' size, and `tree_cost/*`: the
    sums of the decode-step cost fit (rollout/tree_drafting/drafter.fit_step_cost; they add across steps)."""
    stats = engine.draft_stats() if isinstance(engine, DraftsFromTrees) else {}
    if not stats:
        return {}
    if "nodes" not in stats:   # a draft model's (rollout.draft=model): vLLM's counters, no trees
        return draft_model_metrics(stats)
    drafted, accepted = stats["draft_tokens"], stats["accepted_tokens"]
    return {"tree/nodes": stats["nodes"], "tree/memory_mb": stats["memory_mb"],
            "tree/draft_tokens": drafted, "tree/accepted_tokens": accepted,
            # drafts proposed, of which vLLM's scheduler verified draft_tokens (it cuts them to its budget)
            "tree/proposed_tokens": stats.get("proposed_tokens", drafted),
            "tree/accept_rate": accepted / max(drafted, 1.0),
            "tree/tokens_per_step": stats["generated_tokens"] / max(stats["request_steps"], 1.0),
            "tree/generated_tokens": stats["generated_tokens"], "tree/request_steps": stats["request_steps"],
            # engine steps a request ran, on average: far below the batch's steps where a tail of slow
            # requests sets them
            "tree/requests": stats.get("requests", 0.0),
            "tree/steps_per_request": stats["request_steps"] / max(stats.get("requests", 0.0), 1.0),
            "tree/engine_steps": stats["engine_steps"],   # summed over engines, as every counter
            # the rollout's decode steps: one engine's, the longest, where several step side by side
            "tree/engine_steps_longest": stats.get("engine_steps_longest", stats["engine_steps"]),
            "tree/own_draft_tokens": stats.get("own_draft_tokens", 0.0),
            # drafts taken from the shared tree of all prompts' responses, and its size
            "tree/shared_draft_tokens": stats.get("shared_draft_tokens", 0.0),
            "tree/shared_nodes": stats.get("shared_nodes", 0.0),
            # the engine's decode loop for the batch (first to last drafting step) and the drafter's share
            "tree/loop_s": stats.get("loop_s", 0.0), "tree/draft_s": stats.get("draft_s", 0.0),
            "runahead/tokens": stats.get("runahead_tokens", 0.0),
            # the drafter's calibration (rollout/tree_drafting/drafter.Calibration): per source, how often the
            # engine's next token was the tree's first proposed token, over the frequency the tree gave it
            **{f"tree/calibration_{src}": stats.get(f"calib_{src}_hits", 0.0)
               / max(stats.get(f"calib_{src}_expected", 0.0), 1.0) for src in ("prompt", "shared")
               if stats.get(f"calib_{src}_expected", 0.0) > 0},
            **{f"tree_calib/{k.removeprefix('calib_')}": v for k, v in stats.items() if k.startswith("calib_")},
            **cost_model_metrics(stats),
            **{f"tree_cost/{k.removeprefix('cost_')}": v for k, v in stats.items() if k.startswith("cost_")}}


def cost_model_metrics(stats: dict[str, float]) -> dict[str, float]:
    """What the drafter's cost model (rollout/tree_drafting/cost_model.py) chose and from what: draft tokens
    per engine step, the share of request steps that drafted nothing, the acceptance threshold it set
    (mean over steps), and the step-cost fit in effect (mean over the engines that have one)."""
    out = {"spec/draft_tokens_per_step": stats["draft_tokens"] / max(stats["engine_steps"], 1.0),
           "tree/undrafted_request_steps": stats.get("undrafted_request_steps", 0.0),
           # of the request steps of requests that could draft; 1 where none could (a first epoch on CPU)
           "spec/no_draft_frac": (stats.get("undrafted_request_steps", 0.0) / stats["request_steps"]
                                  if stats["request_steps"] > 0 else 1.0)}
    if stats.get("threshold_steps", 0.0) > 0:
        out.update({"tree/threshold_sum": stats["threshold_sum"], "tree/threshold_steps": stats["threshold_steps"],
                    "tree/cost_threshold": stats["threshold_sum"] / stats["threshold_steps"],
                    "tree/last_request_steps": stats["last_request_steps"]})
    engines = stats.get("fit_engines", 0.0)
    if engines > 0:
        out.update({"tree/fit_ms": stats["fit_ms"] / engines, "tree/fit_ms_per_request": stats["fit_ms_per_request"]
                    / engines, "tree/fit_ms_per_draft_token": stats["fit_ms_per_draft_token"] / engines,
                    "tree/fit_ms_per_draft_token_error": stats.get("fit_ms_per_draft_token_error", 0.0) / engines})
    return out


def draft_model_metrics(stats: dict[str, float]) -> dict[str, float]:
    """`draft_model/*` metrics of a rollout drafted by a draft model (rollout.draft=model), from vLLM's
    spec-decode counters (engines/vllm/drafting.draft_model_counters). Its weights stay fixed while the
    policy trains, so accept_rate falling over the run is the draft model going stale."""
    drafted, accepted = stats.get("draft_tokens", 0.0), stats.get("accepted_tokens", 0.0)
    drafts = stats.get("drafts", 0.0)
    return {"draft_model/draft_tokens": drafted, "draft_model/accepted_tokens": accepted,
            "draft_model/drafts": drafts, "draft_model/accept_rate": accepted / max(drafted, 1.0),
            # draft tokens a drafted request-step kept (it also samples one token of its own)
            "draft_model/mean_accept_len": accepted / max(drafts, 1.0),
            "draft_model/engine_steps": stats.get("engine_steps", 0.0),
            "draft_model/engine_steps_longest": stats.get("engine_steps_longest", stats.get("engine_steps", 0.0))}


def common_prefix(a, b) -> int:
    """Number of leading tokens a and b share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def resolve_verify(mode: str, tree_drafting: bool) -> str:
    """rollout.verify=auto: `decode` exactly where it can run (the exact rule, on engines drafting from
    trees), else `prefill` (RolloutConfig resolves `auto` by the same rule, with rollout.draft)."""
    return "decode" if mode == "exact" and tree_drafting else "prefill"


def _tree_drafting(engine) -> bool:
    return isinstance(engine, DraftsFromTrees) and engine.tree_drafting


def _name(engine) -> str:
    return getattr(engine, "name", str(engine))


@dataclass
class _Round:
    """One run(): its plans and what each phase made of them (the metrics read it all)."""

    plans: list[_Plan]
    drafted: list[_Plan] = field(default_factory=list)      # plans with a draft, before verification cut any
    verified: list[tuple[_Plan, ScoreResult]] = field(default_factory=list)
    extended: list[tuple[_Plan, GenerateResult]] = field(default_factory=list)
    runahead: int = 0
    replaced: int = 0          # first new tokens drawn by the verification (decode: by the sampler)
    nonfinite: int = 0
    lenient_excess: float = 0.0
    lenient_accepted: int = 0
    verify_s: float = 0.0
    extend_s: float = 0.0


class SpeculativeRollout:
    def __init__(self, engine: RolloutEngine, store: TrajectoryStore, *, mode: str, lenience: float,
                 sampling: SamplingSettings, max_new_tokens: int, seed: int, coupled_refresh: float = 0.0,
                 runahead: int = 0, verify: str | None = None):
        """`verify`: None resolves as rollout.verify=auto does (resolve_verify). Settings the engine
        cannot serve are refused here, before the first run()."""
        self.engine, self.store = engine, store
        self.mode, self.lenience = mode, lenience
        self.sampling, self.max_new_tokens, self.seed = sampling, max_new_tokens, seed
        self.coupled_refresh = coupled_refresh
        self.runahead = runahead   # most run-ahead requests per rollout (0: off)
        self._check_sampling()
        self.verify = resolve_verify(mode, _tree_drafting(engine)) if verify is None else verify
        self._check_verify()

    @classmethod
    def from_config(cls, engine: RolloutEngine, store: TrajectoryStore, rollout, seed: int) -> "SpeculativeRollout":
        """From a RolloutConfig (its verify resolved by the config, `auto` by resolve_verify)."""
        return cls(engine, store, mode=rollout.spec_mode, lenience=rollout.lenience,
                   sampling=SamplingSettings(rollout.temperature, rollout.top_p, rollout.top_k),
                   max_new_tokens=rollout.max_new_tokens, seed=seed, coupled_refresh=rollout.coupled_refresh,
                   runahead=rollout.runahead, verify=None if rollout.verify == "auto" else rollout.verify)

    # What the engine can do with the settings goes by its declared capabilities (its class's row of
    # engines.protocol.ENGINE_KINDS, which config._cross_checks reads for a run's settings before Ray starts).
    def _check_sampling(self) -> None:
        mode, sampling, engine = self.mode, self.sampling, self.engine
        if mode not in MODES:
            raise ValueError(f"rollout.spec_mode={mode!r} is not one of {MODES}")
        if mode == "coupled" and not samples_coupled(engine):
            raise NotImplementedError(f"rollout.spec_mode=coupled: engine {_name(engine)} has no "
                                      f"position-keyed sampling ({labels_with('samples_coupled')} engines only)")
        if mode == "coupled" and sampling.temperature <= 0:
            raise ValueError(f"rollout.spec_mode=coupled needs temperature > 0, got {sampling.temperature}")
        if not 0.0 <= self.coupled_refresh <= 1.0:
            raise ValueError(f"rollout.coupled_refresh={self.coupled_refresh} is not a fraction in [0, 1]")
        if mode != "off" and not untruncated_t1(sampling) and not verifies_processed_distribution(engine):
            raise NotImplementedError(
                f"rollout.spec_mode={mode} with temperature={sampling.temperature}, top_p={sampling.top_p}, "
                f"top_k={sampling.top_k}: engine {_name(engine)} cannot verify drafts under that "
                f"distribution (it scores at temperature 1 without top-k / top-p only); use the "
                f"{labels_with('verifies_processed_distribution')} engine or spec_mode=off")

    def _check_verify(self) -> None:
        mode, verify, sampling, engine = self.mode, self.verify, self.sampling, self.engine
        if verify not in ("prefill", "decode"):
            raise ValueError(f"rollout.verify={verify!r} is not one of ('prefill', 'decode')")
        if verify == "decode" and mode != "exact":
            raise ValueError(f"rollout.verify=decode with rollout.spec_mode={mode}: only the exact rule is the engine "
                             "rejection sampler's; use rollout.verify=prefill")
        if mode != "off" and verify == "prefill" and sampling.temperature <= 0:
            raise NotImplementedError(f"rollout.spec_mode={mode} with temperature={sampling.temperature}: greedy "
                                      "decoding has no distribution to verify drafts under; use spec_mode=off")
        if verify == "decode" and not _tree_drafting(engine):
            raise ValueError(f"rollout.verify=decode: engine {_name(engine)} does not draft from trees, and its "
                             "proposer is what drafts the own draft in the decode loop; use rollout.verify=prefill")
        if self.runahead and not _tree_drafting(engine):
            raise ValueError(f"rollout.runahead={self.runahead}: engine {_name(engine)} does not draft from trees, "
                             "which run-ahead requests only feed; use rollout.runahead=0")

    def _noise_seed(self, prompt_id: str, k: int, draft: Trajectory | None, step,
                    redraw: bool = False) -> tuple[int, bool]:
        """(noise seed, re-drawn?) of a (prompt, sample) under spec_mode=coupled: the draft's seed, so
        that this epoch's noise is last epoch's, except for a `coupled_refresh` fraction of pairs per
        step (and pairs never drawn), which get a seed of their own. A redraw (an earlier round of this
        step drew the pair) gets the round's own seed: `step` names the round."""
        if redraw:
            return stable_seed(self.seed, "coupled", prompt_id, k, step), True
        if draft is None or draft.noise_seed is None:
            return stable_seed(self.seed, "coupled", prompt_id, k), False
        u = np.random.default_rng(stable_seed(self.seed, step, "refresh", prompt_id, k)).random()
        if u < self.coupled_refresh:
            return stable_seed(self.seed, "coupled", prompt_id, k, step), True
        return draft.noise_seed, False

    def _runahead_requests(self, next_prompts, n_samples: int, step) -> list[GenerateRequest]:
        """Sample 0 of every next prompt, then sample 1, ... up to `runahead` requests."""
        out = []
        for k in range(n_samples):
            for pid, ids in next_prompts:
                if len(out) >= self.runahead:
                    return out
                out.append(GenerateRequest(list(ids), self.max_new_tokens, draft_key=pid, response_start=len(ids),
                                           seed=stable_seed(self.seed, step, "runahead", pid, k), runahead=True))
        return out

    @property
    def _in_decode(self) -> bool:
        return self.verify == "decode"

    def run(self, prompts: list[tuple[str, list[int]]], n_samples: int, weight_version: int,
            step: int | str, next_prompts: list[tuple[str, list[int]]] = ()) -> tuple[list[RolloutSample], dict[str, float]]:
        """`step` only seeds the randomness (acceptance uniforms, sampling seeds), so a resumed
        run makes the same draws. `next_prompts` (the next step's, when known) get up to
        `runahead` run-ahead requests: sampled in the tail of this step's generation only to feed
        their draft trees (GenerateRequest.runahead), never part of the samples or the store."""
        t0 = time.perf_counter()
        r = _Round([self._plan(pid, k, ids, step, weight_version) for pid, ids in prompts for k in range(n_samples)])
        self._verify(r, step, weight_version)                 # 2. every draft in one prefill (decode: in 4.)
        self._accept(r, step)                                 # 3. accepted prefix (+ the first new token)
        self._feed_trees(r)                                   #    samples the engine will not see
        self._extend(r, n_samples, step, weight_version, next_prompts)   # 4. one generation batch
        samples = self._assemble(r, weight_version, str(step))   # 5. samples, and next epoch's drafts
        return samples, self._metrics(r, samples, t0)

    def refresh(self, samples: list[RolloutSample], weight_version: int,
                step: int | str) -> tuple[list[RolloutSample], dict[str, float]]:
        """Coupled samples drawn under older weights, made samples of the current ones (trainer.overlap=exact,
        run/overlap.refresh_rollout): each response is its own draft, verified with its own noise in one
        prefill, kept up to its first changed draw c_n, and
        decoded on from there with the same noise (drafted from the prompt's trees, which hold the stale
        tail). Token for token what plain coupled generation with that noise gives under the current
        weights, so an exact sample of them wherever the noise is independent of the weights: fresh per
        step (rollout.coupled_refresh=1), never seen by the learner. The store gets the refreshed
        responses. Metrics: `refresh/*`."""
        if self.mode != "coupled" or self._in_decode:
            raise ValueError(f"a refresh verifies coupled draws in a prefill: rollout.spec_mode={self.mode}, "
                             f"rollout.verify={self.verify}; it needs spec_mode=coupled, verify=prefill")
        t0, plans = time.perf_counter(), []
        for s in samples:
            if s.noise_seed is None:
                raise ValueError(f"sample {s.prompt_id}/{s.sample_idx} has no noise seed: only coupled samples refresh")
            stale = Trajectory(list(s.response_ids), list(s.logprobs), s.finish_reason, s.weight_version, s.noise_seed)
            plans.append(self._with_draft(_Plan(s.prompt_id, s.sample_idx, s.prompt_ids, stale, noise_seed=s.noise_seed)))
        r, tag = _Round(plans), f"{step}.refresh"
        self._verify(r, tag, weight_version)
        self._accept(r, tag)
        # the stale samples are in the trees already; a changed one the engine will not see enters them
        taken = [DraftResponse(p.prompt_id, list(p.prefix_ids)) for p in plans
                 if not p.needs_generation and p.prefix_ids and p.prefix_ids != p.draft_ids]
        if taken and isinstance(self.engine, DraftsFromTrees):
            self.engine.add_to_draft_trees(taken)
        self._extend(r, 0, tag, weight_version, ())
        refreshed = self._assemble(r, weight_version, tag)
        m = self._metrics(r, refreshed, t0)
        stale_tokens = sum(len(s.response_ids) for s in samples)
        changed = sum(a.response_ids != b.response_ids for a, b in zip(samples, refreshed))
        return refreshed, {
            # the stale tokens kept: each response up to its first changed draw
            "refresh/kept_token_frac": sum(p.accepted for p in plans) / max(stale_tokens, 1),
            "refresh/changed_sample_frac": changed / max(len(samples), 1),
            "refresh/generated_tokens": m["spec/generated_tokens"],
            "refresh/decode_steps": m["spec/decode_steps"],
            "refresh/verify_s": m["spec/verify_s"],
            "refresh/extend_s": m["spec/extend_s"],
        }

    # 1. plan --------------------------------------------------------------------------------
    def _plan(self, prompt_id: str, k: int, prompt_ids: list[int], step, weight_version: int) -> _Plan:
        draft = self.store.get(prompt_id, k) if self.mode != "off" else None
        # a draft of the current weights is a sample an earlier round of this step stored (the version
        # changes every step; the exact overlap's refresh of the previous step is of the current weights
        # too, but drawn with that step's noise): lenient and coupled would serve it again, so they draw afresh
        redraw = (draft is not None and draft.weight_version == weight_version and self.mode in ("lenient", "coupled")
                  and (draft.drawn_at is None or _step_of(draft.drawn_at) == _step_of(step)))
        plan = _Plan(prompt_id, k, prompt_ids, None if redraw else draft, redraw=redraw)
        if self.mode == "coupled":
            plan.noise_seed, plan.refreshed = self._noise_seed(prompt_id, k, draft, step, redraw)
        return self._with_draft(plan)

    def _with_draft(self, plan: _Plan) -> _Plan:
        draft = plan.draft
        if draft is not None and draft.token_ids:
            L = self.max_new_tokens
            plan.draft_ids = list(draft.token_ids[:L])   # an old response longer than L is truncated
            ended_by_eos = draft.finish_reason == "stop" and len(draft.token_ids) <= L
            plan.draft_finish_reason = "stop" if ended_by_eos else "length"
        return plan

    # 2. verify ------------------------------------------------------------------------------
    def _verify(self, r: _Round, step, weight_version: int) -> None:
        """Score every draft in one batch (rollout.verify=decode: none here, the engine's decode loop
        verifies them in 4.)."""
        r.drafted = [p for p in r.plans if p.draft_ids]
        to_verify = [] if self._in_decode else r.drafted
        t = time.perf_counter()
        if to_verify:
            scores = self.engine.score(
                [ScoreRequest(p.prompt_ids, p.draft_ids, seed=stable_seed(self.seed, step, "verify", p.prompt_id,
                                                                          p.sample_idx), coupled_seed=p.noise_seed,
                              draft_key=p.prompt_id)
                 for p in to_verify],
                self.sampling, weight_version)
            r.verified = list(zip(to_verify, scores))
            for p, s in r.verified:
                p.p_logprobs = list(s.acceptance_logprobs)
                if len(p.p_logprobs) < len(p.draft_ids):
                    # the engine verified a prefix only (a response reaching its last position,
                    # protocol.score): the rest is a draft no more, and the extension samples it
                    p.draft_ids, p.draft_finish_reason = p.draft_ids[:len(p.p_logprobs)], "length"
        r.verify_s = time.perf_counter() - t

    # 3. accept ------------------------------------------------------------------------------
    def _accept(self, r: _Round, step) -> None:
        for p, s in r.verified:
            rng = np.random.default_rng(stable_seed(self.seed, step, "accept", p.prompt_id, p.sample_idx))
            q = p.draft.logprobs[: len(p.draft_ids)]
            if self.mode == "coupled":
                acc = coupled_prefix(p.draft_ids, s.replacements, p.p_logprobs)
            else:
                acc = decide(p.draft_ids, p.p_logprobs, q, rng.random(len(p.draft_ids)), self.mode, self.lenience)
            r.lenient_excess += acc.lenient_excess
            r.nonfinite += acc.nonfinite
            r.lenient_accepted += acc.num_accepted
            r.replaced += self._take_prefix(p, s, acc)

    def _take_prefix(self, p: _Plan, s: ScoreResult, acc) -> bool:
        """The plan's response prefix after acceptance: the accepted draft, and where the rule gives it
        the first new token; whether the verification's replacement is that token."""
        n = p.accepted = acc.num_accepted
        p.prefix_ids, p.prefix_logprobs = p.draft_ids[:n], p.p_logprobs[:n]
        if n == len(p.draft_ids):
            # a fully accepted draft needs nothing more if it ended at EOS or filled all L tokens
            p.finish_reason = p.draft_finish_reason
            p.needs_generation = not (p.draft_finish_reason == "stop" or n == self.max_new_tokens)
        elif self.mode == "exact" and s.replacements is None:
            p.ban = acc.ban_token     # the extension's first token excludes y_n (temperature 1 only)
        elif self.mode in ("exact", "coupled") and s.replacements[n] >= 0:
            # the first new token is the verification's draw: exact's from p without y_n (exact by
            # construction), coupled's with the noise of position n (what generation would draw)
            p.prefix_ids = p.prefix_ids + [s.replacements[n]]
            p.prefix_logprobs = p.prefix_logprobs + [s.replacement_sample_logprobs[n]]
            p.finish_reason = "stop" if s.replacement_stops[n] else "length"
            p.needs_generation = not (s.replacement_stops[n] or n + 1 == self.max_new_tokens)
            return True
        # else lenient, or exact where p is a point mass on y_n (rejected by rounding only), or a
        # row with non-finite log-probs (no replacement; the extension's generate() refuses NaN):
        # position n is sampled by the extension from the full distribution
        return False

    def _feed_trees(self, r: _Round) -> None:
        """The samples the engine will not see (a draft accepted whole, or ended by the verification's
        replacement) enter their prompts' draft trees first, once each, as an extension's accepted
        prefix enters when its request starts: verify=decode runs every sample in the engine, and the
        trees' counts (and the batch's drafts from them) must not depend on where a sample was
        verified. An engine of a tree-drafting class built without trees ignores them."""
        taken = [DraftResponse(p.prompt_id, list(p.prefix_ids)) for p in r.plans
                 if not p.needs_generation and p.prefix_ids]
        if taken and isinstance(self.engine, DraftsFromTrees):
            self.engine.add_to_draft_trees(taken)

    # 4. extend ------------------------------------------------------------------------------
    def _extend(self, r: _Round, n_samples: int, step, weight_version: int, next_prompts) -> None:
        """Plain generation for plans without a draft, the rest from the accepted prefix (verify=decode:
        every plan, from the prompt, its draft as the own draft) in one batch, run-ahead requests in
        its tail."""
        to_extend = [p for p in r.plans if p.needs_generation]
        requests = [
            GenerateRequest(prompt_ids=p.prompt_ids + p.prefix_ids,
                            max_new_tokens=self.max_new_tokens - len(p.prefix_ids),
                            seed=stable_seed(self.seed, step, "gen", p.prompt_id, p.sample_idx),
                            ban_first_token=p.ban,
                            draft_key=p.prompt_id, response_start=len(p.prompt_ids), coupled_seed=p.noise_seed,
                            own_draft=p.draft_ids if self._in_decode and p.draft_ids else None)
            for p in to_extend
        ]
        ahead = self._runahead_requests(next_prompts, n_samples, step) if requests else []
        t = time.perf_counter()
        results = self.engine.generate(requests + ahead, self.sampling, weight_version) if requests else []
        r.extend_s = time.perf_counter() - t
        r.extended, r.runahead = list(zip(to_extend, results[:len(requests)])), len(ahead)

    # 5. assemble ----------------------------------------------------------------------------
    def _assemble(self, r: _Round, weight_version: int, drawn_at: str) -> list[RolloutSample]:
        by_plan = {id(p): g for p, g in r.extended}
        samples = []
        for p in r.plans:
            g = by_plan.get(id(p))
            if g is None:
                response, logprobs, finish = p.prefix_ids, p.prefix_logprobs, p.finish_reason
            else:
                response, logprobs, finish = (p.prefix_ids + list(g.token_ids), p.prefix_logprobs + list(g.logprobs),
                                              g.finish_reason)
            if self._in_decode and p.draft_ids:
                p.accepted = common_prefix(p.draft_ids, response)
                r.replaced += p.accepted < min(len(p.draft_ids), len(response))   # the sampler's draw without y_n
            samples.append(RolloutSample(p.prompt_id, p.sample_idx, p.prompt_ids, response, logprobs,
                                         finish, p.accepted, weight_version, p.noise_seed))
            self.store.put(p.prompt_id, p.sample_idx,
                           Trajectory(response, logprobs, finish, weight_version, p.noise_seed, drawn_at))
        return samples

    def _metrics(self, r: _Round, samples: list[RolloutSample], t0: float) -> dict[str, float]:
        in_decode, plans = self._in_decode, r.plans
        results = [g for _, g in r.extended]
        response_tokens = sum(len(s.response_ids) for s in samples)
        accepted = sum(p.accepted for p in plans)
        # samples that are their whole draft (not those a replacement ended: its token is new); decode:
        # every request runs in the engine, a sample is its whole draft where the response is the draft
        full_reuses = sum(bool(p.draft_ids) and p.accepted == len(p.draft_ids)
                          and (len(s.response_ids) == p.accepted if in_decode else not p.needs_generation)
                          for p, s in zip(plans, samples))
        metrics = {
            "spec/accepted_tokens": float(accepted),
            # tokens sampled past the reused prefix (decode: the results also hold the accepted prefix)
            "spec/generated_tokens": float(sum(len(g.token_ids) for g in results)
                                           - (accepted if in_decode else 0)),
            "runahead/requests": float(r.runahead),
            "spec/replaced_tokens": float(r.replaced),   # exact: first new tokens drawn by the verification
            "spec/nonfinite_logprobs": float(r.nonfinite),   # NaN / +inf from the engine (never accepted)
            # the ratios' counts are logged too: DAPO's rounds merge the ratios from the summed counts
            # (rollout/dynamic.RATIOS)
            "spec/reuse_ratio": accepted / max(response_tokens, 1),
            "spec/response_tokens": float(response_tokens),
            "spec/full_reuse_ratio": full_reuses / max(len(plans), 1),
            "spec/full_reuses": float(full_reuses),
            "spec/samples": float(len(plans)),
            "spec/redraws": float(sum(p.redraw for p in plans)),   # drawn again this step, without the draft
            "spec/mean_accept_len": accepted / max(len(r.drafted), 1),
            "spec/drafts": float(len(r.drafted)),
            "spec/cached_prompt_tokens": float(sum(g.num_cached_tokens for g in results)),
            # prompts read, not re-prefilled
            "spec/verify_cached_tokens": float(sum(s.num_cached_tokens for _, s in r.verified)),
            "spec/verify_s": r.verify_s,
            "spec/extend_s": r.extend_s,
            "spec/rollout_s": time.perf_counter() - t0,
        }
        if self.mode == "lenient":
            metrics["spec/lenient_bias"] = r.lenient_excess / max(r.lenient_accepted, 1)
            metrics["spec/lenient_excess"] = r.lenient_excess
            metrics["spec/lenient_accepted_tokens"] = float(r.lenient_accepted)
        if self.mode == "coupled":
            metrics["spec/coupled_refreshed"] = float(sum(p.refreshed for p in plans))
        metrics.update(tree_metrics(self.engine))
        # draft tokens verified: all of every draft in the prefill; in the decode loop, the own-draft
        # tokens the engine's steps verified (K a step, not all of y)
        metrics["spec/verified_tokens"] = (metrics.get("tree/own_draft_tokens", 0.0) if in_decode
                                           else float(sum(len(p.draft_ids) for p, _ in r.verified)))
        # engine decode steps of the generation batch: counted by the tree proposer when it drafts (the
        # longest engine's, as the longest continuation sets them without drafts), otherwise one a token
        # of the longest continuation
        # (a batch whose requests all ran undrafted, rollout.draft_fresh_prompts, counts as one without drafts)
        # (a draft model's: vLLM's engine steps over the batch, its prefill included)
        metrics["spec/decode_steps"] = (metrics.get("tree/engine_steps_longest")
                                        or metrics.get("draft_model/engine_steps_longest")
                                        or float(max((len(g.token_ids) for g in results), default=0)))
        return metrics
