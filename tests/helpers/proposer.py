"""A fake vLLM input batch and a TreeProposer driven by it, as the patched runner drives it."""

from __future__ import annotations

from types import SimpleNamespace
import numpy as np
from megatron_specrl.rollout.tree_drafting import drafter as td
from megatron_specrl.engines.vllm import tree_proposer as tp
from tests.helpers.trees import sequences  # noqa: F401


EOS = 2


def _proposer(monkeypatch, k=8, max_model_len=256, **settings):
    monkeypatch.setenv(tp.SETTINGS_ENV, td.settings_env(**settings))
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                          model_config=SimpleNamespace(max_model_len=max_model_len))
    return tp.TreeProposer(cfg)


class Batch:
    """The runner's view: token rows, no-spec lengths, request ids; requests carry extra_args."""

    def __init__(self):
        self.token_ids_cpu = np.zeros((4, 256), dtype=np.int64)
        self.num_tokens_no_spec = np.zeros(4, dtype=np.int64)
        self.req_ids, self.requests = [], {}

    def add(self, req_id, prompt, key, response_start=None, own=None, max_tokens=None, stop_token_ids=None):
        """With max_tokens: vLLM's own SamplingParams (its EOS and stop tokens, as the input processor sets them)."""
        i = len(self.req_ids)
        self.req_ids.append(req_id)
        self.token_ids_cpu[i, :len(prompt)] = prompt
        self.num_tokens_no_spec[i] = len(prompt)
        extra = None if key is None else {td.DRAFT_KEY: key, td.RESPONSE_START: response_start or len(prompt)}
        if own is not None:
            extra[td.OWN_DRAFT] = list(own)
        params = SimpleNamespace(extra_args=extra)
        if max_tokens is not None:
            from vllm import SamplingParams
            params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids, extra_args=extra)
            params.update_from_generation_config({}, EOS)
        self.requests[req_id] = SimpleNamespace(prompt_token_ids=list(prompt), sampling_params=params)

    def sample(self, i, tokens):
        n = self.num_tokens_no_spec[i]
        self.token_ids_cpu[i, n:n + len(tokens)] = tokens
        self.num_tokens_no_spec[i] = n + len(tokens)
        return list(tokens)


