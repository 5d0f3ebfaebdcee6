"""``shm_direct``: the shared-memory transport's own allreduce, for groups whose
ranks all share one host (DeepSpeed's small-message algorithm, in ringcomm's terms).

Each rank's segment holds a *window* of two buffers of ``RINGCOMM_SHM_DIRECT_BYTES``
and, beside each, a line of three words: the round it holds, and the signature and
epoch of the call that wrote it. A round of a call:

1. copy this rank's part of the data into buffer ``k % 2`` of its own window;
2. write the signature and epoch, fence, write the round number ``k`` (publish);
3. wait until every peer's line for buffer ``k % 2`` says round ``k``, checking that
   its signature and epoch are this call's (else: the ranks run different calls);
4. fence, then reduce every rank's buffer into the caller's tensor, in rank order
   (rank 0's first: every rank computes the same bits, as the schedules do).

A message longer than a buffer takes several rounds. There is no trailing wait: a
rank writes buffer ``k % 2`` again only in round ``k + 2``, after it saw every peer
publish round ``k + 1``, which each did only once it had read round ``k``. So each
byte moves once into shared memory and is read from there by every rank: against a
schedule's exchange, no request machinery, no FIFO and, below
``RINGCOMM_SHM_MIN_BYTES``, no MPI message. It moves ``n`` bytes per rank and reduces
``(p - 1) n``: for small messages and few ranks (``auto`` picks it where the
measured table says it wins).

Waits are the transport's (:meth:`ringcomm.transport.shm.ShmTransport.direct_wait`):
the collective's deadline, backing off to sleeps, dead or failed peers, and a peer
found in another collective. A failed round leaves the windows out of step, so the
transport refuses later collectives.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ringcomm import ops

_copy = ops.serial_copy
#: looks at the peers' lines before the transport's wait takes over
_SPINS = 1000


class DirectAllreduce:
    """The program (``run(bufs)``, ``close()``) of one allreduce shape over ``tp``'s
    window (:class:`ringcomm.transport.shm.Window`): ``layout`` is ``(numel,)``."""

    def __init__(self, tp: Any, layout: tuple, dtype: torch.dtype, op: Any,
                 signature: tuple[int, str], epoch: int, names: Any = None):
        self.tp, self.window = tp, tp.direct
        self.dtype = dtype
        self.nbytes = layout[0] * dtype.itemsize
        self.signature, self.epoch, self._names = signature, epoch, names
        step = self.window.nbytes - self.window.nbytes % dtype.itemsize
        # at least one round: a call of no elements still meets its peers (a size
        # mismatch with it shows)
        self.spans = [(a, min(a + step, self.nbytes)) for a in range(0, max(self.nbytes, 1), step)]
        self.reduce = ops.serial_reducer(op, dtype)
        self.reduce_after = ops.serial_reducer(op, dtype, src_first=True)
        # per buffer, per span: every rank's part in its window, as operands
        self.sources = [[[ops.operand(v[:b - a], dtype) for v in self.window.buffers(buf)]
                         for a, b in self.spans] for buf in (0, 1)]
        self.raw = [[[v[:b - a] for v in self.window.buffers(buf)] for a, b in self.spans]
                    for buf in (0, 1)]
        self._bound: tuple | None = None  # (address, raw parts, operands) of the last tensor
        self.peer_words = [w for r, w in enumerate(self.window.words) if r != tp.rank]
        self.own_words = self.window.words[tp.rank]
        # every rank folds in rank order, (((b0 op b1) op b2) ...): the same bits everywhere
        self._fold = (self._fold_first, self._fold_second)[tp.rank] if tp.rank < 2 \
            else self._fold_later

    def _bind(self, t: torch.Tensor) -> tuple:
        ptr = t.data_ptr()
        bound = self._bound
        if bound is None or bound[0] != ptr:
            mem = ops.memory(ptr, self.nbytes)
            parts = [mem[a:b] for a, b in self.spans]
            bound = self._bound = (ptr, parts, [ops.operand(p, self.dtype) for p in parts])
        return bound

    def run(self, bufs: Sequence[torch.Tensor]) -> None:
        _, parts, targets = self._bind(bufs[0])
        tp, me = self.tp, self.tp.rank
        sig, epoch, fence, peer_words = self.signature[0], self.epoch, tp.fence, self.peer_words
        own, lines = self.own_words, self.window.lines
        try:
            for i in range(len(parts)):
                if tp._broken is not None:
                    raise RuntimeError(tp._broken)
                k = tp.rounds + 1
                buf = k & 1
                line = lines[buf]
                raw = self.raw[buf][i]
                part = parts[i]
                if part.size:
                    _copy(raw[me], part)
                # publish: data, signature and epoch, fence, round
                own[line + 1] = sig
                own[line + 2] = epoch
                fence()
                own[line] = k
                # the peers are usually a few microseconds away: look at their lines in
                # a tight loop first (the transport's wait, with its deadline, probes
                # and sleeps, takes over after _SPINS looks)
                for _ in range(_SPINS):
                    for w in peer_words:
                        if w[line] != k:
                            break
                    else:
                        fence()  # the rounds before the signatures and data they publish
                        for w in peer_words:
                            if w[line + 1] != sig or w[line + 2] != epoch:
                                tp.direct_wait(k, sig, epoch, self._describe)  # raises it
                        break
                else:
                    tp.direct_wait(k, sig, epoch, self._describe)
                self._fold(targets[i], part, raw, self.sources[buf][i])
                tp.rounds = k
        except BaseException as e:
            tp.direct_failed(e)
            raise

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

    def _describe(self, sig: int) -> str:
        """The call of signature hash ``sig``, as this rank knows it."""
        if sig == self.signature[0]:
            return self.signature[1]
        named = self._names(sig, 32) if self._names is not None else None
        return named or "a call of another shape or collective"

    def close(self) -> None:
        self._bound = None

