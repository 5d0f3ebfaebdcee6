"""Every rank of a group learns of a failure elsewhere in it, in a collective or not.

A rank whose collective fails (a timeout, a mismatch) or that leaves with a non-zero
code reports it in the group's store (:meth:`ringcomm.front.lanes.Lanes.mark_broken`).
Ranks waiting on it read the report at their wait's next look. A rank that is not
waiting (late, in its data loader, in its optimizer step) would not: it could run the
same collective later and complete it with the messages its peers sent before they
failed, so the ranks would disagree on the outcome. One thread per process reads each
live group's news counter every ``RINGCOMM_WATCH_S`` seconds (one store read per
group when nothing happened) and, on a report, breaks the group there too: its next
collective fails at once, naming the failure, as every other rank's did (NCCL's abort
does the same to a late rank). A rank that enters the collective within that period
of the report, and finds its peers' messages already there, may still complete it.

Breaking the group there also writes the flight recorder's dump when asked to
(:mod:`ringcomm.trace.flight`, ``TORCH_NCCL_DUMP_ON_TIMEOUT``): a rank stuck outside
the collectives leaves its record of what it did last, as torch's ranks do.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable

from ringcomm import settings

__all__ = ["watch", "on_failure"]

log = logging.getLogger("ringcomm")

_lock = threading.Lock()
_groups: "weakref.WeakSet[Any]" = weakref.WeakSet()
_thread: threading.Thread | None = None
#: called as ``fn(group, text)`` when a group learns of a failure elsewhere
_hooks: list[Callable[[Any, str], None]] = []


def on_failure(fn: Callable[[Any, str], None]) -> None:
    """Call ``fn(group, text)`` whenever a watched group learns of another rank's
    failure."""
    _hooks.append(fn)


def watch(group: Any) -> None:
    """Read ``group.lanes``' news every ``RINGCOMM_WATCH_S`` while the group lives."""
    global _thread
    period = settings.get("RINGCOMM_WATCH_S")
    if not period:
        return
    with _lock:
        _groups.add(group)
        if _thread is None:
            _thread = threading.Thread(target=_loop, args=(period,), daemon=True,
                                       name="ringcomm-watch")
            _thread.start()


def _loop(period: float) -> None:
    stop = threading.Event()  # never set: a daemon thread that ends with the process
    while not stop.wait(period):
        _look()  # holds the groups only while it looks: a released group goes


def _look() -> None:
    with _lock:
        groups = list(_groups)
    for g in groups:
        try:
            text = g.lanes.look_for_news()
        except Exception as e:  # noqa: BLE001 - one group's trouble must not end the watch
            log.info("ringcomm %s: looking for news failed: %s", g._describe(), e)
            continue
        if text is None:
            continue
        log.info("ringcomm %s: a failure elsewhere in the group: %s", g._describe(), text)
        for fn in list(_hooks):
            try:
                fn(g, text)
            except Exception as e:  # noqa: BLE001 - a hook must not end the watch
                log.warning("ringcomm: a failure hook raised: %s", e)
