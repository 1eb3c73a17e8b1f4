"""The shipped recipes against their stated sources (DAPO, arXiv 2503.14476, and verl's recipe/dapo
run_dapo_qwen2.5_32b.sh), every recipe's own dry-run, and README's config tables against the schema:
a key documented but not in config/schema.py, or in config/schema.py but documented nowhere / read by nothing.
"""

from __future__ import annotations
import ast
import pytest
from megatron_specrl.cli import main
from megatron_specrl.config import AlgorithmConfig, LearnerConfig, LossConfig, RolloutConfig, load_config
from tests.helpers.docs_tables import _config_tables, _documented_keys  # noqa: F401
from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
RECIPES = sorted(p.stem for p in (ROOT / "examples").glob("*.yaml"))
CLUSTER_DAPO = ["qwen2.5-7b-dapo-1node", "qwen2.5-32b-dapo-4node", "llama-3.1-70b-dapo-8node",
                "qwen3-8b-dapo-1node", "qwen3-30b-a3b-dapo-3node"]
SECTIONS = {"rollout": RolloutConfig, "learner": LearnerConfig, "algorithm": AlgorithmConfig,
            "learner.loss": LossConfig}


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)   # the cluster recipes' model / data defaults are relative to the repository


def test_every_shipped_recipe_is_listed():
    assert set(CLUSTER_DAPO) <= set(RECIPES) and any(r.startswith("tiny-cpu-") for r in RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_passes_its_own_dry_run(recipe, capsys):
    assert main(["train", recipe, "--dry-run"]) == 0, capsys.readouterr()


@pytest.mark.parametrize("recipe", CLUSTER_DAPO)
def test_cluster_dapo_recipes_use_the_published_dapo_settings(recipe):
    cfg = load_config(ROOT / "examples" / f"{recipe}.yaml")
    r, le, lc, alg = cfg.rollout, cfg.learner, cfg.learner.loss, cfg.algorithm
    # verl recipe/dapo: clip_ratio_low/high 0.2/0.28, clip_ratio_c 10.0, token-mean, no KL, no entropy
    assert (lc.clip_low, lc.clip_high, lc.dual_clip_c) == (0.2, 0.28, 10.0)
    assert lc.agg_mode == "token-mean" and lc.kl_coef == 0.0 and lc.entropy_coef == 0.0
    # optim.lr 1e-6, lr_warmup_steps 10, weight_decay 0.1, grad_clip 1.0, ppo_epochs 1
    assert (le.lr, le.lr_warmup_steps, le.weight_decay, le.grad_clip, le.ppo_epochs) == (1e-6, 10, 0.1, 1.0, 1)
    # sampling: temperature 1, top_p 1, top_k -1, n 16
    assert (r.temperature, r.top_p, r.top_k, r.n_samples) == (1.0, 1.0, -1, 16)
    # DAPO's group filter and soft overlong punishment (penalty 1.0, buffer <= 4096, within L)
    assert alg.name == "dapo" and alg.dynamic_sampling and alg.normalize_std
    assert alg.overlong_penalty == 1.0 and 0 < alg.overlong_buffer <= 4096
    assert alg.overlong_buffer <= r.max_new_tokens // 4
    # verl's filter budget: max_num_gen_batches 10 of gen_batch_size = 3 x train_batch_size (4 rounds of
    # one train batch would stop a base-model run whose early kept fraction is below 1/4)
    assert cfg.trainer.gen_prompts_per_step == 3 * cfg.trainer.prompts_per_step
    assert alg.max_sampling_tries == 10


@pytest.mark.parametrize("recipe", CLUSTER_DAPO)
def test_cluster_recipes_give_long_generations_more_than_the_default_engine_timeout(recipe):
    cfg = load_config(ROOT / "examples" / f"{recipe}.yaml")
    default = RolloutConfig.model_fields["engine_timeout_s"].default
    assert cfg.rollout.engine_timeout_s > default and cfg.rollout.max_new_tokens >= 8192


@pytest.mark.parametrize("recipe", ["qwen3-8b-dapo-1node", "qwen3-30b-a3b-dapo-3node"])
def test_qwen3_recipes_use_verls_qwen3_dapo_lengths(recipe):
    """verl recipe/dapo's Qwen3 scripts: max_prompt_length 2048, max_response_length 8192."""
    cfg = load_config(ROOT / "examples" / f"{recipe}.yaml")
    assert (cfg.data.max_prompt_len, cfg.rollout.max_new_tokens) == (2048, 8192)
    assert cfg.rollout.max_model_len == 2048 + 8192


def test_the_moe_recipe_splits_its_experts_and_its_page_names_the_token_dispatcher():
    """The Qwen3-30B-A3B recipe trains with expert parallelism, bf16 and the distributed optimizer; its
    page names the dispatcher the learner's TransformerConfig uses, and the CPU path's."""
    from megatron_specrl.plan import load_hf_config
    from megatron_specrl.learner.model_provider import transformer_config_from_hf
    cfg = load_config(ROOT / "examples" / "qwen3-30b-a3b-dapo-3node.yaml")
    le = cfg.learner
    assert le.ep > 1 and le.dp % le.ep == 0 and le.precision == "bfloat16" and le.distributed_optimizer
    tc = transformer_config_from_hf(load_hf_config(cfg.model.path), use_cpu=True)
    page = (ROOT / "docs" / "recipes" / "qwen3-30b-a3b-dapo-3node.md").read_text()
    assert "**alltoall** token dispatcher" in page and tc.moe_token_dispatcher_type == "alltoall"
    assert "On CPU over gloo the learner runs the same alltoall dispatcher with\nMegatron's local (SequentialMLP) " \
           "experts" in page
    assert f"TP {le.tp} x PP {le.pp} x DP {le.dp} = {le.tp * le.pp * le.dp} GPUs" in page and f"**EP {le.ep}**" in page






def test_every_schema_key_is_read_outside_the_schema():
    """A key nothing reads does nothing: look for `.key` attribute reads in the package (the schema, config/schema.py, aside)."""
    read: set[str] = set()
    for path in (ROOT / "megatron_specrl").rglob("*.py"):
        if path.relative_to(ROOT).as_posix() == "megatron_specrl/config/schema.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
    unread = sorted(f"{s}.{k}" for s, cls in SECTIONS.items() for k in cls.model_fields if k not in read)
    assert not unread, f"schema keys no module reads: {unread}"
