"""Prepared calls, and what the functions that prepare them share. There is one
such function per torch collective (:mod:`ringcomm.front.reductions`,
:mod:`ringcomm.front.data_movement`): it checks the call's arguments and returns
``(call, args)``: the *prepared call* of the call's shape and what this call
passes to it. ("Request" is kept for MPI's requests.) The lane's engine runs
``call.execute(*args)``.

A prepared call (:class:`Call`) is made on the first call of a shape (group,
lane, collective, dtype, sizes, op, root, algorithm): every argument check, the
algorithm's choice and its program (:mod:`ringcomm.execution.executors`: the compiled
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

from ringcomm.trace import flight
from ringcomm.front.arguments import Inputs
from ringcomm.front.cross_rank_checks import Fingerprints
from ringcomm.front.lanes import Lane, Lanes
from ringcomm.front.planner import Planner

#: prepared calls a group keeps (the oldest dropped first)
CALLS = 256


class Group(Protocol):
    """What a function that prepares calls uses of its process group."""

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
    #: sends and receives posted so far; the flight recorder (None: off), and the
    #: group as its entries name it
    p2p_seq: int
    flight: Any
    fr_tag: Any


def flight_meta(g: Any, call: "Call", method: str, args: tuple) -> tuple:
    """What the flight recorder says of a call of ProcessGroup ``method`` (its name in
    torch, sizes, dtypes, algorithm): made at the first call of its shape."""
    meta = call.fr
    if meta is None:
        lib = "nccl" if call.lane.key.startswith(g.lanes.nccl_type) else "gloo"
        meta = call.fr = flight.call_meta(method, lib, args, g.size(), call.name)
    return meta


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
        owned: buffers of the call's own that its collectives read or write (made on
            the caller's stream with the call, so recorded on the lane's stream at
            every run: a call dropped while its work is still queued on a GPU must
            not free them to the caller's stream).
        blocking: waiting on it blocks the CPU even on a stream (barrier).
    """

    __slots__ = ("name", "lane", "programs", "detail", "g", "owned", "fr")
    blocking = False

    def __init__(self, g: Group, lane: Lane, op: str, prepared: Sequence[tuple]):
        names = sorted({n for n, _ in prepared})
        self.name = f"{op}[{'+'.join(names)}]"
        self.lane = lane
        self.programs = [p for _, p in prepared]
        self.detail = g.detail
        self.g = g
        self.owned: tuple[torch.Tensor, ...] = ()
        #: what the flight recorder says of this call's shape (:func:`flight_meta`)
        self.fr: tuple | None = None

    def execute(self, *args: Any) -> Any:
        """Run the collective on this call's tensors; return the Work's result."""
        raise NotImplementedError

    def touched(self, args: Sequence) -> list[torch.Tensor]:
        """The tensors the call reads or writes, its own buffers and its programs'
        scratch included (recorded on the stream it runs on)."""
        return [*tensors_in(args), *self.owned,
                *(t for p in self.programs for t in getattr(p, "scratch", ()))]

    def same_call(self, op: str, fields: list[int]) -> None:
        """``RINGCOMM_DEBUG=DETAIL``: every rank runs the same call."""
        self.g.fingerprints.compare(self.lane, op, fields)

    def close(self) -> None:
        for p in self.programs:
            p.close()


def tensors_in(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``x`` (nested lists and tuples)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors_in(y)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Non-reducing collectives move bytes: one code path for every dtype."""
    return t.view(torch.uint8)


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def overlap(a: torch.Tensor, b: torch.Tensor) -> int:
    """How the memory of contiguous tensors ``a`` and ``b`` relates: 0 apart (or
    either is empty), 1 the same bytes exactly, 2 some bytes shared."""
    na, nb = nbytes_of(a), nbytes_of(b)
    if not na or not nb:
        return 0
    pa, pb = a.data_ptr(), b.data_ptr()
    if pa >= pb + nb or pb >= pa + na:
        return 0
    return 1 if pa == pb and na == nb else 2


def apart(x: torch.Tensor, outs: Sequence[torch.Tensor], own: int | None) -> torch.Tensor:
    """``x``, a collective's input, copied if it shares memory with one of its
    ``outs`` other than by being ``outs[own]`` exactly (the in-place form, which
    every program handles). A program may read its inputs after it wrote parts of
    its outputs (shm_direct does, round by round), so an input that overlaps an
    output otherwise would be read changed; gloo gives the result of the inputs as
    they were, and so does ringcomm."""
    for j, o in enumerate(outs):
        how = overlap(x, o)
        if how == 2 or (how == 1 and j != own):
            return x.clone()
    return x


def timeout_of(g: Group, timeout: Any) -> float:
    """The seconds a call with torch's ``opts.timeout`` gets: the group's own where
    torch left it unset (negative) or zero, or it is missing."""
    return (g.timeout_s if timeout is None or timeout.days < 0 or not timeout
            else timeout.total_seconds())


def lookup(g: Group, key: Any, make) -> Call:
    call = g.calls.get(key)
    if call is None:
        call = g.calls.put(key, make())
    return call


def flat_bytes(ts: Sequence[torch.Tensor], copy_in: bool) -> tuple[list, list]:
    """1-D contiguous byte views of ``ts`` for a program to run on, and what must be
    written back after it ran (:func:`write_back`): a non-contiguous tensor gets a
    temporary copy (filled from it where ``copy_in``). Without a context manager per
    tensor: a list of outputs costs a microsecond or two per tensor less (the common
    case, 1-D and contiguous, is one view)."""
    flats, back = [], []
    for t in ts:
        if t.is_contiguous():
            flats.append(t.view(torch.uint8) if t.dim() == 1 else t.view(-1).view(torch.uint8))
        else:
            tmp = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype,
                                                             device=t.device)
            flats.append(tmp.view(-1).view(torch.uint8))
            back.append((t, tmp))
    return flats, back


def write_back(back: list) -> None:
    """Copy :func:`flat_bytes`' temporaries into the tensors they stood for."""
    for t, tmp in back:
        t.copy_(tmp)


@contextlib.contextmanager
def flat_view(t: torch.Tensor, copy_in: bool = True) -> Iterator[torch.Tensor]:
    """A 1-D contiguous view of ``t``; a non-contiguous ``t`` gets a temporary copy
    that is written back afterwards."""
    if t.is_contiguous():
        yield t.view(-1)
        return
    tmp = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype, device=t.device)
    yield tmp.view(-1)
    t.copy_(tmp)
