"""How a shared-memory wait spends its time and learns that a peer is gone: it
spins, then yields, then naps (:class:`Idle`), lets MPI progress while MPI has work,
honours the collective's deadline and an abort, and looks at the peers it waits on
every :data:`PROBE_S` (:func:`alive`: is a peer's process still running)."""
from __future__ import annotations

import os
import time
from typing import Any

from ringcomm.backoff import Backoff
from ringcomm.transport.base import TransportAborted, TransportTimeout

_monotonic = time.monotonic

#: spin this long before yielding the core
BUSY_S = 100e-6
#: a wait this long starts looking at the peers it waits on (then at this interval)
PROBE_S = 0.05
#: a shared-memory wait lets MPI progress this often
POKE_S = 20e-6


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except OSError:
        return True


class Idle:
    """What a wait of ``tp`` does each time it finds nothing new: let MPI progress (at
    most every POKE_S, while MPI has work), honour an abort and the collective's
    deadline (``timeout_text()`` says what was awaited), then pace itself (busy, then
    yielding, then naps: :class:`ringcomm.backoff.Backoff`), calling ``look_at(now)``
    every PROBE_S once it has waited that long."""

    __slots__ = ("tp", "timeout_text", "look_at", "pace", "look")

    def __init__(self, tp: Any, timeout_text, look_at):
        self.tp, self.timeout_text, self.look_at = tp, timeout_text, look_at
        self.pace: Backoff | None = None
        self.look = 0.0

    def turn(self) -> None:
        tp, now = self.tp, _monotonic()
        if now >= tp._next_poke and (tp._mpi_out or tp._user_pending()):
            tp._poke()
            tp._next_poke = now + POKE_S
        if tp._stop is not None:
            raise TransportAborted(tp._stop)
        if now >= tp._deadline:
            raise TransportTimeout(self.timeout_text())
        if self.pace is None:
            self.pace = Backoff(BUSY_S, tp.spin_s, tp.max_sleep_s, start=now)
            self.look = now + PROBE_S
        elif now >= self.look:
            self.look_at(now)
            self.look = now + PROBE_S
        self.pace.pause(now)
