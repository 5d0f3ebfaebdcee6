"""How every polling wait in ringcomm paces itself: busy for a while (a peer on
another core answers within microseconds), then yielding the core (co-located
ranks run when cores are oversubscribed), then napping with exponential backoff.

Bottom layer: imports nothing of ringcomm.
"""
from __future__ import annotations

import os
import time

_yield = os.sched_yield
_monotonic = time.monotonic


class Backoff:
    """The pause between two polls of one wait.

    Args:
        busy_s: poll again at once for this long after the start.
        spin_s: until this long after the start, yield the core between polls.
        max_nap_s: after that, sleep between polls, doubling from ``first_nap_s``
            up to this.
        start: when the wait began (``time.monotonic()``; now when None).
    """

    __slots__ = ("busy_until", "spin_until", "nap", "max_nap")

    def __init__(self, busy_s: float = 0.0, spin_s: float = 0.0, max_nap_s: float = 1e-3,
                 first_nap_s: float = 20e-6, start: float | None = None):
        start = _monotonic() if start is None else start
        self.busy_until = start + busy_s
        self.spin_until = start + max(busy_s, spin_s)
        self.nap = min(first_nap_s, max_nap_s)
        self.max_nap = max_nap_s

    def pause(self, now: float | None = None) -> None:
        """Wait before the next poll, as long as this point of the wait calls for."""
        now = _monotonic() if now is None else now
        if now < self.busy_until:
            return
        if now < self.spin_until:
            _yield()
            return
        time.sleep(self.nap)
        self.nap = min(self.nap * 2, self.max_nap)
