"""What the simulator times: every rank's slots (the local work before a group,
then the group's messages, as :class:`ringcomm.execution.world.World` orders them),
each message's peer, size and partner.

Two sources give the same arrays:

* :class:`FullProgram`: every rank's schedule, built and paired by
  :class:`~ringcomm.execution.world.World` (any algorithm; its cost grows with all
  ranks' steps: a ring's 2p(p - 1));
* :class:`RotatedProgram`: rank 0's schedule alone, every other rank's taken as
  its rotation (rank r sends to ``r + d`` where rank 0 sends to ``d``). For the
  algorithms whose ranks all do the same thing (ring, Bruck, direct), so a
  ring of 16,384 ranks costs one rank's 32,766 steps.
  :func:`ringcomm.sim.cell.program_for` takes it only after sampled ranks were
  found to be rotations of rank 0 (structure exact, sizes within
  :data:`SIZE_SLACK`).

Both follow NCCL's order, what runs on GPUs: a slot starts its group's messages
and waits for all of them. :class:`MpiProgram` is every rank's schedule in the
order of ringcomm's executor on MPI, which starts messages earlier.

A program is read by the engines through: ``nslots`` (per rank), ``nsides`` (message
sides: one rank's send or receive of a message), ``slot_work(ranks, slots)``,
``slot_posts`` and ``slot_waits`` (the sides a slot starts and waits for, and whose
each is) and ``sides(ids)``: ``(kind, rank, peer, n, partner side, wait slot)``.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ringcomm.execution.plan import COPY
from ringcomm.execution.world import RECV, SEND, World, expand_ranges

#: sampled ranks may differ from rank 0's rotation by this share of a message's or
#: local operation's size (uneven chunks differ by one element)
SIZE_SLACK = 0.01


class FullProgram:
    """Every rank's slots from a :class:`World` (built, not run)."""


    def __init__(self, world: World):
        self.world = w = world
        self.size = w.size
        self.first = w.first_slot
        self.nslots = np.diff(w.first_slot)
        reg_n = w.regions[:, 3] - w.regions[:, 2]
        nslot = int(w.first_slot[-1])
        l_slot = np.searchsorted(w.s_loc, np.arange(len(w.l_rank)), "right") - 1
        n_loc = reg_n[w.l_dst]
        copy = w.l_kind == COPY
        self.reduce_elems = np.bincount(l_slot[~copy], n_loc[~copy], nslot)
        self.copy_elems = np.bincount(l_slot[copy], n_loc[copy], nslot)
        self._rounds: list | None = None

    def rounds(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """NCCL's rounds of the world, as :meth:`World.run` finds them: per round the
        send and the receive message numbers of the messages it completes. The first
        call runs the world: the structure at the full size (matching, sizes, no
        deadlock), raising its refusal."""
        if self._rounds is None:
            out: list[tuple[np.ndarray, np.ndarray]] = []
            self.world.run(on_messages=lambda b: out.append((b.msg, b.peer_msg)))
            self._rounds = out
        return self._rounds

    def slot_messages(self, ranks: np.ndarray, slots: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
        """The messages of ``ranks``' slots ``slots``: their numbers, and for each the
        position in ``ranks`` it belongs to."""
        g = self.first[ranks] + slots
        a, b = self.world.s_msg[g], self.world.s_msg[g + 1]
        return expand_ranges(a, b), np.repeat(np.arange(len(ranks)), b - a)

    def slot_work(self, ranks: np.ndarray, slots: np.ndarray):
        """``(messages, reduced elements, copied elements)`` of each slot."""
        g = self.first[ranks] + slots
        return (self.world.s_msg[g + 1] - self.world.s_msg[g], self.reduce_elems[g],
                self.copy_elems[g])

    # in NCCL's order a slot posts its group's messages and waits for all of them
    slot_posts = slot_waits = slot_messages

    @property
    def nsides(self) -> int:
        return len(self.world.m_rank)

    def sides(self, ids: np.ndarray):
        """``(kind, rank, peer, n, partner, wait slot)`` of message sides ``ids`` (a
        side: one rank's send or receive of a message)."""
        w = self.world
        return (w.m_kind[ids], w.m_rank[ids], w.m_peer[ids], w.m_n[ids], w.partner[ids],
                w.m_slot[ids] - self.first[w.m_rank[ids]])



class MpiProgram:
    """Every rank's schedule in the order ringcomm's point-to-point executor
    (:class:`ringcomm.execution.executors.P2PProgram`, MPI and shared memory) runs it:
    a send goes out as soon as its data is final, a receive is posted up to
    :data:`ringcomm.execution.plan.RECV_AHEAD` ahead, and a step waits only for its
    own receives and for the sends whose data its work overwrites
    (:func:`ringcomm.execution.plan.dependencies`). Slot ``i`` of a rank is: step
    ``i - 1``'s local work, then what step ``i`` starts, then what it waits for; the
    last slot (one past the last step) waits for the sends no step waited for.

    Args:
        world: every rank's compiled steps (pairs the messages).
        deps: per rank, :func:`~ringcomm.execution.plan.dependencies` of its steps.
    """


    def __init__(self, world: World, deps: list[dict]):
        self.world = w = world
        self.size = p = w.size
        n = len(w.m_rank)
        post, wait = np.zeros(n, np.int64), np.zeros(n, np.int64)
        m_first = np.searchsorted(w.m_rank, np.arange(p + 1))
        for r in range(p):
            ms = np.arange(m_first[r], m_first[r + 1])
            sends, recvs = ms[w.m_kind[ms] == SEND], ms[w.m_kind[ms] == RECV]
            d = deps[r]
            nsteps = int(w.steps[r])
            s_post = np.searchsorted(np.asarray(d["send_upto"], np.int64),
                                     np.arange(len(sends)), "right")
            r_post = np.searchsorted(np.asarray(d["recv_upto"], np.int64),
                                     np.arange(len(recvs)), "right")
            s_wait = np.full(len(sends), nsteps, np.int64)  # else: the last slot
            for i, ks in enumerate(d["step_send_waits"]):
                for k in ks:
                    s_wait[k] = min(s_wait[k], i)
            for j, ks in enumerate(d["recv_waits"]):
                for k in ks:
                    s_wait[k] = min(s_wait[k], r_post[j])
            post[sends], wait[sends] = s_post, np.maximum(s_wait, s_post)
            post[recvs], wait[recvs] = r_post, w.m_step[recvs]
        self.post_slot, self.wait_slot = post, wait
        self.nslots = w.steps + 1
        self.first = np.concatenate(([0], np.cumsum(self.nslots)))
        g_post = self.first[w.m_rank] + post
        g_wait = self.first[w.m_rank] + wait
        total = int(self.first[-1])
        self._posts = np.argsort(g_post, kind="stable")
        self._post_at = np.searchsorted(g_post[self._posts], np.arange(total + 1))
        self._waits = np.argsort(g_wait, kind="stable")
        self._wait_at = np.searchsorted(g_wait[self._waits], np.arange(total + 1))
        reg_n = w.regions[:, 3] - w.regions[:, 2]
        # step i's local work comes before slot i + 1's starts
        l_slot = self.first[w.l_rank] + w.l_step + 1
        n_loc = reg_n[w.l_dst]
        copy = w.l_kind == COPY
        self.reduce_elems = np.bincount(l_slot[~copy], n_loc[~copy], total)
        self.copy_elems = np.bincount(l_slot[copy], n_loc[copy], total)

    def _slot_list(self, order, at, ranks, slots):
        g = self.first[ranks] + slots
        a, b = at[g], at[g + 1]
        return order[expand_ranges(a, b)], np.repeat(np.arange(len(ranks)), b - a)

    def slot_posts(self, ranks: np.ndarray, slots: np.ndarray):
        """The message sides ``ranks`` start in slots ``slots``, and whose each is."""
        return self._slot_list(self._posts, self._post_at, ranks, slots)

    def slot_waits(self, ranks: np.ndarray, slots: np.ndarray):
        """The message sides ``ranks`` wait for in slots ``slots``, and whose each is."""
        return self._slot_list(self._waits, self._wait_at, ranks, slots)

    def slot_work(self, ranks: np.ndarray, slots: np.ndarray):
        """``(sides started or waited for, reduced elements, copied elements)``."""
        g = self.first[ranks] + slots
        return ((self._post_at[g + 1] - self._post_at[g]) + (self._wait_at[g + 1]
                                                              - self._wait_at[g]),
                self.reduce_elems[g], self.copy_elems[g])

    @property
    def nsides(self) -> int:
        return len(self.world.m_rank)

    def sides(self, ids: np.ndarray):
        """As :meth:`FullProgram.sides`."""
        w = self.world
        return (w.m_kind[ids], w.m_rank[ids], w.m_peer[ids], w.m_n[ids], w.partner[ids],
                self.wait_slot[ids])


@dataclasses.dataclass
class _Skeleton:
    """One rank's slots with peers relative to it (``offset = (peer - rank) mod p``)."""
    kind: np.ndarray
    offset: np.ndarray
    n: np.ndarray
    slot: np.ndarray
    nslots: int
    reduce_elems: np.ndarray
    copy_elems: np.ndarray


def skeleton(rank: int, size: int, compiled: tuple[list, list]) -> _Skeleton:
    """Rank ``rank``'s compiled ``(regions, steps)`` as a :class:`_Skeleton`, its slots
    as :class:`World` makes them (a step's local work goes before the next group)."""
    regions, steps = compiled
    reg_n = [e - a for _, a, e, _ in regions]
    kind, offset, n, slot = [], [], [], []
    red: list[int] = [0]
    cop: list[int] = [0]
    for sends, recvs, local in steps:
        if sends or recvs:
            s = len(red) - 1
            for k, part in ((SEND, sends), (RECV, recvs)):
                for q, v in part:
                    kind.append(k)
                    offset.append((q - rank) % size)
                    n.append(reg_n[v])
                    slot.append(s)
            red.append(0)
            cop.append(0)
        for k, d, _ in local:
            if k == COPY:
                cop[-1] += reg_n[d]
            else:
                red[-1] += reg_n[d]
    a = (lambda x, t=np.int64: np.asarray(x, t))
    return _Skeleton(a(kind, np.int8), a(offset), a(n), a(slot), len(red), a(red), a(cop))


class NotRotation(ValueError):
    """Rank 0's schedule rotated is not the other ranks' (the message says where)."""


class RotatedProgram:
    """Every rank as rank 0's :class:`_Skeleton` rotated."""


    def __init__(self, size: int, sk: _Skeleton):
        self.size = p = size
        self.sk = sk
        self.nslots = np.full(p, sk.nslots, np.int64)
        self.m = len(sk.kind)
        self.start = np.searchsorted(sk.slot, np.arange(sk.nslots + 1), "left")
        self.partner = self._pair()

    def _pair(self) -> np.ndarray:
        """The k-th send to offset d pairs with rank d's k-th receive from rank 0,
        which is (rotated) rank 0's k-th receive from offset -d."""
        sk, p = self.sk, self.size
        # key: (kind, the offset as the message's sender sees it toward its receiver)
        toward = np.where(sk.kind == SEND, sk.offset, (p - sk.offset) % p)
        key = toward * 2 + sk.kind
        order = np.argsort(key, kind="stable")
        sk_sorted = key[order]
        first = np.searchsorted(sk_sorted, sk_sorted, "left")
        seq = np.empty(self.m, np.int64)
        seq[order] = np.arange(self.m) - first
        partner = np.full(self.m, -1, np.int64)
        lookup = {(int(k), int(s)): i for i, (k, s) in enumerate(zip(key, seq))}
        for i in range(self.m):
            j = lookup.get((int(key[i]) ^ 1, int(seq[i])))
            if j is None:
                raise NotRotation(f"rank 0's {'send to' if sk.kind[i] == SEND else 'receive from'} "
                                  f"rank {int(sk.offset[i])} (its {int(seq[i]) + 1}th) has no "
                                  "match among the rotated ranks")
            if sk.n[j] != sk.n[i]:
                raise NotRotation(f"rank 0's message to/from rank {int(sk.offset[i])} has "
                                  f"{int(sk.n[i])} elements, its rotated match {int(sk.n[j])}")
            partner[i] = j
        return partner

    def slot_messages(self, ranks: np.ndarray, slots: np.ndarray):
        a, b = self.start[slots], self.start[slots + 1]
        own = np.repeat(np.arange(len(ranks)), b - a)
        j = expand_ranges(a, b)
        return ranks[own] * self.m + j, own

    def slot_work(self, ranks: np.ndarray, slots: np.ndarray):
        return (self.start[slots + 1] - self.start[slots], self.sk.reduce_elems[slots],
                self.sk.copy_elems[slots])

    slot_posts = slot_waits = slot_messages

    @property
    def nsides(self) -> int:
        return self.size * self.m

    def sides(self, ids: np.ndarray):
        """As :meth:`FullProgram.sides`."""
        r, j = np.divmod(ids, self.m)
        sk = self.sk
        peer = (r + sk.offset[j]) % self.size
        return sk.kind[j], r, peer, sk.n[j], peer * self.m + self.partner[j], sk.slot[j]


def same_rotation(base: _Skeleton, other: _Skeleton, rank: int) -> None:
    """Raise :class:`NotRotation` unless ``other`` (rank ``rank``'s) is ``base``
    rotated: the same slots, kinds and offsets, sizes within :data:`SIZE_SLACK`."""
    if other.nslots != base.nslots or len(other.kind) != len(base.kind):
        raise NotRotation(f"rank {rank} has {other.nslots - 1} groups and {len(other.kind)} "
                          f"messages, rank 0 {base.nslots - 1} and {len(base.kind)}")
    for name in ("kind", "offset", "slot"):
        diff = np.nonzero(getattr(other, name) != getattr(base, name))[0]
        if len(diff):
            raise NotRotation(f"rank {rank}'s message {int(diff[0])} differs from rank 0's "
                              f"rotated ({name})")
    for name in ("n", "reduce_elems", "copy_elems"):
        a, b = getattr(base, name), getattr(other, name)
        if np.any(np.abs(a - b) > np.maximum(SIZE_SLACK * np.maximum(a, b), 1)):
            raise NotRotation(f"rank {rank}'s sizes ({name}) differ from rank 0's by more "
                              f"than {SIZE_SLACK:.0%}")


def sample_ranks(size: int, k: int = 4) -> list[int]:
    """Ranks to compare with rank 0: the neighbours, the middle, the last, and
    spread ones (deterministic)."""
    picks = {1, 2, size // 2, size - 1, size // 3, (2 * size) // 3, size // 4 + 1,
             size - 2}
    rng = np.random.default_rng(size)
    picks.update(int(x) for x in rng.integers(1, max(size, 2), size=k))
    return sorted(r for r in picks if 0 < r < size)
