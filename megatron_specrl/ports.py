"""A free TCP port for a rendezvous (torch.distributed's MASTER_PORT), asked of the OS.

One helper for the learner group, checkpoint conversion and the tests that spawn ranks.
The port is free when asked; another process could take it before the rendezvous binds it,
which is the usual (and here accepted) race of every launcher that does this.
"""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A port nobody listens on now; `host` "" (every interface) or e.g. "127.0.0.1"."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
