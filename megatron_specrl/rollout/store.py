"""Last epoch's trajectory for every (prompt id, sample index): the drafts of speculative rollouts.

Keyed by the dataset's stable prompt id and the sample index, never by batch
slot, so drafts survive shuffling, dynamic sampling and batch-size changes.
Saved as flat numpy arrays (not pickle) so a 10^9-token store stays compact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np


@dataclass
class Trajectory:
    token_ids: list[int]
    logprobs: list[float]   # per token, under the policy that last produced or verified it
    finish_reason: str      # "stop" or "length"
    weight_version: int
    # spec_mode=coupled: the noise seed the response was drawn with (kept across epochs unless
    # rollout.coupled_refresh re-draws it); None otherwise
    noise_seed: int | None = None
    # the round that drew it (the rollout's `step`, "7.0"; not saved): whether a draft of the current
    # weights comes from this step's earlier round (redrawn) or from the exact overlap's refresh of the
    # previous step (drafted); None (a loaded store): by the weight version alone
    drawn_at: str | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"trajectory has {len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")


class TrajectoryStore:
    def __init__(self):
        self._items: dict[tuple[str, int], Trajectory] = {}
        self._undo: dict[tuple[str, int], Trajectory | None] | None = None   # while a step may be retried

    def get(self, prompt_id: str, sample_idx: int) -> Trajectory | None:
        return self._items.get((prompt_id, sample_idx))

    def put(self, prompt_id: str, sample_idx: int, traj: Trajectory) -> None:
        key = (prompt_id, sample_idx)
        if self._undo is not None and key not in self._undo:
            self._undo[key] = self._items.get(key)
        self._items[key] = traj

    # -- a step's writes, undone when its rollout is retried ------------------
    def begin_step(self) -> None:
        """Remember what this step's puts replace (only those: a copy of the store would cost its size)."""
        self._undo = {}

    def undo_step(self) -> None:
        """Back to the store as it was at begin_step: a retried rollout (an engine died in a DAPO round
        after earlier rounds stored their samples) drafts from what a first attempt would have seen."""
        for key, old in (self._undo or {}).items():
            if old is None:
                self._items.pop(key, None)
            else:
                self._items[key] = old
        self._undo = {}

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> Iterator[tuple[tuple[str, int], Trajectory]]:
        """((prompt id, sample index), trajectory) of every entry, in the order they were first put."""
        return iter(list(self._items.items()))

    def copy(self) -> "TrajectoryStore":
        """A store with the same entries (trajectories are replaced by put, never changed, so they are
        shared); outside any step: undo_step of the copy restores nothing."""
        out = type(self)()
        out._items = dict(self._items)
        return out

    def num_tokens(self) -> int:
        return sum(len(t.token_ids) for _, t in self.items())

    # -- persistence -------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        entries = list(self.items())
        keys, trajs = [k for k, _ in entries], [t for _, t in entries]
        lengths = np.array([len(t.token_ids) for t in trajs], dtype=np.int64)
        token_ids = np.array([i for t in trajs for i in t.token_ids], dtype=np.int64)
        if not len(token_ids) or (token_ids.min() >= np.iinfo(np.int32).min and token_ids.max() <= np.iinfo(np.int32).max):
            token_ids = token_ids.astype(np.int32)   # every vocabulary fits: 4 bytes a token, as the log-probs' 4 saved
        np.savez(
            d / "trajectories.npz",
            token_ids=token_ids,
            # float64, what the store holds in memory (Python floats): a resumed run must draft and accept
            # (spec_mode=lenient compares these q with new log-probs) from exactly the values the
            # uninterrupted run would have used; float32 rounded any value an engine did not give in float32
            logprobs=np.array([x for t in trajs for x in t.logprobs], dtype=np.float64),
            lengths=lengths,
            versions=np.array([t.weight_version for t in trajs], dtype=np.int64),
            # -1: no noise seed (seeds are 63-bit, never negative)
            noise_seeds=np.array([-1 if t.noise_seed is None else t.noise_seed for t in trajs], dtype=np.int64),
        )
        meta = {"keys": [[p, k] for p, k in keys], "finish": [t.finish_reason for t in trajs]}
        (d / "trajectories.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, directory: str | Path) -> "TrajectoryStore":
        d = Path(directory)
        store = cls()
        try:
            arrays = np.load(d / "trajectories.npz")
            meta = json.loads((d / "trajectories.json").read_text())
        except Exception as e:
            raise RuntimeError(f"trajectory store in {d} is missing or corrupt: {e}") from None
        lengths = arrays["lengths"]
        if len(lengths) != len(meta["keys"]) or int(lengths.sum()) != len(arrays["token_ids"]):
            raise RuntimeError(f"trajectory store in {d} is corrupt: key and token counts disagree")
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        ids, lps, vers = arrays["token_ids"], arrays["logprobs"], arrays["versions"]
        # stores written before coupled rollouts have no noise seeds
        seeds = arrays["noise_seeds"] if "noise_seeds" in arrays.files else np.full(len(lengths), -1, np.int64)
        for i, ((pid, k), finish) in enumerate(zip(meta["keys"], meta["finish"])):
            a, b = offsets[i], offsets[i + 1]
            store.put(pid, int(k), Trajectory(ids[a:b].tolist(), lps[a:b].astype(float).tolist(),
                                              finish, int(vers[i]), None if seeds[i] < 0 else int(seeds[i])))
        return store
