"""Review of launch / plan / the cluster recipes: layouts the plan refused that vLLM runs, transports the
plan let through that the run refuses after the queue, #SBATCH values sbatch reads differently from
what launch meant, and recipe pages that disagree with their recipes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_specrl.config import load_config
from megatron_specrl.launch import launch_main
from megatron_specrl.plan import PlanError, build_plan

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
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
    """run_setup resolves trainer.resync_transport only after Ray placed the actors, i.e. after the job
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
    plan cannot tell whether cuda_ipc will have them: the run resolves it (run_setup)."""
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

@pytest.mark.parametrize("recipe", ["qwen2.5-7b-dapo-1node", "qwen2.5-32b-dapo-4node", "llama-3.1-70b-dapo-8node"])
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
