"""Dissemination barrier: ceil(log2 p) rounds of empty messages, no root."""
from __future__ import annotations

import torch

from ..transport import Transport


def dissemination(tp: Transport, **_) -> None:
    """Returns on every rank only after every rank has entered."""
    p, r = tp.size, tp.rank
    token = torch.empty(0, dtype=torch.uint8, device=tp.device)
    sink = torch.empty(0, dtype=torch.uint8, device=tp.device)
    dist = 1
    while dist < p:
        tp.sendrecv(token, (r + dist) % p, sink, (r - dist) % p)
        dist <<= 1
