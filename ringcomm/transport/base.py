"""What the process group needs from the layer below, for one device.

:class:`Link`: rank, size, device, scratch buffers and the communication library's own
collectives. Two kinds, both driven by :mod:`ringcomm.execution.executors` and driving
nothing themselves:

* :class:`Transport` (MPI for CPU tensors, threads in tests): persistent
  point-to-point requests that a caller starts and waits on. It moves contiguous tensors
  between the ranks of one group and knows nothing of collectives. One
  collective runs on a transport at a time (the engine guarantees it);
  :meth:`Transport.begin` sets the deadline every wait of that collective honours.
* :class:`ringcomm.transport.nccl.NcclLink` (CUDA tensors): NCCL groups
  enqueued on a stream, never waited on by the transport itself.
"""
from __future__ import annotations

import abc
import time
from typing import Any, Sequence

import torch

_monotonic = time.monotonic
_INF = float("inf")

#: how long a sign that a peer runs another call must stay, the same, while the
#: receive it concerns stays incomplete, before it counts as a mismatch: at first
#: sight it may be a message that arrived just after the awaited one matched, or
#: the peer's next call overtaking on a faster path, gone at the wait's next test
MISMATCH_S = 1.0


class Signs:
    """The signs of a mismatched call one wait has seen, one per receive it waits on
    (each receive of an all-to-all may see its own), each with when it was first
    seen. Cleared when a wait begins; a receive whose sign is gone at a look, or
    changed, starts again."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[Any, tuple] = {}

    def clear(self) -> None:
        self._seen.clear()

    def gone(self, key: Any) -> None:
        """No sign for ``key`` at this look."""
        self._seen.pop(key, None)

    def lasted(self, key: Any, sign: Any, now: float) -> bool:
        """Record ``sign`` for ``key``, seen at ``now``; True once the same sign has
        been seen at every look for :data:`MISMATCH_S` (then forgotten)."""
        seen = self._seen.get(key)
        if seen is None or seen[0] != sign:
            self._seen[key] = (sign, now)
            return False
        if now - seen[1] < MISMATCH_S:
            return False
        del self._seen[key]
        return True


class TransportTimeout(TimeoutError):
    """A wait passed the deadline of the running collective."""


class TransportAborted(RuntimeError):
    """The process group was shut down or aborted while a wait was in progress."""


class TransportMismatch(RuntimeError):
    """While a receive from ``peer`` waited for a message tagged ``expected``, a
    message from ``peer`` tagged ``found`` arrived that nothing here will receive:
    the peer runs another call (messages between two ranks arrive in the order they
    were sent, so the awaited one would have come first). A transport that reads the
    peer's whole call signature (a shared-memory window) gives ``signature`` instead
    of the two tags."""

    def __init__(self, peer: int, expected: int | None, found: int | None,
                 signature: int | None = None):
        super().__init__(f"rank {peer} runs the call of signature {signature}" if found is None
                         else f"rank {peer} sent a message tagged {found} where one tagged "
                         f"{expected} was awaited")
        self.peer, self.expected, self.found = peer, expected, found
        self.signature = signature


class NotOwnCollective(ValueError):
    """A link has no collective of its own by the name asked for (the caller may say
    which transport has it)."""


class TransportPeerFailed(RuntimeError):
    """A peer of the group found that the ranks run different calls (it said so
    where the group's ranks meet, the store) while this rank waited."""


class TransportPeerLost(TransportPeerFailed):
    """A peer's process or connection was seen to end while this rank waited for it,
    and nothing said why: found here, so the group's front reports it to the other
    ranks (a rank that waits for this one then names the rank that left, not this
    one)."""


class Handle:
    """One message of a prepared schedule (a persistent request), or a user's send or
    receive. ``buf`` keeps its memory alive where the handle owns that duty (user
    messages, scratch); ``nbytes`` is what a receive must get."""

    __slots__ = ("req", "buf", "peer", "kind", "status", "tag", "nbytes")

    def __init__(self, req: Any, buf: torch.Tensor | None, peer: int, kind: str,
                 status: Any = None, tag: int = 0, nbytes: int = -1):
        self.req = req
        self.buf = buf
        self.peer = peer  # -1: any source
        self.kind = kind
        self.status = status
        self.tag = tag
        self.nbytes = buf.nbytes if nbytes < 0 and buf is not None else nbytes


def packed(chunks: Sequence[torch.Tensor]) -> tuple[int, list[int], list[int]] | None:
    """(base address, byte counts, byte displacements) when 1-D ``chunks`` lie back
    to back in memory, else None."""
    counts = [c.numel() * c.element_size() for c in chunks]
    base = next((c.data_ptr() for c in chunks if c.numel()), 0)
    displs, off = [], 0
    for c, n in zip(chunks, counts):
        if n and c.data_ptr() != base + off:
            return None
        displs.append(off)
        off += n
    return base, counts, displs


class Link(abc.ABC):
    """One group's link between ``size`` ranks on one device; this process is ``rank``.

    A link is driven: the executors of :mod:`ringcomm.execution.executors` call it, and it
    calls nothing above it.
    """

    rank: int
    size: int
    device: torch.device

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank = rank
        self.size = size
        self.device = device
        self._scratch: dict[int, torch.Tensor] = {}

    # -- the communication library's own collectives (algorithm "native") ----------
    def check_native(self, collective: str, dtype: torch.dtype, op: Any) -> None:
        """Raise ValueError unless :meth:`native_init` can run ``collective`` on ``dtype``
        with ``op`` (called before anything is enqueued)."""
        raise ValueError(f"ringcomm {collective}: algorithm 'native' needs a transport with "
                         f"collectives of its own; {type(self).__name__} has none")

    def check_own(self, name: str, collective: str, dtype: torch.dtype, op: Any) -> None:
        """Raise ValueError unless this link runs algorithm ``name`` (a
        :class:`ringcomm.algorithms.TransportCollective`) for ``collective`` on
        ``dtype`` with ``op``. ``native`` is :meth:`check_native`. A link with
        collectives of its own under other names (the shared-memory transport's
        ``shm_direct``) overrides this and calls it for the names it does not know.

        Every link takes any transport collective of :data:`ALONE` on a group of one
        rank: it is a local copy (:meth:`own_init`), whatever the transport.
        """
        if name == "native":
            self.check_native(collective, dtype, op)
            return
        if self.size == 1 and collective in ALONE:
            return
        raise NotOwnCollective(f"ringcomm {collective}: this group's {type(self).__name__} "
                               f"has no collective {name!r} of its own")

    def own_init(self, name: str, collective: str, layout: tuple, dtype: torch.dtype, op: Any,
                 signature: tuple[int, str], epoch: int, names: Any, root: int = 0) -> Any:
        """The program (``run(bufs)``, ``close()``) of a collective of this link's own
        other than ``native`` (:meth:`check_own` accepted it), for one call shape;
        ``signature``, ``epoch`` and ``names`` as a schedule's program gets them."""
        if self.size == 1 and collective in ALONE:
            return _Alone(collective)
        raise NotImplementedError(f"{type(self).__name__} has no collective {name!r}")

    def native_init(self, collective: str, layout: tuple, dtype: torch.dtype, op: Any,
                    root: int) -> Any:
        """The communication library's own ``collective`` (MPI's, NCCL's) for one
        call shape: an object whose ``start(bufs)`` issues it on the caller's buffers (ordered and sized as for a
        schedule, ``ringcomm.schedule.BUFFERS``), ``finish(bufs)`` waits for it (on a
        transport that waits) and copies results out of any staging buffer, and
        ``handles()`` names what a failure must abandon."""
        raise NotImplementedError(f"{type(self).__name__} has no collectives of its own")

    def free(self, handles: Sequence[Handle]) -> None:
        """Release inactive persistent requests (from :meth:`native_init` too)."""

    def abandon(self, handles: Sequence[Handle], keep: Any = None) -> None:
        """A collective failed with ``handles`` possibly active: cancel what can be
        cancelled and keep ``keep`` (the caller's buffers) and the handles' buffers
        alive until the library is done with them, so a late message cannot land in
        freed memory. The handles are unusable afterwards."""

    # -- local work ----------------------------------------------------------
    def scratch(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A work buffer of ``numel`` elements, distinct per ``slot``, shared by the
        collectives of this link (they run one at a time).

        A prepared call holds the view it got, so its persistent requests stay valid
        when a larger call regrows the slot; slots grow to powers of two, so the
        buffers left to older calls add up to less than the newest. Contents are
        undefined.
        """
        nbytes = numel * dtype.itemsize
        buf = self._scratch.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(1 << max(nbytes - 1, 0).bit_length(), dtype=torch.uint8,
                              device=self.device)
            self._scratch[slot] = buf
        return buf[:nbytes].view(dtype)

    def close(self) -> None:
        """Release communicators. The link is unusable afterwards."""


class Transport(Link):
    """Point-to-point messaging among ``size`` ranks; this process is ``rank``.

    A schedule's messages are persistent requests (:meth:`send_init`,
    :meth:`recv_init`) made once per prepared call and buffer addresses, gathered
    into batches (:meth:`batch`) that are started (:meth:`start`) and waited for
    (:meth:`wait`) as the executor's precomputed step lists say. One collective
    runs on a transport at a time (the engine guarantees it); :meth:`begin` sets
    the deadline every wait of that collective honours.
    """

    #: what :meth:`wait` raises when a peer runs another call (it may never)
    Mismatch: type = TransportMismatch
    #: what a wait raises when a peer failed or reported a failure
    PeerFailed: type = TransportPeerFailed
    #: tags lie in [0, tag_limit)
    tag_limit: int = 1 << 30
    #: the low bits of a schedule's tags that number its messages to or from one peer
    #: (set by the executor that numbers them; a transport with two paths to a peer
    #: tells by them that a message came the other way); None: not known
    number_bits: int | None = None
    #: ``peer_failure(peers, gone=False) -> text | None``: what a rank of the group
    #: reported, or how one of ``peers`` (the ranks the wait needs) left the job, if any
    #: (the group's front sets it); a long wait looks at it (``gone``: their process
    #: was seen to end)
    peer_failure = None

    def __init__(self, rank: int, size: int, device: torch.device):
        super().__init__(rank, size, device)
        self._deadline = float("inf")
        self._stop: str | None = None

    def interrupt(self, reason: str) -> None:
        """End every wait, running or later, with :class:`TransportAborted` (``reason``)
        within milliseconds; the transport is unusable afterwards."""
        self._stop = reason

    def stopped(self) -> bool:
        return self._stop is not None

    # -- per-collective state ------------------------------------------------
    def begin(self, timeout_s: float) -> None:
        """Start a collective; every wait in it ends by ``timeout_s`` from now."""
        self._deadline = _monotonic() + timeout_s if timeout_s > 0 else _INF

    def end(self) -> None:
        """The collective finished (or failed and was abandoned)."""
        self._deadline = _INF

    # -- persistent messages -------------------------------------------------------
    @abc.abstractmethod
    def send_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        """A persistent send of contiguous ``buf`` to ``peer`` with ``tag``: nothing moves
        until it is started. Messages between a pair with the same tag match in the
        order they were started."""

    @abc.abstractmethod
    def recv_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        """A persistent receive into contiguous ``buf`` from ``peer`` with ``tag``."""

    def carrier(self, messages: Sequence[tuple[int, int]]) -> "Transport":
        """The transport to bind a program's messages ``(peer, nbytes)`` to, for its
        begin and end to stay this one's: this one, or one it wraps that carries all
        of them (see ``ShmTransport``)."""
        return self

    def batch(self, handles: Sequence[Handle]) -> Any:
        """``handles`` as one unit to :meth:`start` or :meth:`wait`, prepared once."""
        return tuple(handles)

    @abc.abstractmethod
    def start(self, batch: Any) -> None:
        """Start every request of ``batch``, in order."""

    @abc.abstractmethod
    def wait(self, batch: Any) -> None:
        """Block until every request of ``batch`` completed; a receive must have got
        exactly its buffer's size.

        Raises:
            TransportTimeout: the collective's deadline passed first.
            TransportAborted: :meth:`interrupt` was called.
            RuntimeError: a receive got another size than its buffer's.
        """

    def abandon(self, handles: Sequence[Handle], keep: Any = None) -> None:
        self.end()

    # -- optional: receives left where the sender put them ------------------------------
    #: whether :meth:`recv_held_init` can hold a receive (the executor asks for held
    #: receives only then: finding them costs a pass over the plan)
    holds_receives: bool = False

    def recv_held_init(self, buf: torch.Tensor, peer: int, tag: int) -> Handle | None:
        """A receive whose data the one local step that reads it may read where the
        sender put it (shared memory), instead of a copy into ``buf``; None where this
        message cannot be held (it is then an ordinary :meth:`recv_init`). A held
        handle's data is read through the executor's ``held_of`` view."""
        return None

    # -- optional: what a transport that wraps this one may use ------------------------
    # A wrapper (``ShmTransport`` wraps the MPI transport: messages to ranks on other
    # hosts go through it) waits on its own path and on this one's at once. A transport
    # that can be wrapped keeps these; the defaults suit one that needs no progress
    # outside its own waits.

    #: ``idle_hook()``: run between polls of every wait of this transport (the wrapper
    #: moves its own messages there); set by the wrapper
    idle_hook: Any = None
    #: ``probe_hook(handle)``: run in a long wait for ``handle``, and may raise (the
    #: wrapper looks at the peer and at its own path); set by the wrapper
    probe_hook: Any = None

    def poke(self) -> None:
        """Let pending transfers progress once, without blocking (MPI moves a large
        message only inside MPI calls, so a wrapper waiting elsewhere pokes)."""

    def user_pending(self) -> bool:
        """Whether a user's send or receive may still need :meth:`poke`."""
        return False

    def first_tag_from(self, peer: int) -> int | None:
        """The tag of the first message from ``peer`` not yet received, if this
        transport can tell (a wrapper waiting for a message on its own path learns
        that the peer sent it this way, or runs another call); None: none, or unknown."""
        return None

    # -- user point-to-point (dist.send / dist.recv) ----------------------------
    # A communicator of its own, apart from collectives, so user tags never mix with
    # collective traffic, and not bound to the running collective's deadline.
    def p2p_isend(self, buf: torch.Tensor, peer: int, tag: int) -> Handle:
        """Start a user send (``dist.isend``)."""
        raise NotImplementedError(f"{type(self).__name__} has no user messages")

    def p2p_irecv(self, buf: torch.Tensor, peer: int | None, tag: int) -> Handle:
        """Start a user receive; ``peer=None`` receives from any rank."""
        raise NotImplementedError(f"{type(self).__name__} has no user messages")

    def p2p_wait(self, handle: Handle, deadline: float) -> bool:
        """Wait for a user send/receive until ``deadline`` (time.monotonic);
        False if it is still pending then."""
        raise NotImplementedError(f"{type(self).__name__} has no user messages")

    def p2p_done(self, handle: Handle) -> bool:
        """True once the user send/receive completed (does not block)."""
        raise NotImplementedError(f"{type(self).__name__} has no user messages")

    def p2p_cancel(self, handle: Handle) -> None:
        """Give up on a pending user receive (its buffer stays referenced)."""

    def p2p_source(self, handle: Handle) -> int:
        """The sender of a completed receive."""
        return handle.peer

    def timeout_message(self, pending: Sequence[Handle]) -> str:
        peers = sorted({f"{h.kind} {'to' if h.kind == 'send' else 'from'} rank {h.peer}"
                        for h in pending})
        return f"waiting for {', '.join(peers) or 'peers'}"


#: the collectives a transport's own collective on a group of one rank runs as a copy
ALONE = ("allreduce", "broadcast", "allgather", "reduce_scatter", "barrier")


class _Alone:
    """The program of a transport's own collective on a group of one rank: allreduce and
    broadcast leave the tensor as it is, a barrier has no one to wait for; allgather
    and reduce_scatter copy the one chunk from input to output (unless they are the
    same memory)."""

    def __init__(self, collective: str):
        self.collective = collective

    def run(self, bufs: Sequence[torch.Tensor]) -> None:
        if self.collective == "allgather":
            src, dst = bufs[1], bufs[0]
        elif self.collective == "reduce_scatter":
            src, dst = bufs[0], bufs[1]
        else:
            return
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src)

    def close(self) -> None:
        pass
