"""Uneven inputs (:meth:`ddp.DistributedDataParallel.join`): what a rank that ran
out of inputs does while the others still train."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from ddp.replicas import broadcast_coalesced, common_rank


class ShadowingJoinHook(JoinHook):
    """What a rank that ran out of inputs does while the others still train
    (:meth:`ddp.DistributedDataParallel.join`): each iteration, the collectives of one
    training iteration, in the order the training ranks issue them
    (:meth:`ddp.DistributedDataParallel._pre_forward`, then backward), with zero
    gradients; at the end, the final model from the last rank to join."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.rebuild_buckets()
        ddp._sync_buffers_before_forward(training=False)
        sync = torch.zeros(1, device=ddp._device)
        dist.all_reduce(sync, group=ddp.process_group)  # the training ranks' 1 or 0
        should_sync = bool(sync.item())
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = common_rank(ddp._rank if is_last_joiner else None, ddp.process_group,
                           ddp._device)
        state = list(ddp.module.parameters())
        if ddp.broadcast_buffers:
            state += ddp._sync_buffer_list
        with torch.no_grad():
            broadcast_coalesced(state, ddp.process_group, src=src)
