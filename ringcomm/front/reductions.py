"""The reducing collectives (allreduce and its coalesced form, reduce,
reduce_scatter in its three forms), as :mod:`ringcomm.front.calls` describes
every request: a builder per torch method returning ``(call, args)``, the
prepared call made on a shape's first call. ``allreduce_prepared`` is the short
path the process group's ``allreduce`` takes when its call is already prepared.
"""
from __future__ import annotations

from time import time_ns as _time_ns
from typing import Any

import torch
import torch.distributed as dist

from ringcomm import algorithms, ops, trace
from ringcomm.front.arguments import options
from ringcomm.front.cross_rank_checks import dtype_code
from ringcomm.front.lanes import Lane
from ringcomm.runtime.work import Done
from ringcomm.front.calls import (Call, Group, apart, flat_view, flight_meta, lookup,
                                  nbytes_of)

_Tensor = torch.Tensor
_strided = torch.strided
_AllreduceOptions = dist.AllreduceOptions
#: torch < 2.8's options have no asyncOp: every call is then taken as asynchronous
#: (torch waits on the Work of a synchronous one), as the generic path does
_ASYNC_OP = hasattr(_AllreduceOptions(), "asyncOp")


# -- reductions -----------------------------------------------------------------
class _Allreduce(Call):
    __slots__ = ("run", "n", "contiguous", "avg", "size", "fields")

    def __init__(self, g: Group, lane: Lane, t: torch.Tensor, op, contiguous: bool):
        prepared = g.planner.prepare(lane, "allreduce", (t.numel(),), t.dtype, op=op,
                                     nbytes=nbytes_of(t))
        super().__init__(g, lane, "allreduce", [prepared])
        self.run = self.programs[0].run
        self.n = t.numel()
        self.contiguous = contiguous
        self.size = g.inputs.size
        # AVG's steps around the reduction (ops.Averaging); None for every other op
        self.avg = (ops.Averaging(op, t.dtype, self.size, lane.on_stream)
                    if op == ops.AVG and self.size > 1 else None)
        self.fields = [t.numel(), int(op), dtype_code(t.dtype)]

    def execute(self, t: torch.Tensor, tensors: list) -> list:
        if self.detail:
            self.same_call("allreduce", self.fields)
        if not self.n:
            return tensors
        flat = (t if t.dim() == 1 else t.view(-1)) if self.contiguous else t.contiguous().view(-1)
        avg = self.avg
        if avg is None:
            self.run([flat])
        else:
            avg.before(flat)
            self.run([flat])
            avg.after(flat)
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
            # the key of _allreduce_key, written out: this is the short path's first
            # step, and the call of _allreduce_key costs 0.2 us more (1.1 against 1.3
            # us; scripts/bench_copies.py, docs/data/hot_path_copies.json)
            call = g.calls.get(("allreduce", t.dtype, t.numel(), t.device,
                                t.is_contiguous(), hash(opts.reduceOp), 0,
                                g.planner.algos["allreduce"], algorithms.generation))
            if call is not None:
                g.seq += 1
                timeout = opts.timeout
                timeout_s = (g.timeout_s if timeout.days < 0 or not timeout
                             else timeout.total_seconds())
                fr = g.flight
                if fr is None:
                    if _ASYNC_OP and not opts.asyncOp:
                        return call.lane.engine.submit_sync(call, (t, tensors), timeout_s)
                    return call.lane.engine.submit(call, (t, tensors), True, timeout_s)
                # Recorder.record and .issued written out: each call costs this path
                # about 0.1 us (scripts/bench_layers.py's last row)
                i = fr.next_id()
                entry = [i, g.fr_tag, g.seq, g.p2p_seq,
                         call.fr or flight_meta(g, call, "allreduce", (tensors,)), _time_ns(),
                         timeout_s, None]
                fr.ring[i % fr.capacity] = entry
                work = (call.lane.engine.submit_sync(call, (t, tensors), timeout_s)
                        if _ASYNC_OP and not opts.asyncOp else
                        call.lane.engine.submit(call, (t, tensors), True, timeout_s))
                entry[-1] = (True if work.__class__ is Done and work._exc is None
                             else fr.held(work))
                return work
    return None


def _new_allreduce(g: Group, tensors: list, opts: Any, contiguous: bool) -> _Allreduce:
    t = g.inputs.single(tensors, "allreduce")
    op = ops.resolve(opts.reduceOp, t.dtype, "allreduce")
    lane = g.lanes.for_tensor(t, "allreduce")
    return _Allreduce(g, lane, t, op, contiguous)


class _CoalescedPart:
    """The tensors of one dtype of an allreduce_coalesced: their program, and the
    buffer they are packed into (made on first use: a call whose tensors are always
    reduced where they lie never needs one)."""

    __slots__ = ("run", "program", "members", "n", "dtype", "op", "avg", "flat", "offs")

    def __init__(self, prepared: tuple, members: list[int], n: int, dtype: torch.dtype, op,
                 avg: ops.Averaging):
        self.program = prepared[1]
        self.run = self.program.run
        self.members, self.n, self.dtype, self.op, self.avg = members, n, dtype, op, avg
        self.flat: torch.Tensor | None = None
        self.offs: list = []

    def lies(self, ts: list, apart) -> bool:
        """Whether this part's tensors of ``ts`` are reduced where they lie: the
        program takes several tensors, the op needs no step before or after, and the
        tensors are contiguous and ``apart(ts, members)``."""
        avg = self.avg
        return (getattr(self.program, "pieces", False) and avg.scale is None
                and avg.post is None and all(ts[i].is_contiguous() for i in self.members)
                and apart(ts, self.members))

    def packed(self, ts: list) -> torch.Tensor:
        """The buffer, made on the first call that packs (``ts``' device)."""
        if self.flat is None:
            self.flat = torch.empty(self.n, dtype=self.dtype, device=ts[0].device)
            off = 0
            for i in self.members:
                self.offs.append((i, self.flat[off:off + ts[i].numel()]))
                off += ts[i].numel()
        return self.flat


class _AllreduceCoalesced(Call):
    """Several tensors reduced as one collective: packed into one buffer per dtype
    (the call's own), reduced once, unpacked; or, where the program takes the
    elements as several tensors (shm_direct's ``pieces``) and the tensors are
    contiguous and apart, reduced where they lie, with no packing (a DDP bucket's
    gradients: :mod:`ddp.reducer`)."""

    __slots__ = ("parts", "_apart")

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
            parts.append(_CoalescedPart(pr, members, n, dtype, op,
                                        ops.Averaging(op, dtype, g.inputs.size, lane.on_stream)))
        super().__init__(g, lane, "allreduce_coalesced", prepared)
        self.parts = parts
        self._apart: tuple = ((), False)  # the last addresses looked at, and whether apart

    def execute(self, ts: list, tensors: list) -> list:
        for part in self.parts:
            if self.detail:
                self.same_call("allreduce_coalesced",
                               [part.n, int(part.op), dtype_code(part.dtype)])
            if not part.n:
                continue
            if part.lies(ts, self._apart_of):
                part.run([ts[i].view(-1) for i in part.members])
                continue
            avg = part.avg
            flat = part.packed(ts)
            self.owned = tuple(p.flat for p in self.parts if p.flat is not None)
            for i, view in part.offs:
                view.copy_(ts[i].reshape(-1))
            avg.before(flat)
            part.run([flat])
            avg.after(flat)
            for i, view in part.offs:
                ts[i].copy_(view.view_as(ts[i]))
        return tensors

    def in_place(self, ts: list) -> bool:
        """Whether every dtype's tensors of ``ts`` are reduced where they lie."""
        return all(part.lies(ts, self._apart_of) for part in self.parts)

    def _apart_of(self, ts: list, members: list[int]) -> bool:
        """Whether no two of ``members`` of ``ts`` share memory (a round would read what
        an earlier one wrote); the answer kept for the last addresses asked about (the
        call's sizes are fixed)."""
        key = tuple(ts[i].data_ptr() for i in members)
        cached = self._apart  # one read: another thread may ask about other tensors
        if cached[0] != key:
            spans = sorted((ts[i].data_ptr(), ts[i].data_ptr() + ts[i].nbytes)
                           for i in members if ts[i].numel())
            cached = self._apart = (key, all(end <= nxt for (_, end), (nxt, _)
                                             in zip(spans, spans[1:])))
        return cached[1]


def allreduce_coalesced(g: Group, tensors: list[torch.Tensor], opts: Any = None) -> tuple:
    """Allreduce several tensors as one collective."""
    opts = options(opts, dist.AllreduceCoalescedOptions)
    name = "allreduce_coalesced"
    if not tensors:
        raise ValueError(f"ringcomm {name}: no tensors given")
    ts = [g.inputs.tensor(t, name, f"tensor {i}", like=tensors[0]) for i, t in enumerate(tensors)]
    key = (name, tuple((t.dtype, t.numel()) for t in ts), ts[0].device,
           hash(opts.reduceOp), g.lanes.turn, g.planner.algos["allreduce"], algorithms.generation)
    call = lookup(g, key, lambda: _AllreduceCoalesced(
        g, g.lanes.for_tensor(ts[0], name), ts, opts.reduceOp))
    return call, (ts, tensors)


class _Reduce(Call):
    """Reduce into the root; on the other ranks the partial sums go to a buffer of
    the call's own, so their tensors are left unchanged."""

    __slots__ = ("run", "root", "me", "avg", "work", "fields")

    def __init__(self, g: Group, lane: Lane, t: torch.Tensor, op, root: int):
        prepared = g.planner.prepare(lane, "reduce", (t.numel(),), t.dtype, op=op, root=root,
                                     nbytes=nbytes_of(t))
        super().__init__(g, lane, "reduce", [prepared])
        self.run = self.programs[0].run
        self.root, self.me = root, g.inputs.rank
        self.avg = ops.Averaging(op, t.dtype, g.inputs.size, lane.on_stream)
        self.work = None if self.me == root else torch.empty(t.numel(), dtype=t.dtype,
                                                             device=t.device)
        self.owned = () if self.work is None else (self.work,)
        self.fields = [t.numel(), int(op), root, dtype_code(t.dtype)]

    def execute(self, t: torch.Tensor, tensors: list) -> list:
        if self.detail:
            self.same_call("reduce", self.fields)
        if not t.numel():
            return tensors
        if self.work is not None:
            self.work.copy_(t.reshape(-1))
            self.avg.before(self.work)
            self.run([self.work])
            return tensors
        with flat_view(t) as flat:
            self.avg.before(flat)
            self.run([flat])
            self.avg.after(flat)
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

    return lookup(g, key, make), (t, tensors)


class _ReduceScatter(Call):
    """Jobs of (output, per-rank inputs), reduced and scattered in turn. A schedule
    writes partial sums into its chunks (the ring does), so the inputs are first
    copied into a work buffer of the call's own; a program that only reads them
    (``keeps_inputs``: shm_direct) and no premultiplied AVG take them as they are."""

    __slots__ = ("jobs", "op", "avg", "value_index")

    def __init__(self, g: Group, lane: Lane, name: str, jobs: list, op):
        prepared, mine = [], []
        self.avg = ops.Averaging(op, jobs[0][0].dtype, g.inputs.size, lane.on_stream)
        for out, ins in jobs:
            pr = g.planner.prepare(lane, "reduce_scatter", tuple(i.numel() for i in ins),
                                   out.dtype, op=op,
                                   nbytes=sum(i.numel() for i in ins) * out.element_size())
            prepared.append(pr)
            if getattr(pr[1], "keeps_inputs", False) and self.avg.scale is None:
                mine.append((pr[1].run, None, None, out.numel()))
                continue
            work = torch.empty(sum(i.numel() for i in ins), dtype=out.dtype, device=out.device)
            chunks, off = [], 0
            for i in ins:
                chunks.append(work[off:off + i.numel()])
                off += i.numel()
            mine.append((pr[1].run, work, chunks, out.numel()))
        super().__init__(g, lane, name, prepared)
        self.jobs, self.op = mine, op
        self.owned = tuple(work for _, work, _, _ in mine if work is not None)

    def execute(self, jobs: list, value: Any) -> Any:
        for (out, ins), (run, work, chunks, n) in zip(jobs, self.jobs):
            if self.detail:
                self.same_call(self.name, [n, int(self.op), dtype_code(out.dtype)])
            if work is None:  # read in place: 1-D contiguous views (copies where must)
                chunks = [i if i.dim() == 1 and i.is_contiguous() else i.reshape(-1).contiguous()
                          for i in ins]
            elif work.numel():
                torch.cat([i.reshape(-1) for i in ins], out=work)
                self.avg.before(work)
            with flat_view(out, copy_in=False) as flat:
                if work is None:
                    me, outs = self.g.inputs.rank, (flat,)
                    chunks = [apart(c, outs, 0 if j == me else None) for j, c in enumerate(chunks)]
                run([*chunks, flat])
                self.avg.after(flat)
        return value


def _reduce_scatter(g: Group, name: str, jobs: list, opts: Any, value: Any,
                    checked: bool = False) -> tuple:
    """``checked``: the tensors were checked already (the slices of one checked input)."""
    if not jobs:
        raise ValueError(f"ringcomm {name}: no tensors given")
    out0 = jobs[0][0]
    for k, (out, ins) in enumerate(jobs if not checked else ()):
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

    return lookup(g, key, make), (jobs, value)


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
                           [(output, g.inputs.scattered(output, input))], opts, [output],
                           checked=True)


def reduce_scatter_tensor_coalesced(g: Group, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> tuple:
    """Several ``reduce_scatter_tensor`` as one call."""
    opts = options(opts, dist.ReduceScatterOptions)
    name = "reduce_scatter_tensor_coalesced"
    if len(outputs) != len(inputs):
        raise ValueError(f"ringcomm {name}: {len(outputs)} outputs for {len(inputs)} inputs")
    return _reduce_scatter(g, name, [(o, g.inputs.scattered(o, i)) for o, i in zip(outputs, inputs)],
                           opts, outputs)
