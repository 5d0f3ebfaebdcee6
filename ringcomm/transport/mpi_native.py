"""MPI's own collectives, the ``native`` algorithm on CPU: one call shape's MPI
types and op looked up once (:func:`call`), a non-blocking collective issued on the
caller's buffers at every start and polled like point-to-point, so the group's
deadline holds. MPI cannot cancel a collective: after a timeout its buffers stay
referenced until MPI reports the request done
(:data:`ringcomm.transport.mpi_requests.limbo`)."""
from __future__ import annotations

from typing import Any

import torch
from mpi4py import MPI

from ringcomm import mpi_serial, ops
from ringcomm.transport.base import Handle, TransportAborted, TransportTimeout, packed
from ringcomm.transport.mpi_requests import complete

_INF = float("inf")
_fromaddress = MPI.buffer.fromaddress
_BYTE = MPI.BYTE
_mpi_lock = mpi_serial.LOCK

_MPI_TYPES = {torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.int8: "INT8_T",
              torch.uint8: "UINT8_T", torch.int16: "INT16_T", torch.int32: "INT32_T",
              torch.int64: "INT64_T", torch.bool: "UINT8_T"}
if MPI.FLOAT16_T != MPI.DATATYPE_NULL:  # MPICH 4 has it; nobody has bfloat16 yet
    _MPI_TYPES[torch.float16] = "FLOAT16_T"
_MPI_OPS = {"SUM": "SUM", "AVG": "SUM", "PRODUCT": "PROD", "MIN": "MIN", "MAX": "MAX",
            "BAND": "BAND", "BOR": "BOR", "BXOR": "BXOR"}
# bool travels as bytes 0/1: torch's sum/max of bools is "or", product/min is "and"
_BOOL_OPS = {"SUM": "BOR", "AVG": "BOR", "MAX": "BOR", "BOR": "BOR", "PRODUCT": "BAND",
             "MIN": "BAND", "BAND": "BAND", "BXOR": "BXOR"}


def _vector(chunks: list, fill: bool) -> tuple[list, torch.Tensor | None]:
    """An MPI ``[buffer, counts, displs, BYTE]`` over 1-D byte ``chunks``; when they
    are not back to back, over a temporary (filled from them when ``fill``), which is
    returned so the caller can copy results out of it."""
    layout = packed(chunks)
    tmp = None
    if layout is None:
        counts = [c.numel() for c in chunks]
        tmp = torch.empty(sum(counts), dtype=torch.uint8)
        if fill and tmp.numel():
            torch.cat(chunks, out=tmp)
        displs = [sum(counts[:i]) for i in range(len(counts))]
        layout = (tmp.data_ptr(), counts, displs)
    base, counts, displs = layout
    return [_fromaddress(base, sum(counts)), counts, displs, _BYTE], tmp


_NATIVE = ("allreduce", "reduce", "reduce_scatter", "broadcast", "allgather", "gather",
           "scatter", "alltoall", "barrier")


class NativeCall:
    """One of MPI's own collectives for one call shape (see
    :meth:`ringcomm.transport.mpi.MPITransport.native_init`): :meth:`start` issues it on the caller's buffers,
    :meth:`finish` waits for it.

    MPI's collectives progress only inside MPI calls: the wait never naps (as MPI's
    blocking calls never do); a 64 MiB Iallreduce took 1.4 s with naps after 50 ms.
    """

    __slots__ = ("tp", "what", "mop", "mtype", "root", "item", "handle", "unstage")

    def __init__(self, tp: Any, what: str, mop, mtype, root: int, item: int):
        self.tp, self.what, self.mop, self.mtype = tp, what, mop, mtype
        self.root, self.item = root, item
        self.handle: Handle | None = None
        self.unstage = None

    def start(self, bufs: list) -> None:
        tp, coll, mop, mtype, root = self.tp, self.what, self.mop, self.mtype, self.root
        comm, p, r = tp.comm, tp.size, tp.rank
        keep: list = list(bufs)  # referenced until the collective completes (or for good)
        self.unstage = None
        with _mpi_lock:
            if coll == "allreduce":
                buf = bufs[0]
                req = comm.Iallreduce(MPI.IN_PLACE, [_fromaddress(buf.data_ptr(), buf.nbytes),
                                                     buf.numel(), mtype], mop)
            elif coll == "reduce":
                buf = bufs[0]
                mem = [_fromaddress(buf.data_ptr(), buf.nbytes), buf.numel(), mtype]
                req = (comm.Ireduce(MPI.IN_PLACE, mem, mop, root) if r == root
                       else comm.Ireduce(mem, None, mop, root))
            elif coll == "reduce_scatter":
                chunks, out = bufs[:p], bufs[p]
                base, counts, _ = packed(chunks)  # the process group packs them
                item = self.item
                req = comm.Ireduce_scatter(
                    [_fromaddress(base, sum(counts)), sum(counts) // item, mtype],
                    [_fromaddress(out.data_ptr(), out.nbytes), out.numel(), mtype],
                    [c // item for c in counts], mop)
            elif coll == "broadcast":
                buf = bufs[0]
                req = comm.Ibcast([_fromaddress(buf.data_ptr(), buf.nbytes), _BYTE], root)
            elif coll == "allgather":
                chunks, inp = bufs[:p], bufs[p]
                vec, tmp = _vector(chunks, fill=False)
                keep.append(tmp)
                same = tmp is None and inp.numel() and inp.data_ptr() == chunks[r].data_ptr()
                send = MPI.IN_PLACE if same else [_fromaddress(inp.data_ptr(), inp.nbytes), _BYTE]
                req = comm.Iallgatherv(send, vec)
                self.unstage = (tmp, chunks)
            elif coll in ("gather", "scatter"):
                chunks, mine = bufs[:p], bufs[p]
                to_root = coll == "gather"
                own = [_fromaddress(mine.data_ptr(), mine.nbytes), _BYTE]
                vec = None
                if r == root:
                    vec, tmp = _vector(chunks, fill=not to_root)
                    keep.append(tmp)
                    if tmp is None and mine.numel() and mine.data_ptr() == chunks[r].data_ptr():
                        own = MPI.IN_PLACE  # MPI forbids aliased buffers
                    if to_root:
                        self.unstage = (tmp, chunks)
                req = comm.Igatherv(own, vec, root) if to_root else comm.Iscatterv(vec, own, root)
            elif coll == "alltoall":
                sends, recvs = bufs[:p], bufs[p:]
                svec, stmp = _vector(sends, fill=True)
                rvec, rtmp = _vector(recvs, fill=False)
                keep += [stmp, rtmp]
                req = comm.Ialltoallv(svec, rvec)
                self.unstage = (rtmp, recvs)
            else:  # barrier
                req = comm.Ibarrier()
        self.handle = Handle(req, keep, -1, "collective", nbytes=0)

    def finish(self, bufs: list) -> None:
        tp, h = self.tp, self.handle
        if not complete([h.req], [None], tp._deadline, _INF, tp.max_sleep_s,
                        tp._match_all_any_source if tp._any_source else None, tp.stopped):
            if tp._stop is not None:
                raise TransportAborted(tp._stop)
            raise TransportTimeout(f"waiting for MPI's own {self.what} (MPI_I{self.what}) to "
                                   "complete on every rank")
        self.handle = None
        if self.unstage is not None:
            tmp, chunks = self.unstage
            if tmp is not None:
                off = 0
                for c in chunks:
                    c.copy_(tmp[off:off + c.numel()])
                    off += c.numel()

    def handles(self) -> list[Handle]:
        """The request in flight, if any (a failed collective's, to abandon)."""
        return [] if self.handle is None else [self.handle]


def check(collective: str, dtype: torch.dtype) -> None:
    """Raise ValueError unless MPI can run ``collective`` on ``dtype``."""
    if collective in ("allreduce", "reduce", "reduce_scatter") and dtype not in _MPI_TYPES:
        raise ValueError(f"ringcomm {collective}: algorithm 'native' (MPI's own) cannot reduce "
                         f"{dtype}: MPI has no such type; use ring or tree")


def call(tp: Any, collective: str, dtype: torch.dtype, op, root: int) -> "NativeCall":
    """MPI's own collective for one call shape: its MPI types and op looked up once,
    a non-blocking collective (``MPI_Iallreduce`` and friends) issued at every start.

    Not MPI-4's persistent collectives: their initialization is itself collective
    (every rank must make the same ``*_init`` calls in the same order), so binding
    them to the caller's buffers, whose addresses each rank sees change at its own
    times, would hang; bound once to buffers of their own, the copies in and out
    made them slower than ``MPI_Iallreduce`` (3.5 against 3.0 us at 4 KiB, 173
    against 122 us at 1 MiB, 2 ranks here).
    """
    if collective not in _NATIVE:
        raise ValueError(f"ringcomm: MPI has no native {collective!r}")
    mop = mtype = None
    if collective in ("allreduce", "reduce", "reduce_scatter"):
        mop = getattr(MPI, (_BOOL_OPS if dtype == torch.bool else _MPI_OPS)[ops.op_name(op)])
        mtype = getattr(MPI, _MPI_TYPES[dtype])
    return NativeCall(tp, collective, mop, mtype, root, dtype.itemsize)
