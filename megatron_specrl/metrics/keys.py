"""Every key a run writes to its metrics (metrics.jsonl, wandb, the console), with its unit and meaning:
the one registry that docs/metrics.md is generated from.

    python -m megatron_specrl.metrics.keys            # rewrite docs/metrics.md
    python -m megatron_specrl.metrics.keys --check    # exit 1 if docs/metrics.md is stale

A key is exact ("spec/reuse_ratio") or a pattern whose `{name}` part stands for any text
("eval/pass@{n}"). Keys the code builds from a prefix and a name (`f"train/{k}"`) are listed one by
one: `FAMILIES` derives them from the same constants the code iterates over, and the unit tests
(tests/unit/test_metric_keys.py) check that every key the package emits is documented here
and that docs/metrics.md is up to date. Writing the page is a developer tool: its default page is the
checkout's; a wheel install has none and needs --out.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from megatron_specrl.shipped import CHECKOUT

DOC = CHECKOUT / "docs" / "metrics.md" if CHECKOUT is not None else None

# namespace -> (title, where the keys come from)
SECTIONS: dict[str, tuple[str, str]] = {
    "": ("Row", "metrics.MetricsLogger and trainer.train_step"),
    "reward": ("Rewards", "algorithms/rewards_step.score_samples, over the step's training samples"),
    "response": ("Responses", "algorithms/rewards_step.score_samples"),
    "train": ("Policy learner", "trainer.train_step: the policy learner's train_step (learner/worker.py), "
              "averaged over its ppo_epochs x mini_batches optimizer steps"),
    "critic": ("Critic (PPO)", "trainer.train_step and algorithms/ppo.py: the critic's train_step and the batch's "
               "values and returns"),
    "actor": ("KL in the reward", "algorithms/kl_reward.kl_cost (algorithm.use_kl_in_reward)"),
    "dapo": ("DAPO dynamic sampling", "algorithms/dapo.filter_rounds (algorithm.dynamic_sampling)"),
    "spec": ("Speculative rollout", "rollout/speculative.py; DAPO's rounds merged by rollout/dynamic.py "
             "(counters summed, ratios recomputed from the sums)"),
    "tree": ("Tree drafting", "rollout/speculative.tree_metrics, from the engines' draft_stats (rollout.draft=tree)"),
    "tree_calib": ("Tree drafter calibration sums", "rollout/speculative.tree_metrics (rollout/tree_drafting/drafter.Calibration)"),
    "tree_cost": ("Decode-step cost fit sums", "rollout/speculative.tree_metrics (rollout/tree_drafting/drafter.add_step_cost): "
                  "least-squares sums for seconds = a + b x requests + c x draft tokens over the rollout's decode "
                  "steps; r = requests in a step, d = draft tokens it verified, y = its seconds"),
    "draft_model": ("Draft-model drafting", "rollout/speculative.draft_model_metrics (rollout.draft=model), from vLLM's "
                    "spec-decode counters"),
    "runahead": ("Run-ahead", "rollout/speculative.py (rollout.runahead)"),
    "resync": ("Weight resync", "resync/lifecycle.sync_weights, and diagnostics/check.logprob_check every "
               "trainer.check_resync_every steps"),
    "engine": ("Engine recovery", "the run's engine recovery (with_engine_recovery / resync_with_recovery): logged at a "
               "step where a dead engine was restarted"),
    "eval": ("Evaluation", "the run's evaluate() every trainer.eval_every steps (and at step 0): plain generation "
             "on the held-out prompts"),
    "time": ("Timing", "trainer.train_step and run/overlap.step_times"),
    "async": ("Asynchronous rollouts", "run/overlap.staleness (trainer.overlap, trainer.max_staleness)"),
    "refresh": ("Exact overlap's refresh", "rollout/speculative.SpeculativeRollout.refresh via "
                "run/overlap.refresh_rollout (trainer.overlap=exact): logged at a step whose batch was generated "
                "ahead and refreshed under the weights it is trained from"),
}

# key or pattern -> (unit, meaning)
METRICS: dict[str, tuple[str, str]] = {
    # -- the row ---------------------------------------------------------------------------------------
    "step": ("step", "The training step the row belongs to (0: the evaluation before the first step)."),
    "weight_version": ("version", "The policy weight version the engines serve after this step's resync."),
    # -- rewards ---------------------------------------------------------------------------------------
    "reward/mean": ("reward", "Mean shaped reward of the step's samples: the task reward plus DAPO's overlong "
                    "punishment (algorithm.overlong_buffer)."),
    "reward/task_mean": ("reward", "Mean task reward: incorrect_score + (1 - incorrect_score) x the reward "
                         "function's score, before length shaping."),
    "reward/accuracy": ("fraction", "Share of samples whose reward-function score is > 0 (verl's acc)."),
    # -- responses -------------------------------------------------------------------------------------
    "response/mean_len": ("tokens", "Mean response length of the step's samples."),
    "response/max_len": ("tokens", "Longest response of the step (over all DAPO rounds)."),
    "response/clip_ratio": ("fraction", "Share of samples cut at rollout.max_new_tokens (finish reason length)."),
    # -- policy learner --------------------------------------------------------------------------------
    "train/loss": ("1", "The policy objective minimised: pg_loss + kl_coef x kl - entropy_coef x entropy."),
    "train/pg_loss": ("1", "The clipped policy-gradient surrogate (asymmetric clip, dual clip, TIS), aggregated "
                      "by learner.loss.agg_mode."),
    "train/kl": ("nats", "KL(policy || reference) estimate of learner.loss.kl_type, aggregated over response "
                 "tokens (0 without a reference or at kl_coef 0)."),
    "train/entropy": ("nats", "Policy entropy over response tokens (a metric only at entropy_coef 0)."),
    "train/pg_clipfrac": ("fraction", "Share of response tokens whose ratio the PPO clip cut."),
    "train/pg_clipfrac_dual": ("fraction", "Share of response tokens with a negative advantage that the dual "
                               "clip (learner.loss.dual_clip_c) bounded."),
    "train/approx_kl": ("nats", "Mean of old - new log-prob over response tokens: how far the update moved the "
                        "policy from the one that sampled (PPO's approx_kl)."),
    "train/ratio_mean": ("ratio", "Mean importance ratio exp(new - old log-prob) over response tokens."),
    "train/tis_mean": ("ratio", "Mean truncated importance-sampling weight learner / engine probability "
                       "(learner.loss.tis; 1 when off)."),
    "train/grad_norm": ("1", "Global gradient norm before clipping, averaged over the step's optimizer steps."),
    "train/lr": ("1", "Learning rate of this step (after learner.lr_warmup_steps)."),
    "train/rollout_learner_ratio_std": ("ratio", "Spread (std) of the learner / engine probability ratio over "
                                        "response tokens (learner.recompute_old_logprobs): widens where an MoE "
                                        "router picks other experts in the engine than in the learner."),
    "train/moe_load_balancing_loss": ("1", "MoE models: the routers' load-balancing loss before "
                                      "router_aux_loss_coef, mean over layers, microbatches and DP replicas."),
    "train/rollout_learner_logprob_abs_diff": ("nats", "Mean |learner - engine| log-prob of the response tokens "
                                               "(learner.recompute_old_logprobs): the engine/learner mismatch."),
    # -- critic ----------------------------------------------------------------------------------------
    "critic/loss": ("1", "The critic's objective minimised (its value loss)."),
    "critic/vf_loss": ("1", "PPO clipped value loss 0.5 x max((v - R)^2, (v_clipped - R)^2)."),
    "critic/vf_clipfrac": ("fraction", "Share of response tokens where the clipped value term was the larger."),
    "critic/value_mean": ("reward", "Mean value the critic predicted during its update, over response tokens."),
    "critic/grad_norm": ("1", "The critic's gradient norm before clipping."),
    "critic/lr": ("1", "The critic's learning rate this step."),
    "critic/values/mean": ("reward", "Mean value of the rollout batch under the critic before its update (verl's name)."),
    "critic/returns/mean": ("reward", "Mean GAE return of the rollout batch (verl's name)."),
    # -- KL in the reward ------------------------------------------------------------------------------
    "actor/reward_kl_penalty": ("nats", "Mean over responses of each response's per-token KL(policy || reference), "
                                "as subtracted from the reward (verl's name)."),
    "actor/reward_kl_penalty_coeff": ("1", "The KL coefficient beta applied this step (fixed or adaptive "
                                      "controller)."),
    # -- DAPO ------------------------------------------------------------------------------------------
    "dapo/rounds": ("count", "Rollout rounds the dynamic-sampling filter needed this step."),
    "dapo/groups_seen": ("count", "Prompt groups rolled out over those rounds."),
    "dapo/kept_fraction": ("fraction", "Share of the groups seen that the filter kept (informative groups)."),
    # -- speculative rollout ---------------------------------------------------------------------------
    "spec/rollout_s": ("s", "Wall time of the step's rollout (all rounds)."),
    "spec/verify_s": ("s", "Time in the verification batch (engine.score of last epoch's responses)."),
    "spec/extend_s": ("s", "Time in the extension / generation batch."),
    "spec/samples": ("count", "Samples rolled out."),
    "spec/drafts": ("count", "Samples that had a draft (an earlier response) to reuse."),
    "spec/response_tokens": ("tokens", "Tokens of the step's responses."),
    "spec/accepted_tokens": ("tokens", "Draft tokens accepted (reused from last epoch's responses)."),
    "spec/generated_tokens": ("tokens", "Tokens sampled past the reused prefix."),
    "spec/replaced_tokens": ("count", "Samples whose first new token is the verification's replacement draw "
                             "(exact mode)."),
    "spec/verified_tokens": ("tokens", "Draft tokens verified: whole drafts in the prefill, or the own-draft "
                             "tokens the decode loop verified (rollout.verify=decode)."),
    "spec/reuse_ratio": ("fraction", "accepted_tokens / response_tokens: the share of the responses reused."),
    "spec/full_reuses": ("count", "Samples whose whole draft was accepted (no extension needed)."),
    "spec/full_reuse_ratio": ("fraction", "full_reuses / samples."),
    "spec/mean_accept_len": ("tokens", "accepted_tokens / drafts: the mean accepted prefix of a draft."),
    "spec/redraws": ("count", "Samples drawn again without their draft (lenient / coupled: a prompt an earlier "
                     "round of this step already rolled out)."),
    "spec/nonfinite_logprobs": ("count", "Non-finite log-probs (NaN / +inf) the engine returned for drafts; never "
                                "accepted past. Should be 0."),
    "spec/cached_prompt_tokens": ("tokens", "Tokens the generation requests read from the engine's prefix cache."),
    "spec/verify_cached_tokens": ("tokens", "Prompt tokens the verification read from the prefix cache instead of "
                                  "prefilling them."),
    "spec/decode_steps": ("steps", "Engine decode steps of the generation batch (the longest engine's with tree "
                          "drafting, else the longest continuation's tokens)."),
    "spec/lenient_bias": ("probability", "lenient_excess / lenient_accepted_tokens: the mean acceptance "
                          "probability lenient mode adds per accepted token (its bias; lenient only)."),
    "spec/lenient_excess": ("probability", "Sum over accepted tokens of 1 - min(1, p/q): the mass lenient mode "
                            "over-accepts (lenient only)."),
    "spec/lenient_accepted_tokens": ("tokens", "Tokens accepted in lenient mode (lenient_bias's denominator)."),
    "spec/coupled_refreshed": ("count", "Samples whose coupling noise was drawn afresh this step (coupled only)."),
    # -- tree drafting ---------------------------------------------------------------------------------
    "tree/nodes": ("count", "Nodes in the engines' per-prompt draft trees after the step."),
    "tree/memory_mb": ("MB", "Memory the draft trees hold (estimate)."),
    "tree/shared_nodes": ("count", "Nodes in the shared tree of all prompts' responses."),
    "tree/draft_tokens": ("tokens", "Draft tokens the engines verified (accept_rate's denominator)."),
    "tree/proposed_tokens": ("tokens", "Draft tokens the drafter proposed (vLLM's scheduler may verify fewer)."),
    "tree/accepted_tokens": ("tokens", "Tree-draft tokens the engines accepted."),
    "tree/accept_rate": ("fraction", "accepted_tokens / draft_tokens."),
    "tree/own_draft_tokens": ("tokens", "Draft tokens taken from each sample's own previous response "
                              "(rollout.verify=decode)."),
    "tree/shared_draft_tokens": ("tokens", "Draft tokens taken from the shared tree."),
    "tree/generated_tokens": ("tokens", "Tokens the engines generated in drafting decode loops."),
    "tree/request_steps": ("steps", "Sum over requests of the engine steps each ran."),
    "tree/requests": ("count", "Requests of the rollout the drafter saw start (run-ahead ones left out)."),
    "tree/tokens_per_step": ("tokens/step", "generated_tokens / request_steps: tokens a request gains per engine "
                             "step (1 without drafts)."),
    "tree/steps_per_request": ("steps", "request_steps / requests: engine steps a request ran on average."),
    "tree/engine_steps": ("steps", "Engine decode steps, summed over engines."),
    "tree/engine_steps_longest": ("steps", "Decode steps of the longest engine: the rollout's decode loop."),
    "tree/loop_s": ("s", "Seconds of the engines' drafting decode loop (first to last drafting step)."),
    "tree/draft_s": ("s", "Of which the drafter's own seconds."),
    "tree/calibration_prompt": ("ratio", "Prompt-tree calibration: how often the engine's next token was the "
                                "tree's first proposal, over the frequency the tree gave it (1: calibrated)."),
    "tree/calibration_shared": ("ratio", "The same for the shared tree."),
    "tree/undrafted_request_steps": ("steps", "Request steps that proposed no draft (ended requests included)."),
    "tree/threshold_sum": ("probability", "The cost model's acceptance threshold summed over the steps it set one "
                           "(rollout.drafter.cost_model)."),
    "tree/threshold_steps": ("steps", "Engine steps whose drafts the cost model sized."),
    "tree/last_request_steps": ("steps", "Request steps drafted at the threshold of the rollout's predicted last "
                                "request (the longest own draft left; cost_model.DraftCostModel.last_threshold)."),
    "tree/cost_threshold": ("probability", "threshold_sum / threshold_steps: the acceptance probability a draft "
                            "token needed, c x the step's tokens per ms (rollout/tree_drafting/cost_model.py)."),
    "tree/fit_ms": ("ms", "The step-cost fit in effect: ms per engine step (a), mean over engines with one."),
    "tree/fit_ms_per_request": ("ms", "The fit's ms per running request (b)."),
    "tree/fit_ms_per_draft_token": ("ms", "The ms per verified draft token in effect (c): the fit's less two "
                                    "standard errors, what the steps show a draft token costs."),
    "tree/fit_ms_per_draft_token_error": ("ms", "The standard error of the fit's ms per draft token (how much "
                                          "other work on the machine scattered the steps)."),
    "spec/draft_tokens_per_step": ("tokens/step", "tree/draft_tokens / tree/engine_steps: draft tokens an engine "
                                   "step verified."),
    "spec/no_draft_frac": ("fraction", "tree/undrafted_request_steps / tree/request_steps: request steps that "
                           "drafted nothing, of requests that could draft (1 where none could)."),
    "tree_calib/prompt_hits": ("count", "Prompt-tree first proposals the engine's next token matched."),
    "tree_calib/prompt_expected": ("count", "Sum of the frequencies the prompt tree gave its first proposals."),
    "tree_calib/shared_hits": ("count", "Shared-tree first proposals the engine's next token matched."),
    "tree_calib/shared_expected": ("count", "Sum of the frequencies the shared tree gave its first proposals."),
    "tree_cost/n": ("steps", "Decode steps in the fit: sum of 1."),
    "tree_cost/r": ("count", "Sum of r (requests per step)."),
    "tree_cost/d": ("tokens", "Sum of d (draft tokens per step)."),
    "tree_cost/rr": ("count^2", "Sum of r x r."),
    "tree_cost/rd": ("count x tokens", "Sum of r x d."),
    "tree_cost/dd": ("tokens^2", "Sum of d x d."),
    "tree_cost/y": ("s", "Sum of y (seconds per step)."),
    "tree_cost/ry": ("count x s", "Sum of r x y."),
    "tree_cost/dy": ("tokens x s", "Sum of d x y."),
    "tree_cost/yy": ("s^2", "Sum of y x y (the residual, and from it the standard error of c)."),
    # -- draft model -----------------------------------------------------------------------------------
    "draft_model/draft_tokens": ("tokens", "Tokens the draft model proposed and vLLM verified."),
    "draft_model/accepted_tokens": ("tokens", "Draft-model tokens accepted."),
    "draft_model/drafts": ("count", "Drafts (verification chains) the draft model proposed."),
    "draft_model/accept_rate": ("fraction", "accepted_tokens / draft_tokens; falling over a run: the draft model "
                                "going stale as the policy trains."),
    "draft_model/mean_accept_len": ("tokens", "accepted_tokens / drafts."),
    "draft_model/engine_steps": ("steps", "vLLM engine steps of the batch, summed over engines."),
    "draft_model/engine_steps_longest": ("steps", "Engine steps of the longest engine."),
    # -- run-ahead -------------------------------------------------------------------------------------
    "runahead/requests": ("count", "Run-ahead requests sent for the next step's prompts to feed their draft trees."),
    "runahead/tokens": ("tokens", "Tokens the run-ahead requests generated."),
    # -- resync ----------------------------------------------------------------------------------------
    "resync/seconds": ("s", "Wall time of the weight resync learner -> engines."),
    "resync/load_s": ("s", "Of which the engines' load of the weights."),
    "resync/buckets": ("count", "Buckets the weights were sent in (trainer.resync_bucket_mb)."),
    "resync/version": ("version", "Weight version the engines hold after the resync."),
    "resync/logprob_abs_diff": ("nats", "Log-prob check: mean |engine - learner| log-prob over the probe's "
                                "response tokens."),
    "resync/logprob_max_abs_diff": ("nats", "Log-prob check: the largest |engine - learner| difference."),
    "resync/score_logprob_abs_diff": ("nats", "Log-prob check, score path (engine.score) only."),
    "resync/gen_logprob_abs_diff": ("nats", "Log-prob check, generate path only."),
    "resync/probe_tokens": ("tokens", "Response tokens the log-prob check compared."),
    "resync/logprob_check_failed": ("flag", "1 when the log-prob check's mean difference exceeded the engine "
                                    "dtype's tolerance (or compared nothing), else 0."),
    # -- engine recovery -------------------------------------------------------------------------------
    "engine/restarts": ("count", "1 at a step whose rollout met a dead engine: restarted, resynced and retried."),
    "engine/resync_restarts": ("count", "1 at a step whose resync met a dead engine: restarted and synced again."),
    # -- eval ------------------------------------------------------------------------------------------
    "eval/accuracy": ("fraction", "Share of held-out samples scored > 0 (mean@n over rollout.val_kwargs.n samples)."),
    "eval/reward_mean": ("reward", "Mean reward-function score over the held-out samples."),
    "eval/pass@{n}": ("fraction", "Share of held-out prompts with a correct sample among n (n > 1 only)."),
    # -- timing ----------------------------------------------------------------------------------------
    "time/step_s": ("s", "Wall time of the training step: rollout, scoring, learning and resync."),
    "time/train_s": ("s", "Of which the learner's (and critic's) train steps."),
    "time/rollout_s": ("s", "The step's rollout and scoring, in this step or, with trainer.overlap, beside "
                            "the previous step's training."),
    "time/overlap_s": ("s", "Seconds the next step's rollout ran beside this step's training "
                            "(trainer.overlap; 0 in the synchronous loop)."),
    "time/learner_idle_s": ("s", "Seconds of the step in which the learner did not train (it waited for the "
                                 "rollout, the driver or the resync)."),
    "time/engine_idle_s": ("s", "Seconds of the step in which the engines generated nothing (training they did "
                                "not overlap, the resync, the driver's work)."),
    "time/refresh_s": ("s", "The exact overlap's refresh of the step's batch: verification, re-decoding and "
                            "scoring again (trainer.overlap=exact; part of time/step_s)."),
    "time/fill_rounds_s": ("s", "The exact overlap with DAPO's dynamic sampling: its filter on the refreshed "
                                "batch and the rounds it generated after it under the current weights (part of "
                                "time/step_s; 0: the refreshed round was enough)."),
    # -- the exact overlap's refresh (trainer.overlap=exact) --------------------------------------------
    "refresh/kept_token_frac": ("fraction", "Of the response tokens generated ahead, those the refresh kept: each "
                                "response up to its first coupled draw that changed under the new weights."),
    "refresh/changed_sample_frac": ("fraction", "Share of samples whose response the refresh changed."),
    "refresh/generated_tokens": ("tokens", "Tokens the refresh decoded past the kept prefixes."),
    "refresh/decode_steps": ("steps", "Engine decode steps of the refresh's generation batch (against "
                             "spec/decode_steps, the rollout's)."),
    "refresh/verify_s": ("s", "The refresh's verification prefill."),
    "refresh/extend_s": ("s", "The refresh's generation batch (its longest re-decoded tail sets it)."),
    # -- asynchronous rollouts (trainer.overlap, trainer.max_staleness) --------------------------------
    "async/staleness_mean": ("versions", "Mean over the trained samples of the weight versions between the "
                                         "weights that generated them and those the learner trained from."),
    "async/staleness_max": ("versions", "Largest such lag in the step's batch (never above trainer.max_staleness; 0 with "
                                        "trainer.overlap=exact)."),
}


def families() -> dict[str, list[str]]:
    """The keys the code builds from a prefix and a name (f-strings in the package), from the constants
    it iterates over: prefix -> keys (each must be documented in METRICS)."""
    from megatron_specrl.rollout.tree_drafting.drafter import CALIBRATION_SUMS, SOURCES, STEP_COST_SUMS
    from megatron_specrl.learner.worker import CRITIC_METRICS, POLICY_METRICS
    return {
        # LearnerWorker.train_step: the reduced loss metrics, grad_norm (_reduce_metrics), lr, and for
        # the policy the engine/learner log-prob difference
        "train/": [f"train/{k}" for k in (*POLICY_METRICS, "grad_norm", "lr", "rollout_learner_logprob_abs_diff",
                                          "rollout_learner_ratio_std", "moe_load_balancing_loss")],
        "critic/": [f"critic/{k}" for k in (*CRITIC_METRICS, "grad_norm", "lr")],
        "tree/calibration_": [f"tree/calibration_{s}" for s in SOURCES],
        "tree_calib/": [f"tree_calib/{k.removeprefix('calib_')}" for k in CALIBRATION_SUMS],
        "tree_cost/": [f"tree_cost/{k.removeprefix('cost_')}" for k in STEP_COST_SUMS],
        "eval/pass@": ["eval/pass@{n}"],
    }


def _pattern(key: str) -> re.Pattern:
    return re.compile("".join(".+" if part.startswith("{") else re.escape(part)
                              for part in re.split(r"(\{[^}]*\})", key) if part) + "$")


_PATTERNS = [(k, _pattern(k)) for k in METRICS if "{" in k]


def lookup(key: str) -> str | None:
    """The registry entry documenting `key` (itself, or the pattern it matches), or None."""
    if key in METRICS:
        return key
    return next((k for k, p in _PATTERNS if p.match(key)), None)


def undocumented(keys) -> list[str]:
    """The keys of `keys` that no registry entry documents, sorted."""
    return sorted({k for k in keys if lookup(k) is None})


def namespace(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else ""


def render() -> str:
    """docs/metrics.md."""
    missing = sorted({namespace(k) for k in METRICS} - set(SECTIONS))
    if missing:
        raise ValueError(f"metric namespaces without a SECTIONS entry: {missing}")
    lines = ["# Metrics", "",
             "<!-- Generated by `python -m megatron_specrl.metrics.keys` from megatron_specrl/metrics/keys.py; "
             "do not edit by hand. -->", "",
             "Every key a training run writes to `<output_dir>/metrics.jsonl` (one JSON row per step) and to "
             "wandb, with its unit and meaning. Counters are sums over the step (over every DAPO round and "
             "every engine); ratios are recomputed from those sums. A key appears only in steps where its "
             "feature ran (a rollout mode, tree drafting, PPO, an evaluation step, ...). `{n}` in a key stands "
             "for a number.", "",
             "Units: `s` seconds, `tokens` token counts, `count` plain counts, `fraction` a share in [0, 1], "
             "`nats` natural-log units of log-probabilities, KL and entropy, `reward` the reward function's "
             "scale, `1` dimensionless.", ""]
    by_ns: dict[str, list[str]] = {}
    for k in METRICS:
        by_ns.setdefault(namespace(k), []).append(k)
    lines.append("| section | keys |")
    lines.append("|---|---|")
    for ns, (title, _) in SECTIONS.items():
        if ns in by_ns:
            anchor = re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")
            lines.append(f"| [{title}](#{anchor}) | {len(by_ns[ns])} |")
    lines.append("")
    for ns, (title, source) in SECTIONS.items():
        if ns not in by_ns:
            continue
        lines += [f"## {title}", "", f"From {source}.", "", "| key | unit | meaning |", "|---|---|---|"]
        for k in by_ns[ns]:
            unit, meaning = METRICS[k]
            lines.append(f"| `{k}` | {unit} | {meaning.replace('|', chr(92) + '|')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_specrl.metrics.keys", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DOC, required=DOC is None,
                   help="the page to write (default: the checkout's docs/metrics.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page differs")
    args = p.parse_args(argv)
    out, text = Path(args.out), render()
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} is stale: run python -m megatron_specrl.metrics.keys", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}: {len(METRICS)} keys")
    return 0


if __name__ == "__main__":
    sys.exit(main())
