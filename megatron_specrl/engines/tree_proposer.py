"""vLLM speculative-decoding proposer that drafts from per-prompt trees of earlier responses (SRT).

Lives inside the engine's worker (vLLM builds it from `speculative_config={"method":
"custom_class", "model": "megatron_specrl.engines.tree_proposer.TreeProposer"}`), and is called
once per engine step through `patches/vllm_0_32_0_tree_proposer.py` with the input batch:

- a request opts in with `SamplingParams.extra_args = {DRAFT_KEY: prompt id, RESPONSE_START: n}`:
  all samples of a prompt share one tree (rollout.draft_tree.DraftTrees), and the response
  starts at prompt position n (an extension request's prompt ends with an accepted draft
  prefix, which is part of the response);
- every step, the tokens a request gained (accepted drafts + the bonus or recovered token)
  extend its sequence in its prompt's tree at once, so sibling samples of the same step draft
  from each other in flight; the tree keeps them after the request ends (later epochs);
- the draft for a request is the tree's proposal from the longest suffix of its response,
  up to K tokens, where K shrinks as more requests run: a step verifies at most about
  `token_budget` tokens (drafting is free while the engine is under-used, as in the tail of a
  batch, and costs compute when it is full; DAS and FastGRPO size drafts the same way); the
  path-probability cut-off `min_prob` relaxes the same way as the batch empties.

vLLM's rejection sampler verifies the drafts: a point-mass draft x is accepted with probability
p(x) under the request's processed distribution, and a rejection samples p with x removed, so
generation stays an exact sample of the policy; every accepted token comes back with its log-prob.

Settings come from the environment variable SPECRL_TREE_PROPOSER (JSON, set by VLLMEngine
before it builds the LLM, so multiprocess workers inherit it).
"""

from __future__ import annotations

import json
import os

from megatron_specrl.rollout.draft_tree import DraftTrees

DRAFT_KEY = "specrl_draft_key"
RESPONSE_START = "specrl_response_start"
RUNAHEAD = "specrl_runahead"          # a run-ahead request: its tokens feed the tree, counted apart
SETTINGS_ENV = "SPECRL_TREE_PROPOSER"
PROPOSER_CLASS = "megatron_specrl.engines.tree_proposer.TreeProposer"

DEFAULTS = {"max_depth": 40, "max_match": 16, "max_nodes": 4_000_000, "min_prob": 0.1,
            "token_budget": 2048}

_COUNTERS = ("draft_tokens", "accepted_tokens", "generated_tokens", "request_steps", "engine_steps",
             "runahead_tokens")


class TreeProposer:
    specrl_batch_proposer = True   # the patch calls propose_batch with the input batch

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.max_k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        s = dict(DEFAULTS, **json.loads(os.environ.get(SETTINGS_ENV) or "{}"))
        self.min_prob, self.token_budget = float(s["min_prob"]), int(s["token_budget"])
        self.trees = DraftTrees(max_depth=int(s["max_depth"]), max_match=int(s["max_match"]),
                                max_nodes=int(s["max_nodes"]))
        # request id -> [response start, tokens of the response already in the tree, last draft length,
        # run-ahead (0/1)]; None for requests that did not opt in
        self._live: dict[str, list[int] | None] = {}
        self.counters = dict.fromkeys(_COUNTERS, 0)

    def load_model(self, *args, **kwargs) -> None:   # no draft model
        pass

    def propose(self, *args, **kwargs):
        """vLLM's own custom_class call, which carries no request ids: only reached without the patch."""
        raise RuntimeError("TreeProposer needs patches/vllm_0_32_0_tree_proposer.py applied in this process")

    def draft_len(self, running: int) -> int:
        return max(0, min(self.max_k, self.token_budget // max(running, 1) - 1))

    def draft_min_prob(self, running: int) -> float:
        """min_prob while full drafts for every running request would fill the step's budget, less
        as the batch empties: in the tail a longer, less likely draft costs almost nothing and can
        only add accepted tokens."""
        fill = min(1.0, running * (self.max_k + 1) / self.token_budget)
        return self.min_prob * fill

    def propose_batch(self, input_batch, requests, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        k_max = self.draft_len(len(sampled_token_ids))
        min_prob = self.draft_min_prob(len(sampled_token_ids))
        c = self.counters
        drafting = False   # engine steps count only when a request of ours runs (not eval, not others)
        token_ids, num_tokens = input_batch.token_ids_cpu, input_batch.num_tokens_no_spec
        drafts: list[list[int]] = []
        seen = set()
        for i, sampled in enumerate(sampled_token_ids):
            req_id = input_batch.req_ids[i]
            seen.add(req_id)
            live = self._live.get(req_id, 0)
            if live == 0:
                live = self._start(req_id, requests.get(req_id))
            if live is None or not sampled:     # not ours, or a partial prefill
                drafts.append([])
                continue
            start, consumed, last_draft, runahead = live
            drafting = drafting or not runahead
            end = int(num_tokens[i])
            new = token_ids[i, start + consumed:end].tolist()
            if new and runahead:   # feeds the tree; kept out of this rollout's counters
                self.trees.extend(req_id, new)
                live[1] = end - start
                c["runahead_tokens"] += len(sampled)
            elif new:
                self.trees.extend(req_id, new)
                live[1] = end - start
                c["generated_tokens"] += len(sampled)
                c["request_steps"] += 1
                if last_draft:
                    c["accepted_tokens"] += min(len(sampled) - 1, last_draft)
            k = min(k_max, self.max_model_len - end - 1)
            draft = self.trees.propose(req_id, k, min_prob) if k > 0 else []
            live[2] = len(draft)
            c["draft_tokens"] += len(draft)
            drafts.append(draft)
        c["engine_steps"] += drafting
        for req_id in [r for r in self._live if r not in seen]:
            if self._live.pop(req_id) is not None:
                self.trees.finish(req_id)
        return drafts

    def _start(self, req_id: str, state) -> list[int] | None:
        params = getattr(state, "sampling_params", None)
        extra = (params.extra_args or {}) if params is not None else {}
        key = extra.get(DRAFT_KEY)
        if key is None or state.prompt_token_ids is None:
            self._live[req_id] = None
            return None
        prompt = state.prompt_token_ids
        start = int(extra.get(RESPONSE_START, len(prompt)))
        self.trees.start(req_id, str(key), prompt[start:])
        live = self._live[req_id] = [start, len(prompt) - start, 0, int(bool(extra.get(RUNAHEAD)))]
        return live

    # -- driver-side calls (through collective_rpc) -------------------------------------
    def take_stats(self) -> dict[str, float]:
        """Counters since the last call, and the trees' size now."""
        out = {k: float(v) for k, v in self.counters.items()}
        self.counters = dict.fromkeys(_COUNTERS, 0)
        st = self.trees.stats()
        out["nodes"] = float(st["nodes"])
        out["memory_mb"] = st["memory_bytes"] / 2**20
        out["keys"] = float(st["keys"])
        return out

    def state_dict(self) -> dict:
        return self.trees.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trees = DraftTrees.from_state_dict(state)
        self._live.clear()


def settings_env(**overrides) -> str:
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tree proposer settings {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    return json.dumps(dict(DEFAULTS, **overrides))


def in_worker(worker, method: str, *args):
    """Runs inside each vLLM worker (collective_rpc): call a TreeProposer method."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if not isinstance(drafter, TreeProposer):
        raise RuntimeError("this engine was built without the tree proposer (rollout.draft=tree)")
    return getattr(drafter, method)(*args)
