"""Per-rank program for the signal test: rank 0 never joins an allreduce the other
ranks wait in (one of them on the progress thread), under a group timeout of two
minutes. Each rank prints "rank R waiting" first; the test then interrupts the
launcher, and every rank must be gone within 10 s."""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm  # noqa: F401

dist.init_process_group("ringcomm", timeout=timedelta(seconds=120))
rank = dist.get_rank()
print(f"rank {rank} waiting", flush=True)
if rank == 0:
    time.sleep(120)
elif rank == 1:
    dist.all_reduce(torch.ones(1000))  # inline on the caller's thread
else:
    dist.all_reduce(torch.ones(1000), async_op=True).wait()  # on the progress thread
