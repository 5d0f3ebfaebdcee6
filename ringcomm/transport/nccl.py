"""NCCL transport for CUDA tensors, through CuPy's bindings (``cupy.cuda.nccl``).

Tensors are handed to NCCL by address (``data_ptr()``), count and type code,
with the stream as a plain int: no CuPy arrays, no copies, and bfloat16 works
with every CuPy version. Point-to-point messages travel as bytes; only NCCL's
own collectives (algorithm ``native``) need the element type.

Everything here only *enqueues* work on a stream. Each schedule step is one
``groupStart()``/``groupEnd()`` pair (:class:`ringcomm.execution.executors.GroupProgram`),
local reductions are torch ops issued on the same stream, and waiting, time
limits and errors belong to :class:`ringcomm.runtime.streams.StreamEngine`.

NCCL keeps the group depth per thread, and a call that fails inside a group
leaves the group open: every later NCCL call of that thread, on any
communicator, would be queued and never launched. So every group opened here is
closed on every path (:meth:`NcclLink.close_groups`), as torch's
``AutoNcclGroup`` does.

CuPy is imported on first use only: ``import ringcomm`` works without it, and a
CUDA tensor without it gets an error naming the extra to install.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from typing import Any, Callable, Iterator

import torch

from ringcomm import ops
from ringcomm.backoff import Backoff
from ringcomm.transport.base import Link, packed

#: what to install when CuPy or NCCL is missing
EXTRAS_HINT = ("pip install 'ringcomm[cuda12]' (CUDA 12) or 'ringcomm[cuda13]' (CUDA 13), "
               "which bring CuPy and NCCL")

#: NCCL's type codes (nccl.h ncclDataType_t)
DTYPE_CODES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
               torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
_UINT8 = 1
#: NCCL's op codes (ncclRedOp_t). AVG reduces as a sum: the process group divides
#: afterwards, as for every other algorithm.
OP_CODES = {ops.SUM.value: 0, ops.AVG.value: 0, ops.PRODUCT.value: 1, ops.MAX.value: 2,
            ops.MIN.value: 3}
#: collectives NCCL has (torch's NCCL backend builds the others from send/recv,
#: as ringcomm's own algorithms do)
NCCL_COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter")

#: NCCL's error codes (ncclResult_t), as CuPy's NcclError names them
ERROR_NAMES = {1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR", 2: "NCCL_ERROR_SYSTEM_ERROR",
               3: "NCCL_ERROR_INTERNAL_ERROR", 4: "NCCL_ERROR_INVALID_ARGUMENT",
               5: "NCCL_ERROR_INVALID_USAGE", 6: "NCCL_ERROR_REMOTE_ERROR",
               7: "NCCL_ERROR_IN_PROGRESS", 8: "NCCL_ERROR_TIMEOUT"}
#: the statuses CuPy's ``NcclError`` has no name for (its table stops at 6): its
#: constructor raises ``KeyError(status)`` instead, from ``nccl.pyx``
#: (:func:`nccl_status` recovers them)
CUPY_UNNAMED = (7, 8)
#: ncclGetErrorString's text of those (CuPy cannot give it)
_UNNAMED_TEXT = {7: "NCCL operation in progress", 8: "timeout"}
#: ncclInProgress: a non-blocking call has not finished yet; not an error
IN_PROGRESS = 7
#: what each error usually means for a ringcomm user
_ERROR_CAUSES = {
    1: "a CUDA call inside NCCL failed: is a GPU visible to this process "
       "(CUDA_VISIBLE_DEVICES), its driver loaded, and not out of memory?",
    2: "a system call inside NCCL failed: a socket (is NCCL_SOCKET_IFNAME an interface "
       "that reaches the other ranks?), or shared memory (a container's /dev/shm is often "
       "too small: docker --shm-size)",
    3: "NCCL found itself in an inconsistent state",
    4: "NCCL refused an argument (a pointer not on this device, a rank out of range, or "
       "a communicator used after it was aborted or destroyed)",
    5: "NCCL refused how it was used: two ranks on one GPU (\"Duplicate GPU\") need NCCL "
       ">= 2.30.3 and NCCL_MULTI_RANK_GPU_ENABLE=1; or mismatched calls across ranks",
    6: "a remote rank exited or the network between the ranks failed",
    7: "NCCL's operation is still in progress (a non-blocking communicator's call that "
       "has not finished; ringcomm's communicators are blocking, so NCCL returned it where "
       "ringcomm expected a finished call)",
    8: "NCCL gave up waiting within its own time limit (NCCL >= 2.30): a peer stopped "
       "making the same calls, or the network between the ranks stalled",
}


class NcclUnavailable(RuntimeError):
    """CuPy or NCCL cannot be loaded on this machine."""


_lib: Any = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


#: NCCL's setting that makes the host's issue order the launch order of kernels of
#: different communicators on one device (NCCL >= 2.26; older NCCL ignores it)
LAUNCH_ORDER = "NCCL_LAUNCH_ORDER_IMPLICIT"


def load() -> Any:
    """The ``cupy.cuda.nccl`` module, loaded once.

    Before NCCL reads its settings, ``NCCL_LAUNCH_ORDER_IMPLICIT=1`` is set unless
    the environment sets it: a ringcomm group runs kernels of several communicators
    on one GPU at once (``num_channels > 1``; the pair communicators of send/recv
    beside the group's), and NCCL needs one launch order across them or they may
    deadlock; with it, the order ringcomm issues them in (the same on every rank
    for a group's collectives) is that order. NCCL before 2.26 has no such setting,
    and only the issue order protects it.

    Raises:
        NcclUnavailable: CuPy is not installed, or it cannot load NCCL.
    """
    global _lib, _lib_error
    os.environ.setdefault(LAUNCH_ORDER, "1")
    with _lib_lock:
        if _lib is None and _lib_error is None:
            try:
                from cupy.cuda import nccl
            except Exception as e:  # noqa: BLE001 - ImportError, or CUDA missing underneath
                _lib_error = f"CuPy is not usable here ({type(e).__name__}: {e})"
            else:
                if getattr(nccl, "available", False):
                    _lib = nccl
                else:
                    _lib_error = "CuPy is installed but cannot load the NCCL library"
    if _lib is None:
        raise NcclUnavailable(f"ringcomm: CUDA tensors need CuPy with NCCL: {_lib_error}; "
                              f"{EXTRAS_HINT}")
    return _lib


def version(lib: Any) -> str:
    """NCCL's runtime version as ``major.minor.patch``."""
    code = int(lib.get_version())
    if code >= 10000:  # 2.9 and later: major*10000 + minor*100 + patch
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def encode_id(uid: Any) -> bytes:
    """A unique id from ``get_unique_id()`` as bytes for the store: 128 ``bytes``
    (CuPy 14) or a tuple of 128 chars (CuPy 13: signed, or unsigned where ``char``
    is, as on aarch64), marked with its form."""
    if isinstance(uid, (bytes, bytearray)):
        return b"B" + bytes(uid)
    if any(x > 127 for x in uid):
        return b"U" + bytes(uid)
    return b"T" + bytes(x & 0xFF for x in uid)


def decode_id(data: bytes) -> Any:
    """The inverse of :func:`encode_id`: what this CuPy's ``NcclCommunicator`` takes."""
    form, raw = data[:1], data[1:]
    if form == b"B":
        return bytes(raw)
    if form == b"U":
        return tuple(raw)
    return tuple(x - 256 if x > 127 else x for x in raw)


def last_error(lib: Any) -> str:
    """What NCCL's ``ncclGetLastError`` says of the last failure, or "".

    CuPy does not bind it, so it is called in the NCCL library CuPy loaded (found
    in this process's memory map); a stand-in answers through ``last_error()``."""
    own = getattr(lib, "last_error", None)
    if own is not None:
        return own()
    global _get_last_error
    if _get_last_error is None:
        _get_last_error = _find_get_last_error()
    if not _get_last_error:
        return ""
    try:
        text = _get_last_error(None)
    except Exception:  # noqa: BLE001 - a diagnostic only
        return ""
    return text.decode(errors="replace").strip() if text else ""


_get_last_error: Any = None


def _find_get_last_error() -> Any:
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libnccl.so" in line}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).ncclGetLastError
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        return fn
    return False


def nccl_status(err: BaseException) -> int | None:
    """The NCCL status (``ncclResult_t``) an exception from a CuPy NCCL call carries,
    or None for one that is not NCCL's. CuPy's ``NcclError`` has it as ``status``;
    for a status its name table lacks (:data:`CUPY_UNNAMED`) the error's constructor
    raises ``KeyError(status)`` inside ``nccl.pyx``, which is read back here."""
    status = getattr(err, "status", None)
    if isinstance(status, int):
        return status
    if isinstance(err, KeyError) and len(err.args) == 1 and err.args[0] in CUPY_UNNAMED:
        frames = traceback.extract_tb(err.__traceback__)
        if frames and frames[-1].name.endswith("__init__") and "nccl" in frames[-1].filename:
            return err.args[0]
    return None


def explain(lib: Any, err: BaseException) -> str:
    """``err`` from an NCCL call, with what NCCL said of it (``ncclGetLastError``)
    and what it usually means; "" for an error that is not NCCL's."""
    status = nccl_status(err)
    if status not in ERROR_NAMES:
        return ""
    parts = [str(err) if getattr(err, "status", None) == status
             else f"{ERROR_NAMES[status]}: {_UNNAMED_TEXT[status]}"]
    detail = last_error(lib)
    if detail:
        parts.append(f"NCCL said: {detail}")
    parts.append(f"this usually means {_ERROR_CAUSES[status]}")
    if not os.environ.get("NCCL_DEBUG"):
        parts.append("NCCL_DEBUG=WARN prints NCCL's own account")
    return "; ".join(parts)


def connect(lib: Any, store: Any, prefix: str, rank: int, size: int, timeout_s: float,
            device_context: Callable[[], Any]) -> Any:
    """A new NCCL communicator over ``size`` ranks, its unique id passed through ``store``.

    Rank 0 creates the id. Every rank first announces itself and waits for all
    the others within ``timeout_s``: ``ncclCommInitRank`` cannot time out, so a
    rank that never comes is reported here instead.

    Raises:
        RuntimeError: not every rank arrived in time (names how many did), or NCCL
            could not create the communicator (names the group and the cause).
    """
    key = f"{prefix}/uid"
    if rank == 0:
        store.set(key, encode_id(lib.get_unique_id()))
    arrived = f"{prefix}/arrived"
    store.add(arrived, 1)
    deadline = time.monotonic() + timeout_s
    pace = Backoff(max_nap_s=0.05, first_nap_s=1e-3)
    while True:
        count = store.add(arrived, 0)
        if count >= size:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"ringcomm: creating the NCCL communicator {prefix!r}: only "
                               f"{count} of {size} ranks arrived within {timeout_s:g}s (every "
                               "rank must make the same first CUDA call on this group)")
        pace.pause()
    uid = decode_id(store.get(key))
    try:
        with device_context():
            return lib.NcclCommunicator(size, uid, rank)
    except Exception as e:  # noqa: BLE001 - NCCL's and CUDA's errors, named with the group
        why = explain(lib, e) or (f"{type(e).__name__}: {e}. Is CUDA usable here (a GPU "
                                  "visible, its driver loaded)?")
        raise RuntimeError(f"ringcomm: creating the NCCL communicator {prefix!r} (rank {rank} "
                           f"of {size}) failed: {why}") from e


class NcclLink(Link):
    """One NCCL communicator of a group, on one device, enqueuing on one stream.

    Implements :class:`ringcomm.execution.executors.GroupComm`, so
    :class:`~ringcomm.execution.executors.GroupProgram` drives it; the stream engine makes
    ``stream`` current around every call, so the local reductions (torch ops, which
    the program calls directly: ``local_work_inline``) land on it too.

    Args:
        lib: ``cupy.cuda.nccl`` (or a stand-in with the same interface).
        comm: the ``NcclCommunicator``; this transport owns it.
        rank, size: this rank and the communicator's size.
        device: where the tensors live.
        stream: the stream handle (``cudaStream_t`` as an int) work is enqueued on.
    """

    #: local reductions and copies are torch ops on the current stream
    local_work_inline = True

    def __init__(self, lib: Any, comm: Any, rank: int, size: int, device: torch.device,
                 stream: int):
        super().__init__(rank, size, device)
        self.lib = lib
        self.comm = comm
        self.stream = stream
        self._aborted = False
        # The watchdog checks and aborts from its own thread: never two of these at once
        # (CuPy clears its communicator handle only after ncclCommAbort returned).
        self._life = threading.Lock()
        #: groups this transport opened and has not closed (one thread uses it at a
        #: time: the stream engine's lock)
        self.depth = 0

    # -- the GroupComm interface --------------------------------------------------
    def group_start(self) -> None:
        self.lib.groupStart()
        self.depth += 1

    def group_end(self, label: str = "") -> None:
        # NCCL lowers the depth before it reports the group's error
        self.depth -= 1
        self.lib.groupEnd()

    def close_groups(self) -> None:
        """Close the groups a failure left open (their error is the one already
        raised; what they queued never runs). Call after any exception between
        ``group_start`` and ``group_end``."""
        while self.depth > 0:
            self.depth -= 1
            try:
                self.lib.groupEnd()
            except Exception:  # noqa: BLE001 - the group's stored error, already raised
                pass

    @contextlib.contextmanager
    def group(self, label: str = "") -> Iterator[None]:
        """One NCCL group around the calls of the ``with`` body, closed however the
        body ends."""
        self.group_start()
        try:
            yield
        except BaseException:
            self.close_groups()
            raise
        self.group_end(label)

    def send(self, buf: torch.Tensor, peer: int) -> None:
        # Both sides skip an empty message alike (a schedule's pairs have equal sizes).
        n = buf.numel() * buf.element_size()
        if n:
            self.comm.send(buf.data_ptr(), n, _UINT8, peer, self.stream)

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        n = buf.numel() * buf.element_size()
        if n:
            self.comm.recv(buf.data_ptr(), n, _UINT8, peer, self.stream)

    def message(self, kind: str, buf: torch.Tensor, peer: int) -> tuple | None:
        """The NCCL call that issues a send or receive of ``buf``, with its arguments
        worked out (address, bytes, peer, stream); None for an empty message."""
        n = buf.numel() * buf.element_size()
        if not n:
            return None
        fn = self.comm.send if kind == "send" else self.comm.recv
        return fn, (buf.data_ptr(), n, _UINT8, peer, self.stream)

    def local_reduce(self, dst: torch.Tensor, src: torch.Tensor, op: Any,
                     src_first: bool = False) -> None:
        ops.reduce_(dst, src, op, src_first)

    def local_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    # -- NCCL's own collectives ---------------------------------------------------
    def check_native(self, collective: str, dtype: torch.dtype, op: Any) -> None:
        if collective not in NCCL_COLLECTIVES:
            raise ValueError(f"ringcomm {collective}: NCCL has no {collective} of its own "
                             f"(torch's NCCL backend builds it from send/recv, as ringcomm's "
                             f"own algorithms do); 'native' exists for "
                             f"{', '.join(NCCL_COLLECTIVES)}")
        if collective in ("allreduce", "reduce", "reduce_scatter"):
            if dtype not in DTYPE_CODES:
                raise ValueError(f"ringcomm {collective}: algorithm 'native' (NCCL's own) cannot "
                                 f"reduce {dtype}; NCCL reduces "
                                 f"{', '.join(str(d) for d in DTYPE_CODES)}; use ring or tree")
            if op is not None and op.value not in OP_CODES:
                raise ValueError(f"ringcomm {collective}: NCCL has no ReduceOp."
                                 f"{ops.op_name(op)}; use ring or tree")

    def native_init(self, collective: str, layout: tuple, dtype: torch.dtype, op: Any,
                    root: int) -> "_NcclNative":
        return _NcclNative(self, collective, layout, dtype, op, root)

    def native(self, collective: str, bufs: list, layout: tuple, dtype: torch.dtype, op: Any,
               root: int) -> None:
        """Enqueue NCCL's own ``collective`` on the caller's buffers."""
        c, s, p, me = self.comm, self.stream, self.size, self.rank
        if collective == "allreduce":
            b = bufs[0]
            c.allReduce(b.data_ptr(), b.data_ptr(), b.numel(), DTYPE_CODES[dtype],
                        OP_CODES[op.value], s)
        elif collective == "reduce":
            b = bufs[0]
            c.reduce(b.data_ptr(), b.data_ptr(), b.numel(), DTYPE_CODES[dtype],
                     OP_CODES[op.value], root, s)
        elif collective == "broadcast":
            b = bufs[0]
            c.broadcast(b.data_ptr(), b.data_ptr(), b.numel() * b.element_size(), _UINT8, root, s)
        elif collective == "allgather":
            chunks, inp = bufs[:p], bufs[p]
            counts = [x.numel() for x in chunks]
            if len(set(counts)) == 1 and packed(chunks) is not None:
                c.allGather(inp.data_ptr(), chunks[0].data_ptr(), counts[0], _UINT8, s)
            else:  # uneven or scattered outputs: one broadcast per rank, in one group
                with self.group():
                    for r, x in enumerate(chunks):
                        if x.numel():
                            src = inp if r == me else x
                            c.broadcast(src.data_ptr(), x.data_ptr(), x.numel(), _UINT8, r, s)
        elif collective == "reduce_scatter":
            chunks, out = bufs[:p], bufs[p]
            code, nop = DTYPE_CODES[dtype], OP_CODES[op.value]
            counts = [x.numel() for x in chunks]
            if len(set(counts)) == 1 and packed(chunks) is not None:
                c.reduceScatter(chunks[0].data_ptr(), out.data_ptr(), counts[0], code, nop, s)
            else:  # uneven: one reduce per rank, in one group
                with self.group():
                    for r, x in enumerate(chunks):
                        if x.numel():
                            dst = out if r == me else x
                            c.reduce(x.data_ptr(), dst.data_ptr(), x.numel(), code, nop, r, s)
        else:
            raise ValueError(f"ringcomm: NCCL has no native {collective!r}")

    # -- failure and teardown ---------------------------------------------------------
    def explain(self, err: BaseException) -> str:
        """An NCCL error with what NCCL said of it and what it usually means; "" for
        any other error."""
        return explain(self.lib, err)

    def check_async_error(self) -> None:
        """Raise the communicator's asynchronous error, if it has one (an operation
        still in progress is none)."""
        with self._life:
            if not self._aborted:
                try:
                    self.comm.check_async_error()
                except Exception as e:  # noqa: BLE001 - NCCL's, or CuPy's KeyError for it
                    if nccl_status(e) != IN_PROGRESS:
                        raise

    def abort(self) -> None:
        """Abort the communicator: its pending and running work ends (the data is
        garbage), and a thread blocked in NCCL returns. Idempotent."""
        with self._life:
            if not self._aborted:
                self._aborted = True
                self.comm.abort()

    def close(self) -> None:
        with self._life:
            if not self._aborted:
                self._aborted = True
                self.comm.destroy()


class _NcclNative:
    """NCCL's own collective, prepared: enqueued at every start (NCCL has no
    persistent collectives), nothing to wait for on the CPU."""

    __slots__ = ("tp", "args")

    def __init__(self, tp: NcclLink, *args: Any):
        self.tp, self.args = tp, args

    def start(self, bufs: list) -> None:
        collective, layout, dtype, op, root = self.args
        self.tp.native(collective, bufs, layout, dtype, op, root)

    def finish(self, bufs: list) -> None:
        pass

    def handles(self) -> list:
        return []


#: the name NcclLink had before it was named for what it is (a link: it enqueues
#: NCCL groups, it is no point-to-point Transport), for code written against it
NcclTransport = NcclLink
