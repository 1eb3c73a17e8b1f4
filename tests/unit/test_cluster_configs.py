"""The cluster path (plan.py, cluster/launch.py) with real-shaped HF configs.

- The learner is fp32 (worker.build_gpt_model), and TransformerEngine's flash and fused attention take
  fp16 / bf16 only, so on GPUs its attention is the unfused one that stores the s^2 probabilities: the
  plan counted GPU runs as flash attention (selective == none), and passed layouts that run out of memory.
- Colocated, the reference's (KL), the critic's (PPO) and with use_kl_in_reward the policy's scoring passes
  run before the engines release their memory (trainer.train_step): the plan checked only the resident
  memory beside vLLM's share.
- A requeued job re-ran `train` with the first attempt's trainer.resume: `never` refuses the directory the
  first attempt wrote (exit 2, so the job never restarts), an explicit checkpoint sets the run's later
  checkpoints aside and goes back to it on every restart.
"""

import json
import pytest
from megatron_specrl.config import load_config
from megatron_specrl.plan import (
    GB, ModelShape, PlanError, activation_elements_per_token_layer, build_plan, learner_memory, load_hf_config,
)
from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
RECIPE = ROOT / "examples/qwen2.5-7b-dapo-1node.yaml"

# published config.json sizes (Hugging Face model cards)
SHAPES = {
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, intermediate_size=28672, vocab_size=128256),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064),
    "qwen2.5-72b": dict(model_type="qwen2", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=29568, vocab_size=152064),
}


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture
def models(tmp_path):
    out = {}
    for name, shape in SHAPES.items():
        d = tmp_path / "models" / name
        d.mkdir(parents=True)
        rope = ({"rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
                if shape["model_type"] == "llama" else {"rope_theta": 1000000.0})
        (d / "config.json").write_text(json.dumps({
            **shape, **rope, "tie_word_embeddings": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "torch_dtype": "bfloat16"}))
        out[name] = str(d)
    return out


def plan(overrides, recipe=RECIPE):
    return build_plan(load_config(recipe, overrides), check_data=False)


def failures(overrides, recipe=RECIPE) -> list[str]:
    try:
        plan(overrides, recipe)
    except PlanError as e:
        return e.failures
    return []


# --------------------------------------------------------------------------- fp32 attention on GPUs

def test_gpu_plan_counts_the_fp32_learners_unfused_attention(models):
    """On GPUs the fp32 learner stores the attention probabilities unless learner.recompute drops them:
    none > selective, and the activations are learner_memory's without flash attention."""
    base = [f"model.path={models['qwen2.5-7b']}", "cluster.gpu_memory_gb=10000", "learner.max_tokens_per_microbatch=9216"]
    none, selective = plan([*base, "learner.recompute=none"]), plan([*base, "learner.recompute=selective"])
    cfg = load_config(RECIPE, [*base, "learner.recompute=none"])
    s = ModelShape.from_hf(load_hf_config(models["qwen2.5-7b"]))
    assert none.learner.activations == learner_memory(cfg, s, none.padded_vocab, flash=False).activations
    # 28 layers x 9216 tokens x (28 heads / tp 4) x 9216 keys x 4 bytes of probabilities
    assert none.learner.activations - selective.learner.activations == 28 * 9216 * 7 * 9216 * 4


def test_a_layout_that_stores_the_probabilities_out_of_memory_is_refused(models):
    """Qwen2.5-7B at tp4 x dp2, no recompute, 9216-token microbatches: 66.6 GB of fp32 probabilities on top
    of the 69.8 GB the plan counted; refused with one line. Selective recompute (which drops them) fits."""
    base = [f"model.path={models['qwen2.5-7b']}", "learner.max_tokens_per_microbatch=9216"]
    lines = failures([*base, "learner.recompute=none"])
    assert len(lines) == 1 and lines[0].startswith("cluster.gpu_memory_gb=79.6: the learner needs ") \
        and "at learner.tp=4 pp=1 dp=2" in lines[0], lines
    assert failures([*base, "learner.recompute=selective"]) == []


@pytest.mark.parametrize("model, layout", [
    ("llama-3.1-70b", ["learner.tp=8", "learner.pp=4", "rollout.engine_tp=8"]),
    ("qwen2.5-72b", ["learner.tp=8", "learner.pp=4", "rollout.engine_tp=8"]),
])
def test_70b_class_learners_at_tp8_pp4_fit_with_full_recompute(models, model, layout):
    """The 70B recipe's layout with each 70B-class shape: 16 bytes a parameter (fp32 weights, grads, Adam;
    dp 1 leaves the distributed optimizer nothing to shard) plus activations with the probabilities of the
    one layer full recompute rebuilds, under 79.6 GiB."""
    p = plan([f"model.path={models[model]}", *layout], ROOT / "examples/llama-3.1-70b-dapo-8node.yaml")
    lm = p.learner
    assert lm.static == 16 * lm.params and lm.total <= 79.6 * GB
    seq = 1024 + 12288                                     # one row a microbatch, 4 in flight on stage 0
    layer_inputs = 4 * 20 * 8192 * seq * 4
    assert lm.activations - layer_inputs > 8 * seq * seq * 4   # the rebuilt layer's 8 heads x s^2 probabilities


# --------------------------------------------------------------------------- scoring beside awake engines

def test_kl_reference_scoring_beside_colocated_engines_is_refused(models):
    """Qwen2.5-7B colocated at gpu_memory_utilization 0.6 with a KL loss: resident 28.4 GB (policy 21.3 +
    reference 7.1) + vLLM's 47.8 GiB fit in 79.6 GiB, but the reference scores a 16384-token microbatch (13.6 GiB:
    one layer's tensors and three fp32 logits-sized tensors of 152064 / 4 columns) before the engines sleep."""
    base = [f"model.path={models['qwen2.5-7b']}", "learner.loss.kl_coef=0.001"]
    lines = failures(base)
    assert len(lines) == 1, lines
    assert lines[0].startswith("rollout.gpu_memory_utilization=0.6: colocated, the KL reference's scoring pass")
    assert "vLLM's 47.8 GiB + the learner's resident 28.4 GiB + 13.6 GiB for one 16384-token microbatch" in lines[0]
    ok = plan([*base, "rollout.gpu_memory_utilization=0.45"])
    logits = 16384 * (152064 // 4) * 4
    assert 3 * logits < ok.learner.scoring < 3 * logits + 8 * GB
    assert any(k == "scoring / GPU" for k, _ in ok.rows())
    # without a reference (the recipe: DAPO, kl 0) nothing scores before the engines sleep
    assert failures([f"model.path={models['qwen2.5-7b']}"]) == []


def test_kl_in_reward_and_a_padded_vocab_are_named_and_counted(models):
    """Llama-3.1-8B (128256 -> 128512 columns at tp 4: the masked copy counts) with the KL in the reward:
    the reference and the policy score the batch beside the engines."""
    base = [f"model.path={models['llama-3.1-8b']}", "algorithm.use_kl_in_reward=true"]
    lines = failures(base)
    assert len(lines) == 1 and "the KL reference's (and the policy's, use_kl_in_reward) scoring pass" in lines[0], lines
    padded = plan([*base, "rollout.gpu_memory_utilization=0.3"]).learner.scoring
    unpadded = plan([f"model.path={models['qwen2.5-7b']}", "algorithm.use_kl_in_reward=true",
                     "rollout.gpu_memory_utilization=0.3"]).learner.scoring
    seq = 1024 + 8192

    def layer(model):   # one layer's forward tensors for a 16384-token microbatch at tp 4
        s = ModelShape.from_hf(load_hf_config(models[model]))
        return activation_elements_per_token_layer(s, 4, seq, flash=False) * 16384 * 4
    assert padded == layer("llama-3.1-8b") + 4 * 16384 * (128512 // 4) * 4       # logits, masked, shifted, exp
    assert unpadded == layer("qwen2.5-7b") + 3 * 16384 * (152064 // 4) * 4       # logits, shifted, exp


# --------------------------------------------------------------------------- requeue / resume









