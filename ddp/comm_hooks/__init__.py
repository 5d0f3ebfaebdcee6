"""Communication hooks: how one bucket of gradients is reduced across ranks.

A hook is a plain function ``hook(state, bucket) -> torch.futures.Future`` whose
future holds a tensor shaped like ``bucket.buffer()``: the bucket's gradients
averaged over the group. :class:`~ddp.DistributedDataParallel` calls it once per
bucket, as soon as the bucket is ready and every bucket before it has been
launched, and waits on the future at the end of backward.

Because the bucket offers ``index()``, ``buffer()``, ``gradients()``,
``parameters()`` and ``is_last()`` like torch's ``dist.GradBucket``, torch's own
hooks (``torch.distributed.algorithms.ddp_comm_hooks``) work on ``ddp`` models,
and these work on torch's DDP. The hooks here take the same states as torch's:

* :mod:`~ddp.comm_hooks.default`: ``allreduce_hook`` (what DDP runs without a
  hook), ``fp16_compress_hook``, ``bf16_compress_hook`` and ``noop_hook``; their
  state is the process group, or ``None`` for the DDP instance's;
* :mod:`~ddp.comm_hooks.powersgd`: ``powerSGD_hook`` and ``batched_powerSGD_hook``
  on torch's ``PowerSGDState``;
* :mod:`~ddp.comm_hooks.quantization`: ``quantization_pertensor_hook`` and
  ``quantization_perchannel_hook`` (uint8), on a process group;
* :mod:`~ddp.comm_hooks.local_sgd`: ``post_localSGD_hook`` on torch's
  ``PostLocalSGDState``, for ``torch.distributed.optim.PostLocalSGDOptimizer``.

Every collective of these hooks is issued on the hook's own thread (where a
second depends on the first, the hook waits for the first), so every rank issues
them in the same order on any backend, and no future callback issues or waits
for a collective.
"""
from __future__ import annotations

from ddp.comm_hooks.default import (CommHook, GradBucket, allreduce_hook, allreduce_sum,
                                    bf16_compress_hook, fp16_compress_hook, noop_hook)
from ddp.comm_hooks.local_sgd import PostLocalSGDState, post_localSGD_hook
from ddp.comm_hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from ddp.comm_hooks.quantization import (quantization_perchannel_hook,
                                         quantization_pertensor_hook)

__all__ = ["CommHook", "GradBucket", "allreduce_hook", "allreduce_sum", "fp16_compress_hook",
           "bf16_compress_hook", "noop_hook", "PowerSGDState", "powerSGD_hook",
           "batched_powerSGD_hook", "quantization_pertensor_hook",
           "quantization_perchannel_hook", "PostLocalSGDState", "post_localSGD_hook"]
