"""ddp: DistributedDataParallel re-implemented in Python, after Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 2020).

``from ddp import DistributedDataParallel as DDP`` is a drop-in for torch's DDP
(for the arguments it has). Gradients are grouped into buckets and each bucket's
allreduce starts while backward is still running; see ``docs/ddp.md``.
"""
from __future__ import annotations

from ddp import comm_hooks
from ddp.comm_hooks import GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from ddp.data_parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel", "GradBucket", "allreduce_hook", "fp16_compress_hook",
           "bf16_compress_hook", "comm_hooks"]
