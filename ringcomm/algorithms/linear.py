"""Direct (linear) algorithms: every rank talks to every other rank at once.

For gather, scatter and all-to-all the data itself is personal, so each byte
crosses one link once whatever the schedule; posting every message at once lets
the transport move them concurrently. Latency grows with p at the root of
gather/scatter.
"""
from __future__ import annotations

import torch

from ..transport import Transport


def gather(tp: Transport, send: torch.Tensor, chunks: list[torch.Tensor] | None, root: int,
           *, segment_bytes: int = 0) -> None:
    """Rank i's ``send`` lands in ``chunks[i]`` on ``root`` (which fills ``chunks[root]``
    itself); ``chunks`` is None on other ranks."""
    if tp.rank != root:
        tp.send(send, root)
        return
    tp.wait_all([tp.irecv(c, i) for i, c in enumerate(chunks) if i != root])


def scatter(tp: Transport, chunks: list[torch.Tensor] | None, recv: torch.Tensor, root: int,
            *, segment_bytes: int = 0) -> None:
    """``chunks[i]`` of ``root`` lands in ``recv`` of rank i (root copies its own)."""
    if tp.rank != root:
        tp.recv(recv, root)
        return
    tp.wait_all([tp.isend(c, i) for i, c in enumerate(chunks) if i != root])


def alltoall(tp: Transport, sends: list[torch.Tensor], recvs: list[torch.Tensor],
             *, segment_bytes: int = 0) -> None:
    """``sends[j]`` of rank i lands in ``recvs[i]`` of rank j. Messages go in order of
    distance (r+1, r+2, ...) so ranks do not all hit the same peer first. Empty
    chunks still send an empty message: a size mismatch then fails loudly."""
    p, r = tp.size, tp.rank
    recvs[r].copy_(sends[r])
    handles = []
    for s in range(1, p):
        handles.append(tp.irecv(recvs[(r - s) % p], (r - s) % p))
        handles.append(tp.isend(sends[(r + s) % p], (r + s) % p))
    tp.wait_all(handles)
