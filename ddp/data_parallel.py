"""DistributedDataParallel: the module wrapper users see.

It mirrors ``torch.nn.parallel.DistributedDataParallel`` (same constructor
arguments for the features it has, ``module``, ``no_sync``,
``register_comm_hook``, a state_dict with the same ``module.`` prefix), so a
training script switches by changing one import. The gradient machinery is in
:mod:`ddp.reducer`; bucket layout in :mod:`ddp.buckets`; the replicas' first
agreement in :mod:`ddp.replicas`; argument checks in :mod:`ddp.arguments`; uneven
inputs in :mod:`ddp.join`.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ddp.arguments import check_arguments, split_parameters
from ddp.buckets import FIRST_BUCKET_CAP_BYTES, MB
from ddp.comm_hooks import CommHook
from ddp.delayed import DelayedAllreduce
from ddp.join import ShadowingJoinHook
from ddp.logging_data import logging_data
from ddp.mixed_precision import MixedPrecision
from ddp.reducer import Reducer
from ddp.replicas import broadcast_coalesced, common_rank, describe_mismatch, verify_same_model
from ringcomm import trace

#: Under torch.compile, what DDP does around the module's forward (collectives, hooks
#: on the outputs, clocks) runs eagerly. torch's lazy form of torch.compiler.disable
#: imports torch._dynamo at the first call, not at ``import ddp`` (2 s of a 3 s
#: import); torch's optimizers import it when they are made, so a training loop
#: pays nothing more
_eager = torch._disable_dynamo

__all__ = ["DistributedDataParallel", "describe_mismatch"]

class DistributedDataParallel(nn.Module, Joinable):
    """Data-parallel training: wrap a model; gradients are averaged across ranks in backward.

    All ranks start from rank 0's parameters and buffers; after each
    ``loss.backward()`` every ``param.grad`` holds the gradient averaged over the
    group, so identical optimizer steps keep the replicas identical. Gradients
    are reduced in buckets while backward is still running.

    Args:
        module: the model; every rank must pass the same architecture.
        process_group: group to train over (default: the default group). Any
            backend works (ringcomm, gloo, mpi); only all_reduce, broadcast,
            all_gather are used.
        bucket_cap_mb: bucket size cap in MiB (the first bucket is capped at
            ``min(1, bucket_cap_mb)`` MiB so communication starts early). 0 gives
            every parameter its own bucket (one allreduce per parameter), as in
            torch's DDP.
        find_unused_parameters: walk the autograd graph after each forward to
            find parameters that get no gradient this iteration, so their buckets
            need not wait for them; parameters no rank used keep ``grad``
            unchanged. Needed whenever some parameters can go unused.
        gradient_as_bucket_view: make each ``param.grad`` a view into its bucket,
            saving one copy and the memory of one gradient per parameter.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to
            all ranks at construction and before each forward. With False, buffers
            are never synchronized, not even at construction (as in torch).
        static_graph: the model uses the same parameters every iteration (as torch's
            ``static_graph``): the first synchronized iteration finds the unused ones
            (even without ``find_unused_parameters``), later iterations skip the graph
            walk and the used-parameter allreduce.
        delay_all_reduce_named_params: ``(name, parameter)`` pairs kept out of the
            buckets and averaged in one allreduce of their own at the end of
            backward, after the buckets, waited for before backward returns (see
            :mod:`ddp.delayed`). Not with ``join()``.
        param_to_hook_all_reduce: a parameter of the module, given with
            ``delay_all_reduce_named_params`` as torch requires (torch launches the
            delayed allreduce from its gradient; here the moment is fixed).
        mixed_precision: torch's ``_MixedPrecision(param_dtype, reduce_dtype,
            buffer_dtype)`` (see :mod:`ddp.mixed_precision`): forward and backward in
            ``param_dtype``, buckets in ``reduce_dtype``, full precision for the
            optimizer. Not with ``gradient_as_bucket_view``.
        init_sync: False skips construction's collectives (the model check and the
            broadcast of rank 0's state): each rank keeps its own parameters, which
            the caller must have made equal.
        device_mesh: a 1-D ``DeviceMesh`` to train over, instead of
            ``process_group``.
        forward_sync_buffers: torch 2.13's successor of ``broadcast_buffers`` for the
            broadcasts before each forward; buffers are then always synchronized at
            construction (``broadcast_buffers=False`` also skips that one).
    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``bucket_cap_mb`` is negative or not a number, this process
            is not in ``process_group``, or the delayed parameters are given
            without their hook parameter (or the other way round), name no
            parameter of the module, or are all of its trainable ones.
        RuntimeError: no process group is initialized; the model differs across
            ranks (on every rank); no parameter requires a gradient; the model has
            sparse embeddings.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float | None = 25, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, broadcast_buffers: bool = True,
                 static_graph: bool = False,
                 delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
                 param_to_hook_all_reduce: nn.Parameter | None = None,
                 mixed_precision: Any = None, init_sync: bool = True,
                 device_mesh: Any = None, forward_sync_buffers: bool | None = None):
        nn.Module.__init__(self)
        Joinable.__init__(self)  # join() (uneven inputs) is off until asked for
        self._divide_by_initial_world_size = True
        bucket_cap_mb, process_group, delayed, mp = check_arguments(
            module, process_group, bucket_cap_mb, gradient_as_bucket_view,
            delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
            device_mesh)
        init_buffers = broadcast_buffers
        if forward_sync_buffers is not None:
            broadcast_buffers, init_buffers = forward_sync_buffers, True
        self.module = module
        self.process_group = process_group
        self.device_mesh = device_mesh
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.bucket_bytes_cap = int(bucket_cap_mb * MB)
        self.world_size = dist.get_world_size(process_group)
        self._rank = dist.get_rank(process_group)

        named_params = list(module.named_parameters())  # shared parameters appear once
        named_buffers = list(module.named_buffers())
        device = named_params[0][1].device if named_params else torch.device("cpu")
        self._device = device
        # Before anything else: a mismatch would make later collectives disagree in
        # size (hang or garbage); the fingerprint turns that into an error everywhere.
        if init_sync:
            verify_same_model(named_params, named_buffers, process_group, device)
        trainable, held = split_parameters(module, named_params, delayed)

        # As torch does, broadcast_buffers=False also leaves buffers out of this
        # first broadcast, so rank-local buffers stay rank-local.
        start_state = [p for _, p in named_params]
        if init_buffers:
            start_state += [b for _, b in named_buffers]
        if init_sync:
            with torch.no_grad():
                broadcast_coalesced(start_state, process_group)
        self._sync_buffer_list = [b for _, b in named_buffers]
        self._mp = mp
        if mp is not None:
            mp.cast_buffers(self._sync_buffer_list)
        self.reducer = self._build_reducer(trainable, held, mp)
        # As in torch: a backward is synchronized when its forward ran with grad
        # enabled outside no_sync; buffers are synced before a forward that follows
        # such a forward (or the first one).
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._forward_ns, self._forwards = 0, 0  # synchronized forwards, for logging_data

    def _build_reducer(self, trainable: list[tuple[str, nn.Parameter]],
                       held: list[tuple[str, nn.Parameter]],
                       mp: MixedPrecision | None) -> Reducer:
        """The reducer of the bucketed parameters; the delayed ones' allreduce on it."""
        reduce_dtype = mp.reduce_dtype if mp is not None else None
        reducer = Reducer(
            [p for _, p in trainable], [n for n, _ in trainable], self.process_group,
            self.bucket_bytes_cap, min(FIRST_BUCKET_CAP_BYTES, self.bucket_bytes_cap),
            self.find_unused_parameters, self.gradient_as_bucket_view, self.static_graph,
            bucket_dtype=reduce_dtype)
        reducer.mp = mp
        if held:
            reducer.delayed = DelayedAllreduce(
                [p for _, p in held], [n for n, _ in held], self.process_group,
                reduce_dtype=reduce_dtype)
        return reducer

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; arm gradient synchronization for the coming backward.

        Raises:
            RuntimeError: the previous synchronized backward never finished reducing.
        """
        start, inputs, kwargs = self._pre_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs)
        return self._post_forward(output, start)

    def logging_data(self) -> dict[str, Any]:
        """What this DDP is and has done (:func:`ddp.logging_data.logging_data`)."""
        return logging_data(self)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's name for :meth:`logging_data`."""
        return self.logging_data()

    # Under torch.compile, only the wrapped module's forward is traced (_eager).
    @_eager
    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, tuple, dict]:
        """Everything before the module's forward: the clocks at its start and whether
        mixed precision swapped the parameters now, and the inputs (cast, with mixed
        precision)."""
        start = (time.perf_counter_ns(), trace.now() if trace.active() else 0.0)
        joining = self._join_config.enable
        grad = torch.is_grad_enabled()
        if grad:
            self.reducer.check_idle()
        # In join(): tell the ranks that ran out of inputs that this one trains on; the
        # number that do is the divisor when divide_by_initial_world_size is False.
        work = Join.notify_join_context(self) if joining else None
        self.reducer.set_divisor_work(
            work if work is not None and not self._divide_by_initial_world_size else None)
        if grad:
            # Before the forward allocates activations: the old and new buckets
            # briefly coexist.
            self.reducer.rebuild_buckets()
        self._sync_buffers_before_forward(training=True)
        if joining:  # whether the joined ranks have a backward to shadow
            flag = torch.ones(1, device=self._device) if (
                grad and self.require_backward_grad_sync) else torch.zeros(1, device=self._device)
            dist.all_reduce(flag, group=self.process_group)
        swapped = False
        if self._mp is not None:
            inputs, kwargs, swapped = self._mp.swap_in(inputs, kwargs)
        return (*start, swapped), inputs, kwargs

    @_eager
    def _post_forward(self, output: Any, start: tuple) -> Any:
        """Everything after the module's forward: arm (or disarm) the reducer."""
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            self.reducer.prepare_for_backward(output)
            self._forward_ns += time.perf_counter_ns() - start[0]
            self._forwards += 1
        else:
            self.require_forward_param_sync = False
            if torch.is_grad_enabled():
                self.reducer.disarm()
        if self._mp is not None and not torch.is_grad_enabled() and start[2]:
            # no backward comes to put full precision back; a swap made by an earlier
            # forward whose backward is still to come is left to that backward
            self._mp.restore()
        if trace.active():
            trace.complete("forward", "ddp", start[1] or trace.now(), trace.now())
        return output

    def _sync_buffers_before_forward(self, training: bool) -> None:
        """Rank 0's buffers to every rank before a forward that follows a synchronized
        one; in join(), the largest training rank's (rank 0 may have run out of
        inputs, its buffers stale). ``training``: this rank has inputs."""
        if not (self.require_forward_param_sync and self.broadcast_buffers
                and self._sync_buffer_list and self.world_size > 1):
            return
        src = 0
        if self._join_config.enable:
            src = common_rank(self._rank if training else None, self.process_group,
                               self._device)
        with torch.no_grad():
            broadcast_coalesced(self._sync_buffer_list, self.process_group, src=src)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Train on uneven inputs: ``with model.join(): for x in my_batches: ...``.

        A rank that runs out of inputs shadows the others' collectives (zero gradients)
        until every rank is done, so nobody hangs; then every rank takes the last
        rank's model. As in torch's DDP (whose ``Join`` this is), gradients are
        divided by the initial world size, or with ``divide_by_initial_world_size=False``
        by the number of ranks still training.

        Args:
            divide_by_initial_world_size: see above.
            enable: False turns the context into a no-op (even inputs).
            throw_on_early_termination: raise on every rank as soon as one runs out
                of inputs, instead of shadowing.
        """
        if enable and self.reducer.delayed is not None:
            raise RuntimeError("DistributedDataParallel.join: not with "
                               "delay_all_reduce_named_params (not built: the ranks out of "
                               "inputs would have to shadow the delayed allreduce too)")
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook :class:`torch.distributed.algorithms.Join` runs on a rank that ran
        out of inputs (see :meth:`join`)."""
        return ShadowingJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward accumulates gradients locally with no communication.

        The first synchronized backward after leaving the context averages the
        accumulated gradients. What counts is where the *forward* ran: a forward
        inside ``no_sync`` gives an unsynchronized backward.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> torch.futures.Future``.

        The future must hold a tensor shaped like ``bucket.buffer()``: the bucket
        averaged over the group. ``ddp.comm_hooks`` has ``allreduce_hook``,
        ``fp16_compress_hook`` and ``bf16_compress_hook`` (their ``state`` is a
        process group, or None for this wrapper's group); torch's own DDP hooks
        work too. Call it on every rank, once, before the first forward.

        Raises:
            TypeError: ``hook`` is not callable.
            RuntimeError: a hook is already registered or training has started.
        """
        self.reducer.register_comm_hook(state, hook)
