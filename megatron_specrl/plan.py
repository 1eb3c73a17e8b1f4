"""The plan check: everything about a run that can be known before it queues, checked in one place.

`train --dry-run`, `launch` (before it writes a script) and `convert` (before it spawns ranks) all
call `check_plan`: a layout that cannot run on the allocation, a model its parallel sizes do not
divide, a missing model config or data file, or a learner that does not fit in GPU memory would
otherwise fail only after hours in a Slurm queue. Every failure is one line naming the key, its value
and the reason; success is a table of the plan (layout, batch arithmetic, memory per GPU).

Memory model (bytes per GPU, the heaviest rank):
  learner  learner.precision=float32: weights, gradients and AdamW's two moments are fp32 (no
           separate master copy), so 4 + 4 + 8 bytes a parameter, the moments divided by learner.dp
           with the distributed optimizer. bfloat16 (Megatron's mixed precision, distributed optimizer
           required): bf16 weights (2), fp32 main_grad (4), fp32 master weights + two moments (12 / dp),
           activations in bf16 (2 bytes an element; the logits stay fp32) and, on GPUs, flash
           attention. Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
           Large Transformer Models", arXiv 2205.05198), counted per tensor saved for backward (no
           sequence parallelism, no dropout masks), in the learner's precision: none stores every
           layer's tensors with the s^2 attention probabilities unless flash attention keeps none (the
           fp32 learner gets no flash attention on GPUs: TransformerEngine's flash and fused backends
           take fp16 / bf16 only, so it runs the unfused one), selective the same without them, full stores each
           layer's input plus one layer's tensors; the
           bf16 on the local spec (no flash) also keeps the RMSNorms' tensors and the attention's
           softmax in fp32 (fp32_extra_bytes_per_token_layer). The
           first pipeline stage holds min(pp, microbatches) microbatches in flight (1F1B), and the last
           stage holds the fp32 logits and their log-softmax. PPO's critic (the same layout, a value
           head for the LM head) and the frozen KL reference (weights in the learner's precision) share
           the policy ranks' GPUs (actors.learner_bundles) and stay resident. The optimizer step
           runs after backward has freed the activations, so the peak is the static memory plus the
           larger of the activations and the step's temporaries: torch's AdamW (the replicated
           optimizer, and Megatron's distributed one without TransformerEngine or apex) takes the
           foreach path on GPUs, whose sqrt of the second moments is one fp32 copy of every parameter
           it updates (on an H200 a 0.5B bf16 learner with full recompute peaked 2.0 GiB above its
           static memory in the step, 1.9 GiB of it that copy); TE's FusedAdam updates in place.
           A mixture-of-experts learner (Qwen3-MoE, every layer an MoE layer) holds num_experts / ep
           experts a rank, each split over TP (Megatron's expert TP defaults to TP), beside the
           TP-split attention and the replicated router; the distributed optimizer shards the dense
           parameters' states over dp and the experts' over the expert-data-parallel group, dp / ep
           ranks (Megatron's expert_data_parallel_size = world / (expert TP x ep x pp)). The experts'
           activations assume balanced routing: each token's top-k copies, wherever they are computed.
  scoring  the reference's log-probs, PPO's critic values and (use_kl_in_reward with
           recompute_old_logprobs) the policy's are forward passes over the batch before colocated
           engines release their memory (trainer.train_step): the static memory plus one microbatch's
           forward (one layer's tensors, and on the last stage the fp32 logits, their shifted copy and
           its exp, one more each for a temperature and a padded vocabulary) beside vLLM's share.
  engine   weights in rollout.engine_dtype over engine_tp GPUs; vLLM reserves
           rollout.gpu_memory_utilization of the GPU and fills what the weights leave with KV cache.
           The KV the step's batch would need at full length (prompt + response) is reported with the
           number of sequences that fit at once; a cache that cannot hold one max_model_len sequence
           fails, as vLLM would at start-up. Colocated, the learner's weights, grads and optimizer
           stay resident while the engine runs, so both must fit together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from megatron_specrl.config import ConfigError, RunConfig
from megatron_specrl.errors import quote_exception
from megatron_specrl.models.families.shape import CLI_KEYS, ModelShape, layout_failures

GB = 1024 ** 3    # GiB: every memory figure of the plan, cluster.gpu_memory_gb included
FP32 = 4
ENGINE_BYTES = {"float32": 4, "bfloat16": 2}


class PlanError(ConfigError):
    """The plan cannot run; `failures` holds one line per reason (key, value, why)."""

    def __init__(self, failures: list[str]):
        self.failures = list(failures)
        super().__init__("; ".join(self.failures))


# --------------------------------------------------------------------------- the model's config

def load_hf_config(model_path: str):
    """AutoConfig of `model.path`: the tiny models' config without building them, else the local
    directory's config.json (never a hub download: a cluster job must not depend on one)."""
    from transformers import AutoConfig

    from megatron_specrl.models.resolve import TINY
    if model_path in TINY:
        from megatron_specrl.models.families import family_named
        from megatron_specrl.models.tiny import DEFAULT_NUM_LAYERS
        family = family_named(TINY[model_path])
        return AutoConfig.for_model(family.model_type, vocab_size=TINY_VOCAB, num_hidden_layers=DEFAULT_NUM_LAYERS,
                                    max_position_embeddings=512, **family.tiny_config)
    config_json = Path(model_path) / "config.json"
    if not config_json.is_file():
        raise PlanError([f"model.path={model_path!r}: no config.json there (a local HF checkpoint directory, "
                         f"or one of {sorted(TINY)})"])
    try:
        return AutoConfig.from_pretrained(str(Path(model_path)), local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError / KeyError for bad files
        raise PlanError([f"model.path={model_path!r}: config.json is not a readable HF config "
                         f"({quote_exception(e)})"]) from None


TINY_VOCAB = 264   # models/tiny.py's tokenizer size


# --------------------------------------------------------------------------- parameter counts

def dense_layer_parameters(s: ModelShape, tp: int) -> int:
    """One layer's parameters outside its experts on one TP rank (Megatron's GPT layer): attention (and a
    dense model's MLP) split over TP; the two layer norms, Qwen3's per-head q / k norms and an MoE
    layer's router (num_experts x hidden, the same on every TP and EP rank) replicated."""
    qkv_out = (s.heads + 2 * s.kv_heads) * s.head_dim
    sharded = s.hidden * qkv_out + s.heads * s.head_dim * s.hidden
    if not s.moe:
        sharded += 3 * s.hidden * s.ffn
    if s.qkv_bias:
        sharded += qkv_out
    replicated = 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0) + s.experts * s.hidden
    return sharded // tp + replicated


def expert_layer_parameters(s: ModelShape, tp: int, ep: int = 1) -> int:
    """One MoE layer's expert parameters on one rank: num_experts / ep experts, each a SwiGLU MLP (gate,
    up, down of moe_intermediate_size) split over the expert TP size, Megatron's default: TP."""
    return s.experts // ep * 3 * s.hidden * s.expert_ffn // tp


def layer_parameters(s: ModelShape, tp: int, ep: int = 1) -> int:
    """One transformer layer's parameters on one TP (and EP) rank."""
    return dense_layer_parameters(s, tp) + expert_layer_parameters(s, tp, ep)


def stage_parameters(s: ModelShape, tp: int, pp: int, stage: int, padded_vocab: int, role: str = "policy",
                     ep: int = 1) -> int:
    """Parameters of one rank of pipeline stage `stage` (Megatron GPTModel with this project's options).
    A tied embedding is one tensor at pp=1; at pp>1 the last stage keeps its own copy of it."""
    n = (s.layers // pp) * layer_parameters(s, tp, ep)
    first, last = stage == 0, stage == pp - 1
    if first:
        n += padded_vocab * s.hidden // tp
    if last:
        n += s.hidden                                    # final norm
        if role == "critic":
            n += s.hidden                                # value head, replicated
        elif not s.tied or pp > 1:
            n += padded_vocab * s.hidden // tp
    return n


def stage_expert_parameters(s: ModelShape, tp: int, pp: int, ep: int = 1) -> int:
    """The expert parameters among stage_parameters (the same on every stage): their optimizer states
    shard over the expert-data-parallel group, not over dp."""
    return (s.layers // pp) * expert_layer_parameters(s, tp, ep)


def full_parameters(s: ModelShape, active: bool = False) -> int:
    """The HF model's parameter count (unpadded vocab): what an engine holds. `active`: the parameters
    one token passes through, its num_experts_per_tok experts of each MoE layer instead of all."""
    n = s.layers * layer_parameters(s, 1) + s.vocab * s.hidden + s.hidden
    if active and s.moe:
        n -= s.layers * (s.experts - s.topk) * 3 * s.hidden * s.expert_ffn
    return n if s.tied else n + s.vocab * s.hidden


# --------------------------------------------------------------------------- memory

@dataclass
class LearnerMemory:
    params: int                     # parameters on the heaviest rank
    weights: int
    grads: int
    optimizer: int
    activations: int
    tokens_per_microbatch: int
    microbatches_in_flight: int
    # on the same GPUs (actors.learner_bundles): PPO's critic (weights, grads, optimizer, value head
    # for the LM head) and the frozen KL reference (weights only); each trains or scores in turn, so
    # the activations are the policy's
    critic: int = 0
    reference: int = 0
    # a forward-only pass over one microbatch (reference / critic / policy scoring; no saved tensors)
    scoring: int = 0
    # transient bytes of the optimizer step (optimizer_step_bytes), after backward freed the activations
    optimizer_step: int = 0
    # the expert parameters among `params` (an MoE model: num_experts / ep experts, split over TP)
    expert_params: int = 0

    @property
    def static(self) -> int:
        return self.weights + self.grads + self.optimizer + self.critic + self.reference

    @property
    def total(self) -> int:
        return self.static + max(self.activations, self.optimizer_step)


def activation_elements_per_token_layer(s: ModelShape, tp: int, seq_len: int, flash: bool) -> int:
    """Elements one layer saves for backward per token, counted on Megatron's local (unfused) layer spec
    with saved-tensor hooks (tests/unit/test_plan.py): the two norms' inputs and outputs; q after RoPE, q, k
    and v expanded to all heads for the batched matmuls (GQA included), the context and the projection
    input; SwiGLU's fc1 output (gate and up) and three ffn-wide intermediates; the attention scores (s
    per head) unless flash attention keeps none. Qwen3's q / k norms add their inputs and outputs. An
    MoE layer (balanced routing) keeps each token's top-k copies: the permuted input and the expert
    output (hidden each) and the expert SwiGLU's five tensors, plus the router's logits and scores.
    TransformerEngine's fused layers save less, so on GPUs this errs high."""
    n = 4 * s.hidden                                  # norm inputs and outputs
    n += 7 * s.heads * s.head_dim // tp               # q (roped), q/k/v for bmm, context, proj input, ...
    if s.qk_norm:
        n += 2 * (s.heads + s.kv_heads) * s.head_dim // tp   # q / k norm inputs and outputs
    if s.moe:
        n += s.topk * (5 * s.expert_ffn // tp + 2 * s.hidden) + 2 * s.experts
    else:
        n += 5 * s.ffn // tp                          # fc1 output (2 ffn) + 3 ffn-wide SwiGLU tensors
    if not flash:
        n += s.heads * seq_len // tp                  # softmax probabilities
    return n


def fp32_extra_bytes_per_token_layer(s: ModelShape, tp: int, seq_len: int, attention_probs: bool) -> int:
    """What a bf16 learner on Megatron's local spec keeps in fp32 beyond `activation_elements_per_token_layer`
    x 2 bytes, per token and layer: the RMSNorms compute in fp32 and save their four tensors in fp32 (2
    more bytes each), and the unfused attention (attention_softmax_in_fp32) saves the fp32 softmax
    probabilities beside their bf16 copy (4 more bytes a score) unless recompute drops them. Counted with
    saved-tensor hooks (tests/unit/test_plan.py); on an H200 (2026-11-28) a 0.5B bf16 learner's
    training peak was 13% above the estimate without this term and 3% with it. TransformerEngine's
    fused norms and flash attention (the GPU path the plan assumes for bf16) save neither."""
    extra = 4 * s.hidden * 2
    if s.qk_norm:
        extra += 2 * (s.heads + s.kv_heads) * s.head_dim // tp * 2
    if attention_probs:
        extra += s.heads * seq_len // tp * 4
    return extra


def learner_bytes(cfg: RunConfig) -> tuple[int, int, int, int]:
    """(weight, gradient, optimizer-state, activation) bytes per parameter / element of the learner:
    fp32 (4, 4, 8: AdamW's moments, 4), or bf16 mixed precision (2, 4: Megatron DDP's fp32 main_grad,
    12: the distributed optimizer's fp32 master weights and moments, 2)."""
    if cfg.learner.precision == "bfloat16":
        return 2, FP32, 3 * FP32, 2
    return FP32, FP32, 2 * FP32, FP32


def flash_attention(cfg: RunConfig) -> bool:
    """Whether the learner's attention keeps no s^2 probabilities: TransformerEngine's flash / fused
    backends, on GPUs, for fp16 / bf16 only (the fp32 learner runs the unfused one)."""
    return cfg.learner.precision == "bfloat16" and cfg.cluster.gpus_per_node > 0


def adam_kind(cfg: RunConfig) -> str:
    """Which Adam the learner steps with, as far as its memory goes: `fused` (Megatron's distributed
    optimizer takes TransformerEngine's or apex's FusedAdam, which the GPU plan assumes installed, as it
    assumes TE's flash attention), `foreach` (torch's AdamW on GPUs: the replicated optimizer in
    learner/worker.py always), `per_tensor` (torch's AdamW on CPU parameters, a loop over tensors)."""
    if cfg.cluster.gpus_per_node == 0:
        return "per_tensor"
    return "fused" if cfg.learner.distributed_optimizer else "foreach"


def optimizer_step_bytes(s: ModelShape, tp: int, padded_vocab: int, params: int, kind: str) -> int:
    """Temporaries of one AdamW step: torch's foreach path allocates sqrt(exp_avg_sq) for all the
    parameters it updates at once (fp32; the rest of its update is in place), the per-tensor path one
    tensor's worth (the largest: the vocabulary shard of the embedding or head, or fc1, an expert's on
    the local experts), FusedAdam none. `params` is the optimizer's local parameter count (a DP shard
    with the distributed optimizer)."""
    if kind == "fused":
        return 0
    if kind == "foreach":
        return params * FP32
    if kind == "per_tensor":
        return FP32 * s.hidden * max(padded_vocab // tp, 2 * s.mlp_width[1] // tp, s.experts)
    raise ValueError(f"unknown Adam kind {kind!r}")


def learner_memory(cfg: RunConfig, s: ModelShape, padded_vocab: int, flash: bool,
                   adam: str | None = None) -> LearnerMemory:
    """The learner's bytes on its heaviest rank; `adam` overrides adam_kind(cfg) (a GPU without TE)."""
    le = cfg.learner
    w_bytes, g_bytes, o_bytes, a_bytes = learner_bytes(cfg)
    params = max(stage_parameters(s, le.tp, le.pp, st, padded_vocab, ep=le.ep) for st in range(le.pp))
    experts = stage_expert_parameters(s, le.tp, le.pp, le.ep)
    seq = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    rows = batch_arithmetic(cfg)["rows_per_dp_minibatch"]
    tokens = le.max_tokens_per_microbatch or min(le.micro_batch_size, rows) * seq
    in_flight = min(le.pp, batch_arithmetic(cfg)["microbatches"])
    layers = s.layers // le.pp
    per_layer = activation_elements_per_token_layer(s, le.tp, seq, flash) * tokens * a_bytes
    probs = not flash
    if le.recompute == "selective" and not flash:   # flash attention already stores no scores
        per_layer = activation_elements_per_token_layer(s, le.tp, seq, flash=True) * tokens * a_bytes
        probs = False
    if le.precision == "bfloat16" and not flash:    # Megatron's local spec: fp32 norms and softmax
        per_layer += fp32_extra_bytes_per_token_layer(s, le.tp, seq, probs) * tokens

    def stage(microbatches: int) -> int:
        if le.recompute == "full":      # each layer's input kept, one layer rebuilt at a time
            return microbatches * layers * s.hidden * tokens * a_bytes + per_layer
        return microbatches * layers * per_layer

    logits = 2 * tokens * (padded_vocab // le.tp) * FP32           # logits + log-softmax, last stage
    acts = stage(in_flight) + logits if le.pp == 1 else max(stage(in_flight), stage(1) + logits)
    def local(n: int, bytes_each: int = 1) -> int:
        """What one rank's Adam keeps of `n` parameters (bytes_each a parameter): the distributed optimizer
        shards the dense ones over dp and the experts over the expert-data-parallel group (dp / ep)."""
        if not le.distributed_optimizer:
            return n * bytes_each
        return math.ceil((n - experts) * bytes_each / le.dp) + math.ceil(experts * bytes_each / (le.dp // le.ep))

    critic = 0
    if cfg.algorithm.name == "ppo":
        n = max(stage_parameters(s, le.tp, le.pp, st, padded_vocab, role="critic", ep=le.ep) for st in range(le.pp))
        critic = n * (w_bytes + g_bytes) + local(n, o_bytes)
    reference = params * w_bytes if cfg.needs_reference else 0
    step = optimizer_step_bytes(s, le.tp, padded_vocab, local(params), adam or adam_kind(cfg))
    return LearnerMemory(params, params * w_bytes, params * g_bytes, local(params, o_bytes), acts, tokens, in_flight,
                         critic, reference, scoring_memory(cfg, s, padded_vocab, tokens, flash), step,
                         expert_params=experts)


def scoring_memory(cfg: RunConfig, s: ModelShape, padded_vocab: int, tokens: int, flash: bool) -> int:
    """Bytes of one microbatch's forward-only scoring pass (learner/worker._score under no_grad): one
    layer's tensors, and where a policy / reference scores log-probs the last stage's fp32 logits, their
    shifted copy and its exp (learner/logprobs.py), plus the tempered and the padding-masked copies
    where they are made. PPO's critic ends in a value head (no vocab-wide tensor)."""
    le = cfg.learner
    layer = activation_elements_per_token_layer(s, le.tp, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens,
                                                flash) * tokens * learner_bytes(cfg)[3]
    if not cfg.needs_reference:
        return layer
    copies = 3 + (cfg.rollout.temperature != 1.0) + (padded_vocab > s.vocab)
    return layer + copies * tokens * (padded_vocab // le.tp) * FP32


@dataclass
class EngineMemory:
    weights: int
    budget: int                # what vLLM reserves: gpu_memory_utilization x GPU memory
    kv_per_token: int
    kv_batch: int              # the KV the step's batch per engine needs at full length
    sequences_per_engine: int
    concurrent_sequences: int  # full-length sequences the cache holds at once
    max_model_len: int         # the engine's; vLLM refuses to start unless one such sequence fits

    @property
    def kv_space(self) -> int:
        return self.budget - self.weights


def engine_memory(cfg: RunConfig, s: ModelShape, gpu_bytes: int, draft: ModelShape | None = None) -> EngineMemory:
    """`draft`: rollout.draft=model's draft model, which vLLM holds beside the policy in every engine,
    its weights split as the policy's (draft TP = engine TP) and its layers' KV in the same cache."""
    r = cfg.rollout
    dtype = ENGINE_BYTES[r.engine_dtype]
    weights = sum(full_parameters(m) for m in (s, draft) if m is not None) * dtype // r.engine_tp
    kv_per_token = sum(2 * m.layers * max(1, m.kv_heads // r.engine_tp) * m.head_dim * dtype
                       for m in (s, draft) if m is not None)
    seqs = math.ceil(cfg.trainer.gen_prompts_per_step * r.n_samples / r.num_engines)   # a rollout round's
    seq = cfg.data.max_prompt_len + r.max_new_tokens
    budget = int(r.gpu_memory_utilization * gpu_bytes)
    space = budget - weights
    concurrent = max(0, space // (seq * kv_per_token))
    return EngineMemory(weights, budget, kv_per_token, seqs * seq * kv_per_token, seqs, int(concurrent),
                        engine_max_model_len(cfg, s))


def draft_model_shape(cfg: RunConfig, s: ModelShape) -> tuple[ModelShape | None, list[str]]:
    """rollout.draft=model's draft model shape (None otherwise) and what is wrong with it: no readable
    config, or a vocabulary that is not the policy's (vLLM verifies draft tokens by id)."""
    r = cfg.rollout
    if r.draft != "model":
        return None, []
    try:
        draft = ModelShape.from_hf(load_hf_config(r.draft_model))
    except PlanError as e:
        return None, [line.replace("model.path=", "rollout.draft_model=", 1) for line in e.failures]
    if draft.vocab != s.vocab:
        return draft, [f"rollout.draft_model={r.draft_model!r}: vocab_size {draft.vocab} is not the policy's {s.vocab}; "
                       "the draft model must share the policy's tokenizer"]
    return draft, []


def engine_max_model_len(cfg: RunConfig, s: ModelShape) -> int:
    """The max_model_len the engine is started with: vLLM must hold one such sequence in its KV cache
    or it refuses to start. A vLLM engine gets room beyond rollout.max_model_len: one step's drafts
    when it drafts, else the one token a verification prefill of a full-length response samples
    (engines/vllm/args.drafting_max_model_len)."""
    r = cfg.rollout
    if r.engine != "vllm":
        return r.max_model_len
    from megatron_specrl.engines.vllm.args import drafting_max_model_len
    return drafting_max_model_len(r.max_model_len, r.drafter.tokens if r.draft != "none" else 0,
                                  s.max_positions)


# --------------------------------------------------------------------------- arithmetic

def batch_arithmetic(cfg: RunConfig) -> dict[str, int]:
    le = cfg.learner
    rows = cfg.trainer.prompts_per_step * cfg.rollout.n_samples
    per_dp = rows // (le.dp * le.mini_batches)
    if le.max_tokens_per_microbatch:   # dynamic batching: at full length, as many as the tokens need
        seq = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
        microbatches = math.ceil(per_dp * seq / le.max_tokens_per_microbatch)
    else:
        microbatches = math.ceil(per_dp / le.micro_batch_size)
    return {"rows": rows, "rows_per_dp_minibatch": per_dp, "microbatches": max(1, microbatches),
            "optimizer_steps": le.ppo_epochs * le.mini_batches}


def gpus_needed(cfg: RunConfig) -> tuple[int, int]:
    """(learner GPUs, engine GPUs not shared with the learner)."""
    r = cfg.rollout
    return cfg.world_size, 0 if r.colocate else r.num_engines * r.engine_tp


# --------------------------------------------------------------------------- checks

def model_fit_failures(cfg: RunConfig, s: ModelShape) -> list[str]:
    """The model against the run: its shape against the layout (the one rule, shape.layout_failures, with
    the run's keys) and the engines' context against its positions. The plan check's lines, and the run's
    own start-up check (check_model_fits) repeats them on the model it resolved."""
    le, r = cfg.learner, cfg.rollout
    out = layout_failures(s, where=f"model.path={cfg.model.path!r}", tp=le.tp, pp=le.pp, ep=le.ep,
                          engine_tp=r.engine_tp)
    if r.max_model_len > s.max_positions:
        out.append(f"rollout.max_model_len={r.max_model_len} exceeds the model's max_position_embeddings="
                   f"{s.max_positions}")
    return out


def check_model_fits(cfg: RunConfig, model_dir: str | Path) -> None:
    """The run's start-up check (run/build.prepare_model), on the directory model.path resolved to:
    model_fit_failures, so a run started without the CLI (`train(cfg)` from Python, which skips the plan)
    fails in the plan's lines too, not in a Megatron or vLLM assert inside a Ray actor."""
    failures = model_fit_failures(cfg, ModelShape.from_hf(load_hf_config(str(model_dir))))
    if failures:
        raise PlanError(failures)


def _hf_support(cfg: RunConfig, hf) -> list[str]:
    """The model builder's refusals (model_provider.unsupported_fields), one line each."""
    from megatron_specrl.learner.model_provider import unsupported_fields
    return [f"model.path={cfg.model.path!r}: {line}" for line in unsupported_fields(hf)]


def _layout(cfg: RunConfig) -> list[str]:
    c, le, r, out = cfg.cluster, cfg.learner, cfg.rollout, []
    ba = batch_arithmetic(cfg)
    if le.pp > 1 and ba["microbatches"] < le.pp:
        out.append(f"learner.micro_batch_size={le.micro_batch_size} gives {ba['microbatches']} microbatches per "
                   f"data-parallel rank ({ba['rows_per_dp_minibatch']} rows), fewer than learner.pp={le.pp}: the "
                   "pipeline never fills; lower micro_batch_size")
    if c.gpus_per_node == 0:
        if le.recompute != "none":
            out.append(f"learner.recompute={le.recompute} with cluster.gpus_per_node=0: Megatron's activation "
                       "recompute needs CUDA (it saves CUDA RNG states); use learner.recompute=none on CPU")
        from megatron_specrl.engines.protocol import ENGINE_KINDS
        kind = ENGINE_KINDS[r.engine]
        if r.draft not in kind.cpu_drafts:
            out.append(f"rollout.draft={r.draft} with rollout.engine={r.engine} on CPU (cluster.gpus_per_node=0): "
                       f"{kind.why_not('cpu_drafts')}; use rollout.draft={kind.cpu_drafts[-1]} on CPU")
        return out      # a CPU run: Ray places ranks and engines on cores
    have = c.nodes * c.gpus_per_node
    learner, engines = gpus_needed(cfg)
    if c.gpus_per_node % le.tp:
        out.append(f"learner.tp={le.tp} does not divide cluster.gpus_per_node={c.gpus_per_node}: a tensor-parallel "
                   "group must sit inside one node")
    if r.engine_tp > c.gpus_per_node or c.gpus_per_node % r.engine_tp:
        out.append(f"rollout.engine_tp={r.engine_tp} does not divide cluster.gpus_per_node={c.gpus_per_node}: an "
                   "engine must sit inside one node")
    if r.colocate:
        if r.engine_tp != 1:
            out.append(f"rollout.engine_tp={r.engine_tp} with rollout.colocate=true: a colocated engine shares one GPU "
                       "with one learner rank; use engine_tp=1 or colocate=false")
        if r.num_engines > learner:
            out.append(f"rollout.num_engines={r.num_engines} exceeds the learner's {learner} GPUs it is colocated on")
        if cfg.trainer.runs_ahead:
            off = "trainer.overlap=none" if cfg.trainer.overlap else "trainer.max_staleness=0"
            out.append(f"{cfg.trainer.overlap_key()} with rollout.colocate=true: colocated "
                       "engines sleep while the learner trains on their GPUs, so nothing can overlap; set "
                       f"rollout.colocate=false (engines on GPUs of their own) or {off}")
    if learner + engines != have:
        what = (f"learner.tp x pp x dp = {le.tp} x {le.pp} x {le.dp} = {learner}"
                + ("" if r.colocate else f" plus rollout.num_engines x engine_tp = {r.num_engines} x {r.engine_tp} "
                   f"= {engines} (disaggregated)"))
        out.append(f"cluster.nodes={c.nodes}: {what} GPUs, but cluster.nodes x gpus_per_node = {c.nodes} x "
                   f"{c.gpus_per_node} = {have}" + (" (GPUs would sit idle)" if learner + engines < have else ""))
    return out


def _transport(cfg: RunConfig) -> list[str]:
    """trainer.resync_transport against the layout, as the run resolves it once Ray has placed the actors
    (resync/choose.py): cuda_ipc disaggregated or with several engines, or broadcast colocated on GPUs,
    would otherwise fail only after the job left the queue. Without cluster.gpus_per_node the plan does not
    know the machine's GPUs (a local run finds them through Ray): the run checks it then."""
    from megatron_specrl.config.placement import Placement
    from megatron_specrl.resync.choose import resolve_transport
    r = cfg.rollout
    if cfg.cluster.gpus_per_node == 0:
        return []
    placement = Placement(r.colocate, 1.0, float(r.engine_tp))
    try:
        resolve_transport(cfg.trainer.resync_transport, placement, r.num_engines, r.engine)
    except ConfigError as e:
        return [str(e)]
    return []


def _memory(cfg: RunConfig, lm: LearnerMemory, em: EngineMemory) -> list[str]:
    c, r, out = cfg.cluster, cfg.rollout, []
    if c.gpus_per_node == 0:
        return out
    gpu = int(c.gpu_memory_gb * GB)
    if lm.total > gpu:
        out.append(f"cluster.gpu_memory_gb={c.gpu_memory_gb:g}: the learner needs {lm.total / GB:.1f} GiB per GPU "
                   f"(weights {lm.weights / GB:.1f} + grads {lm.grads / GB:.1f} + optimizer {lm.optimizer / GB:.1f} "
                   + (f"+ PPO critic {lm.critic / GB:.1f} " if lm.critic else "")
                   + (f"+ KL reference {lm.reference / GB:.1f} " if lm.reference else "")
                   + f"+ the larger of activations {lm.activations / GB:.1f} and the optimizer step's "
                   f"temporaries {lm.optimizer_step / GB:.1f}) at learner.tp={cfg.learner.tp} pp={cfg.learner.pp} "
                   f"dp={cfg.learner.dp}" + (f" ep={cfg.learner.ep}" if lm.expert_params else "")
                   + "; raise tp/pp" + ("/ep" if lm.expert_params else "") + ", set learner.distributed_optimizer / "
                   "learner.recompute, or lower learner.micro_batch_size")
    if em.kv_space < em.max_model_len * em.kv_per_token:
        out.append(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization:g}: vLLM's {em.budget / GB:.1f} GiB leave "
                   f"{max(0, em.kv_space) / GB:.1f} GiB of KV cache after {em.weights / GB:.1f} GiB of weights per GPU, "
                   f"less than one {em.max_model_len}-token sequence (the engine's max_model_len) needs "
                   f"({em.max_model_len * em.kv_per_token / GB:.2f} GiB); raise it or rollout.engine_tp")
    scores_awake = cfg.needs_reference or cfg.algorithm.name == "ppo"
    if r.colocate and scores_awake and lm.static + em.budget <= gpu < lm.static + em.budget + lm.scoring:
        out.append(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization:g}: colocated, the "
                   + ("KL reference's" if cfg.needs_reference else "PPO critic's")
                   + (" (and the policy's, use_kl_in_reward)" if cfg.algorithm.use_kl_in_reward else "")
                   + f" scoring pass runs before the engines release memory: vLLM's {em.budget / GB:.1f} GiB + the "
                   f"learner's resident {lm.static / GB:.1f} GiB + {lm.scoring / GB:.1f} GiB for one "
                   f"{lm.tokens_per_microbatch}-token microbatch's forward exceed cluster.gpu_memory_gb="
                   f"{c.gpu_memory_gb:g}; lower gpu_memory_utilization or learner.max_tokens_per_microbatch / "
                   "micro_batch_size")
    if r.colocate and lm.static + em.budget > gpu:
        out.append(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization:g}: colocated, vLLM's {em.budget / GB:.1f} "
                   f"GiB plus the learner's resident {lm.static / GB:.1f} GiB (weights, grads, optimizer"
                   + (", critic" if lm.critic else "") + (", reference" if lm.reference else "") + ") exceed "
                   f"cluster.gpu_memory_gb={c.gpu_memory_gb:g}")
    return out


def _data(cfg: RunConfig, tokenizer) -> list[str]:
    from megatron_specrl.data.datasets import DatasetError, load_records, render_all
    d, out = cfg.data, []
    for key, split in (("data.source", "train"), ("data.eval_source", "eval")):
        value = getattr(d, key.split(".")[1])
        if value is None or value == "synthetic":
            continue
        try:
            records = load_records(d, split, seed=cfg.trainer.seed)
            if tokenizer is not None:   # the run's own start-up check (run.build.build_run), before it queues
                records, _ = render_all(records, tokenizer, d.apply_chat_template, d.max_prompt_len,
                                        d.filter_overlong_prompts, split)
        except DatasetError as e:
            out.append(f"{key}={value!r}: {e}")
            continue
        if split == "train" and len(records) < cfg.trainer.gen_prompts_per_step:
            out.append(f"{key}={value!r}: {len(records)} prompts, fewer than {cfg.trainer.round_prompts_key()}")
    return out


WEIGHT_FILES = ("*.safetensors", "*.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def is_shape_only(model_path: str) -> bool:
    """A config.json without weights beside it (none of WEIGHT_FILES): the shapes in examples/models/,
    which the cluster recipes' plan checks read offline until the run is given the checkpoint. A tiny
    model (built when the run starts) is not one."""
    from megatron_specrl.models.resolve import TINY
    return model_path not in TINY and not any(any(Path(model_path).glob(p)) for p in WEIGHT_FILES)


def _model_files(cfg: RunConfig, loads_model: bool):
    """(tokenizer or None, failures) of model.path. A real checkpoint (weights present) is resolved and
    its tokenizer loaded as the run does (models/resolve.resolve_model, run/build.load_tokenizer, whose
    load and vocabulary check this repeats, its message quoting transformers' first sentence whole); a
    shape-only config has neither, and is refused where `loads_model` (the run loads this very path)."""
    from megatron_specrl.models.resolve import TINY, read_hf_config, resolve_model
    path = cfg.model.path
    if path in TINY:
        return None, []   # built, with its tokenizer, when the run starts
    if is_shape_only(path):
        return None, [f"model.path={path!r}: no weights beside config.json (*.safetensors): a shape-only config, "
                      "which the run cannot load; pass the checkpoint's directory"] if loads_model else []
    try:
        resolve_model(cfg.model)      # a local directory: checks only (config.json, *.safetensors)
    except ConfigError as e:
        return None, [str(e)]
    model_dir = Path(path)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return None, [f"model.path={path!r}: no tokenizer.json or tokenizer_config.json beside config.json (the run "
                      "loads its tokenizer from there)"]
    # run/build.load_tokenizer's load and vocabulary check (importing it here would close an import cycle:
    # learner/convert -> plan -> run)
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:   # OSError / ValueError / TypeError, depending on what is missing
        return None, [f"model.path={path!r}: cannot load its tokenizer ({quote_exception(e)})"]
    vocab = read_hf_config(model_dir).get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        return None, [f"model.path={path!r}: the tokenizer has {len(tokenizer)} tokens, more than the model's "
                      f"vocab_size={vocab} (config.json): a tokenizer of another model?"]
    return tokenizer, []


# --------------------------------------------------------------------------- the plan

@dataclass
class Plan:
    cfg: RunConfig
    shape: ModelShape
    padded_vocab: int
    learner: LearnerMemory
    engine: EngineMemory
    failures: list[str] = field(default_factory=list)
    shape_only: bool = False      # model.path holds config.json only (is_shape_only)

    def rows(self) -> list[tuple[str, str]]:
        cfg, s, c, le, r = self.cfg, self.shape, self.cfg.cluster, self.cfg.learner, self.cfg.rollout
        ba = batch_arithmetic(cfg)
        learner_gpus, engine_gpus = gpus_needed(cfg)
        gpu = f"{c.nodes} x {c.gpus_per_node} = {c.nodes * c.gpus_per_node} ({c.gpu_memory_gb:g} GiB)" \
            if c.gpus_per_node else f"{c.nodes} node(s), CPU"
        gb = lambda b: f"{b / GB:.1f} GiB" if b >= GB / 10 else f"{b / 2**20:.2f} MiB"
        mlp = (f"{s.experts} experts (top {s.topk}) of ffn {s.expert_ffn}, {full_parameters(s):,} params, "
               f"{full_parameters(s, active=True):,} active" if s.moe else f"ffn {s.ffn}, {full_parameters(s):,} params")
        lm = self.learner
        return [
            ("model", f"{cfg.model.path} ({s.model_type}: {s.layers} layers, hidden {s.hidden}, heads {s.heads}/"
                      f"{s.kv_heads} kv, head_dim {s.head_dim}, {mlp})"
                      + ("; shape only (no weights beside config.json): the run needs the checkpoint's path, whose "
                         "tokenizer and prompt lengths it checks when it starts" if self.shape_only else "")),
            ("vocab", f"{s.vocab} -> {self.padded_vocab} padded (multiple of 128 x tp)"),
            ("cluster", gpu),
            ("learner", f"tp {le.tp} x pp {le.pp} x dp {le.dp} = {learner_gpus} GPUs"
                        + (f"; ep {le.ep}: {s.experts // le.ep} of {s.experts} experts a GPU, expert-data-parallel "
                           f"{le.dp // le.ep}" if s.moe else "")),
            ("engines", f"{r.num_engines} x engine_tp {r.engine_tp}, "
                        + ("colocated" if r.colocate else f"disaggregated ({engine_gpus} GPUs)")),
            ("batch", f"{cfg.trainer.prompts_per_step} prompts x {r.n_samples} = {ba['rows']} sequences; "
                      f"{ba['rows_per_dp_minibatch']} per dp rank and mini-batch, {ba['microbatches']} microbatches, "
                      f"{ba['optimizer_steps']} optimizer steps"
                      + (f"; rounds of {cfg.trainer.gen_prompts_per_step} prompts (DAPO filter)"
                         if cfg.trainer.gen_prompts_per_step != cfg.trainer.prompts_per_step else "")),
            ("lengths", f"prompt {cfg.data.max_prompt_len} + response {r.max_new_tokens}"
                        + (f" (overlong buffer {cfg.algorithm.overlong_buffer})" if cfg.algorithm.name == "dapo" else "")
                        + f", max_model_len {r.max_model_len}"),
            ("learner params / GPU", f"{lm.params:,} (heaviest stage)"
                                     + (f", {lm.expert_params:,} of them in experts" if s.moe else "")),
            ("learner memory / GPU", f"weights {gb(self.learner.weights)} + grads {gb(self.learner.grads)} + optimizer "
                                     f"{gb(self.learner.optimizer)}"
                                     + ((f" (distributed: dense states over dp {le.dp}, experts' over dp / ep "
                                         f"{le.dp // le.ep})" if s.moe else " (distributed)")
                                        if le.distributed_optimizer else "")
                                     + (" (bf16 weights, fp32 grads and master weights)"
                                        if le.precision == "bfloat16" else "")
                                     + (f" + PPO critic {gb(self.learner.critic)}" if self.learner.critic else "")
                                     + (f" + KL reference {gb(self.learner.reference)}" if self.learner.reference else "")
                                     + f" + activations {gb(self.learner.activations)} (recompute {le.recompute}, "
                                     f"{self.learner.tokens_per_microbatch} tokens x "
                                     f"{self.learner.microbatches_in_flight} in flight)"
                                     + (f", or the optimizer step's {gb(self.learner.optimizer_step)} (torch AdamW)"
                                        if self.learner.optimizer_step else "")
                                     + f" = {gb(self.learner.total)}"),
            *self._scoring_rows(gb),
            *self._engine_rows(gb),
            ("data", cfg.data.source + (f" (eval {cfg.data.eval_source})" if cfg.data.eval_source else "")),
        ]

    def _scoring_rows(self, gb) -> list[tuple[str, str]]:
        cfg = self.cfg
        if not (cfg.rollout.colocate and cfg.cluster.gpus_per_node
                and (cfg.needs_reference or cfg.algorithm.name == "ppo")):
            return []
        return [("scoring / GPU", f"resident {gb(self.learner.static)} + forward {gb(self.learner.scoring)} beside "
                                  f"vLLM's {gb(self.engine.budget)} (before the engines release memory) = "
                                  f"{gb(self.learner.static + self.learner.scoring + self.engine.budget)}")]

    def _engine_rows(self, gb) -> list[tuple[str, str]]:
        r = self.cfg.rollout
        if self.cfg.cluster.gpus_per_node == 0:
            return [("engine memory", f"CPU run: rollout.kv_cache_gb={r.kv_cache_gb:g} GiB of KV cache per engine, "
                                      f"weights {gb(self.engine.weights)} ({r.engine_dtype}"
                                      + (", with the draft model's" if r.draft == "model" else "") + ")")]
        return [
            ("engine memory / GPU", f"weights {gb(self.engine.weights)} ({r.engine_dtype}"
                                    + (", with the draft model's" if r.draft == "model" else "") + ") of vLLM's "
                                    f"{gb(self.engine.budget)}; KV {self.engine.kv_per_token / 1024:.0f} KiB/token"),
            ("engine KV for the batch", f"{self.engine.sequences_per_engine} sequences need "
                                        f"{gb(self.engine.kv_batch)}; {gb(max(0, self.engine.kv_space))} holds "
                                        f"{self.engine.concurrent_sequences} at full length"),
        ]

    def table(self):
        from rich.table import Table
        t = Table(title=f"plan: {self.cfg.output_dir}", show_header=True)
        t.add_column("item", style="bold")
        t.add_column("value")
        for k, v in self.rows():
            t.add_row(k, v)
        return t


def build_plan(cfg: RunConfig, check_data: bool = True, loads_model: bool = False) -> Plan:
    """Every check; raises PlanError with one line per failure. `loads_model`: the run loads model.path as
    it is now (`train`, `launch --submit`), so a shape-only config is refused; elsewhere (`--dry-run`, a
    rendered script the job may get another path for) it is accepted, and its tokenizer and prompt
    lengths are checked when the run starts."""
    hf = load_hf_config(cfg.model.path)
    s = ModelShape.from_hf(hf)
    from megatron_specrl.learner.model_provider import padded_vocab_size
    padded = padded_vocab_size(s.vocab, cfg.learner.tp)
    flash = flash_attention(cfg)   # bf16 on GPUs; fp32: TransformerEngine's flash / fused take fp16 / bf16 only
    gpu_bytes = int(cfg.cluster.gpu_memory_gb * GB)
    lm = learner_memory(cfg, s, padded, flash)
    draft, draft_failures = draft_model_shape(cfg, s)
    em = engine_memory(cfg, s, gpu_bytes, draft)
    failures = (_hf_support(cfg, hf) + model_fit_failures(cfg, s) + _layout(cfg) + _transport(cfg) + draft_failures
                + _memory(cfg, lm, em))
    tokenizer, model_failures = _model_files(cfg, loads_model)
    failures += model_failures
    if check_data:
        failures += _data(cfg, tokenizer)
    if failures:
        raise PlanError(failures)
    return Plan(cfg, s, padded, lm, em, shape_only=is_shape_only(cfg.model.path))


def print_plan(plan: Plan) -> None:
    from rich.console import Console
    Console(width=160).print(plan.table())


def check_convert_layout(hf_dir: str | Path, tp: int, pp: int, ep: int = 1) -> None:
    """`convert`'s check before it spawns tp x pp x ep ranks: the model config is readable and the layout
    fits it (shape.layout_failures, with --tp / --pp / --ep). Without it a bad --tp reached the spawned
    ranks, whose Megatron assert "255 is not divisible by 2 when instantiating ColumnParallelLinear" names
    no config field."""
    failures = layout_failures(ModelShape.from_hf(load_hf_config(str(hf_dir))), where=str(hf_dir), tp=tp, pp=pp,
                               ep=ep, keys=CLI_KEYS)
    if failures:
        raise PlanError(failures)
