"""The replicas start as one model: every rank checks that it wraps the same
parameters and buffers (one small all_gather of fingerprints, the first difference
named on every rank), then takes a rank's values in flat chunks."""
from __future__ import annotations

import hashlib
import json
from typing import Sequence

import torch
import torch.distributed as dist

from ddp.buckets import MB

__all__ = ["describe_mismatch", "verify_same_model", "broadcast_coalesced", "common_rank",
           "BROADCAST_CHUNK_BYTES"]

#: Parameters and buffers are broadcast in flat chunks of at most this many bytes:
#: one collective per chunk instead of one per tensor, bounded extra memory.
BROADCAST_CHUNK_BYTES = 64 * MB

# One entry of a model description: kind ("parameter"/"buffer"), name, shape,
# dtype and requires_grad. Everything but the name must agree across ranks.
Entry = tuple[str, str, list[int], str, bool]


def _entries(named_params: Sequence[tuple[str, torch.Tensor]],
             named_buffers: Sequence[tuple[str, torch.Tensor]]) -> list[Entry]:
    out: list[Entry] = []
    for kind, named in (("parameter", named_params), ("buffer", named_buffers)):
        for name, t in named:
            out.append((kind, name, list(t.shape), str(t.dtype),
                        bool(t.requires_grad) if kind == "parameter" else False))
    return out


def _key(e: Entry | None) -> tuple | None:
    return None if e is None else (e[0], tuple(e[2]), e[3], e[4])


def _fmt(e: Entry | None) -> str:
    if e is None:
        return "nothing there"
    kind, name, shape, dtype, rg = e
    extra = "" if kind == "buffer" else f", requires_grad={rg}"
    return f"{kind} '{name}' of shape {tuple(shape)}, dtype {dtype}{extra}"


def describe_mismatch(per_rank: Sequence[Sequence[Entry]]) -> str | None:
    """Name the first parameter or buffer whose shape, dtype or requires_grad differs.

    Args:
        per_rank: each rank's model description (parameters in registration order,
            then buffers; lists where JSON turned tuples into lists are fine).
    Returns:
        A message naming the position, each rank's entry there and which ranks
        hold which, or None when all ranks agree.
    """
    ranks = [[tuple(e) for e in entries] for entries in per_rank]
    longest = max(len(e) for e in ranks)
    for pos in range(longest):
        at = [e[pos] if pos < len(e) else None for e in ranks]
        keys = [_key(a) for a in at]
        if len(set(keys)) == 1:
            continue
        holders: dict[tuple | None, list[int]] = {}
        for r, k in enumerate(keys):
            holders.setdefault(k, []).append(r)
        parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: "
                 f"{_fmt(at[rs[0]])}" for rs in holders.values()]
        first = next(r for r, a in enumerate(at) if a is not None)
        kind, name = at[first][0], at[first][1]
        kind_pos = sum(1 for e in ranks[first][:pos] if e[0] == kind)
        msg = (f"the wrapped model differs across ranks at {kind} #{kind_pos} ('{name}'): "
               + "; ".join(parts))
        counts = [(sum(e[0] == "parameter" for e in r), sum(e[0] == "buffer" for e in r))
                  for r in ranks]
        if len(set(counts)) > 1:
            msg += " (numbers differ: " + "; ".join(
                f"rank {r}: {p} parameters, {b} buffers" for r, (p, b) in enumerate(counts)) + ")"
        return msg + (". Every rank must wrap the same model: the same parameters and "
                      "buffers with the same shapes, dtypes and requires_grad, in the same order.")
    return None


def _gather(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def verify_same_model(named_params: Sequence[tuple[str, torch.Tensor]],
                      named_buffers: Sequence[tuple[str, torch.Tensor]],
                      group: dist.ProcessGroup, device: torch.device) -> None:
    """Check, with one small all_gather, that every rank has the same parameters and buffers.

    Each rank sends a fixed-size fingerprint (counts and a digest of shapes, dtypes
    and requires_grad). Only when fingerprints differ do ranks exchange their full
    descriptions, so every rank can name the first mismatch and all raise the same
    error: no rank goes on to a broadcast the others will never join.

    Args:
        named_params: (name, parameter) in registration order.
        named_buffers: (name, buffer) in registration order.
        group: the group whose ranks must agree.
        device: where the exchanged tensors live (one the group's backend supports).
    Raises:
        RuntimeError: on every rank, when the descriptions differ.
    """
    entries = _entries(named_params, named_buffers)
    blob = json.dumps([_key(e) for e in entries]).encode()
    digest = int.from_bytes(hashlib.sha256(blob).digest()[:8], "little", signed=True)
    n_params = len(named_params)
    mine = torch.tensor([n_params, len(entries) - n_params, digest], dtype=torch.int64,
                        device=device)
    rows = _gather(mine, group)
    if all(torch.equal(r, rows[0]) for r in rows):
        return
    payload = json.dumps(entries).encode()
    sizes = _gather(torch.tensor([len(payload)], dtype=torch.int64, device=device), group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    blobs = _gather(buf.to(device), group)
    per_rank = [json.loads(bytes(b[:int(s.item())].cpu().numpy()))
                for b, s in zip(blobs, sizes)]
    msg = describe_mismatch(per_rank) or "the fingerprints of the model differ across ranks"
    raise RuntimeError(f"DistributedDataParallel (rank {dist.get_rank(group)} of "
                       f"{dist.get_world_size(group)}): {msg}")


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup,
                        chunk_bytes: int = BROADCAST_CHUNK_BYTES, src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with group rank ``src``'s values, in flat chunks.

    Tensors are grouped by dtype and device (one collective moves one dtype) and
    packed into chunks of at most ``chunk_bytes`` (a larger tensor travels alone).
    Every rank of ``group`` must call it with tensors of the same shapes and dtypes.

    Args:
        tensors: written in place (call under ``torch.no_grad()`` for parameters).
        group: the group.
        chunk_bytes: upper bound on one broadcast's size.
        src: the group rank whose values everyone gets.
    """
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    root = dist.get_rank(group) == src
    for ts in by_kind.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in ts + [None]:
            nbytes = 0 if t is None else t.numel() * t.element_size()
            if chunk and (t is None or size + nbytes > chunk_bytes):
                flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                dist.broadcast(flat, group=group, group_src=src)
                if not root:
                    offset = 0
                    for c in chunk:
                        c.detach().copy_(flat[offset:offset + c.numel()].view(c.shape))
                        offset += c.numel()
                chunk, size = [], 0
            if t is not None:
                chunk.append(t)
                size += nbytes


def common_rank(mine: int | None, group: dist.ProcessGroup, device: torch.device) -> int:
    """The largest group rank among those that offer themselves (``mine`` not None); a
    collective: every rank calls it."""
    t = torch.tensor([-1 if mine is None else mine], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
