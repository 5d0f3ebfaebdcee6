"""Gradient buckets: which parameters share one flat buffer and one allreduce.

Bucketing trades latency for bandwidth: one allreduce per parameter pays the
per-message latency hundreds of times, one allreduce for the whole model
cannot start before backward ends. Buckets of ``bucket_cap_mb`` are the
middle ground (paper, section 3.2.2).

The assignment is a pure function of the parameters' sizes and dtypes and of
an order, so every rank that passes the same order computes the same buckets:
the reverse registration order at construction (gradients of the last layers
become ready first), then the order rank 0 observed during the first backward
(section 3.2.3, "bucket rebuild").
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

MB = 1024 * 1024

#: torch's DDP also caps its first bucket at 1 MiB: the last layers' gradients,
#: which are ready first, go out early instead of waiting to fill a full bucket.
FIRST_BUCKET_CAP_BYTES = 1 * MB


def compute_bucket_assignment(params: Sequence[torch.Tensor], order: Sequence[int],
                              bucket_cap_bytes: int,
                              first_bucket_cap_bytes: int | None = None) -> list[list[int]]:
    """Group parameter indices into buckets, in the order their gradients should be reduced.

    Parameters are visited in ``order``; each joins the open bucket of its
    (dtype, device), which closes once it holds at least its cap (so a bucket
    exceeds the cap by at most one parameter, and a parameter larger than the cap
    gets a bucket of its own; a cap of 0 gives every parameter its own bucket, as
    ``bucket_cap_mb=0`` does in torch's DDP). The first bucket of each (dtype, device) is capped
    by ``min(first_bucket_cap_bytes, bucket_cap_bytes)``, later ones by
    ``bucket_cap_bytes``. Buckets are returned sorted by the position in
    ``order`` of their first parameter.

    Args:
        params: the parameters (only ``numel``, ``element_size``, ``dtype`` and
            ``device`` are read, so ``meta`` tensors do).
        order: a permutation of ``range(len(params))``.
        bucket_cap_bytes: size at which a bucket is closed (0: after every parameter).
        first_bucket_cap_bytes: cap of the first bucket (default
            :data:`FIRST_BUCKET_CAP_BYTES`).
    Returns:
        One list of parameter indices per bucket; within a bucket, in ``order``.
    Raises:
        ValueError: ``order`` is not a permutation of the parameter indices, or a
            cap is negative.
    """
    if bucket_cap_bytes < 0:
        raise ValueError(f"bucket cap must not be negative, got {bucket_cap_bytes} bytes")
    first = FIRST_BUCKET_CAP_BYTES if first_bucket_cap_bytes is None else first_bucket_cap_bytes
    if first < 0:
        raise ValueError(f"first bucket cap must not be negative, got {first} bytes")
    order = list(order)
    if sorted(order) != list(range(len(params))):
        raise ValueError(f"bucket order must be a permutation of 0..{len(params) - 1}, "
                         f"got {order}")
    position = {idx: pos for pos, idx in enumerate(order)}
    done: list[list[int]] = []
    open_: dict[tuple, list[int]] = {}
    filled: dict[tuple, int] = {}
    closed_any: set[tuple] = set()
    for idx in order:
        p = params[idx]
        key = (p.dtype, p.device)
        bucket = open_.setdefault(key, [])
        bucket.append(idx)
        filled[key] = filled.get(key, 0) + p.numel() * p.element_size()
        cap = bucket_cap_bytes if key in closed_any else min(first, bucket_cap_bytes)
        if filled[key] >= cap:
            done.append(open_.pop(key))
            filled[key] = 0
            closed_any.add(key)
    done.extend(open_.values())
    done.sort(key=lambda b: position[b[0]])
    return done


def reverse_order(n: int) -> list[int]:
    """The construction-time order: reverse registration, roughly when gradients get ready."""
    return list(range(n - 1, -1, -1))


def complete_order(observed: Sequence[int], n: int) -> list[int]:
    """``observed`` (indices whose gradients became ready, in that order) followed by the
    indices that never became ready, in registration order (as torch's reducer
    appends them, so unused parameters are bucketed alike).

    Raises:
        ValueError: ``observed`` repeats an index or names one outside ``range(n)``.
    """
    seen = set()
    for i in observed:
        if not 0 <= i < n or i in seen:
            raise ValueError(f"observed gradient order is not a list of distinct indices "
                             f"in 0..{n - 1}: {list(observed)}")
        seen.add(i)
    return list(observed) + [i for i in range(n) if i not in seen]


@dataclasses.dataclass
class Bucket:
    """One bucket's storage: a flat buffer and, per parameter, a view of its slot.

    Attributes:
        index: position in launch order.
        param_indices: indices (into the reducer's parameter list) of its parameters.
        buffer: the flat tensor handed to the communication hook.
        views: for each parameter, its slot in ``buffer`` shaped (and, where the
            parameter is dense, strided) like the parameter, so a gradient can live there.
    """

    index: int
    param_indices: list[int]
    buffer: torch.Tensor
    views: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def _slot_view(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A view of ``flat`` laid out like ``p``.

    AccumulateGrad gives a gradient the strides of its parameter when the parameter
    is dense (channels-last convolutions, transposed weights); a slot with the same
    strides lets it accumulate in place when the gradient lives in the bucket.
    """
    if p.is_contiguous() or p.dim() == 0:
        return flat.view(p.shape)
    if _dense_non_overlapping(p):
        return flat.as_strided(p.shape, p.stride())
    return flat.view(p.shape)


def _dense_non_overlapping(p: torch.Tensor) -> bool:
    """True when ``p``'s elements exactly tile ``numel`` consecutive storage slots."""
    dims = sorted((s, n) for s, n in zip(p.stride(), p.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def make_buckets(params: Sequence[torch.Tensor], assignment: list[list[int]],
                 dtype: torch.dtype | None = None) -> list[Bucket]:
    """Allocate zeroed buffers and slot views for ``assignment``; ``dtype``: the
    buffers' dtype for floating parameters (mixed precision's reduce dtype), else
    the parameters' own.

    Raises:
        ValueError: a bucket mixes dtypes or devices (one allreduce moves one dtype).
    """
    buckets = []
    for b, indices in enumerate(assignment):
        ps = [params[i] for i in indices]
        kinds = {(p.dtype, p.device) for p in ps}
        if len(kinds) != 1:
            raise ValueError(f"bucket {b} mixes dtypes/devices {sorted(map(str, kinds))}")
        total = sum(p.numel() for p in ps)
        kind = dtype if dtype is not None and ps[0].is_floating_point() else ps[0].dtype
        buffer = torch.zeros(total, dtype=kind, device=ps[0].device)
        views, offset = [], 0
        for p in ps:
            views.append(_slot_view(buffer[offset:offset + p.numel()], p))
            offset += p.numel()
        buckets.append(Bucket(b, list(indices), buffer, views))
    return buckets
