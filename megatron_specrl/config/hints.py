"""Hints for unknown config keys: verl's names for our keys, and near misses.

Users come from verl and type its names (`trainer.test_freq`, `actor_rollout_ref.rollout.n`); an
unknown-key error that only repeats the key sends them to the README's tables. `hint(key, known)`
names our key instead: from verl's name (the map below, taken from verl's `ppo_trainer.yaml` and
its DAPO recipe; a key given without verl's `actor_rollout_ref.` prefix is looked up with it too, and
one that is ours under that prefix, `actor_rollout_ref.rollout.temperature`, is ours without it),
else from the same leaf name elsewhere in the schema (`trainer.lr` -> `learner.lr`), else from the
closest spelling (difflib). The names are hints, not aliases: one spelling per setting in recipes.
"""

from __future__ import annotations

import difflib

# verl key -> ours (an entry's text after the key, if any, says how the value carries over)
VERL_NAMES: dict[str, str] = {
    "data.train_files": "data.source",
    "data.val_files": "data.eval_source",
    "data.train_batch_size": "trainer.prompts_per_step",
    "data.max_prompt_length": "data.max_prompt_len",
    "data.max_response_length": "rollout.max_new_tokens",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.actor.optim.lr": "learner.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "learner.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.weight_decay": "learner.weight_decay",
    "actor_rollout_ref.actor.grad_clip": "learner.grad_clip",
    "actor_rollout_ref.actor.ppo_epochs": "learner.ppo_epochs",
    "actor_rollout_ref.actor.ppo_mini_batch_size":
        "learner.mini_batches (optimizer steps a batch: trainer.prompts_per_step / verl's ppo_mini_batch_size)",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "learner.micro_batch_size",
    "actor_rollout_ref.actor.use_dynamic_bsz": "learner.max_tokens_per_microbatch (set: token-budget microbatches)",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "learner.max_tokens_per_microbatch",
    "actor_rollout_ref.actor.clip_ratio": "learner.loss.clip_low and learner.loss.clip_high",
    "actor_rollout_ref.actor.clip_ratio_low": "learner.loss.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "learner.loss.clip_high",
    "actor_rollout_ref.actor.clip_ratio_c": "learner.loss.dual_clip_c",
    "actor_rollout_ref.actor.loss_agg_mode": "learner.loss.agg_mode",
    "actor_rollout_ref.actor.entropy_coeff": "learner.loss.entropy_coef",
    "actor_rollout_ref.actor.use_kl_loss": "learner.loss.kl_coef (> 0 turns the KL loss on)",
    "actor_rollout_ref.actor.kl_loss_coef": "learner.loss.kl_coef",
    "actor_rollout_ref.actor.kl_loss_type": "learner.loss.kl_type",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "learner.tp",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "learner.pp",
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer": "learner.distributed_optimizer",
    "actor_rollout_ref.rollout.name": "rollout.engine",
    "actor_rollout_ref.rollout.n": "rollout.n_samples",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.engine_tp",
    "actor_rollout_ref.rollout.dtype": "rollout.engine_dtype",
    "actor_rollout_ref.rollout.response_length": "rollout.max_new_tokens",
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_len",
    "critic.optim.lr": "algorithm.critic_lr",
    "critic.optim.lr_warmup_steps": "algorithm.critic_lr_warmup_steps",
    "critic.optim.weight_decay": "algorithm.critic_weight_decay",
    "critic.grad_clip": "algorithm.critic_grad_clip",
    "critic.cliprange_value": "learner.loss.value_clip",
    "algorithm.adv_estimator": "algorithm.name (grpo, dapo; verl's gae: ppo)",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.normalize_std",
    "algorithm.filter_groups.enable": "algorithm.dynamic_sampling",
    "algorithm.filter_groups.metric": "algorithm.filter_metric",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.max_sampling_tries",
    "reward_model.overlong_buffer.enable": "algorithm.overlong_buffer (> 0 turns it on)",
    "reward_model.overlong_buffer.len": "algorithm.overlong_buffer",
    "reward_model.overlong_buffer.penalty_factor": "algorithm.overlong_penalty",
    "custom_reward_function.path": "reward.name (a dotted path package.module.function)",
    "custom_reward_function.name": "reward.name (a dotted path package.module.function)",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.total_epochs": "trainer.total_steps (steps: an epoch is the prompts / trainer.prompts_per_step)",
    "trainer.val_before_train": "trainer.eval_every (> 0 also evaluates before the first step)",
    "trainer.test_freq": "trainer.eval_every",
    "trainer.save_freq": "trainer.checkpoint_every",
    "trainer.max_actor_ckpt_to_keep": "trainer.keep_checkpoints",
    "trainer.resume_mode": "trainer.resume (auto, never or a checkpoint path)",
    "trainer.resume_from_path": "trainer.resume (a checkpoint path)",
    "trainer.default_local_dir": "output_dir",
    "trainer.project_name": "logging.project",
    "trainer.experiment_name": "logging.run_name",
    "trainer.logger": "logging.wandb",
    "trainer.nnodes": "cluster.nodes",
    "trainer.n_gpus_per_node": "cluster.gpus_per_node",
}
_VERL_PREFIX = "actor_rollout_ref."

# Our own keys that were renamed: refused with the new name (one spelling per setting)
RENAMED: dict[str, str] = {
    f"rollout.draft_{old}": f"rollout.drafter.{new}" for old, new in (
        ("tokens", "tokens"), ("min_prob", "min_prob"), ("token_budget", "token_budget"),
        ("max_nodes", "max_nodes"), ("shared_nodes", "shared_nodes"), ("calibrate", "calibrate"),
        ("fresh_prompts", "fresh_prompts"), ("impl", "impl"))
}


def renamed(key: str) -> str:
    """'<key> was renamed: use <new key>' for one of our renamed keys, else ''."""
    return f"{key} was renamed: use {RENAMED[key]}" if key in RENAMED else ""


def schema_keys(model) -> list[str]:
    """Every dotted key of a pydantic model: nested models are walked, any other field is a leaf."""
    keys = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            keys += [f"{name}.{k}" for k in schema_keys(sub)]
        else:
            keys.append(name)
    return keys


def leaf_keys(key: str, value) -> list[str]:
    """The dotted leaves under an unknown key: pydantic reports `actor_rollout_ref` for
    `actor_rollout_ref.rollout.n=8`, with the subtree as its value."""
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in leaf_keys(f"{key}.{k}", v)]
    return [key]


def hint(key: str, known: list[str]) -> str:
    """A parenthesised hint naming our key for an unknown one, or '' when none is close."""
    for name in (key, _VERL_PREFIX + key):
        if name in VERL_NAMES:
            return f" (verl's name; here: {VERL_NAMES[name]})"
    if key.startswith(_VERL_PREFIX) and key.removeprefix(_VERL_PREFIX) in known:   # verl's rollout.* keys
        return f" (verl's name; here: {key.removeprefix(_VERL_PREFIX)})"
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
    close = same_leaf[:1] or difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""
