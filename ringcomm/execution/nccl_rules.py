"""NCCL's point-to-point rules as a progress engine, shared by the checker
(symbolic data) and the simulator (real tensors).

The rules (NCCL's "Point-to-point communication" guide):

* Sends and receives issued between ``ncclGroupStart`` and ``ncclGroupEnd`` form
  one *group*: a kernel that completes only when every operation in it completed.
* A rank's groups (and the local work between them) run in order on its stream.
* A send completes together with its matching receive, and only while both
  ranks' groups holding them are running (no buffering is assumed: small
  messages may complete earlier on real hardware, so this is the strict reading).
* Messages between one pair match in issue order: the k-th send from a to b
  pairs with the k-th receive at b from a, and their sizes must agree.

The engine advances in synchronous rounds: in a round every pair of matching
operations at the heads of two ranks' streams completes; then finished groups
retire and local work runs. When nothing can move while work remains, it
reports the cycle of waiting ranks (a deadlock) or the message that has no
partner, never hangs.
"""
from __future__ import annotations

import collections
from typing import Any, Callable

from ringcomm.schedule import ScheduleError


def message_words(kind: str, n: int, unit: str, peer: int) -> str:
    """``send of 4 elements to rank 1`` / ``receive of 4 elements from rank 0``."""
    if kind == "send":
        return f"send of {n} {unit} to rank {peer}"
    return f"receive of {n} {unit} from rank {peer}"


def mismatch_words(rank: int, label: str, n: int, unit: str, peer: int, peer_label: str,
                   peer_n: int) -> str:
    """A send and its matching receive disagree on the size."""
    return (f"size mismatch: rank {rank} {label} sends {n} {unit} to rank {peer}, whose "
            f"matching receive ({peer_label}) takes {peer_n}")


def unmatched_words(orphans: list[tuple[int, str, str, int, int]], unit: str) -> str:
    """Messages without a partner: ``(rank, label, kind, n, peer)`` each (the first 4
    are named)."""
    return "unmatched message: " + "; ".join(
        f"rank {rank} {label}: {message_words(kind, n, unit, peer)} has no matching "
        f"{'receive' if kind == 'send' else 'send'} on rank {peer}"
        for rank, label, kind, n, peer in orphans[:4])


def deadlock_words(cycle: list[tuple[int, str, str, int, int, str]], unit: str) -> str:
    """A cycle of waits: ``(rank, label, kind, n, peer, label of the match's group)``
    each, every entry waiting for the next one's rank."""
    return "deadlock under NCCL's group rules: " + "; ".join(
        f"rank {rank} {label} ({message_words(kind, n, unit, peer)}) waits for rank {peer}, "
        f"whose match is in its {where}" for rank, label, kind, n, peer, where in cycle)


def wait_cycle(waits: dict[int, Any], peer_of: Callable[[Any], int]) -> list:
    """The cycle among ``waits`` (rank -> what it waits on, ``peer_of`` naming the rank
    that holds the match), followed from the lowest waiting rank: its entries in
    order, each waiting for the next one's rank; the path followed where it leaves
    the waiting ranks instead."""
    seen: list[int] = []
    r = next(iter(waits), None)
    while r is not None and r in waits and r not in seen:
        seen.append(r)
        r = peer_of(waits[r])
    return [waits[x] for x in (seen[seen.index(r):] if r in seen else seen)]


class _Op:
    __slots__ = ("kind", "rank", "peer", "seq", "n", "payload", "done", "group")

    def __init__(self, kind, rank, peer, seq, n, payload, group):
        self.kind, self.rank, self.peer, self.seq = kind, rank, peer, seq
        self.n, self.payload, self.done, self.group = n, payload, False, group


class _Group:
    __slots__ = ("rank", "label", "ops", "recvs", "pending")

    def __init__(self, rank: int, label: str):
        self.rank, self.label = rank, label
        self.ops: list[_Op] = []
        self.recvs: dict[tuple, _Op] = {}
        self.pending = 0


class _Local:
    __slots__ = ("fn", "label")

    def __init__(self, fn, label):
        self.fn, self.label = fn, label


class Rules:
    """Streams of ``size`` ranks under NCCL's rules.

    Args:
        size: number of ranks.
        unit: what message sizes count, for messages ("elements", "bytes").
    """

    def __init__(self, size: int, unit: str = "elements"):
        self.size = size
        self.unit = unit
        self.queues: list[collections.deque] = [collections.deque() for _ in range(size)]
        self._seq: dict[tuple, int] = collections.defaultdict(int)
        #: statistics of the run so far (for the cost model)
        self.rounds = 0
        self.busiest_bytes = 0  # sum over rounds of the busiest rank's in- or outflow
        self.sent = [0] * size

    # -- filling streams --------------------------------------------------------
    def add_group(self, rank: int, ops: list[tuple[str, int, int, Any]], label: str) -> None:
        """Append a group to ``rank``'s stream. ``ops`` holds ``(kind, peer, n,
        payload)``: for a send the payload is called with no argument and returns the
        data; for a receive it is called with that data."""
        g = _Group(rank, label)
        for kind, peer, n, payload in ops:
            if not 0 <= peer < self.size or peer == rank:
                raise ScheduleError(f"rank {rank} {label}: {kind} peer {peer} is not another "
                                    f"rank of {self.size}")
            key = (rank, peer) if kind == "send" else (peer, rank)
            seq = self._seq[(kind, *key)]
            self._seq[(kind, *key)] = seq + 1
            op = _Op(kind, rank, peer, seq, n, payload, g)
            g.ops.append(op)
            if kind == "recv":
                g.recvs[(peer, seq)] = op
        g.pending = len(g.ops)
        if g.ops:
            self.queues[rank].append(g)

    def add_local(self, rank: int, fn: Callable[[], None], label: str) -> None:
        """Append local work to ``rank``'s stream (runs when it reaches the head)."""
        self.queues[rank].append(_Local(fn, label))

    # -- progress ---------------------------------------------------------------
    def _run_locals(self) -> bool:
        moved = False
        for q in self.queues:
            while q and isinstance(q[0], _Local):
                q.popleft().fn()
                moved = True
        return moved

    def step_round(self) -> bool:
        """One round; True if anything moved."""
        moved = self._run_locals()
        heads = [q[0] if q else None for q in self.queues]
        out = [0] * self.size
        inn = [0] * self.size
        matched = False
        for g in heads:
            if g is None:
                continue
            for op in g.ops:
                if op.done or op.kind != "send":
                    continue
                peer_head = heads[op.peer]
                if peer_head is None:
                    continue
                rv = peer_head.recvs.get((op.rank, op.seq))
                if rv is None:
                    continue
                if rv.n != op.n:
                    err = ScheduleError(mismatch_words(op.rank, g.label, op.n, self.unit,
                                                       op.peer, peer_head.label, rv.n))
                    err.mismatch = (g.label, op, peer_head.label)  # the send, as data
                    raise err
                rv.payload(op.payload())
                op.done = rv.done = True
                g.pending -= 1
                peer_head.pending -= 1
                out[op.rank] += op.n
                inn[op.peer] += op.n
                self.sent[op.rank] += op.n
                matched = True
        if matched:
            self.rounds += 1
            self.busiest_bytes += max(max(a, b) for a, b in zip(out, inn))
        for q in self.queues:
            if q and isinstance(q[0], _Group) and q[0].pending == 0:
                q.popleft()
                moved = True
        return moved or matched

    def drain(self) -> None:
        """Run until every stream is empty.

        Raises:
            ScheduleError: a deadlock (naming the cycle of ranks and their steps), a
                message without a partner, or a size mismatch.
        """
        while any(self.queues):
            if not self.step_round():
                raise ScheduleError(self.stuck_report())

    # -- diagnosis --------------------------------------------------------------
    def _find_match(self, op: _Op) -> str | None:
        """Where ``op``'s partner sits in the peer's stream, or None if nowhere."""
        want = "recv" if op.kind == "send" else "send"
        key_rank = op.peer
        for item in self.queues[key_rank]:
            if isinstance(item, _Group):
                for o in item.ops:
                    if (o.kind == want and o.peer == op.rank and o.seq == op.seq
                            and not o.done):
                        return item.label
        return None

    def stuck(self) -> tuple[list[tuple[Any, _Op]], list[tuple[Any, _Op, Any]]]:
        """Why nothing can move, as data: ``(orphans, cycle)``. ``orphans``: the
        (group label, message) pairs at the streams' heads that no peer's stream
        matches, in rank order; ``cycle``: when there is none, the ranks' waits round
        the cycle, each (group label, message, the label of its match's group)."""
        waits: dict[int, tuple[Any, _Op, Any]] = {}
        orphans = []
        for r, q in enumerate(self.queues):
            if not q:
                continue
            g = q[0]
            for op in g.ops:
                if op.done:
                    continue
                where = self._find_match(op)
                if where is None:
                    orphans.append((g.label, op))
                elif r not in waits:
                    waits[r] = (g.label, op, where)
        if orphans:
            return orphans, []
        return [], wait_cycle(waits, lambda w: w[1].peer)

    def stuck_report(self) -> str:
        """Why nothing can move (:meth:`stuck`), in words."""
        orphans, cycle = self.stuck()
        if orphans:
            return unmatched_words([(op.rank, label, op.kind, op.n, op.peer)
                                    for label, op in orphans], self.unit)
        return deadlock_words([(op.rank, label, op.kind, op.n, op.peer, where)
                               for label, op, where in cycle], self.unit)
