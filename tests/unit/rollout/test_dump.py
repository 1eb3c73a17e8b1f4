"""trainer.rollout_data_dir: verl-style per-step JSON lines, read back token for token.
"""

import json
import pytest
from megatron_specrl.rollout.dump import dump_rollouts, read_rollouts
from tests.helpers.rollouts import Tok, _sample  # noqa: F401

def test_dump_writes_verl_fields_and_ids_and_reads_back(tmp_path):
    samples = [_sample("p0", 0, [5, 6, 7], reused=2), _sample("p0", 1, [5, 8])]
    path = dump_rollouts(tmp_path / "dump", 4, samples, [1.0, 0.0], Tok())
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert path.name == "4.jsonl" and len(rows) == 2
    assert rows[0]["input"] == "t1 t2" and rows[0]["output"] == "t5 t6 t7" and rows[0]["score"] == 1.0
    assert rows[0]["step"] == 4 and rows[0]["num_reused"] == 2 and rows[0]["weight_version"] == 3
    dump_rollouts(tmp_path / "dump", 5, samples[:1], [0.5], Tok())
    steps = read_rollouts(tmp_path / "dump")
    assert list(steps) == [4, 5] and steps[4][1]["response_ids"] == [5, 8] and steps[5][0]["score"] == 0.5


def test_a_replayed_step_replaces_its_file_and_keeps_the_others(tmp_path):
    dump_rollouts(tmp_path, 1, [_sample("a", 0, [1])], [0.0], Tok())
    dump_rollouts(tmp_path, 2, [_sample("b", 0, [2])], [0.0], Tok())
    dump_rollouts(tmp_path, 2, [_sample("c", 0, [3]), _sample("c", 1, [4])], [1.0, 1.0], Tok())   # after a resume
    steps = read_rollouts(tmp_path)
    assert [r["prompt_id"] for r in steps[1]] == ["a"] and [r["prompt_id"] for r in steps[2]] == ["c", "c"]
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_input_names_the_problem(tmp_path):
    with pytest.raises(ValueError, match="2 samples but 1 rewards"):
        dump_rollouts(tmp_path, 0, [_sample("a", 0, [1]), _sample("a", 1, [1])], [1.0], Tok())
    with pytest.raises(FileNotFoundError, match="no rollout dumps"):
        read_rollouts(tmp_path / "empty")
