"""HFCheckpoint: a rank reads only its pipeline stage's tensors of an HF checkpoint, one at a time (each
rank read the whole model into memory: 140 GB a rank for a 70B model in bf16), follows the shard index
like transformers, and checks shapes from the headers without reading tensor data.
"""

import json
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from megatron_specrl.learner import hf_mapping as hm
from megatron_specrl.learner.hf_checkpoint import HFCheckpoint

class CountingCheckpoint(HFCheckpoint):
    def __init__(self, d):
        super().__init__(d)
        self.read = []

    def __getitem__(self, name):
        self.read.append(name)
        return super().__getitem__(name)


def _sharded(tiny_llama, d):
    """The tiny checkpoint in two shard files with transformers' index."""
    d.mkdir()
    state = load_file(str(tiny_llama / "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for f, ns in halves.items():
        save_file({n: state[n] for n in ns}, str(d / f))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in halves.items() for n in ns}}))
    (d / "config.json").write_text((tiny_llama / "config.json").read_text())
    return state


def test_a_rank_reads_only_its_stage_and_gets_the_same_shards(tiny_llama, tmp_path):
    state = _sharded(tiny_llama, tmp_path / "ckpt")
    cfg = AutoConfig.from_pretrained(str(tmp_path / "ckpt"))
    ckpt = CountingCheckpoint(tmp_path / "ckpt")
    assert set(ckpt) == set(state) and len(ckpt) == len(state)
    hm.validate_hf_state(ckpt, cfg)
    assert ckpt.read == []                                   # shapes from the headers
    want = hm.hf_to_megatron_shards(state, cfg, 2, 2, only=(1, 1))[(1, 1)]
    got = hm.hf_to_megatron_shards(ckpt, cfg, 2, 2, only=(1, 1))[(1, 1)]
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert "model.layers.0.self_attn.q_proj.weight" not in ckpt.read        # stage 0's layer
    assert "model.layers.1.self_attn.q_proj.weight" in ckpt.read
    assert len(ckpt.read) < len(state)


def test_the_index_decides_which_files_are_read(tiny_llama, tmp_path):
    state = _sharded(tiny_llama, tmp_path / "ckpt")
    stray = {"model.norm.weight": torch.full_like(state["model.norm.weight"], 7.0)}
    save_file(stray, str(tmp_path / "ckpt" / "consolidated.safetensors"))
    assert torch.equal(HFCheckpoint(tmp_path / "ckpt")["model.norm.weight"], state["model.norm.weight"])
    (tmp_path / "ckpt" / "model.safetensors.index.json").unlink()     # no index: every file, and a clash
    with pytest.raises(hm.CheckpointError, match="'model.norm.weight' is in both"):
        HFCheckpoint(tmp_path / "ckpt")


def test_an_index_naming_a_missing_file_is_one_line(tiny_llama, tmp_path):
    _sharded(tiny_llama, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(hm.CheckpointError, match="names files that are not there.*00002"):
        HFCheckpoint(tmp_path / "ckpt")


def test_save_hf_shards_streams_transformers_layout_and_reads_back(tiny_llama, tmp_path):
    """Shards of at most max_shard_bytes with transformers' names and index, floating tensors in the
    checkpoint's dtype; one shard is plain model.safetensors; an older export's files are removed."""
    from transformers import AutoModelForCausalLM

    from megatron_specrl.learner.hf_checkpoint import save_hf_shards
    state = load_file(str(tiny_llama / "model.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"stale")
    largest = max(t.numel() * 2 for t in state.values())
    files = save_hf_shards(iter(state.items()), out, dtype=torch.bfloat16, max_shard_bytes=largest)
    assert len(files) > 2 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    assert all(f.stat().st_size <= largest + 10_000 for f in files)          # + the header
    back = HFCheckpoint(out)
    assert set(back) == set(state)
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], state[k].to(torch.bfloat16)) for k in state)
    (out / "config.json").write_text((tiny_llama / "config.json").read_text())
    for f in tiny_llama.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (out / f.name).write_bytes(f.read_bytes())
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)   # transformers reads it
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"].to(torch.bfloat16).float())

    files = save_hf_shards(iter(state.items()), out)                        # fits one shard: plain name
    assert [f.name for f in files] == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert all(torch.equal(v, state[k]) for k, v in load_file(str(out / "model.safetensors")).items())


def test_export_dtype_is_the_checkpoints_own():
    from megatron_specrl.learner.checkpoint_io import checkpoint_dtype
    assert checkpoint_dtype(AutoConfig.for_model("llama", dtype="bfloat16")) == torch.bfloat16
    assert checkpoint_dtype(AutoConfig.for_model("llama", dtype="float32")) == torch.float32
    assert checkpoint_dtype(AutoConfig.for_model("llama")) in (None, torch.float32)
