"""Mixed precision for DDP: forward and backward in ``param_dtype``, gradients
reduced in ``reduce_dtype``, parameters and gradients in full precision whenever
the optimizer sees them (torch's ``_MixedPrecision`` for DDP).

The configuration is torch's ``torch.nn.parallel.distributed._MixedPrecision``, or
any object with ``param_dtype``, ``reduce_dtype`` and ``buffer_dtype``:

* ``param_dtype``: each forward runs on low-precision copies of the floating
  parameters (``param.data`` swapped), with floating inputs cast alike; backward
  produces gradients in that dtype. After a synchronized backward (and after a
  ``no_sync`` one, and right after a forward without gradients) the full-precision
  values are back and ``param.grad`` is full precision. Gradients accumulated over
  ``no_sync`` steps are cast down at the next forward and accumulate in
  ``param_dtype``, as in torch.
* ``reduce_dtype``: the buckets' dtype (default ``param_dtype``, else the
  parameters'): each gradient is divided by the world size as it enters its
  bucket, the sum is taken in this dtype.
* ``buffer_dtype``: floating buffers are cast once, at construction.

torch's own implementation needs CUDA events and fails on CPU ("cpu backend
doesn't support events"); this one has no streams and runs on any device.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["MixedPrecision"]


class MixedPrecision:
    """Swaps a module's floating parameters between full and low precision.

    Args:
        config: ``param_dtype``, ``reduce_dtype``, ``buffer_dtype`` (each None or
            a floating dtype).
        module: the wrapped module.
    Raises:
        TypeError: the configuration lacks those attributes or names a dtype that
            is not floating point.
    """

    def __init__(self, config: Any, module: nn.Module):
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            if not hasattr(config, name):
                raise TypeError(f"DistributedDataParallel: mixed_precision must have "
                                f"param_dtype, reduce_dtype and buffer_dtype (torch's "
                                f"_MixedPrecision), got {type(config).__name__}")
            d = getattr(config, name)
            if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
                raise TypeError(f"DistributedDataParallel: mixed_precision.{name} must be "
                                f"a floating-point torch.dtype or None, got {d!r}")
        self.param_dtype = config.param_dtype
        self.reduce_dtype = config.reduce_dtype or config.param_dtype
        self.buffer_dtype = config.buffer_dtype
        self.params = [p for p in module.parameters() if p.is_floating_point()]
        self._full: list[torch.Tensor] | None = None  # full-precision data while swapped

    def cast_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Cast the floating buffers to ``buffer_dtype`` (once, at construction)."""
        if self.buffer_dtype is None:
            return
        for b in buffers:
            if b.is_floating_point():
                b.data = b.data.to(self.buffer_dtype)

    @property
    def swapped(self) -> bool:
        return self._full is not None

    def swap_in(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
        """Before a forward: low-precision copies in the parameters (accumulated
        gradients cast down with them); the inputs cast alike; whether this call
        swapped (False: a forward before it did, and its backward is still to come)."""
        if self.param_dtype is None:
            return args, kwargs, False
        fresh = self._full is None
        if fresh:
            self._full = [p.data for p in self.params]
        for p, full in zip(self.params, self._full):
            g = p.grad
            p.grad = None
            p.data = full.to(self.param_dtype)
            if g is not None:
                p.grad = g.to(self.param_dtype)

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                return x.to(self.param_dtype)
            return x

        return tree_map(cast, args), tree_map(cast, kwargs), fresh

    def restore(self) -> None:
        """The full-precision values back in the parameters, gradients cast up."""
        if self._full is None:
            return
        for p, full in zip(self.params, self._full):
            g = p.grad
            p.grad = None
            p.data = full
            if g is not None:
                p.grad = g.to(full.dtype)
        self._full = None
