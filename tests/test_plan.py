"""The plan check: the shipped cluster recipes pass it, each broken variant fails with its named
reason (one line, exit 2) in `train --dry-run` and in `launch` (before a script is written), and the
memory estimate's parameter, gradient and optimizer bytes equal a real learner's."""

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
    stage_parameters,
)

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_RECIPES = ["qwen2.5-7b-dapo-1node", "qwen2.5-32b-dapo-4node", "llama-3.1-70b-dapo-8node"]
MODELS = {"qwen2.5-7b": 7.615616512e9, "qwen2.5-32b": 32.763876352e9, "llama-3.1-70b": 70.553706496e9}


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
     "cluster.gpu_memory_gb=80: the learner needs 12"),   # 110+ GB per GPU
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

def _measure(rank, world, hf_dir, layouts, ports, out_dir):
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from test_learner_layouts import complete_batch, make_batch

    from megatron_specrl.config import LearnerConfig
    from megatron_specrl.learner.worker import LearnerWorker
    for (tp, pp, mbs), port in zip(layouts, ports):
        w = LearnerWorker(rank, world, "127.0.0.1", port, LearnerConfig(tp=tp, pp=pp, dp=world // (tp * pp),
                                                                        micro_batch_size=mbs), seed=1)
        w.load_hf(hf_dir)
        batch = make_batch(hf_dir)
        params = [p for p in w.model.parameters()]
        param_storages = {p.untyped_storage().data_ptr() for p in params}
        saved = {}

        def pack(t, saved=saved, param_storages=param_storages):   # what autograd keeps, weights excluded
            if t.untyped_storage().data_ptr() not in param_storages:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            w.train_step(complete_batch(batch, torch.zeros(batch["input_ids"].shape)))
        opt = [t for p in params for k, t in w.optimizer.state[p].items() if k in ("exp_avg", "exp_avg_sq")]
        torch.save({"stage": w.pp_rank, "numel": sum(p.numel() for p in params),
                    "weights": sum(p.numel() * p.element_size() for p in params),
                    "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
                    "optimizer": sum(t.numel() * t.element_size() for t in opt),
                    "activations": sum(saved.values())},
                   f"{out_dir}/tp{tp}pp{pp}-rank{rank}.pt")
        w.shutdown()


ACTIVATION_TOLERANCE = 0.2


@pytest.mark.slow
def test_memory_estimate_matches_a_real_learner(tiny_llama, tmp_path):
    """Parameters, gradient and AdamW bytes of every rank at DP2, TP2 and PP2 equal the estimate exactly.
    Activations (one microbatch, the bytes autograd saves) are within 20% of it at DP2 and TP2 (measured:
    estimate / saved = 0.98 at TP1, 0.87 at TP2, where a few tensors are not split); at PP2 the hooks sum
    both microbatches rather than the peak, so activations are not compared there."""
    import torch.multiprocessing as mp

    from megatron_specrl.learner.model_provider import padded_vocab_size
    from megatron_specrl.ports import free_port
    layouts = [(1, 1, 4), (2, 1, 4), (1, 2, 2)]          # (tp, pp, micro_batch_size): dp2, tp2, pp2
    mp.spawn(_measure, args=(2, str(tiny_llama), layouts, [free_port("127.0.0.1") for _ in layouts], str(tmp_path)),
             nprocs=2, join=True)
    s = ModelShape.from_hf(load_hf_config(str(tiny_llama)))
    for tp, pp, mbs in layouts:
        # the batch of make_batch: 4 sequences of 12 tokens (4 prompt + 8 response), one step
        cfg = load_config(None, [f"model.path={tiny_llama}", f"learner.tp={tp}", f"learner.pp={pp}",
                                 f"learner.dp={2 // (tp * pp)}", f"learner.micro_batch_size={mbs}",
                                 "trainer.prompts_per_step=1", "rollout.n_samples=4", "data.max_prompt_len=4",
                                 "rollout.max_new_tokens=8"])
        plan = build_plan(cfg, check_data=False)
        ranks = [torch.load(tmp_path / f"tp{tp}pp{pp}-rank{r}.pt") for r in range(2)]
        for rank, m in enumerate(ranks):
            assert m["numel"] == stage_parameters(s, tp, pp, m["stage"], padded_vocab_size(s.vocab, tp)), (tp, pp, rank)
            assert m["weights"] == m["grads"] == 4 * m["numel"] and m["optimizer"] == 8 * m["numel"]
        heaviest = max(m["numel"] for m in ranks)
        assert plan.learner.params == heaviest
        assert (plan.learner.weights, plan.learner.grads, plan.learner.optimizer) == \
            (4 * heaviest, 4 * heaviest, 8 * heaviest)
        if pp == 1:
            measured = max(m["activations"] for m in ranks)
            assert abs(plan.learner.activations / measured - 1) <= ACTIVATION_TOLERANCE, \
                (tp, pp, plan.learner.activations, measured)


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
    room = r.max_model_len + r.draft_tokens + 1
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
