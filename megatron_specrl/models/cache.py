"""Directories built once and shared by later runs (the tiny models, the warm-up checkpoints)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def build_once(final: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp)` in a temporary directory beside `final` and rename it into place: a crash never
    leaves a half-written directory that a later run trusts. `marker` is the file `build` writes last;
    a `final` without it (an interrupted build) is replaced, and when another process renamed its own
    result into place first, that result is kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
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
