"""The resync broadcast group: learner rank 0 (the source, group rank 0) + one receiver per engine actor.

It is separate from Megatron's default group (the learner ranks already own that one and the
engines are not in it), so it is built without init_process_group: learner rank 0 opens a TCPStore
on a free port and every member joins with that address under a per-generation key prefix, so a
restarted engine joins a fresh group instead of the dead one's.

CPU: torch's ProcessGroupGloo; its op timeout turns a silent peer into an error and a dead peer
fails the next op at once. GPU: torch's ProcessGroupNCCL on the same store, built as
distributed_c10d's new_group builds one (ProcessGroupNCCL.Options with `_timeout`, `nccl_options`):
each op is waited for with the group timeout (a blocking wait, which aborts the communicator and
raises), so a dead or silent peer is an error naming the transfer after `timeout_s`, not a hang until
the driver's Ray timeout; the watchdog's own timeout is a little longer (NCCL_WATCHDOG_GRACE_S), a
backstop that with torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING ends the process. A torch without
NCCL falls back to vLLM's StatelessProcessGroup + PyNcclCommunicator (no op timeout there).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist


class ResyncTransportError(RuntimeError):
    """A weight transfer failed (peer gone, timeout, malformed data); the message says which."""


def first_line(err: BaseException) -> str:
    """An error's first line (its type where it has no text): what a one-line error quotes of its cause."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class GlooGroup:
    backend = "gloo"

    def __init__(self, store, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.device = torch.device("cpu")
        self.pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        try:
            self.pg.broadcast([tensor], opts).wait()
        except RuntimeError as e:
            act = f"sending {what}" if self.rank == src else f"receiving {what} from group rank {src}"
            raise ResyncTransportError(f"resync broadcast (gloo, rank {self.rank}/{self.world}): {act} "
                                       f"failed (timeout {self.timeout_s:g}s): {first_line(e)}") from e

    def close(self) -> None:
        self.pg = None   # drops gloo's sockets: peers blocked on this group fail instead of waiting


# The watchdog's timeout exceeds the op wait's by this much, so the blocking wait raises (and close()
# aborts the group) before the watchdog, which by default tears the whole process down.
NCCL_WATCHDOG_GRACE_S = 10.0


def nccl_options(options_cls, timeout_s: float):
    """ProcessGroupNCCL.Options as distributed_c10d._new_process_group_helper fills them for
    new_group / init_process_group: `_timeout` (the watchdog's) and a normal-priority stream.
    `options_cls` is a parameter so a CPU build (no ProcessGroupNCCL) can test this with a fake."""
    opts = options_cls()
    opts.is_high_priority_stream = False
    opts._timeout = timedelta(seconds=timeout_s + NCCL_WATCHDOG_GRACE_S)
    return opts


class NcclGroup:
    """torch's ProcessGroupNCCL, built directly on the resync store like GlooGroup (not registered
    with torch.distributed, so it lives beside the learner's own default NCCL group)."""

    backend = "nccl"

    def __init__(self, store, rank: int, world: int, timeout_s: float, pg_cls=None,
                 device: torch.device | None = None):
        pg_cls = pg_cls if pg_cls is not None else dist.ProcessGroupNCCL
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.pg = pg_cls(store, rank, world, nccl_options(pg_cls.Options, timeout_s))
        # NCCL builds its communicator on the first op: do it here, so joining stays a rendezvous
        # (as with gloo) and a member that never comes fails the join, not the first bucket.
        try:
            self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device), 0, "the join handshake")
        except BaseException:
            self.close()
            raise

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        act = f"sending {what}" if self.rank == src else f"receiving {what} from group rank {src}"
        where = f"resync broadcast (nccl, rank {self.rank}/{self.world}): {act} failed (timeout {self.timeout_s:g}s)"
        if self.pg is None:
            raise ResyncTransportError(f"{where}: the group was closed")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        try:
            done = self.pg.broadcast([tensor], opts).wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as e:   # DistBackendError: timed out (communicator aborted) or NCCL error
            raise ResyncTransportError(f"{where}: {first_line(e)}") from e
        if done is False:
            raise ResyncTransportError(f"{where}: not complete after {self.timeout_s:g}s")

    def close(self) -> None:
        # Abort, not only drop: peers blocked on this group fail at once, and the communicator and
        # the watchdog thread are freed (one per regroup otherwise).
        pg, self.pg = getattr(self, "pg", None), None
        abort = getattr(pg, "abort", None)
        if abort is not None:
            try:
                abort()
            except Exception:   # close() runs on error paths: never hide the error being raised
                pass


class PyncclGroup:
    """NCCL through vLLM's communicator, for a torch built without NCCL: no op timeout (the
    caller's Ray timeout bounds a hang)."""

    backend = "nccl"

    def __init__(self, store, rank: int, world: int, timeout_s: float):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.meta = StatelessProcessGroup(rank=rank, world_size=world, store=store)
        self.comm = PyNcclCommunicator(self.meta, device=self.device)
        if self.comm.disabled:
            raise ResyncTransportError("resync broadcast: vLLM's PyNcclCommunicator found no NCCL library")

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        stream = torch.cuda.current_stream(self.device)
        try:
            self.comm.broadcast(tensor, src=src, stream=stream)
            stream.synchronize()
        except RuntimeError as e:
            raise ResyncTransportError(f"resync broadcast (nccl, rank {self.rank}/{self.world}): {what} "
                                       f"failed: {first_line(e)}") from e

    def close(self) -> None:
        # Free the communicator, not only the reference: PyNcclCommunicator has no finalizer, so
        # each regroup (engine restart, failed sync) would leak one with its GPU buffers. destroy()
        # aborts (ncclCommAbort), safe with peers gone; vLLMs without it keep the old behaviour.
        comm, self.comm, self.meta = getattr(self, "comm", None), None, None
        if comm is not None and hasattr(comm, "destroy"):
            try:
                comm.destroy()
            except Exception:   # close() runs on error paths: never hide the error being raised
                pass


def group_class() -> type:
    """gloo without CUDA; torch's NCCL group with it (vLLM's communicator if torch lacks NCCL)."""
    if not torch.cuda.is_available():
        return GlooGroup
    return NcclGroup if dist.is_nccl_available() else PyncclGroup


def listening_socket(host: str) -> socket.socket:
    """A TCP socket bound to `host` on a free port and listening, for TCPStore's `master_listen_fd`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


class BroadcastEndpoint:
    """One process's membership: learner rank 0 opens the store once, every member `join`s per generation."""

    PREFIX = "specrl-resync"

    def __init__(self):
        self._store = None
        self._store_addr: tuple[str, int] | None = None
        self._is_master = False
        self.group: GlooGroup | NcclGroup | PyncclGroup | None = None
        self.generation: int | None = None

    def open_store(self, host: str, timeout_s: float) -> tuple[str, int]:
        """Source side: a TCPStore on a free port of this node (kept across generations), listening on `host`
        (the node's cluster address) only: torch's TCPStore alone binds every interface."""
        if self._store is None or not self._is_master:
            sock = listening_socket(host)
            port = sock.getsockname()[1]
            self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach(),
                                        use_libuv=True)
            self._store_addr, self._is_master = (host, self._store.port), True
        return self._store_addr

    def join(self, host: str, port: int, rank: int, world: int, generation: int, timeout_s: float) -> str:
        """Build this member's group (blocks until all `world` members joined); returns the backend."""
        self.close()
        if self._store_addr != (host, port):
            self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            self._store_addr, self._is_master = (host, port), False
        store = dist.PrefixStore(f"{self.PREFIX}/{generation}", self._store)
        cls = group_class()
        try:
            self.group = cls(store, rank, world, timeout_s)
        except ResyncTransportError:
            raise
        except Exception as e:   # a member never arrived (store timeout) or the backend failed to start
            raise ResyncTransportError(f"resync broadcast: rank {rank}/{world} could not join generation "
                                       f"{generation} at {host}:{port}: {first_line(e)}") from e
        self.generation = generation
        return cls.backend

    def require(self) -> GlooGroup | NcclGroup | PyncclGroup:
        if self.group is None:
            raise ResyncTransportError("resync broadcast: this process is not in a broadcast group "
                                       "(join_resync_group first, or it was closed after a failure)")
        return self.group

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = self.generation = None


class ResyncMember:
    """Mixin for the actors in the group (learner worker, engine actor): their endpoint + join."""

    @property
    def resync_endpoint(self) -> BroadcastEndpoint:
        if getattr(self, "_resync_endpoint", None) is None:
            self._resync_endpoint = BroadcastEndpoint()
        return self._resync_endpoint

    def join_resync_group(self, host: str, port: int, rank: int, world: int, generation: int,
                          timeout_s: float) -> str:
        return self.resync_endpoint.join(host, port, rank, world, generation, timeout_s)
