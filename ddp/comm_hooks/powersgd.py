"""PowerSGD gradient compression (Vogels, Karimireddy and Jaggi, NeurIPS 2019) as
DDP communication hooks, on torch's own :class:`PowerSGDState`.

A gradient matrix ``M`` (n x m) is sent as two thin factors: ``P = M Q`` (n x r),
allreduced and orthogonalized, then ``Q = M^T P`` (m x r), allreduced; the result
is ``P Q^T``. That is ``(n + m) r`` numbers on the wire instead of ``n m``. With
error feedback, what compression lost this iteration is added to the next
iteration's gradient; with warm start, the last ``Q`` starts the next power
iteration.

The state is torch's (``torch.distributed.algorithms.ddp_comm_hooks.
powerSGD_hook.PowerSGDState``): its hyperparameters, its random stream, its error
and P/Q memories and its counters mean what they mean for torch's hooks, so one
state object works with either implementation, and checkpoints of it load into
both. The arithmetic is torch's, step by step; the results equal torch's hooks' to
float rounding (tested against torch's hooks on torch's DDP).

What differs is how the collectives are issued:

* the uncompressed tensors and the P factors go in one allreduce, not two
  (torch's first allreduce has to finish before its second starts);
* every collective is issued on the hook's own thread: the hook waits for the
  first (small: compressed) allreduce, computes Q and returns the second's future.
  torch's hooks issue their later collectives from future callbacks, on whatever
  thread completes the earlier one; with several buckets on gloo those threads
  issue them in a different order on different ranks, and training hangs (the
  issue order is what matches collectives across ranks).

So an iteration of :func:`powerSGD_hook` costs two collectives in sequence, not
three, issued in the same order on every rank whatever the backend, and no
callback issues or waits for a collective.
"""
import dataclasses
import functools
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from ddp.comm_hooks.default import allreduce_hook, hook_group

__all__ = ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook", "orthogonalize"]

logger = logging.getLogger(__name__)


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalize the columns of each matrix in place: Gram-Schmidt for at most
    two columns or a half-precision dtype, QR otherwise (as torch's PowerSGD).

    Args:
        matrices: (n, r) or (batch, n, r), with r <= n.
        epsilon: added to each column's norm before dividing by it, so an all-zero
            column gives zeros, not NaNs.
    Raises:
        ValueError: not 2-D or 3-D, or more columns than rows.
    """
    shape = tuple(matrices.shape)
    if matrices.dim() == 2:
        matrices = matrices.unsqueeze(0)
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(f"orthogonalize: expected (n, r) or (batch, n, r) matrices with "
                         f"r <= n, got shape {shape}")
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrices[:, :, i:i + 1]
            col /= torch.norm(col, dim=1, keepdim=True) + epsilon
            if i + 1 < rank:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        r = torch.empty(matrices.shape[0], rank, rank, device=matrices.device,
                        dtype=matrices.dtype)
        torch.linalg.qr(matrices, out=(matrices, r))


def _check_state(state: Any, hook: str) -> None:
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"{hook}: state must be a torch.distributed.algorithms."
                        f"ddp_comm_hooks.powerSGD_hook.PowerSGDState, got "
                        f"{type(state).__name__}")


def _start(state: Any, bucket: Any, hook: str
           ) -> tuple[dist.ProcessGroup, torch.futures.Future | None]:
    """What both hooks do first: check the state; the group (the state's, else the DDP
    instance's, else the world); before ``start_powerSGD_iter``, the future of a
    plain average (None once compression is due)."""
    _check_state(state, hook)
    group = state.process_group if state.process_group is not None else hook_group(None, bucket)
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return group, allreduce_hook(group, bucket)
    return group, None


def _report(state: PowerSGDState, bucket: Any) -> None:
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info("PowerSGD compression: iteration %s, %s numbers before compression, "
                    "%s after, rate %s", state.iter, before, after, rate)
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _add_error(state: PowerSGDState, index: int, x: torch.Tensor) -> torch.Tensor | None:
    """Error feedback's first half: add last iteration's error to ``x``; a copy of the
    corrected ``x`` to subtract the result from (None without error feedback)."""
    if not state.use_error_feedback:
        return None
    if index in state.error_dict:
        x.add_(state.error_dict[index])
    else:
        state.error_dict[index] = torch.zeros_like(x)
    return x.detach().clone()


def _end(state: PowerSGDState, bucket: Any, index: int, before: torch.Tensor | None,
         after: torch.Tensor) -> None:
    """An iteration's bookkeeping once ``after`` holds the result."""
    if after.is_cuda:
        torch.cuda.synchronize(after.device)
    if before is not None:
        state.error_dict[index] = before - after
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)


@dataclasses.dataclass
class _Factors:
    """One bucket's compressed matrices and their factors (views of the state's P and
    Q memories for the bucket)."""
    #: (batch, n, m) products' left operands, each with the bucket's matrices in it
    #: (one: a view of it; several of one shape: a stacked copy)
    batches: list[tuple[torch.Tensor, list[torch.Tensor]]]
    ps: list[torch.Tensor]  # (batch, n, r) views of p_mem
    qs: list[torch.Tensor]  # (batch, m, r) views of q_mem
    p_mem: torch.Tensor
    q_mem: torch.Tensor
    fresh: bool  # the memories are new: Q is drawn at random


def _split_for_compression(state: PowerSGDState, bucket: Any
                           ) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int]:
    """Each gradient viewed as a matrix (its first dimension by the rest): those worth
    compressing (``(n + m) r * min_compression_rate < n m``), the rest as they are,
    and the lengths of the compressed ones' P and Q; the state's counters updated."""
    to_compress, plain = [], []
    p_len = q_len = 0
    for g in bucket.gradients():
        matrix = g.view(g.shape[0] if g.dim() else 1, -1)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        state.total_numel_before_compression += n * m
        if (n + m) * r * state.min_compression_rate < n * m:
            to_compress.append(matrix)
            p_len, q_len = p_len + n * r, q_len + m * r
            state.total_numel_after_compression += (n + m) * r
        else:
            plain.append(g)
            state.total_numel_after_compression += n * m
    return to_compress, plain, p_len, q_len


def _factors(state: PowerSGDState, index: int, buf: torch.Tensor,
             to_compress: list[torch.Tensor], p_len: int, q_len: int) -> _Factors:
    """The bucket's P and Q memories (new ones unless warm start has them), cut into
    each batch's factors: matrices of one shape batched with
    ``batch_tensors_with_same_shape``, shapes in first-seen order (the order torch
    draws Q's values in)."""
    fresh = not state.warm_start or index not in state.p_memory_dict
    if fresh:  # locals first: another bucket's decompress may clear the dicts meanwhile
        p_mem, q_mem = buf.new_empty(p_len), buf.new_empty(q_len)
        state.p_memory_dict[index], state.q_memory_dict[index] = p_mem, q_mem
    else:
        p_mem, q_mem = state.p_memory_dict[index], state.q_memory_dict[index]
    by_shape: dict[torch.Size, list[torch.Tensor]] = {}
    for matrix in to_compress:
        by_shape.setdefault(matrix.shape, []).append(matrix)
    f = _Factors([], [], [], p_mem, q_mem, fresh)
    p_at = q_at = 0
    for members in by_shape.values():
        groups = ([members] if state.batch_tensors_with_same_shape else
                  [[m] for m in members])
        for ms in groups:
            batch = ms[0].unsqueeze(0) if len(ms) == 1 else torch.stack(ms)
            b, n, m = batch.shape
            r = min(n, m, state.matrix_approximation_rank)
            f.batches.append((batch, ms))
            f.ps.append(p_mem[p_at:p_at + b * n * r].view(b, n, r))
            f.qs.append(q_mem[q_at:q_at + b * m * r].view(b, m, r))
            p_at, q_at = p_at + b * n * r, q_at + b * m * r
    return f


def _compress(state: PowerSGDState, f: _Factors, dtype: torch.dtype) -> None:
    """P = M Q, with Q orthogonalized: drawn from the state's random stream when the
    memories are fresh, else last iteration's (warm start)."""
    if f.fresh:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in f.qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=dtype))
                orthogonalize(q, state.orthogonalization_epsilon)
    else:
        for q in f.qs:
            orthogonalize(q, state.orthogonalization_epsilon)
    for (batch, _), q, p in zip(f.batches, f.qs, f.ps):
        torch.bmm(batch, q, out=p)


def _allreduce_plain_and_ps(group: dist.ProcessGroup, world: int,
                            plain: list[torch.Tensor], f: _Factors, p_len: int) -> None:
    """The first allreduce, waited for: the uncompressed tensors (averaged back into
    the bucket) and every P (summed into the P memory), in one message."""
    sizes = [g.numel() for g in plain]
    packed = torch.cat([g.reshape(-1) for g in plain] + [f.p_mem])
    dist.all_reduce(packed, group=group)
    parts = packed.split(sizes + [p_len])
    for g, part in zip(plain, parts):
        g.copy_(part.view_as(g).div_(world))
    f.p_mem.copy_(parts[-1])


def _compute_qs(state: PowerSGDState, f: _Factors) -> None:
    """Orthogonalize the summed P; Q = M^T P."""
    for p in f.ps:
        orthogonalize(p, state.orthogonalization_epsilon)
    for (batch, _), p, q in zip(f.batches, f.ps, f.qs):
        torch.bmm(batch.transpose(1, 2), p, out=q)


def _decompress(state: PowerSGDState, bucket: Any, index: int, buf: torch.Tensor,
                before: torch.Tensor | None, world: int, f: _Factors,
                fut: torch.futures.Future) -> torch.Tensor:
    """Once the second allreduce (of Q) is done: M = P Q^T / world into the bucket's
    matrices, and the iteration's bookkeeping; the bucket's buffer ``buf``."""
    fut.value()  # raises the collective's error, if any
    f.q_mem.div_(world)
    for (batch, members), p, q in zip(f.batches, f.ps, f.qs):
        torch.bmm(p, q.transpose(1, 2), out=batch)
        if len(members) > 1:  # a stacked copy: back into the bucket
            for i, matrix in enumerate(members):
                matrix.copy_(batch[i])
    _end(state, bucket, index, before, buf)
    return buf


def powerSGD_hook(state: PowerSGDState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress each gradient matrix of the bucket to rank
    ``state.matrix_approximation_rank`` (PowerSGD, one power iteration).

    Before ``state.start_powerSGD_iter`` iterations it averages with a plain
    allreduce. After that, each parameter's gradient is viewed as a matrix (its first
    dimension by the rest) and compressed where ``(n + m) r * min_compression_rate <
    n m``; the rest (biases, small layers) are averaged uncompressed. With
    ``batch_tensors_with_same_shape``, matrices of one shape are multiplied as one
    batch.

    Args:
        state: torch's ``PowerSGDState``. Its ``process_group`` None means the DDP
            instance's group (torch's hook takes the world).
        bucket: the bucket to reduce; its buffer receives the result.
    Returns:
        A future holding the bucket's buffer, averaged and decompressed.
    Raises:
        TypeError: ``state`` is not a ``PowerSGDState``.
    """
    group, plain_average = _start(state, bucket, "powerSGD_hook")
    if plain_average is not None:
        return plain_average
    world, buf, index = group.size(), bucket.buffer(), bucket.index()
    before = _add_error(state, index, buf)
    to_compress, plain, p_len, q_len = _split_for_compression(state, bucket)
    _report(state, bucket)
    f = _factors(state, index, buf, to_compress, p_len, q_len)
    _compress(state, f, buf.dtype)
    _allreduce_plain_and_ps(group, world, plain, f, p_len)
    _compute_qs(state, f)
    second = dist.all_reduce(f.q_mem, group=group, async_op=True).get_future()
    return second.then(functools.partial(_decompress, state, bucket, index, buf, before,
                                         world, f))


def batched_powerSGD_hook(state: PowerSGDState,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress the whole bucket as one square matrix (its buffer, zero-padded to
    ``ceil(sqrt(n))`` squared): fewer, larger products than :func:`powerSGD_hook`,
    but less accurate above rank 1, since the square cuts across parameters.

    Before ``state.start_powerSGD_iter`` iterations it averages with a plain
    allreduce. The bucket's buffer is not resized: the padded matrix is a separate
    tensor. torch 2.13's own ``batched_powerSGD_hook`` fails at its first
    compressed iteration (it hands its orthogonalization a 2-D matrix); this one
    computes what it would, and takes ``state.orthogonalization_epsilon`` into
    account, which torch's ignores here.

    Args:
        state: torch's ``PowerSGDState`` (``batch_tensors_with_same_shape`` does
            not apply).
        bucket: the bucket to reduce; its buffer receives the result.
    Returns:
        A future holding the bucket's buffer, averaged and decompressed.
    Raises:
        TypeError: ``state`` is not a ``PowerSGDState``.
        ValueError: the rank is larger than the padded matrix's side.
    """
    group, plain_average = _start(state, bucket, "batched_powerSGD_hook")
    if plain_average is not None:
        return plain_average
    world, buf = group.size(), bucket.buffer()
    n = buf.numel()
    side = math.ceil(math.sqrt(n))
    rank = state.matrix_approximation_rank
    if rank > side:
        raise ValueError(f"batched_powerSGD_hook: matrix_approximation_rank {rank} is "
                         f"larger than bucket {bucket.index()}'s {side} x {side} matrix")
    state.total_numel_before_compression += n
    state.total_numel_after_compression += side * rank * 2
    _report(state, bucket)
    index = bucket.index()
    padded = buf.new_zeros(side * side)
    padded[:n].copy_(buf)
    before = _add_error(state, index, padded)
    matrix = padded.view(side, side)

    if not state.warm_start or index not in state.p_memory_dict:
        p = buf.new_empty(side, rank)  # locals first, as in powerSGD_hook
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            q = torch.randn(side, rank, device="cpu", dtype=buf.dtype).to(buf.device)
        state.p_memory_dict[index], state.q_memory_dict[index] = p, q
    else:
        p, q = state.p_memory_dict[index], state.q_memory_dict[index]
    eps = state.orthogonalization_epsilon
    orthogonalize(q, eps)
    torch.matmul(matrix, q, out=p)
    dist.all_reduce(p, group=group)
    orthogonalize(p, eps)
    torch.matmul(matrix.t(), p, out=q)
    second = dist.all_reduce(q, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()
        q.div_(world)
        torch.matmul(p, q.t(), out=matrix)
        buf.copy_(padded[:n])
        _end(state, bucket, index, before, padded)
        return buf

    return second.then(decompress)
