"""The reducer: turns gradient-ready events during backward into bucket allreduces.

Life of one synchronized iteration (paper, section 3.2 and Algorithm 1):

1. ``prepare_for_backward`` (end of DDP's forward) arms the reducer and, with
   ``find_unused_parameters``, walks the autograd graph from the outputs to find
   parameters that will get no gradient on this rank.
2. Each parameter's post-accumulate-grad hook copies its gradient into its bucket
   slot (or makes the slot the gradient, with ``gradient_as_bucket_view``; or, where
   the group reduces a bucket's tensors where they lie, leaves it where it is until
   the bucket goes out: see ``Reducer._lay``). The
   first hook of the backward queues the finalize callback and marks the unused
   parameters ready. When a bucket's last gradient arrives, every complete bucket
   from the lowest unlaunched index on is handed to the communication hook
   (asynchronous allreduce): buckets go out strictly in index order on every rank,
   so the collectives match across ranks whatever order gradients arrive in.
3. After the last bucket, with ``find_unused_parameters``, a bitmap of the
   parameters that got a gradient here is allreduced too.
4. The finalize callback (autograd runs it when backward ends) waits on every
   future and writes the averaged gradients back into ``param.grad``; globally
   unused parameters keep their ``grad`` as it was.

Autograd runs hooks and callbacks of a CPU backward on the thread that called
``backward()``; the collectives progress on the process group's own threads.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ddp.buckets import (Bucket, complete_order, compute_bucket_assignment, make_buckets,
                         reverse_order)
from ddp.comm_hooks import CommHook, GradBucket, allreduce_hook, allreduce_sum
from ddp.comm_hooks.default import allreduce_sum_coalesced
from ddp.graph import find_tensors, reachable_parameters
from ddp.iteration import Iteration
from ringcomm import trace

log = logging.getLogger("ddp")


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same memory, same layout: ``a`` is (a view equal to) ``b``."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


#: how many tensors use a storage (torch's own count; None where this torch lacks it:
#: then no gradient is reduced where it lies)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _owns_memory(t: torch.Tensor) -> bool:
    """Whether no tensor but ``t`` uses its memory (the storage object asked counts one)."""
    return (_storage_use_count is not None
            and _storage_use_count(t.untyped_storage()._cdata) <= 2)


def _grad_hook(ref: "weakref.ref[Reducer]", index: int, param: torch.Tensor) -> None:
    """A parameter's post-accumulate-grad hook: :meth:`Reducer._on_grad_ready`."""
    # A weak reference: hooks live as long as the parameter, the reducer only as
    # long as its DDP wrapper.
    reducer = ref()
    if reducer is not None:
        # Autograd runs hooks of parameters on different devices on different
        # threads; the per-iteration state must see them one at a time.
        with reducer._lock:
            reducer._on_grad_ready(index, param)


def _output_grad_hook(ref: "weakref.ref[Reducer]", grad: torch.Tensor) -> None:
    """A hook on the forward's outputs: the backward begins (:meth:`Reducer._begin`)."""
    reducer = ref()
    if reducer is not None:
        with reducer._lock:
            if reducer._armed:
                reducer._begin()


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()


class Reducer:
    """Buckets the gradients of ``params`` and reduces them during backward.

    Args:
        params: parameters that require gradients, in registration order; the same
            on every rank (DDP checks that first).
        names: their names, for error messages.
        process_group: group to reduce over.
        bucket_cap_bytes: bucket size cap.
        first_bucket_cap_bytes: cap of the first bucket (default 1 MiB).
        find_unused_parameters: detect parameters without gradients each iteration.
        gradient_as_bucket_view: make ``param.grad`` a view into its bucket.
        static_graph: find the unused parameters once, in the first iteration.
        bucket_dtype: the buckets' dtype for floating parameters (mixed precision's
            reduce dtype); None: the parameters' own.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 process_group: dist.ProcessGroup, bucket_cap_bytes: int,
                 first_bucket_cap_bytes: int | None = None,
                 find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 bucket_dtype: torch.dtype | None = None):
        self.params = list(params)
        self.names = list(names)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.bucket_cap_bytes = bucket_cap_bytes
        self.first_bucket_cap_bytes = first_bucket_cap_bytes
        self.find_unused_parameters = find_unused_parameters
        #: static_graph: the first synchronized iteration finds the unused parameters
        #: (graph walk, bitmap allreduce); later ones reuse what it found
        self.static_graph = static_graph
        self._static_unused: list[int] | None = None
        self._static_used: list | None = None
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._device = self.params[0].device
        self._lock = threading.Lock()
        #: parameters kept out of the buckets, averaged on their own (ddp.delayed)
        self.delayed: Any = None
        #: mixed precision (ddp.mixed_precision): the buckets' dtype, and what puts
        #: the full-precision parameters back at the end of a backward
        self.mp: Any = None
        self.bucket_dtype = bucket_dtype
        self._mp_queued = False

        self._comm_hook: CommHook = allreduce_hook
        self._comm_hook_state: Any = None
        # A field, not derived from the hook and its state: registering allreduce_hook
        # with state None leaves those as they are by default, yet a second
        # registration must still be refused and logging_data name the hook.
        self._comm_hook_registered = False
        #: with the default hook and bucket slots apart from the gradients, the
        #: division by the world size happens while each gradient is copied into its
        #: slot (as in torch's reducer): one pass over the gradients instead of two.
        #: It follows from gradient_as_bucket_view, the world size and whether a hook
        #: is registered, but every gradient's copy (_fill) and every bucket launch
        #: reads it, so it is computed once, here and in register_comm_hook.
        self._prescale: float | None = (None if gradient_as_bucket_view
                                        else 1.0 / self.world_size)

        self.buckets: list[Bucket] = []
        self._install(compute_bucket_assignment(self.params, reverse_order(len(self.params)),
                                                bucket_cap_bytes, first_bucket_cap_bytes))
        self.initial_bucket_bytes = [b.buffer.nbytes for b in self.buckets]

        # Per-iteration state (see _reset), and what no_sync iterations leave behind.
        self._armed = False
        self._reset()
        self._used_since_sync = [False] * len(self.params)

        # Bucket rebuild: the first synchronized backward records the order in
        # which gradients arrive; the next forward rebuilds from rank 0's record.
        self._recording: list[int] | None = None
        self._observed_order: list[int] | None = None
        self._rebuilt = False
        #: the order gradients arrived in last (parameter indices; logging data)
        self.last_ready_order: list[int] = []
        #: sums over synchronized backwards, in ns (perf_counter): backward computation
        #: (first event to finalize), communication (first launch to the last wait's
        #: return) and their overlap (the number of backwards to divide them by is
        #: num_synced_backwards; unused bytes are unused_bytes)
        self.timing = {"backward_compute": 0, "backward_comm": 0, "overlap": 0}
        self._last_used: list[bool] = []
        self.num_synced_backwards = 0
        #: join() with divide_by_initial_world_size=False: the forward's allreduce that
        #: counts the ranks still training (the divisor instead of the world size)
        self._divisor_work: Any = None

        ref = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, ref, i))
                   for i, p in enumerate(self.params)]
        weakref.finalize(self, _remove_hooks, handles)

    # -- layout -----------------------------------------------------------------
    def _install(self, assignment: list[list[int]]) -> None:
        """Allocate buckets for ``assignment``; with bucket views, move existing
        gradients into their new slots so accumulated values survive a rebuild."""
        self.buckets = make_buckets(self.params, assignment, self.bucket_dtype)
        n = len(self.params)
        self._bucket_of = [0] * n
        self._slot_of = [0] * n
        for b in self.buckets:
            for k, i in enumerate(b.param_indices):
                self._bucket_of[i] = b.index
                self._slot_of[i] = k
        self._grad_buckets = [
            GradBucket(b.index, b.buffer, b.views, [self.params[i] for i in b.param_indices],
                       b.index == len(self.buckets) - 1, self.process_group)
            for b in self.buckets]
        #: per bucket: the group sums a bucket's tensors where they lie (ringcomm's
        #: allreduce_coalesced over shared memory), so with the default hook its
        #: gradients need not be copied into the bucket and back (see _lay)
        self._in_place = [self._reduces_in_place(b) for b in self.buckets]
        if self.gradient_as_bucket_view:
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    view = self._view(i)
                    view.copy_(p.grad)
                    p.grad = view

    def _view(self, i: int) -> torch.Tensor:
        return self.buckets[self._bucket_of[i]].views[self._slot_of[i]]

    def _reduces_in_place(self, b: Bucket) -> bool:
        """Whether the group sums tensors of ``b``'s slots' sizes where they lie, with
        no packed buffer between (a ringcomm group that runs shm_direct for them:
        :meth:`ringcomm.front.process_group.ProcessGroupRingcomm.reduces_in_place`).
        A bucket's slots stand for its gradients: the same sizes and dtype."""
        if self.gradient_as_bucket_view or self._device.type != "cpu":
            return False
        ask = getattr(self.process_group, "reduces_in_place", None)
        return bool(ask is not None and ask(list(b.views)))

    def _laying(self, b: int) -> bool:
        """Whether bucket ``b`` goes out as the tensors that hold its gradients
        (:meth:`_lay`): the default hook (``_prescale``), no mixed precision, and a
        group that reduces such tensors where they lie. The same on every rank."""
        return self._prescale is not None and self.mp is None and self._in_place[b]

    def _lay(self, b: int) -> list[torch.Tensor]:
        """The tensors bucket ``b`` is reduced as, at its launch (every gradient of it
        in): a used parameter's gradient, divided by the world size in place, where
        it can stand in its slot's place (contiguous, the slot's dtype and size) and
        no other tensor uses its memory (autograd may hand a parameter a view of a
        gradient that another branch of the backward still reads); otherwise its
        slot, filled now (a parameter that got no gradient: filled when it was marked).
        Dividing once, here, also counts a gradient that arrived twice once."""
        bucket, it = self.buckets[b], self.it
        tensors, lying = [], []
        for i, view in zip(bucket.param_indices, bucket.views):
            g = self.params[i].grad
            if it.used[i] and g is not None and g.dtype == view.dtype and g.is_contiguous() \
                    and g.numel() == view.numel() and g.device == view.device \
                    and not _aliases(g, view) and _owns_memory(g):
                it.lying[i] = True
                lying.append(g)
                tensors.append(g)
                continue
            if it.used[i]:
                if g is None:  # a hook cleared it; treat as a zero gradient
                    view.zero_()
                else:
                    self._fill(view, g)
            tensors.append(view)
        if lying:  # the division torch's reducer makes while copying into the slot
            torch._foreach_mul_(lying, self._prescale)
        return tensors

    def bucket_assignment(self) -> list[list[int]]:
        """Parameter indices per bucket, in launch order."""
        return [list(b.param_indices) for b in self.buckets]

    # -- configuration ----------------------------------------------------------
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Use ``hook(state, bucket)`` to reduce each bucket. See ``ddp.comm_hooks``.

        Raises:
            TypeError: ``hook`` is not callable.
            RuntimeError: a hook is already registered, or a synchronized backward
                already ran (every rank must switch at the same iteration).
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got "
                            f"{type(hook).__name__}")
        if self._comm_hook_registered:
            raise RuntimeError("register_comm_hook: a communication hook is already "
                               "registered; it can be registered only once")
        if self.num_synced_backwards or self._armed:
            raise RuntimeError("register_comm_hook: must be called before the first "
                               "forward/backward, so that every rank reduces every "
                               "iteration with the same hook")
        self._comm_hook, self._comm_hook_state = hook, state
        self._comm_hook_registered = True
        self._prescale = None  # a hook gets the bucket as it is, and averages it itself

    # -- per iteration ----------------------------------------------------------
    @property
    def rebuilt(self) -> bool:
        """Whether the buckets were rebuilt in the order gradients arrived."""
        return self._rebuilt

    @property
    def comm_hook_name(self) -> str:
        """The registered comm hook's name ("" for the default)."""
        hook = self._comm_hook
        return getattr(hook, "__qualname__", repr(hook)) if self._comm_hook_registered else ""

    def check_idle(self) -> None:
        """Raise if the previous synchronized backward started reducing and never finished.

        Raises:
            RuntimeError: buckets were launched but the finalize step never ran
                (backward raised or was interrupted); the ranks' collectives may
                no longer match, so continuing could hang or mix iterations.
        """
        if self._armed and self.it.launched:
            raise RuntimeError(
                f"ddp: the previous backward launched {self.it.launched} of "
                f"{len(self.buckets)} bucket allreduces but never finished (did backward "
                "raise?). The ranks may be out of step; restart training from a checkpoint.")

    def rebuild_buckets(self) -> bool:
        """Once, after the first synchronized backward: rebuild buckets in the order
        rank 0 saw gradients arrive (a collective: every rank calls it at the same
        point, DDP's forward). Returns True if it ran this time."""
        if self._rebuilt or self._observed_order is None:
            return False
        self._rebuilt = True
        n = len(self.params)
        order = torch.tensor(complete_order(self._observed_order, n), dtype=torch.int64,
                             device=self._device)
        # Ranks may see different orders (ties in autograd's scheduling, data-
        # dependent control flow); rank 0's order makes the layout identical.
        dist.broadcast(order, group=self.process_group, group_src=0)
        assignment = compute_bucket_assignment(self.params, order.tolist(),
                                               self.bucket_cap_bytes,
                                               self.first_bucket_cap_bytes)
        if assignment != self.bucket_assignment():
            self._install(assignment)
            self._reset()
            log.info("ddp: rebuilt %d buckets from the observed gradient order",
                     len(self.buckets))
        return True

    def _reset(self) -> None:
        """Forget the previous iteration's progress (the layout stays)."""
        self.it = Iteration(len(self.params), self.buckets)

    @property
    def _detecting(self) -> bool:
        """Whether this iteration finds its unused parameters (graph walk, bitmap)."""
        return self.find_unused_parameters or (self.static_graph and self._static_used is None)

    def prepare_for_backward(self, outputs: Any) -> None:
        """Arm the reducer for the backward of this forward's ``outputs``.

        Raises:
            RuntimeError: see :meth:`check_idle`.
        """
        self.check_idle()
        self._reset()
        if self._detecting:
            reached = reachable_parameters(find_tensors(outputs), self.params)
            self.it.unused_from_graph = [i for i in range(len(self.params)) if i not in reached]
        elif self._static_unused is not None:  # static_graph: as the first iteration found
            self.it.unused_from_graph = list(self._static_unused)
        if self._observed_order is None and self._recording is None:
            self._recording = []
        self._armed = True
        self._mp_queued = False  # a backward that raised may have left it set
        if self.delayed is not None:
            self.delayed.arm()
        # A hook on each output starts the iteration as soon as backward reaches the
        # outputs, even on a rank where no parameter will get a gradient: its
        # buckets (all zeros) still go out, so the other ranks are not left waiting.
        ref = weakref.ref(self)
        for t in find_tensors(outputs):
            if t.requires_grad and t.grad_fn is not None:
                t.register_hook(functools.partial(_output_grad_hook, ref))

    def set_divisor_work(self, work: Any) -> None:
        """The coming backward divides by the sum that ``work`` (an allreduce of ones
        over the ranks still training) holds, not by the world size; None: the world
        size."""
        self._divisor_work = work

    def shadow_backward(self) -> None:
        """On a rank that ran out of inputs (DDP's join): the collectives of one
        synchronized backward, in launch order, with zero gradients; this rank's own
        gradients stay as they are."""
        futures = []
        for b, gb in zip(self.buckets, self._grad_buckets):
            zeros = torch.zeros_like(b.buffer)
            views = [zeros[v.storage_offset() - b.buffer.storage_offset():][:v.numel()]
                     .view_as(v) for v in b.views]
            shadow = GradBucket(gb.index(), zeros, views, gb.parameters(), gb.is_last(),
                                self.process_group)
            futures.append(self._reduce(b.index, shadow))
        for fut in futures:
            fut.wait()
        if self._detecting:
            bitmap = torch.zeros(len(self.params), dtype=torch.int32, device=self._device)
            dist.all_reduce(bitmap, group=self.process_group)
        if self._observed_order is None and not self._rebuilt:
            # the training ranks rebuild their buckets at their next forward: so does
            # this rank, in the order rank 0 sends (complete_order fills the rest)
            self._observed_order = []

    def disarm(self) -> None:
        """The next backward is not synchronized (a forward inside ``no_sync``)."""
        self.check_idle()
        self._armed = False
        self._mp_queued = False  # a backward that raised may have left it set
        if self.delayed is not None:
            self.delayed.disarm()

    def _begin(self) -> None:
        """First event of a synchronized backward: queue the finalize callback (it has
        to be queued from inside the backward) and send what is known to be unused."""
        if self.it.started:
            return
        self.it.started = True
        self._t_begin = time.perf_counter_ns()
        self._t_launch = 0
        if trace.active():
            self.it.backward_start = trace.now()
            trace.instant("backward start", "ddp")
        Variable._execution_engine.queue_callback(self._end_of_backward)
        for j in self.it.unused_from_graph:
            self._mark_ready(j, used=False)

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        if not self._armed:
            # no_sync (or a backward through the module outside DDP's forward): the
            # gradient accumulates locally. Remember the parameter was used, so the
            # next synchronized iteration reduces it even if that iteration leaves
            # it unused here.
            if param.grad is not None:
                self._used_since_sync[i] = True
            if self.mp is not None and self.mp.swapped and not self._mp_queued:
                # mixed precision: the full-precision parameters are back once this
                # backward ends
                self._mp_queued = True
                Variable._execution_engine.queue_callback(self._mp_restore)
            return
        self._begin()
        if self.it.ready[i]:
            b = self._bucket_of[i]
            if b < self.it.launched:
                raise RuntimeError(
                    f"ddp: parameter '{self.names[i]}' got a gradient after its bucket {b} "
                    "was already reduced: the parameter is not reachable from the outputs "
                    "of DDP's forward, yet the loss depends on it (is it used outside the "
                    "wrapped module's forward?)")
            # Marked unused from the graph walk, but its bucket has not gone out yet:
            # take the gradient after all.
            self.it.used[i] = True
            self.it.saved_slots.pop(i, None)
            self._load_slot(i, param)
            return
        self._mark_ready(i, used=True)

    def _load_slot(self, i: int, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:  # a hook cleared it; treat as a zero gradient
            self._view(i).zero_()
            return
        if g.layout != torch.strided:
            raise RuntimeError(f"ddp: parameter '{self.names[i]}' has a {g.layout} gradient; "
                               "only dense gradients are supported (nn.Embedding(sparse=True) "
                               "is not)")
        view = self._view(i)
        if self.gradient_as_bucket_view:
            if not _aliases(g, view):
                view.copy_(g)
                p.grad = view
        elif self._laying(self._bucket_of[i]):
            pass  # left where it is until its bucket goes out (_lay)
        else:
            self._fill(view, g)

    def _fill(self, view: torch.Tensor, g: torch.Tensor) -> None:
        """Put gradient ``g`` into its bucket slot (already divided, see ``_prescale``)."""
        if self._prescale is None:
            view.copy_(g)
        else:
            torch.mul(g, self._prescale, out=view)

    def _mark_ready(self, i: int, used: bool) -> None:
        if used:
            self.it.used[i] = True
            self.it.ready_order.append(i)
            if self._recording is not None:
                self._recording.append(i)
            self._load_slot(i, self.params[i])
        else:
            # No gradient on this rank this iteration. Contribute the gradient as it
            # stands (zero if None): with accumulation across iterations that is
            # exactly this rank's share of the sum.
            g, view = self.params[i].grad, self._view(i)
            if g is None:
                view.zero_()
            elif _aliases(g, view):
                # The slot is the gradient; keep a copy to restore it untouched if no
                # rank used the parameter (the allreduce would round it otherwise).
                if self.find_unused_parameters or self.static_graph:
                    self.it.saved_slots[i] = view.clone()
            else:
                self._fill(view, g)
        self.it.ready[i] = True
        b = self._bucket_of[i]
        self.it.pending[b] -= 1
        if self.it.pending[b] == 0:
            trace.instant(f"bucket {b} ready", "ddp", bucket=b,
                          bytes=self.buckets[b].buffer.nbytes)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.it.launched < len(self.buckets) and self.it.pending[self.it.launched] == 0:
            b = self.it.launched
            trace.instant(f"bucket {b} launch", "ddp", bucket=b)
            if not self._t_launch:
                self._t_launch = time.perf_counter_ns()
            self.it.futures[b] = self._reduce(b, self._grad_buckets[b])
            self.it.launched += 1
        if (self._detecting and self.it.launched == len(self.buckets)
                and self.it.used_future is None):
            # Every parameter is ready, so the local used-set is final. Sent after the
            # last bucket on every rank, so the collectives still match.
            used = [u or v for u, v in zip(self.it.used, self._used_since_sync)]
            bitmap = torch.tensor(used, dtype=torch.int32, device=self._device)
            self.it.used_future = dist.all_reduce(bitmap, group=self.process_group,
                                                async_op=True).get_future()

    def _reduce(self, b: int, gb: GradBucket) -> torch.futures.Future:
        """Hand bucket ``b`` (``gb``) to the communication hook; the future it gave.
        The default hook is an allreduce of the sum, the division done as the
        gradients came into their slots (``_prescale``), or, for a bucket reduced
        where its gradients lie, here (:meth:`_lay`)."""
        if self._laying(b):
            # every rank reduces the bucket as the tensors that hold it (a join's
            # shadow bucket of zeros: its slots)
            if gb is self._grad_buckets[b]:
                tensors = self._lay(b)
                self.it.coalesced[b] = True
            else:
                tensors = gb.gradients()
            fut = allreduce_sum_coalesced(self.process_group, tensors)
        elif self._prescale is not None:
            fut = allreduce_sum(self.process_group, gb.buffer())
        else:
            fut = self._comm_hook(self._comm_hook_state, gb)
        # torch.futures.Future is the Python face of torch._C.Future; collectives'
        # get_future() returns the latter.
        if not isinstance(fut, torch._C.Future):
            raise TypeError(f"ddp: the communication hook must return a "
                            f"torch.futures.Future, got {type(fut).__name__} for bucket {b}")
        return fut

    def _end_of_backward(self) -> None:
        """End of backward: finish any bucket still waiting, wait for all, write back.

        Mixed precision's full-precision parameters are put back exactly once: after
        the waits, whether they raised or not, and before the write-back (which then
        casts the averaged gradients to the full-precision dtype)."""
        try:
            missing, global_used = self._wait_for_buckets()
        finally:
            if self.mp is not None:
                self.mp.restore()
        self._close_iteration(missing, global_used)

    def _wait_for_buckets(self) -> tuple[list[int], list | None]:
        """Send what never got a gradient, wait for every bucket (and the used bitmap,
        and join's divisor). Returns the parameters that got no gradient here, and
        which parameters some rank used (None: all of them)."""
        if trace.active():
            trace.complete("backward", "ddp", self.it.backward_start, trace.now(),
                           buckets=len(self.buckets))
        self._armed = False
        t_compute_end = time.perf_counter_ns()
        missing = [i for i in range(len(self.params)) if not self.it.ready[i]]
        # Parameters that got no gradient still have to be sent: the other ranks are
        # waiting in the allreduce of their bucket.
        for i in missing:
            self._mark_ready(i, used=False)
        for b, fut in enumerate(self.it.futures):
            with trace.span(f"wait bucket {b}", "ddp", bucket=b):
                value = fut.wait()
            if not self.it.coalesced[b]:  # (a coalesced bucket's result is where it lay)
                self._store_result(b, value)
        self._account(t_compute_end, time.perf_counter_ns())
        global_used = None
        if self.it.used_future is not None:
            global_used = self.it.used_future.wait()[0].tolist()
            if self.static_graph and self._static_used is None:
                self._static_used = global_used
                self._static_unused = [i for i in range(len(self.params)) if not self.it.used[i]]
        elif self._static_used is not None:
            global_used = self._static_used
        if self._divisor_work is not None:  # join(divide_by_initial_world_size=False)
            self._divisor_work.wait()
            training = int(self._divisor_work.result()[0].item())
            self._divisor_work = None
            if training and training != self.world_size:
                for bucket in self.buckets:
                    bucket.buffer.mul_(self.world_size / training)
                for i, lying in enumerate(self.it.lying):
                    if lying:
                        self.params[i].grad.mul_(self.world_size / training)
        return missing, global_used

    def _close_iteration(self, missing: list[int], global_used: list | None) -> None:
        """The averages into ``param.grad``; the iteration's bookkeeping; the error for
        parameters that got no gradient without ``find_unused_parameters``."""
        if self.delayed is not None:  # after the buckets: the same place on every rank
            self.delayed.finish()
        with trace.span("copy-back", "ddp"):
            self._grads_from_buckets(global_used)
        self.it.saved_slots = {}
        self._used_since_sync = [False] * len(self.params)
        self.num_synced_backwards += 1
        if self._recording is not None:
            self._observed_order, self._recording = self._recording, None
        if missing and not (self.find_unused_parameters or self.static_graph):
            names = [self.names[i] for i in missing]
            raise RuntimeError(
                f"ddp: {len(missing)} parameter(s) got no gradient in this backward on this "
                f"rank: {names[:10]}{' ...' if len(names) > 10 else ''}. Their zero gradients "
                "were reduced so the other ranks are not left waiting, but results are only "
                "right if the model uses every parameter: pass find_unused_parameters=True "
                "to DistributedDataParallel when some parameters are unused in an iteration.")

    def _mp_restore(self) -> None:
        self._mp_queued = False
        self.mp.restore()

    def _account(self, compute_end: int, comm_end: int) -> None:
        """Add this backward's times to :attr:`timing` (logging data)."""
        launch = self._t_launch or compute_end
        t = self.timing
        t["backward_compute"] += compute_end - self._t_begin
        t["backward_comm"] += comm_end - launch
        t["overlap"] += max(0, compute_end - launch)
        # _reset makes new lists for the next backward: these stay as they are
        self.last_ready_order, self._last_used = self.it.ready_order, self.it.used

    @property
    def unused_bytes(self) -> int:
        """Bytes of the parameters the last synchronized backward gave no gradient."""
        return sum(p.nbytes for p, used in zip(self.params, self._last_used) if not used)

    def _grads_from_buckets(self, global_used: list | None) -> None:
        """Reduced buckets -> ``param.grad`` (parameters no rank used keep theirs)."""
        lying = self.it.lying
        for b in self.buckets:
            for k, i in enumerate(b.param_indices):
                p, view = self.params[i], b.views[k]
                if lying[i]:
                    continue  # reduced in param.grad itself (used here: used somewhere)
                if global_used is not None and global_used[i] == 0:
                    saved = self.it.saved_slots.get(i)
                    if saved is not None:
                        view.copy_(saved)
                    continue  # no rank used it: grad stays as it was (None or unchanged)
                if self.gradient_as_bucket_view:
                    if p.grad is None or not _aliases(p.grad, view):
                        p.grad = view
                elif p.grad is None:
                    p.grad = view.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(view)

    def _store_result(self, b: int, value: Any) -> None:
        bucket = self.buckets[b]
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"ddp: the communication hook's future for bucket {b} holds "
                            f"{type(value).__name__}; expected a tensor")
        if value.shape != bucket.buffer.shape:
            raise ValueError(f"ddp: the communication hook's result for bucket {b} has shape "
                             f"{tuple(value.shape)}; expected {tuple(bucket.buffer.shape)}")
        if not _aliases(value, bucket.buffer):
            bucket.buffer.copy_(value)
