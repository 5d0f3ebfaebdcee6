"""What the checker refuses, as data: a :class:`Finding` (kind, rank, step, peer,
element) that a refusal carries beside its message (:func:`finding_of`), for a
caller that relates the facts to something else without reading the words."""
from __future__ import annotations

import dataclasses

from ringcomm.schedule import ScheduleError

#: the kinds of :class:`Finding`
KINDS = frozenset({"builder", "structure", "peer", "size mismatch", "unmatched", "deadlock",
                   "reduce", "wrong result", "barrier", "model"})


@dataclasses.dataclass(frozen=True)
class Finding:
    """What the checker refused, as data: the facts its message gives in words, for
    a caller that relates them to something else (``ringcomm.msccl`` names the XML
    steps that a rank's step carries) without reading the words. A refusal carries
    it (:func:`finding_of`).

    Attributes:
        kind: what is wrong, one of :data:`KINDS`: ``builder`` (it returned no
            Schedule), ``structure``
            (:func:`~ringcomm.execution.structure.validate` refuses a region, a buffer
            or a local op), ``peer`` (a message to no other rank), ``size mismatch``,
            ``unmatched`` (a message without a partner), ``deadlock`` (steps that wait
            on each other in a cycle), ``reduce`` (a reduction of undefined or different
            data, or counting a rank twice), ``wrong result``, ``barrier`` (a rank leaves
            it early), ``model`` (no symbolic model of the collective).
        rank: the rank at fault (None: no one rank).
        step: the index of its step at fault (None: no one step).
        peer: the other rank of the message at fault.
        peer_step: the index of the peer's step that holds the message's match.
        buffer, element: where ``rank``'s wrong data lies: the element that ends wrong
            (``wrong result``), the destination element reduced (``reduce``).
        more: the report's further entries, of the same kind: the other messages
            without a partner; the rest of a deadlock's cycle (each entry waits for
            the next one's rank, the last for the first's).
    """
    kind: str
    rank: int | None = None
    step: int | None = None
    peer: int | None = None
    peer_step: int | None = None
    buffer: int | None = None
    element: int | None = None
    more: tuple[Finding, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"checker: a finding of unknown kind {self.kind!r}")

    def steps_named(self) -> list[tuple[int, int]]:
        """Every (rank, step index) the finding names, in order: each entry's own
        step, then the peer's step that holds its match."""
        out = []
        for f in (self, *self.more):
            if f.rank is not None and f.step is not None:
                out.append((f.rank, f.step))
            if f.peer is not None and f.peer_step is not None:
                out.append((f.peer, f.peer_step))
        return out

    def element_words(self) -> str:
        """The words that name :attr:`element` in the message (``rank 0 buffer 1
        element 2``)."""
        return f"rank {self.rank} buffer {self.buffer} element {self.element}"


def finding_of(err: BaseException) -> Finding | None:
    """The :class:`Finding` that a refusal of the checker carries; None for any other
    error (a builder's own :class:`~ringcomm.schedule.ShapeNotServed`, say)."""
    return getattr(err, "finding", None)


def refusal(message: str, finding: Finding | None) -> ScheduleError:
    err = ScheduleError(message)
    err.finding = finding
    return err


def short_layout(layout) -> str:
    """A call's layout in a refusal's words, cut to 60 characters."""
    text = str(layout)
    return text if len(text) <= 60 else text[:57] + "..."
