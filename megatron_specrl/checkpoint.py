"""Atomic run checkpoints: write into a temporary directory, add a manifest, then rename.

A directory `step_XXXXXXXX` exists only once complete; its manifest lists every
file with a checksum, so `resume=auto` can also skip one damaged later on.

Layout: learner/ (Megatron dist checkpoint, written by the learner ranks),
trajectories.{npz,json} (the speculative drafts), trainer_state.json (step,
weight version, data position, tokenizer fingerprint; the learner's RNG states are in learner/),
manifest.json (last).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_FULL_HASH_LIMIT = 64 << 20   # larger files: size + hash of head and tail (hashing 100s of GB is too slow)


def file_checksum(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _FULL_HASH_LIMIT:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            h.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
    return f"{size}:{h.hexdigest()}"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def begin(root: Path, step: int) -> Path:
    """A fresh temporary directory to write step's checkpoint into. Temporary directories left by an
    earlier process (a crash mid-write) are removed: resume never reads them, and each holds a whole
    checkpoint's bytes. One driver writes an output_dir's checkpoints, one at a time."""
    root = Path(root)
    for stale in root.glob(".tmp-*") if root.is_dir() else ():   # saves are synchronous: none is ours
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    tmp.mkdir(parents=True)
    return tmp


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:   # some filesystems (FUSE mounts) cannot fsync a directory: nothing more to do there
        if not (e.errno == errno.EINVAL and path.is_dir()):
            raise
    finally:
        os.close(fd)


def commit(tmp: Path, state: dict, keep: int) -> Path:
    """Write trainer_state + manifest, rename into place, prune old checkpoints. Every file and
    directory is fsynced before the rename and the parent after it, and only then are older
    checkpoints pruned: after a node crash (power loss, kernel panic) the newest complete checkpoint
    is on disk, not only in the page cache while the older ones are already gone."""
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    for p in files:
        _fsync(p)
    manifest = {"step": state["step"], "files": {str(p.relative_to(tmp)): file_checksum(p) for p in files}}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
        _fsync(d)
    _fsync(tmp)
    final = tmp.parent / step_dir_name(state["step"])
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(tmp.parent)
    _prune(tmp.parent, keep, final)
    return final


def _prune(root: Path, keep: int, newest: Path) -> None:
    """Keep the `keep` newest checkpoints up to `newest` (the one just written). Later-numbered ones
    (a damaged one resume=auto skipped) are not counted: they would push `newest` out."""
    done = sorted(p for p in root.glob("step_*") if p.name <= newest.name)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def make_aside_dir(root: Path, step: int, name: str | None = None) -> Path:
    """A new `root/<name>` (default `abandoned-after-step_N-<time>`; `-1`, `-2`... where taken) for what
    a run starting at `step` sets aside (here its later checkpoints, rollout/dump.py its later dumps)."""
    base = Path(root) / (name or f"abandoned-after-{step_dir_name(step)}-{time.strftime('%Y%m%d-%H%M%S')}")
    dest, n = base, 1
    while dest.exists():
        dest, n = base.with_name(f"{base.name}-{n}"), n + 1
    dest.mkdir()
    return dest


def set_aside_newer(root: Path, step: int, logs: Iterable[Path] = ()) -> Path | None:
    """A run resuming at `step` with later checkpoints in `root` (an abandoned run's, resumed from an
    older one; or damaged ones resume=auto skipped) moves them, before it writes anything, into
    `root/abandoned-after-step_N-<time>/`, with copies of `logs` (the metrics and data order the
    resumed run is about to trim to `step`): resume=auto and engine restarts (find_latest) then see
    only the resumed timeline, pruning never counts them, and nothing is deleted. None if none."""
    root = Path(root)
    newer = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name > step_dir_name(step))
    if not newer:
        return None
    dest = make_aside_dir(root, step)
    for p in newer:
        os.rename(p, dest / p.name)
    for f in logs:
        if Path(f).is_file():
            shutil.copy2(f, dest / Path(f).name)
    _fsync(dest)
    _fsync(root)
    log.warning("resuming at step %d: moved the later checkpoints %s (not this timeline's) into %s",
                step, ", ".join(p.name for p in newer), dest)
    return dest


def verify(ckpt: Path) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong with it."""
    mf = ckpt / MANIFEST
    if not mf.is_file():
        return "no manifest (half-written)"
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "manifest is not valid JSON"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return "manifest has no file list"
    for rel, checksum in manifest["files"].items():
        p = ckpt / rel
        if not p.is_file():
            return f"file {rel} is missing"
        if file_checksum(p) != checksum:
            return f"file {rel} does not match its checksum"
    return None


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint; damaged or half-written ones are skipped with a warning."""
    root = Path(root)
    if not root.is_dir():
        return None
    for leftover in root.glob(".tmp-step_*"):
        log.warning("ignoring half-written checkpoint %s", leftover)
    for ckpt in sorted(root.glob("step_*"), reverse=True):
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        log.warning("ignoring checkpoint %s: %s", ckpt, problem)
    return None


def load_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())


def check_tokenizer(state: dict, ckpt: Path, fingerprint: str, model_dir: Path) -> None:
    """A run must not resume with another tokenizer: its token ids (and drafts) would mean other text."""
    from megatron_specrl.config import ConfigError
    if state.get("tokenizer") != fingerprint:
        raise ConfigError(f"tokenizer mismatch: checkpoint {ckpt} was trained with tokenizer "
                          f"{state.get('tokenizer')}, model.path {model_dir} has {fingerprint}")


# what makes a learner checkpoint another model's: its tensors would not fit (or mean other things)
ARCH_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings")


def check_model(ckpt: Path, model_dir: Path) -> None:
    """A run must not resume a checkpoint of another model: the learner's dist-checkpoint load would
    fail deep in a Ray actor with a traceback (other shapes), or load weights meant for another
    architecture. The checkpoint's own HF config (learner/hf/config.json) is compared with model.path's;
    a checkpoint without one (written before it was copied there) is not checked."""
    from megatron_specrl.config import ConfigError
    saved_file, current_file = Path(ckpt) / "learner" / "hf" / "config.json", Path(model_dir) / "config.json"
    if not saved_file.is_file() or not current_file.is_file():
        return
    saved, current = json.loads(saved_file.read_text()), json.loads(current_file.read_text())
    diff = [f"{k} {saved.get(k)!r} vs {current.get(k)!r}" for k in ARCH_KEYS if saved.get(k) != current.get(k)]
    if diff:
        raise ConfigError(f"model mismatch: checkpoint {ckpt} was trained with another model than model.path "
                          f"{model_dir} ({', '.join(diff)})")


def check_optimizer(ckpt: Path, distributed_optimizer: bool) -> None:
    """The learner loads optimizer state only of its own kind (learner/worker.py load_checkpoint);
    checked here too so the mismatch is one line before any actor starts, not a Ray traceback."""
    from megatron_specrl.config import ConfigError
    meta = Path(ckpt) / "learner" / "specrl_learner.json"
    if not meta.is_file():
        return
    saved = bool(json.loads(meta.read_text()).get("distributed_optimizer", False))
    if saved != distributed_optimizer:
        kind = "Megatron distributed optimizer" if saved else "torch AdamW"
        raise ConfigError(f"optimizer mismatch: checkpoint {ckpt} holds {kind} state; set "
                          f"learner.distributed_optimizer={str(saved).lower()} to resume it")
