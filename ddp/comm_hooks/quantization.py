"""8-bit quantization hooks: each rank sends its gradients as uint8 with an affine
scale and zero point, and every rank dequantizes and averages what all sent.

The quantization is torch's (``torch.distributed.algorithms.ddp_comm_hooks.
quantization_hooks``): min/max observers from ``torch.ao.quantization``, values
rounded to ``round(x / scale) + zero_point`` and clamped to 0..255, and the results
equal torch's hooks' (tested against them on torch's DDP). The messages differ:

* a rank's scale and zero point travel with its bytes in one all-gather, where
  torch gathers them first and the bytes second, from the first's callback;
* the per-channel hook quantizes all channels at once, not one by one, and pads
  the buffer to a whole number of channels only when it is not one already.

A quarter of float32's bytes go on the wire, but as an all-gather: each rank
receives ``world_size`` quantized copies, so this pays off against an allreduce
only on small groups.
"""
import torch
import torch.distributed as dist
from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver

from ddp.comm_hooks.default import hook_group

__all__ = ["quantization_pertensor_hook", "quantization_perchannel_hook"]


def _quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(x / scale) + zero, 0, 255).to(torch.uint8)


def _exchange(group: dist.ProcessGroup, params: torch.Tensor, q: torch.Tensor,
              finish) -> torch.futures.Future:
    """All-gather each rank's float32 ``params`` and uint8 ``q`` as one message;
    the future holds ``finish([(params, q) of each rank, in rank order])``."""
    head = params.numel() * 4
    mine = torch.cat([params.reshape(-1).view(torch.uint8), q.reshape(-1)])
    world = group.size()
    everyone = mine.new_empty(world * mine.numel())
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(everyone, mine, group=group, async_op=True)

    def unpack(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # raises the collective's error, if any
        ranks = everyone.view(world, -1)
        # a copy: a rank's parameters start at any byte, a float32 view needs four
        return finish([(ranks[r, :head].clone().view(torch.float32).view_as(params),
                        ranks[r, head:].view_as(q)) for r in range(world)])

    return work.get_future().then(unpack)


def quantization_pertensor_hook(process_group: dist.ProcessGroup | None,
                                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket sent as uint8, one scale and zero point for the whole bucket.

    Args:
        process_group: the group to reduce over; ``None`` for the DDP instance's.
        bucket: the bucket to reduce.
    Returns:
        A future holding the average of every rank's dequantized gradients
        (float32, as torch's hook; DDP copies it into the bucket).
    Raises:
        TypeError: ``process_group`` is neither a process group nor None.
    """
    group = hook_group(process_group, bucket)
    buf = bucket.buffer()
    observer = MinMaxObserver().to(buf.device)
    observer(buf)
    scale, zero = observer.calculate_qparams()
    params = torch.cat([scale.reshape(1).float(), zero.reshape(1).float()]).to(buf.device)
    q = _quantize(buf, params[0], params[1])

    def average(ranks: list) -> torch.Tensor:
        total = torch.zeros(buf.shape, device=buf.device, dtype=torch.float32)
        for p, qr in ranks:
            total += p[0] * (qr.to(torch.float32) - p[1])
        return total / len(ranks)

    return _exchange(group, params, q, average)


def quantization_perchannel_hook(process_group: dist.ProcessGroup | None,
                                 bucket: dist.GradBucket, bucket_size: int = 512
                                 ) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket sent as uint8, with a scale and zero point for each run of
    ``bucket_size`` values (a channel): finer than per tensor where gradients'
    magnitudes vary along the bucket.

    Args:
        process_group: the group to reduce over; ``None`` for the DDP instance's.
        bucket: the bucket to reduce.
        bucket_size: values per channel.
    Returns:
        A future holding the average of every rank's dequantized gradients (float32).
    Raises:
        TypeError: ``process_group`` is neither a process group nor None.
        ValueError: ``bucket_size`` is not a positive integer.
    """
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"quantization_perchannel_hook: bucket_size must be a positive "
                         f"integer, got {bucket_size!r}")
    group = hook_group(process_group, bucket)
    buf = bucket.buffer()
    n = buf.numel()
    channels = buf.new_zeros(-(-n // bucket_size) * bucket_size)
    channels[:n].copy_(buf)
    channels = channels.view(-1, bucket_size)
    observer = PerChannelMinMaxObserver().to(buf.device)
    observer(channels)
    scale, zero = observer.calculate_qparams()
    params = torch.stack((scale.float(), zero.float())).to(buf.device)
    q = _quantize(channels, params[0].unsqueeze(1), params[1].unsqueeze(1))

    def average(ranks: list) -> torch.Tensor:
        total = torch.zeros(channels.shape, device=buf.device, dtype=torch.float32)
        for p, qr in ranks:
            total += p[0].unsqueeze(1) * (qr.to(torch.float32) - p[1].unsqueeze(1))
        return total.flatten()[:n] / len(ranks)

    return _exchange(group, params, q, average)
