"""What one synchronized backward has done so far (:class:`Iteration`): the reducer's
per-iteration state in one place, made afresh when a forward arms the reducer."""
from __future__ import annotations

from typing import Sequence

import torch

from ddp.buckets import Bucket


class Iteration:
    """The progress of one synchronized backward, made afresh when a forward arms the
    reducer (:meth:`ddp.reducer.Reducer.prepare_for_backward`); the bucket layout outlives it."""

    __slots__ = ("started", "backward_start", "launched", "ready", "used", "ready_order",
                 "pending", "futures", "used_future", "unused_from_graph", "saved_slots",
                 "lying", "coalesced")

    def __init__(self, n_params: int, buckets: Sequence[Bucket]):
        self.started = False                     # finalize queued, unused marked
        self.backward_start = 0.0                # trace clock at the first hook
        self.launched = 0                        # buckets handed to the comm hook
        self.ready = [False] * n_params          # gradient in its slot (or unused)
        self.used = [False] * n_params           # got a gradient this iteration
        self.ready_order: list[int] = []         # parameters in the order they came
        self.pending = [len(b.param_indices) for b in buckets]  # slots still empty
        self.futures: list[torch.futures.Future | None] = [None] * len(buckets)
        self.used_future: torch.futures.Future | None = None  # the bitmap allreduce
        self.unused_from_graph: list[int] = []
        self.saved_slots: dict[int, torch.Tensor] = {}  # bucket views to restore
        self.lying = [False] * n_params          # reduced in param.grad, not its slot
        self.coalesced = [False] * len(buckets)  # reduced as the tensors that hold it
