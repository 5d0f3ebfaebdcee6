"""FakeNccl: a stand-in for ``cupy.cuda.nccl`` over CPU memory, so the process
group's CUDA path (communicators through the store, pointers, byte counts, type
codes, groups, NCCL's own collectives, aborts) runs where there is no GPU.
:func:`ringcomm.testing.nccl_groups` runs process groups over it on threads.
"""
from __future__ import annotations

import collections
import ctypes
import os
import threading
from typing import Any

import torch

from ringcomm.schedules.simulator import SimFabric
from ringcomm.transport.nccl import DTYPE_CODES


class FakeNccl:
    """A stand-in for ``cupy.cuda.nccl`` over CPU memory, for running ringcomm's
    NCCL path (communicator set-up through the store, pointers, byte counts, type
    codes, groups, NCCL's own collectives, aborts) where there is no GPU.

    Messages follow NCCL's rules through :class:`ringcomm.schedules.simulator.SimFabric`:
    ``groupEnd()`` returns once the group completed (as if the stream were
    synchronised after each group), so a schedule that would hang on a GPU ends in
    :class:`ringcomm.schedules.simulator.SimulatorError` naming the cycle. NCCL's own
    collectives are lowered to messages to every peer plus a local reduction.

    Pass it as ``nccl=`` to :class:`ringcomm.ProcessGroupRingcomm` with
    ``nccl_device_type="cpu"``; :func:`nccl_groups` does that for a whole world.

    With ``record=True`` nothing moves: every call is counted (``calls``) and
    returns at once, and a communicator needs no peers. That measures the Python
    time of ringcomm's CUDA path alone (``scripts/bench_cuda_path.py``).

    Args:
        id_form: what ``get_unique_id`` returns: ``"bytes"`` (CuPy 14) or
            ``"tuple"`` of signed chars (CuPy 13); the communicator takes only that.
        timeout_s: how long a group may wait for its peers.
        record: count the calls and do nothing else.
    """

    available = True

    def __init__(self, id_form: str = "bytes", timeout_s: float = 60.0, record: bool = False):
        if id_form not in ("bytes", "tuple"):
            raise ValueError(f"FakeNccl: id_form must be 'bytes' or 'tuple', got {id_form!r}")
        self.id_form = id_form
        self.timeout_s = timeout_s
        self.record = record
        self._fabrics: dict[bytes, SimFabric] = {}
        self._lock = threading.Lock()
        self._tls = threading.local()
        self.calls: dict[str, int] = collections.defaultdict(int)  # per method, for tests

    @staticmethod
    def get_version() -> int:
        return 22703

    def get_unique_id(self) -> Any:
        raw = os.urandom(128)
        if self.id_form == "bytes":
            return raw
        return tuple(x - 256 if x > 127 else x for x in raw)

    def NcclCommunicator(self, ndev: int, uid: Any, rank: int) -> "_FakeComm":  # noqa: N802
        self.calls["NcclCommunicator"] += 1
        want = bytes if self.id_form == "bytes" else tuple
        if not isinstance(uid, want):
            raise TypeError(f"FakeNccl({self.id_form!r}): the unique id must be "
                            f"{want.__name__}, got {type(uid).__name__}")
        if self.record:
            if not 0 <= rank < ndev:
                raise ValueError(f"FakeNccl: rank {rank} does not fit a communicator of {ndev}")
            return _RecordingComm(self, rank, ndev)
        key = bytes(x & 0xFF for x in uid)
        with self._lock:
            fabric = self._fabrics.setdefault(key, SimFabric(ndev))
        if fabric.size != ndev or not 0 <= rank < ndev:
            raise ValueError(f"FakeNccl: rank {rank} of {ndev} does not fit a communicator "
                             f"of {fabric.size}")
        return _FakeComm(self, fabric.comm(rank))

    # -- groups (per thread, as in NCCL) --------------------------------------------
    def groupStart(self) -> None:  # noqa: N802
        self.calls["groupStart"] += 1
        if self.record:
            return
        depth = getattr(self._tls, "depth", 0)
        if depth == 0:
            self._tls.ops = []
        self._tls.depth = depth + 1

    def groupEnd(self) -> None:  # noqa: N802
        if self.record:
            self.calls["groupEnd"] += 1
            return
        depth = getattr(self._tls, "depth", 0)
        if depth == 0:
            raise RuntimeError("FakeNccl: groupEnd without groupStart")
        self._tls.depth = depth - 1
        if depth == 1:
            ops, self._tls.ops = self._tls.ops, []
            self._run(ops)

    def _enqueue(self, comm: "_FakeComm", sends: list, recvs: list, post=None) -> None:
        """``sends``: ``(peer, tensor)``; ``recvs``: ``(peer, tensor)``; ``post``: runs
        once the group completed."""
        item = (comm, sends, recvs, post)
        if getattr(self._tls, "depth", 0):
            self._tls.ops.append(item)
        else:  # a lone call is a group of its own
            self._run([item])

    def _run(self, items: list) -> None:
        comms = []
        for comm, _, _, _ in items:
            if comm not in comms:
                comms.append(comm)
        for c in comms:
            c.sim.group_start()
        for comm, sends, recvs, _ in items:
            for peer, t in sends:
                comm.sim.send(t, peer)
            for peer, t in recvs:
                comm.sim.recv(t, peer)
        for c in comms:
            c.sim.group_end("group")
        for c in comms:
            c.sim.synchronize(self.timeout_s)
        for _, _, _, post in items:
            if post is not None:
                post()


#: NCCL type code -> torch dtype
_FAKE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def memory_at(ptr: int, count: int, code: int) -> torch.Tensor:
    """The ``count`` elements of type ``code`` at address ``ptr``, as a tensor."""
    dtype = _FAKE_DTYPES[code]
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    raw = (ctypes.c_char * nbytes).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


def _fold(parts: list, op: int) -> torch.Tensor:
    acc = parts[0].clone()
    for x in parts[1:]:
        if op in (0, 4):
            acc.add_(x)
        elif op == 1:
            acc.mul_(x)
        elif op == 2:
            torch.maximum(acc, x, out=acc)
        elif op == 3:
            torch.minimum(acc, x, out=acc)
        else:
            raise ValueError(f"FakeNccl: unknown op code {op}")
    if op == 4:
        acc = acc / len(parts) if acc.is_floating_point() else torch.div(
            acc, len(parts), rounding_mode="trunc")
    return acc


class _FakeComm:
    """One rank's communicator of a :class:`FakeNccl`."""

    def __init__(self, lib: FakeNccl, sim: Any):
        self.lib = lib
        self.sim = sim
        self.rank, self.size = sim.rank, sim.size
        self.aborted = False

    def _others(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank]

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self.lib.calls["send"] += 1
        self.lib._enqueue(self, [(peer, memory_at(sendbuf, count, datatype))], [])

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self.lib.calls["recv"] += 1
        self.lib._enqueue(self, [], [(peer, memory_at(recvbuf, count, datatype))])

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,  # noqa: N802
                  stream: int) -> None:
        self.lib.calls["allReduce"] += 1
        mine = memory_at(sendbuf, count, datatype)
        theirs = {r: torch.empty_like(mine) for r in self._others()}

        def post():
            parts = [mine if r == self.rank else theirs[r] for r in range(self.size)]
            memory_at(recvbuf, count, datatype).copy_(_fold(parts, op))

        self.lib._enqueue(self, [(r, mine) for r in theirs], list(theirs.items()), post)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int,
               stream: int) -> None:
        self.lib.calls["reduce"] += 1
        mine = memory_at(sendbuf, count, datatype)
        if self.rank != root:
            self.lib._enqueue(self, [(root, mine)], [])
            return
        theirs = {r: torch.empty_like(mine) for r in self._others()}

        def post():
            parts = [mine if r == self.rank else theirs[r] for r in range(self.size)]
            memory_at(recvbuf, count, datatype).copy_(_fold(parts, op))

        self.lib._enqueue(self, [], list(theirs.items()), post)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        self.lib.calls["broadcast"] += 1
        if self.rank == root:
            src = memory_at(sendbuff, count, datatype)

            def post():
                if sendbuff != recvbuff:
                    memory_at(recvbuff, count, datatype).copy_(src)

            self.lib._enqueue(self, [(r, src) for r in self._others()], [], post)
        else:
            self.lib._enqueue(self, [], [(root, memory_at(recvbuff, count, datatype))])

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,  # noqa: N802
                  stream: int) -> None:
        self.lib.calls["allGather"] += 1
        mine = memory_at(sendbuf, count, datatype)
        out = memory_at(recvbuf, count * self.size, datatype).view(self.size, -1) if count else None

        def post():
            if out is not None:
                out[self.rank].copy_(mine)

        self.lib._enqueue(self, [(r, mine) for r in self._others()],
                          [(r, out[r]) for r in self._others()] if out is not None else [], post)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int,  # noqa: N802
                      op: int, stream: int) -> None:
        self.lib.calls["reduceScatter"] += 1
        if not recvcount:
            return
        blocks = memory_at(sendbuf, recvcount * self.size, datatype).view(self.size, -1)
        theirs = {r: torch.empty_like(blocks[0]) for r in self._others()}

        def post():
            parts = [blocks[r] if r == self.rank else theirs[r] for r in range(self.size)]
            memory_at(recvbuf, recvcount, datatype).copy_(_fold(parts, op))

        self.lib._enqueue(self, [(r, blocks[r]) for r in theirs], list(theirs.items()), post)

    def check_async_error(self) -> None:
        pass

    def abort(self) -> None:
        self.lib.calls["abort"] += 1
        self.aborted = True
        self.sim.abort()

    def destroy(self) -> None:
        self.lib.calls["destroy"] += 1
        self.sim.close()


class _RecordingComm:
    """A communicator of a recording :class:`FakeNccl`: every call is counted and
    returns at once (argument lists as ``cupy.cuda.nccl.NcclCommunicator``'s)."""

    def __init__(self, lib: FakeNccl, rank: int, size: int):
        self.lib, self.rank, self.size = lib, rank, size
        self._calls = lib.calls

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._calls["send"] += 1

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._calls["recv"] += 1

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,  # noqa: N802
                  stream: int) -> None:
        self._calls["allReduce"] += 1

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int,
               stream: int) -> None:
        self._calls["reduce"] += 1

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        self._calls["broadcast"] += 1

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,  # noqa: N802
                  stream: int) -> None:
        self._calls["allGather"] += 1

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int,  # noqa: N802
                      op: int, stream: int) -> None:
        self._calls["reduceScatter"] += 1

    def check_async_error(self) -> None:
        pass

    def abort(self) -> None:
        self._calls["abort"] += 1

    def destroy(self) -> None:
        self._calls["destroy"] += 1
