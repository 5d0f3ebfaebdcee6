"""Every rank's steps at once, as arrays, run in NCCL's rounds: the event order of a
whole group, without a thread or process per rank.

:class:`World` loads every rank's compiled steps (the ``(regions, steps)`` of
:func:`ringcomm.execution.plan.compile_steps`), pairs each send with its receive
(the k-th send from a to b with the k-th receive at b from a) once, by sorting,
and runs the steps under the rules :mod:`ringcomm.execution.nccl_rules` states: a
step's messages form a group, a rank's groups and local work run in order, and a
message completes in the round in which both ranks' groups holding it are at the
head of their streams. Each round, every rank first runs the local work its
stream reached, then every message whose two groups are both at the head completes;
groups left with nothing pending retire.

The rounds are exactly :class:`~ringcomm.execution.nccl_rules.Rules`' (the same
messages complete in the same round, the same refusals in the same words, a test
holds them to it), but a round costs a few array operations over the groups that
advanced, not a Python call per message: every rank of a 1,024-rank ring moves in
about 2,000 rounds. The caller gives what moves data (:meth:`World.run`): symbolic
contents in the checker, tensors in ``run_schedule(executor="events")``; the
world itself holds only the order.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

import numpy as np

from ringcomm.execution.nccl_rules import (deadlock_words, mismatch_words, unmatched_words,
                                           wait_cycle)
from ringcomm.schedule import ScheduleError

SEND, RECV = 0, 1


@dataclasses.dataclass
class Counts:
    """What the run counted, as :class:`~ringcomm.execution.nccl_rules.Rules` counts it:
    ``rounds`` with messages, ``busiest`` (per round, the largest in- or outflow of any
    rank, summed), ``sent`` (elements each rank sent)."""
    rounds: int
    busiest: int
    sent: np.ndarray


class Batch:
    """One round's local work or messages, one entry per rank at most (locals) or per
    message; arrays of equal length, in rank order.

    Locals: ``rank``, ``step``, ``kind`` (:data:`ringcomm.execution.plan.COPY` or a
    reduce), ``dst``, ``src`` (global region numbers, :attr:`World.regions`).
    Messages: ``rank`` (the sender), ``peer`` (the receiver), ``step`` and ``peer_step``,
    ``n`` (elements), ``src`` and ``dst`` (global region numbers), ``msg`` and
    ``peer_msg`` (the send's and the receive's message numbers)."""
    __slots__ = ("rank", "step", "kind", "dst", "src", "peer", "peer_step", "n", "msg",
                 "peer_msg")

    def __init__(self, **fields):
        for k in self.__slots__:
            setattr(self, k, fields.get(k))

    def __len__(self) -> int:
        return len(self.rank)


def _table(flat: list[int], width: int) -> np.ndarray:
    """Rows of ``width`` integers, given one after another, as an int64 array (a flat
    list converts several times faster than a list of tuples)."""
    return np.array(flat, np.int64).reshape(-1, width)


def expand_ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The concatenated ranges ``[starts[i], ends[i])``."""
    lens = ends - starts
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    rep = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
    return np.arange(total, dtype=np.int64) + rep


class Memory:
    """Every rank's buffers laid end to end in one array (caller buffers, then
    scratch, rank after rank), and where each of a :class:`World`'s regions lies in it.

    Args:
        world: the world whose regions are placed.
        lengths: per rank, the element count of each of its buffers.

    Attributes:
        base: per rank, where each of its buffers starts.
        total: elements in all.
    """

    def __init__(self, world: "World", lengths: Sequence[Sequence[int]]):
        sizes = [int(n) for lens in lengths for n in lens]
        starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        self.total = int(starts[-1])
        first = np.cumsum([0, *(len(lens) for lens in lengths)])
        self.base = [starts[first[r]:first[r + 1]].tolist() for r in range(len(lengths))]
        reg = world.regions
        count = np.diff(first)[reg[:, 0]]
        sizes = np.asarray(sizes + [0], np.int64)
        at = np.where(reg[:, 1] < count, first[reg[:, 0]] + reg[:, 1], len(sizes) - 1)
        bad = np.nonzero((reg[:, 1] < 0) | (reg[:, 1] >= count) | (reg[:, 2] < 0)
                         | (reg[:, 3] < reg[:, 2]) | (reg[:, 3] > sizes[at]))[0]
        if len(bad):  # raw positions have no bounds of their own: a neighbour's memory
            r, b, a, e = reg[bad[0]].tolist()
            raise ValueError(f"ringcomm: rank {r}'s region [{a}, {e}) of buffer {b} is "
                             f"outside its buffers ({count[bad[0]]} buffers, this one of "
                             f"{sizes[at[bad[0]]] if b < count[bad[0]] else 'none'} "
                             "elements): a malformed schedule")
        self._start = starts[at] + reg[:, 2]
        self._n = reg[:, 3] - reg[:, 2]

    def elements(self, regions: np.ndarray) -> np.ndarray:
        """The positions of the elements of ``regions`` (global numbers), in order."""
        starts = self._start[regions]
        return expand_ranges(starts, starts + self._n[regions])

    def sizes(self, regions: np.ndarray) -> np.ndarray:
        return self._n[regions]


class World:
    """Every rank's steps under NCCL's rules.

    Args:
        ranks: per rank ``(regions, steps)`` as :func:`ringcomm.execution.plan.compile_steps`
            gives them: regions ``(buffer, start, end, whole)``, steps ``(sends, recvs,
            local)`` of ``(peer, region)``, ``(peer, region)`` and ``(kind, dst, src)``.
        unit: what message sizes count, for messages.
    Raises:
        ScheduleError: a message names a peer that is no other rank; the error's
            ``bad_peer`` is ``(rank, step, peer)``.

    Attributes:
        size: number of ranks.
        regions: ``(rank, buffer, start, end)`` of every rank's regions, numbered
            globally: rank r's region v is ``region_base[r] + v``.
        region_base: where each rank's regions start in :attr:`regions`.
        reduced: elements each rank reduces locally.
        steps: steps in each rank's schedule.
    """

    def __init__(self, ranks: Iterable[tuple[list, list]], size: int | None = None,
                 unit: str = "elements"):
        if size is None:
            ranks = list(ranks)
            size = len(ranks)
        self.size = p = size
        self.unit = unit
        i64 = np.int64
        cols: dict[str, list[np.ndarray]] = {k: [] for k in (
            "reg", "m", "l", "s_rank", "s_step")}
        base, nreg, nslot = [], 0, 0
        self.first_slot = np.zeros(p + 1, i64)
        self.steps = np.zeros(p, i64)
        for r, (regions, steps) in enumerate(ranks):
            base.append(nreg)
            self.first_slot[r] = nslot
            self.steps[r] = len(steps)
            # messages in program order: a step's sends, then its receives
            m = _table([x for i, st in enumerate(steps) for k in (SEND, RECV)
                        for q, v in st[k] for x in (i, k, q, v)], 4)
            loc = _table([x for i, st in enumerate(steps) for kind, d, s in st[2]
                          for x in (i, kind, d, s)], 4)
            bad = np.nonzero((m[:, 2] < 0) | (m[:, 2] >= p) | (m[:, 2] == r))[0]
            if len(bad):
                i, k, q, _ = m[bad[0]].tolist()
                err = ScheduleError(f"rank {r} step {i}: {'send' if k == SEND else 'recv'} "
                                    f"peer {q} is not another rank of {p}")
                err.bad_peer = (r, i, q)
                raise err
            # slots: the local work before a step's group, the group; then the end
            groups = np.unique(m[:, 0])
            cols["m"].append(np.column_stack((
                np.full(len(m), r), m[:, 1], m[:, 2], m[:, 3] + nreg, m[:, 0],
                nslot + np.searchsorted(groups, m[:, 0], "left"))))
            cols["l"].append(np.column_stack((
                np.full(len(loc), r), loc[:, 1], loc[:, 2] + nreg, loc[:, 3] + nreg, loc[:, 0],
                nslot + np.searchsorted(groups, loc[:, 0], "right"))))
            cols["s_rank"].append(np.full(len(groups) + 1, r))
            cols["s_step"].append(np.append(groups, -1))
            cols["reg"].append(_table([x for b, a, e, _ in regions for x in (r, b, a, e)], 4))
            nreg += len(regions)
            nslot += len(groups) + 1
        self.first_slot[p] = nslot
        cat = (lambda k, w: np.concatenate(cols[k]).astype(i64).reshape(-1, w) if cols[k]
               else np.zeros((0, w), i64))
        self.regions = cat("reg", 4)
        self.region_base = np.array(base, i64)
        m, loc = cat("m", 6), cat("l", 6)
        self.m_rank, self.m_kind, self.m_peer, self.m_reg, self.m_step, self.m_slot = m.T
        self.m_kind = self.m_kind.astype(np.int8)
        self.l_rank, self.l_kind, self.l_dst, self.l_src, self.l_step, l_slot = loc.T
        self.s_rank = np.concatenate(cols["s_rank"]).astype(i64) if p else np.zeros(0, i64)
        self.s_step = np.concatenate(cols["s_step"]).astype(i64) if p else np.zeros(0, i64)
        slots = np.arange(nslot + 1)
        self.s_msg = np.searchsorted(self.m_slot, slots, "left")
        self.s_loc = np.searchsorted(l_slot, slots, "left")
        reg_n = self.regions[:, 3] - self.regions[:, 2]
        self.m_n = reg_n[self.m_reg]
        red = self.l_kind != 0
        self.reduced = np.bincount(self.l_rank[red], reg_n[self.l_dst[red]], p).astype(i64)
        self._pair()

    def _pair(self) -> None:
        """``partner[m]``: the message that matches ``m`` (-1: none), by sender,
        receiver and order."""
        n = len(self.m_rank)
        sender = np.where(self.m_kind == SEND, self.m_rank, self.m_peer)
        receiver = np.where(self.m_kind == SEND, self.m_peer, self.m_rank)
        pair = sender * self.size + receiver
        code = pair * 2 + self.m_kind
        order = np.argsort(code, kind="stable")  # program order kept within a pair
        sc = code[order]
        first = np.searchsorted(sc, sc, side="left")
        seq = np.empty(n, np.int64)
        seq[order] = np.arange(n) - first
        key = (pair * (n + 1) + seq) * 2
        self.partner = np.full(n, -1, np.int64)
        sends = np.nonzero(self.m_kind == SEND)[0]
        recvs = np.nonzero(self.m_kind == RECV)[0]
        rk = key[recvs]
        ro = np.argsort(rk)
        pos = np.searchsorted(rk[ro], key[sends])
        pos_c = np.minimum(pos, max(len(recvs) - 1, 0))
        hit = (pos < len(recvs)) & (rk[ro][pos_c] == key[sends]) if len(recvs) else \
            np.zeros(len(sends), bool)
        s_hit, r_hit = sends[hit], recvs[ro[pos_c[hit]]]
        self.partner[s_hit] = r_hit
        self.partner[r_hit] = s_hit

    # -- running -------------------------------------------------------------------
    def run(self, on_local: Callable[[Batch], None] | None = None,
            on_messages: Callable[[Batch], None] | None = None) -> Counts:
        """Run every rank to the end, round by round, calling ``on_local`` with each
        batch of local work due (the k-th piece of each rank's, k = 0, 1, ...) and then
        ``on_messages`` with the round's completed messages.

        Raises:
            ScheduleError: a send and its receive differ in size (``mismatch``:
                ``(rank, step, peer, peer_step)``), or nothing can move while work remains
                (``stuck``: ``(orphans, cycle)`` as :meth:`stuck` gives them).
        """
        p = self.size
        head = self.first_slot[:p].copy()
        last = self.first_slot[1:] - 1
        pending = np.diff(self.s_msg)
        done = np.zeros(len(self.m_rank), bool)
        entering = head.copy()
        rounds = busiest = 0
        sent = np.zeros(p, np.int64)
        while True:
            if len(entering):
                self._locals(entering, on_local)
            cand = expand_ranges(self.s_msg[entering], self.s_msg[entering + 1]) \
                if len(entering) else np.zeros(0, np.int64)
            pm = self.partner[cand]
            ok = pm >= 0
            cand, pm = cand[ok], pm[ok]
            ok = head[self.m_rank[pm]] == self.m_slot[pm]
            cand, pm = cand[ok], pm[ok]
            snd = np.unique(np.where(self.m_kind[cand] == SEND, cand, pm))
            if len(snd):
                rcv = self.partner[snd]
                self._sizes(snd, rcv)
                done[snd] = done[rcv] = True
                if on_messages is not None:
                    on_messages(Batch(rank=self.m_rank[snd], peer=self.m_rank[rcv],
                                      step=self.m_step[snd], peer_step=self.m_step[rcv],
                                      n=self.m_n[snd], src=self.m_reg[snd],
                                      dst=self.m_reg[rcv], msg=snd, peer_msg=rcv))
                rounds += 1
                flow_out = np.bincount(self.m_rank[snd], self.m_n[snd], p)
                flow_in = np.bincount(self.m_rank[rcv], self.m_n[snd], p)
                busiest += int(np.maximum(flow_out, flow_in).max())
                sent += flow_out.astype(np.int64)
                slots = np.concatenate((self.m_slot[snd], self.m_slot[rcv]))
                np.subtract.at(pending, slots, 1)
                touched = np.unique(slots)
                retired = touched[pending[touched] == 0]
            else:
                retired = np.zeros(0, np.int64)
            # a rank whose group retired moves to its next slot
            ranks = self.s_rank[retired]
            head[ranks] += 1
            entering = head[ranks]
            if not len(retired) and not len(snd):  # nothing moved
                if np.all(head == last):
                    break
                raise self._stuck_error(head, done)
        return Counts(rounds, busiest, sent)

    def _locals(self, entering: np.ndarray, on_local) -> None:
        """The local work of slots ``entering``, in order within each rank."""
        starts, ends = self.s_loc[entering], self.s_loc[entering + 1]
        k = 0
        while True:
            live = starts + k < ends
            if not live.any():
                return
            ix = starts[live] + k
            if on_local is not None:
                on_local(Batch(rank=self.l_rank[ix], step=self.l_step[ix],
                               kind=self.l_kind[ix], dst=self.l_dst[ix], src=self.l_src[ix]))
            k += 1

    def _sizes(self, snd: np.ndarray, rcv: np.ndarray) -> None:
        bad = np.nonzero(self.m_n[snd] != self.m_n[rcv])[0]
        if not len(bad):
            return
        s, r = int(snd[bad[0]]), int(rcv[bad[0]])
        err = ScheduleError(mismatch_words(
            int(self.m_rank[s]), f"step {self.m_step[s]}", int(self.m_n[s]), self.unit,
            int(self.m_peer[s]), f"step {self.m_step[r]}", int(self.m_n[r])))
        err.mismatch = (int(self.m_rank[s]), int(self.m_step[s]), int(self.m_peer[s]),
                        int(self.m_step[r]))
        raise err

    # -- when nothing moves --------------------------------------------------------------
    def stuck(self, head: np.ndarray, done: np.ndarray) -> tuple[list, list]:
        """Why nothing moves, as data, as :meth:`Rules.stuck
        <ringcomm.execution.nccl_rules.Rules.stuck>` finds it: ``(orphans, cycle)``;
        orphans ``(rank, step, kind, n, peer)``: the undone messages of the heads'
        groups that have no partner; else the cycle, each ``(rank, step, kind, n, peer,
        step of the match)``, from the lowest waiting rank."""
        orphans, waits = [], {}
        for r in range(self.size):
            s = int(head[r])
            for m in range(int(self.s_msg[s]), int(self.s_msg[s + 1])):
                if done[m]:
                    continue
                entry = (r, int(self.m_step[m]), "send" if self.m_kind[m] == SEND else "recv",
                         int(self.m_n[m]), int(self.m_peer[m]))
                if self.partner[m] < 0:
                    orphans.append(entry)
                elif r not in waits:
                    waits[r] = (*entry, int(self.m_step[self.partner[m]]))
        if orphans:
            return orphans, []
        return [], wait_cycle(waits, lambda w: w[4])

    def _stuck_error(self, head: np.ndarray, done: np.ndarray) -> ScheduleError:
        orphans, cycle = self.stuck(head, done)
        if orphans:
            text = unmatched_words([(r, f"step {i}", k, n, q) for r, i, k, n, q in orphans],
                                   self.unit)
        else:
            text = deadlock_words([(r, f"step {i}", k, n, q, f"step {j}")
                                   for r, i, k, n, q, j in cycle], self.unit)
        err = ScheduleError(text)
        err.stuck = (orphans, cycle)
        return err
