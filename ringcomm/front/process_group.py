"""The ringcomm ProcessGroup: a table from torch's method names to the functions
that prepare their calls (:mod:`ringcomm.front.reductions`,
:mod:`ringcomm.front.data_movement`; what they share: :mod:`ringcomm.front.calls`),
plus what belongs to the group itself: its identity, its algorithm choices,
point-to-point messages and its end.

A torch call ``pg.allreduce([t], opts)`` goes ``METHODS["allreduce"]`` ->
``reductions.allreduce(pg, [t], opts)``, which finds the prepared call of the
call's shape (made on its first call: checks, lane, algorithm, program) ->
the lane's engine, which runs it (or queues it) and returns torch's ``Work``.
"""
from __future__ import annotations

import os
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ringcomm import trace
from ringcomm.trace import flight
from ringcomm.algorithms import check_choice
from ringcomm.front import calls, data_movement, reductions
from ringcomm.front.contract import TorchContract, forward_collectives
from ringcomm.front.arguments import Inputs
from ringcomm.front.cross_rank_checks import Fingerprints
from ringcomm.front.lanes import Lane, Lanes, Ordered
from ringcomm.front.planner import Planner
from ringcomm.front.calls import Calls
from ringcomm.runtime.engine import Engine
from ringcomm.runtime.work import Batch, Done, P2PWork
from ringcomm.execution.user_checks import AlgorithmFailed
from ringcomm.settings import Options, get
from ringcomm.transport import Transport

__all__ = ["ProcessGroupRingcomm", "Options", "METHODS"]

#: torch's ProcessGroup method name -> the function that prepares its call
METHODS: dict[str, Callable[..., tuple]] = {
    "allreduce": reductions.allreduce,
    "allreduce_coalesced": reductions.allreduce_coalesced,
    "reduce": reductions.reduce,
    "broadcast": data_movement.broadcast,
    "allgather": data_movement.allgather,
    "allgather_coalesced": data_movement.allgather_coalesced,
    "all_gather_single": data_movement.all_gather_into_tensor,
    "_allgather_base": data_movement.all_gather_into_tensor,
    "allgather_into_tensor_coalesced": data_movement.allgather_into_tensor_coalesced,
    "all_gather_single_coalesced": data_movement.allgather_into_tensor_coalesced,
    "gather": data_movement.gather,
    "gather_single": data_movement.gather_into_tensor,
    "gather_into_tensor": data_movement.gather_into_tensor,
    "scatter": data_movement.scatter,
    "reduce_scatter": reductions.reduce_scatter,
    "reduce_scatter_single": reductions.reduce_scatter_tensor,
    "_reduce_scatter_base": reductions.reduce_scatter_tensor,
    "reduce_scatter_tensor_coalesced": reductions.reduce_scatter_tensor_coalesced,
    "reduce_scatter_single_coalesced": reductions.reduce_scatter_tensor_coalesced,
    "alltoall": data_movement.all_to_all,
    "alltoall_base": data_movement.all_to_all_single,
    "all_to_all_single": data_movement.all_to_all_single,
    "barrier": data_movement.barrier,
}


class ProcessGroupRingcomm(TorchContract, dist.ProcessGroup):
    """A torch process group whose collectives run ringcomm's algorithms: over MPI
    for CPU tensors, over NCCL (through CuPy) for CUDA tensors, chosen per call by
    the tensors' device.

    Created by torch through the registered backend creator; users get it from
    ``dist.init_process_group("ringcomm")`` or ``dist.new_group(..., backend="ringcomm")``.
    Its collective methods are those of :data:`METHODS`.

    Args:
        rank, size: this process's rank in the group and the group size.
        transport: the MPI transport for CPU tensors, or one per channel
            (``Options.num_channels``, each over its own communicator); None where MPI
            cannot be loaded (``cpu_error`` says why), so CPU tensors are refused.
        timeout: default time limit of every collective.
        options: per-group settings.
        group_id: torch's name of the group.
        store: the group's c10d store; NCCL communicators exchange their ids through it.
        nccl: the ``cupy.cuda.nccl`` module or a stand-in (default: loaded on the
            first CUDA tensor).
        nccl_device_type: tensors of this device type run over NCCL. Tests pass
            ``"cpu"`` with :class:`ringcomm.testing.FakeNccl` to run the NCCL path
            on CPU tensors.
        hosts: the host of every rank (:class:`ringcomm.schedule.Context`); empty: one host.
        torch_store: the store torch gave the group (``split_group`` prefixes it).
        global_ranks: the members' world ranks in group-rank order; empty: the world.

    What torch reads off a backend besides collectives (``_get_backend``, device
    binding, timeouts, errors, splitting) is :class:`ringcomm.front.contract.TorchContract`.
    """

    def __init__(self, rank: int, size: int, transport: Transport | list[Transport] | None,
                 timeout: timedelta, options: Options | None = None, group_id: str = "", *,
                 store: Any = None, cpu_error: str | None = None, nccl: Any = None,
                 nccl_device_type: str = "cuda", hosts: tuple = (), torch_store: Any = None,
                 global_ranks: list[int] | tuple = ()):
        super().__init__(rank, size)
        # plain ints: rank() and size() cross into C++ on every call
        self._rank, self._size = rank, size
        self.timeout_s = timeout.total_seconds()
        self._group_name = group_id
        self._group_desc = ""
        self.inputs = Inputs(rank, size, nccl_device_type)
        resolved = (options or Options()).resolve()
        self._options = resolved
        self._torch_store = torch_store if torch_store is not None else store
        self._global_ranks = list(global_ranks)
        self.planner = Planner(rank, size, resolved, hosts)
        self.fingerprints = Fingerprints(self.planner)
        #: RINGCOMM_DEBUG=DETAIL, or torch's TORCH_DISTRIBUTED_DEBUG=DETAIL (whose
        #: checking wrapper torch puts around C++ backends only): every call is
        #: compared across ranks before it runs
        self.detail = "DETAIL" in (get("RINGCOMM_DEBUG"),
                                   os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper())
        channels = resolved.num_channels
        transports = [] if transport is None else \
            list(transport) if isinstance(transport, (list, tuple)) else [transport]
        if transports and len(transports) != channels:
            raise ValueError(f"ringcomm: {len(transports)} transports given for "
                             f"num_channels={channels}")
        cpus = [Lane(tp, Engine(tp, self._channel_name(k, channels)), False, k)
                for k, tp in enumerate(transports)]
        self.lanes = Lanes(rank, size, cpus or None, store=store, timeout_s=self.timeout_s,
                           describe=self._describe, cpu_error=cpu_error, nccl=nccl,
                           nccl_type=nccl_device_type, channels=channels)
        #: collectives called so far, refused ones included (see :func:`_method`)
        self.seq = 0
        #: sends and receives posted so far (torch numbers them apart)
        self.p2p_seq = 0
        #: the flight recorder (None: off) and this group as its entries name it
        self.flight = flight.recorder()
        self.fr_tag = flight.GroupTag(group_id, "", self._global_ranks or list(range(size)))
        self.fr_tag.waiting = weakref.WeakMethod(self.lanes.waiting_for)
        #: the prepared calls, by shape (:mod:`ringcomm.front.calls`)
        self.calls = Calls()
        #: per thread: the Works of an open batch (:meth:`_start_coalescing`)
        self._batch = threading.local()

    # -- identity -------------------------------------------------------------
    def getBackendName(self) -> str:
        return "ringcomm"

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = self.fr_tag.name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = self.fr_tag.desc = desc

    def _describe(self) -> str:
        return f"group '{self._group_desc or self._group_name or '?'}'"

    def _channel_name(self, k: int, channels: int) -> Callable[[], str]:
        if channels == 1:
            return self._describe
        return lambda: f"{self._describe()} channel {k}/{channels}"

    @property
    def num_channels(self) -> int:
        """Communicators this group uses in turn (``Options.num_channels``)."""
        return self.lanes.channels

    def __repr__(self) -> str:
        return f"<ringcomm.ProcessGroup {self._describe()} rank {self._rank}/{self._size}>"

    @property
    def segment_bytes(self) -> int:
        """The pipeline segment size of this group's algorithms, in bytes."""
        return self.planner.segment_bytes

    # -- algorithm choice -----------------------------------------------------
    def set_algorithm(self, collective: str, name: str) -> None:
        """Use algorithm ``name`` (or ``"auto"``) for ``collective`` on this group.

        Every rank of the group must make the same choice before its next collective.
        """
        check_choice(collective, name)
        self.planner.algos[collective] = name

    def get_algorithm(self, collective: str) -> str:
        return self.planner.algos[collective]

    def algorithm_for(self, collective: str, nbytes: int) -> str:
        """The algorithm a ``collective`` of ``nbytes`` per rank runs on this group."""
        return self.planner.choose(collective, nbytes)

    def reduces_in_place(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``allreduce_coalesced`` of ``tensors`` (a SUM) reduces them where they
        lie, with no packed buffer between (shm_direct's rounds read and write each
        tensor itself): the algorithm auto or the set choice runs for their size takes
        several tensors, and they are contiguous and apart. Prepares the call (no
        message is sent); a caller with tensors of the same sizes elsewhere gets the
        same answer for them while they are contiguous and apart."""
        opts = dist.AllreduceCoalescedOptions()
        call, _ = reductions.allreduce_coalesced(self, tensors, opts)
        return call.in_place(list(tensors))

    # -- point-to-point -------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:
        """``dist.send``/``isend``: posted at once (non-blocking), so rings of sends
        cannot deadlock; the Work completes when the message left. CUDA tensors go
        over a two-rank NCCL communicator for this direction of the pair, on its own
        stream (:meth:`ringcomm.front.lanes.Lanes.pair`; ``tag`` is ignored there: NCCL
        matches by order, as in torch's NCCL backend)."""
        t = self.inputs.single(tensors, "send")
        self.inputs.peer(dstRank, "send", t.device)
        self._in_batch(t, "send")
        entry = self._record_message("send", t, dstRank)
        if t.device.type == self.lanes.nccl_type:
            work = self._pair_message("send", t, dstRank)
        else:
            lane = self.lanes.for_tensor(t, "send", channel=0)
            buf = t if t.is_contiguous() else t.contiguous()
            h = lane.tp.p2p_isend(buf.view(-1).view(torch.uint8), dstRank, tag)
            work = P2PWork("send", lane.engine, lane.tp, h, self.timeout_s)
        if entry is not None:
            self.flight.issued(entry, work, False)
        return self._batched(work)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:
        """``dist.recv``/``irecv`` from ``srcRank``."""
        t = self.inputs.single(tensors, "recv")
        self.inputs.peer(srcRank, "recv", t.device)
        self._in_batch(t, "recv")
        entry = self._record_message("recv", t, srcRank)
        if t.device.type == self.lanes.nccl_type:
            work = self._pair_message("recv", t, srcRank)
        else:
            work = self._post_recv(self.lanes.for_tensor(t, "recv", channel=0), t, srcRank, tag)
        if entry is not None:
            self.flight.issued(entry, work, False)
        return self._batched(work)

    def _record_message(self, kind: str, t: torch.Tensor, peer: int) -> list | None:
        """A send or receive in the flight recorder (torch's name: ``send 0->1``,
        ``recv 1<-0``); its entry, or None when the recorder is off."""
        self.p2p_seq += 1
        if self.flight is None:
            return None
        lib = "nccl" if t.device.type == self.lanes.nccl_type else "gloo"
        arrow = f"{self._rank}->{peer}" if kind == "send" else f"{self._rank}<-{peer}"
        dtype = flight.call_meta("broadcast", lib, ([t],), self._size, kind)
        meta = (f"{lib}:{kind} {arrow}", *dtype[1:5], kind)
        return self.flight.record(self.fr_tag, self.seq, self.p2p_seq, meta, self.timeout_s)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """``dist.recv`` without a source; the Work knows the sender (``_source_rank``)."""
        t = self.inputs.single(tensors, "recv")
        if t.device.type == self.lanes.nccl_type:
            raise ValueError(f"ringcomm recv: a receive from any rank needs MPI; NCCL has "
                             f"none, so a tensor on {t.device} needs the source rank")
        return self._batched(self._post_recv(self.lanes.for_tensor(t, "recv", channel=0), t,
                                             None, tag))

    # -- torch's _coalescing_manager(device=...) ------------------------------------
    def _start_coalescing(self, device: Any) -> None:
        """The sends and receives this thread makes until :meth:`_end_coalescing` are
        one batch, whose Work that call returns (torch's ``_coalescing_manager`` with
        a device, as its NCCL backend serves it). Each is posted at once: none can
        block another (MPI's are non-blocking; on NCCL each direction of a pair has a
        communicator of its own).

        Raises:
            ValueError: a batch is already open on this thread.
        """
        if getattr(self._batch, "works", None) is not None:
            raise ValueError(f"ringcomm _start_coalescing ({self._describe()}): a batch is "
                             "already open on this thread; end it first")
        self._batch.works = []
        self._batch.device = torch.device(device)

    def _end_coalescing(self, device: Any) -> dist.Work:
        """The Work of the batch :meth:`_start_coalescing` opened.

        Raises:
            ValueError: no batch is open on this thread.
        """
        works = getattr(self._batch, "works", None)
        if works is None:
            raise ValueError(f"ringcomm _end_coalescing ({self._describe()}): no batch is "
                             "open on this thread (_start_coalescing first)")
        self._batch.works = self._batch.device = None
        return Batch("coalesced send/recv", works)

    def _in_batch(self, t: torch.Tensor, op: str) -> None:
        """Refuse a tensor of another device type than the open batch's (torch's NCCL
        backend would put it in an NCCL group)."""
        dev = getattr(self._batch, "device", None)
        if dev is not None and t.device.type != dev.type:
            raise ValueError(f"ringcomm {op} ({self._describe()}): a batch of sends and "
                             f"receives on {dev} (_coalescing_manager(device={dev})) was given "
                             f"a tensor on {t.device}; one batch takes one device's tensors")

    def _batched(self, work: dist.Work) -> dist.Work:
        works = getattr(self._batch, "works", None)
        if works is not None:
            works.append(work)
        return work

    def _pair_message(self, kind: str, t: torch.Tensor, peer: int) -> dist.Work:
        # only the pair's communicator of this direction: the group's own are made by
        # its first collective, which every rank calls (a message concerns two ranks)
        lane, pair_peer = self.lanes.pair(t.device, peer, kind, kind == "send")
        call = _PairMessage(f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}",
                            lane, kind == "send", pair_peer)
        return lane.engine.submit(call, (t,), async_op=True, timeout_s=self.timeout_s)

    def _post_recv(self, lane: Lane, t: torch.Tensor, src: int | None, tag: int) -> dist.Work:
        buf = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        h = lane.tp.p2p_irecv(buf.view(-1).view(torch.uint8), src, tag)
        on_done = None if buf is t else (lambda: t.copy_(buf))
        return P2PWork("recv", lane.engine, lane.tp, h, self.timeout_s, on_done)

    # -- lifecycle ------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the group: a collective still running on the CPU ends at once with
        an error, queued ones fail, later calls fail; NCCL communicators are destroyed
        once their work finished (aborted if that takes more than 10 s)."""
        self._release_calls(self.lanes.close(
            "the process group was shut down while this collective ran", 10.0))

    def abort(self) -> None:
        """Like :meth:`shutdown`, without waiting for anything: NCCL communicators are
        aborted and their pending Works fail."""
        self._release_calls(self.lanes.close(
            "the process group was aborted while this collective ran", 0.0))

    def _release_calls(self, idle: bool) -> None:
        """Forget the prepared calls; free their persistent MPI requests unless a
        collective may still be using them (then they go with their objects)."""
        if idle:
            self.calls.close()
        else:
            self.calls.clear()

    def _stop_threads(self, wait_s: float) -> None:
        """At interpreter exit: stop the progress thread; NCCL lanes end without waiting."""
        self.lanes.stop_threads(wait_s)


def traced_bytes(torch_args: tuple) -> int:
    """A collective's size in the trace, as nccl-tests counts it: the larger of its
    outputs' and its inputs' bytes on this rank, each byte of memory once (an
    allreduce of 4,000 bytes is 4,000; an allgather of 4,000 bytes in is its output,
    4,000 times the ranks; a reduce_scatter its input). torch's methods take the
    outputs first, then the inputs; allreduce, broadcast and reduce one list."""
    sides = [list(calls.tensors_in(a)) for a in torch_args[:2]]
    return max((_distinct_bytes(side) for side in sides if side), default=0)


def _distinct_bytes(tensors: list) -> int:
    spans = sorted((t.data_ptr(), t.data_ptr() + calls.nbytes_of(t))
                   for t in tensors if t.numel())
    total, end = 0, 0
    for lo, hi in spans:
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


class _Traced:
    """A prepared call recorded in the trace: its enqueue now, on the caller's thread,
    and its run where it runs (on a stream: the time to issue it)."""

    __slots__ = ("call", "name", "lane", "blocking", "targs", "enqueued")

    def __init__(self, call: Any, nbytes: int, seq: int, group: str):
        self.call, self.name, self.lane = call, call.name, call.lane
        self.blocking = getattr(call, "blocking", False)
        self.targs = {"group": group, "seq": seq, "device": call.lane.key,
                      "channel": call.lane.channel, "bytes": nbytes}
        trace.instant(f"enqueue {self.name}", "enqueue", **self.targs)
        self.enqueued = trace.now()

    def execute(self, *args: Any) -> Any:
        with trace.span(self.name, "collective", enqueued_us=self.enqueued, **self.targs):
            return self.call.execute(*args)

    def touched(self, args: tuple) -> list:
        return self.call.touched(args)


class _PairMessage:
    """A lone send or receive on the NCCL communicator of one direction of a pair: a
    group of its own, as in torch."""

    blocking = False

    def __init__(self, name: str, lane: Lane, send: bool, peer: int):
        self.name, self.lane, self.send, self.peer = name, lane, send, peer

    def execute(self, t: torch.Tensor) -> list:
        tp = self.lane.tp
        tp.group_start()  # not tp.group(): a context manager costs this path a microsecond
        try:
            (tp.send if self.send else tp.recv)(t.view(-1).view(torch.uint8), self.peer)
        except BaseException:
            tp.close_groups()
            raise
        tp.group_end("send" if self.send else "recv")
        return [t]

    def touched(self, args: tuple) -> list:
        return list(args)


def _method(torch_name: str, build: Callable[..., tuple]) -> Callable[..., dist.Work]:
    """The ProcessGroup method ``torch_name``: find (or prepare) the call, then hand
    it to its lane's engine.

    Every call is numbered; the number picks the channel (``Options.num_channels``).
    A call refused on this rank (bad input) starts a new epoch of the group's
    message tags (:meth:`ringcomm.front.planner.Planner.refused`): if it was refused on
    some ranks only, those ranks' next collective carries other tags than the
    others' current one: those ranks' waits fail naming the mismatch ("rank 0 runs a
    call of another epoch") as soon as the new tags arrive, instead of two different
    collectives silently exchanging data (tests/ranks/failure_check.py ``refused``). A collective issued by a future
    callback on a lane's progress thread runs on that lane at once and takes no
    number (:mod:`ringcomm.runtime.engine`).
    """
    def method(self: ProcessGroupRingcomm, *args: Any, **kwargs: Any) -> dist.Work:
        lanes = self.lanes
        if lanes.channels == 1:
            self.seq += 1
        else:
            nested = lanes.nested_lane()
            if nested is None:
                self.seq += 1
                lanes.turn_to(self.seq)
            else:
                lanes.turn_to(nested.channel)
        try:
            call, call_args = build(self, *args, **kwargs)
        except AlgorithmFailed as e:
            # as when a built-in algorithm fails while running: the group is unusable
            err = dist.DistBackendError(f"ringcomm {torch_name} ({self._describe()}, rank "
                                        f"{self._rank} of {self._size}): {e}; the group is "
                                        "unusable now")
            err.__cause__ = e
            lanes.mark_broken(err)
            raise err from e
        except Exception:
            self.planner.refused()
            self.calls.clear()
            raise
        opts = args[-1] if args else kwargs.get("opts")  # torch's options come last
        timeout_s = calls.timeout_of(self, getattr(opts, "timeout", None))
        fr = self.flight
        if fr is not None:
            entry = fr.record(self.fr_tag, self.seq, self.p2p_seq,
                              calls.flight_meta(self, call, torch_name, args), timeout_s)
        order = lanes.order
        if order is not None:  # several channels: keep issue order on the same tensors
            keys, deps = order.after_earlier(call.lane, calls.tensors_in(call_args))
            if deps:
                call = Ordered(call, deps)
        if trace.active():
            call = _Traced(call, traced_bytes(args), self.seq, self._describe())
        work = call.lane.engine.submit(call, call_args, async_op=getattr(opts, "asyncOp", True),
                                       timeout_s=timeout_s)
        if fr is not None:
            fr.issued(entry, work, work.__class__ is Done and work._exc is None)
        if order is not None:
            order.issued(call.lane, keys, work)
        return work

    method.__name__ = torch_name
    method.__qualname__ = f"ProcessGroupRingcomm.{torch_name}"
    method.__doc__ = build.__doc__
    return method


for _name, _build in METHODS.items():
    setattr(ProcessGroupRingcomm, _name, _method(_name, _build))
_generic_allreduce = ProcessGroupRingcomm.allreduce


def _allreduce(self: ProcessGroupRingcomm, tensors: list[torch.Tensor],
               opts: Any = None) -> dist.Work:
    # the short path for the collective every training step calls (its key, its
    # lookup and the engine, with nothing between); any other call goes the generic way
    work = reductions.allreduce_prepared(self, tensors, opts)
    return work if work is not None else _generic_allreduce(self, tensors, opts)


_allreduce.__doc__ = reductions.allreduce.__doc__
_allreduce.__name__ = "allreduce"
_allreduce.__qualname__ = "ProcessGroupRingcomm.allreduce"
ProcessGroupRingcomm.allreduce = _allreduce


def _barrier(self: ProcessGroupRingcomm, opts: Any = None) -> dist.Work:
    # the short path for the barrier on a CPU lane: a training loop calls it between
    # phases, and every step of a generic call before it is a step one rank takes
    # alone after the others left (scripts/bench_barrier.py)
    work = data_movement.barrier_prepared(self, opts)
    return work if work is not None else _generic_barrier(self, opts)


_generic_barrier = ProcessGroupRingcomm.barrier
_barrier.__doc__ = data_movement.barrier.__doc__
_barrier.__name__ = "barrier"
_barrier.__qualname__ = "ProcessGroupRingcomm.barrier"
ProcessGroupRingcomm.barrier = _barrier
forward_collectives([*METHODS, "send", "recv", "recv_anysource"])
