"""The bucket a hook sees, and the plain hooks: allreduce (DDP's default), float16
and bfloat16 compression, and no communication at all; and the group a state
names, which the other hook modules share."""
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["GradBucket", "CommHook", "allreduce_hook", "fp16_compress_hook",
           "bf16_compress_hook", "noop_hook"]


class GradBucket:
    """What a communication hook sees of one bucket.

    Args:
        index: the bucket's position in launch order.
        buffer: flat tensor holding the bucket's local gradients.
        gradients: per parameter, its slot in ``buffer`` shaped like the parameter.
        parameters: the bucket's parameters, in slot order.
        is_last: whether this is the last bucket of the iteration.
        process_group: the DDP instance's process group.
    """

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[torch.Tensor], is_last: bool,
                 process_group: dist.ProcessGroup):
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last
        self.process_group = process_group

    def index(self) -> int:
        """Position of this bucket in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient tensor; a hook may modify it in place."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Per parameter, a view of its gradient inside :meth:`buffer`."""
        return list(self._gradients)

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients this bucket holds, in slot order."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """True for the last bucket launched in an iteration."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the bucket's contents with ``tensor`` (same shape and dtype).

        Raises:
            ValueError: shape or dtype differ from :meth:`buffer`'s.
        """
        if tensor.shape != self._buffer.shape or tensor.dtype != self._buffer.dtype:
            raise ValueError(f"GradBucket.set_buffer: expected {tuple(self._buffer.shape)} "
                             f"{self._buffer.dtype}, got {tuple(tensor.shape)} {tensor.dtype}")
        self._buffer.copy_(tensor)

    def __repr__(self) -> str:
        return (f"<GradBucket {self._index}: {len(self._parameters)} parameters, "
                f"{self._buffer.numel()} x {self._buffer.dtype}>")


CommHook = Callable[[Any, GradBucket], torch.futures.Future]


def hook_group(state: Any, bucket: dist.GradBucket) -> dist.ProcessGroup:
    """The group a default hook's state names: itself, or for None the DDP instance's
    (torch's DDP's buckets do not carry it: then the world)."""
    if state is None:
        return getattr(bucket, "process_group", None) or dist.group.WORLD
    if not isinstance(state, dist.ProcessGroup):
        raise TypeError(f"comm hook state must be a process group or None, got "
                        f"{type(state).__name__}")
    return state


def allreduce_hook(state: dist.ProcessGroup | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group: divide by the group size, then allreduce (sum).

    Dividing first keeps large gradient sums away from the dtype's range limit.
    With no hook registered the reducer computes the same: it divides each gradient
    as it copies it into its bucket slot, then allreduces the bucket with
    :func:`allreduce_sum` (one pass less over the bucket).

    Args:
        state: process group to reduce over; ``None`` for the DDP instance's group.
        bucket: the bucket to reduce (its buffer is reduced in place).
    Returns:
        A future holding the averaged buffer.
    Raises:
        TypeError: ``state`` is neither a process group nor None.
    """
    group = hook_group(state, bucket)
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    return allreduce_sum(group, buf)


def allreduce_sum(group: dist.ProcessGroup, buf: torch.Tensor) -> torch.futures.Future:
    """Sum ``buf`` over ``group`` in place, asynchronously; the future holds ``buf``."""
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def allreduce_sum_coalesced(group: dist.ProcessGroup,
                            tensors: list[torch.Tensor]) -> torch.futures.Future:
    """Sum ``tensors`` over ``group`` in place as one collective, asynchronously."""
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True
    return group.allreduce_coalesced(tensors, opts).get_future()


def _compressed(state: Any, bucket: dist.GradBucket, dtype: torch.dtype) -> torch.futures.Future:
    group = hook_group(state, bucket)
    buf = bucket.buffer()
    # Divide in the low-precision copy, as torch does: the sum of world_size
    # gradients would overflow float16's 65504 before the division otherwise.
    compressed = buf.to(dtype).div_(dist.get_world_size(group))
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buf.copy_(fut.value()[0])
        return buf

    return work.get_future().then(decompress)


def fp16_compress_hook(state: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Like :func:`allreduce_hook`, but sends the gradients as float16 (half the bytes).

    The averaged result is cast back into the bucket's dtype. float16 keeps 11
    significant bits, so each gradient is rounded to about 1e-3 relative error;
    values below about 6e-8 / world_size flush to zero.

    Args:
        state: process group to reduce over; ``None`` for the DDP instance's group.
        bucket: the bucket to reduce.
    Returns:
        A future holding the bucket's buffer, averaged.
    Raises:
        TypeError: ``state`` is neither a process group nor None.
    """
    return _compressed(state, bucket, torch.float16)


def bf16_compress_hook(state: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Like :func:`fp16_compress_hook`, with bfloat16: float32's range, 8 significant bits
    (about 4e-3 relative error per gradient), so no overflow or flush-to-zero worries.

    Args:
        state: process group to reduce over; ``None`` for the DDP instance's group.
        bucket: the bucket to reduce.
    Returns:
        A future holding the bucket's buffer, averaged.
    Raises:
        TypeError: ``state`` is neither a process group nor None.
    """
    return _compressed(state, bucket, torch.bfloat16)


def noop_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce nothing: the future holds the bucket's local gradients as they are.

    For measuring what communication costs (a run with this hook is the
    computation alone), as torch's ``debugging_hooks.noop_hook``; training with it
    lets the replicas drift apart.
    """
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut

