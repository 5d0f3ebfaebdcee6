"""One function per torch collective: it checks the call's arguments, picks the
lane (device) and the algorithm, and returns a :class:`Request`: what the lane's
engine runs (on the progress thread for MPI, enqueued on a stream for NCCL).

Each function takes the group first and then torch's arguments, in the order
torch's ``ProcessGroup`` methods take them; ``ringcomm.process_group.METHODS``
maps torch's method names (aliases included) to them.

Every argument is checked before the lane is chosen: the first CUDA call of a
group creates its NCCL communicator, with every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from . import ops
from .checks import Inputs, options
from .lanes import Lane, Lanes
from .plans import Planner, dtype_code


@dataclasses.dataclass(slots=True)
class Request:
    """A checked, prepared collective call.

    Attributes:
        op: its name in errors and logs (``"allreduce[ring]"``).
        lane: where it runs.
        run: runs the whole collective and returns what the Work's ``result()`` gives.
        opts: torch's options object (timeout, asyncOp).
        keep: tensors it touches, kept alive until it finished on a stream.
        blocking: waiting on it blocks the CPU even on a stream (barrier).
    """

    op: str
    lane: Lane
    run: Callable[[], Any]
    opts: Any
    keep: Sequence[torch.Tensor] = ()
    blocking: bool = False


class Group(Protocol):
    """What a request builder uses of its process group."""

    inputs: Inputs
    lanes: Lanes
    planner: Planner
    #: ``RINGCOMM_DEBUG=DETAIL``: compare every call across ranks before running it
    detail: bool


def _same_call(g: Group, lane: Lane, op: str, fields: list[int]) -> None:
    if g.detail:
        g.planner.same_call(lane, op, fields)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Non-reducing collectives move bytes: one code path for every dtype."""
    return t.view(torch.uint8)


def _named(op: str, algorithms: list[str]) -> str:
    """The name of a request that runs one or more parts: ``op[ring]``, ``op[ring+tree]``."""
    return f"{op}[{'+'.join(sorted(set(algorithms)))}]"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
def allreduce(g: Group, tensors: list[torch.Tensor], opts: Any = None) -> Request:
    """In-place allreduce of ``tensors[0]`` (``dist.all_reduce``)."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    opts = options(opts, dist.AllreduceOptions)
    t = g.inputs.single(tensors, "allreduce")
    op = ops.resolve(opts.reduceOp, t.dtype, "allreduce")
    lane = g.lanes.for_tensor(t, "allreduce")
    name, algo = g.planner.prepare(lane, "allreduce", (t.numel(),), t.dtype, op=op,
                                   nbytes=_nbytes(t))
    size, detail = g.inputs.size, g.detail

    def run():
        if detail:
            g.planner.same_call(lane, "allreduce", [t.numel(), int(op), dtype_code(t.dtype)])
        # The hot path of small messages: no context manager for the common case.
        contiguous = t.is_contiguous()
        flat = t if contiguous and t.dim() == 1 else t.contiguous().view(-1)
        if flat.numel():
            algo([flat])
            ops.finalize_(flat, op, size)
            if not contiguous:
                t.copy_(flat.view_as(t))
        return tensors

    return Request(f"allreduce[{name}]", lane, run, opts, tensors)


def allreduce_coalesced(g: Group, tensors: list[torch.Tensor], opts: Any = None) -> Request:
    """Allreduce several tensors as one collective: packed into one buffer per
    dtype, reduced once, unpacked."""
    opts = options(opts, dist.AllreduceCoalescedOptions)
    name = "allreduce_coalesced"
    if not tensors:
        raise ValueError(f"ringcomm {name}: no tensors given")
    ts = [g.inputs.tensor(t, name, f"tensor {i}", like=tensors[0]) for i, t in enumerate(tensors)]
    lane = g.lanes.for_tensor(ts[0], name)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in ts:
        by_dtype.setdefault(t.dtype, []).append(t)
    parts = []
    for dtype, members in by_dtype.items():
        op = ops.resolve(opts.reduceOp, dtype, name)
        n = sum(t.numel() for t in members)
        parts.append((members, op, *g.planner.prepare(lane, "allreduce", (n,), dtype, op=op,
                                                      nbytes=n * dtype.itemsize)))
    size = g.inputs.size

    def run():
        for members, op, _, algo in parts:
            flat = torch.cat([t.reshape(-1) for t in members])
            _same_call(g, lane, name, [flat.numel(), int(op)])
            if flat.numel():
                algo([flat])
                ops.finalize_(flat, op, size)
            off = 0
            for t in members:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
        return tensors

    return Request(_named(name, [p[2] for p in parts]), lane, run, opts, tensors)


def reduce(g: Group, tensors: list[torch.Tensor], opts: Any = None) -> Request:
    """Reduce ``tensors[0]`` of every rank into ``tensors[0]`` of ``opts.rootRank``;
    other ranks' tensors are left unchanged."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    opts = options(opts, dist.ReduceOptions)
    t = g.inputs.single(tensors, "reduce")
    op = ops.resolve(opts.reduceOp, t.dtype, "reduce")
    root = g.inputs.root(opts.rootRank, "reduce")
    lane = g.lanes.for_tensor(t, "reduce")
    name, algo = g.planner.prepare(lane, "reduce", (t.numel(),), t.dtype, op=op, root=root,
                                   nbytes=_nbytes(t))
    size, me = g.inputs.size, g.inputs.rank

    def run():
        _same_call(g, lane, "reduce", [t.numel(), int(op), root])
        with _flat(t) as flat:
            if flat.numel():
                work = flat if me == root else flat.clone()  # partial sums stay private
                algo([work])
                if me == root:
                    ops.finalize_(flat, op, size)
        return tensors

    return Request(f"reduce[{name}]", lane, run, opts, tensors)


def _reduce_scatter(g: Group, name: str, jobs: list, opts: Any, value: Any) -> Request:
    """``jobs``: (output, per-rank inputs) pairs, reduced and scattered in turn."""
    if not jobs:
        raise ValueError(f"ringcomm {name}: no tensors given")
    out0 = jobs[0][0]
    op = ops.resolve(opts.reduceOp, out0.dtype, name)
    for k, (out, ins) in enumerate(jobs):
        ops.resolve(opts.reduceOp, out.dtype, name)
        g.inputs.tensor(out, name, f"output {k}", out0)
        for i, x in enumerate(ins):
            g.inputs.tensor(x, name, f"input {i} of output {k}", out0)
    lane = g.lanes.for_tensor(out0, name)
    prepared = [g.planner.prepare(lane, "reduce_scatter", tuple(i.numel() for i in ins),
                                  out.dtype, op=op,
                                  nbytes=sum(i.numel() for i in ins) * out.element_size())
                for out, ins in jobs]
    algos = [algo for _, algo in prepared]
    size = g.inputs.size

    def run():
        for (out, ins), algo in zip(jobs, algos):
            _same_call(g, lane, name, [out.numel(), int(op)])
            work = torch.cat([i.reshape(-1) for i in ins])  # the ring writes partial sums
            chunks, off = [], 0
            for i in ins:
                chunks.append(work[off:off + i.numel()])
                off += i.numel()
            with _flat(out, copy_in=False) as flat:
                algo([*chunks, flat])
                ops.finalize_(flat, op, size)
        return value

    return Request(_named(name, [n for n, _ in prepared]), lane, run, opts,
                   [t for out, ins in jobs for t in (out, *ins)])


def reduce_scatter(g: Group, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                   opts: Any = None) -> Request:
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
                          opts: Any = None) -> Request:
    """``dist.reduce_scatter_tensor``: the input holds world-size equal slices;
    rank i's output is the reduction of everyone's i-th slice."""
    opts = options(opts, dist.ReduceScatterOptions)
    return _reduce_scatter(g, "reduce_scatter_tensor",
                           [(output, g.inputs.scattered(output, input))], opts, [output])


def reduce_scatter_tensor_coalesced(g: Group, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> Request:
    """Several ``reduce_scatter_tensor`` as one request."""
    opts = options(opts, dist.ReduceScatterOptions)
    name = "reduce_scatter_tensor_coalesced"
    if len(outputs) != len(inputs):
        raise ValueError(f"ringcomm {name}: {len(outputs)} outputs for {len(inputs)} inputs")
    return _reduce_scatter(g, name, [(o, g.inputs.scattered(o, i)) for o, i in zip(outputs, inputs)],
                           opts, outputs)


# -- data movement ----------------------------------------------------------------
def broadcast(g: Group, tensors: list[torch.Tensor], opts: Any = None) -> Request:
    """In-place broadcast of ``tensors[0]`` from ``opts.rootRank``."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    opts = options(opts, dist.BroadcastOptions)
    t = g.inputs.single(tensors, "broadcast")
    root = g.inputs.root(opts.rootRank, "broadcast")
    if getattr(opts, "rootTensor", 0) != 0:
        raise ValueError(f"ringcomm broadcast: rootTensor must be 0, got {opts.rootTensor}")
    lane = g.lanes.for_tensor(t, "broadcast")
    nbytes = _nbytes(t)
    name, algo = g.planner.prepare(lane, "broadcast", (nbytes,), torch.uint8, nbytes=nbytes,
                                   root=root)

    def run():
        _same_call(g, lane, "broadcast", [t.numel(), root])
        with _flat(t, copy_in=True) as flat:
            if flat.numel():
                algo([_bytes(flat)])
        return tensors

    return Request(f"broadcast[{name}]", lane, run, opts, tensors)


def _allgather_run(g: Group, lane: Lane, outs: list[torch.Tensor], t: torch.Tensor,
                   op: str) -> tuple[str, Callable[[], None]]:
    """(algorithm, run) of one all_gather into ``outs``."""
    # Sizes may differ across ranks; every rank knows all output sizes alike.
    layout = tuple(_nbytes(o) for o in outs)
    name, algo = g.planner.prepare(lane, "allgather", layout, torch.uint8, nbytes=max(layout))

    def run():
        _same_call(g, lane, op, [t.numel()])
        with contextlib.ExitStack() as stack:
            flats = [_bytes(stack.enter_context(_flat(o, copy_in=False))) for o in outs]
            algo([*flats, _bytes(t.reshape(-1).contiguous())])

    return name, run


def allgather(g: Group, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
              opts: Any = None) -> Request:
    """``dist.all_gather``: ``output_lists[0][i]`` receives rank i's ``inputs[0]``
    (tensors may differ in size across ranks)."""
    opts = options(opts, _c10d.AllgatherOptions)
    if len(output_lists) != 1 or len(inputs) != 1:
        raise ValueError(f"ringcomm allgather: expected one output list and one input, got "
                         f"{len(output_lists)} and {len(inputs)}")
    t = g.inputs.tensor(inputs[0], "allgather", "input")
    g.inputs.per_rank(output_lists[0], t, "allgather")
    lane = g.lanes.for_tensor(t, "allgather")
    name, gather = _allgather_run(g, lane, output_lists[0], t, "allgather")

    def run():
        gather()
        return output_lists

    return Request(f"allgather[{name}]", lane, run, opts, [*output_lists[0], t])


def allgather_coalesced(g: Group, output_lists: list[list[torch.Tensor]],
                        inputs: list[torch.Tensor], opts: Any = None) -> Request:
    """``dist.all_gather_coalesced``: several ``all_gather`` calls as one request.
    ``output_lists[r][i]`` receives rank r's ``inputs[i]`` (torch's layout; the
    inputs may differ in shape, empty ones included)."""
    opts = options(opts, _c10d.AllgatherOptions)
    name, p = "allgather_coalesced", g.inputs.size
    g.inputs.coalesced_lists(output_lists, inputs, name)
    lane = g.lanes.for_tensor(inputs[0], name)
    parts = [_allgather_run(g, lane, [output_lists[r][i] for r in range(p)], x, name)
             for i, x in enumerate(inputs)]

    def run():
        for _, r in parts:
            r()
        return output_lists

    return Request(_named(name, [n for n, _ in parts]), lane, run, opts,
                   [*inputs, *(o for outs in output_lists for o in outs)])


def _gather_into(g: Group, name: str, pairs: list, opts: Any, value: Any) -> Request:
    """``pairs``: (output, input) of all_gather_into_tensor, gathered in turn."""
    lane = g.lanes.for_tensor(pairs[0][1], name)
    p = g.inputs.size
    prepared = [g.planner.prepare(lane, "allgather", (_nbytes(i),) * p, torch.uint8,
                                  nbytes=_nbytes(i)) for _, i in pairs]
    algos = [algo for _, algo in prepared]

    def run():
        for (out, inp), algo in zip(pairs, algos):
            _same_call(g, lane, "all_gather_into_tensor", [inp.numel()])
            with _flat(out, copy_in=False) as flat:
                if flat.numel():
                    src = _bytes(inp.reshape(-1).contiguous())  # any strides, copied if must
                    algo([*_bytes(flat).view(p, -1).unbind(0), src])
        return value

    return Request(_named(name, [n for n, _ in prepared]), lane, run, opts,
                   [t for pair in pairs for t in pair])


def all_gather_into_tensor(g: Group, output: torch.Tensor, input: torch.Tensor,
                           opts: Any = None) -> Request:
    """``dist.all_gather_into_tensor``: rank i's input fills the i-th slice of output."""
    opts = options(opts, _c10d.AllgatherOptions)
    name = "all_gather_into_tensor"
    g.inputs.gathered(output, input, name)
    return _gather_into(g, name, [(output, input)], opts, [output])


def allgather_into_tensor_coalesced(g: Group, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> Request:
    """Several ``all_gather_into_tensor`` as one request."""
    opts = options(opts, _c10d.AllgatherOptions)
    name = "allgather_into_tensor_coalesced"
    g.inputs.pairs(outputs, inputs, name)
    for o, i in zip(outputs, inputs):
        g.inputs.gathered(o, i, name, inputs[0])
    return _gather_into(g, name, list(zip(outputs, inputs)), opts, outputs)


def _rooted_layout(g: Group, chunks: list[torch.Tensor] | None, mine: torch.Tensor) -> tuple:
    """Gather/scatter layout in bytes: the root knows every chunk, others their own."""
    if chunks is not None:
        return tuple(_nbytes(c) for c in chunks)
    return tuple(_nbytes(mine) if i == g.inputs.rank else None for i in range(g.inputs.size))


def gather(g: Group, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
           opts: Any = None) -> Request:
    """``dist.gather``: on the root ``output_lists[0][i]`` receives rank i's input;
    other ranks pass ``output_lists == []``."""
    opts = options(opts, dist.GatherOptions)
    t = g.inputs.single(inputs, "gather")
    root = g.inputs.root(opts.rootRank, "gather")
    outs = g.inputs.root_list(output_lists, t, root, "gather", "output")
    lane = g.lanes.for_tensor(t, "gather")
    name, algo = g.planner.prepare(lane, "gather", _rooted_layout(g, outs, t), torch.uint8,
                                   nbytes=0, root=root)  # ranks may hold different sizes
    size = g.inputs.size

    def run():
        _same_call(g, lane, "gather", [t.numel(), root])
        with contextlib.ExitStack() as stack:
            src = _bytes(stack.enter_context(_flat(t)))
            chunks = [None] * size
            if outs is not None:
                chunks = [_bytes(stack.enter_context(_flat(o, copy_in=False))) for o in outs]
            algo([*chunks, src])
        return output_lists

    return Request(f"gather[{name}]", lane, run, opts, [t, *(outs or ())])


def scatter(g: Group, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
            opts: Any = None) -> Request:
    """``dist.scatter``: rank i's ``outputs[0]`` receives the root's
    ``input_lists[0][i]``; other ranks pass ``input_lists == []``."""
    opts = options(opts, dist.ScatterOptions)
    t = g.inputs.single(outputs, "scatter")
    root = g.inputs.root(opts.rootRank, "scatter")
    ins = g.inputs.root_list(input_lists, t, root, "scatter", "input")
    lane = g.lanes.for_tensor(t, "scatter")
    name, algo = g.planner.prepare(lane, "scatter", _rooted_layout(g, ins, t), torch.uint8,
                                   nbytes=0, root=root)  # ranks may hold different sizes
    size = g.inputs.size

    def run():
        _same_call(g, lane, "scatter", [t.numel(), root])
        with contextlib.ExitStack() as stack:
            dst = _bytes(stack.enter_context(_flat(t, copy_in=False)))
            chunks = [None] * size
            if ins is not None:
                chunks = [_bytes(stack.enter_context(_flat(i))) for i in ins]
            algo([*chunks, dst])
        return outputs

    return Request(f"scatter[{name}]", lane, run, opts, [t, *(ins or ())])


def all_to_all(g: Group, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
               opts: Any = None) -> Request:
    """``dist.all_to_all``: ``inputs[j]`` of rank i lands in ``outputs[i]`` of rank j."""
    opts = options(opts, dist.AllToAllOptions)
    g.inputs.all_to_all(outputs, inputs)
    layout = (tuple(_nbytes(x) for x in inputs), tuple(_nbytes(o) for o in outputs))
    lane = g.lanes.for_tensor(inputs[0], "all_to_all")
    name, algo = g.planner.prepare(lane, "alltoall", layout, torch.uint8,
                                   nbytes=0)  # ranks may hold different sizes

    def run():
        _same_call(g, lane, "all_to_all", [])
        with contextlib.ExitStack() as stack:
            sends = [_bytes(stack.enter_context(_flat(x))) for x in inputs]
            recvs = [_bytes(stack.enter_context(_flat(o, copy_in=False))) for o in outputs]
            algo([*sends, *recvs])
        return outputs

    return Request(f"all_to_all[{name}]", lane, run, opts, [*outputs, *inputs])


def all_to_all_single(g: Group, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> Request:
    """``dist.all_to_all_single``: split along dim 0 (equal splits when the size
    lists are empty, else the given row counts, zeros allowed)."""
    opts = options(opts, dist.AllToAllOptions)
    op = "all_to_all_single"
    g.inputs.tensor(input, op, "input")
    g.inputs.tensor(output, op, "output", input)
    g.inputs.same_dtype(output, input, op)
    sends = g.inputs.split_rows(input, list(input_split_sizes), "input")
    recvs = g.inputs.split_rows(output, list(output_split_sizes), "output")
    lane = g.lanes.for_tensor(input, op)
    item = input.element_size()
    layout = (tuple((b - a) * item for a, b in sends), tuple((b - a) * item for a, b in recvs))
    name, algo = g.planner.prepare(lane, "alltoall", layout, torch.uint8,
                                   nbytes=0)  # ranks may hold different sizes

    def run():
        _same_call(g, lane, op, [])
        with _flat(input) as src, _flat(output, copy_in=False) as dst:
            algo([*(_bytes(src[a:b]) for a, b in sends), *(_bytes(dst[a:b]) for a, b in recvs)])
        return [output]

    return Request(f"{op}[{name}]", lane, run, opts, (output, input))


def barrier(g: Group, opts: Any = None) -> Request:
    """Completes once every rank of the group has entered.

    Runs over MPI, or over NCCL when torch asks for a CUDA device
    (``dist.barrier(device_ids=[i])``) or MPI is missing; waiting on it then
    blocks the CPU until the barrier completed on the device, as torch's NCCL
    backend does.

    On a group of several channels it first waits for every collective issued
    before it on the other channels, so it orders the whole group as on one."""
    opts = options(opts, dist.BarrierOptions)
    lane = g.lanes.for_barrier(opts)
    name, algo = g.planner.prepare(lane, "barrier", (1,), torch.uint8, nbytes=0)
    fences = [other.engine.fence() for other in g.lanes.siblings(lane)]

    def run():
        for fence in fences:
            fence()
        _same_call(g, lane, "barrier", [])
        algo([lane.token])
        return []

    return Request(f"barrier[{name}]", lane, run, opts, blocking=True)
