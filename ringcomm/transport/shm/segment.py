"""A rank's shared-memory segment: where things lie in it (:class:`Geometry`),
shm_direct's windows over every rank's segment (:class:`Window`), making and
mapping it (its space allocated when it is made, the file unlinked once every rank
has mapped it), the failure text its header carries to the peers, and the memory
fence every publication and consumption uses."""
from __future__ import annotations

import mmap
import os
import socket
from typing import Any

import numpy as np

from ringcomm import mpi_serial

#: a counter's own stretch of memory: two cache lines, so the adjacent-line prefetcher
#: never makes two writers share one
LINE = 128
#: the header: ints (magic, pid, failure length) then the failure text
_HEADER = 512
_TEXT_AT, _TEXT_MAX = 128, _HEADER - 128
MAGIC = 0x52494E47434F4D4D  # "RINGCOMM"
#: slots start page-aligned (copies of whole slots run at full speed)
_PAGE = 4096

def _round(n: int, to: int) -> int:
    return -(-n // to) * to


class Geometry:
    """Where things lie in a segment of a rank with ``npeers`` peers on its host.

    Layout: the header; ``npeers`` tail counters (one per peer, in the order of the
    owner's peer list); ``npeers`` outboxes, each a head counter, ``slots`` (tag,
    size) pairs and ``slots`` data slots of ``slot_bytes``; where ``direct_bytes``,
    the window of :mod:`ringcomm.transport.shm.direct`: a page of two lines (one per
    buffer: round, signature, epoch) and two buffers of ``direct_bytes``.
    """

    __slots__ = ("npeers", "slots", "slot_bytes", "meta_bytes", "outbox_bytes",
                 "direct_bytes", "nbytes")

    def __init__(self, npeers: int, slots: int, slot_bytes: int, direct_bytes: int = 0):
        self.npeers, self.slots = npeers, slots
        self.slot_bytes = _round(slot_bytes, _PAGE)
        self.meta_bytes = _round(16 * slots, LINE)
        self.outbox_bytes = _round(LINE + self.meta_bytes, _PAGE) + slots * self.slot_bytes
        self.direct_bytes = _round(direct_bytes, _PAGE)
        self.nbytes = self.window_at() + (_PAGE + 2 * self.direct_bytes
                                          if self.direct_bytes else 0)

    def tail_at(self, j: int) -> int:
        return _HEADER + j * LINE

    def outbox_at(self, j: int) -> int:
        return _round(_HEADER + self.npeers * LINE, _PAGE) + j * self.outbox_bytes

    def slot_at(self, j: int, s: int) -> int:
        return self.outbox_at(j) + _round(LINE + self.meta_bytes, _PAGE) + s * self.slot_bytes

    def window_at(self) -> int:
        """The window's page of lines; its buffers follow it."""
        return self.outbox_at(self.npeers)

    def line_at(self, b: int) -> int:
        """The line of window buffer ``b``: round, signature, epoch."""
        return self.window_at() + b * LINE


class Window:
    """The windows of every rank of a group on one host (:mod:`ringcomm.transport.shm.direct`):
    ``nbytes`` per buffer; each rank's two buffers, and its two lines as word indices
    into its segment's words."""

    __slots__ = ("nbytes", "words", "lines", "_buffers")

    def __init__(self, geo: Geometry, maps_in_rank_order: list):
        self.nbytes = geo.direct_bytes
        #: per rank, its segment as 8-byte words
        self.words = [words for _, words in maps_in_rank_order]
        self.lines = (geo.line_at(0) // 8, geo.line_at(1) // 8)
        at = geo.window_at() + _PAGE
        self._buffers = tuple([np.frombuffer(mm, dtype=np.uint8, count=self.nbytes,
                                             offset=at + b * self.nbytes)
                               for mm, _ in maps_in_rank_order] for b in (0, 1))

    def buffers(self, b: int) -> list:
        """Buffer ``b`` of every rank, in rank order (bytes)."""
        return self._buffers[b]


def memory_fence():
    """``MPI_Win_sync`` of a window over this process (a full memory barrier in MPICH)
    and the window (to free)."""
    from mpi4py import MPI

    mem = np.zeros(1, dtype=np.int64)
    with mpi_serial.LOCK:
        win = MPI.Win.Create(mem, comm=MPI.COMM_SELF)
        win.Lock_all()  # Win_sync needs a passive-target epoch
    return win.Sync, (win, mem)


def write_failure(maps: list, text: str, fence) -> None:
    """Write ``text`` (why this rank stopped) into the header of this rank's segment,
    ``maps[0]`` ((mmap, words)): text, fence, length."""
    raw = text.encode(errors="replace")[:_TEXT_MAX]
    mm, words = maps[0]
    mm[_TEXT_AT:_TEXT_AT + len(raw)] = raw
    fence()
    words[2] = len(raw)


def read_failure(mm, words, fence) -> str | None:
    """What the owner of a segment (its mmap and words) wrote there when it stopped,
    if it did: length, fence, text."""
    n = words[2]
    if not n:
        return None
    fence()
    return bytes(mm[_TEXT_AT:_TEXT_AT + min(n, _TEXT_MAX)]).decode(errors="replace")


def make_segment(path: str, nbytes: int, directory: str, peers: int,
                  rank: int) -> tuple[Any, str | None]:
    """Create, allocate and map this rank's segment; (mmap, None) or (None, why not)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return None, f"rank {rank} cannot create {path}: {e.strerror}"
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            unlink(path)
            st = os.statvfs(directory)
            free = st.f_bavail * st.f_frsize
            return None, (f"{directory} has {free / 2**20:.1f} MiB free, and rank {rank}'s "
                          f"segment needs {nbytes / 2**20:.1f} MiB for its {peers} peer(s) on "
                          f"host {socket.gethostname()} ({e.strerror})")
        try:
            return mmap.mmap(fd, nbytes), None
        except OSError as e:
            unlink(path)
            return None, f"rank {rank} cannot map {path}: {e.strerror}"
    finally:
        os.close(fd)


def map_segment(path: str, nbytes: int) -> Any:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
