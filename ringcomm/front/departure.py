"""A rank that leaves tells the ranks that wait on it.

Under mpiexec (and srun with an MPI plugin) a Python process that raises, or calls
``sys.exit``, does not end: mpi4py's exit hook calls ``MPI_Finalize``, which waits
for every other rank to finalize too, so the ranks waiting on it saw nothing until
their group timeout (30 minutes by default). gloo's peers hear "connection closed".

So, as the process leaves (an ``atexit`` hook that runs before MPI finalizes), it
writes into the store of every ringcomm group it belongs to how it left
(:meth:`ringcomm.front.lanes.Lanes.announce_left`): an uncaught exception with its
type, message, file and line; ``sys.exit``'s code; or the end of the script. A peer
whose wait needs that rank reads it at its next look (every 50 ms) and fails
naming the rank, its host and the cause; peers on the same host learn it from the
rank's shared-memory segment at once. A rank that ended its script normally may
have sent its last messages just before: a wait on it fails only if it stays
unfinished for :data:`ringcomm.front.lanes.LEFT_GRACE_S` after the notice, so a
job whose ranks all end normally, in any order, still exits 0.

A rank that leaves with a non-zero code then waits (at most :data:`ABORT_WAIT_S`)
until the peers that waited on it have read the notice, and calls ``MPI_Abort``:
mpiexec ends the whole job with that code instead of leaving the ranks in
``MPI_Finalize``. A rank that ends normally waits at an exit barrier, as
``MPI_Finalize`` would next: rank 0's process holds the store, which must live
until every rank has written how it left.

The abort and the barrier apply under an MPI launcher (mpiexec, srun with an MPI
plugin), where ``MPI_Finalize`` held the process. Under torchrun and plain srun the
process ends as it would, after writing how it left into the store, so its peers get
the cause, not only that it exited; a non-zero code first waits (at most
:data:`ABORT_WAIT_S`) for them to read it: under plain srun the store lives in rank
0's process.

An uncaught exception in another thread does not end the process; if the process
then ends, its notice names that exception too. A ``SystemExit`` raised by hand
(not through ``sys.exit``) keeps its code from Python's hooks: it reads as the
script's end, and the peers that wait on the rank fail after
:data:`ringcomm.front.lanes.LEFT_GRACE_S`, naming it.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

from ringcomm import mpi_serial
from ringcomm.trace import flight
from ringcomm.launch import bootstrap, pmi

__all__ = ["install", "ABORT_WAIT_S"]

#: how long a rank leaving with a non-zero code waits for its peers to read why,
#: before it ends the job (MPI_Abort)
ABORT_WAIT_S = 2.0

_lock = threading.Lock()
_installed = False
#: how this process is leaving, as far as it is known: (exit code, words)
_how: list = [None, None]
#: the first uncaught exception of a thread other than the main one (words)
_thread_failure: list = [None]


def _where(tb: Any) -> str:
    frames = traceback.extract_tb(tb)
    if not frames:
        return ""
    last = frames[-1]
    return f" at {os.path.basename(last.filename)}:{last.lineno}"


def describe_exception(exc_type: type, exc: BaseException, tb: Any) -> str:
    """``raised ValueError: bad batch at train.py:42``."""
    text = str(exc).strip().splitlines()
    return f"raised {exc_type.__name__}{': ' + text[0][:300] if text else ''}{_where(tb)}"


def _exit_code(status: Any) -> int:
    """The exit code ``sys.exit(status)`` gives the process."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF if status >= 0 else 1
    return 1  # a message: printed to stderr, exit code 1


def install(groups: Any) -> None:
    """Watch how this process leaves, and tell ``groups`` (the live ringcomm groups)
    as it does. Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    previous = sys.excepthook

    def excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
        _how[:] = [1, describe_exception(exc_type, exc, tb)]
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    previous_thread_hook = threading.excepthook

    def thread_excepthook(args: Any) -> None:
        # the process goes on; if it then ends, its peers hear of this too
        if args.exc_type is not SystemExit and _thread_failure[0] is None:
            name = getattr(args.thread, "name", "?")
            _thread_failure[0] = (f"{describe_exception(args.exc_type, args.exc_value, args.exc_traceback)}"
                                  f" in thread {name!r}")
        previous_thread_hook(args)

    threading.excepthook = thread_excepthook
    real_exit = sys.exit

    def exit(status: Any = None) -> None:  # noqa: A001 - sys.exit's own name
        code = _exit_code(status)
        _how[:] = [code, f"called sys.exit({status!r})"]
        real_exit(status)

    exit.__doc__ = real_exit.__doc__
    sys.exit = exit
    # after ringcomm's own atexit hook: it runs first (hooks run last in, first out)
    atexit.register(_leave, groups)


def _leave(groups: Any) -> None:
    under_mpi = bootstrap.launched_by_mpi()
    code, how = _how
    if how is None:
        # no exception and no sys.exit: the script's end (or a SystemExit raised by
        # hand, whose code Python keeps to itself)
        code, how = 0, "ended its script"
        if _thread_failure[0] is not None:
            how += f" after an uncaught exception: {_thread_failure[0]}"
    else:
        how = f"{how} (exit code {code})"
    pid, host = os.getpid(), socket.gethostname()
    members = [g for g in list(groups) if g.size() > 1]
    if code and members:
        flight.dump_for_failure(f"this rank {how}")
    for g in members:
        g.lanes.announce_left(f"rank {g.rank()} (pid {pid}) on host {host}", how, code)
    # a failed set-up may have left an MPI call blocking in its thread (MPI cannot
    # cancel it): MPI_Finalize, and the exit barrier, would wait for it forever, so
    # such a process ends without them (under mpiexec that ends the job)
    stuck = bool(bootstrap.stuck_calls())
    # MPI started whole under torchrun (ringcomm.launch.pmi) finalizes in a barrier
    # of every rank: a failing rank's peers may never come to it (torchrun ends
    # them once this process has ended)
    alone = stuck or (code != 0 and pmi.serving())
    if not members or (code == 0 and not under_mpi):
        return _end_without_mpi(code) if alone else None  # torchrun, plain srun: it ends
    if code == 0:
        if stuck:
            _end_without_mpi(code)
        _exit_barrier()
        return
    # wait until the ranks that wait on this one have read why (or at most
    # ABORT_WAIT_S, for those that never look): under plain srun this process may
    # hold the store they read it from
    deadline = time.monotonic() + ABORT_WAIT_S
    while time.monotonic() < deadline and not all(g.lanes.left_seen_by_all() for g in members):
        time.sleep(0.02)
    if alone:
        _end_without_mpi(code)
    if not under_mpi:
        return
    # MPI would hold this process in MPI_Finalize: end the job
    _flush()
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


def _end_without_mpi(code: int) -> None:
    """End the process now, with ``code``, without finalizing MPI."""
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
            pass


def _exit_barrier() -> None:
    """Wait until every rank of the MPI job is leaving too, as ``MPI_Finalize`` would
    next (it waits for them all): the store of the groups lives in rank 0's process,
    so rank 0 keeps it up until every rank has written how it left. A rank that
    waits on this one meanwhile reads that it left and fails, which ends the job."""
    from mpi4py import MPI

    req = mpi_serial.locked(MPI.COMM_WORLD.Ibarrier)
    while not mpi_serial.locked(req.Test):
        time.sleep(0.01)
