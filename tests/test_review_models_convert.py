"""`megatron-specrl convert` on a bad HF directory: one line on stderr naming the problem."""

import json
import shutil

import pytest

from megatron_specrl.learner.convert import convert_main


@pytest.mark.parametrize("case,want", [("no-weights", "safetensors"), ("yarn", "yarn"), ("arch", "mistral")])
def test_bad_hf_dir_is_one_line(tiny_llama, tmp_path, capsys, case, want):
    d = tmp_path / "hf"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    if case == "no-weights":
        (d / "model.safetensors").unlink()
    elif case == "yarn":
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    else:
        cfg["model_type"] = "mistral"
    (d / "config.json").write_text(json.dumps(cfg))
    assert convert_main(["hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "out")]) == 1
    stderr = capsys.readouterr().err
    err = [line for line in stderr.splitlines() if line.startswith("convert failed")]
    assert len(err) == 1 and want in err[0], err
    assert "Traceback" not in stderr
