"""vLLM speculative-decoding proposer that drafts from per-prompt trees of earlier responses (SRT).

Lives inside the engine's worker (vLLM builds it from `speculative_config={"method":
"custom_class", "model": PROPOSER_CLASS}`, engines/vllm/args.py), and is called
once per engine step through `patches/vllm_0_32_0_tree_proposer.py` with the input batch:

- a request opts in with `SamplingParams.extra_args = {DRAFT_KEY: prompt id, RESPONSE_START: n}`:
  all samples of a prompt share one tree (rollout.tree_drafting.trees.DraftTrees), and the response
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
The scheduler verifies a draft in the next step and may cut it to the step's token budget or
max_model_len (or drop it, preempting the request); the runner's `InputBatch.spec_token_ids` says what
it scheduled, and the drafter counts those tokens as drafted (`verified_count`).

The bookkeeping (per-request state, draft length rules, counters) is engine-independent and lives in
rollout/tree_drafting/drafter.py, shared with SGLang's NGRAM worker patch; this class only reads vLLM's batch.

Settings come from the environment variable SPECRL_TREE_PROPOSER: rollout.drafter (config.DrafterConfig)
whole as JSON (rollout/tree_drafting/drafter.settings_env), set by VLLMEngine before it builds the LLM, so multiprocess
workers inherit it; read_settings gives it back, the drafter's defaults being DrafterConfig's.
"""

from __future__ import annotations

import os

from megatron_specrl.rollout.tree_drafting.drafter import DRAFT_KEY, TreeDrafter, opts_from_params, read_settings

SETTINGS_ENV = "SPECRL_TREE_PROPOSER"
# vLLM builds the proposer from this dotted path (llm_args: speculative_config "custom_class")
PROPOSER_CLASS = "megatron_specrl.engines.vllm.tree_proposer.TreeProposer"


class TreeProposer:
    """vLLM's side only: reads the input batch and hands each request to the shared TreeDrafter."""

    specrl_batch_proposer = True   # the patch calls propose_batch with the input batch

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.drafter = TreeDrafter(int(spec.num_speculative_tokens), int(vllm_config.model_config.max_model_len),
                                   read_settings(os.environ.get(SETTINGS_ENV)))
        if getattr(self.drafter.trees, "compiled", False):   # numba's kernels now, not in the first rollout
            from megatron_specrl.rollout.tree_drafting.compiled_trees import load_kernels
            load_kernels()

    @property
    def trees(self):
        return self.drafter.trees

    @property
    def max_k(self) -> int:
        return self.drafter.max_k

    def load_model(self, *args, **kwargs) -> None:   # no draft model
        pass

    def propose(self, *args, **kwargs):
        """vLLM's own custom_class call, which carries no request ids: only reached without the patch."""
        raise RuntimeError("TreeProposer needs patches/vllm_0_32_0_tree_proposer.py applied in this process")

    def draft_len(self, running: int) -> int:
        return self.drafter.draft_len(running)

    def draft_min_prob(self, running: int) -> float:
        return self.drafter.draft_min_prob(running)

    def holds_requests(self) -> bool:
        """Whether a request that opted in is still the drafter's (patches/vllm_0_32_0_tree_proposer's
        plain steps need none: the drafter releases an ended request only in a step it sees)."""
        return self.drafter.holds_requests()

    @staticmethod
    def opts_in(params) -> bool:
        """Whether a request with these SamplingParams asked for tree drafts (its DRAFT_KEY; an own draft
        and run-ahead come with it): a step without one has nothing to draft."""
        return DRAFT_KEY in (getattr(params, "extra_args", None) or {})

    def propose_batch(self, input_batch, requests, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        d = self.drafter
        d.begin_step(len(sampled_token_ids))
        token_ids, num_tokens = input_batch.token_ids_cpu, input_batch.num_tokens_no_spec
        scheduled = getattr(input_batch, "spec_token_ids", None)
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            req_id = input_batch.req_ids[i]
            draft = d.request(req_id, lambda: self._opts(requests.get(req_id)),
                              lambda a, b: token_ids[i, a:b].tolist(), int(num_tokens[i]), len(sampled),
                              None if scheduled is None else verified_count(scheduled[i]))
            drafts.append(draft or [])
        d.end_step(requests)   # the runner's request states: it drops a request's only when it finished
        return drafts

    @staticmethod
    def _opts(state):
        params = getattr(state, "sampling_params", None)
        prompt = getattr(state, "prompt_token_ids", None)
        if params is None or prompt is None:
            return None
        # where vLLM's scheduler ends the request (vllm.v1.core.sched.utils.check_stop): its runner hands
        # over every sampled token, also those past a stop token or max_tokens
        stops = [getattr(params, "eos_token_id", None), *(getattr(params, "stop_token_ids", None) or ())]
        return opts_from_params(params.extra_args, len(prompt), getattr(params, "max_tokens", None), stops)

    # -- driver-side calls (through collective_rpc) -------------------------------------
    def calls(self, calls: list[tuple[str, tuple]]) -> list:
        """Several of the calls below in order, in one round trip from the driver (through the engine
        core to this worker): VLLMEngine sends the responses it holds for the trees first
        (add_responses), with the call that needs them."""
        return [getattr(self, method)(*args) for method, args in calls]

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call, and the trees' size now."""
        return self.drafter.take_stats()

    def keys_held(self, keys: list[str]) -> list[bool]:
        """Whether each prompt's tree holds anything (an earlier response, or one in flight)."""
        return [self.drafter.trees.has_key(k) for k in keys]

    def add_responses(self, responses: list[tuple[str, list[int]]]) -> None:
        """Whole responses the engine did not generate (TreeDrafter.add_responses)."""
        self.drafter.add_responses(responses)

    def state_dict(self) -> dict:
        return self.drafter.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.drafter.load_state_dict(state)


def verified_count(spec_token_ids) -> int:
    """How many draft tokens this step verified for a request: vLLM's runner keeps the draft tokens the
    scheduler scheduled in this step (`InputBatch.spec_token_ids`, set from
    `scheduler_output.scheduled_spec_decode_tokens` in `_update_states`): our last draft for the request,
    cut to the step's token budget or max_model_len, empty where the scheduler dropped it (a preempted
    request). Structured output pads tokens its grammar rejects with -1 (not verified)."""
    n = 0
    for t in spec_token_ids:
        if t < 0:
            break
        n += 1
    return n


def in_worker(worker, method: str, *args):
    """Runs inside each vLLM worker (collective_rpc): call a TreeProposer method."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if not isinstance(drafter, TreeProposer):
        raise RuntimeError("this engine was built without the tree proposer (rollout.draft=tree)")
    return getattr(drafter, method)(*args)
