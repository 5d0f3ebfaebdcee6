"""The ringcomm ProcessGroup: torch's collective calls -> one request each for the engine."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import zlib
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from . import algorithms, checker, ops
from .algorithms import NATIVE, REGISTRY, select
from .algorithms import names as algorithm_names
from .algorithms import ring as _ring
from .engine import Engine
from .executors import Plan
from .schedule import Context, ScheduleError
from .transport import Channel, Transport
from .work import P2PWork

log = logging.getLogger("ringcomm")

DEFAULT_SEGMENT_BYTES = 2 * 1024 * 1024
#: compiled schedules kept per group (least recently used dropped first)
PLAN_CACHE_SIZE = 512
#: a user's schedule is checked symbolically at its real shape up to this many
#: elements over all ranks, at a proportionally smaller shape above it
CHECK_ELEMENTS = 1 << 18


def _collective(method: Callable) -> Callable:
    """Number every collective call, refused ones included.

    The number is the MPI tag of the collective's messages. If a call is refused
    on some ranks only (bad input there), those ranks' next collective carries a
    different tag from the others' current one, so the mismatch ends in a clear
    timeout instead of two different collectives silently exchanging data.
    """
    @functools.wraps(method)
    def numbered(self: "ProcessGroupRingcomm", *args: Any, **kwargs: Any) -> Any:
        self._seq += 1
        return method(self, *args, **kwargs)

    return numbered


@dataclasses.dataclass
class Options:
    """Per-group settings, passed as ``pg_options`` to ``init_process_group`` / ``new_group``.

    Attributes:
        algorithms: collective -> algorithm name (e.g. ``{"allreduce": "ring"}``);
            unlisted collectives use ``RINGCOMM_ALGO`` or ``auto``.
        segment_bytes: pipeline segment size (default ``RINGCOMM_SEGMENT_BYTES`` or 2 MiB).
        tuning_file: JSON tuning table for ``auto`` (default ``RINGCOMM_TUNING``).
    """

    algorithms: dict[str, str] = dataclasses.field(default_factory=dict)
    segment_bytes: int | None = None
    tuning_file: str | None = None


def _parse_algo_env(value: str) -> dict[str, str]:
    """``RINGCOMM_ALGO``: ``ring`` (every collective that has one) or ``allreduce=ring,broadcast=tree``."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        if "=" in item:
            coll, name = (s.strip() for s in item.split("=", 1))
            out[coll] = name
        else:
            for coll, algos in REGISTRY.items():
                if item in algos or item == "auto":
                    out[coll] = item
            if not any(item in a for a in REGISTRY.values()) and item != "auto":
                raise ValueError(f"ringcomm: RINGCOMM_ALGO names unknown algorithm {item!r}")
    return out


def _check_algo(collective: str, name: str) -> None:
    if collective not in REGISTRY:
        raise ValueError(f"ringcomm: unknown collective {collective!r}; known: {sorted(REGISTRY)}")
    if name != "auto" and name not in REGISTRY[collective]:
        raise ValueError(f"ringcomm: no {collective} algorithm {name!r}; available: "
                         f"{algorithm_names(collective)}")


class _Lane:
    """What runs one device's collectives: its channel (MPI transport or NCCL
    communicator) and its engine (progress thread or stream)."""

    __slots__ = ("tp", "engine", "key", "token", "on_stream")

    def __init__(self, tp: Channel, engine: Any, on_stream: bool):
        self.tp = tp
        self.engine = engine
        self.key = str(tp.device)
        #: the barrier's one byte
        self.token = torch.zeros(1, dtype=torch.uint8, device=tp.device)
        #: collectives are enqueued on a stream (NCCL), not run to completion (MPI)
        self.on_stream = on_stream


class ProcessGroupRingcomm(dist.ProcessGroup):
    """A torch process group whose collectives run ringcomm's algorithms: over MPI
    for CPU tensors, over NCCL (through CuPy) for CUDA tensors, chosen per call by
    the tensors' device.

    Created by torch through the registered backend creator; users get it from
    ``dist.init_process_group("ringcomm")`` or ``dist.new_group(..., backend="ringcomm")``.

    Args:
        rank, size: this process's rank in the group and the group size.
        transport: the MPI transport for CPU tensors; None where MPI cannot be loaded
            (``cpu_error`` says why), so CPU tensors are refused.
        timeout: default time limit of every collective.
        options: per-group settings.
        group_id: torch's name of the group.
        store: the group's c10d store; NCCL communicators exchange their ids through it.
        nccl: the ``cupy.cuda.nccl`` module or a stand-in (default: loaded on the
            first CUDA tensor).
        nccl_device_type: tensors of this device type run over NCCL. Tests pass
            ``"cpu"`` with :class:`ringcomm.testing.FakeNccl` to run the NCCL path
            on CPU tensors.
    """

    def __init__(self, rank: int, size: int, transport: Transport | None, timeout: timedelta,
                 options: Options | None = None, group_id: str = "", *, store: Any = None,
                 cpu_error: str | None = None, nccl: Any = None,
                 nccl_device_type: str = "cuda"):
        super().__init__(rank, size)
        # plain ints: rank() and size() cross into C++ on every call
        self._rank, self._size = rank, size
        self._tp = transport
        self._cpu_error = cpu_error
        self._store = store
        self._nccl_lib = nccl
        self._nccl_type = nccl_device_type
        self._lanes: dict[str, _Lane] = {}
        self._pair_lanes: dict[tuple, _Lane] = {}
        self._nccl_count = 0
        self._lanes_lock = threading.Lock()
        self._timeout_s = timeout.total_seconds()
        self._group_name = group_id
        self._group_desc = ""
        options = options or Options()
        env_algos = _parse_algo_env(os.environ.get("RINGCOMM_ALGO", ""))
        self._algos: dict[str, str] = {c: "auto" for c in REGISTRY}
        for coll, name in {**env_algos, **options.algorithms}.items():
            _check_algo(coll, name)
            self._algos[coll] = name
        seg = options.segment_bytes
        if seg is None:
            raw = os.environ.get("RINGCOMM_SEGMENT_BYTES", str(DEFAULT_SEGMENT_BYTES))
            try:
                seg = int(raw)
            except ValueError:
                raise ValueError(f"ringcomm: RINGCOMM_SEGMENT_BYTES must be a whole number of "
                                 f"bytes, got {raw!r}") from None
        if not isinstance(seg, int) or seg <= 0:
            raise ValueError(f"ringcomm: segment_bytes must be positive, got {seg}")
        self.segment_bytes = seg
        self._tuning = select.load_tuning(options.tuning_file)
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._prepared: dict = {}
        self._plans_lock = threading.Lock()
        self._logged_choices: set = set()
        self._check_consistency = os.environ.get("RINGCOMM_DEBUG", "").upper() == "DETAIL"
        self._engine = Engine(transport, self._describe) if transport is not None else None
        self._cpu = _Lane(transport, self._engine, False) if transport is not None else None
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

    def __repr__(self) -> str:
        return f"<ringcomm.ProcessGroup {self._describe()} rank {self._rank}/{self._size}>"

    # -- algorithm choice -----------------------------------------------------
    def set_algorithm(self, collective: str, name: str) -> None:
        """Use algorithm ``name`` (or ``"auto"``) for ``collective`` on this group.

        Every rank of the group must make the same choice before its next collective.
        """
        _check_algo(collective, name)
        self._algos[collective] = name

    def get_algorithm(self, collective: str) -> str:
        return self._algos[collective]

    def algorithm_for(self, collective: str, nbytes: int) -> str:
        """The algorithm a ``collective`` of ``nbytes`` per rank runs on this group."""
        name = self._algos[collective]
        if name == "auto":
            name = select.choose(self._tuning, collective, nbytes, self._size)
            if log.isEnabledFor(logging.INFO):
                key = (collective, name, max(nbytes, 1).bit_length())
                if key not in self._logged_choices:
                    self._logged_choices.add(key)
                    log.info("ringcomm auto: %s of %d B on %d ranks -> %s",
                             collective, nbytes, self._size, name)
        return name

    def _prepare(self, lane: _Lane, collective: str, layout: tuple, dtype: torch.dtype, *,
                 nbytes: int, root: int = 0, op: Any = None,
                 name: str | None = None) -> tuple[str, Callable[[list], None]]:
        """Choose the algorithm for one call and return ``(name, run)``; ``run(bufs)``
        executes it on the caller's buffers (ordered as ``schedule.BUFFERS`` says)
        over ``lane``.

        Runs on the caller's thread, so a schedule a user's builder gets wrong is
        refused here, on every rank alike, before anything is sent.
        """
        key = None
        if name is None:
            # A training loop repeats the same calls: skip choosing and looking up.
            key = (lane.key, collective, layout, dtype, op, root, self._algos[collective],
                   self.segment_bytes, algorithms.generation)
            hit = self._prepared.get(key)
            if hit is not None:
                return hit
            name = self.algorithm_for(collective, nbytes)
        prepared = self._prepare_named(lane.tp, collective, name, layout, dtype, root, op)
        if key is not None:
            if len(self._prepared) >= PLAN_CACHE_SIZE:
                self._prepared.clear()
            self._prepared[key] = prepared
        return prepared

    def _prepare_named(self, tp: Channel, collective: str, name: str, layout: tuple,
                       dtype: torch.dtype, root: int, op: Any) -> tuple[str, Callable[[list], None]]:
        build = REGISTRY[collective].get(name)
        if build is None:
            raise ValueError(f"ringcomm {collective}: algorithm {name!r} is not registered "
                             f"(available: {algorithm_names(collective)})")
        if build is NATIVE:
            tp.check_native(collective, dtype, op)
            return name, lambda bufs: tp.native(collective, bufs, layout, dtype, op, root)
        return name, self._runner(tp, self._plan(collective, name, build, layout, root, dtype),
                                  dtype, op)

    @staticmethod
    def _runner(tp: Channel, plan: Plan, dtype: torch.dtype, op: Any) -> Callable[[list], None]:
        """``run(bufs)``: ``plan`` on the caller's buffers over ``tp``, scratch from it."""

        def scratch(i: int, n: int) -> torch.Tensor:
            return tp.scratch(i, n, dtype)

        def run(bufs: list) -> None:
            tp.execute(plan, plan.bind(bufs, scratch), op)

        return run

    def _plan(self, collective: str, name: str, build: Callable, layout: tuple, root: int,
              dtype: torch.dtype) -> Plan:
        """The compiled schedule for this call shape, from the cache or built (and, for
        an algorithm that did not ship with ringcomm, checked) now."""
        seg = max(1, self.segment_bytes // dtype.itemsize)
        key = (collective, name, build, layout, root, seg, algorithms.generation)
        with self._plans_lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        ctx = Context(collective, self._size, self._rank, layout, root, seg)
        if (collective, name) not in algorithms.BUILTIN:
            schedule = _check_user_schedule(build, ctx, name)
        else:
            schedule = build(ctx)
        plan = Plan(schedule)
        with self._plans_lock:
            self._plans[key] = plan
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        return plan

    # -- devices --------------------------------------------------------------
    def _lane(self, t: torch.Tensor, op: str) -> _Lane:
        """The lane that runs a call on ``t``'s device (created on first use).

        Raises:
            ValueError: the device is not supported, or the library it needs (MPI for
                CPU tensors, CuPy with NCCL for CUDA tensors) is missing.
        """
        return self._device_lane(t.device, op)

    def _device_lane(self, dev: torch.device, op: str) -> _Lane:
        if dev.type == self._nccl_type:
            lane = self._lanes.get(str(dev))
            return lane if lane is not None else self._nccl_lane(dev, op)
        if dev.type == "cpu":
            if self._cpu is None:
                raise ValueError(f"ringcomm {op}: CPU tensors run over MPI, which could not be "
                                 f"loaded here ({self._cpu_error}); move the tensors to a CUDA "
                                 "device, or install MPI (pip install mpich)")
            return self._cpu
        raise ValueError(f"ringcomm {op}: tensors on {dev} are not supported; ringcomm runs "
                         f"CPU tensors over MPI and {self._nccl_type} tensors over NCCL")

    def _nccl_library(self, op: str) -> Any:
        if self._nccl_lib is None:
            from .transport import nccl
            try:
                self._nccl_lib = nccl.load()
            except nccl.NcclUnavailable as e:
                raise ValueError(f"ringcomm {op}: {e}") from None
        return self._nccl_lib

    def _nccl_lane(self, device: torch.device, op: str) -> _Lane:
        """A new NCCL communicator of this group on ``device``: every rank creates its
        k-th at the same call, so the k-th communicators of all ranks are one."""
        lib = self._nccl_library(op)
        with self._lanes_lock:
            lane = self._lanes.get(str(device))
            if lane is None:
                lane = self._new_nccl_lane(lib, device, f"ringcomm/nccl/{self._nccl_count}",
                                           self._rank, self._size)
                self._nccl_count += 1
                self._lanes[str(device)] = lane
        return lane

    def _pair_lane(self, device: torch.device, peer: int, op: str) -> tuple[_Lane, int]:
        """The two-rank NCCL communicator (and its own stream) this rank uses for
        ``dist.send``/``dist.recv`` with ``peer`` on ``device``, as torch's NCCL backend
        does: messages between a pair then never queue behind the group's collectives.
        Returns the lane and the peer's rank in it."""
        lib = self._nccl_library(op)
        lo, hi = min(self._rank, peer), max(self._rank, peer)
        key = (str(device), peer)
        with self._lanes_lock:
            lane = self._pair_lanes.get(key)
            if lane is None:
                # each side counts the pair communicators it made with the other
                n = sum(1 for k in self._pair_lanes if k[1] == peer)
                lane = self._new_nccl_lane(lib, device, f"ringcomm/nccl/p2p/{lo}-{hi}/{n}",
                                           0 if self._rank == lo else 1, 2)
                self._pair_lanes[key] = lane
        return lane, 1 if self._rank == lo else 0

    def _new_nccl_lane(self, lib: Any, device: torch.device, prefix: str, rank: int,
                       size: int) -> _Lane:
        from .streams import StreamEngine, streams_for
        from .transport.nccl import NcclTransport, connect

        if self._store is None:
            raise ValueError("ringcomm: this group has no store to set up NCCL communicators")
        streams = streams_for(device)
        comm = connect(lib, self._store, prefix, rank, size, self._timeout_s,
                       streams.device_context)
        tp = NcclTransport(lib, comm, rank, size, device, streams.handle)
        what = f"{self._describe()}" + ("" if size == self._size else f" (pair {prefix})")
        engine = StreamEngine(tp, streams, lambda: what)
        return _Lane(tp, engine, True)

    # -- plumbing -------------------------------------------------------------
    def _timeout(self, opts: Any) -> float:
        t = getattr(opts, "timeout", None)
        if isinstance(t, timedelta) and t.total_seconds() > 0:
            return t.total_seconds()
        return self._timeout_s

    def _submit(self, lane: _Lane, op: str, fn: Callable[[], Any], opts: Any,
                keep: Any = (), blocking: bool = False) -> dist.Work:
        """Run (MPI) or enqueue (NCCL) collective ``fn`` on ``lane``; ``keep``: the
        tensors it touches (kept alive until it finished on a stream)."""
        if lane.on_stream:
            return lane.engine.submit(op, fn, async_op=True, timeout_s=self._timeout(opts),
                                      keep=keep, blocking=blocking)
        return lane.engine.submit(op, fn, async_op=bool(getattr(opts, "asyncOp", True)),
                                  timeout_s=self._timeout(opts),
                                  tag=self._seq % lane.tp.tag_limit)

    def _check(self, t: Any, op: str, what: str = "tensor",
               like: torch.Tensor | None = None) -> torch.Tensor:
        """Check one tensor argument; ``like``: a tensor of the same call it must share
        a device with."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ringcomm {op}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"ringcomm {op}: {what} has layout {t.layout}; only dense tensors")
        if like is not None and t.device != like.device:
            raise ValueError(f"ringcomm {op}: {what} is on {t.device} but the call's first "
                             f"tensor is on {like.device}; one call takes tensors of one device")
        if t.device.type == self._nccl_type and not t.is_contiguous():
            raise ValueError(f"ringcomm {op}: {what} on {t.device} is not contiguous; NCCL "
                             "needs contiguous tensors (pass t.contiguous())")
        return t

    def _single(self, tensors: list, op: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"ringcomm {op}: expected a list with exactly one tensor "
                             f"(one device per process), got {len(tensors)}")
        return self._check(tensors[0], op)

    def _consistency_check(self, lane: _Lane, op: str, fields: list[int]) -> None:
        """RINGCOMM_DEBUG=DETAIL: every rank must run the same collective with the same
        sizes; compare a fixed-length fingerprint across ranks before running it."""
        if not self._check_consistency or self._size == 1:
            return
        mine = torch.zeros(1 + _FINGERPRINT_FIELDS, dtype=torch.int64)
        mine[0] = zlib.crc32(op.encode())
        mine[1:1 + len(fields)] = torch.tensor(fields[:_FINGERPRINT_FIELDS], dtype=torch.int64)
        dev = lane.tp.device
        rows = torch.empty(self._size, mine.numel(), dtype=torch.int64, device=dev)
        width = mine.numel() * mine.element_size()
        # Always the built-in ring: the user's choice of algorithm is what may be wrong.
        plan = self._plan("allgather", "ring", _ring.allgather, (width,) * self._size, 0,
                          torch.uint8)
        self._runner(lane.tp, plan, torch.uint8, None)(
            [*(_bytes(r) for r in rows.unbind(0)), _bytes(mine.to(dev))])
        rows = rows.cpu()  # on a stream: waits for the exchange
        bad = [r for r in range(self._size) if not torch.equal(rows[r], mine)]
        if bad:
            theirs = "; ".join(f"rank {r} runs {_FINGERPRINT_NAMES.get(rows[r, 0].item(), '?')} "
                               f"{rows[r, 1:].tolist()}" for r in bad)
            raise RuntimeError(f"collective mismatch: rank {self._rank} runs {op} "
                               f"{mine[1:].tolist()}, but {theirs}")

    # -- collectives ----------------------------------------------------------
    @_collective
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """In-place allreduce of ``tensors[0]`` (torch's ``dist.all_reduce``)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        opts = _options(opts, dist.AllreduceOptions)
        t = self._single(tensors, "allreduce")
        op = ops.resolve(opts.reduceOp, t.dtype, "allreduce")
        # Every argument is checked before the lane: the first CUDA call of a group
        # creates its NCCL communicator, with every rank.
        lane = self._lane(t, "allreduce")
        name, algo = self._prepare(lane, "allreduce", (t.numel(),), t.dtype, op=op,
                                   nbytes=t.numel() * t.element_size())
        size = self._size

        def run():
            if self._check_consistency:
                self._consistency_check(lane, "allreduce",
                                        [t.numel(), int(op), _dtype_code(t.dtype)])
            # The hot path of small messages: no context manager for the common case.
            contiguous = t.is_contiguous()
            flat = t if contiguous and t.dim() == 1 else t.contiguous().view(-1)
            if flat.numel():
                algo([flat])
                ops.finalize_(flat, op, size)
                if not contiguous:
                    t.copy_(flat.view_as(t))
            return tensors

        return self._submit(lane, f"allreduce[{name}]", run, opts, tensors)

    @_collective
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """In-place broadcast of ``tensors[0]`` from ``opts.rootRank``."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        opts = _options(opts, dist.BroadcastOptions)
        t = self._single(tensors, "broadcast")
        root = self._root(opts.rootRank, "broadcast")
        if getattr(opts, "rootTensor", 0) != 0:
            raise ValueError(f"ringcomm broadcast: rootTensor must be 0, got {opts.rootTensor}")
        lane = self._lane(t, "broadcast")
        nbytes = t.numel() * t.element_size()
        name, algo = self._prepare(lane, "broadcast", (nbytes,), torch.uint8, nbytes=nbytes,
                                   root=root)

        def run():
            self._consistency_check(lane, "broadcast", [t.numel(), root])
            with _flat(t, copy_in=True) as flat:
                if flat.numel():
                    algo([_bytes(flat)])
            return tensors

        return self._submit(lane, f"broadcast[{name}]", run, opts, tensors)

    @_collective
    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        """``dist.all_gather``: ``output_lists[0][i]`` receives rank i's ``inputs[0]``
        (tensors may differ in size across ranks)."""
        opts = _options(opts, _c10d.AllgatherOptions)
        if len(output_lists) != 1 or len(inputs) != 1:
            raise ValueError(f"ringcomm allgather: expected one output list and one input, got "
                             f"{len(output_lists)} and {len(inputs)}")
        self._check_allgather(output_lists[0], inputs[0], "allgather")
        lane = self._lane(inputs[0], "allgather")
        run = self._allgather_plan(lane, output_lists[0], inputs[0], "allgather")

        def request():
            run()
            return output_lists

        return self._submit(lane, "allgather", request, opts, [*output_lists[0], inputs[0]])

    def _check_allgather(self, outs: list[torch.Tensor], t: torch.Tensor, op: str) -> None:
        self._check(t, op, "input")
        self._check_list(outs, t, op)

    def _allgather_plan(self, lane: _Lane, outs: list[torch.Tensor], t: torch.Tensor,
                        op: str) -> Callable[[], None]:
        # Sizes may differ across ranks; every rank knows all output sizes alike.
        layout = tuple(o.numel() * o.element_size() for o in outs)
        algo = self._prepare(lane, "allgather", layout, torch.uint8, nbytes=max(layout))[1]

        def run():
            self._consistency_check(lane, op, [t.numel()])
            with contextlib.ExitStack() as stack:
                flats = [_bytes(stack.enter_context(_flat(o, copy_in=False))) for o in outs]
                algo([*flats, _bytes(t.reshape(-1).contiguous())])

        return run

    @_collective
    def barrier(self, opts: Any = None) -> dist.Work:
        """Returns (or its Work completes) once every rank of the group has entered.

        Runs over MPI, or over NCCL when torch asks for a CUDA device
        (``dist.barrier(device_ids=[i])``) or MPI is missing; waiting on it then
        blocks the CPU until the barrier completed on the device, as torch's NCCL
        backend does."""
        opts = _options(opts, dist.BarrierOptions)
        lane = self._barrier_lane(opts)
        name, algo = self._prepare(lane, "barrier", (1,), torch.uint8, nbytes=0)

        def run():
            self._consistency_check(lane, "barrier", [])
            algo([lane.token])
            return []

        return self._submit(lane, f"barrier[{name}]", run, opts, blocking=True)

    def _barrier_lane(self, opts: Any) -> _Lane:
        dev = getattr(opts, "device", None)
        ids = list(getattr(opts, "device_ids", None) or [])
        if ids and (dev is None or dev.type == "cpu") and self._nccl_type == "cuda":
            dev = torch.device("cuda", ids[0])
        if isinstance(dev, torch.device) and dev.type == self._nccl_type:
            if dev.type == "cuda" and dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            return self._device_lane(dev, "barrier")
        if self._cpu is not None:
            return self._cpu
        if self._lanes:  # no MPI: the first device this group used
            return next(iter(self._lanes.values()))
        if self._nccl_type == "cuda" and torch.cuda.is_available():
            return self._device_lane(torch.device("cuda", torch.cuda.current_device()), "barrier")
        return self._device_lane(torch.device("cpu"), "barrier")

    @_collective
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Allreduce several tensors as one collective: packed into one buffer per
        dtype, reduced once, unpacked."""
        opts = _options(opts, dist.AllreduceCoalescedOptions)
        if not tensors:
            raise ValueError("ringcomm allreduce_coalesced: no tensors given")
        ts = [self._check(t, "allreduce_coalesced", f"tensor {i}", like=tensors[0])
              for i, t in enumerate(tensors)]
        lane = self._lane(ts[0], "allreduce_coalesced")
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in ts:
            groups.setdefault(t.dtype, []).append(t)
        plan = []
        for dtype, members in groups.items():
            op = ops.resolve(opts.reduceOp, dtype, "allreduce_coalesced")
            n = sum(t.numel() for t in members)
            plan.append((members, op, self._prepare(lane, "allreduce", (n,), dtype, op=op,
                                                    nbytes=n * dtype.itemsize)[1]))
        size = self._size

        def run():
            for members, op, algo in plan:
                flat = torch.cat([t.reshape(-1) for t in members])
                self._consistency_check(lane, "allreduce_coalesced", [flat.numel(), int(op)])
                if flat.numel():
                    algo([flat])
                    ops.finalize_(flat, op, size)
                off = 0
                for t in members:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()
            return tensors

        return self._submit(lane, "allreduce_coalesced", run, opts, tensors)

    @_collective
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Reduce ``tensors[0]`` of every rank into ``tensors[0]`` of ``opts.rootRank``;
        other ranks' tensors are left unchanged."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        opts = _options(opts, dist.ReduceOptions)
        t = self._single(tensors, "reduce")
        op = ops.resolve(opts.reduceOp, t.dtype, "reduce")
        root = self._root(opts.rootRank, "reduce")
        lane = self._lane(t, "reduce")
        name, algo = self._prepare(lane, "reduce", (t.numel(),), t.dtype, op=op, root=root,
                                   nbytes=t.numel() * t.element_size())
        size, me = self._size, self._rank

        def run():
            self._consistency_check(lane, "reduce", [t.numel(), int(op), root])
            with _flat(t) as flat:
                if flat.numel():
                    work = flat if me == root else flat.clone()  # partial sums stay private
                    algo([work])
                    if me == root:
                        ops.finalize_(flat, op, size)
            return tensors

        return self._submit(lane, f"reduce[{name}]", run, opts, tensors)

    @_collective
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> dist.Work:
        """``dist.all_gather_into_tensor``: rank i's input fills the i-th slice of output."""
        opts = _options(opts, _c10d.AllgatherOptions)
        self._check_gather_single(output, input, "all_gather_into_tensor")
        lane = self._lane(input, "all_gather_into_tensor")
        return self._submit(lane, "all_gather_into_tensor",
                            self._gather_into_plan(lane, [(output, input)]), opts,
                            (output, input))

    _allgather_base = all_gather_single

    @_collective
    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Several ``all_gather_into_tensor`` as one request."""
        opts = _options(opts, _c10d.AllgatherOptions)
        if len(outputs) != len(inputs):
            raise ValueError(f"ringcomm allgather_into_tensor_coalesced: {len(outputs)} outputs "
                             f"for {len(inputs)} inputs")
        if not inputs:
            raise ValueError("ringcomm allgather_into_tensor_coalesced: no tensors given")
        for o, i in zip(outputs, inputs):
            self._check_gather_single(o, i, "allgather_into_tensor_coalesced", inputs[0])
        lane = self._lane(inputs[0], "allgather_into_tensor_coalesced")
        return self._submit(lane, "allgather_into_tensor_coalesced",
                            self._gather_into_plan(lane, list(zip(outputs, inputs)), outputs),
                            opts, [*outputs, *inputs])

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _check_gather_single(self, out: torch.Tensor, inp: torch.Tensor, op: str,
                             like: torch.Tensor | None = None) -> None:
        self._check(inp, op, "input", like)
        self._check(out, op, "output", inp)
        if out.dtype != inp.dtype:
            raise ValueError(f"ringcomm {op}: output dtype {out.dtype} != input dtype {inp.dtype}")
        if out.numel() != inp.numel() * self._size:
            raise ValueError(f"ringcomm {op}: output has {out.numel()} elements, expected "
                             f"{self._size} x {inp.numel()} (world size x input)")

    def _gather_into_plan(self, lane: _Lane, pairs: list, value: Any = None) -> Callable[[], Any]:
        p = self._size
        algos = []
        for _, i in pairs:
            nbytes = i.numel() * i.element_size()
            algos.append(self._prepare(lane, "allgather", (nbytes,) * p, torch.uint8,
                                       nbytes=nbytes)[1])

        def run():
            for (out, inp), algo in zip(pairs, algos):
                self._consistency_check(lane, "all_gather_into_tensor", [inp.numel()])
                with _flat(out, copy_in=False) as flat:
                    if flat.numel():
                        # any input strides (a copy only if it must)
                        src = _bytes(inp.reshape(-1).contiguous())
                        algo([*_bytes(flat).view(p, -1).unbind(0), src])
            return value if value is not None else [pairs[0][0]]

        return run

    @_collective
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.all_gather_coalesced``: several ``all_gather`` calls as one request.
        ``output_lists[r][i]`` receives rank r's ``inputs[i]`` (torch's layout; the
        inputs may differ in shape, empty ones included)."""
        opts = _options(opts, _c10d.AllgatherOptions)
        op, p = "allgather_coalesced", self._size
        if not inputs:
            raise ValueError(f"ringcomm {op}: no input tensors given")
        if len(output_lists) != p or any(len(o) != len(inputs) for o in output_lists):
            raise ValueError(f"ringcomm {op}: expected {p} output lists (one per rank), each "
                             f"with {len(inputs)} tensors (one per input); got lists of "
                             f"lengths {[len(o) for o in output_lists]}")
        for i, x in enumerate(inputs):
            self._check(x, op, f"input {i}", like=inputs[0])
            self._check_allgather([output_lists[r][i] for r in range(p)], x, op)
        lane = self._lane(inputs[0], op)
        runs = [self._allgather_plan(lane, [output_lists[r][i] for r in range(p)], inp, op)
                for i, inp in enumerate(inputs)]

        def run():
            for r in runs:
                r()
            return output_lists

        return self._submit(lane, "allgather_coalesced", run, opts,
                            [*inputs, *(o for outs in output_lists for o in outs)])

    @_collective
    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> dist.Work:
        """``dist.gather``: on the root ``output_lists[0][i]`` receives rank i's input;
        other ranks pass ``output_lists == []``."""
        opts = _options(opts, dist.GatherOptions)
        t = self._single(inputs, "gather")
        root = self._root(opts.rootRank, "gather")
        outs = self._root_list(output_lists, t, root, "gather", "output")
        lane = self._lane(t, "gather")
        name, algo = self._prepare(lane, "gather", self._rooted_layout(outs, t), torch.uint8,
                                   nbytes=0, root=root)  # ranks may hold different sizes

        def run():
            self._consistency_check(lane, "gather", [t.numel(), root])
            with contextlib.ExitStack() as stack:
                src = _bytes(stack.enter_context(_flat(t)))
                chunks = [None] * self._size
                if outs is not None:
                    chunks = [_bytes(stack.enter_context(_flat(o, copy_in=False))) for o in outs]
                algo([*chunks, src])
            return output_lists

        return self._submit(lane, f"gather[{name}]", run, opts, [t, *(outs or ())])

    @_collective
    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                opts: Any = None) -> dist.Work:
        """``dist.scatter``: rank i's ``outputs[0]`` receives the root's
        ``input_lists[0][i]``; other ranks pass ``input_lists == []``."""
        opts = _options(opts, dist.ScatterOptions)
        t = self._single(outputs, "scatter")
        root = self._root(opts.rootRank, "scatter")
        ins = self._root_list(input_lists, t, root, "scatter", "input")
        lane = self._lane(t, "scatter")
        name, algo = self._prepare(lane, "scatter", self._rooted_layout(ins, t), torch.uint8,
                                   nbytes=0, root=root)  # ranks may hold different sizes

        def run():
            self._consistency_check(lane, "scatter", [t.numel(), root])
            with contextlib.ExitStack() as stack:
                dst = _bytes(stack.enter_context(_flat(t, copy_in=False)))
                chunks = [None] * self._size
                if ins is not None:
                    chunks = [_bytes(stack.enter_context(_flat(i))) for i in ins]
                algo([*chunks, dst])
            return outputs

        return self._submit(lane, f"scatter[{name}]", run, opts, [t, *(ins or ())])

    @_collective
    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter``: rank i's output is the reduction of everyone's
        ``input_lists[0][i]``. Inputs are not modified."""
        opts = _options(opts, dist.ReduceScatterOptions)
        t = self._single(outputs, "reduce_scatter")
        if len(input_lists) != 1:
            raise ValueError(f"ringcomm reduce_scatter: expected one input list, got "
                             f"{len(input_lists)}")
        ins = self._check_list(input_lists[0], t, "reduce_scatter")
        return self._reduce_scatter_request("reduce_scatter", [(t, ins)], opts, outputs)

    @_collective
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter_tensor``: the input holds world-size equal slices;
        rank i's output is the reduction of everyone's i-th slice."""
        opts = _options(opts, dist.ReduceScatterOptions)
        return self._reduce_scatter_request("reduce_scatter_tensor",
                                            [self._slices(output, input)], opts, [output])

    _reduce_scatter_base = reduce_scatter_single

    @_collective
    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Several ``reduce_scatter_tensor`` as one request."""
        opts = _options(opts, dist.ReduceScatterOptions)
        if len(outputs) != len(inputs):
            raise ValueError(f"ringcomm reduce_scatter_tensor_coalesced: {len(outputs)} "
                             f"outputs for {len(inputs)} inputs")
        return self._reduce_scatter_request(
            "reduce_scatter_tensor_coalesced",
            [self._slices(o, i) for o, i in zip(outputs, inputs)], opts, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _slices(self, out: torch.Tensor, inp: torch.Tensor) -> tuple:
        op = "reduce_scatter_tensor"
        self._check(out, op, "output")
        self._check(inp, op, "input", out)
        if out.dtype != inp.dtype:
            raise ValueError(f"ringcomm {op}: output dtype {out.dtype} != input dtype {inp.dtype}")
        if inp.numel() != out.numel() * self._size:
            raise ValueError(f"ringcomm {op}: input has {inp.numel()} elements, expected "
                             f"{self._size} x {out.numel()} (world size x output)")
        return out, list(inp.reshape(-1).view(self._size, -1).unbind(0)) if out.numel() else \
            [inp.reshape(-1)[:0]] * self._size

    def _reduce_scatter_request(self, name: str, jobs: list, opts: Any, value: Any) -> dist.Work:
        if not jobs:
            raise ValueError(f"ringcomm {name}: no tensors given")
        out0 = jobs[0][0]
        op = ops.resolve(opts.reduceOp, out0.dtype, name)
        for k, (out, ins) in enumerate(jobs):
            ops.resolve(opts.reduceOp, out.dtype, name)
            self._check(out, name, f"output {k}", out0)
            for i, x in enumerate(ins):
                self._check(x, name, f"input {i} of output {k}", out0)
        lane = self._lane(out0, name)
        algos = [self._prepare(lane, "reduce_scatter", tuple(i.numel() for i in ins), out.dtype, op=op,
                               nbytes=sum(i.numel() for i in ins) * out.element_size())[1]
                 for out, ins in jobs]
        size = self._size

        def run():
            for (out, ins), algo in zip(jobs, algos):
                self._consistency_check(lane, name, [out.numel(), int(op)])
                work = torch.cat([i.reshape(-1) for i in ins])  # the ring writes partial sums
                chunks, off = [], 0
                for i in ins:
                    chunks.append(work[off:off + i.numel()])
                    off += i.numel()
                with _flat(out, copy_in=False) as flat:
                    algo([*chunks, flat])
                    ops.finalize_(flat, op, size)
            return value

        return self._submit(lane, name, run, opts,
                            [t for out, ins in jobs for t in (out, *ins)])

    @_collective
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        """``dist.all_to_all``: ``inputs[j]`` of rank i lands in ``outputs[i]`` of rank j."""
        opts = _options(opts, dist.AllToAllOptions)
        p = self._size
        for what, lst in (("output", outputs), ("input", inputs)):
            if len(lst) != p:
                raise ValueError(f"ringcomm all_to_all: {len(lst)} {what} tensors, expected one "
                                 f"per rank ({p})")
        for i, (o, x) in enumerate(zip(outputs, inputs)):
            self._check(o, "all_to_all", f"output {i}", inputs[0])
            self._check(x, "all_to_all", f"input {i}", inputs[0])
            if o.dtype != inputs[0].dtype or x.dtype != inputs[0].dtype:
                raise ValueError("ringcomm all_to_all: all tensors must share one dtype")
        if outputs[self._rank].numel() != inputs[self._rank].numel():
            raise ValueError(f"ringcomm all_to_all: output {self._rank} has "
                             f"{outputs[self._rank].numel()} elements but input "
                             f"{self._rank} has {inputs[self._rank].numel()}")
        layout = (tuple(x.numel() * x.element_size() for x in inputs),
                  tuple(o.numel() * o.element_size() for o in outputs))
        lane = self._lane(inputs[0], "all_to_all")
        name, algo = self._prepare(lane, "alltoall", layout, torch.uint8,
                                   nbytes=0)  # ranks may hold different sizes

        def run():
            self._consistency_check(lane, "all_to_all", [])
            with contextlib.ExitStack() as stack:
                sends = [_bytes(stack.enter_context(_flat(x))) for x in inputs]
                recvs = [_bytes(stack.enter_context(_flat(o, copy_in=False))) for o in outputs]
                algo([*sends, *recvs])
            return outputs

        return self._submit(lane, f"all_to_all[{name}]", run, opts, [*outputs, *inputs])

    @_collective
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> dist.Work:
        """``dist.all_to_all_single``: split along dim 0 (equal splits when the size
        lists are empty, else the given row counts, zeros allowed)."""
        opts = _options(opts, dist.AllToAllOptions)
        op = "all_to_all_single"
        self._check(input, op, "input")
        self._check(output, op, "output", input)
        if output.dtype != input.dtype:
            raise ValueError(f"ringcomm {op}: output dtype {output.dtype} != input dtype "
                             f"{input.dtype}")
        sends = self._split_rows(input, list(input_split_sizes), "input")
        recvs = self._split_rows(output, list(output_split_sizes), "output")
        lane = self._lane(input, op)
        item = input.element_size()
        layout = (tuple((b - a) * item for a, b in sends), tuple((b - a) * item for a, b in recvs))
        name, algo = self._prepare(lane, "alltoall", layout, torch.uint8,
                                   nbytes=0)  # ranks may hold different sizes

        def run():
            self._consistency_check(lane, op, [])
            with _flat(input) as src, _flat(output, copy_in=False) as dst:
                algo([*(_bytes(src[a:b]) for a, b in sends),
                      *(_bytes(dst[a:b]) for a, b in recvs)])
            return [output]

        return self._submit(lane, f"{op}[{name}]", run, opts, (output, input))

    def _split_rows(self, t: torch.Tensor, splits: list[int], what: str) -> list[tuple[int, int]]:
        p = self._size
        rows = t.shape[0] if t.dim() else 1
        if not splits:
            if rows % p:
                raise ValueError(f"ringcomm all_to_all_single: {what} has {rows} rows, not "
                                 f"divisible by the world size {p}; pass split sizes")
            splits = [rows // p] * p
        if len(splits) != p or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"ringcomm all_to_all_single: {what} split sizes {splits} must be "
                             f"{p} non-negative row counts summing to {rows}")
        per_row = t.numel() // rows if rows else 0
        bounds, a = [], 0
        for s in splits:
            bounds.append((a * per_row, (a + s) * per_row))
            a += s
        return bounds

    # -- point-to-point -------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:
        """``dist.send``/``isend``: posted at once (non-blocking), so rings of sends
        cannot deadlock; the Work completes when the message left. CUDA tensors go
        over a two-rank NCCL communicator of the pair, on its own stream (``tag`` is
        ignored there: NCCL matches by order, as in torch's NCCL backend)."""
        t = self._single(tensors, "send")
        self._peer(dstRank, "send")
        lane = self._lane(t, "send")
        if lane.on_stream:
            return self._pair_message("send", t, dstRank)
        buf = t if t.is_contiguous() else t.contiguous()
        h = lane.tp.p2p_isend(_bytes(buf.view(-1)), dstRank, tag)
        return P2PWork("send", lane.engine, lane.tp, h, self._timeout_s)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:
        """``dist.recv``/``irecv`` from ``srcRank``."""
        t = self._single(tensors, "recv")
        self._peer(srcRank, "recv")
        lane = self._lane(t, "recv")
        if lane.on_stream:
            return self._pair_message("recv", t, srcRank)
        return self._post_recv(lane, t, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """``dist.recv`` without a source; the Work knows the sender (``_source_rank``)."""
        t = self._single(tensors, "recv")
        lane = self._lane(t, "recv")
        if lane.on_stream:
            raise ValueError(f"ringcomm recv: a receive from any rank needs MPI; NCCL has "
                             f"none, so a tensor on {t.device} needs the source rank")
        return self._post_recv(lane, t, None, tag)

    def _pair_message(self, kind: str, t: torch.Tensor, peer: int) -> dist.Work:
        lane, pair_peer = self._pair_lane(t.device, peer, kind)
        tp = lane.tp
        move = tp.send if kind == "send" else tp.recv
        buf = _bytes(t.view(-1))

        def run():
            tp.group_start()  # a lone message is a group of its own, as in torch
            move(buf, pair_peer)
            tp.group_end(kind)
            return [t]

        return lane.engine.submit(f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}",
                                  run, async_op=True, timeout_s=self._timeout_s, keep=[t])

    def _post_recv(self, lane: _Lane, t: torch.Tensor, src: int | None, tag: int) -> dist.Work:
        buf = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        h = lane.tp.p2p_irecv(_bytes(buf.view(-1)), src, tag)
        on_done = None if buf is t else (lambda: t.copy_(buf))
        return P2PWork("recv", lane.engine, lane.tp, h, self._timeout_s, on_done)

    def _peer(self, peer: int, op: str) -> None:
        if not 0 <= peer < self._size:
            raise ValueError(f"ringcomm {op}: peer rank {peer} is out of range for a group "
                             f"of {self._size}")
        if peer == self._rank:
            raise ValueError(f"ringcomm {op}: rank {peer} cannot {op} to/from itself")

    # -- helpers --------------------------------------------------------------
    def _root_list(self, lists: list, like: torch.Tensor, root: int, op: str,
                   what: str) -> list[torch.Tensor] | None:
        """The root's tensor list of gather/scatter (None on other ranks, which must
        pass none)."""
        if self._rank == root:
            if len(lists) != 1:
                raise ValueError(f"ringcomm {op}: the root needs one {what} list, got {len(lists)}")
            return self._check_list(lists[0], like, op)
        if lists and any(len(x) for x in lists):
            raise ValueError(f"ringcomm {op}: only the root (rank {root}) takes {what}s")
        return None

    def _check_list(self, lst: list, like: torch.Tensor, op: str) -> list[torch.Tensor]:
        if len(lst) != self._size:
            raise ValueError(f"ringcomm {op}: the tensor list has {len(lst)} tensors, "
                             f"expected one per rank ({self._size})")
        for i, x in enumerate(lst):
            self._check(x, op, f"tensor {i} of the list", like)
            if x.dtype != like.dtype:
                raise ValueError(f"ringcomm {op}: tensor {i} of the list has dtype {x.dtype}, "
                                 f"expected {like.dtype}")
        if lst[self._rank].numel() != like.numel():
            raise ValueError(f"ringcomm {op}: tensor {self._rank} of the list has "
                             f"{lst[self._rank].numel()} elements, this rank's tensor has "
                             f"{like.numel()}")
        return lst

    def _rooted_layout(self, chunks: list[torch.Tensor] | None, mine: torch.Tensor) -> tuple:
        """Gather/scatter layout in bytes: the root knows every chunk, others their own."""
        if chunks is not None:
            return tuple(c.numel() * c.element_size() for c in chunks)
        own = mine.numel() * mine.element_size()
        return tuple(own if i == self._rank else None for i in range(self._size))

    def _root(self, root: int, op: str) -> int:
        if not 0 <= root < self._size:
            raise ValueError(f"ringcomm {op}: root rank {root} is out of range for a group "
                             f"of {self._size}")
        return root

    # -- lifecycle ------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the group: a collective still running on the CPU ends at once with
        an error, queued ones fail, later calls fail; NCCL communicators are destroyed
        once their work finished (aborted if that takes more than 10 s)."""
        self._close("the process group was shut down while this collective ran", 10.0)

    def abort(self) -> None:
        """Like :meth:`shutdown`, without waiting for anything: NCCL communicators are
        aborted and their pending Works fail."""
        self._close("the process group was aborted while this collective ran", 0.0)

    def _close(self, reason: str, nccl_wait_s: float) -> None:
        if self._engine is not None:
            self._engine.shutdown(wait_s=5.0, interrupt=reason)
            self._tp.close()
        with self._lanes_lock:
            lanes = [*self._lanes.values(), *self._pair_lanes.values()]
            self._lanes, self._pair_lanes = {}, {}
        for lane in lanes:
            lane.engine.close(nccl_wait_s)

    def _stop_threads(self, wait_s: float) -> None:
        """At interpreter exit: stop the progress thread; NCCL communicators are
        destroyed if idle, else aborted (left to CuPy's finalizer, a destroy could
        wait for work that never finishes)."""
        if self._engine is not None:
            self._engine.shutdown(wait_s=wait_s)
        for lane in [*self._lanes.values(), *self._pair_lanes.values()]:
            lane.engine.close(0.0)


def _options(opts: Any, cls: type) -> Any:
    """Accept what torch's own ProcessGroup bindings accept from Python callers:
    an options object, None, a ReduceOp (DDP's join passes one) or a root rank."""
    if opts is None:
        return cls()
    if isinstance(opts, cls):
        return opts
    out = cls()
    if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)) and hasattr(out, "reduceOp"):
        out.reduceOp = opts
        return out
    if isinstance(opts, int) and hasattr(out, "rootRank"):
        out.rootRank = opts
        return out
    raise TypeError(f"ringcomm: expected {cls.__name__}, got {type(opts).__name__}")


_FINGERPRINT_FIELDS = 4
_FINGERPRINT_NAMES = {zlib.crc32(n.encode()): n for n in (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "allgather_coalesced",
    "all_gather_into_tensor", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced", "all_to_all", "all_to_all_single", "barrier")}


def _check_user_schedule(build: Callable, ctx: Context, name: str):
    """Check a user's builder for this call shape and return this rank's schedule,
    the very one that was checked (every rank checks the same, so every rank
    refuses a wrong schedule alike).

    At the real shape: bounds, matching and freedom from deadlock always, contents
    too up to ``CHECK_ELEMENTS`` elements over all ranks (and 62 ranks); above that
    the contents are checked at a proportionally smaller shape with the same
    number of segments per chunk.

    Raises:
        ScheduleError: (a ValueError) naming the algorithm, step and element at fault.
    """
    coll, p, r, lay = ctx.collective, ctx.size, ctx.rank, ctx.layout
    # The checker needs every rank's view; where a rank knows only its own sizes
    # (gather/scatter non-roots, alltoall) a consistent global layout stands in;
    # this rank's part of it is exactly its own layout.
    if coll in ("gather", "scatter"):
        own = lay[r]
        layout = tuple(own if c is None else c for c in lay)
    elif coll == "alltoall":
        sends, recvs = lay
        layout = tuple(tuple(sends[j] if i == r else recvs[i] if j == r else 1
                             for j in range(p)) for i in range(p))
    else:
        layout = lay
    total = sum(_leaves(layout)) * max(p, 1)
    small = total <= CHECK_ELEMENTS and p <= checker.MAX_RANKS
    try:
        scheds = checker.schedules(build, coll, p, layout, ctx.root, ctx.seg)
        checker.check(build, coll, p, layout, root=ctx.root, seg=ctx.seg, symbolic=small,
                      built=scheds)
        if not small and p <= checker.MAX_RANKS:  # same segments per chunk, fewer elements
            f = -(-total // CHECK_ELEMENTS)
            checker.check(build, coll, p, _scaled(layout, f), root=ctx.root,
                          seg=max(1, ctx.seg // f))
    except ScheduleError as e:
        raise ScheduleError(f"ringcomm: algorithm {name!r} is wrong: {e}") from None
    return scheds[r]


def _leaves(layout) -> list[int]:
    out = []
    for x in layout:
        if isinstance(x, tuple):
            out.extend(_leaves(x))
        elif x is not None:
            out.append(x)
    return out


def _scaled(layout, f: int):
    return tuple(_scaled(x, f) if isinstance(x, tuple) else -(-x // f) for x in layout)


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Non-reducing collectives move bytes: one code path for every dtype."""
    return t.view(torch.uint8)


@contextlib.contextmanager
def _flat(t: torch.Tensor, copy_in: bool = True) -> Iterator[torch.Tensor]:
    """A 1-D contiguous view of ``t``; a non-contiguous ``t`` gets a temporary copy
    that is written back afterwards."""
    if t.is_contiguous():
        yield t.view(-1)
        return
    tmp = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype, device=t.device)
    yield tmp.view(-1)
    t.copy_(tmp)
