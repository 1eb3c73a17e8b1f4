"""`trainer.rollout_data_dir`: every step's samples as JSON lines, as verl's `trainer.rollout_data_dir`
writes them (`{step}.jsonl`; `input`, `output`, `score`, `step`), plus the token ids, the reused
prefix and the weight version, so that a run's rollouts can be read back token for token
(tools/replay_drafts.py replays them through the draft trees). One file per step, written whole
(a temporary file renamed into place): a step replayed after a resume replaces its file and the
steps before it stay as they were.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence


def dump_rollouts(directory: str | Path, step: int, samples: Sequence, rewards: Sequence[float], tokenizer) -> Path:
    """Write `{directory}/{step}.jsonl`: one row per sample, in the step's order."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if len(samples) != len(rewards):
        raise ValueError(f"rollout dump of step {step}: {len(samples)} samples but {len(rewards)} rewards")
    rows = []
    for s, r in zip(samples, rewards):
        rows.append(json.dumps({
            "step": step, "prompt_id": s.prompt_id, "sample_idx": s.sample_idx,
            "input": tokenizer.decode(s.prompt_ids), "output": tokenizer.decode(s.response_ids), "score": float(r),
            "prompt_ids": list(s.prompt_ids), "response_ids": list(s.response_ids),
            "num_reused": s.num_reused, "finish_reason": s.finish_reason, "weight_version": s.weight_version}))
    path = out / f"{step}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("\n".join(rows) + "\n")
    os.replace(tmp, path)
    return path


def read_rollouts(directory: str | Path) -> dict[int, list[dict]]:
    """Every dumped step, by step number."""
    steps = {}
    for path in Path(directory).glob("*.jsonl"):
        if path.stem.isdigit():
            steps[int(path.stem)] = [json.loads(line) for line in path.read_text().splitlines() if line]
    if not steps:
        raise FileNotFoundError(f"no rollout dumps (<step>.jsonl) in {directory}")
    return dict(sorted(steps.items()))
