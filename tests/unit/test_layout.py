"""One parallel-layout rule at every entry point: the plan check (`train --dry-run`, `launch`, `train`), the
run's start-up check (`train(cfg)` called from Python, which skips the plan), `convert` and `check-resync`
accept the same layouts and refuse the others with the same lines, their own key names (learner.tp, --tp)
and model names aside, for dense and mixture-of-experts models.

Each entry point had its own copy of the rule before (issue #56), and for Qwen3-MoE they disagreed: an MoE
model's TP splits each expert's moe_intermediate_size, never the dense intermediate_size its config also
carries, yet the start-up check and check-resync split that one. A model whose unused intermediate_size
was odd passed `--dry-run` and `convert` but `train` refused it; one whose expert width was odd was refused
by all three, while check-resync let it through to a Megatron traceback and `train(cfg)` reached the
start-up check that tested the wrong width.

The checkpoints are small real ones (config, seeded weights, a tokenizer), built here; every entry point's
check runs in-process, stopped before it would start Ray or spawn ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_specrl.config import ConfigError, load_config

# every dimension TP could split is set explicitly, so each case changes the one it is about
COMMON = dict(vocab_size=264, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)
MODELS = {
    "dense": ("llama", dict(intermediate_size=256)),
    "dense-odd-ffn": ("llama", dict(intermediate_size=255)),
    # every layer MoE, 4 experts, top 2; intermediate_size=255 belongs to no layer (no dense layers)
    "moe": ("qwen3_moe", dict(intermediate_size=255, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "moe-odd-expert": ("qwen3_moe", dict(intermediate_size=256, moe_intermediate_size=63, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                         mlp_only_layers=[])),
}

# (model, layout, the lines every entry point gives, written with the neutral keys tp / pp / ep / engine_tp and
# MODEL for the model's name)
CASES = [
    ("dense", dict(tp=2), []),
    ("dense", dict(tp=3), ["tp=3 does not divide num_attention_heads=4 and num_key_value_heads=2 and "
                           "intermediate_size=256 of MODEL"]),
    ("dense-odd-ffn", dict(tp=2), ["tp=2 does not divide intermediate_size=255 of MODEL"]),
    ("dense", dict(pp=3), ["pp=3 does not divide num_hidden_layers=2 of MODEL"]),
    ("dense", dict(ep=2), ["ep=2: MODEL is a dense model (llama, no experts to split); use ep=1"]),
    ("dense", dict(engine_tp=4), []),     # vLLM replicates the 2 KV heads over 4 ranks
    ("dense", dict(engine_tp=3), ["engine_tp=3 does not divide num_attention_heads=4 and num_key_value_heads=2 "
                                  "and intermediate_size=256 of MODEL"]),
    # the reproduced cases: the dense intermediate_size (255) of an all-MoE model is split by nothing ...
    ("moe", dict(tp=2), []),
    ("moe", dict(tp=2, ep=2), []),
    # ... and each expert's width is
    ("moe-odd-expert", dict(tp=2), ["tp=2 does not divide moe_intermediate_size=63 of MODEL"]),
    ("moe-odd-expert", dict(engine_tp=2), ["engine_tp=2 does not divide moe_intermediate_size=63 of MODEL"]),
    ("moe", dict(tp=4), ["tp=4 does not divide num_key_value_heads=2 of MODEL"]),
    ("moe", dict(ep=3), ["ep=3 does not divide num_experts=4 of MODEL"]),
    ("moe", dict(tp=3, pp=3), ["tp=3 does not divide num_attention_heads=4 and num_key_value_heads=2 and "
                               "moe_intermediate_size=64 of MODEL", "pp=3 does not divide num_hidden_layers=2 of MODEL"]),
]

RUN_KEYS = {"tp": "learner.tp", "pp": "learner.pp", "ep": "learner.ep", "engine_tp": "rollout.engine_tp"}
CLI_KEYS = {"tp": "--tp", "pp": "--pp", "ep": "--ep", "engine_tp": "--engine-tp"}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from megatron_specrl.models.tiny import build_tokenizer
    d = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """Each of MODELS as a checkpoint directory: config.json, seeded weights and the tiny models' tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name, (model_type, fields) in MODELS.items():
        config_class = {"llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}[model_type]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config_class(**COMMON, **fields), dtype=torch.float32)
        model.save_pretrained(str(root / name), safe_serialization=True)
        for f in tokenizer_dir.iterdir():
            shutil.copy2(f, root / name / f.name)
        out[name] = root / name
    return out


def _run_config(model_dir: Path, layout: dict):
    le = {"tp": 1, "pp": 1, "ep": 1, "engine_tp": 1, **layout}
    overrides = [f"model.path={model_dir}", f"learner.tp={le['tp']}", f"learner.pp={le['pp']}",
                 f"learner.ep={le['ep']}", f"learner.dp={le['ep']}", f"rollout.engine_tp={le['engine_tp']}"]
    if le["ep"] == 3:   # the batch must split over learner.dp=3
        overrides.append("trainer.prompts_per_step=12")
    return load_config(None, overrides)


def plan_check(model_dir: Path, layout: dict) -> None:
    from megatron_specrl.plan import build_plan
    build_plan(_run_config(model_dir, layout), check_data=False)


def start_up_check(model_dir: Path, layout: dict) -> None:
    """What `train(cfg)` runs on its model before Ray starts (run/build.build_run)."""
    from megatron_specrl.run.build import prepare_model
    prepare_model(_run_config(model_dir, layout))


def convert_check(model_dir: Path, layout: dict) -> None:
    from megatron_specrl.plan import check_convert_layout
    check_convert_layout(model_dir, layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1))


def check_resync_check(model_dir: Path, layout: dict) -> None:
    from megatron_specrl.cli import check_resync_layout
    from megatron_specrl.diagnostics.check import build_parser
    argv = ["--model", str(model_dir)]
    for key, value in layout.items():
        argv += [CLI_KEYS[key], str(value)]
    check_resync_layout(build_parser().parse_args(argv))


ENTRY_POINTS = {"plan": (plan_check, RUN_KEYS), "start-up": (start_up_check, RUN_KEYS),
                "convert": (convert_check, CLI_KEYS), "check-resync": (check_resync_check, CLI_KEYS)}


def _lines(check, keys: dict, model_dir: Path, layout: dict) -> list[str]:
    """The entry point's failure lines, its key names replaced by the neutral ones and its model name by MODEL."""
    try:
        check(model_dir, layout)
    except ConfigError as e:   # PlanError (one line each in .failures) is one
        lines = list(getattr(e, "failures", None) or str(e).split("; "))
    else:
        return []
    out = []
    for line in lines:
        line = line.replace(f"model.path={str(model_dir)!r}", "MODEL").replace(str(model_dir), "MODEL")
        for neutral, key in keys.items():
            line = line.replace(f"{key}=", f"{neutral}=")
        out.append(line)
    return out


@pytest.mark.parametrize("model, layout, want", CASES,
                         ids=[f"{m}-" + "-".join(f"{k}{v}" for k, v in layout.items()) for m, layout, _ in CASES])
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_every_entry_point_refuses_a_layout_with_the_same_lines(checkpoints, model, layout, want, entry_point):
    if entry_point == "convert" and "engine_tp" in layout:
        pytest.skip("convert has no engine")
    check, keys = ENTRY_POINTS[entry_point]
    assert _lines(check, keys, checkpoints[model], layout) == want


def test_the_layout_rule_names_each_entry_points_keys(checkpoints):
    """The same line, in the keys the user typed: the run's config keys, or the command's flags."""
    from megatron_specrl.plan import PlanError, check_convert_layout
    d = checkpoints["moe-odd-expert"]
    with pytest.raises(PlanError) as e:
        plan_check(d, dict(tp=2))
    assert e.value.failures == [f"learner.tp=2 does not divide moe_intermediate_size=63 of model.path={str(d)!r}"]
    with pytest.raises(PlanError) as e:
        check_convert_layout(d, tp=2, pp=1)
    assert e.value.failures == [f"--tp=2 does not divide moe_intermediate_size=63 of {d}"]
