"""MPI from one thread at a time, and the set-up collectives that keep to it.

:data:`LOCK` is held by every MPI call ringcomm makes, process-wide, but for the three
set-up calls named below. MPI_THREAD_MULTIPLE is requested, but under torchrun
(singletons joined through ports, UCX netmod) MPICH 4.3.2 lost messages when one
thread posted receives while another tested requests (seen: a user irecv never
matched while its message sat in UCX's unexpected queue). Each call under it is
short; waits release it between polls.

A group is set up on whichever thread asks for it (torch's on the caller's, torchft's on
its quorum thread) while other groups' collectives run on theirs. So the set-up's
collectives are MPI's non-blocking forms, started and polled under the lock like any
other request, and bounded: a member that died after meeting the others at the store
ends the set-up with an error within the limit instead of blocking the thread forever.
Connect, accept and a group's communicator from a world (``Create_group``) have no
non-blocking form: they run outside the lock, in a thread of their own bounded by the
caller (:func:`ringcomm.launch.bootstrap._bounded`), since held under the lock a peer
that never came would stop every thread's MPI for good (MPI cannot cancel a call).
Merge, which has none either, runs under the lock once a bounded barrier has seen its
peers arrive. Once such a call is stuck for good, MPICH may also hold what later
set-ups of the process need (its context ids): those then time out as well.

Bottom layer: imports nothing of ringcomm above it; mpi4py only when called.
"""
from __future__ import annotations

import pickle
import threading
import time
from typing import Any

from ringcomm import settings
from ringcomm.backoff import Backoff

__all__ = ["LOCK", "locked", "limit", "wait", "allgather", "bcast", "barrier", "dup"]

LOCK = threading.Lock()

_monotonic = time.monotonic


def locked(call, *args: Any) -> Any:
    """``call(*args)`` with :data:`LOCK` held (for local MPI calls: free, open a port)."""
    with LOCK:
        return call(*args)


def limit(limit_s: float | None) -> float:
    """``limit_s``, or ``RINGCOMM_CONNECT_TIMEOUT`` where it is None: how long one
    set-up step may take."""
    return settings.get("RINGCOMM_CONNECT_TIMEOUT") if limit_s is None else limit_s


def _failed(comm, what: str, limit_s: float) -> Exception:
    import torch.distributed as dist

    return dist.DistBackendError(
        f"ringcomm: {what} (rank {comm.Get_rank()} of {comm.Get_size()}) did not complete "
        f"within {limit_s:g} s: a member of the group stopped, died, or is setting up "
        "another group first (raise RINGCOMM_CONNECT_TIMEOUT for slow starts)")


def wait(req, comm, what: str, limit_s: float, keep: Any = None) -> None:
    """Poll the request ``req`` of a collective over ``comm`` to completion, the lock
    held for each test, for at most ``limit_s`` seconds; then raise
    ``DistBackendError`` naming ``what``. ``keep``: the buffers it uses, kept alive
    while it runs (and, after a timeout, for as long as MPI may still write them)."""
    deadline = _monotonic() + limit_s
    if _stranded:
        _prune()
    pace = Backoff(busy_s=100e-6, spin_s=0.05, max_nap_s=2e-3)
    while True:
        with LOCK:
            if req.Test():
                return
        now = _monotonic()
        if now >= deadline:
            _stranded.append((req, keep))  # MPI may still write into them
            raise _failed(comm, what, limit_s)
        pace.pause(now)


#: requests of set-up collectives that timed out, with their buffers
_stranded: list = []


def _prune() -> None:
    """Forget the timed-out requests MPI has since completed (and their buffers)."""
    with LOCK:
        _stranded[:] = [(req, keep) for req, keep in _stranded if not req.Test()]


def _bytes(obj: Any):
    import numpy as np

    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def allgather(comm, obj: Any, what: str, limit_s: float) -> list:
    """Every rank's ``obj`` (picklable), in rank order: ``comm.allgather`` bounded."""
    import numpy as np
    from mpi4py import MPI

    mine = _bytes(obj)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    one = np.array([mine.size], dtype=np.int64)
    wait(locked(comm.Iallgather, one, sizes), comm, what, limit_s, (one, sizes))
    starts = np.zeros_like(sizes)
    np.cumsum(sizes[:-1], out=starts[1:])
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait(locked(comm.Iallgatherv, [mine, MPI.BYTE], [out, (sizes, starts), MPI.BYTE]),
         comm, what, limit_s, (mine, out, sizes, starts))
    return [pickle.loads(out[a:a + n].tobytes()) for a, n in zip(starts.tolist(),
                                                                    sizes.tolist())]


def bcast(comm, obj: Any, root: int, what: str, limit_s: float) -> Any:
    """Rank ``root``'s ``obj`` on every rank: ``comm.bcast`` bounded."""
    import numpy as np
    from mpi4py import MPI

    data = _bytes(obj) if comm.Get_rank() == root else None
    size = np.array([0 if data is None else data.size], dtype=np.int64)
    wait(locked(comm.Ibcast, size, root), comm, what, limit_s, size)
    if data is None:
        data = np.empty(int(size[0]), dtype=np.uint8)
    wait(locked(comm.Ibcast, [data, MPI.BYTE], root), comm, what, limit_s, data)
    return pickle.loads(data.tobytes())


def barrier(comm, what: str, limit_s: float) -> None:
    """``comm.Barrier()`` bounded."""
    wait(locked(comm.Ibarrier), comm, what, limit_s)


def dup(comm, what: str, limit_s: float):
    """A duplicate of ``comm`` (owned by the caller): ``comm.Dup()`` bounded."""
    new, req = locked(comm.Idup)
    wait(req, comm, what, limit_s, new)  # MPI writes the handle as the request completes
    return new
