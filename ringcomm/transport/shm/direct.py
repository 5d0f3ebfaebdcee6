"""``shm_direct``: the shared-memory transport's own collectives (allreduce,
broadcast, allgather, reduce_scatter, barrier), for groups whose ranks all share one
host (DeepSpeed's small-message allreduce, in ringcomm's terms, and the same round for
the others; a barrier is a round that carries no data).

Each rank's segment holds a *window* of two buffers of ``RINGCOMM_SHM_DIRECT_BYTES``
and, beside each, a line of three words: the round it holds, and the signature and
epoch of the call that wrote it. A round of a call:

1. copy this rank's part of the data into buffer ``k % 2`` of its own window (the
   collective says which part: :meth:`_Direct._put`);
2. write the signature and epoch, fence, write the round number ``k`` (publish);
3. wait until every peer's line for buffer ``k % 2`` says round ``k``, checking that
   its signature and epoch are this call's (else: the ranks run different calls);
4. fence, then read what this rank needs from the peers' buffers
   (:meth:`_Direct._take`): allreduce folds every rank's buffer into the caller's
   tensor in rank order (rank 0's first: every rank computes the same bits, as the
   schedules do); broadcast copies the root's; allgather copies every peer's into its
   output chunk; reduce_scatter folds every rank's copy of this rank's chunk, in rank
   order, into the output.

A message longer than a buffer takes several rounds. There is no trailing wait: a
rank writes buffer ``k % 2`` again only in round ``k + 2``, after it saw every peer
publish round ``k + 1``, which each did only once it had read round ``k``. So each
byte moves once into shared memory and is read from there by the ranks that need
it: against a schedule's exchange, no request machinery, no FIFO and, below
``RINGCOMM_SHM_MIN_BYTES``, no MPI message. ``auto`` picks these where the measured
table says they win.

A round's wait (:func:`wait_round`) is the transport's kind of wait
(:class:`ringcomm.transport.shm.liveness.Idle`): the collective's deadline, backing
off to sleeps, dead or failed peers, and a peer found in another collective. A
schedule's wait on a peer that runs shm_direct instead finds it in that peer's
window (:func:`peers_ahead`). A failed round leaves the windows out of step, so the
transport refuses later collectives (:func:`round_failed`).
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from ringcomm import ops
from ringcomm.mismatch import mismatch
from ringcomm.transport.base import (TransportAborted, TransportMismatch,
                                     TransportPeerFailed)
from ringcomm.transport.shm.liveness import Idle

_monotonic = time.monotonic

_copy = ops.serial_copy
#: looks at the peers' lines before the transport's wait takes over
_SPINS = 1000
#: the collectives shm_direct serves
COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter", "barrier")


def direct_program(tp: Any, collective: str, layout: tuple, dtype: torch.dtype, op: Any,
                   root: int, signature: tuple[int, str], epoch: int, names: Any = None):
    """The program (``run(bufs)``, ``close()``) of one ``collective`` call shape over
    ``tp``'s window; buffers and ``layout`` as :data:`ringcomm.schedule.BUFFERS` says."""
    kind = {"allreduce": DirectAllreduce, "broadcast": DirectBroadcast,
            "allgather": DirectAllgather, "reduce_scatter": DirectReduceScatter,
            "barrier": DirectBarrier}[collective]
    return kind(tp, layout, dtype, op, root, signature, epoch, names)


def wait_round(tp: Any, k: int, sig: int, epoch: int, describe) -> None:
    """Wait until every peer published round ``k`` of the same call (signature
    ``sig``, ``epoch``), within the collective's deadline; then the fence that
    orders the reads of its data after it. ``describe(sig)`` names a call."""
    win = tp.direct
    line, words, me = win.lines[k & 1], win.words, tp.rank
    pending = [r for r in range(tp.size) if r != me]
    idle = Idle(tp, lambda: (
        f"waiting for rank(s) {pending} on host {tp.host} to join "
        f"{describe(sig)} (over shared memory)"),
        lambda now: _look_from_window(tp, pending, now, describe(sig)))
    tp.signs.clear()
    while True:
        arrived = [r for r in pending if words[r][line] == k]
        if arrived:
            tp.fence()  # the rounds before the signatures and data they publish
            for r in arrived:
                w = words[r]
                if w[line + 1] != sig or w[line + 2] != epoch:
                    theirs = describe(w[line + 1]) if w[line + 2] == epoch else (
                        "a call of another epoch (a call before it was refused on "
                        "some ranks only: bad input there)")
                    raise mismatch(me, describe(sig), r, theirs)
            pending[:] = [r for r in pending if r not in arrived]
            if not pending:
                return
        idle.turn()


def _look_from_window(tp: Any, pending: list[int], now: float, mine: str) -> None:
    """A long shm_direct wait looks at the peers it waits on: failed, gone, or in
    another collective (a message of a schedule from them waits here, the same at
    every look for MISMATCH_S)."""
    reported = tp.peer_failure(pending) if tp.peer_failure is not None else None
    if reported is not None:
        raise TransportPeerFailed(reported)
    first_tag = tp.inner.first_tag_from
    for peer in pending:
        text = tp.failure_of(peer)
        if text is not None:
            raise TransportPeerFailed(f"rank {peer} on host {tp.host} stopped: {text}")
        tp.check_alive(peer, "over shared memory")
        pair = tp.pairs[peer]
        came = pair.in_[pair.head_in] > pair.got
        tag = first_tag(peer)
        if not came and tag is None:
            tp.signs.gone(peer)
        elif tp.signs.lasted(peer, (came, tag, pair.in_[pair.head_in]), now):
            raise mismatch(tp.rank, mine, peer, None)  # its messages' tags: unread


def peers_ahead(tp: Any, peers: list[int]) -> None:
    """Raise if a peer this schedule waits on published a shm_direct round this rank
    has not joined, the same at every look for MISMATCH_S: it runs shm_direct where
    this rank runs a schedule."""
    now = _monotonic()
    for peer in peers:
        ahead = round_of(tp, peer)
        key = ("window", peer)
        if ahead <= tp.rounds:
            tp.signs.gone(key)
        elif tp.signs.lasted(key, ahead, now):
            # its window holds its call's whole signature: the program names it
            line = tp.direct.lines[ahead & 1]
            raise TransportMismatch(peer, None, None,
                                    signature=tp.direct.words[peer][line + 1])


def round_of(tp: Any, peer: int) -> int:
    """The last round of shm_direct ``peer`` published."""
    w, lines = tp.direct.words[peer], tp.direct.lines
    return max(w[lines[0]], w[lines[1]])


def round_failed(tp: Any, e: BaseException) -> None:
    """A round failed part done: the windows are out of step from here on."""
    if isinstance(e, TransportAborted) or tp.broken is not None:
        tp.broken = tp.broken or ("ringcomm shared-memory transport: unusable after "
                                        "an aborted collective")
        return
    tp.fail(f"rank {tp.rank} on host {tp.host}: {type(e).__name__}: {e}")


class _Direct:
    """The round protocol every shm_direct collective shares: ``spans`` are the
    element ranges ``(a, b)`` of the rounds (a part of each rank's data per round);
    a subclass copies this rank's part in (``_put``) and reads the peers' out
    (``_take``), on the memory :meth:`_views` made of the caller's buffers."""

    def __init__(self, tp: Any, dtype: torch.dtype, longest: int, step: int,
                 signature: tuple[int, str], epoch: int, names: Any):
        self.tp, self.window, self.dtype = tp, tp.direct, dtype
        self.itemsize = dtype.itemsize
        self.signature, self.epoch, self._names = signature, epoch, names
        self.me, self.p = tp.rank, tp.size
        # at least one round: a call of no elements still meets its peers (a size
        # mismatch with it shows)
        self.spans = [(a, min(a + step, longest)) for a in range(0, max(longest, 1), step)]
        self._bound: tuple | None = None  # (addresses, views) of the last buffers
        self.peer_words = [w for r, w in enumerate(self.window.words) if r != tp.rank]
        self.own_words = self.window.words[tp.rank]

    def window_part(self, buf: int, rank: int, at: int, n: int):
        """``n`` elements at element ``at`` of ``rank``'s window buffer ``buf``, bytes."""
        isz = self.itemsize
        return self.window.buffers(buf)[rank][at * isz:(at + n) * isz]

    def caller_part(self, t: torch.Tensor, a: int, b: int):
        """Elements ``[a, b)`` of a caller's contiguous tensor (clipped to it), bytes."""
        n = t.numel()
        a, b = min(a, n), min(b, n)
        isz = self.itemsize
        return ops.memory(t.data_ptr() + a * isz, (b - a) * isz)

    def _bind(self, bufs: Sequence[torch.Tensor]):
        # one buffer (a single tensor's call) keys by its address alone: no generator
        key = bufs[0].data_ptr() if len(bufs) == 1 else tuple(t.data_ptr() for t in bufs)
        bound = self._bound
        if bound is None or bound[0] != key:
            bound = self._bound = (key, self._views(bufs))
        return bound[1]

    def _views(self, bufs: Sequence[torch.Tensor]):
        raise NotImplementedError

    def _put(self, views, i: int, buf: int) -> None:
        raise NotImplementedError

    def _take(self, views, i: int, buf: int) -> None:
        raise NotImplementedError

    def run(self, bufs: Sequence[torch.Tensor]) -> None:
        views = self._bind(bufs)
        tp = self.tp
        sig, epoch, fence, peer_words = self.signature[0], self.epoch, tp.fence, self.peer_words
        own, lines = self.own_words, self.window.lines
        put, take = self._put, self._take
        try:
            for i in range(len(self.spans)):
                if tp.broken is not None:
                    raise RuntimeError(tp.broken)
                k = tp.rounds + 1
                buf = k & 1
                line = lines[buf]
                put(views, i, buf)
                # publish: data, signature and epoch, fence, round
                own[line + 1] = sig
                own[line + 2] = epoch
                fence()
                own[line] = k
                # the peers are usually a few microseconds away: look at their lines in
                # a tight loop first (the transport's wait, with its deadline, probes
                # and sleeps, takes over after _SPINS looks, or raises a mismatch)
                for _ in range(_SPINS):
                    for w in peer_words:
                        if w[line] != k:
                            break
                    else:
                        fence()  # the rounds before the signatures and data they publish
                        for w in peer_words:
                            if w[line + 1] != sig or w[line + 2] != epoch:
                                wait_round(tp, k, sig, epoch, self._describe)
                        break
                else:
                    wait_round(tp, k, sig, epoch, self._describe)
                take(views, i, buf)
                tp.rounds = k
        except BaseException as e:
            round_failed(tp, e)
            raise

    def _describe(self, sig: int) -> str | None:
        """The call of signature hash ``sig``, as this rank knows it (None: not one of
        this rank's recent calls)."""
        if sig == self.signature[0]:
            return self.signature[1]
        return self._names(sig, 32) if self._names is not None else None

    def close(self) -> None:
        self._bound = None


class DirectAllreduce(_Direct):
    """allreduce, ``layout`` ``(numel,)``: every rank copies its part in and folds
    every rank's, in rank order.

    ``run`` also takes the call's elements as several 1-D tensors, one after the
    other (``pieces``: an allreduce_coalesced of distinct, non-overlapping tensors):
    each round copies the pieces' parts straight into the window and folds the
    peers' straight into them, with no packed buffer between."""

    #: run() takes the elements as several tensors, in order
    pieces = True

    def __init__(self, tp, layout, dtype, op, root, signature, epoch, names=None):
        step = tp.direct.nbytes // dtype.itemsize
        super().__init__(tp, dtype, layout[0], step, signature, epoch, names)
        self.reduce = ops.serial_reducer(op, dtype)
        self.reduce_after = ops.serial_reducer(op, dtype, src_first=True)
        # per buffer, per span: every rank's part in its window, as bytes and operands
        self.raw = [[[self.window_part(buf, r, 0, b - a) for r in range(self.p)]
                     for a, b in self.spans] for buf in (0, 1)]
        self.sources = [[[ops.operand(v, dtype) for v in per_span] for per_span in per_buf]
                        for per_buf in self.raw]
        # per buffer, per span: this rank's part of its window as a memoryview. A copy
        # between memoryviews is a memcpy through the buffer protocol: after a pause a
        # 4 KiB one costs half what numpy's copyto does, for the code each runs
        # (scripts/bench_steps.py, docs/data/steps_pause.json)
        self.mine = [[memoryview(per_span[self.me]) for per_span in per_buf]
                     for per_buf in self.raw]
        # every rank folds in rank order, (((b0 op b1) op b2) ...): the same bits everywhere
        self._fold = (self._fold_first, self._fold_second)[self.me] if self.me < 2 \
            else self._fold_later

    def _views(self, bufs):
        if len(bufs) > 1:
            return None, self._piece_views(bufs), None
        parts = [self.caller_part(bufs[0], a, b) for a, b in self.spans]
        return parts, [ops.operand(x, self.dtype) for x in parts], [memoryview(x) for x in parts]

    def _piece_views(self, bufs) -> list:
        """Per span, per window buffer: ``(part, raw, target, src)`` for each piece of
        ``bufs`` the span covers: the piece's bytes and operand, and every rank's
        window bytes and operands at the piece's place in the span."""
        out = [[[] for _ in (0, 1)] for _ in self.spans]
        at = 0
        for t in bufs:
            n = t.numel()
            for i, (a, b) in enumerate(self.spans):
                lo, hi = max(a, at), min(b, at + n)
                if lo >= hi:
                    continue
                part = self.caller_part(t, lo - at, hi - at)
                target = ops.operand(part, self.dtype)
                for buf in (0, 1):
                    raw = [self.window_part(buf, r, lo - a, hi - lo) for r in range(self.p)]
                    out[i][buf].append((part, raw, target,
                                        [ops.operand(v, self.dtype) for v in raw]))
            at += n
        return out

    def _put(self, views, i, buf):
        parts = views[0]
        if parts is None:
            me = self.me
            for part, raw, _, _ in views[1][i][buf]:
                _copy(raw[me], part)
            return
        part = views[2][i]
        if part.nbytes:
            self.mine[buf][i][:] = part

    def _take(self, views, i, buf):
        if views[0] is None:
            fold = self._fold
            for part, raw, target, src in views[1][i][buf]:
                fold(target, part, raw, src)
            return
        self._fold(views[1][i], views[0][i], self.raw[buf][i], self.sources[buf][i])

    def _fold_first(self, target, part, raw, src) -> None:
        """Rank 0: its own, then every other rank's, in rank order."""
        for r in range(1, len(src)):
            self.reduce(target, src[r])

    def _fold_second(self, target, part, raw, src) -> None:
        """Rank 1: rank 0's, then its own, then the rest."""
        self.reduce_after(target, src[0])
        for r in range(2, len(src)):
            self.reduce(target, src[r])

    def _fold_later(self, target, part, raw, src) -> None:
        """Rank 2 on: rank 0's copied in, then every other rank's (its own from its
        window), in rank order."""
        _copy(part, raw[0])
        for r in range(1, len(src)):
            self.reduce(target, src[r])


class DirectBroadcast(_Direct):
    """broadcast from ``root``, ``layout`` ``(numel,)``: the root copies its data in,
    every other rank copies it out."""

    def __init__(self, tp, layout, dtype, op, root, signature, epoch, names=None):
        step = tp.direct.nbytes // dtype.itemsize
        super().__init__(tp, dtype, layout[0], step, signature, epoch, names)
        self.root = root
        self.raw = [[self.window_part(buf, root, 0, b - a) for a, b in self.spans]
                    for buf in (0, 1)]

    def _views(self, bufs):
        return [self.caller_part(bufs[0], a, b) for a, b in self.spans]

    def _put(self, views, i, buf):
        if self.me == self.root and views[i].size:
            _copy(self.raw[buf][i], views[i])

    def _take(self, views, i, buf):
        if self.me != self.root and views[i].size:
            _copy(views[i], self.raw[buf][i])


class DirectAllgather(_Direct):
    """allgather, ``layout`` the count of every rank's chunk: every rank copies its
    input in, and every peer's out into that peer's output chunk (its own from its
    input, unless the input is its output chunk)."""

    def __init__(self, tp, layout, dtype, op, root, signature, epoch, names=None):
        step = tp.direct.nbytes // dtype.itemsize
        super().__init__(tp, dtype, max(layout, default=0), step, signature, epoch, names)
        self.counts = layout
        self.raw = [[[self.window_part(buf, r, 0, max(min(b, c) - a, 0))
                      for r, c in enumerate(layout)] for a, b in self.spans] for buf in (0, 1)]

    def _views(self, bufs):
        me = self.me
        inp = [self.caller_part(bufs[self.p], a, b) for a, b in self.spans]
        outs = [[self.caller_part(bufs[r], a, b) for r in range(self.p)] for a, b in self.spans]
        in_place = bufs[me].data_ptr() == bufs[self.p].data_ptr()
        return inp, outs, in_place

    def _put(self, views, i, buf):
        part = views[0][i]
        if part.size:
            _copy(self.raw[buf][i][self.me], part)

    def _take(self, views, i, buf):
        inp, outs, in_place = views
        me, raw, out = self.me, self.raw[buf][i], outs[i]
        if not in_place and inp[i].size:
            _copy(out[me], inp[i])
        for r in range(self.p):
            if r != me and raw[r].size:
                _copy(out[r], raw[r])


class DirectReduceScatter(_Direct):
    """reduce_scatter, ``layout`` the count of every chunk: every rank copies its
    input chunks for the other ranks into its window (each chunk at its own offset),
    and folds every rank's copy of its own chunk, in rank order, into the output (its
    own contribution read from its input, or from its window where the output
    overlaps that input)."""

    #: it only reads its input chunks: the front passes the caller's, uncopied
    keeps_inputs = True

    def __init__(self, tp, layout, dtype, op, root, signature, epoch, names=None):
        p, isz = tp.size, dtype.itemsize
        # a chunk's stride in the window: a p-th of it, in whole cache lines
        stride = max(tp.direct.nbytes // p // 64 * 64, isz) // isz
        super().__init__(tp, dtype, max(layout, default=0), stride, signature, epoch, names)
        self.counts, self.stride = layout, stride
        self.reduce = ops.serial_reducer(op, dtype)
        me = self.me
        # per buffer, per span: chunk j's part in this rank's window (to put); and
        # this rank's chunk in every rank's window (to take), as bytes and operands
        self.put_at = [[[self.window_part(buf, me, j * stride, max(min(b, c) - a, 0))
                         for j, c in enumerate(layout)] for a, b in self.spans]
                       for buf in (0, 1)]
        mine = [[[self.window_part(buf, r, me * stride, max(min(b, layout[me]) - a, 0))
                  for r in range(p)] for a, b in self.spans] for buf in (0, 1)]
        self.take_raw = mine
        self.take_ops = [[[ops.operand(v, dtype) for v in s] for s in per_buf]
                         for per_buf in mine]

    def _views(self, bufs):
        me, p = self.me, self.p
        out, chunk = bufs[p], bufs[me]
        lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * self.itemsize
        clo, chi = chunk.data_ptr(), chunk.data_ptr() + chunk.numel() * self.itemsize
        # the output overlaps this rank's input chunk: folding into it would change
        # what it still reads, so its own part goes through its window as well
        overlap = out.numel() > 0 and chunk.numel() > 0 and lo < chi and clo < hi
        ins = [[self.caller_part(bufs[j], a, b) for j in range(p)] for a, b in self.spans]
        outs = [self.caller_part(out, a, b) for a, b in self.spans]
        # this rank's own contribution, where it is read from its input
        own = [None if overlap else ops.operand(s[me], self.dtype) for s in ins]
        return ins, outs, [ops.operand(x, self.dtype) for x in outs], own

    def _put(self, views, i, buf):
        ins, _, _, own = views
        me, at = self.me, self.put_at[buf][i]
        for j, part in enumerate(ins[i]):
            if (j != me or own[i] is None) and part.size:
                _copy(at[j], part)

    def _take(self, views, i, buf):
        ins, outs, targets, own = views
        part, target, mine = outs[i], targets[i], own[i]
        if not part.size:
            return
        me, raw, src = self.me, self.take_raw[buf][i], self.take_ops[buf][i]
        _copy(part, ins[i][0] if me == 0 and mine is not None else raw[0])
        for r in range(1, self.p):
            self.reduce(target, mine if r == me and mine is not None else src[r])


class DirectBarrier(_Direct):
    """barrier: one round that carries no data. Each rank publishes the round and
    leaves once every peer published it: one write and p-1 reads of shared memory
    where a dissemination schedule sends ceil(log2 p) messages in turn, so the ranks
    leave within a look at the lines of each other (``scripts/bench_barrier.py``)."""

    def __init__(self, tp, layout, dtype, op, root, signature, epoch, names=None):
        super().__init__(tp, dtype, 0, 1, signature, epoch, names)

    def _views(self, bufs):
        return None

    def _put(self, views, i, buf):
        pass

    def _take(self, views, i, buf):
        pass
