"""vLLM v1 logits processor that bans one token at the first generated position.

The exact speculative rule resamples the first rejected position from the new
policy with the rejected draft token y_n excluded; every later position is an
ordinary sample. A request opts in with `SamplingParams(extra_args={BAN_KEY: y_n})`.

The processor is not argmax-invariant, so vLLM applies it in
`Sampler.apply_logits_processors`, i.e. *after* the raw log-probs are computed
(`logprobs_mode="raw_logprobs"`, vLLM's default). The reported log-prob of the
first token is therefore its probability under the unbanned policy, which is
what the learner must train on.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

BAN_KEY = "specrl_ban_first_token"


class BanFirstTokenLogitsProcessor(LogitsProcessor):
    """Sets logit[y] = -inf for requests that carry `extra_args[BAN_KEY] = y`
    while they have produced no output token yet."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        tok = (sampling_params.extra_args or {}).get(BAN_KEY)
        if tok is not None and (not isinstance(tok, int) or tok < 0):
            raise ValueError(f"{BAN_KEY} must be a non-negative token id, got {tok!r}")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        # batch index -> (banned token id, live reference to the request's output ids)
        self.bans: dict[int, tuple[int, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy picks too, and must run before temperature

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params: SamplingParams, _prompt, output_ids):
            tok = (params.extra_args or {}).get(BAN_KEY)
            return None if tok is None else (int(tok), output_ids)

        process_dict_updates(self.bans, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.bans:
            return logits
        rows, cols = [], []
        for index, (tok, output_ids) in self.bans.items():
            if len(output_ids) == 0 and index < logits.shape[0] and tok < logits.shape[1]:
                rows.append(index)
                cols.append(tok)
        if rows:
            logits[rows, cols] = float("-inf")
        return logits
