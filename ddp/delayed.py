"""Delayed allreduce: parameters kept out of DDP's buckets and averaged in one
allreduce of their own at the end of backward (torch's
``delay_all_reduce_named_params`` with ``param_to_hook_all_reduce``).

The use is a set of parameters whose gradients should travel together, in one
message, instead of spreading over the buckets.

Differences from torch's DDP, which launches the allreduce from a tensor hook on
``param_to_hook_all_reduce`` and never waits for it:

* the allreduce goes out at the end of backward, after the buckets, on every
  rank: a place that does not depend on when a parameter's gradient comes (on a
  rank whose graph differs, or where the hook parameter or a delayed one got no
  gradient, torch's launch moves relative to the buckets, and the ranks'
  collectives stop matching). ``param_to_hook_all_reduce`` is checked, as torch
  does, but no longer decides the moment;
* it is waited for before backward returns, so the optimizer always reads
  averaged gradients, on any backend;
* every delayed parameter gets its average as ``grad`` on every rank (zeros
  where no rank used it), so replicas stay equal;
* with mixed precision, the sum is taken in ``reduce_dtype``;
* under ``no_sync`` nothing is sent, as for the buckets.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["DelayedAllreduce"]


class DelayedAllreduce:
    """The delayed parameters' gradients, packed per dtype and averaged in one allreduce
    per dtype at the end of each synchronized backward.

    Args:
        params: the delayed parameters (those requiring gradients).
        names: their names, for messages.
        group: the process group.
        reduce_dtype: the dtype of the sum for floating gradients (None: theirs).
    """

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str],
                 group: dist.ProcessGroup, reduce_dtype: torch.dtype | None = None):
        self.params, self.names, self.group = list(params), list(names), group
        self.world_size = dist.get_world_size(group)
        self.reduce_dtype = reduce_dtype
        self._armed = False

    def arm(self) -> None:
        """The coming backward is synchronized."""
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def finish(self) -> None:
        """At the end of a synchronized backward (DDP's finalize, after the buckets):
        allreduce the delayed gradients and write their averages into ``param.grad``."""
        if not self._armed:
            return
        self._armed = False
        by_kind: dict[tuple, list[int]] = {}
        for i, p in enumerate(self.params):
            by_kind.setdefault((p.dtype, p.device), []).append(i)
        for (dtype, _), members in by_kind.items():
            kind = self.reduce_dtype if self.reduce_dtype and dtype.is_floating_point else dtype
            flat = torch.cat([(self.params[i].grad if self.params[i].grad is not None
                               else torch.zeros_like(self.params[i])).reshape(-1).to(kind)
                              for i in members])
            flat.div_(self.world_size)
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for i in members:
                p = self.params[i]
                part = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = part.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(part)
