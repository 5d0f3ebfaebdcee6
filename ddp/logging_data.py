"""What a DistributedDataParallel is and has done, under the names of torch's
``_get_ddp_logging_data()``."""
from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist


def logging_data(ddp: Any) -> dict[str, Any]:
    """What this DDP is and has done, under the names of torch's
    ``_get_ddp_logging_data()``: configuration, bucket sizes in bytes (first
    layout, and after the rebuild), the last iteration's gradient order and
    unused bytes, and mean times per synchronized iteration in nanoseconds.

    ``avg_backward_compute_time`` runs from the first gradient event to the end
    of backward's computation; ``avg_backward_comm_time`` from the first bucket's
    launch to the return of the last wait; their overlap is the part of
    communication before computation ended. torch samples these every 100
    iterations on CUDA; here every synchronized iteration counts.
    """
    r = ddp.reducer
    iters = r.num_synced_backwards
    t = r.timing

    def mean(total: int, n: int) -> int:
        return total // n if n else 0

    def sizes(bs: Sequence[int]) -> str:
        return ", ".join(map(str, bs))

    params = r.params
    return {
        "world_size": ddp.world_size, "rank": ddp._rank,
        "module_name": type(ddp.module).__name__,
        "backend_name": dist.get_backend(ddp.process_group),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "broadcast_buffers": int(ddp.broadcast_buffers),
        "static_graph": int(ddp.static_graph),
        "num_parameter_tensors": len(params),
        "total_parameter_size_bytes": sum(p.nbytes for p in params),
        "dtypes": ", ".join(dict.fromkeys(str(p.dtype).removeprefix("torch.")
                                          for p in params)),
        "bucket_sizes": sizes(r.initial_bucket_bytes or []),
        "has_rebuilt_buckets": int(r.rebuilt),
        "rebuilt_bucket_sizes": sizes(b.buffer.nbytes for b in r.buckets)
        if r.rebuilt else "",
        "rebuilt_per_bucket_param_indices": " | ".join(
            " ".join(map(str, b.param_indices)) for b in r.buckets) if r.rebuilt else "",
        "num_buckets_reduced": len(r.buckets),
        "iteration": iters,
        "prev_iteration_grad_ready_order_indices": sizes(r.last_ready_order),
        "unused_parameter_size": r.unused_bytes,
        "comm_hook": r.comm_hook_name,
        "avg_forward_compute_time": mean(ddp._forward_ns, ddp._forwards),
        "avg_backward_compute_time": mean(t["backward_compute"], iters),
        "avg_backward_comm_time": mean(t["backward_comm"], iters),
        "avg_backward_compute_comm_overlap_time": mean(t["overlap"], iters),
    }
