"""The small protocol every rollout engine speaks (vLLM, SGLang, routers of them).

Everything is token ids in, token ids + log-probs out: the rollout code never
hands text to an engine, so tokenizer drift cannot silently change a trajectory.
Every call carries the weight version the caller believes is loaded; an engine
serving another version raises instead of answering.

Log-prob conventions (README, "Speculative rollouts"):
- processed: the log-prob under the distribution the sampler draws from (logits / T, then top-k /
  top-p truncation, renormalised; -inf outside the nucleus). Generated tokens carry these, and so
  do the trajectory store's drafts; acceptance reads them.
- tempered: log_softmax(logits / T) over the full vocabulary, what the learner computes. Without
  top-k / top-p it equals the processed one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, runtime_checkable

if TYPE_CHECKING:   # annotations only: the CLI imports EngineError without loading torch
    import torch


class EngineError(RuntimeError):
    """An engine died, timed out or ran out of memory. Carries its last log lines."""

    def __init__(self, message: str, engine: str = "", last_log_lines: list[str] | None = None):
        self.message, self.engine = message, engine
        self.last_log_lines = list(last_log_lines or [])
        tail = "\n".join(self.last_log_lines[-20:])
        super().__init__(f"[{engine}] {message}" + (f"\n--- last engine log lines ---\n{tail}" if tail else ""))

    def __reduce__(self):
        # raised in an engine's actor, it reaches the driver pickled: rebuilt from the formatted
        # message alone (BaseException's default), it would read "[] [engine] ..."
        return type(self), (self.message, self.engine, self.last_log_lines)


def check_finite_logprobs(token_ids: list[int], logprobs: list, engine: str) -> None:
    """Refuse a response's NaN / +inf log-probs (and null ones: SGLang's HTTP server writes NaN / inf as
    JSON null): the learner would train on them (TIS, PPO's old log-probs) and turn NaN. -inf (a token
    outside the processed distribution's support) is a log-prob."""
    bad = [i for i, v in enumerate(logprobs) if v is None or v != v or v == float("inf")]
    if bad:
        raise EngineError(f"generate: log-prob {logprobs[bad[0]]} for token {token_ids[bad[0]]} at response position "
                          f"{bad[0]} ({len(bad)} of {len(token_ids)} tokens): the engine's weights or activations "
                          "are not finite (megatron-specrl check-resync compares them)", engine)


class WeightVersionMismatch(RuntimeError):
    """A response was (or would be) produced under weights other than the caller expects."""


@dataclass
class SamplingSettings:
    """Distribution the policy samples from; part of both verification and resampling."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Eval needs no log-probs: then any temperature (0 = greedy) is fine on any engine.
    need_logprobs: bool = True


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int | None = None
    # Token that must not be produced at the *first* generated position only: the exact rule's
    # resample at a rejection on engines without replacements in `score` (SGLang; exact there only
    # at temperature 1 without top-k / top-p). The vLLM engine refuses it.
    ban_first_token: int | None = None
    # Tree drafting (rollout.draft=tree): the tree this request drafts from and feeds (the prompt
    # id: all samples of a prompt share one), and where in prompt_ids the response starts (an
    # extension's prompt ends with the accepted part of its draft, which is part of the response).
    # Required with draft_key or coupled_seed (0 would take the whole prompt for response: its
    # tokens would enter the tree, the noise positions would count from the prompt's start).
    draft_key: str | None = None
    response_start: int | None = None
    # Coupled sampling (rollout.spec_mode=coupled): the token at response position t (counted from
    # response_start) is drawn with noise that depends only on (coupled_seed, t), so an extension
    # that starts inside the response draws what a generation from the prompt would
    # (megatron_specrl.rollout.coupled). Engines with `samples_coupled` only; `seed` is then unused.
    coupled_seed: int | None = None
    # Run-ahead (rollout.runahead, with tree drafting): a request for a *later* step's prompt that
    # the engine starts only in the tail of this batch, when few other requests still run, and
    # aborts when they have all finished. Its tokens only feed that prompt's draft tree; its result
    # (finish_reason "abort", the tokens it got) is never training data. Engines without tree
    # drafting refuse it.
    runahead: bool = False
    # Exact verification in the decode loop (rollout.verify=decode, with tree drafting): this
    # sample's last-epoch response, which the engine drafts first for as long as the response
    # follows it; its rejection sampler accepts each drafted token y with p(y) and otherwise samples
    # p without y, the `exact` rule. Engines without tree drafting refuse it.
    own_draft: list[int] | None = None

    def __post_init__(self):
        if self.response_start is None:
            if self.draft_key is not None or self.coupled_seed is not None:
                raise ValueError("GenerateRequest: draft_key and coupled_seed need response_start, where the "
                                 "response begins in prompt_ids (len(prompt_ids) for a fresh response)")
            self.response_start = 0
        if not 0 <= self.response_start <= len(self.prompt_ids):
            raise ValueError(f"GenerateRequest: response_start={self.response_start} is outside the "
                             f"{len(self.prompt_ids)}-token prompt_ids")


@dataclass
class GenerateResult:
    token_ids: list[int]
    logprobs: list[float]          # processed log-prob of each generated token under the serving weights
    finish_reason: str             # "stop" (EOS / stop token), "length", or "abort" (run-ahead)
    num_cached_tokens: int = 0     # prompt tokens served from the prefix cache
    weight_version: int = -1


@dataclass
class ScoreRequest:
    prompt_ids: list[int]
    continuation_ids: list[int]
    seed: int | None = None        # seeds the replacement draws (same seed, same replacements)
    # Coupled verification: `replacements` hold the coupled draw c_t at every position instead
    # (equal to y_t where the draft survives; -1 only at a non-finite row, which the extension samples); the noise of continuation token t is that
    # of response position t of a GenerateRequest with the same coupled_seed.
    coupled_seed: int | None = None
    # The prompt id, as GenerateRequest.draft_key: a router sends the verification to the engine
    # that gets the prompt's generation requests, whose prefix cache it warms.
    draft_key: str | None = None


@dataclass
class ScoreResult:
    """Per continuation token y_t, under the serving weights and the request's sampling settings.
    Engines without processed verification (`verifies_processed_distribution` false) fill only
    `logprobs`, and only at temperature 1 without top-k / top-p, where both conventions agree."""

    logprobs: list[float]          # tempered log-prob of y_t (the learner's convention)
    weight_version: int = -1
    sample_logprobs: list[float] | None = None        # processed log-prob of y_t (acceptance)
    # r_t: drawn from the processed distribution with y_t excluded and renormalised; -1 where that
    # distribution is empty (the nucleus is {y_t}). Its tempered and processed (y_t not excluded)
    # log-probs, and whether it ends a response (EOS / stop token of the engine).
    replacements: list[int] | None = None
    replacement_logprobs: list[float] | None = None
    replacement_sample_logprobs: list[float] | None = None
    replacement_stops: list[bool] | None = None
    # prompt tokens read from the prefix cache (not part of the result: equal results may differ here)
    num_cached_tokens: int = field(default=0, compare=False)

    @property
    def acceptance_logprobs(self) -> list[float]:
        """What acceptance reads: the processed log-probs (the tempered ones where the engine
        reports no others, which is only allowed where they agree)."""
        return self.logprobs if self.sample_logprobs is None else self.sample_logprobs


@dataclass
class DraftResponse:
    """A whole response the rollout took without the engine generating it (rollout.verify=prefill: a
    draft accepted whole, or ended by the verification's replacement), for the engine's draft trees
    (rollout.draft=tree). Engines that draft from trees take them with
    `add_to_draft_trees(responses: list[DraftResponse]) -> None`: each enters its prompt's tree and the
    shared tree once, as a response the engine generated for a request with this draft_key would (the
    engine's counters of generated and drafted tokens are left alone: it generated none of them). A
    method of the DraftsFromTrees capability: an engine of that class built without tree drafting
    ignores the call, and the rollout sends none to engines without it; a router sends each response
    to the engine that gets its prompt's requests."""

    draft_key: str
    token_ids: list[int]


def draft_response_pairs(responses: list[DraftResponse]) -> list[tuple[str, list[int]]]:
    """(prompt id, token ids) pairs of plain types, as the engines' drafters take them."""
    return [(str(r.draft_key), [int(t) for t in r.token_ids]) for r in responses]


@dataclass
class EngineHealth:
    alive: bool
    weight_version: int
    detail: dict = field(default_factory=dict)


# -- what each engine (rollout.engine) can do: one table -------------------------------------------
@dataclass(frozen=True)
class EngineKind:
    """What one engine of rollout.engine can do. ENGINE_KINDS is the one table of it: the config's
    cross-checks refuse a run's settings from it (before Ray starts), an engine class declares its row
    (EngineCapabilities' `kind`) and so sets the flags the rollout reads, and the engines' own guards name
    the engines that can from it; adding an engine or a capability is an entry here."""

    label: str                                      # the engine's name in messages
    # score() verifies under the sampler's processed distribution (any temperature, top-k, top-p) and
    # returns replacements for the exact rule; False: temperature 1 without top-k / top-p only
    verifies_processed_distribution: bool
    # generate() and score() honour coupled_seed (position-keyed noise, rollout.spec_mode=coupled)
    samples_coupled: bool
    drafts: tuple[str, ...]                         # the rollout.draft values it builds with
    runs_ahead: bool                                # run-ahead requests (rollout.runahead, with tree drafting)
    runs_fresh_prompts_undrafted: bool              # rollout.drafter.fresh_prompts=false
    cpu_drafts: tuple[str, ...] = ("none",)          # the rollout.draft values it builds with on a CPU
    # why it lacks a capability, by the capability's field name, where messages say why
    lacks: dict[str, str] = field(default_factory=dict)

    def why_not(self, capability: str) -> str:
        return self.lacks.get(capability, f"{self.label} has no {capability}")


ENGINE_KINDS: dict[str, EngineKind] = {
    "vllm": EngineKind("vLLM", verifies_processed_distribution=True, samples_coupled=True,
                       drafts=("none", "tree", "model"), runs_ahead=True, runs_fresh_prompts_undrafted=True,
                       cpu_drafts=("none", "tree", "model")),
    "sglang": EngineKind("SGLang", verifies_processed_distribution=False, samples_coupled=False,
                         drafts=("none", "tree"), runs_ahead=False, runs_fresh_prompts_undrafted=False,
                         lacks={"verifies_processed_distribution": "SGLang scores drafts with untempered, "
                                                                   "untruncated log-probs",
                                "runs_fresh_prompts_undrafted": "SGLang drafts every prompt",
                                "runs_ahead": "SGLang drafts from the trees without them",
                                "cpu_drafts": "SGLang's NGRAM verification has no CPU kernels and verifies "
                                              "greedily on CPU"}),
}


def engines_with(capability: str | Callable[[EngineKind], bool]) -> list[str]:
    """The rollout.engine values whose engines have `capability`: an EngineKind flag's name, or a test."""
    has = capability if callable(capability) else (lambda kind: getattr(kind, capability))
    return [name for name, kind in ENGINE_KINDS.items() if has(kind)]


def labels_with(capability: str | Callable[[EngineKind], bool]) -> str:
    """The engines that have `capability`, as messages name them ("vLLM")."""
    return " or ".join(ENGINE_KINDS[name].label for name in engines_with(capability))


def settings_with(capability: str | Callable[[EngineKind], bool]) -> str:
    """The rollout.engine settings that have `capability`, as messages suggest them ("rollout.engine=vllm")."""
    return " or ".join(f"rollout.engine={name}" for name in engines_with(capability))


def one_of(values) -> str:
    """'a', 'b' or 'c'."""
    quoted = [repr(v) for v in values]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


# -- capabilities: declared by an engine's class (its bases), never probed ------------------------
# Callers test them with isinstance (or the flag helpers below); an engine that does not declare one
# lacks it, whatever methods it happens to have.
class EngineCapabilities:
    """Flags of what `score` / `generate` honour, as class attributes (an instance may set its own).
    An engine that does not derive from this class has neither. An engine of rollout.engine declares
    its row of ENGINE_KINDS, `class VLLMEngine(EngineCapabilities, kind="vllm")`, which sets the flags
    and `engine_kind`; fakes in tests set the flags themselves."""

    verifies_processed_distribution: bool = False   # EngineKind's flags of the same names say what they mean
    samples_coupled: bool = False
    engine_kind: EngineKind | None = None

    def __init_subclass__(cls, kind: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if kind is not None:
            cls.engine_kind = ENGINE_KINDS[kind]
            cls.verifies_processed_distribution = cls.engine_kind.verifies_processed_distribution
            cls.samples_coupled = cls.engine_kind.samples_coupled


class DraftsFromTrees(ABC):
    """Capability: the engine drafts from per-prompt draft trees (rollout.draft=tree). An engine of
    such a class built without trees answers with nothing: {} / None / a no-op (load_draft_state
    raises, a checkpoint's trees cannot be loaded into it)."""

    @property
    def tree_drafting(self) -> bool:
        """Whether this engine was built with tree drafting (rollout.draft=tree): it takes run-ahead
        requests and own drafts (rollout.verify=decode). A class that always drafts from trees keeps
        this default."""
        return True

    @abstractmethod
    def draft_stats(self) -> dict[str, float]:
        """Counters since the last call (speculative.tree_metrics reads them); {} without drafting."""

    @abstractmethod
    def draft_state(self) -> dict | None:
        """The trees, for checkpoints (rollout.tree_drafting.trees.DraftTrees.state_dict); None without trees."""

    @abstractmethod
    def load_draft_state(self, state: dict) -> None:
        """Load what draft_state returned."""

    @abstractmethod
    def add_to_draft_trees(self, responses: list[DraftResponse]) -> None:
        """Responses the rollout took without generating them (DraftResponse)."""


class SleepsWhileTraining(ABC):
    """Capability: colocated on GPUs, the engine hands its memory to the learner for a train step
    (resync.lifecycle.release_engine_memory) and takes it back around the next weight load."""

    @abstractmethod
    def release_memory(self) -> None: ...

    @abstractmethod
    def resume_memory(self, tags: list[str] | None = None) -> None:
        """tags=["weights"] before loading new weights, then ["kv_cache"]."""


class RunsInWorkers(ABC):
    """Capability: fn(worker, **kwargs) in each of the engine's workers, one result per worker
    (diagnostics read the loaded weights back this way)."""

    @abstractmethod
    def run_in_workers(self, fn, kwargs: dict | None = None) -> list: ...


class InActor(ABC):
    """Capability: the engine runs in a Ray actor (engines.ray_engine.RayEngine): calls can be started
    without waiting (`submit`) and waited on later (`wait`), functions run inside the actor
    (`submit_actor`), and the process can be killed and restarted."""

    actor: Any       # the Ray actor handle; None while it is not running
    pid: int | None  # the actor's process, once started

    @abstractmethod
    def submit(self, method: str, *args) -> Any:
        """Start an engine method in the actor; returns the Ray ref."""

    @abstractmethod
    def wait(self, ref, what: str, expected_version: int | None = None, deadline: float | None = None) -> Any:
        """The result of a submitted call, the actor's failures turned into EngineError."""

    @abstractmethod
    def submit_actor(self, method: str, *args) -> Any:
        """Start an EngineActor method (or Ray's `__ray_call__`) without waiting."""

    @abstractmethod
    def restart(self) -> None: ...

    @abstractmethod
    def wait_started(self) -> None:
        """Wait until a launched engine has built (an in-process engine has when its constructor returns)."""


class RoutesToEngines(ABC):
    """Capability: the engine spreads its work over `engines` (engines.router.EngineRouter)."""

    engines: list


def engines_behind(engine) -> list:
    """The engines a router spreads over, or the engine itself."""
    return list(engine.engines) if isinstance(engine, RoutesToEngines) else [engine]


@runtime_checkable
class RolloutEngine(Protocol):
    name: str

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: list[GenerateRequest], sampling: SamplingSettings,
                 weight_version: int) -> list[GenerateResult]: ...

    def score(self, requests: list[ScoreRequest], sampling: SamplingSettings,
              weight_version: int) -> list[ScoreResult]:
        """Log-probs of given continuations in one prefill; leaves the prefix cache warm.
        An engine whose class sets `verifies_processed_distribution = True` fills every field of
        ScoreResult for any temperature > 0, top-k and top-p; others refuse settings other than
        temperature 1 without truncation (NotImplementedError). A continuation that reaches the
        engine's last position is verified up to the token before it (the result is that much
        shorter): the prefill samples one token past the continuation, and an engine already at the
        model's max_position_embeddings has no position for it."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load (a bucket of) HF-named full tensors. Does not bump the version by itself
        unless `finish_update` is called; see resync.lifecycle."""
        ...

    def finish_update(self, version: int) -> None:
        """Bump weight_version and reset the prefix cache (nothing served in between)."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def health(self) -> EngineHealth: ...

    def shutdown(self) -> None: ...


def untruncated_t1(s: SamplingSettings) -> bool:
    """Temperature 1, no top-k, no top-p: processed, tempered and raw log-probs all agree."""
    return s.temperature == 1.0 and s.top_p >= 1.0 and s.top_k in (-1, 0)


def fit_to_positions(requests: list[ScoreRequest], room: int) -> list[ScoreRequest]:
    """RolloutEngine.score's rule for a continuation that reaches the engine's last position: verified up to
    the token before it. `room`: the most prompt + continuation tokens the engine verifies (its context
    length less the one token the prefill samples past the continuation)."""
    return [r if len(r.prompt_ids) + len(r.continuation_ids) <= room else
            replace(r, continuation_ids=list(r.continuation_ids[:max(0, room - len(r.prompt_ids))]))
            for r in requests]


def _declares(engine) -> bool:
    """Whether `engine` (an engine, or an engine class) derives from EngineCapabilities."""
    return issubclass(engine if isinstance(engine, type) else type(engine), EngineCapabilities)


def verifies_processed_distribution(engine) -> bool:
    """Whether `engine.score` verifies under any temperature / top-k / top-p (and returns
    replacements). Declared on EngineCapabilities; wrappers (Ray, router) forward it."""
    return _declares(engine) and bool(engine.verifies_processed_distribution)


def samples_coupled(engine) -> bool:
    """Whether the engine honours GenerateRequest.coupled_seed and ScoreRequest.coupled_seed
    (position-keyed noise). Declared on EngineCapabilities; wrappers (Ray, router) forward it."""
    return _declares(engine) and bool(engine.samples_coupled)


def check_count(engine_name: str, what: str, results: list, expected: int) -> None:
    """One result per request, in order: anything else is the engine's failure, named here."""
    if len(results) != expected:
        raise EngineError(f"{what}: {len(results)} results for {expected} requests", engine_name)


def check_version(engine_name: str, serving: int, expected: int) -> None:
    if serving != expected:
        raise WeightVersionMismatch(
            f"engine {engine_name} serves weight version {serving}, caller expects {expected}")

