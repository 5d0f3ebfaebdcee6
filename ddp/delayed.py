"""Delayed allreduce: parameters kept out of DDP's buckets, averaged in one
allreduce of their own once a chosen parameter's gradient is ready (torch's
``delay_all_reduce_named_params`` with ``param_to_hook_all_reduce``).

The use is a model whose early layers' gradients come last: pointing the hook at
the first layer's weight sends the delayed parameters together at the end of
backward, in one message, instead of spreading them over the buckets.

Differences from torch's DDP, which launches the allreduce from a tensor hook and
never waits for it:

* the allreduce is waited for before backward returns (at DDP's finalize), so the
  optimizer always reads averaged gradients, on any backend;
* a delayed parameter whose gradient arrives after the hook parameter's would
  miss the allreduce (torch averages a partial buffer silently): backward raises,
  naming it and saying which parameter to hook instead;
* under ``no_sync`` nothing is sent, as for the buckets.
"""
from __future__ import annotations

import functools
import weakref
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["DelayedAllreduce"]


def _on_ready(ref: "weakref.ref[DelayedAllreduce]", index: int, param: torch.Tensor) -> None:
    me = ref()
    if me is not None:
        me._ready(index, param)


def _on_hook_param(ref: "weakref.ref[DelayedAllreduce]", param: torch.Tensor) -> None:
    me = ref()
    if me is not None:
        me.launch()


class DelayedAllreduce:
    """The delayed parameters' gradients, packed per dtype and averaged in one allreduce
    per dtype.

    Args:
        params: the delayed parameters (those requiring gradients).
        names: their names, for messages.
        hook_param: the parameter whose accumulated gradient starts the allreduce.
        group: the process group.
    """

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str],
                 hook_param: torch.Tensor, group: dist.ProcessGroup):
        self.params, self.names, self.group = list(params), list(names), group
        self.world_size = dist.get_world_size(group)
        self._armed = False
        self._launched = False
        self._late: list[str] = []
        self._got = [False] * len(self.params)
        self._works: list[tuple] = []
        ref = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(_on_ready, ref, i))
                         for i, p in enumerate(self.params)]
        self._handles.append(hook_param.register_post_accumulate_grad_hook(
            functools.partial(_on_hook_param, ref)))
        weakref.finalize(self, lambda hs: [h.remove() for h in hs], self._handles)

    def arm(self) -> None:
        """The coming backward is synchronized."""
        self._armed, self._launched, self._late = True, False, []
        self._got = [False] * len(self.params)
        self._works = []

    def disarm(self) -> None:
        self._armed = False

    def _ready(self, i: int, param: torch.Tensor) -> None:
        if not self._armed:
            return
        self._got[i] = True
        if self._launched:
            self._late.append(self.names[i])

    def launch(self) -> None:
        """Pack and start the allreduces (once per backward; from the hook parameter's
        gradient, or at finalize when it got none)."""
        if not self._armed or self._launched:
            return
        self._launched = True
        by_dtype: dict[tuple, list[int]] = {}
        for i, p in enumerate(self.params):
            by_dtype.setdefault((p.dtype, p.device), []).append(i)
        for (dtype, device), members in by_dtype.items():
            flat = torch.cat([(self.params[i].grad if self.params[i].grad is not None
                               else torch.zeros_like(self.params[i])).reshape(-1)
                              for i in members])
            flat.div_(self.world_size)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._works.append((work, flat, members))

    def finish(self) -> None:
        """At the end of a synchronized backward: launch if still due, wait, write the
        averages into ``param.grad``.

        Raises:
            RuntimeError: a delayed parameter's gradient arrived after the allreduce
                had started.
        """
        if not self._armed:
            return
        self.launch()
        self._armed = False
        for work, flat, members in self._works:
            work.wait()
            offset = 0
            for i in members:
                p = self.params[i]
                part = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    if not part.any():  # no rank used it: its gradient stays None
                        continue
                    p.grad = part.clone()
                else:
                    p.grad.copy_(part)
        self._works = []
        if self._late:
            raise RuntimeError(
                f"ddp: delay_all_reduce_named_params: the gradient of {self._late[:5]} came "
                "after param_to_hook_all_reduce's, so the delayed allreduce had already "
                "started without it; hook a parameter whose gradient comes last (usually "
                "the first layer's weight)")
