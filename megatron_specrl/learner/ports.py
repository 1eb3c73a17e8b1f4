"""A free TCP port for a rendezvous (torch.distributed's MASTER_PORT), asked of the OS.

One helper for the learner group, checkpoint conversion and the tests that spawn ranks.

Why not simply bind port 0: the kernel then hands out a port from its ephemeral range
(`net.ipv4.ip_local_port_range`, 32768-60999 by default), the same range it draws from for
every outgoing connection. Between asking and binding the rendezvous, gloo's pair sockets,
Ray or any client can be given that very port, and the rendezvous fails with EADDRINUSE
(seen in CI: the 2nd of 4 ports asked up front was taken by the 1st group's gloo sockets).
A port below the ephemeral range is never handed out implicitly; only an explicit bind can
take it. So the port is drawn at random below that range and kept only if it binds now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 20000              # above Ray's default worker ports (10002-19999) and its GCS / dashboard / client
_AVOID = frozenset({29400, 29500})   # torch.distributed's c10d and torchrun defaults, in the range drawn from


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for implicit ports (Linux's setting; the common default elsewhere)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "", tries: int = 200) -> int:
    """A port nobody listens on now, outside the ephemeral range where one exists below it;
    `host` "" (every interface) or e.g. "127.0.0.1"."""
    low = ephemeral_range()[0]
    if low - 1 > _LOWEST:
        rng = random.SystemRandom()                  # independent of seeded `random` in callers
        for _ in range(tries):
            port = rng.randrange(_LOWEST, low)
            if port not in _AVOID and _binds(host, port):
                return port
    with socket.socket() as s:                       # no room below the range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]
