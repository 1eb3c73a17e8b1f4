"""HFCheckpoint: a rank reads only its pipeline stage's tensors of an HF checkpoint, one at a time (each
rank read the whole model into memory: 140 GB a rank for a 70B model in bf16), follows the shard index
like transformers, and checks shapes from the headers without reading tensor data."""

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
