"""free_port: a bindable port outside the kernel's ephemeral range (where outgoing sockets and
gloo's pair connections get theirs), so a port asked ahead of its rendezvous is not taken.
"""

import socket
from megatron_specrl.learner import ports

def test_port_is_free_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    seen = set()
    for _ in range(50):
        p = ports.free_port("127.0.0.1")
        assert p < low and p not in ports._AVOID
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))                 # it is free now
        seen.add(p)
    assert len(seen) > 40                            # drawn at random, not one fixed port


def test_a_port_in_use_is_never_returned(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken, taken])

        class Rng:
            def randrange(self, a, b):
                return next(draws, a + 7)

        monkeypatch.setattr(ports.random, "SystemRandom", Rng)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (max(taken, ports._LOWEST + 8) + 1, 60999))
        assert ports.free_port("127.0.0.1") == ports._LOWEST + 7


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    p = ports.free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
