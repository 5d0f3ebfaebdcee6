"""Ring algorithms: reduce-scatter, allgather, and allreduce as the two in a row.

Every rank sends to its right neighbour and receives from its left one, so
each link carries (p-1)/p of the data once per phase: bandwidth-optimal, with
latency growing with p. Chunks are cut into segments and each received
segment is reduced and forwarded on its own, so sending segment k+1 overlaps
reducing segment k.
"""
from __future__ import annotations

import torch

from ..transport import Transport
from .common import WINDOW, chain, seg_elems, segments, split_even
from .tree import broadcast_from_root


def reduce_scatter(tp: Transport, chunks: list[torch.Tensor], op, *, segment_bytes: int) -> None:
    """Ring reduce-scatter over 1-D contiguous ``chunks`` (one per rank, same dtype,
    any lengths as long as every rank passes the same lengths).

    On return ``chunks[rank]`` holds the reduction of every rank's ``chunks[rank]``;
    the other chunks hold partial results.
    """
    p, r = tp.size, tp.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    seg = seg_elems(segment_bytes, chunks[r].dtype)
    # Step s sends chunk r-s-1 and receives chunk r-s-2 (mod p), reducing it; the last
    # step receives chunk r, which is then complete.
    incoming = [(dst, s) for s in range(p - 1) for dst in segments(chunks[(r - s - 2) % p], seg)]
    sends = [tp.isend(v, right) for v in segments(chunks[(r - 1) % p], seg)]
    window = min(WINDOW, len(incoming))
    if window:
        space = tp.scratch(0, window * seg, chunks[r].dtype)

    def post(i: int):
        slot = (i % window) * seg
        return tp.irecv(space[slot:slot + incoming[i][0].numel()], left)

    pending = [post(i) for i in range(window)]
    for i, (dst, s) in enumerate(incoming):
        h = pending[i % window]
        tp.wait(h)
        tp.reduce_(dst, h.buf, op)
        if i + window < len(incoming):
            pending[i % window] = post(i + window)
        if s < p - 2:  # forward the partial sum: it is what step s+1 sends
            sends.append(tp.isend(dst, right))
    tp.wait_all(sends)


def allgather(tp: Transport, chunks: list[torch.Tensor], *, segment_bytes: int) -> None:
    """Ring allgather: ``chunks[rank]`` holds this rank's block; on return every
    ``chunks[i]`` holds rank i's block. Chunks may differ in length (same on all ranks)."""
    p, r = tp.size, tp.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    seg = seg_elems(segment_bytes, chunks[r].dtype)
    # Step s sends chunk r-s and receives chunk r-s-1 straight into place.
    incoming = [(v, s) for s in range(p - 1) for v in segments(chunks[(r - s - 1) % p], seg)]
    recvs = [tp.irecv(v, left) for v, _ in incoming]
    sends = [tp.isend(v, right) for v in segments(chunks[r], seg)]
    for h, (v, s) in zip(recvs, incoming):
        tp.wait(h)
        if s < p - 2:
            sends.append(tp.isend(v, right))
    tp.wait_all(sends)


def allreduce(tp: Transport, buf: torch.Tensor, op, *, segment_bytes: int) -> None:
    """Ring allreduce of 1-D ``buf``: reduce-scatter, then allgather, over p chunks."""
    if tp.size == 1:
        return
    chunks = split_even(buf, tp.size)
    reduce_scatter(tp, chunks, op, segment_bytes=segment_bytes)
    allgather(tp, chunks, segment_bytes=segment_bytes)


def broadcast(tp: Transport, buf: torch.Tensor, root: int, *, segment_bytes: int) -> None:
    """Pipelined broadcast along the ring from ``root``: every rank receives and
    forwards each segment once, so large messages move at link bandwidth."""
    if tp.size > 1:
        broadcast_from_root(tp, buf, root, segment_bytes, topology=chain)
