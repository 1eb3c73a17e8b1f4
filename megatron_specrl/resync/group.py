"""The resync broadcast group: learner rank 0 (the source, group rank 0) + one receiver per engine actor.

It is separate from Megatron's default group (the learner ranks already own that one and the
engines are not in it), so it is built without init_process_group: learner rank 0 opens a TCPStore
on a free port and every member joins with that address under a per-generation key prefix, so a
restarted engine joins a fresh group instead of the dead one's.

CPU: torch's ProcessGroupGloo; its op timeout turns a silent peer into an error and a dead peer
fails the next op at once. GPU: vLLM's StatelessProcessGroup + PyNcclCommunicator on the same store
(the verl / OpenRLHF pattern); NCCL ops have no timeout, so there the caller's Ray timeout bounds a hang.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class ResyncTransportError(RuntimeError):
    """A weight transfer failed (peer gone, timeout, malformed data); the message says which."""


def _first_line(err: BaseException) -> str:
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
                                       f"failed (timeout {self.timeout_s:g}s): {_first_line(e)}") from e

    def close(self) -> None:
        self.pg = None   # drops gloo's sockets: peers blocked on this group fail instead of waiting


class PyncclGroup:
    """NCCL through vLLM's communicator: usable next to the learner's own torch NCCL group."""

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
                                       f"failed: {_first_line(e)}") from e

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


class BroadcastEndpoint:
    """One process's membership: learner rank 0 opens the store once, every member `join`s per generation."""

    PREFIX = "specrl-resync"

    def __init__(self):
        self._store = None
        self._store_addr: tuple[str, int] | None = None
        self._is_master = False
        self.group: GlooGroup | PyncclGroup | None = None
        self.generation: int | None = None

    def open_store(self, host: str, timeout_s: float) -> tuple[str, int]:
        """Source side: a TCPStore on a free port of this node (kept across generations)."""
        if self._store is None or not self._is_master:
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=timeout_s))
            self._store_addr, self._is_master = (host, self._store.port), True
        return self._store_addr

    def join(self, host: str, port: int, rank: int, world: int, generation: int, timeout_s: float) -> str:
        """Build this member's group (blocks until all `world` members joined); returns the backend."""
        self.close()
        if self._store_addr != (host, port):
            self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            self._store_addr, self._is_master = (host, port), False
        store = dist.PrefixStore(f"{self.PREFIX}/{generation}", self._store)
        cls = PyncclGroup if torch.cuda.is_available() else GlooGroup
        try:
            self.group = cls(store, rank, world, timeout_s)
        except ResyncTransportError:
            raise
        except Exception as e:   # a member never arrived (store timeout) or the backend failed to start
            raise ResyncTransportError(f"resync broadcast: rank {rank}/{world} could not join generation "
                                       f"{generation} at {host}:{port}: {_first_line(e)}") from e
        self.generation = generation
        return cls.backend

    def require(self) -> GlooGroup | PyncclGroup:
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
