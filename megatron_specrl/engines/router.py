"""Data parallel over N rollout engines behind the same protocol.

A batch is split so every engine gets about the same number of tokens
(longest-first greedy), the shards run concurrently (Ray actors: all submitted
before any wait; in-process engines: threads), and results come back in the
caller's order. The first engine to fail is reported at once, not after the
engines still generating have finished. Weight updates go to every engine; with
Ray engines each bucket is put in the object store once and read by all actors.
"""

from __future__ import annotations

import hashlib
import heapq
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Iterable, Sequence

import torch

from megatron_specrl.engines.protocol import (
    DraftResponse, DraftsFromTrees, EngineCapabilities, EngineHealth, GenerateRequest, GenerateResult, InActor,
    RoutesToEngines, SamplingSettings, ScoreRequest, ScoreResult, WeightVersionMismatch, check_count, samples_coupled,
    verifies_processed_distribution,
)


def balance(costs: Sequence[int], n: int) -> list[list[int]]:
    """Indices per shard, longest first onto the least-loaded shard; each shard keeps input order."""
    shards: list[list[int]] = [[] for _ in range(n)]
    heap = [(0, k) for k in range(n)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, k = heapq.heappop(heap)
        shards[k].append(i)
        heapq.heappush(heap, (load + costs[i], k))
    return [sorted(s) for s in shards]


def shard_by_key(keys: Sequence[str | None], n: int) -> list[list[int]]:
    """Tree drafting: every request of a prompt goes to the same engine, always the same one, so that
    engine's tree for the prompt sees all its samples and epochs (a stable hash, not Python's)."""
    shards: list[list[int]] = [[] for _ in range(n)]
    for i, key in enumerate(keys):
        k = 0 if key is None else int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % n
        shards[k].append(i)
    return shards


class EngineRouter(EngineCapabilities, DraftsFromTrees, RoutesToEngines):
    """Its capabilities are its engines': the flags where every engine has them, the draft trees'
    calls forwarded to the engines that draft from trees (nothing for the others)."""

    def __init__(self, engines: list, name: str = "router"):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = list(engines)
        self.name = name

    @property
    def verifies_processed_distribution(self) -> bool:
        return all(verifies_processed_distribution(e) for e in self.engines)

    @property
    def samples_coupled(self) -> bool:
        return all(samples_coupled(e) for e in self.engines)

    @property
    def weight_version(self) -> int:
        versions = {e.weight_version for e in self.engines}
        if len(versions) != 1:
            raise WeightVersionMismatch(f"{self.name}: engines serve different versions {sorted(versions)}")
        return versions.pop()

    def _fan_out(self, method: str, requests: list, costs: list[int], sampling, weight_version: int,
                 shards: list[list[int]] | None = None):
        shards = shards or balance(costs, len(self.engines))
        work = [(e, idx) for e, idx in zip(self.engines, shards) if idx]
        if all(isinstance(e, InActor) for e, _ in work):   # Ray engines: submit all, then wait on all
            from megatron_specrl.engines.ray_engine import wait_engines
            outs = wait_engines([(e, e.submit(method, [requests[i] for i in idx], sampling, weight_version))
                                 for e, idx in work], method, weight_version)
        else:
            pool = ThreadPoolExecutor(len(work))
            try:
                futs = [pool.submit(getattr(e, method), [requests[i] for i in idx], sampling, weight_version)
                        for e, idx in work]
                done, _ = wait(futs, return_when=FIRST_EXCEPTION)
                for f in futs:                      # a failure is raised before the slow engines finish
                    if f in done and f.exception() is not None:
                        f.result()
                outs = [f.result() for f in futs]
            finally:
                # After a failure the others' threads finish on their own (in-process engines are not
                # restarted: the error ends the caller's run or test, and interpreter exit joins them).
                pool.shutdown(wait=False)
        results: list = [None] * len(requests)
        for (e, idx), out in zip(work, outs):
            # zip would leave None for a missing result (and drop an extra one) far from its engine
            check_count(e.name, method, out, len(idx))
            for i, r in zip(idx, out):
                if r.weight_version != weight_version:
                    raise WeightVersionMismatch(f"{self.name}: engine {e.name} answered {method} under version "
                                                f"{r.weight_version}, expected {weight_version}")
                results[i] = r
        return results

    def generate(self, requests: list[GenerateRequest], sampling: SamplingSettings,
                 weight_version: int) -> list[GenerateResult]:
        costs = [len(r.prompt_ids) + r.max_new_tokens for r in requests]
        shards = None
        if any(r.draft_key is not None for r in requests):
            shards = shard_by_key([r.draft_key for r in requests], len(self.engines))
        return self._fan_out("generate", requests, costs, sampling, weight_version, shards)

    def score(self, requests: list[ScoreRequest], sampling: SamplingSettings,
              weight_version: int) -> list[ScoreResult]:
        costs = [len(r.prompt_ids) + len(r.continuation_ids) for r in requests]
        shards = None
        if any(r.draft_key is not None for r in requests):   # on the engine that extends the prompt
            shards = shard_by_key([r.draft_key for r in requests], len(self.engines))
        return self._fan_out("score", requests, costs, sampling, weight_version, shards)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = list(named_tensors)   # an iterator can be consumed only once
        for e in self.engines:
            e.update_weights(named, version)

    def finish_update(self, version: int) -> None:
        for e in self.engines:
            e.finish_update(version)

    def reset_prefix_cache(self) -> None:
        for e in self.engines:
            e.reset_prefix_cache()

    def draft_stats(self) -> dict[str, float]:
        """Summed over engines (counters and tree sizes alike), plus `engine_steps_longest`: the most
        engine steps one engine took, the rollout's decode steps (engines step side by side)."""
        total: dict[str, float] = {}
        longest = None
        for e in self._drafting():
            stats = e.draft_stats()
            for k, v in stats.items():
                total[k] = total.get(k, 0.0) + v
            if "engine_steps" in stats:
                longest = max(longest or 0.0, stats["engine_steps"])
        if longest is not None:
            total["engine_steps_longest"] = longest
        return total

    def add_to_draft_trees(self, responses: list[DraftResponse]) -> None:
        """Each response to the engine that gets its prompt's requests (shard_by_key), whose trees
        hold the prompt's other samples."""
        for e, idx in zip(self.engines, shard_by_key([r.draft_key for r in responses], len(self.engines))):
            if idx and isinstance(e, DraftsFromTrees):
                e.add_to_draft_trees([responses[i] for i in idx])

    @property
    def tree_drafting(self) -> bool:
        return all(isinstance(e, DraftsFromTrees) and e.tree_drafting for e in self.engines)

    def _drafting(self) -> list[DraftsFromTrees]:
        return [e for e in self.engines if isinstance(e, DraftsFromTrees)]

    def draft_state(self) -> dict | None:
        states = [e.draft_state() if isinstance(e, DraftsFromTrees) else None for e in self.engines]
        return None if all(s is None for s in states) else {"engines": states}

    def load_draft_state(self, state: dict) -> None:
        states = state.get("engines")
        if states is None or len(states) != len(self.engines):
            raise ValueError(f"{self.name}: saved draft trees are for "
                             f"{len(states) if states is not None else 1} engines, not {len(self.engines)}")
        for e, s in zip(self.engines, states):
            if s is not None:
                if not isinstance(e, DraftsFromTrees):
                    raise ValueError(f"{self.name}: engine {e.name} does not draft from trees")
                e.load_draft_state(s)

    def health(self) -> EngineHealth:
        hs = [e.health() for e in self.engines]
        versions = {h.weight_version for h in hs}
        return EngineHealth(alive=all(h.alive for h in hs),
                            weight_version=versions.pop() if len(versions) == 1 else -1,
                            detail={e.name: h for e, h in zip(self.engines, hs)})

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()
