"""Engine log files: tee the engine's loggers into a file, and quote its last lines in errors.

Shared by every engine and by the Ray handle (which reads the file an actor wrote), so it lives
apart from any engine: importing it needs neither vLLM nor SGLang.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path


def tail_lines(path: str | Path | None, n: int = 50) -> list[str]:
    """Last n lines of a log file (empty if it does not exist)."""
    if not path or not Path(path).is_file():
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        return f.read().decode("utf-8", "replace").splitlines()[-n:]


class _OncePerRecord(logging.Filter):
    """The handler sits on several loggers of one hierarchy: write each record once."""

    def __init__(self):
        super().__init__()
        self._last = None

    def filter(self, record):
        if record is self._last or not record.name.startswith(("vllm", "megatron_specrl")):
            return False
        self._last = record
        return True


_LOG_ROOTS = ("", "vllm", "megatron_specrl")


def attach_log_file(path: Path) -> logging.Handler:
    """Tee vLLM's and our loggers into `path` so failures can quote the engine's last lines.
    vLLM's module loggers may hang off the root logger or off a non-propagating "vllm"
    logger depending on its logging config, so the handler goes on both."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    handler.addFilter(_OncePerRecord())
    reattach_log_file(handler)
    for name in ("vllm", "megatron_specrl"):
        lg = logging.getLogger(name)
        if lg.level == logging.NOTSET or lg.level > logging.INFO:
            lg.setLevel(logging.INFO)
    return handler


def reattach_log_file(handler: logging.Handler) -> None:
    """vLLM re-applies its dictConfig while the engine starts, dropping foreign handlers."""
    for name in _LOG_ROOTS:
        lg = logging.getLogger(name)
        if handler not in lg.handlers:
            lg.addHandler(handler)


def detach_log_file(handler: logging.Handler) -> None:
    for name in _LOG_ROOTS:
        logging.getLogger(name).removeHandler(handler)
    handler.close()
