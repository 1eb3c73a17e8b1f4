"""`vllm.SamplingParams` for our requests: a generation request's (tree-drafting and coupled-noise keys in
`extra_args`) and a verification request's (the batched prompt-log-prob patch's keys), and the sampling
settings vLLM would silently change, refused here before a request reaches it.

The keys' readers are vLLM-side: the tree proposer (engines/vllm/tree_proposer.py, through the drafter's
request keys), patches/vllm_0_32_0_coupled_sampling.py and patches/vllm_0_32_0_batched_prompt_logprobs.py.
"""

from __future__ import annotations

from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings, ScoreRequest, untruncated_t1
from megatron_specrl.patches import vllm_0_32_0_batched_prompt_logprobs as verify
from megatron_specrl.rollout.tree_drafting.drafter import DRAFT_KEY, OWN_DRAFT, RESPONSE_START, RUNAHEAD

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


def check_coupled(s: SamplingSettings) -> None:
    """Coupled noise needs a distribution to perturb, and the patch that draws it in the workers."""
    from megatron_specrl.patches import vllm_0_32_0_coupled_sampling
    if s.temperature <= 0:
        raise ValueError(f"coupled sampling needs temperature > 0, got {s.temperature}")
    if not vllm_0_32_0_coupled_sampling.is_applied():
        raise NotImplementedError("coupled sampling needs patches/vllm_0_32_0_coupled_sampling (vLLM 0.32.0)")


def generate_params(req: GenerateRequest, s: SamplingSettings, *, logprobs_mode: str, tree_drafting: bool,
                    seed_requests: bool, undrafted: bool = False):
    """One generation request's SamplingParams. `tree_drafting`: the engine was built with rollout.draft=tree;
    `undrafted`: the request runs without its draft key (a fresh prompt, drafter.fresh_prompts off)."""
    from vllm import SamplingParams

    if logprobs_mode == "raw_logprobs" and s.need_logprobs and not untruncated_t1(s):
        raise NotImplementedError(
            "raw_logprobs ignore temperature, top-k and top-p: sampling with them needs an engine "
            "built with logprobs_mode='processed_logprobs'")
    if s.need_logprobs:
        check_temperature(s, "generate")
    if req.ban_first_token is not None:
        raise NotImplementedError("the vLLM engine has no ban-first-token processor: the exact rule takes "
                                  "its resampled token from score()'s replacements")
    extra = {}
    if req.runahead and (not tree_drafting or req.draft_key is None):
        raise ValueError("a run-ahead request needs tree drafting (rollout.draft=tree) and a draft_key: "
                         "its tokens are only for the prompt's draft tree")
    if req.own_draft is not None and (not tree_drafting or req.draft_key is None):
        raise ValueError("an own draft (rollout.verify=decode) needs tree drafting (rollout.draft=tree) and a "
                         "draft_key: the engine's proposer drafts it")
    if req.draft_key is not None and tree_drafting and not undrafted:
        extra.update({DRAFT_KEY: req.draft_key, RESPONSE_START: req.response_start})
        if req.runahead:
            extra[RUNAHEAD] = True
        if req.own_draft:
            extra[OWN_DRAFT] = [int(t) for t in req.own_draft]
    seed = req.seed if seed_requests else None
    if req.coupled_seed is not None:
        check_coupled(s)
        extra.update({verify.COUPLED_KEY: int(req.coupled_seed), RESPONSE_START: req.response_start})
        seed = None   # the coupled noise replaces vLLM's per-request generator
    return SamplingParams(
        n=1, max_tokens=req.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        seed=seed, logprobs=0, detokenize=False, extra_args=extra or None, flat_logprobs=True,
        skip_clone=True)   # built fresh per request: vLLM's default deep copy (own drafts included) is waste


def check_verification(s: SamplingSettings) -> None:
    """What score() refuses before building a request: no distribution to verify under, a temperature vLLM
    would change, or workers without the patch that computes the verification columns."""
    if s.temperature <= 0:
        raise NotImplementedError(f"score() needs temperature > 0, got {s.temperature} "
                                  "(greedy decoding has no distribution to verify under)")
    check_temperature(s, "score")
    if not verify.is_applied():
        raise NotImplementedError(
            "score() needs patches/vllm_0_32_0_batched_prompt_logprobs (vLLM 0.32.0, not disabled by "
            "SPECRL_VLLM_BATCHED_PROMPT_LOGPROBS=0): vLLM's own prompt log-probs skip temperature and top-p")


def verify_params(req: ScoreRequest, s: SamplingSettings):
    """One verification request's SamplingParams: a prompt-log-prob prefill of prompt + continuation whose
    rows the patch fills with the VERIFY_COLUMNS columns from the continuation's first token on."""
    from vllm import SamplingParams

    args = {verify.VERIFY_KEY: len(req.prompt_ids), verify.SEED_KEY: req.seed}
    if req.coupled_seed is not None:
        check_coupled(s)
        args[verify.COUPLED_KEY] = int(req.coupled_seed)
    # the n samples of a prompt share it: with the patch's capped lookup, a verification reads the
    # prompt's cached blocks (never the continuation's) instead of re-prefilling it
    return SamplingParams(
        max_tokens=1, prompt_logprobs=verify.VERIFY_COLUMNS - 1, detokenize=False, flat_logprobs=True,
        skip_clone=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        skip_reading_prefix_cache=not verify.reads_prefix_cache(), extra_args=args)


def stop_token_ids(llm) -> frozenset[int]:
    """Tokens that end a response in `llm` (a `vllm.LLM`): the tokenizer's EOS and the generation config's
    eos_token_id(s), as vLLM's input processor adds them to every request."""
    from vllm import SamplingParams
    ip = llm.llm_engine.input_processor
    sp = SamplingParams()
    sp.update_from_generation_config(ip.generation_config_fields, ip.renderer.get_eos_token_id())
    return frozenset(sp.all_stop_token_ids)
