"""One function per torch collective: it checks the call's arguments and returns
``(call, args)``: the *prepared call* of the call's shape and what this call
passes to it. The lane's engine runs ``call.execute(*args)``.

A prepared call (:class:`Call`) is made on the first call of a shape (group,
lane, collective, dtype, sizes, op, root, algorithm): every argument check, the
algorithm's choice and its program (:mod:`ringcomm.schedules.executors`: the compiled
schedule, scratch, persistent requests) are done then, once. A later call of
the shape finds it by a key made of what defines the shape, checks only what
the key cannot vouch for (the tensor's type and layout, its contiguity, the
sizes of list entries), and runs.

Each function takes the group first and then torch's arguments, in the order
torch's ``ProcessGroup`` methods take them; ``ringcomm.front.process_group.METHODS``
maps torch's method names (aliases included) to them.

Every argument is checked before the lane is chosen: the first CUDA call of a
group creates its NCCL communicator, with every rank.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from ringcomm import algorithms, ops, trace
from ringcomm.front.arguments import Inputs, options
from ringcomm.front.fingerprints import Fingerprints, dtype_code
from ringcomm.front.lanes import Lane, Lanes
from ringcomm.front.plans import Planner

_Tensor = torch.Tensor
_strided = torch.strided
_uint8 = torch.uint8
_AllreduceOptions = dist.AllreduceOptions
#: prepared calls a group keeps (the oldest dropped first)
CALLS = 256


class Group(Protocol):
    """What a request builder uses of its process group."""

    inputs: Inputs
    lanes: Lanes
    planner: Planner
    calls: "Calls"
    #: ``RINGCOMM_DEBUG=DETAIL``: compare every call across ranks before running it
    detail: bool
    fingerprints: Fingerprints
    #: collectives called so far, and the default time limit of each
    seq: int
    timeout_s: float


class Calls(dict):
    """A group's prepared calls by shape key (a dict: the lookup is the short path's
    first step). Every key ends with the registry's generation, so a call prepared
    before an algorithm was registered or replaced is never found again. Bounded
    (the oldest dropped first), emptied when a call is refused (a new epoch:
    messages get new tags)."""

    def __init__(self, limit: int = CALLS):
        super().__init__()
        self.limit = limit

    def put(self, key: Any, call: "Call") -> "Call":
        if len(self) >= self.limit:
            # not closed here: a queued collective may still hold it; its requests
            # are freed with it (mpi4py frees the requests it made)
            del self[next(iter(self))]
        self[key] = call
        return call

    def close(self) -> None:
        """Forget and release every call (nothing may be running)."""
        calls = list(self.values())
        self.clear()
        for call in calls:
            call.close()


class Call:
    """What every call of one shape shares, made on the first.

    Attributes:
        name: the call's name in errors, logs and traces (``"allreduce[ring]"``).
        lane: where it runs.
        programs: the programs it owns (closed with it).
        blocking: waiting on it blocks the CPU even on a stream (barrier).
    """

    __slots__ = ("name", "lane", "programs", "detail", "g")
    blocking = False

    def __init__(self, g: Group, lane: Lane, op: str, prepared: Sequence[tuple]):
        names = sorted({n for n, _ in prepared})
        self.name = f"{op}[{'+'.join(names)}]"
        self.lane = lane
        self.programs = [p for _, p in prepared]
        self.detail = g.detail
        self.g = g

    def execute(self, *args: Any) -> Any:
        """Run the collective on this call's tensors; return the Work's result."""
        raise NotImplementedError

    def touched(self, args: Sequence) -> list[torch.Tensor]:
        """The tensors the call reads or writes, its scratch included (kept alive
        while it runs on a stream)."""
        return [*tensors_in(args), *(t for p in self.programs for t in getattr(p, "scratch", ()))]

    def same_call(self, op: str, fields: list[int]) -> None:
        """``RINGCOMM_DEBUG=DETAIL``: every rank runs the same call."""
        self.g.fingerprints.compare(self.lane, op, fields)

    def close(self) -> None:
        for p in self.programs:
            p.close()


def tensors_in(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``x`` (nested lists and tuples)."""
    if isinstance(x, _Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors_in(y)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Non-reducing collectives move bytes: one code path for every dtype."""
    return t.view(_uint8)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _lookup(g: Group, key: Any, make) -> Call:
    call = g.calls.get(key)
    if call is None:
        call = g.calls.put(key, make())
    return call


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


# -- reductions -----------------------------------------------------------------
class _Allreduce(Call):
    __slots__ = ("run", "n", "contiguous", "avg", "size", "fields")

    def __init__(self, g: Group, lane: Lane, t: torch.Tensor, op, contiguous: bool):
        prepared = g.planner.prepare(lane, "allreduce", (t.numel(),), t.dtype, op=op,
                                     nbytes=_nbytes(t))
        super().__init__(g, lane, "allreduce", [prepared])
        self.run = self.programs[0].run
        self.n = t.numel()
        self.contiguous = contiguous
        self.size = g.inputs.size
        self.avg = op if op == ops.AVG and self.size > 1 else None
        self.fields = [t.numel(), int(op), dtype_code(t.dtype)]

    def execute(self, t: torch.Tensor, tensors: list) -> list:
        if self.detail:
            self.same_call("allreduce", self.fields)
        if not self.n:
            return tensors
        if self.contiguous:
            flat = t if t.dim() == 1 else t.view(-1)
            self.run([flat])
        else:
            flat = t.contiguous().view(-1)
            self.run([flat])
        if self.avg is not None:
            ops.finalize_(flat, self.avg, self.size)
        if not self.contiguous:
            t.copy_(flat.view_as(t))
        return tensors


def allreduce(g: Group, tensors: list[torch.Tensor], opts: Any = None) -> tuple:
    """In-place allreduce of ``tensors[0]`` (``dist.all_reduce``)."""
    # the short path: what the key cannot vouch for is the tensor's type and layout
    if type(tensors) is list and len(tensors) == 1 and type(opts) is _AllreduceOptions:
        t = tensors[0]
        if isinstance(t, _Tensor) and t.layout is _strided:
            contiguous = t.is_contiguous()
            key = _allreduce_key(g, t, opts, contiguous)
            call = g.calls.get(key)
            if call is None:
                call = g.calls.put(key, _new_allreduce(g, tensors, opts, contiguous))
            return call, (t, tensors)
    # anything else: refused with the reason, or made the short path's form
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    opts = options(opts, dist.AllreduceOptions)
    g.inputs.single(tensors, "allreduce")
    return allreduce(g, tensors, opts)


def _allreduce_key(g: Group, t: torch.Tensor, opts: Any, contiguous: bool) -> tuple:
    return ("allreduce", t.dtype, t.numel(), t.device, contiguous, hash(opts.reduceOp),
            g.lanes.turn, g.planner.algos["allreduce"], algorithms.generation)


def allreduce_prepared(g: Group, tensors: Any, opts: Any) -> Any:
    """The ProcessGroup's ``allreduce`` when its call is prepared, on a group of one
    channel: the Work, with no step between the key and the engine; None otherwise
    (the group's generic path then runs it, or refuses it)."""
    if type(tensors) is list and len(tensors) == 1 and type(opts) is _AllreduceOptions:
        t = tensors[0]
        if (isinstance(t, _Tensor) and t.layout is _strided and g.lanes.channels == 1
                and not trace.active()):
            # the key of _allreduce_key, written out: this is the short path's first step
            call = g.calls.get(("allreduce", t.dtype, t.numel(), t.device,
                                t.is_contiguous(), hash(opts.reduceOp), 0,
                                g.planner.algos["allreduce"], algorithms.generation))
            if call is not None:
                g.seq += 1
                timeout = opts.timeout
                return call.lane.engine.submit(
                    call, (t, tensors), opts.asyncOp,
                    g.timeout_s if timeout.days < 0 or not timeout else timeout.total_seconds())
    return None


def _new_allreduce(g: Group, tensors: list, opts: Any, contiguous: bool) -> _Allreduce:
    t = g.inputs.single(tensors, "allreduce")
    op = ops.resolve(opts.reduceOp, t.dtype, "allreduce")
    lane = g.lanes.for_tensor(t, "allreduce")
    return _Allreduce(g, lane, t, op, contiguous)


class _AllreduceCoalesced(Call):
    """Several tensors reduced as one collective: packed into one buffer per dtype
    (the call's own), reduced once, unpacked."""

    __slots__ = ("parts", "size")

    def __init__(self, g: Group, lane: Lane, ts: list, reduce_op):
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(ts):
            by_dtype.setdefault(t.dtype, []).append(i)
        parts, prepared = [], []
        for dtype, members in by_dtype.items():
            op = ops.resolve(reduce_op, dtype, "allreduce_coalesced")
            n = sum(ts[i].numel() for i in members)
            pr = g.planner.prepare(lane, "allreduce", (n,), dtype, op=op, nbytes=n * dtype.itemsize)
            prepared.append(pr)
            flat = torch.empty(n, dtype=dtype, device=ts[0].device)
            offs, off = [], 0
            for i in members:
                offs.append((i, flat[off:off + ts[i].numel()]))
                off += ts[i].numel()
            parts.append((pr[1].run, flat, offs, op))
        super().__init__(g, lane, "allreduce_coalesced", prepared)
        self.parts = parts
        self.size = g.inputs.size

    def execute(self, ts: list, tensors: list) -> list:
        for run, flat, offs, op in self.parts:
            if self.detail:
                self.same_call("allreduce_coalesced",
                               [flat.numel(), int(op), dtype_code(flat.dtype)])
            if not flat.numel():
                continue
            for i, view in offs:
                view.copy_(ts[i].reshape(-1))
            run([flat])
            ops.finalize_(flat, op, self.size)
            for i, view in offs:
                ts[i].copy_(view.view_as(ts[i]))
        return tensors


def allreduce_coalesced(g: Group, tensors: list[torch.Tensor], opts: Any = None) -> tuple:
    """Allreduce several tensors as one collective."""
    opts = options(opts, dist.AllreduceCoalescedOptions)
    name = "allreduce_coalesced"
    if not tensors:
        raise ValueError(f"ringcomm {name}: no tensors given")
    ts = [g.inputs.tensor(t, name, f"tensor {i}", like=tensors[0]) for i, t in enumerate(tensors)]
    key = (name, tuple((t.dtype, t.numel()) for t in ts), ts[0].device,
           hash(opts.reduceOp), g.lanes.turn, g.planner.algos["allreduce"], algorithms.generation)
    call = _lookup(g, key, lambda: _AllreduceCoalesced(
        g, g.lanes.for_tensor(ts[0], name), ts, opts.reduceOp))
    return call, (ts, tensors)


class _Reduce(Call):
    """Reduce into the root; on the other ranks the partial sums go to a buffer of
    the call's own, so their tensors are left unchanged."""

    __slots__ = ("run", "root", "me", "size", "op", "work", "fields")

    def __init__(self, g: Group, lane: Lane, t: torch.Tensor, op, root: int):
        prepared = g.planner.prepare(lane, "reduce", (t.numel(),), t.dtype, op=op, root=root,
                                     nbytes=_nbytes(t))
        super().__init__(g, lane, "reduce", [prepared])
        self.run = self.programs[0].run
        self.root, self.me, self.size, self.op = root, g.inputs.rank, g.inputs.size, op
        self.work = None if self.me == root else torch.empty(t.numel(), dtype=t.dtype,
                                                             device=t.device)
        self.fields = [t.numel(), int(op), root, dtype_code(t.dtype)]

    def execute(self, t: torch.Tensor, tensors: list) -> list:
        if self.detail:
            self.same_call("reduce", self.fields)
        if not t.numel():
            return tensors
        if self.work is not None:
            self.work.copy_(t.reshape(-1))
            self.run([self.work])
            return tensors
        with _flat(t) as flat:
            self.run([flat])
            ops.finalize_(flat, self.op, self.size)
        return tensors


def reduce(g: Group, tensors: list[torch.Tensor], opts: Any = None) -> tuple:
    """Reduce ``tensors[0]`` of every rank into ``tensors[0]`` of ``opts.rootRank``;
    other ranks' tensors are left unchanged."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    opts = options(opts, dist.ReduceOptions)
    t = g.inputs.single(tensors, "reduce")
    root = g.inputs.root(opts.rootRank, "reduce")
    key = ("reduce", t.dtype, t.numel(), t.device, hash(opts.reduceOp), root,
           g.lanes.turn, g.planner.algos["reduce"], algorithms.generation)

    def make():
        op = ops.resolve(opts.reduceOp, t.dtype, "reduce")
        return _Reduce(g, g.lanes.for_tensor(t, "reduce"), t, op, root)

    return _lookup(g, key, make), (t, tensors)


class _ReduceScatter(Call):
    """Jobs of (output, per-rank inputs), reduced and scattered in turn. The ring
    writes partial sums into its chunks, so the inputs are first copied into a
    work buffer of the call's own."""

    __slots__ = ("jobs", "op", "size", "value_index")

    def __init__(self, g: Group, lane: Lane, name: str, jobs: list, op):
        prepared, mine = [], []
        for out, ins in jobs:
            pr = g.planner.prepare(lane, "reduce_scatter", tuple(i.numel() for i in ins),
                                   out.dtype, op=op,
                                   nbytes=sum(i.numel() for i in ins) * out.element_size())
            prepared.append(pr)
            work = torch.empty(sum(i.numel() for i in ins), dtype=out.dtype, device=out.device)
            chunks, off = [], 0
            for i in ins:
                chunks.append(work[off:off + i.numel()])
                off += i.numel()
            mine.append((pr[1].run, work, chunks, out.numel()))
        super().__init__(g, lane, name, prepared)
        self.jobs, self.op, self.size = mine, op, g.inputs.size

    def execute(self, jobs: list, value: Any) -> Any:
        for (out, ins), (run, work, chunks, n) in zip(jobs, self.jobs):
            if self.detail:
                self.same_call(self.name, [n, int(self.op), dtype_code(out.dtype)])
            if work.numel():
                torch.cat([i.reshape(-1) for i in ins], out=work)
            with _flat(out, copy_in=False) as flat:
                run([*chunks, flat])
                ops.finalize_(flat, self.op, self.size)
        return value


def _reduce_scatter(g: Group, name: str, jobs: list, opts: Any, value: Any) -> tuple:
    if not jobs:
        raise ValueError(f"ringcomm {name}: no tensors given")
    out0 = jobs[0][0]
    for k, (out, ins) in enumerate(jobs):
        g.inputs.tensor(out, name, f"output {k}", out0)
        for i, x in enumerate(ins):
            g.inputs.tensor(x, name, f"input {i} of output {k}", out0)
    key = (name, tuple((out.dtype, tuple(i.numel() for i in ins)) for out, ins in jobs),
           out0.device, hash(opts.reduceOp), g.lanes.turn,
           g.planner.algos["reduce_scatter"], algorithms.generation)

    def make():
        op = ops.resolve(opts.reduceOp, out0.dtype, name)
        for out, _ in jobs:
            ops.resolve(opts.reduceOp, out.dtype, name)
        return _ReduceScatter(g, g.lanes.for_tensor(out0, name), name, jobs, op)

    return _lookup(g, key, make), (jobs, value)


def reduce_scatter(g: Group, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                   opts: Any = None) -> tuple:
    """``dist.reduce_scatter``: rank i's output is the reduction of everyone's
    ``input_lists[0][i]``. Inputs are not modified."""
    opts = options(opts, dist.ReduceScatterOptions)
    t = g.inputs.single(outputs, "reduce_scatter")
    if len(input_lists) != 1:
        raise ValueError(f"ringcomm reduce_scatter: expected one input list, got "
                         f"{len(input_lists)}")
    ins = g.inputs.per_rank(input_lists[0], t, "reduce_scatter")
    return _reduce_scatter(g, "reduce_scatter", [(t, ins)], opts, outputs)


def reduce_scatter_tensor(g: Group, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> tuple:
    """``dist.reduce_scatter_tensor``: the input holds world-size equal slices;
    rank i's output is the reduction of everyone's i-th slice."""
    opts = options(opts, dist.ReduceScatterOptions)
    return _reduce_scatter(g, "reduce_scatter_tensor",
                           [(output, g.inputs.scattered(output, input))], opts, [output])


def reduce_scatter_tensor_coalesced(g: Group, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> tuple:
    """Several ``reduce_scatter_tensor`` as one call."""
    opts = options(opts, dist.ReduceScatterOptions)
    name = "reduce_scatter_tensor_coalesced"
    if len(outputs) != len(inputs):
        raise ValueError(f"ringcomm {name}: {len(outputs)} outputs for {len(inputs)} inputs")
    return _reduce_scatter(g, name, [(o, g.inputs.scattered(o, i)) for o, i in zip(outputs, inputs)],
                           opts, outputs)


# -- data movement ----------------------------------------------------------------
class _Broadcast(Call):
    __slots__ = ("run", "fields")

    def __init__(self, g: Group, lane: Lane, t: torch.Tensor, root: int):
        nbytes = _nbytes(t)
        prepared = g.planner.prepare(lane, "broadcast", (nbytes,), _uint8, nbytes=nbytes,
                                     root=root)
        super().__init__(g, lane, "broadcast", [prepared])
        self.run = self.programs[0].run
        self.fields = [t.numel(), root, dtype_code(t.dtype)]

    def execute(self, t: torch.Tensor, tensors: list) -> list:
        if self.detail:
            self.same_call("broadcast", self.fields)
        if t.numel():
            with _flat(t, copy_in=True) as flat:
                self.run([_bytes(flat)])
        return tensors


def broadcast(g: Group, tensors: list[torch.Tensor], opts: Any = None) -> tuple:
    """In-place broadcast of ``tensors[0]`` from ``opts.rootRank``."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    opts = options(opts, dist.BroadcastOptions)
    t = g.inputs.single(tensors, "broadcast")
    root = g.inputs.root(opts.rootRank, "broadcast")
    if getattr(opts, "rootTensor", 0) != 0:
        raise ValueError(f"ringcomm broadcast: rootTensor must be 0, got {opts.rootTensor}")
    key = ("broadcast", _nbytes(t), t.device, root, g.lanes.turn,
           g.planner.algos["broadcast"], algorithms.generation)
    call = _lookup(g, key, lambda: _Broadcast(g, g.lanes.for_tensor(t, "broadcast"), t, root))
    return call, (t, tensors)


class _Allgather(Call):
    """all_gather into a list of tensors (sizes may differ across ranks; every rank
    knows all output sizes alike); one part per input of the coalesced form."""

    __slots__ = ("runs", "fields_op")

    def __init__(self, g: Group, lane: Lane, op: str, layouts: list[tuple]):
        prepared = [g.planner.prepare(lane, "allgather", lay, _uint8, nbytes=max(lay))
                    for lay in layouts]
        super().__init__(g, lane, op, prepared)
        self.runs = [p.run for _, p in prepared]
        self.fields_op = op

    def execute(self, parts: list, value: Any) -> Any:
        for run, (outs, t) in zip(self.runs, parts):
            if self.detail:
                self.same_call(self.fields_op, [t.numel(), dtype_code(t.dtype)])
            with contextlib.ExitStack() as stack:
                flats = [_bytes(stack.enter_context(_flat(o, copy_in=False))) for o in outs]
                run([*flats, _bytes(t.reshape(-1).contiguous())])
        return value


def allgather(g: Group, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
              opts: Any = None) -> tuple:
    """``dist.all_gather``: ``output_lists[0][i]`` receives rank i's ``inputs[0]``
    (tensors may differ in size across ranks)."""
    opts = options(opts, _c10d.AllgatherOptions)
    if len(output_lists) != 1 or len(inputs) != 1:
        raise ValueError(f"ringcomm allgather: expected one output list and one input, got "
                         f"{len(output_lists)} and {len(inputs)}")
    t = g.inputs.tensor(inputs[0], "allgather", "input")
    outs = g.inputs.per_rank(output_lists[0], t, "allgather")
    layout = tuple(_nbytes(o) for o in outs)
    key = ("allgather", layout, t.device, g.lanes.turn, g.planner.algos["allgather"], algorithms.generation)
    call = _lookup(g, key, lambda: _Allgather(g, g.lanes.for_tensor(t, "allgather"),
                                              "allgather", [layout]))
    return call, ([(outs, t)], output_lists)


def allgather_coalesced(g: Group, output_lists: list[list[torch.Tensor]],
                        inputs: list[torch.Tensor], opts: Any = None) -> tuple:
    """``dist.all_gather_coalesced``: several ``all_gather`` calls as one.
    ``output_lists[r][i]`` receives rank r's ``inputs[i]`` (torch's layout; the
    inputs may differ in shape, empty ones included)."""
    opts = options(opts, _c10d.AllgatherOptions)
    name, p = "allgather_coalesced", g.inputs.size
    g.inputs.coalesced_lists(output_lists, inputs, name)
    parts = [([output_lists[r][i] for r in range(p)], x) for i, x in enumerate(inputs)]
    layouts = [tuple(_nbytes(o) for o in outs) for outs, _ in parts]
    key = (name, tuple(layouts), inputs[0].device, g.lanes.turn,
           g.planner.algos["allgather"], algorithms.generation)
    call = _lookup(g, key, lambda: _Allgather(g, g.lanes.for_tensor(inputs[0], name), name,
                                              layouts))
    return call, (parts, output_lists)


class _GatherInto(Call):
    """all_gather_into_tensor, one part per (output, input) pair."""

    __slots__ = ("runs", "p")

    def __init__(self, g: Group, lane: Lane, op: str, pairs: list):
        p = g.inputs.size
        prepared = [g.planner.prepare(lane, "allgather", (_nbytes(i),) * p, _uint8,
                                      nbytes=_nbytes(i)) for _, i in pairs]
        super().__init__(g, lane, op, prepared)
        self.runs = [pr.run for _, pr in prepared]
        self.p = p

    def execute(self, pairs: list, value: Any) -> Any:
        p = self.p
        for (out, inp), run in zip(pairs, self.runs):
            if self.detail:
                self.same_call("all_gather_into_tensor", [inp.numel(), dtype_code(inp.dtype)])
            with _flat(out, copy_in=False) as flat:
                if flat.numel():
                    src = _bytes(inp.reshape(-1).contiguous())  # any strides, copied if must
                    run([*_bytes(flat).view(p, -1).unbind(0), src])
        return value


def _gather_into(g: Group, name: str, pairs: list, value: Any) -> tuple:
    key = (name, tuple(_nbytes(i) for _, i in pairs), pairs[0][1].device, g.lanes.turn,
           g.planner.algos["allgather"], algorithms.generation)
    call = _lookup(g, key, lambda: _GatherInto(g, g.lanes.for_tensor(pairs[0][1], name), name,
                                               pairs))
    return call, (pairs, value)


def all_gather_into_tensor(g: Group, output: torch.Tensor, input: torch.Tensor,
                           opts: Any = None) -> tuple:
    """``dist.all_gather_into_tensor``: rank i's input fills the i-th slice of output."""
    opts = options(opts, _c10d.AllgatherOptions)
    name = "all_gather_into_tensor"
    g.inputs.gathered(output, input, name)
    return _gather_into(g, name, [(output, input)], [output])


def allgather_into_tensor_coalesced(g: Group, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> tuple:
    """Several ``all_gather_into_tensor`` as one call."""
    opts = options(opts, _c10d.AllgatherOptions)
    name = "allgather_into_tensor_coalesced"
    g.inputs.pairs(outputs, inputs, name)
    for o, i in zip(outputs, inputs):
        g.inputs.gathered(o, i, name, inputs[0])
    return _gather_into(g, name, list(zip(outputs, inputs)), outputs)


def _rooted_layout(g: Group, chunks: list[torch.Tensor] | None, mine: torch.Tensor) -> tuple:
    """Gather/scatter layout in bytes: the root knows every chunk, others their own."""
    if chunks is not None:
        return tuple(_nbytes(c) for c in chunks)
    return tuple(_nbytes(mine) if i == g.inputs.rank else None for i in range(g.inputs.size))


class _Rooted(Call):
    """gather (``to_root``) or scatter: the root's per-rank chunks and this rank's
    own tensor (ranks may hold different sizes)."""

    __slots__ = ("run", "to_root", "size", "fields")

    def __init__(self, g: Group, lane: Lane, op: str, layout: tuple, root: int, mine: int):
        prepared = g.planner.prepare(lane, op, layout, _uint8, nbytes=0, root=root)
        super().__init__(g, lane, op, [prepared])
        self.run = self.programs[0].run
        self.to_root = op == "gather"
        self.size = g.inputs.size
        self.fields = [mine, root]

    def execute(self, t: torch.Tensor, chunks: list | None, value: Any) -> Any:
        if self.detail:
            self.same_call("gather" if self.to_root else "scatter",
                           [*self.fields, dtype_code(t.dtype)])
        inward = not self.to_root  # scatter's chunks are read, gather's written
        with contextlib.ExitStack() as stack:
            mine = _bytes(stack.enter_context(_flat(t, copy_in=self.to_root)))
            flats = [None] * self.size
            if chunks is not None:
                flats = [_bytes(stack.enter_context(_flat(c, copy_in=inward))) for c in chunks]
            self.run([*flats, mine])
        return value


def _rooted(g: Group, op: str, t: torch.Tensor, chunks: list | None, root: int,
            value: Any) -> tuple:
    layout = _rooted_layout(g, chunks, t)
    key = (op, layout, t.device, root, g.lanes.turn, g.planner.algos[op], algorithms.generation)
    call = _lookup(g, key, lambda: _Rooted(g, g.lanes.for_tensor(t, op), op, layout, root,
                                           t.numel()))
    return call, (t, chunks, value)


def gather(g: Group, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
           opts: Any = None) -> tuple:
    """``dist.gather``: on the root ``output_lists[0][i]`` receives rank i's input;
    other ranks pass ``output_lists == []``."""
    opts = options(opts, dist.GatherOptions)
    t = g.inputs.single(inputs, "gather")
    root = g.inputs.root(opts.rootRank, "gather")
    outs = g.inputs.root_list(output_lists, t, root, "gather", "output")
    return _rooted(g, "gather", t, outs, root, output_lists)


def scatter(g: Group, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
            opts: Any = None) -> tuple:
    """``dist.scatter``: rank i's ``outputs[0]`` receives the root's
    ``input_lists[0][i]``; other ranks pass ``input_lists == []``."""
    opts = options(opts, dist.ScatterOptions)
    t = g.inputs.single(outputs, "scatter")
    root = g.inputs.root(opts.rootRank, "scatter")
    ins = g.inputs.root_list(input_lists, t, root, "scatter", "input")
    return _rooted(g, "scatter", t, ins, root, outputs)


class _AllToAll(Call):
    __slots__ = ("run", "op")

    def __init__(self, g: Group, lane: Lane, op: str, layout: tuple):
        prepared = g.planner.prepare(lane, "alltoall", layout, _uint8,
                                     nbytes=0)  # ranks may hold different sizes
        super().__init__(g, lane, op, [prepared])
        self.run = self.programs[0].run
        self.op = op

    def execute(self, sends: list, recvs: list, value: Any) -> Any:
        """``sends``/``recvs``: per rank a tensor, or (tensor, start, end) rows of one."""
        if self.detail:
            first = sends[0][0] if isinstance(sends[0], tuple) else sends[0]
            self.same_call(self.op, [dtype_code(first.dtype)])
        with contextlib.ExitStack() as stack:
            out = [_bytes(_part(stack, x, True)) for x in sends]
            out += [_bytes(_part(stack, x, False)) for x in recvs]
            self.run(out)
        return value


def _part(stack: contextlib.ExitStack, x: Any, copy_in: bool) -> torch.Tensor:
    if isinstance(x, tuple):  # (flat tensor, start, end)
        return x[0][x[1]:x[2]]
    return stack.enter_context(_flat(x, copy_in=copy_in))


def all_to_all(g: Group, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
               opts: Any = None) -> tuple:
    """``dist.all_to_all``: ``inputs[j]`` of rank i lands in ``outputs[i]`` of rank j."""
    opts = options(opts, dist.AllToAllOptions)
    g.inputs.all_to_all(outputs, inputs)
    layout = (tuple(_nbytes(x) for x in inputs), tuple(_nbytes(o) for o in outputs))
    key = ("all_to_all", layout, inputs[0].device, g.lanes.turn,
           g.planner.algos["alltoall"], algorithms.generation)
    call = _lookup(g, key, lambda: _AllToAll(g, g.lanes.for_tensor(inputs[0], "all_to_all"),
                                             "all_to_all", layout))
    return call, (inputs, outputs, outputs)


class _AllToAllSingle(_AllToAll):
    __slots__ = ()

    def execute(self, output: torch.Tensor, input: torch.Tensor, sends: list, recvs: list,
                value: Any) -> Any:
        if self.detail:
            self.same_call(self.op, [dtype_code(input.dtype)])
        with _flat(input) as src, _flat(output, copy_in=False) as dst:
            self.run([*(_bytes(src[a:b]) for a, b in sends),
                      *(_bytes(dst[a:b]) for a, b in recvs)])
        return value


def all_to_all_single(g: Group, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> tuple:
    """``dist.all_to_all_single``: split along dim 0 (equal splits when the size
    lists are empty, else the given row counts, zeros allowed)."""
    opts = options(opts, dist.AllToAllOptions)
    op = "all_to_all_single"
    g.inputs.tensor(input, op, "input")
    g.inputs.tensor(output, op, "output", input)
    g.inputs.same_dtype(output, input, op)
    sends = g.inputs.split_rows(input, list(input_split_sizes), "input")
    recvs = g.inputs.split_rows(output, list(output_split_sizes), "output")
    item = input.element_size()
    layout = (tuple((b - a) * item for a, b in sends), tuple((b - a) * item for a, b in recvs))
    key = (op, layout, input.device, g.lanes.turn, g.planner.algos["alltoall"], algorithms.generation)
    call = _lookup(g, key, lambda: _AllToAllSingle(g, g.lanes.for_tensor(input, op), op, layout))
    return call, (output, input, sends, recvs, [output])


class _Barrier(Call):
    __slots__ = ("run",)
    blocking = True

    def __init__(self, g: Group, lane: Lane):
        prepared = g.planner.prepare(lane, "barrier", (1,), _uint8, nbytes=0)
        super().__init__(g, lane, "barrier", [prepared])
        self.run = self.programs[0].run

    def execute(self, fences: list) -> list:
        for fence in fences:
            fence()
        if self.detail:
            self.same_call("barrier", [])
        self.run([self.lane.token])
        return []

    def touched(self, args: Sequence) -> list[torch.Tensor]:
        return [self.lane.token, *super().touched(())]


def barrier(g: Group, opts: Any = None) -> tuple:
    """Completes once every rank of the group has entered.

    Runs over MPI, or over NCCL when torch asks for a CUDA device
    (``dist.barrier(device_ids=[i])``, where CUDA and CuPy are usable) or MPI is
    missing; waiting on it then blocks the CPU until the barrier completed on the
    device, as torch's NCCL backend does.

    On a group of several channels it first waits for every collective issued
    before it on the other channels, so it orders the whole group as on one."""
    opts = options(opts, dist.BarrierOptions)
    lane = g.lanes.for_barrier(opts)
    key = ("barrier", lane.key, lane.channel, g.planner.algos["barrier"], algorithms.generation)
    call = _lookup(g, key, lambda: _Barrier(g, lane))
    return call, ([other.engine.fence() for other in g.lanes.siblings(lane)],)
