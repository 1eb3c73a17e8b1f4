"""The plan check: the shipped cluster recipes pass it, each broken variant fails with its named
reason (one line, exit 2) in `train --dry-run` and in `launch` (before a script is written), and the
memory estimate's parameter, gradient and optimizer bytes equal a real learner's.

The plan's activation estimate for a bf16 learner on Megatron's local spec (CPU, or a GPU without
TransformerEngine) counts what that spec keeps in fp32: the RMSNorms' tensors and the unfused attention's
fp32 softmax beside its bf16 copy. Without that term the estimate was 39% below the bytes autograd saves
here and 13% below a 0.5B learner's training peak on an H200 (2026-11-28).

Review of launch / plan / the cluster recipes: layouts the plan refused that vLLM runs, transports the
plan let through that the run refuses after the queue, #SBATCH values sbatch reads differently from
what launch meant, and recipe pages that disagree with their recipes.
"""

from __future__ import annotations
import json
from pathlib import Path
import pytest
import torch
from megatron_specrl.cli import main
from megatron_specrl.config import load_config
from megatron_specrl.plan import (
    GB,
    ModelShape,
    build_plan,
    load_hf_config,
)
import re
from megatron_specrl.cluster.launch import launch_main
from megatron_specrl.plan import PlanError
from tests.helpers.paths import REPO_ROOT



# ---- The plan check: the shipped cluster recipes pass it, each broken variant fails with its named

ROOT = REPO_ROOT
CLUSTER_RECIPES = ["qwen2.5-7b-dapo-1node", "qwen2.5-32b-dapo-4node", "llama-3.1-70b-dapo-8node",
                   "qwen3-8b-dapo-1node", "qwen3-30b-a3b-dapo-3node"]
# the published checkpoints' parameter counts (their safetensors)
MODELS = {"qwen2.5-7b": 7.615616512e9, "qwen2.5-32b": 32.763876352e9, "llama-3.1-70b": 70.553706496e9,
          "qwen3-8b": 8.190735360e9, "qwen3-30b-a3b": 30.532122624e9}
ACTIVE = {"qwen3-30b-a3b": 3.353032704e9}   # Qwen3-30B-A3B: "3.3B activated" (8 of 128 experts a layer)


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)   # the recipes' default model and data paths are relative to the repository


@pytest.mark.parametrize("recipe", CLUSTER_RECIPES)
def test_cluster_recipes_pass_the_dry_run(recipe, capsys):
    assert main(["train", recipe, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "learner memory / GPU" in out and "engine KV for the batch" in out
    cfg = load_config(ROOT / "examples" / f"{recipe}.yaml")
    assert cfg.algorithm.name == "dapo" and cfg.rollout.spec_mode == "exact"
    assert 0 < cfg.algorithm.overlong_buffer < cfg.rollout.max_new_tokens
    plan = build_plan(cfg)
    assert plan.learner.total <= cfg.cluster.gpu_memory_gb * GB


@pytest.mark.parametrize("model, params", MODELS.items())
def test_shipped_model_shapes_have_the_published_sizes(model, params):
    from megatron_specrl.plan import full_parameters
    s = ModelShape.from_hf(load_hf_config(f"examples/models/{model}"))
    assert full_parameters(s) == params
    assert full_parameters(s, active=True) == ACTIVE.get(model, params)   # a dense model: all of them active


@pytest.mark.parametrize("recipe", CLUSTER_RECIPES)
def test_cluster_recipes_render_their_launch_scripts(recipe, tmp_path):
    """`launch` runs the plan and renders the job with the recipe's nodes and GPUs, the plan beside it
    (tests/e2e/test_launch.py runs bash -n and shellcheck on rendered scripts)."""
    script = tmp_path / "job.sbatch"
    assert launch_main([recipe, f"output_dir={tmp_path / 'out'}", "--out", str(script)]) == 0
    text = script.read_text()
    cfg = load_config(ROOT / "examples" / f"{recipe}.yaml")
    sbatch = _sbatch_lines(text)
    assert sbatch["#SBATCH --nodes"] == [f"--nodes={cfg.cluster.nodes}"]
    assert sbatch["#SBATCH --gpus-per-node"] == [f"--gpus-per-node={cfg.cluster.gpus_per_node}"]
    assert f"RECIPE={ROOT / 'examples' / f'{recipe}.yaml'}" in text or f"{recipe}.yaml" in text
    plan = script.with_suffix(".plan.txt").read_text()
    assert plan.startswith("model: ") and "learner memory / GPU" in plan


# --------------------------------------------------------------------------- Qwen3 and Qwen3-MoE shapes

def _shape_dir(tmp_path: Path, base: str, **fields) -> Path:
    """A shape-only copy of examples/models/<base> with `fields` changed."""
    cfg = json.loads((ROOT / "examples" / "models" / base / "config.json").read_text())
    cfg.update(fields)
    d = tmp_path / (base + "".join(f"-{k}{v}" for k, v in fields.items()).replace(" ", ""))
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# Qwen3-30B-A3B by hand: attention (q 32 x 128 and k / v 4 x 128 of hidden 2048, o back) split over TP; the
# two layer norms, the q / k norms (head_dim 128 each) and the router (128 experts x 2048) replicated; each
# expert gate / up / down of 768 split over TP (expert TP = TP), num_experts / ep of them a rank.
H, LAYERS, VOCAB, EXPERTS, TOPK = 2048, 48, 151936, 128, 8
ATTENTION = H * (32 + 2 * 4) * 128 + 32 * 128 * H
REPLICATED = 2 * H + 2 * 128 + EXPERTS * H
EXPERT = 3 * H * 768


def test_qwen3_dense_counts_the_qk_norms_the_configs_head_dim_and_tied_embeddings(tmp_path):
    """Qwen3-4B's shape: head_dim 128 although hidden 2560 / 32 heads is 80, per-head q / k norms, no QKV
    bias, tied embeddings: 4,022,468,096 parameters (the published checkpoint). At TP 4 a rank holds a
    quarter of the attention and MLP, the norms whole, and the one (tied) embedding shard at pp 1."""
    from megatron_specrl.learner.model_provider import padded_vocab_size
    from megatron_specrl.plan import full_parameters, layer_parameters, stage_parameters
    d = _shape_dir(tmp_path, "qwen3-8b", hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)
    s = ModelShape.from_hf(load_hf_config(str(d)))
    assert (s.head_dim, s.qk_norm, s.qkv_bias, s.tied) == (128, True, False, True)
    sharded = 2560 * (32 + 2 * 8) * 128 + 32 * 128 * 2560 + 3 * 2560 * 9728
    norms = 2 * 2560 + 2 * 128
    assert layer_parameters(s, 1) == sharded + norms
    assert full_parameters(s) == 36 * (sharded + norms) + VOCAB * 2560 + 2560 == 4_022_468_096
    padded = padded_vocab_size(VOCAB, 4)
    assert stage_parameters(s, 4, 1, 0, padded) == 36 * (sharded // 4 + norms) + padded * 2560 // 4 + 2560
    untied = ModelShape.from_hf(load_hf_config("examples/models/qwen3-8b"))
    assert not untied.tied and full_parameters(untied) == 36 * layer_parameters(untied, 1) + 2 * VOCAB * 4096 + 4096


def test_moe_parameters_per_gpu_divide_experts_by_ep_and_attention_by_tp():
    """The 30B-A3B recipe at tp 2 x dp 8, ep 4: 32 experts a rank, each half its width; attention halved;
    norms and router whole; the untied embedding and head split over TP (vocab padded to 256 x 594)."""
    cfg = load_config(ROOT / "examples/qwen3-30b-a3b-dapo-3node.yaml", ["learner.tp=2", "learner.dp=8", "learner.ep=4",
                                                                        "cluster.gpu_memory_gb=10000"])
    plan = build_plan(cfg, check_data=False)
    experts = LAYERS * (EXPERTS // 4) * EXPERT // 2
    padded = 152064
    assert plan.padded_vocab == padded
    assert plan.learner.expert_params == experts
    assert plan.learner.params == LAYERS * (ATTENTION // 2 + REPLICATED) + experts + 2 * padded * H // 2 + H
    assert (plan.learner.weights, plan.learner.grads) == (2 * plan.learner.params, 4 * plan.learner.params)
    rows = dict(plan.rows())
    assert "ep 4: 32 of 128 experts a GPU, expert-data-parallel 2" in rows["learner"]
    assert f"{plan.learner.params:,} (heaviest stage), {experts:,} of them in experts" in rows["learner params / GPU"]


def test_the_distributed_optimizer_shards_expert_states_over_dp_over_ep():
    """Megatron's distributed optimizer: the dense parameters' fp32 master weights and moments (12 bytes)
    split over dp 16, the experts' over the expert-data-parallel group, dp / ep ranks; without it every
    rank keeps its local shards' whole Adam state."""
    recipe = ROOT / "examples/qwen3-30b-a3b-dapo-3node.yaml"
    dense = LAYERS * (ATTENTION + REPLICATED) + 2 * VOCAB * H + H
    for ep in (8, 16, 2):
        lm = build_plan(load_config(recipe, [f"learner.ep={ep}", "cluster.gpu_memory_gb=10000"]), check_data=False).learner
        experts = LAYERS * (EXPERTS // ep) * EXPERT
        assert (lm.params, lm.expert_params) == (dense + experts, experts)
        assert lm.optimizer == -(-12 * dense // 16) + -(-12 * experts // (16 // ep)), ep
    fp32 = build_plan(load_config(recipe, ["learner.precision=float32", "learner.distributed_optimizer=false",
                                           "cluster.gpu_memory_gb=10000"]), check_data=False).learner
    assert fp32.optimizer == 8 * fp32.params == 8 * (dense + LAYERS * 16 * EXPERT)


def test_the_moe_table_shows_total_and_active_parameters():
    plan = build_plan(load_config(ROOT / "examples/qwen3-30b-a3b-dapo-3node.yaml"), check_data=False)
    active = LAYERS * (ATTENTION + REPLICATED + TOPK * EXPERT) + 2 * VOCAB * H + H
    total = active + LAYERS * (EXPERTS - TOPK) * EXPERT
    assert "128 experts (top 8) of ffn 768, " f"{total:,} params, {active:,} active" in dict(plan.rows())["model"]
    assert "dense states over dp 16, experts' over dp / ep 2" in dict(plan.rows())["learner memory / GPU"]


def _one_plan_line(capsys, argv: list[str], tmp_path: Path) -> str:
    """`train --dry-run` and `launch` both refuse with the same one line, and launch writes nothing."""
    assert main(["train", *argv, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    script = tmp_path / "job.sbatch"
    assert main(["launch", *argv, "--out", str(script)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == err
    assert not script.exists() and not script.with_suffix(".plan.txt").exists()
    return err[0]


def test_an_ep_that_does_not_divide_the_experts_is_refused_in_one_line(tmp_path, capsys):
    model = _shape_dir(tmp_path, "qwen3-30b-a3b", num_experts=60)
    line = _one_plan_line(capsys, ["qwen3-30b-a3b-dapo-3node", f"model.path={model}"], tmp_path)
    assert line == f"megatron-specrl: plan error: learner.ep=8 does not divide num_experts=60 of model.path={str(model)!r}"


def test_an_ep_on_a_dense_model_is_refused_in_one_line(tmp_path, capsys):
    line = _one_plan_line(capsys, ["qwen3-8b-dapo-1node", "learner.ep=2"], tmp_path)
    assert line == ("megatron-specrl: plan error: learner.ep=2: model.path='examples/models/qwen3-8b' is a dense "
                    "model (qwen3, no experts to split); use learner.ep=1")


def test_an_ep_that_does_not_divide_dp_is_refused_in_one_line(tmp_path, capsys):
    assert main(["train", "qwen3-30b-a3b-dapo-3node", "learner.ep=32", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "learner.ep=32 does not divide learner.dp=16" in err[0], err
    assert main(["launch", "qwen3-30b-a3b-dapo-3node", "learner.ep=32", "--out", str(tmp_path / "x.sbatch")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == err and not (tmp_path / "x.sbatch").exists()


@pytest.mark.parametrize("field, value", [("decoder_sparse_step", 2), ("mlp_only_layers", [0, 47])])
def test_an_moe_config_with_dense_layers_is_refused_in_one_line(field, value, tmp_path, capsys):
    """The learner builds every layer of a Qwen3-MoE model as an MoE layer: a config with dense layers among
    them would be counted (and trained) as something else."""
    model = _shape_dir(tmp_path, "qwen3-30b-a3b", **{field: value})
    line = _one_plan_line(capsys, ["qwen3-30b-a3b-dapo-3node", f"model.path={model}"], tmp_path)
    assert f"model.path={str(model)!r}: {field}={value}" in line and "every layer as an MoE layer" in line, line


def test_moe_tp_checks_each_experts_width_not_intermediate_size(tmp_path):
    """Megatron's expert TP and vLLM's fused MoE split moe_intermediate_size; the intermediate_size a
    Qwen3-MoE config also carries (for dense layers it has none of) is not split."""
    odd_dense = _shape_dir(tmp_path, "qwen3-30b-a3b", intermediate_size=6145)
    build_plan(load_config(ROOT / "examples/qwen3-30b-a3b-dapo-3node.yaml", [f"model.path={odd_dense}"]),
               check_data=False)
    odd_expert = _shape_dir(tmp_path, "qwen3-30b-a3b", moe_intermediate_size=102)
    with pytest.raises(PlanError) as e:
        build_plan(load_config(ROOT / "examples/qwen3-30b-a3b-dapo-3node.yaml", [f"model.path={odd_expert}"]),
                   check_data=False)
    want = f"rollout.engine_tp=4 does not divide moe_intermediate_size=102 of model.path={str(odd_expert)!r}"
    assert e.value.failures == [want]
    with pytest.raises(PlanError) as e:
        build_plan(load_config(ROOT / "examples/qwen3-30b-a3b-dapo-3node.yaml",
                               ["learner.tp=5"]), check_data=False)
    assert any(line.startswith("learner.tp=5 does not divide num_attention_heads=32 and num_key_value_heads=4 and "
                               "moe_intermediate_size=768 of ") for line in e.value.failures), e.value.failures


def test_moe_engine_tp_still_follows_the_kv_head_rules():
    """vLLM serves the experts with its own parallelism; its attention still splits (or, at a multiple of
    them, replicates) the 4 KV heads: engine_tp 8 replicates them, 3 divides neither way."""
    recipe = ROOT / "examples/qwen3-30b-a3b-dapo-3node.yaml"
    plan = build_plan(load_config(recipe, ["rollout.engine_tp=8", "rollout.num_engines=1"]), check_data=False)
    assert plan.engine.kv_per_token == 2 * LAYERS * 1 * 128 * 2
    assert plan.engine.weights == (LAYERS * (ATTENTION + REPLICATED + EXPERTS * EXPERT) + 2 * VOCAB * H + H) * 2 // 8
    with pytest.raises(PlanError, match="rollout.engine_tp=3 does not divide num_attention_heads=32 and "
                                        "num_key_value_heads=4 of"):
        build_plan(load_config(recipe, ["rollout.engine_tp=3"]), check_data=False)


BROKEN = [
    # (recipe, overrides, needle)
    ("llama-3.1-70b-dapo-8node", ["learner.tp=16"], "learner.tp=16 does not divide num_key_value_heads=8"),
    ("qwen2.5-32b-dapo-4node", ["learner.tp=3"], "learner.tp=3 does not divide num_attention_heads=40 and "
                                                 "num_key_value_heads=8"),
    ("qwen2.5-32b-dapo-4node", ["rollout.engine_tp=5"], "rollout.engine_tp=5 does not divide num_key_value_heads=8"),
    ("llama-3.1-70b-dapo-8node", ["learner.pp=3"], "learner.pp=3 does not divide num_hidden_layers=80"),
    ("qwen2.5-32b-dapo-4node", ["learner.dp=2", "cluster.nodes=2"],
     "cluster.nodes=2: learner.tp x pp x dp = 8 x 2 x 2 = 32 plus rollout.num_engines x engine_tp = 4 x 4 = 16"),
    ("qwen2.5-7b-dapo-1node", ["learner.tp=1", "learner.dp=5", "trainer.prompts_per_step=40"],
     "cluster.nodes=1: learner.tp x pp x dp = 1 x 1 x 5 = 5 GPUs, but cluster.nodes x gpus_per_node = 1 x 8 = 8"),
    ("llama-3.1-70b-dapo-8node", ["learner.pp=1", "learner.dp=4"],
     "cluster.gpu_memory_gb=79.6: the learner needs 12"),   # 110+ GiB per GPU
    ("qwen2.5-7b-dapo-1node", ["model.path=/nonexistent/qwen"], "model.path='/nonexistent/qwen': no config.json"),
    ("qwen2.5-7b-dapo-1node", ["data.source=/nonexistent/train.parquet"],
     "data.source='/nonexistent/train.parquet': data file not found"),
]


@pytest.mark.parametrize("recipe, overrides, needle", BROKEN, ids=lambda v: v if isinstance(v, str) else None)
def test_broken_variants_fail_dry_run_and_launch(recipe, overrides, needle, tmp_path, capsys):
    """One line per failure (a layout can break several rules), the named reason among them."""
    def failures():
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert err and all(ln.startswith("megatron-specrl: plan error: ") for ln in err), err
        assert any(needle in ln for ln in err), err
        return err
    assert main(["train", recipe, *overrides, "--dry-run"]) == 2
    dry_run = failures()
    script = tmp_path / "job.sbatch"
    assert main(["launch", recipe, *overrides, "--out", str(script)]) == 2
    assert failures() == dry_run                       # launch refuses exactly what the dry run refuses
    assert not script.exists() and not script.parent.joinpath("job.plan.txt").exists()


@pytest.mark.parametrize("content, needle", [
    ("", "has no rows"),
    ('{"prompt": "1+1=", "answer": "2"}\nnot json\n', "line 2 is not valid JSON"),
    ('{"question": "1+1="}\n', "missing answer field"),
])
def test_bad_data_files_fail_the_dry_run(tmp_path, capsys, content, needle):
    data = tmp_path / "train.jsonl"
    data.write_text(content)
    assert main(["train", "qwen2.5-7b-dapo-1node", f"data.source={data}", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"data.source='{data}'" in err[0] and needle in err[0], err


def test_too_few_prompts_for_a_step(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    assert main(["train", "qwen2.5-7b-dapo-1node", f"data.source={data}", "--dry-run"]) == 2
    assert "8 prompts, fewer than trainer.gen_prompts_per_step=96" in capsys.readouterr().err   # a DAPO round


def test_flag_anywhere_and_tiny_layouts(capsys):
    assert main(["train", "tiny-cpu-grpo", "--dry-run", "learner.tp=2"]) == 0
    assert "tp 2 x pp 1 x dp 1" in capsys.readouterr().out


def test_distributed_optimizer_and_recompute_shrink_the_estimate():
    base = ["learner.distributed_optimizer=false", "learner.recompute=none", "cluster.gpu_memory_gb=10000"]
    cfg = load_config(ROOT / "examples/qwen2.5-7b-dapo-1node.yaml", base)
    plain = build_plan(cfg, check_data=False).learner
    sharded = build_plan(load_config(ROOT / "examples/qwen2.5-7b-dapo-1node.yaml",
                                     [*base, "learner.distributed_optimizer=true"]), check_data=False).learner
    full = build_plan(load_config(ROOT / "examples/qwen2.5-7b-dapo-1node.yaml",
                                  [*base, "learner.recompute=full"]), check_data=False).learner
    assert plain.optimizer == 2 * plain.weights and sharded.optimizer == plain.optimizer // cfg.learner.dp
    assert full.activations < plain.activations / 4 and full.static == plain.static


def test_recompute_is_a_gpu_setting(capsys):
    """Megatron's activation checkpointing saves CUDA RNG states: a CPU run with recompute is refused by the
    plan, the model builder refuses it without CUDA, and on GPUs each mode maps onto settings Megatron's
    TransformerConfig accepts."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_specrl.learner.model_provider import (
        RECOMPUTE,
        transformer_config_from_hf,
    )
    assert main(["train", "tiny-cpu-grpo", "learner.recompute=full", "--dry-run"]) == 2
    assert "learner.recompute=full with cluster.gpus_per_node=0" in capsys.readouterr().err
    hf = load_hf_config("tiny-llama")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="learner.recompute=selective needs CUDA"):
            transformer_config_from_hf(hf, recompute="selective")
    for mode, settings in RECOMPUTE.items():
        cfg = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, use_cpu_initialization=True,
                                **settings)
        assert cfg.recompute_granularity == (None if mode == "none" else mode)


def test_convert_checks_the_layout_before_spawning(tiny_llama, tmp_path, capsys):
    out = tmp_path / "mcore"
    assert main(["convert", "hf-to-mcore", "--hf", str(tiny_llama), "--out", str(out), "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp=3 does not divide num_attention_heads=4 and num_key_value_heads=2" in err[0]
    assert not out.exists()


# --------------------------------------------------------------------------- estimate vs a real learner







def test_the_kv_check_counts_the_drafting_engines_room(capsys):
    """vLLM refuses to start unless one sequence of its max_model_len fits in the KV cache; an engine that
    drafts from trees is started with one step's drafts of room beyond rollout.max_model_len, so a cache
    that holds rollout.max_model_len + 5 tokens passes without drafting and fails with it."""
    recipe = "qwen2.5-7b-dapo-1node"
    cfg = load_config(ROOT / f"examples/{recipe}.yaml")
    em = build_plan(cfg, check_data=False).engine
    r = cfg.rollout
    assert em.max_model_len == r.max_model_len + 1      # room for the token a verification prefill samples
    gpu = cfg.cluster.gpu_memory_gb * GB
    util = (em.weights + (r.max_model_len + 5 + 0.5) * em.kv_per_token) / gpu
    tight = [f"rollout.gpu_memory_utilization={util!r}"]
    assert main(["train", recipe, *tight, "--dry-run"]) == 0
    capsys.readouterr()
    assert main(["train", recipe, *tight, "rollout.draft=tree", "--dry-run"]) == 2
    room = r.max_model_len + r.drafter.tokens + 1
    assert f"less than one {room}-token sequence (the engine's max_model_len)" in capsys.readouterr().err


def test_overlong_prompts_are_refused_before_the_run_queues_or_starts(tiny_llama, tmp_path, capsys):
    """With the model's tokenizer at hand the dry-run (and so `launch`) measures every prompt; without
    one (synthetic data, a tiny model built at start) the run measures them before Ray or an engine
    starts. One line, exit 2; verl's data.filter_overlong_prompts leaves them out instead."""
    data = tmp_path / "train.jsonl"
    rows = [{"problem": f"{i}+1=", "answer": str(i + 1)} for i in range(16)]
    rows.append({"problem": "+".join(["1"] * 40) + "=", "answer": "40"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["tiny-cpu-grpo", f"model.path={tiny_llama}", f"data.source={data}", "data.max_prompt_len=16",
            "data.num_eval=0", "--dry-run"]
    assert main(["train", *base]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 of 17 train prompts are longer than data.max_prompt_len=16" in err[0], err
    assert main(["train", *base, "data.filter_overlong_prompts=true"]) == 0
    capsys.readouterr()
    out = tmp_path / "run"
    assert main(["train", "tiny-cpu-grpo", f"model.path={tiny_llama}", "data.max_prompt_len=4",
                 f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron-specrl: data error: ") and "data.max_prompt_len=4" in err[0]
    assert not (out / "engine_logs").exists()          # refused before any engine started


def _checkpoint_copy(src: Path, dst: Path, *names: str) -> Path:
    dst.mkdir()
    for name in ("config.json", "model.safetensors", *names):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_a_checkpoint_without_its_tokenizer_fails_the_dry_run_and_launch_in_one_line(tiny_llama, tmp_path, capsys):
    """config.json and weights but no tokenizer files: a real checkpoint (not a shape-only config), whose
    tokenizer the run would fail to load only after the queue. One line naming the directory and what
    is missing, exit 2, nothing written."""
    model = _checkpoint_copy(Path(tiny_llama), tmp_path / "no-tokenizer")
    out, script = tmp_path / "run", tmp_path / "job.sbatch"
    want = [f"megatron-specrl: plan error: model.path={str(model)!r}: no tokenizer.json or tokenizer_config.json "
            "beside config.json (the run loads its tokenizer from there)"]
    for argv in (["train", "tiny-cpu-grpo", f"model.path={model}", f"output_dir={out}", "--dry-run"],
                 ["launch", "tiny-cpu-grpo", f"model.path={model}", f"output_dir={out}", "--out", str(script)],
                 ["train", "tiny-cpu-grpo", f"model.path={model}", f"output_dir={out}"]):
        assert main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines() == want, argv
    assert not out.exists() and not script.exists()


def test_a_tokenizer_transformers_cannot_load_is_quoted_whole_without_install_advice(tiny_llama, tmp_path, capsys):
    model = _checkpoint_copy(Path(tiny_llama), tmp_path / "half-tokenizer", "tokenizer_config.json")
    assert main(["train", "tiny-cpu-grpo", f"model.path={model}", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.path={str(model)!r}: cannot load its tokenizer (" in err[0], err
    assert err[0].endswith(".)") and "sentencepiece" not in err[0]


def test_a_shape_only_config_passes_where_the_run_gets_the_checkpoint_later(tmp_path, capsys):
    """examples/models/ holds config.json only (no weights: what marks a shape-only config). The dry-run
    and a rendered script accept it (the job may get SPECRL_MODEL when it is submitted); `train` and
    `launch --submit`, which load that very path, refuse it before anything is written."""
    recipe, shape = "qwen2.5-7b-dapo-1node", "examples/models/qwen2.5-7b"
    assert main(["train", recipe, "--dry-run"]) == 0
    plan = build_plan(load_config(ROOT / "examples" / f"{recipe}.yaml"))
    assert plan.shape_only and "shape only (no weights beside config.json)" in dict(plan.rows())["model"]
    script = tmp_path / "job.sbatch"
    assert main(["launch", recipe, f"output_dir={tmp_path / 'o'}", "--out", str(script)]) == 0
    assert script.is_file() and "shape only" in script.with_suffix(".plan.txt").read_text()
    capsys.readouterr()
    want = [f"megatron-specrl: plan error: model.path={shape!r}: no weights beside config.json (*.safetensors): a "
            "shape-only config, which the run cannot load; pass the checkpoint's directory"]
    for argv in (["train", recipe, f"output_dir={tmp_path / 'r'}"],
                 ["launch", recipe, f"output_dir={tmp_path / 'r'}", "--out", str(tmp_path / "x.sbatch"), "--submit"]):
        assert main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines() == want, argv
    assert not (tmp_path / "r").exists() and not (tmp_path / "x.sbatch").exists()


def test_ppo_critic_and_kl_reference_count_on_the_policy_gpus(capsys):
    """They share the policy ranks' GPUs (actors.learner_bundles) and stay resident: a layout that fits
    the policy alone but not the three is refused before it queues (it ran out of memory on the GPUs)."""
    recipe = ROOT / "examples/qwen2.5-7b-dapo-1node.yaml"
    base = ["learner.distributed_optimizer=false", "cluster.gpu_memory_gb=10000"]
    alone = build_plan(load_config(recipe, base), check_data=False).learner
    both = build_plan(load_config(recipe, [*base, "algorithm.name=ppo", "learner.loss.kl_coef=0.001"]),
                      check_data=False).learner
    s = ModelShape.from_hf(load_hf_config(load_config(recipe, base).model.path))
    lm_head = s.vocab * s.hidden // 4        # roughly: the LM head's share a TP rank, replaced by a value head
    assert alone.critic == alone.reference == 0
    assert both.reference == alone.weights
    assert alone.static - 16 * lm_head * 1.2 < both.critic < alone.static
    assert both.static == alone.static + both.critic + both.reference
    util = load_config(recipe, base).rollout.gpu_memory_utilization    # colocated: vLLM's share beside it
    fits_alone = 1.05 * max(alone.total, alone.static / (1 - util)) / GB
    assert both.static / (1 - util) > fits_alone * GB
    assert main(["train", str(recipe), *base[:1], f"cluster.gpu_memory_gb={fits_alone:.1f}", "--dry-run"]) == 0
    capsys.readouterr()
    assert main(["train", str(recipe), *base[:1], f"cluster.gpu_memory_gb={fits_alone:.1f}", "algorithm.name=ppo",
                 "learner.loss.kl_coef=0.001", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "PPO critic" in err and "KL reference" in err


# ---- The plan's activation estimate for a bf16 learner on Megatron's local spec (CPU, or a GPU without







# ---- Review of launch / plan / the cluster recipes: layouts the plan refused that vLLM runs, transports the

@pytest.fixture(autouse=True)
def _repo_cwd_launch(monkeypatch):
    monkeypatch.chdir(ROOT)


def _cfg(recipe: str, *overrides: str):
    return load_config(ROOT / "examples" / f"{recipe}.yaml", list(overrides))


# --------------------------------------------------------------------------- engine TP vs KV heads

def _model(tmp_path: Path, heads: int, kv_heads: int) -> Path:
    """A Qwen2.5-3B-like shape (16 heads, 2 KV heads) with the given head counts."""
    cfg = json.loads((ROOT / "examples" / "models" / "qwen2.5-7b" / "config.json").read_text())
    cfg.update(hidden_size=2048, num_hidden_layers=36, intermediate_size=11008, vocab_size=151936,
               tie_word_embeddings=True, num_attention_heads=heads, num_key_value_heads=kv_heads)
    d = tmp_path / f"m{heads}-{kv_heads}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_engine_tp_a_multiple_of_the_kv_heads_passes(tmp_path):
    """vLLM replicates KV heads when its TP is a multiple of their count (Qwen2.5-3B: 2 KV heads runs at
    TP 4); the plan refused engine_tp=4 as not dividing num_key_value_heads=2."""
    model = _model(tmp_path, heads=16, kv_heads=2)
    cfg = _cfg("qwen2.5-32b-dapo-4node", f"model.path={model}", "learner.tp=2", "learner.pp=1", "learner.dp=8",
               "learner.mini_batches=4")
    plan = build_plan(cfg, check_data=False)
    assert plan.engine.kv_per_token == 2 * 36 * 1 * 128 * 2    # one (replicated) KV head per engine GPU


def test_engine_tp_neither_dividing_nor_a_multiple_of_the_kv_heads_still_fails(tmp_path):
    model = _model(tmp_path, heads=24, kv_heads=6)        # vLLM: divide(6, 4) fails
    cfg = _cfg("qwen2.5-32b-dapo-4node", f"model.path={model}", "learner.tp=2", "learner.pp=1", "learner.dp=8")
    with pytest.raises(PlanError, match="rollout.engine_tp=4 does not divide num_key_value_heads=6"):
        build_plan(cfg, check_data=False)


def test_learner_tp_still_has_to_divide_the_kv_heads(tmp_path):
    """Megatron splits the query groups over TP: no replication on the learner side."""
    model = _model(tmp_path, heads=16, kv_heads=2)
    cfg = _cfg("qwen2.5-32b-dapo-4node", f"model.path={model}", "learner.tp=4", "learner.pp=1", "learner.dp=4")
    with pytest.raises(PlanError, match="learner.tp=4 does not divide num_key_value_heads=2"):
        build_plan(cfg, check_data=False)


# --------------------------------------------------------------------------- resync transport vs layout

@pytest.mark.parametrize("recipe, overrides, needle", [
    ("qwen2.5-32b-dapo-4node", ["trainer.resync_transport=cuda_ipc"], "needs engines colocated"),
    ("qwen2.5-7b-dapo-1node", ["trainer.resync_transport=cuda_ipc"], "rollout.num_engines=8"),
    ("qwen2.5-7b-dapo-1node", ["trainer.resync_transport=broadcast"], "NCCL cannot"),
])
def test_a_transport_the_layout_cannot_use_fails_the_plan(recipe, overrides, needle, tmp_path):
    """run.build resolves trainer.resync_transport only after Ray placed the actors, i.e. after the job
    left the queue; the plan passed these."""
    with pytest.raises(PlanError, match=needle):
        build_plan(_cfg(recipe, *overrides), check_data=False)
    with pytest.raises(PlanError, match=needle):
        launch_main([recipe, *overrides, "--out", str(tmp_path / "x.sbatch")])
    assert not (tmp_path / "x.sbatch").exists()


def test_transports_the_layout_can_use_pass():
    build_plan(_cfg("qwen2.5-32b-dapo-4node", "trainer.resync_transport=broadcast"), check_data=False)
    build_plan(_cfg("qwen2.5-7b-dapo-1node", "trainer.resync_transport=ray"), check_data=False)
    build_plan(_cfg("qwen2.5-7b-dapo-1node", "trainer.resync_transport=cuda_ipc", "rollout.num_engines=1"),
               check_data=False)


def test_a_plan_without_cluster_gpus_leaves_the_transport_to_the_run():
    """`train` plans every run; a local one (cluster.gpus_per_node unset) finds its GPUs through Ray, so the
    plan cannot tell whether cuda_ipc will have them: the run resolves it (run.build)."""
    build_plan(_cfg("tiny-cpu-grpo", "trainer.resync_transport=cuda_ipc", "rollout.colocate=true"), check_data=False)


# --------------------------------------------------------------------------- #SBATCH lines as sbatch reads them

def sbatch_arguments(line: str) -> list[str]:
    """The arguments sbatch takes from one `#SBATCH ...` line: Slurm's get_argument (src/sbatch/opt.c),
    called until the line is used up: whitespace splits, ' and " quote, \\ escapes, an unquoted # ends it."""
    rest, out = line[len("#SBATCH"):], []
    while True:
        i = 0
        while i < len(rest) and rest[i].isspace():
            i += 1
        if i == len(rest):
            return out
        arg, quoted, q, esc, comment = "", False, "", False, False
        while i < len(rest) and (quoted or not rest[i].isspace()) and rest[i] != "\n":
            c = rest[i]
            if esc:
                esc = False
            elif c == "\\":
                esc, i = True, i + 1
                continue
            elif quoted:
                if c == q:
                    quoted, i = False, i + 1
                    continue
            elif c in "'\"":
                quoted, q, i = True, c, i + 1
                continue
            elif c == "#":
                comment = True
                break
            arg += c
            i += 1
        assert not quoted, f"sbatch: unmatched {q} in {line!r}"
        if arg:
            out.append(arg)
        if comment:
            return out
        rest = rest[i:]


def _sbatch_lines(text: str) -> dict[str, list[str]]:
    return {ln.split("=", 1)[0]: sbatch_arguments(ln) for ln in text.splitlines() if ln.startswith("#SBATCH --")}


@pytest.mark.parametrize("name", ["run#3", "bob's", "100%x", 'say "hi"', "plain"])
def test_sbatch_output_reaches_slurm_as_the_output_dir(name, tmp_path):
    """`#SBATCH --output=/x/run#3/%x-%j.out` was cut at the # (a comment to sbatch), a ' opened a quote
    sbatch never saw closed (fatal) or dropped the quotes, a % in the directory became a Slurm pattern."""
    out_dir = tmp_path / name / "o"
    script = tmp_path / "job.sbatch"
    assert launch_main(["tiny-cpu-grpo", f"output_dir={out_dir}", "--out", str(script)]) == 0
    args = _sbatch_lines(script.read_text())["#SBATCH --output"]
    assert len(args) == 1
    value = args[0].split("=", 1)[1]
    # Slurm's filename patterns: %% is a literal %, %x / %j the job name and id
    expanded = re.sub(r"%([%xj])", lambda m: {"%": "%", "x": "NAME", "j": "42"}[m.group(1)], value)
    assert expanded == f"{out_dir}/NAME-42.out"
    assert out_dir.is_dir()


def test_sbatch_job_name_of_a_recipe_with_a_space_is_one_argument(tmp_path):
    recipe = tmp_path / "my recipe.yaml"
    recipe.write_text((ROOT / "examples" / "tiny-cpu-grpo.yaml").read_text())
    script = tmp_path / "job.sbatch"
    assert launch_main([str(recipe), f"output_dir={tmp_path / 'o'}", "--out", str(script)]) == 0
    assert _sbatch_lines(script.read_text())["#SBATCH --job-name"] == ["--job-name=specrl-my recipe"]


def test_sbatch_parser_port_matches_the_simple_cases():
    assert sbatch_arguments("#SBATCH --nodes=4") == ["--nodes=4"]
    assert sbatch_arguments('#SBATCH --output="/a b/%j.out"') == ["--output=/a b/%j.out"]
    assert sbatch_arguments("#SBATCH --output=/a#b") == ["--output=/a"]
    assert sbatch_arguments("#SBATCH --job-name=a b") == ["--job-name=a", "b"]


# --------------------------------------------------------------------------- recipe pages vs recipes

@pytest.mark.parametrize("recipe", CLUSTER_RECIPES)
def test_recipe_pages_state_the_recipes_sampling_tries(recipe):
    """The 7B page said dynamic sampling with `<= 4 tries` while the recipe set max_sampling_tries: 30."""
    page = (ROOT / "docs" / "recipes" / f"{recipe}.md").read_text()
    cfg = _cfg(recipe)
    for n in re.findall(r"<= (\d+) (?:tries|rounds)", page):
        assert int(n) == cfg.algorithm.max_sampling_tries, (recipe, n)


def test_a_tp_that_does_not_divide_the_mlp_fails_the_plan(tmp_path):
    """Megatron's and vLLM's column-parallel MLP split the intermediate size over TP (divide() asserts)."""
    model = tmp_path / "odd-ffn"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 11010, "vocab_size": 32000,
        "max_position_embeddings": 16384, "tie_word_embeddings": False}))
    with pytest.raises(PlanError, match="learner.tp=4 does not divide intermediate_size=11010"):
        build_plan(_cfg("qwen2.5-7b-dapo-1node", f"model.path={model}"), check_data=False)


# --------------------------------------------------------------------------- asynchronous rollouts

def test_staleness_with_colocated_gpu_engines_is_refused_and_disaggregated_passes():
    """trainer.max_staleness overlaps the engines' rollout with the learner's training: colocated engines
    sleep on the learner's GPUs while it trains, so the plan refuses the pair in one line naming both keys."""
    with pytest.raises(PlanError, match=r"trainer.max_staleness=1 with rollout.colocate=true: colocated engines sleep"):
        build_plan(_cfg("qwen2.5-7b-dapo-1node", "trainer.max_staleness=1"), check_data=False)
    build_plan(_cfg("qwen2.5-32b-dapo-4node", "trainer.max_staleness=1"), check_data=False)   # colocate=false
    build_plan(_cfg("tiny-cpu-grpo", "trainer.max_staleness=1"), check_data=False)           # CPU: no GPUs to share


def test_sglang_tree_drafting_is_refused_on_a_cpu_run_by_the_plan_and_allowed_on_gpus(capsys):
    """SGLang verifies drafts greedily on CPU: rollout.draft=tree with rollout.engine=sglang is one plan line
    naming the fix, before Ray starts; the recipe as written (draft=auto) resolves to none there and runs, and
    a GPU cluster's plan does not refuse tree drafting."""
    assert main(["train", "tiny-cpu-grpo", "rollout.engine=sglang", "rollout.draft=tree", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "rollout.draft=tree with rollout.engine=sglang on CPU (cluster.gpus_per_node=0)" in err
    assert "verifies greedily on CPU; use rollout.draft=none on CPU" in err
    assert main(["train", "tiny-cpu-grpo", "rollout.engine=sglang", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "rollout.draft=none" in out.out + out.err
    gpu = load_config(ROOT / "examples/qwen3-8b-dapo-1node.yaml", ["rollout.engine=sglang", "rollout.draft=tree"])
    assert not any("on CPU" in line for line in _layout_lines(gpu))


def test_draft_auto_resolves_by_the_engine_and_the_device():
    """rollout.draft=auto is tree drafting where the engine verifies a sampled draft exactly on the run's
    device (engines.protocol.ENGINE_KINDS) and none elsewhere; the keys that follow from the draft (verify,
    drafter.tokens) follow the resolved value, and the checks before the resolve step read it too."""
    from megatron_specrl.config import ConfigError
    from megatron_specrl.config.resolve import resolve

    def chosen(*overrides):
        cfg = resolve(load_config(ROOT / "examples/tiny-cpu-grpo.yaml", ["rollout.draft=auto", *overrides]))
        return cfg.rollout.draft, cfg.rollout.verify

    assert chosen() == ("tree", "decode")
    assert chosen("rollout.engine=sglang") == ("none", "prefill")
    assert chosen("rollout.engine=sglang", "cluster.gpus_per_node=8") == ("tree", "decode")
    # run-ahead needs tree drafting: accepted where auto is tree, refused in one line where it is none
    assert resolve(load_config(ROOT / "examples/tiny-cpu-grpo.yaml", ["rollout.runahead=4"])).rollout.runahead == 4
    with pytest.raises(ConfigError, match="rollout.runahead=4 with rollout.draft=none"):
        load_config(ROOT / "examples/tiny-cpu-grpo.yaml", ["rollout.runahead=4", "rollout.engine=sglang"])


def _layout_lines(cfg) -> list[str]:
    from megatron_specrl.plan import _layout
    return _layout(cfg)
