"""RolloutEngine over SGLang: `sglang.Engine` (in-process) or a running HTTP server.

On a CPU (no CUDA) `SGLangEngine` starts SGLang's CPU path: `SGLANG_USE_CPU_ENGINE=1` in the environment
its scheduler processes inherit, `CPU_SERVER_ARGS` (device cpu, the torch-native attention backend, no CUDA
graphs, a small KV pool), and the import-time stand-ins of patches/sglang_0_5_23_cpu_imports.py for the
CUDA-only `sgl_kernel` and `torchvision` (which tools/setup_env.sh's CPU install puts in SGLang's spawned
processes through a .pth file). There a request's seed decides its samples, as with vLLM's seeded requests
(patches/sglang_0_5_23_seeded_sampling.py, applied in the scheduler processes through our plugin), so a
resumed run draws what the run it continues drew. tests/integration/engines/test_sglang_engine.py runs it
against HF transformers; the request building and answer parsing are also tested as pure functions.

Semantics (read from sglang 0.5.23):
- `generate(input_ids=..., return_logprob=True)` -> `meta_info.output_token_logprobs`
  = [(logprob, token_id, text|None)], after temperature (SGLANG_RETURN_ORIGINAL_LOGPROB unset).
- Scoring = `logprob_start_len=len(prompt)-1`: `meta_info.input_token_logprobs` covers
  input ids from that index on, the first value None; input log-probs are untempered and
  untruncated, so score() supports temperature 1 without top-k / top-p only and returns no
  replacements (its protocol.ENGINE_KINDS row: SpeculativeRollout refuses other
  settings, and its exact rule falls back to ban_first_token, exact at temperature 1).
- A custom logit processor runs before the log-probs are taken, so the first token of a
  ban_first_token request is re-scored (one cached prefill) to report its unbanned log-prob.
- Weights: sglang 0.5.23 refuses `update_weights_from_tensor` outside a weight-update window:
  `begin_weight_update()` before the first bucket of a version, `update_weights_from_tensor(named_tensors,
  load_format, flush_cache=False)` per bucket, then at finish_update `end_weight_update()`, one
  `flush_cache()` (radix cache: KV of the old weights) and the server's weight version set to ours, which
  every answer's `meta_info.weight_version` is then checked against.
- SGLang refuses inputs of context_length tokens or more and input + max_new_tokens above it, so
  score() verifies a continuation reaching the last position up to the token before it (protocol.score).
- A dead scheduler or detokenizer (killed, OOM-killed, crashed): SGLang's SubprocessWatchdog would SIGQUIT
  this process, whose handler kills it and every child of it; SGLangEngine stops that watchdog and watches
  the processes itself (children_of): a call running or made after the death raises the one-line
  EngineError naming the process and how it ended, health() says the same, and restart() serves a fresh
  engine at version 0 (run.recovery then pushes the learner's weights again). A scheduler or detokenizer
  that fails by a Python exception sends SIGQUIT to this process itself before it exits: SGLang's handlers
  for it (its launch-phase one, then its tokenizer manager's on the event loop) are replaced by
  `child_sigquit`, which only logs, so the exit is found and named as any other death.
- Colocated GPUs: release_memory / resume_memory map onto `release_memory_occupation` /
  `resume_memory_occupation(tags)` (memory freed only with enable_memory_saver=True).
- Tree drafting (draft="tree", rollout.draft=tree): speculative decoding with SGLang's NGRAM
  worker drafting from our per-prompt trees (patches/sglang_0_5_23_tree_proposer.py, which says
  how our chain drafts map onto SGLang's tree verify). A request opts in with
  `custom_params = {DRAFT_KEY: prompt id, RESPONSE_START: n}`; the server runs with
  `tree_server_args(draft_tokens)` and, in its environment, the patch settings (`tree_server_env`);
  counters and the trees travel through `Engine.collective_rpc` (in-process engine only: SGLang's
  HTTP server has no route for it). Run-ahead requests are vLLM-only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterable

import torch

from megatron_specrl.config import DrafterConfig, check_engine_args
from megatron_specrl.engines.logs import attach_log_file, detach_log_file, tail_lines
from megatron_specrl.engines.protocol import (
    DraftResponse, EngineError, EngineHealth, GenerateRequest, GenerateResult, SamplingSettings, ScoreRequest,
    ScoreResult, WeightVersionMismatch, check_finite_logprobs, check_version, draft_response_pairs,
    fit_to_positions, one_of,
)
from megatron_specrl.engines.protocol import (   # capabilities these engines declare
    DraftsFromTrees, EngineCapabilities, SleepsWhileTraining,
)
from megatron_specrl.engines.sglang.requests import (
    ban_processor_str, build_generate_payload, build_score_payload, check_temperature, message_of,
    parse_generate_response, parse_score_response, succeeded,
)
from megatron_specrl.engines.sglang.server import check_plugin_installed, tree_server_args, tree_server_env
from megatron_specrl.rollout.tree_drafting.drafter import as_drafter

logger = logging.getLogger(__name__)


class _SGLangBase(EngineCapabilities, DraftsFromTrees, SleepsWhileTraining, kind="sglang"):
    """Version bookkeeping + the update order shared by the Engine and HTTP variants. What they can do is
    SGLang's row of protocol.ENGINE_KINDS (score(): temperature 1, no top-k / top-p, no replacements)."""

    def __init__(self, name: str, log_dir: str | Path | None, use_ban_processor: bool = True,
                 draft: str = "none"):
        if draft not in self.engine_kind.drafts:
            raise ValueError(f"draft must be {one_of(self.engine_kind.drafts)}, got {draft!r}")
        self.draft = draft
        self.name = name
        self.log_path = Path(log_dir or "logs/engines") / f"{name}.log"
        self._log_handler = attach_log_file(self.log_path)
        self._log = logging.getLogger(f"megatron_specrl.engines.{name}")
        self._version, self._pending = 0, None
        self._updating = False   # between begin_weight_update() and end_weight_update()
        self.skip_cache_reset = False   # check-resync's injected bug (--skip-cache-reset): no flush after an update
        self._ban_proc = ban_processor_str() if use_ban_processor else None

    # backend hooks
    def _generate_raw(self, payload: dict) -> list[dict]: raise NotImplementedError
    def _begin_update(self) -> Any: raise NotImplementedError
    def _load_tensors(self, named: list[tuple[str, torch.Tensor]]) -> Any: raise NotImplementedError
    def _end_update(self) -> Any: raise NotImplementedError
    def _flush(self) -> Any: raise NotImplementedError
    def _set_server_version(self, version: int) -> None: pass
    def _context_len(self) -> int | None: return None   # None: unknown, continuations sent whole
    def _vocab_size(self) -> int | None: return None    # None: unknown (parse_score_response)
    def _memory(self, call: str, tags: list[str] | None) -> Any: raise NotImplementedError
    def _tree_rpc(self, call: str, path: str) -> None:
        raise NotImplementedError(f"engine {self.name}: SGLang's HTTP server has no collective_rpc route; the "
                                  "draft trees' counters and state are reachable from the in-process engine only")

    @property
    def weight_version(self) -> int:
        return self._version

    def _check(self, expected: int) -> None:
        check_version(self.name, self._version, expected)
        if self._pending is not None:
            raise WeightVersionMismatch(f"engine {self.name}: update to {self._pending} is half-loaded")

    def _call(self, payload: dict) -> list[dict]:
        try:
            out = self._generate_raw(payload)
        except (EngineError, WeightVersionMismatch, NotImplementedError):
            raise
        except ValueError as e:   # a request SGLang refuses (TokenizerManager / SamplingParams.verify)
            raise ValueError(f"engine {self.name}: {e}") from e
        except Exception as e:
            raise EngineError(f"{type(e).__name__}: {e}", self.name, tail_lines(self.log_path)) from e
        return out if isinstance(out, list) else [out]

    def generate(self, requests: list[GenerateRequest], sampling: SamplingSettings,
                 weight_version: int) -> list[GenerateResult]:
        if not requests:
            return []
        if sampling.need_logprobs:
            check_temperature(sampling, "generate")
        self._check(weight_version)
        outs = self._call(build_generate_payload(requests, sampling, self._ban_proc, self.draft))
        results = parse_generate_response(outs, requests, weight_version, self._meta_version(), self.name)
        banned = [i for i, r in enumerate(requests) if r.ban_first_token is not None and results[i].token_ids]
        if banned:  # report the first token's log-prob under the unbanned policy
            fix = self.score([ScoreRequest(requests[i].prompt_ids, results[i].token_ids[:1]) for i in banned],
                             sampling, weight_version)
            for i, s in zip(banned, fix):
                if not s.logprobs:   # prompt + first token fill the context: no position to score it at
                    raise ValueError(f"engine {self.name}: cannot re-score the first token of a ban_first_token "
                                     "request whose prompt ends one token before the context length")
                results[i].logprobs[0] = s.logprobs[0]
        # after the re-scoring: a banned request's first log-prob comes from score(), which passes NaN on
        # (acceptance rejects it), so a NaN verification row reached the rollout through here
        for r in results:
            check_finite_logprobs(r.token_ids, r.logprobs, self.name)
        self._check(weight_version)
        return results

    def score(self, requests: list[ScoreRequest], sampling: SamplingSettings,
              weight_version: int) -> list[ScoreResult]:
        self._check(weight_version)
        # SGLang refuses an input of context_len tokens or more (and input + max_new_tokens above it): a
        # continuation reaching the last position is verified without its last token(s) (protocol.score)
        if self._context_len() is not None:
            requests = fit_to_positions(requests, self._context_len() - 1)
        todo = [i for i, r in enumerate(requests) if r.continuation_ids]
        results = [ScoreResult([], weight_version) for _ in requests]
        if todo:
            sub = [requests[i] for i in todo]
            outs = self._call(build_score_payload(sub, sampling, self.name))
            for i, r in zip(todo, parse_score_response(outs, sub, weight_version, self._meta_version(), self.name,
                                                                 self._vocab_size())):
                results[i] = r
        self._check(weight_version)
        return results

    def _meta_version(self) -> int | None:
        return None

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """One bucket (or the whole state dict) of `version`; the first opens SGLang's weight-update
        window (begin_weight_update), which finish_update closes. A failed load leaves the version
        pending (never served) and the window open, so the update can be sent again."""
        if version <= self._version:
            raise WeightVersionMismatch(f"engine {self.name}: update to {version}, serving {self._version}")
        named = list(named_tensors)
        if not self._updating:
            self._control("begin_weight_update", self._begin_update)
            self._updating = True
        self._pending = version
        self._control(f"update_weights_from_tensor (version {version})", lambda: self._load_tensors(named))

    def finish_update(self, version: int) -> None:
        if self._pending not in (None, version):
            raise WeightVersionMismatch(f"finish_update({version}) but loaded {self._pending}")
        if self._updating:
            self._control("end_weight_update", self._end_update)
            self._updating = False
        if not self.skip_cache_reset:
            self.reset_prefix_cache()
        else:
            self._log.warning("skip_cache_reset: radix cache NOT flushed after update (debug only)")
        self._set_server_version(version)
        self._version, self._pending = version, None

    def _control(self, what: str, call) -> Any:
        """A control call (weight update, flush); a refusal or an exception is an EngineError naming
        the call and SGLang's message."""
        try:
            ret = call()
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"{what} failed: {type(e).__name__}: {e}", self.name, tail_lines(self.log_path)) from e
        if not succeeded(ret):
            raise EngineError(f"{what} failed: {message_of(ret)}", self.name, tail_lines(self.log_path))
        return ret

    # colocated GPUs (resync.lifecycle): SGLang's release_memory_occupation / resume_memory_occupation;
    # the memory is freed only on a server started with enable_memory_saver=True
    def release_memory(self) -> None:
        """Hand weights, KV cache and CUDA graphs to the learner while it trains."""
        self._memory_call("release", None)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """tags=["weights"] before loading new weights, then ["kv_cache"] (with the CUDA graphs, which
        release_memory released too and resync.lifecycle does not name)."""
        if tags is not None and "kv_cache" in tags and "cuda_graph" not in tags:
            tags = [*tags, "cuda_graph"]
        self._memory_call("resume", tags)

    def _memory_call(self, call: str, tags: list[str] | None) -> None:
        self._control(f"{call}_memory_occupation({tags})", lambda: self._memory(call, tags))

    def reset_prefix_cache(self) -> None:
        self._control("flush_cache (requests still running?)", self._flush)

    # -- draft trees (draft="tree") ----------------------------------------------------------
    @property
    def tree_drafting(self) -> bool:
        """protocol.DraftsFromTrees: built with draft="tree"."""
        return self.draft == "tree"

    def _tree_call(self, call: str, state: dict | None = None):
        import pickle
        import tempfile
        with tempfile.TemporaryDirectory(prefix="specrl-tree-") as d:
            path = str(Path(d) / "tree.pkl")
            if state is not None:
                with open(path, "wb") as f:
                    pickle.dump(state, f)
            try:
                self._tree_rpc(call, path)
            except NotImplementedError:
                raise
            except Exception as e:
                raise EngineError(f"tree {call} failed: {type(e).__name__}: {e}", self.name,
                                  tail_lines(self.log_path)) from e
            if state is not None:
                return None
            with open(path, "rb") as f:
                return pickle.load(f)

    def draft_stats(self) -> dict[str, float]:
        """The tree drafter's counters since the last call (draft / accepted / generated tokens,
        request-steps, engine steps) and the trees' size; {} without tree drafting."""
        return self._tree_call("take_stats") if self.draft == "tree" else {}

    def add_to_draft_trees(self, responses: list[DraftResponse]) -> None:
        """Responses the rollout took without generating them enter their prompts' trees and the shared
        tree once each, as a generated response would (protocol.DraftResponse); nothing without tree
        drafting."""
        if self.draft == "tree" and responses:
            self._tree_call("add_responses", draft_response_pairs(responses))

    def draft_state(self) -> dict | None:
        """The trees (rollout.tree_drafting.trees.DraftTrees.state_dict), for checkpoints; None without tree drafting."""
        return self._tree_call("state_dict") if self.draft == "tree" else None

    def load_draft_state(self, state: dict) -> None:
        if self.draft != "tree":
            raise ValueError(f"engine {self.name} was built without tree drafting (rollout.draft=none)")
        self._tree_call("load_state_dict", state)

    def health(self) -> EngineHealth:
        return EngineHealth(alive=True, weight_version=self._version,
                            detail={"name": self.name, "pending_version": self._pending})

    def shutdown(self) -> None:
        detach_log_file(self._log_handler)


# sglang.Engine's arguments on a CPU (no CUDA), under rollout.engine_kwargs.sglang and tests' overrides:
# SGLang's CPU device with its torch-native attention (the only backend without CUDA kernels), no CUDA
# graphs, no warm-up request, and a small KV pool (mem_fraction_static is a fraction of the host's memory
# there; max_total_tokens bounds it).
# sleep_on_idle: an idle scheduler blocks on its sockets (zmq poll, woken by the next request) instead of
# spinning; without it the scheduler of an idle CPU engine keeps a whole core busy, which on a small machine is
# taken from the learner that trains while the engine waits (docs/benchmarks/2026-12-02-epyc-avx2.md).
CPU_SERVER_ARGS = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                       mem_fraction_static=0.05, max_total_tokens=16384,
                       skip_server_warmup=True, sleep_on_idle=True)
CPU_ENV = "SGLANG_USE_CPU_ENGINE"   # without it SGLang's is_cpu() is false and it takes its CUDA paths


def _enter_sglang_cpu():
    """SGLANG_USE_CPU_ENGINE=1, SPECRL_SGLANG_PATCHES=1 and the import-time stand-ins
    (patches/sglang_0_5_23_cpu_imports.py) in this process while sglang.Engine starts: its scheduler and
    detokenizer inherit the variables, through the first the .pth file's stand-ins, through the second our
    plugin's patches (the seeded sampling of patches/sglang_0_5_23_seeded_sampling.py). Returns the undo,
    called once they run: processes this one starts later (vLLM's, Ray's, a learner's) see neither the
    variables nor the stand-ins."""
    from megatron_specrl.patches import sglang_0_5_23_cpu_imports as cpu_imports
    from megatron_specrl.patches.sglang_engine_patches import ENV as PATCHES_ENV
    before = {name: os.environ.get(name) for name in (CPU_ENV, PATCHES_ENV)}
    was_active = cpu_imports.active()
    os.environ.update({CPU_ENV: "1", PATCHES_ENV: "1"})
    cpu_imports.install()

    def undo():
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if not was_active:
            cpu_imports.uninstall()
    return undo


class SGLangEngine(_SGLangBase):
    """In-process `sglang.Engine`: its CPU path without CUDA (CPU_SERVER_ARGS), else the GPU. `engine` may be
    injected (tests of pure plumbing pass a fake)."""

    def __init__(self, model_path: str | None = None, name: str = "sglang-0", seed: int = 0,
                 max_model_len: int = 256, tensor_parallel_size: int = 1, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.6, log_dir: str | Path | None = None,
                 engine: Any = None, use_ban_processor: bool = True, draft: str = "none",
                 drafter: DrafterConfig | dict | None = None, enforce_eager: bool | None = None,
                 cudagraph_capture_sizes: list[int] | None = None, max_num_seqs: int | None = None,
                 engine_args: dict | None = None, **engine_kwargs):
        """rollout's verl keys in SGLang's names: enforce_eager true -> disable_cuda_graph (unset: SGLang's
        CUDA graphs), cudagraph_capture_sizes -> cuda_graph_bs, max_num_seqs -> max_running_requests;
        `drafter`: rollout.drafter whole (draft=tree: its tokens are the NGRAM worker's draft nodes, the
        rest reaches the patch's TreeDrafter through its environment variable);
        `engine_args` (rollout.engine_kwargs.sglang) are passed on as they are. `engine_kwargs`: the
        factory's (enable_memory_saver) and tests' overrides."""
        self.on_cpu = engine is None and not torch.cuda.is_available()
        if self.on_cpu and draft not in self.engine_kind.cpu_drafts:   # the plan refuses it first (CLI)
            raise ValueError(f"rollout.draft={draft} with rollout.engine=sglang needs a GPU: "
                             f"{self.engine_kind.why_not('cpu_drafts')}")
        # from before anything imports SGLang (it reads the switch once: is_cpu() is cached) until its
        # processes have started
        undo = _enter_sglang_cpu() if self.on_cpu else None
        try:
            super().__init__(name, log_dir, use_ban_processor, draft)
            check_engine_args("sglang", engine_args or {})
            self.server_args = dict(model_path=str(model_path), random_seed=seed, context_length=max_model_len,
                                    tp_size=tensor_parallel_size, dtype=dtype, mem_fraction_static=gpu_memory_utilization,
                                    enable_custom_logit_processor=True, skip_tokenizer_init=True,
                                    custom_sigquit_handler=child_sigquit)   # a child failing at start: logged
            if enforce_eager:
                self.server_args["disable_cuda_graph"] = True
            if cudagraph_capture_sizes:
                self.server_args["cuda_graph_bs"] = sorted({int(x) for x in cudagraph_capture_sizes})
            if max_num_seqs is not None:
                self.server_args["max_running_requests"] = int(max_num_seqs)
            if draft == "tree":   # the scheduler processes SGLang starts inherit the patch settings
                drafter = as_drafter(drafter, draft)
                self.server_args.update(tree_server_args(drafter.tokens))
                os.environ.update(tree_server_env(drafter))
            if self.on_cpu:
                self.server_args.update(CPU_SERVER_ARGS)
            self.server_args.update(engine_args or {})
            self.server_args.update(engine_kwargs)
            if engine is None:
                engine = self._start_sglang()
        finally:
            if undo is not None:
                undo()
        self._adopt(engine)

    def _start_sglang(self):
        import sglang
        if self.draft == "tree" or self.on_cpu:   # the tree patch; on CPU, seeded sampling
            check_plugin_installed()
        return sglang.Engine(**self.server_args)

    def _adopt(self, engine) -> None:
        """Serve from `engine`: its children watched by us (children_of), the server's version set to ours."""
        self.engine = engine
        self._children, self._death_logged = children_of(engine), False
        keep_alive_on_child_sigquit(engine)
        # a real engine's answers carry the server's weight version ("default" at start): ours from here on
        self._records_version = hasattr(engine, "tokenizer_manager")
        self._set_server_version(0)

    def restart(self) -> None:
        """A fresh sglang.Engine from model_path after its processes died (run.recovery restarts every engine
        and pushes the learner's weights again): it serves version 0, so the caller re-pushes the current
        weights. Only this engine's own processes are ended (SGLang's Engine.shutdown kills every child of
        this process: a learner's or another engine's too)."""
        old, self.engine = self.engine, None
        if old is not None:
            stop_children(old, self._children)
        self._version, self._pending, self._updating = 0, None, False
        undo = _enter_sglang_cpu() if self.on_cpu else None
        try:
            engine = self._start_sglang()
        finally:
            if undo is not None:
                undo()
        self._adopt(engine)
        self._log.info("engine %s restarted (SGLang processes %s)", self.name, [p.pid for _, p in self._children])

    def _died(self, what: str) -> None:
        """Raise the one-line EngineError if one of SGLang's processes has exited."""
        dead = dead_children(self._children)
        if dead:
            if not self._death_logged:
                self._log.error("engine %s: SGLang process died: %s", self.name, "; ".join(dead))
                self._death_logged = True
            raise EngineError(f"{what}: engine process died: {'; '.join(dead)}", self.name, tail_lines(self.log_path))

    def _guarded(self, what: str, call):
        """call() (which runs SGLang's event loop until its answer) while a task on the same loop polls the
        scheduler and detokenizer: when one dies, SGLang's tokenizer manager would wait for its answer
        forever, so the poll stops the loop and the call raises the one-line EngineError instead."""
        if self.engine is None:
            raise EngineError(f"{what}: engine is not running (shut down or died; restart() starts a fresh one)",
                              self.name)
        self._died(what)
        loop = getattr(self.engine, "loop", None)
        if loop is None or not self._children:   # a fake engine (pure plumbing tests)
            return call()
        children = self._children

        async def poll():
            while not dead_children(children):
                await asyncio.sleep(CHILD_POLL_S)
            loop.stop()
        task = loop.create_task(poll())
        try:
            return call()
        except RuntimeError:   # "Event loop stopped before Future completed": the poll found a death
            self._died(what)
            raise
        finally:
            task.cancel()

    def _generate_raw(self, payload):
        return self._guarded("generate", lambda: self.engine.generate(**payload))

    def _context_len(self):
        n = self.server_args.get("context_length")
        return None if n is None else int(n)

    def _vocab_size(self):
        config = getattr(getattr(self.engine, "tokenizer_manager", None), "model_config", None)
        return getattr(config, "vocab_size", None)

    def _begin_update(self):
        return self._guarded("begin_weight_update", lambda: self.engine.begin_weight_update())

    def _load_tensors(self, named):
        return self._guarded("update_weights_from_tensor", lambda: self.engine.update_weights_from_tensor(
            named_tensors=named, load_format=None, flush_cache=False))

    def _end_update(self):
        return self._guarded("end_weight_update", lambda: self.engine.end_weight_update())

    def _flush(self):
        return self._guarded("flush_cache", lambda: self.engine.flush_cache())

    def _meta_version(self) -> int | None:
        return self._version if self._records_version else None

    def _set_server_version(self, version: int) -> None:
        """sglang.Engine has no method for it; its HTTP server's /update_weight_version does this call."""
        if not self._records_version:
            return
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput
        req = UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False)
        self._control(f"update_weight_version({version})", lambda: self._guarded(
            "update_weight_version", lambda: self.engine.loop.run_until_complete(
                self.engine.tokenizer_manager.update_weight_version(req)) or (True, "")))

    def health(self) -> EngineHealth:
        """Alive while SGLang's scheduler and detokenizer processes are; `death_cause` says which one exited
        and how (a signal or an exit code)."""
        dead = dead_children(self._children)
        return EngineHealth(alive=self.engine is not None and not dead, weight_version=self._version,
                            detail={"name": self.name, "pending_version": self._pending, "pid": os.getpid(),
                                    "child_pids": [p.pid for _, p in self._children],
                                    "death_cause": "; ".join(dead) or None, "log": str(self.log_path)})

    def _memory(self, call, tags):
        return self._guarded(f"{call}_memory_occupation",
                             lambda: getattr(self.engine, f"{call}_memory_occupation")(tags=tags))

    def _tree_rpc(self, call, path):
        from megatron_specrl.patches.sglang_0_5_23_tree_proposer import RPC_METHOD
        self._guarded(f"tree {call}", lambda: self.engine.collective_rpc(RPC_METHOD, call=call, path=path))

    def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            super().shutdown()


CHILD_POLL_S = 0.2   # how often a running call checks SGLang's processes


class _Pid:
    """A child known by its pid only (an engine whose SubprocessWatchdog is not there to name them)."""

    def __init__(self, pid: int):
        self.pid, self.exitcode = pid, None

    def is_alive(self) -> bool:
        import psutil
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def child_sigquit(signum=None, frame=None) -> None:
    """SIGQUIT from one of SGLang's processes: sglang 0.5.23's scheduler and detokenizer send it to this
    process when they fail by an exception, and then exit. SGLang's own handlers kill this process and all
    of its children (a learner's or another engine's too); this one logs, and the engine's watch of its
    processes (SGLangEngine._guarded, health) finds the exit and names it."""
    logger.error("an SGLang process reported a failure (SIGQUIT); its engine's next call names it")


def keep_alive_on_child_sigquit(engine) -> None:
    """Replace the SIGQUIT handler sglang 0.5.23's tokenizer manager adds to its event loop (main thread
    only: `running_phase_sigquit_handler`, which kills this process tree) by child_sigquit; and this
    process's own (SGLang's launch-phase one), where this is the main thread. A fake engine: nothing."""
    loop = getattr(engine, "loop", None)
    if loop is None or not hasattr(engine, "tokenizer_manager"):
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGQUIT, child_sigquit)
        loop.remove_signal_handler(signal.SIGQUIT)
        loop.add_signal_handler(signal.SIGQUIT, child_sigquit)


def children_of(engine) -> list[tuple[str, Any]]:
    """SGLang's scheduler and detokenizer processes as (name, multiprocessing.Process), taken over from its
    SubprocessWatchdog, which is stopped: on a child's death it sends SIGQUIT to this process, whose
    handler (sglang 0.5.23 TokenizerManager's running_phase_sigquit_handler) kills this process and
    every child of it, the caller included, where we raise an EngineError that a restart recovers from.
    The watchdog's process list is private (sglang 0.5.23, srt/utils/watchdog.py); without it the pids
    of Engine.get_all_child_pids. [] for a fake engine."""
    watchdog = getattr(getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
    if watchdog is not None:
        watchdog.stop()
        procs, names = getattr(watchdog, "_processes", None), getattr(watchdog, "_names", None)
        if procs and names:
            return list(zip(names, procs))
    try:
        return [(f"process {pid}", _Pid(pid)) for pid in engine.get_all_child_pids()]
    except Exception:
        return []


def dead_children(children: list[tuple[str, Any]]) -> list[str]:
    """One phrase per exited child: `scheduler_0 (pid 123) was killed by SIGKILL` / `exited with code 1`."""
    import signal as _signal
    out = []
    for name, proc in children:
        if proc.is_alive():
            continue
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by {_signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        elif code is not None:
            how = f"exited with code {code}"
        else:
            how = "exited"
        out.append(f"SGLang's {name} (pid {proc.pid}) {how}")
    return out


def stop_children(engine, children: list[tuple[str, Any]]) -> None:
    """End one engine's SGLang processes (and theirs) and reap them, leaving this process's other children
    alone; its tokenizer manager's tasks on the shared event loop are cancelled and its exit hook dropped
    (Engine.shutdown at exit would kill every child of this process)."""
    import atexit

    import psutil
    procs = []
    for _, child in children:
        try:
            p = psutil.Process(child.pid)
            procs += [*p.children(recursive=True), p]
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    for _, child in children:
        if hasattr(child, "join"):
            child.join(timeout=1)   # reaped: exitcode set, no zombie left
    for task in list(getattr(getattr(engine, "tokenizer_manager", None), "asyncio_tasks", ()) or ()):
        task.cancel()
    atexit.unregister(engine.shutdown)


class SGLangHTTPEngine(_SGLangBase):
    """A running `python -m sglang.launch_server --enable-custom-logit-processor` server.
    Tensors go through /update_weights_from_tensor as IPC handles (colocated GPU only);
    the server's weight_version is set on each finish_update and checked on every answer."""

    def __init__(self, base_url: str, name: str = "sglang-http-0", log_dir: str | Path | None = None,
                 timeout_s: float = 600.0, use_ban_processor: bool = True, post=None, draft: str = "none"):
        super().__init__(name, log_dir, use_ban_processor, draft)
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._post = post or self._urllib_post
        self._set_server_version(0)   # the server starts at "default"; answers must carry ours

    def _urllib_post(self, path: str, body: dict) -> Any:
        import urllib.error
        import urllib.request
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            if path == "/generate":
                raise
            # a refused control call (flush with requests running, failed load): 400 and its message
            text = e.read().decode(errors="replace")
            try:
                return {**json.loads(text), "success": False}
            except (json.JSONDecodeError, TypeError):
                return {"success": False, "message": text}
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {"success": True, "message": text}

    def _meta_version(self) -> int | None:
        return self._version

    def _generate_raw(self, payload):
        return self._post("/generate", payload)

    def _begin_update(self):
        return self._post("/begin_weight_update", {})

    def _end_update(self):
        return self._post("/end_weight_update", {})

    def _load_tensors(self, named):
        from sglang.srt.utils import MultiprocessingSerializer
        blob = MultiprocessingSerializer.serialize(named, output_str=True)
        return self._post("/update_weights_from_tensor",
                          {"serialized_named_tensors": [blob], "flush_cache": False})

    def _flush(self):
        return self._post("/flush_cache", {})

    def _memory(self, call, tags):
        return self._post(f"/{call}_memory_occupation", {"tags": tags})

    def _set_server_version(self, version: int) -> None:
        if not succeeded(self._post("/update_weight_version", {"new_version": str(version)})):
            raise EngineError(f"update_weight_version({version}) failed", self.name, tail_lines(self.log_path))
