"""Directories built once and shared by later runs (the tiny models, the warm-up checkpoints)."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)


def _lock(fd: int, parent: Path) -> None:
    """Take the exclusive lock on the cache directory, saying first when another run holds it: its warm-up
    can hold the directory for minutes, and a run that blocks silently looks hung."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.warning("another run is building in %s: waiting for it (its result is reused if it is "
                    "what this run needs)", parent)
        fcntl.flock(fd, fcntl.LOCK_EX)


@contextmanager
def _building_in(parent: Path) -> Iterator[None]:
    """Hold an exclusive lock on the cache directory `parent` (flock on the directory itself, so no lock
    file is left in it). Two jobs or test workers that need the same warm-up at once then train it once:
    the second waits and reuses the first's result instead of training the same model beside it. Where the
    filesystem refuses flock (Lustre mounted without `flock`, some NFS setups: ENOLCK, EOPNOTSUPP, ENOSYS),
    builds go ahead unlocked, as before the lock: each builds, and the first complete result renamed into
    place is kept."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        try:
            _lock(fd, parent)
        except OSError as e:
            log.warning("cache directory %s refuses a lock (%s): building without one", parent, e)
        yield
    finally:
        os.close(fd)                                   # closing the descriptor releases the lock


def build_once(final: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp)` in a temporary directory beside `final` and rename it into place: a crash never
    leaves a half-written directory that a later run trusts. `marker` is the file `build` writes last;
    a `final` without it (an interrupted build) is replaced. Builds into one cache directory take turns
    (a lock on the directory), and a `final` another process completed meanwhile is returned as it is;
    where the lock is not honoured (some network filesystems), a result another process renamed into
    place first is kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with _building_in(final.parent):
        if (final / marker).is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            build(tmp)
            if final.exists() and not (final / marker).is_file():
                shutil.rmtree(final)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / marker).is_file():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final
