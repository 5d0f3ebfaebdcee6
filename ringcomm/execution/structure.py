"""The structural check of one rank's schedule (:func:`validate`): every region
inside a buffer that exists on that rank, local operations well formed, and no step
that receives into memory it sends from or receives into twice."""
from __future__ import annotations

import bisect

from ringcomm.execution.findings import Finding, refusal
from ringcomm.schedule import (REDUCING, Copy, Reduce, Region, Schedule, ScheduleError,
                               buffer_lengths)

_LOCAL_OPS = (Reduce, Copy)


def validate(s: Schedule) -> None:
    """Structural checks of one rank's schedule.

    Raises:
        ScheduleError: naming the rank, step and region at fault (its finding:
            ``structure``).
    """
    ctx = s.ctx
    lens = buffer_lengths(ctx)
    nb = s.nbuffers + len(s.scratch)
    reducing = ctx.collective in REDUCING

    def refuse(i: int, what: str, peer: int | None = None) -> ScheduleError:
        return refusal(f"{ctx.collective} rank {ctx.rank} step {i}: {what}",
                        Finding("structure", rank=ctx.rank, step=i, peer=peer))

    # every region is checked, so the words of a refusal are made only for one:
    # formatting them for each of a 1,024-rank ring's 4 million regions took seconds
    sizes = [s.buffer_len(b, lens) for b in range(nb)]

    def fits(rg: Region) -> bool:
        ln = sizes[rg.buf] if 0 <= rg.buf < nb else None
        return ln is not None and 0 <= rg.off and 0 <= rg.n and rg.off + rg.n <= ln

    def outside(i: int, rg: Region, what: str, peer: int | None = None) -> ScheduleError:
        if not 0 <= rg.buf < nb:
            return refuse(i, f"{what} uses buffer {rg.buf}, which does not exist "
                             f"(buffers 0..{nb - 1})", peer)
        if sizes[rg.buf] is None:
            return refuse(i, f"{what} uses buffer {rg.buf}, which rank {ctx.rank} does not "
                             "have", peer)
        return refuse(i, f"{what} region {tuple(rg)} is outside buffer {rg.buf} of "
                         f"{sizes[rg.buf]} elements", peer)

    for i, st in enumerate(s.steps):
        for x in st.sends:
            if not fits(x.region):
                raise outside(i, x.region, f"send to rank {x.peer}", x.peer)
        for x in st.recvs:
            if not fits(x.region):
                raise outside(i, x.region, f"receive from rank {x.peer}", x.peer)
        for op in st.local:
            if type(op) not in _LOCAL_OPS and not isinstance(op, _LOCAL_OPS):
                raise refuse(i, f"unknown local op {op!r}")
            if not reducing and isinstance(op, Reduce):
                raise refuse(i, f"{ctx.collective} does not reduce, but the step has a reduce")
            if not fits(op.dst):
                raise outside(i, op.dst, f"{type(op).__name__.lower()} destination")
            if not fits(op.src):
                raise outside(i, op.src, f"{type(op).__name__.lower()} source")
            name = type(op).__name__.lower
            if op.dst.n != op.src.n:
                raise refuse(i, f"{name()} of {op.src.n} elements into {op.dst.n}")
            if _overlap(op.dst, op.src):  # torch refuses or is undefined for these
                raise refuse(i, f"{name()} destination {tuple(op.dst)} overlaps its source "
                                f"{tuple(op.src)}")
        if st.recvs:
            _disjoint_writes(st, lambda what: refuse(i, what))


def _disjoint_writes(st, refuse) -> None:
    """A step's receives write disjoint memory, none of which its sends read: the
    regions sorted once, each checked against its neighbours (a step of one_shot on
    1,024 ranks has 1,023 receives)."""
    written = sorted((x.region for x in st.recvs if x.region.n > 0),
                     key=lambda rg: (rg.buf, rg.off))
    for a, b in zip(written, written[1:]):
        if _overlap(a, b):
            raise refuse(f"two receives write region {tuple(a)} and {tuple(b)}")
    keys = [(rg.buf, rg.off) for rg in written]
    for x in st.sends:
        rg = x.region
        if rg.n <= 0:
            continue
        # the last write starting before the send's end is the only one that can
        # overlap it (the writes are disjoint and sorted)
        k = bisect.bisect_left(keys, (rg.buf, rg.off + rg.n)) - 1
        if k >= 0 and _overlap(rg, written[k]):
            raise refuse(f"sends region {tuple(rg)} while receiving into "
                         f"{tuple(written[k])} in the same step")


def _overlap(a: Region, b: Region) -> bool:
    return a.buf == b.buf and a.n > 0 and b.n > 0 and a.off < b.off + b.n and b.off < a.off + a.n


# -- symbolic contents --------------------------------------------------------------
