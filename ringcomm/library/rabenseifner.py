"""Rabenseifner's allreduce: a recursive-halving reduce-scatter, then a
recursive-doubling allgather (Rabenseifner 2004; Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", 2005).

The buffer is cut into ``pow2`` blocks (``pow2`` the largest power of two <= p).
In the reduce-scatter a rank exchanges half of its current window of blocks with
the rank at distance ``pow2/2``, then a quarter with the rank at ``pow2/4``, ...,
reducing what it receives, until it holds one fully reduced block; the allgather
retraces the same pairs in reverse, doubling what it holds each step. Every rank
sends and reduces ``(pow2-1)/pow2`` of the buffer, like the ring, but in
``2 log2 pow2`` steps instead of ``2 (p-1)``.

Non-power-of-two world sizes fold first, as MPICH does: among the first ``2 *
extra`` ranks (``extra = p - pow2``) each even rank hands its buffer to the next
odd rank and sits out; it receives the result at the end. That costs two more
steps and a whole-buffer message each way.

Steps: ``2 log2 pow2`` (+2 when p is not a power of two), each cut into pipeline
segments of ``ctx.seg`` elements (so scratch stays ``SCRATCH_SLOTS`` segments and the MPI
executor overlaps one segment's reduction with the next one's transfer).

When it wins: mid-size messages on 4 or more ranks, where recursive doubling's
whole-buffer exchanges cost too many bytes and the ring's 2(p-1) steps too much
latency (see ``ringcomm/algorithms/select.py`` for the rows ``auto`` follows).
"""
from __future__ import annotations

from ringcomm.schedule import SCRATCH_SLOTS, Builder, Context, Reduce, Region, Schedule, pieces


class _Slots:
    """A ring of ``SCRATCH_SLOTS`` scratch slots that reduced receives land in; allocated on
    first use, so ranks that never reduce ask for no scratch."""

    def __init__(self, b: Builder, slot: int):
        self.b, self.slot, self.buf, self.i = b, slot, None, 0

    def next(self, n: int) -> Region:
        if self.buf is None:
            self.buf = self.b.scratch(SCRATCH_SLOTS * self.slot)
        rg = Region(self.buf, (self.i % SCRATCH_SLOTS) * self.slot, n)
        self.i += 1
        return rg


def exchange(b: Builder, peer: int, send: Region | None, recv: Region | None,
             slots: _Slots | None) -> None:
    """Send ``send`` to ``peer`` and receive ``peer``'s matching data into ``recv``,
    segment by segment (step k moves segment k both ways). With ``slots`` the
    received data is reduced into ``recv``; without, it is written there."""
    seg = b.ctx.seg
    out = pieces(send, seg) if send is not None else []
    into = pieces(recv, seg) if recv is not None else []
    for k in range(max(len(out), len(into))):
        sends = [(peer, out[k])] if k < len(out) else []
        recvs, local = [], []
        if k < len(into):
            if slots is None:
                recvs = [(peer, into[k])]
            else:
                space = slots.next(into[k].n)
                recvs, local = [(peer, space)], [Reduce(into[k], space)]
        b.step(sends, recvs, local)


def allreduce(ctx: Context) -> Schedule:
    """Allreduce buffer 0 in place: fold, recursive halving, recursive doubling, unfold."""
    b = Builder(ctx)
    p, r, n = ctx.size, ctx.rank, ctx.layout[0]
    if p == 1 or n == 0:
        return b.build()
    data = Region(0, 0, n)
    slots = _Slots(b, min(ctx.seg, n))
    pow2 = 1 << (p.bit_length() - 1)
    extra = p - pow2
    if r < 2 * extra:
        if r % 2 == 0:  # folded away: hand the data over, get the result back
            exchange(b, r + 1, data, None, None)
            exchange(b, r + 1, None, data, None)
            return b.build()
        exchange(b, r - 1, None, data, slots)
        vr = r // 2
    else:
        vr = r - extra

    def real(v: int) -> int:
        """The rank playing virtual rank ``v`` of the power-of-two group."""
        return 2 * v + 1 if v < extra else v + extra

    # the blocks of split_even(data, pow2), by their offsets alone: a rank touches
    # log2 p spans of them, and listing all pow2 blocks cost a 16,384-rank plan 6 ms
    q, longer = divmod(n, pow2)

    def span(lo: int, hi: int) -> Region:
        """Blocks ``lo .. hi-1``: one contiguous region (possibly empty)."""
        a, e = lo * q + min(lo, longer), hi * q + min(hi, longer)
        return Region(0, a, e - a)

    # Reduce-scatter: the window [lo, hi) of 2*mask blocks holds vr; keep the half
    # with vr in it, send the other half to the partner, who keeps that one.
    lo, hi, mask = 0, pow2, pow2 >> 1
    while mask:
        mid = lo + mask
        keep, give = ((mid, hi), (lo, mid)) if vr & mask else ((lo, mid), (mid, hi))
        exchange(b, real(vr ^ mask), span(*give), span(*keep), slots)
        lo, hi = keep
        mask >>= 1
    # Allgather: rank vr holds the aligned group of ``mask`` blocks around block vr;
    # swapping with the partner's group doubles it.
    mask = 1
    while mask < pow2:
        mine, theirs = vr & ~(mask - 1), (vr ^ mask) & ~(mask - 1)
        exchange(b, real(vr ^ mask), span(mine, mine + mask), span(theirs, theirs + mask),
                 None)
        mask <<= 1
    if r < 2 * extra:
        exchange(b, r - 1, data, None, None)
    return b.build()


#: what ``import ringcomm`` registers of this module: (collective, name) -> builder
REGISTERS = {("allreduce", "rabenseifner"): allreduce}
#: each algorithm's row in docs/architecture.md's generated table: name -> (its
#: steps, where it wins)
ROWS = {
    'rabenseifner': (
        "recursive-halving reduce-scatter + recursive-doubling allgather: 2 log2 p' "
        "(+2 to fold the p - p' extra ranks, as MPICH), each cut into segments",
        'mid sizes from 4 ranks on: up to about p MiB on powers of two, less '
        'elsewhere; from 512 ranks on ever more of the sizes, every size from 8,192 '
        '(`scripts/auto_at_scale.py`)'),
}
