"""Waiting on MPI requests so that every wait honours a deadline and an abort
(``MPI_Wait`` cannot time out), and keeping the buffers of requests given up on
alive until MPI is done with them (:data:`limbo`)."""
from __future__ import annotations

import time

from mpi4py import MPI

from ringcomm import mpi_serial
from ringcomm.backoff import Backoff
from ringcomm.transport.base import Handle

_monotonic = time.monotonic
# one thread in MPI at a time, process-wide (why: ringcomm.mpi_serial)
_mpi_lock = mpi_serial.LOCK

#: spin this long before yielding the core: a peer on another core answers within it
_BUSY_S = 100e-6
#: tests per hold of the MPI lock while spinning (the lock costs as much as a test)
_BATCH = 32
#: a wait this long looks for a message of another call from the peers it waits on
#: (then again at this interval): a collective that has to wait this long is no short
#: one, and a mismatched call fails now instead of at its deadline
PROBE_S = 0.05


def poll(test, deadline: float, spin_s: float, max_sleep_s: float, stop=None) -> bool:
    """Call ``test()`` until it returns True (then True), or ``deadline`` passes or
    ``stop()`` returns True (then False)."""
    if test():
        return True
    pace = Backoff(_BUSY_S, spin_s, max_sleep_s)
    while not test():
        now = _monotonic()
        if now >= deadline or (stop is not None and stop()):
            return False
        pace.pause(now)
    return True


def complete(reqs: list, statuses: list, deadline: float, spin_s: float,
             max_sleep_s: float, idle=None, stop=None, done: int = 0, probe=None) -> bool:
    """Drive MPI requests to completion, in order, until ``deadline`` or until
    ``stop()`` returns True (then False). ``probe(i)``, if given, runs once the wait
    has lasted :data:`PROBE_S`, then at that interval, with the first request not
    yet complete (it may raise).

    One request is tested at a time, several tests per hold of the lock: a 512 KiB
    shared-memory exchange measured 69 us this way, 93 us with ``Testall`` on both
    requests and 117 us with the lock taken for every test (``MPI_Waitall``: 63 us,
    but it cannot time out). ``statuses[i]`` (None for sends) receives request i's.
    ``idle()``, if given, runs between batches of tests. The first ``done`` requests
    are known complete.
    """
    n, i = len(reqs), done
    if i == n:
        return True
    pace = None
    # the request waited on is tested with its bound method and status: every poll
    # lets MPI's progress copy the next cell of a large message, so the time between
    # polls adds up (a 256 KiB exchange took 2 us longer with a test that indexed)
    test, st = reqs[i].Test, statuses[i]
    while True:
        with _mpi_lock:
            for _ in range(_BATCH):
                if test(st):
                    i += 1
                    while i < n and reqs[i].Test(statuses[i]):
                        i += 1
                    if i == n:
                        return True
                    test, st = reqs[i].Test, statuses[i]
        if idle is not None:
            idle()
        now = _monotonic()
        if now >= deadline or (stop is not None and stop()):
            return False
        if pace is None:  # made only once the first tests found work left
            pace = Backoff(_BUSY_S, spin_s, max_sleep_s, start=now)
            look = now + PROBE_S
        elif probe is not None and now >= look:
            probe(i)
            look = now + PROBE_S
        pace.pause(now)


def tested(reqs: list, statuses: list) -> int:
    """Test the requests once, in order, until one is not done; how many are (call
    holding the lock)."""
    i = 0
    for q, st in zip(reqs, statuses):
        if not q.Test(st):
            return i
        i += 1
    return i


#: requests of failed collectives and cancelled receives, with their buffers, from
#: every transport: MPI may still write into those buffers, so they stay referenced
#: until a test says the request is done (cancelled receives soon, sends to a peer
#: that never receives them not before MPI is finalized)
limbo: list[Handle] = []


def prune_limbo() -> None:
    """Drop the requests of ``limbo`` that MPI has finished with."""
    keep = []
    with _mpi_lock:
        for h in limbo:
            try:
                done = not isinstance(h.req, MPI.Request) or h.req.Test()
            except MPI.Exception:
                done = True  # an error completes the request too
            if not done:
                keep.append(h)
        limbo[:] = keep
