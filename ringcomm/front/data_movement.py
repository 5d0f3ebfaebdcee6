"""The collectives that move data without reducing it (broadcast, allgather in
its forms, gather, scatter, all-to-all) and the barrier, as
:mod:`ringcomm.front.calls` describes every request."""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from ringcomm import algorithms, trace
from ringcomm.front.arguments import options
from ringcomm.front.cross_rank_checks import dtype_code
from ringcomm.front.lanes import Lane
from ringcomm.front.calls import (Call, Group, apart, as_bytes, flat_bytes, flat_view, lookup,
                                  nbytes_of, timeout_of, write_back)

_uint8 = torch.uint8
_BarrierOptions = dist.BarrierOptions
_ASYNC_OP = hasattr(_BarrierOptions(), "asyncOp")
#: a barrier's arguments on a group of one channel: no other channel to fence
_NO_FENCES: tuple = ([],)


# -- data movement ----------------------------------------------------------------
class _Broadcast(Call):
    __slots__ = ("run", "fields")

    def __init__(self, g: Group, lane: Lane, t: torch.Tensor, root: int):
        nbytes = nbytes_of(t)
        prepared = g.planner.prepare(lane, "broadcast", (nbytes,), _uint8, nbytes=nbytes,
                                     root=root, as_dtype=t.dtype)
        super().__init__(g, lane, "broadcast", [prepared])
        self.run = self.programs[0].run
        self.fields = [t.numel(), root, dtype_code(t.dtype)]

    def execute(self, t: torch.Tensor, tensors: list) -> list:
        if self.detail:
            self.same_call("broadcast", self.fields)
        if t.numel():
            flats, back = flat_bytes((t,), copy_in=True)
            self.run(flats)
            write_back(back)
        return tensors


def broadcast(g: Group, tensors: list[torch.Tensor], opts: Any = None) -> tuple:
    """In-place broadcast of ``tensors[0]`` from ``opts.rootRank``."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    opts = options(opts, dist.BroadcastOptions)
    t = g.inputs.single(tensors, "broadcast")
    root = g.inputs.root(opts.rootRank, "broadcast")
    if getattr(opts, "rootTensor", 0) != 0:
        raise ValueError(f"ringcomm broadcast: rootTensor must be 0, got {opts.rootTensor}")
    key = ("broadcast", nbytes_of(t), t.dtype, t.device, root, g.lanes.turn,
           g.planner.algos["broadcast"], algorithms.generation)
    call = lookup(g, key, lambda: _Broadcast(g, g.lanes.for_tensor(t, "broadcast"), t, root))
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
            flats, back = flat_bytes(outs, copy_in=False)
            src, _ = flat_bytes((t,), copy_in=True)  # read only: nothing to write back
            run([*flats, apart(src[0], flats, self.g.inputs.rank)])
            write_back(back)
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
    layout = tuple(nbytes_of(o) for o in outs)
    key = ("allgather", layout, t.device, g.lanes.turn, g.planner.algos["allgather"], algorithms.generation)
    call = lookup(g, key, lambda: _Allgather(g, g.lanes.for_tensor(t, "allgather"),
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
    layouts = [tuple(nbytes_of(o) for o in outs) for outs, _ in parts]
    key = (name, tuple(layouts), inputs[0].device, g.lanes.turn,
           g.planner.algos["allgather"], algorithms.generation)
    call = lookup(g, key, lambda: _Allgather(g, g.lanes.for_tensor(inputs[0], name), name,
                                              layouts))
    return call, (parts, output_lists)


class _GatherInto(Call):
    """all_gather_into_tensor, one part per (output, input) pair."""

    __slots__ = ("runs", "p")

    def __init__(self, g: Group, lane: Lane, op: str, pairs: list):
        p = g.inputs.size
        prepared = [g.planner.prepare(lane, "allgather", (nbytes_of(i),) * p, _uint8,
                                      nbytes=nbytes_of(i)) for _, i in pairs]
        super().__init__(g, lane, op, prepared)
        self.runs = [pr.run for _, pr in prepared]
        self.p = p

    def execute(self, pairs: list, value: Any) -> Any:
        p = self.p
        for (out, inp), run in zip(pairs, self.runs):
            if self.detail:
                self.same_call("all_gather_into_tensor", [inp.numel(), dtype_code(inp.dtype)])
            with flat_view(out, copy_in=False) as flat:
                if flat.numel():
                    src = as_bytes(inp.reshape(-1).contiguous())  # any strides, copied if must
                    chunks = as_bytes(flat).view(p, -1).unbind(0)
                    run([*chunks, apart(src, chunks, self.g.inputs.rank)])
        return value


def _gather_into(g: Group, name: str, pairs: list, value: Any) -> tuple:
    key = (name, tuple(nbytes_of(i) for _, i in pairs), pairs[0][1].device, g.lanes.turn,
           g.planner.algos["allgather"], algorithms.generation)
    call = lookup(g, key, lambda: _GatherInto(g, g.lanes.for_tensor(pairs[0][1], name), name,
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
        return tuple(nbytes_of(c) for c in chunks)
    return tuple(nbytes_of(mine) if i == g.inputs.rank else None for i in range(g.inputs.size))


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
            mine = as_bytes(stack.enter_context(flat_view(t, copy_in=self.to_root)))
            flats = [None] * self.size
            if chunks is not None:
                flats = [as_bytes(stack.enter_context(flat_view(c, copy_in=inward))) for c in chunks]
            self.run([*flats, mine])
        return value


def _rooted(g: Group, op: str, t: torch.Tensor, chunks: list | None, root: int,
            value: Any) -> tuple:
    layout = _rooted_layout(g, chunks, t)
    key = (op, layout, t.device, root, g.lanes.turn, g.planner.algos[op], algorithms.generation)
    call = lookup(g, key, lambda: _Rooted(g, g.lanes.for_tensor(t, op), op, layout, root,
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


def gather_into_tensor(g: Group, output: torch.Tensor, input: torch.Tensor,
                       opts: Any = None) -> tuple:
    """``dist.gather_single`` / ``dist.gather_into_tensor`` (torch 2.15): the root's
    ``output`` (contiguous, world size x the input's elements: flat or stacked)
    receives rank i's input as its i-th slice; other ranks' ``output`` is unused."""
    opts = options(opts, dist.GatherOptions)
    name = "gather_into_tensor"
    t = g.inputs.tensor(input, name, "input")
    root = g.inputs.root(opts.rootRank, name)
    if g.inputs.rank != root:
        return _rooted(g, "gather", t, None, root, [output])
    g.inputs.gathered(output, t, name)
    if not output.is_contiguous():
        raise ValueError(f"ringcomm {name}: the output must be contiguous")
    chunks = list(output.view(-1).view(g.inputs.size, -1).unbind(0)) if t.numel() else \
        [output.view(-1)[:0]] * g.inputs.size
    return _rooted(g, "gather", t, chunks, root, [output])


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
            out = [as_bytes(_part(stack, x, True)) for x in sends]
            out += [as_bytes(_part(stack, x, False)) for x in recvs]
            self.run(out)
        return value


def _part(stack: contextlib.ExitStack, x: Any, copy_in: bool) -> torch.Tensor:
    if isinstance(x, tuple):  # (flat tensor, start, end)
        return x[0][x[1]:x[2]]
    return stack.enter_context(flat_view(x, copy_in=copy_in))


def all_to_all(g: Group, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
               opts: Any = None) -> tuple:
    """``dist.all_to_all``: ``inputs[j]`` of rank i lands in ``outputs[i]`` of rank j."""
    opts = options(opts, dist.AllToAllOptions)
    g.inputs.all_to_all(outputs, inputs)
    layout = (tuple(nbytes_of(x) for x in inputs), tuple(nbytes_of(o) for o in outputs))
    key = ("all_to_all", layout, inputs[0].device, g.lanes.turn,
           g.planner.algos["alltoall"], algorithms.generation)
    call = lookup(g, key, lambda: _AllToAll(g, g.lanes.for_tensor(inputs[0], "all_to_all"),
                                             "all_to_all", layout))
    return call, (inputs, outputs, outputs)


class _AllToAllSingle(_AllToAll):
    __slots__ = ()

    def execute(self, output: torch.Tensor, input: torch.Tensor, sends: list, recvs: list,
                value: Any) -> Any:
        if self.detail:
            self.same_call(self.op, [dtype_code(input.dtype)])
        with flat_view(input) as src, flat_view(output, copy_in=False) as dst:
            self.run([*(as_bytes(src[a:b]) for a, b in sends),
                      *(as_bytes(dst[a:b]) for a, b in recvs)])
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
    call = lookup(g, key, lambda: _AllToAllSingle(g, g.lanes.for_tensor(input, op), op, layout))
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
    call = lookup(g, key, lambda: _Barrier(g, lane))
    return call, ([other.engine.fence() for other in g.lanes.siblings(lane)],)


def barrier_prepared(g: Group, opts: Any) -> Any:
    """The ProcessGroup's ``barrier`` when it runs on the group's CPU lane (no
    device named) and is prepared, on a group of one channel with no flight
    recorder or trace: the Work, with nothing between the key and the engine; None
    otherwise (the generic path, :func:`barrier`, runs it)."""
    lanes = g.lanes
    if (type(opts) is _BarrierOptions and lanes.channels == 1 and g.flight is None
            and lanes.cpus and not opts.device_ids and not trace.active()):
        dev = opts.device
        if dev is None or (dev.type == "cpu" and lanes.nccl_type != "cpu"):
            lane = lanes.cpus[0]  # Lanes.for_barrier's choice for these options
            call = g.calls.get(("barrier", lane.key, 0, g.planner.algos["barrier"],
                                algorithms.generation))
            if call is not None:
                g.seq += 1
                if _ASYNC_OP and not opts.asyncOp:
                    return lane.engine.submit_sync(call, _NO_FENCES, timeout_of(g, opts.timeout))
                return lane.engine.submit(call, _NO_FENCES, True, timeout_of(g, opts.timeout))
    return None
