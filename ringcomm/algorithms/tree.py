"""Tree algorithms: pipelined reduce and broadcast over a tree, and allreduce
as reduce-to-root followed by broadcast.

Latency grows with the tree depth (log2 p for the binomial tree), so trees
win for small messages; the buffer is cut into segments so large messages
stream through the tree instead of waiting at every level.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..transport import Transport
from .common import WINDOW, binomial, seg_elems, segments

Topology = Callable[[int, int, int], "tuple[int | None, list[int]]"]


def reduce_to_root(tp: Transport, buf: torch.Tensor, op, root: int, segment_bytes: int,
                   topology: Topology = binomial) -> None:
    """Reduce 1-D ``buf`` of every rank into ``buf`` on ``root``, segment by segment.

    On other ranks ``buf`` is left holding a partial reduction.
    """
    parent, kids = topology(tp.rank, tp.size, root)
    views = segments(buf, seg_elems(segment_bytes, buf.dtype))
    if not views:
        return
    seg = views[0].numel()
    window = min(WINDOW, len(views))
    spaces = [tp.scratch(ci, window * seg, buf.dtype) for ci in range(len(kids))]

    def post(ci: int, k: int):
        slot = (k % window) * seg
        return tp.irecv(spaces[ci][slot:slot + views[k].numel()], kids[ci])

    pending = [[post(ci, k) for k in range(window)] for ci in range(len(kids))]
    sends = []
    for k, dst in enumerate(views):
        for ci in range(len(kids)):
            h = pending[ci][k % window]
            tp.wait(h)
            tp.reduce_(dst, h.buf, op)
            if k + window < len(views):
                pending[ci][k % window] = post(ci, k + window)
        if parent is not None:
            sends.append(tp.isend(dst, parent))
    tp.wait_all(sends)


def broadcast_from_root(tp: Transport, buf: torch.Tensor, root: int, segment_bytes: int,
                        topology: Topology = binomial) -> None:
    """Copy 1-D ``buf`` of ``root`` into ``buf`` of every rank, forwarding each
    segment down the tree as soon as it arrives."""
    parent, kids = topology(tp.rank, tp.size, root)
    views = segments(buf, seg_elems(segment_bytes, buf.dtype))
    recvs = [tp.irecv(v, parent) for v in views] if parent is not None else None
    sends = []
    for k, v in enumerate(views):
        if recvs is not None:
            tp.wait(recvs[k])
        for kid in kids:
            sends.append(tp.isend(v, kid))
    tp.wait_all(sends)


def allreduce(tp: Transport, buf: torch.Tensor, op, *, segment_bytes: int) -> None:
    """Binomial-tree allreduce: reduce to rank 0, then broadcast from it."""
    if tp.size == 1:
        return
    reduce_to_root(tp, buf, op, 0, segment_bytes)
    broadcast_from_root(tp, buf, 0, segment_bytes)


def broadcast(tp: Transport, buf: torch.Tensor, root: int, *, segment_bytes: int) -> None:
    """Binomial-tree broadcast, pipelined in segments."""
    if tp.size > 1:
        broadcast_from_root(tp, buf, root, segment_bytes)


def reduce(tp: Transport, buf: torch.Tensor, op, root: int, *, segment_bytes: int) -> None:
    """Binomial-tree reduce to ``root``, pipelined in segments."""
    if tp.size > 1:
        reduce_to_root(tp, buf, op, root, segment_bytes)
