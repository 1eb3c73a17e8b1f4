"""`trainer.rollout_data_dir`: every step's samples as JSON lines, as verl's `trainer.rollout_data_dir`
writes them (`{step}.jsonl`; `input`, `output`, `score`, `step`), plus the token ids, the reused
prefix and the weight version, so that a run's rollouts can be read back token for token
(benchmarks/replay_drafts.py replays them through the draft trees). One file per step, written whole
(a temporary file renamed into place): a step replayed after a resume replaces its file and the
steps before it stay as they were. A run starting at step N first moves the dumps of steps > N aside
(set_aside_later_dumps), so the directory only ever holds one timeline.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Sequence

from megatron_specrl.checkpoint import make_aside_dir

log = logging.getLogger(__name__)
_DUMP = re.compile(r"(\d+)\.jsonl(\.tmp)?")   # {step}.jsonl, and the temporary file a crash mid-write leaves


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


def set_aside_later_dumps(directory: str | Path, step: int, name: str | None = None) -> Path | None:
    """A run starting at `step` moves the dumps of steps > `step` (and their half-written temporary
    files) into `{directory}/abandoned-after-step_N-<time>/` (`name`, when given: build_run passes the
    name of the checkpoints' abandoned-after directory, so the two match), before it writes any; nothing
    is deleted. Returns that directory, or None when there is nothing to move.

    Done on every start, not only a resume from an older checkpoint (whose later checkpoints
    checkpoint.set_aside_newer moves): the dumps past the start step are never this run's timeline.
    They are the abandoned run's later steps, or, after a crash past the last checkpoint (resume=auto),
    the steps the resumed run replays from that checkpoint, sampled again; a replay that gets as far
    replaces each file anyway, but one that stops earlier, or runs with other settings, would leave a
    directory that mixes the two runs for read_rollouts (benchmarks/replay_drafts.py). Same rule as the
    metrics and data order, which every resume trims to its step. A fresh run (step 0) in a directory
    holding an earlier run's dumps moves them all aside instead of overwriting them step by step.
    read_rollouts reads only the directory's own `<step>.jsonl`, never a subdirectory."""
    root = Path(directory)
    if not root.is_dir():
        return None
    later = sorted((p for p in root.iterdir() if p.is_file() and (m := _DUMP.fullmatch(p.name)) and int(m[1]) > step),
                   key=lambda p: (int(_DUMP.fullmatch(p.name)[1]), p.name))
    if not later:
        return None
    dest = make_aside_dir(root, step, name)
    for p in later:
        os.rename(p, dest / p.name)
    log.warning("starting at step %d: moved the rollout dumps of later steps (not this timeline's) %s into %s",
                step, ", ".join(p.name for p in later), dest)
    return dest
