"""The ringcomm ProcessGroup: a table from torch's method names to the request
builders of :mod:`ringcomm.requests`, plus what belongs to the group itself:
its identity, its algorithm choices, point-to-point messages and its end.

A torch call ``pg.allreduce([t], opts)`` goes ``METHODS["allreduce"]`` ->
``requests.allreduce(pg, [t], opts)`` (checks, lane, algorithm) -> a
:class:`~ringcomm.requests.Request` -> the lane's engine, which returns torch's
``Work``.
"""
from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import requests, trace
from .algorithms import check_choice
from .checks import Inputs
from .engine import Engine
from .lanes import Lane, Lanes
from .plans import AlgorithmFailed, Planner
from .requests import Request
from .settings import Options, get
from .transport import Transport
from .work import P2PWork

__all__ = ["ProcessGroupRingcomm", "Options", "METHODS"]

#: torch's ProcessGroup method name -> the request builder that serves it
METHODS: dict[str, Callable[..., Request]] = {
    "allreduce": requests.allreduce,
    "allreduce_coalesced": requests.allreduce_coalesced,
    "reduce": requests.reduce,
    "broadcast": requests.broadcast,
    "allgather": requests.allgather,
    "allgather_coalesced": requests.allgather_coalesced,
    "all_gather_single": requests.all_gather_into_tensor,
    "_allgather_base": requests.all_gather_into_tensor,
    "allgather_into_tensor_coalesced": requests.allgather_into_tensor_coalesced,
    "all_gather_single_coalesced": requests.allgather_into_tensor_coalesced,
    "gather": requests.gather,
    "scatter": requests.scatter,
    "reduce_scatter": requests.reduce_scatter,
    "reduce_scatter_single": requests.reduce_scatter_tensor,
    "_reduce_scatter_base": requests.reduce_scatter_tensor,
    "reduce_scatter_tensor_coalesced": requests.reduce_scatter_tensor_coalesced,
    "reduce_scatter_single_coalesced": requests.reduce_scatter_tensor_coalesced,
    "alltoall": requests.all_to_all,
    "alltoall_base": requests.all_to_all_single,
    "all_to_all_single": requests.all_to_all_single,
    "barrier": requests.barrier,
}


class ProcessGroupRingcomm(dist.ProcessGroup):
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
    """

    def __init__(self, rank: int, size: int, transport: Transport | list[Transport] | None,
                 timeout: timedelta, options: Options | None = None, group_id: str = "", *,
                 store: Any = None, cpu_error: str | None = None, nccl: Any = None,
                 nccl_device_type: str = "cuda", hosts: tuple = ()):
        super().__init__(rank, size)
        # plain ints: rank() and size() cross into C++ on every call
        self._rank, self._size = rank, size
        self._timeout_s = timeout.total_seconds()
        self._group_name = group_id
        self._group_desc = ""
        self.inputs = Inputs(rank, size, nccl_device_type)
        resolved = (options or Options()).resolve()
        self.planner = Planner(rank, size, resolved, hosts)
        #: RINGCOMM_DEBUG=DETAIL: every call is compared across ranks before it runs
        self.detail = get("RINGCOMM_DEBUG") == "DETAIL"
        channels = resolved.num_channels
        transports = [] if transport is None else \
            list(transport) if isinstance(transport, (list, tuple)) else [transport]
        if transports and len(transports) != channels:
            raise ValueError(f"ringcomm: {len(transports)} transports given for "
                             f"num_channels={channels}")
        cpus = [Lane(tp, Engine(tp, self._channel_name(k, channels)), False, k)
                for k, tp in enumerate(transports)]
        self.lanes = Lanes(rank, size, cpus or None, store=store, timeout_s=self._timeout_s,
                           describe=self._describe, cpu_error=cpu_error, nccl=nccl,
                           nccl_type=nccl_device_type, channels=channels)
        #: collectives called so far, refused ones included (see :func:`_method`)
        self._seq = 0

    # -- identity -------------------------------------------------------------
    def getBackendName(self) -> str:
        return "ringcomm"

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

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

    # -- collectives ----------------------------------------------------------
    def _submit(self, req: Request) -> dist.Work:
        """Run (MPI) or enqueue (NCCL) ``req`` on its lane."""
        lane, timeout_s, run = req.lane, self._timeout(req.opts), req.run
        if trace.active():
            run = self._traced(req)
        if lane.on_stream:
            return lane.engine.submit(req.op, run, async_op=True, timeout_s=timeout_s,
                                      keep=req.keep, blocking=req.blocking)
        return lane.engine.submit(req.op, run,
                                  async_op=bool(getattr(req.opts, "asyncOp", True)),
                                  timeout_s=timeout_s, tag=self._seq % lane.tp.tag_limit)

    def _traced(self, req: Request) -> Callable[[], Any]:
        """``req.run`` recorded in the trace: its enqueue now, on the caller's thread,
        and its run where it runs (on a stream: the time to issue it)."""
        args = {"group": self._describe(), "seq": self._seq, "device": req.lane.key,
                "channel": req.lane.channel,
                "bytes": sum(t.numel() * t.element_size() for t in req.keep
                             if isinstance(t, torch.Tensor))}
        trace.instant(f"enqueue {req.op}", "enqueue", **args)
        enqueued = trace.now()

        def run() -> Any:
            with trace.span(req.op, "collective", enqueued_us=enqueued, **args):
                return req.run()

        return run

    def _timeout(self, opts: Any) -> float:
        t = getattr(opts, "timeout", None)
        if isinstance(t, timedelta) and t.total_seconds() > 0:
            return t.total_seconds()
        return self._timeout_s

    # -- point-to-point -------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:
        """``dist.send``/``isend``: posted at once (non-blocking), so rings of sends
        cannot deadlock; the Work completes when the message left. CUDA tensors go
        over a two-rank NCCL communicator of the pair, on its own stream (``tag`` is
        ignored there: NCCL matches by order, as in torch's NCCL backend)."""
        t = self.inputs.single(tensors, "send")
        self.inputs.peer(dstRank, "send")
        lane = self.lanes.for_tensor(t, "send", channel=0)
        if lane.on_stream:
            return self._pair_message("send", t, dstRank)
        buf = t if t.is_contiguous() else t.contiguous()
        h = lane.tp.p2p_isend(buf.view(-1).view(torch.uint8), dstRank, tag)
        return P2PWork("send", lane.engine, lane.tp, h, self._timeout_s)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:
        """``dist.recv``/``irecv`` from ``srcRank``."""
        t = self.inputs.single(tensors, "recv")
        self.inputs.peer(srcRank, "recv")
        lane = self.lanes.for_tensor(t, "recv", channel=0)
        if lane.on_stream:
            return self._pair_message("recv", t, srcRank)
        return self._post_recv(lane, t, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """``dist.recv`` without a source; the Work knows the sender (``_source_rank``)."""
        t = self.inputs.single(tensors, "recv")
        lane = self.lanes.for_tensor(t, "recv", channel=0)
        if lane.on_stream:
            raise ValueError(f"ringcomm recv: a receive from any rank needs MPI; NCCL has "
                             f"none, so a tensor on {t.device} needs the source rank")
        return self._post_recv(lane, t, None, tag)

    def _pair_message(self, kind: str, t: torch.Tensor, peer: int) -> dist.Work:
        lane, pair_peer = self.lanes.pair(t.device, peer, kind)
        tp = lane.tp
        move = tp.send if kind == "send" else tp.recv
        buf = t.view(-1).view(torch.uint8)

        def run():
            tp.group_start()  # a lone message is a group of its own, as in torch
            move(buf, pair_peer)
            tp.group_end(kind)
            return [t]

        return lane.engine.submit(f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}",
                                  run, async_op=True, timeout_s=self._timeout_s, keep=[t])

    def _post_recv(self, lane: Lane, t: torch.Tensor, src: int | None, tag: int) -> dist.Work:
        buf = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        h = lane.tp.p2p_irecv(buf.view(-1).view(torch.uint8), src, tag)
        on_done = None if buf is t else (lambda: t.copy_(buf))
        return P2PWork("recv", lane.engine, lane.tp, h, self._timeout_s, on_done)

    # -- lifecycle ------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the group: a collective still running on the CPU ends at once with
        an error, queued ones fail, later calls fail; NCCL communicators are destroyed
        once their work finished (aborted if that takes more than 10 s)."""
        self.lanes.close("the process group was shut down while this collective ran", 10.0)

    def abort(self) -> None:
        """Like :meth:`shutdown`, without waiting for anything: NCCL communicators are
        aborted and their pending Works fail."""
        self.lanes.close("the process group was aborted while this collective ran", 0.0)

    def _stop_threads(self, wait_s: float) -> None:
        """At interpreter exit: stop the progress thread; NCCL lanes end without waiting."""
        self.lanes.stop_threads(wait_s)


def _method(torch_name: str, build: Callable[..., Request]) -> Callable[..., dist.Work]:
    """The ProcessGroup method ``torch_name``: build the call's request, then submit it.

    Every call is numbered, refused ones included. The number picks the channel
    (``Options.num_channels``) and is the MPI tag of
    the collective's messages: if a call is refused on some ranks only (bad input
    there), those ranks' next collective carries a different tag from the others'
    current one, so the mismatch ends in a clear timeout instead of two different
    collectives silently exchanging data.
    """
    @functools.wraps(build)
    def method(self: ProcessGroupRingcomm, *args: Any, **kwargs: Any) -> dist.Work:
        self._seq += 1
        self.lanes.turn_to(self._seq)
        try:
            req = build(self, *args, **kwargs)
        except AlgorithmFailed as e:
            # as when a built-in algorithm fails while running: the group is unusable
            err = dist.DistBackendError(f"ringcomm {torch_name} ({self._describe()}, rank "
                                        f"{self._rank} of {self._size}): {e}; the group is "
                                        "unusable now")
            err.__cause__ = e
            self.lanes.mark_broken(err)
            raise err from e
        return self._submit(req)

    method.__name__ = torch_name
    method.__qualname__ = f"ProcessGroupRingcomm.{torch_name}"
    return method


for _name, _build in METHODS.items():
    setattr(ProcessGroupRingcomm, _name, _method(_name, _build))
