"""Direct schedules: every rank talks to every other rank in the same step.

On one host, where the transport is shared memory, a message costs a hand-over
per pair and all pairs move at once, so the number of steps, not the bytes on
a link, is what a collective pays for: these algorithms take one or two steps
for any p where the ring takes 2(p-1) and recursive doubling log2 p.

======================  ==============  ============================================
algorithm               collective      steps (p ranks; k segments where segmented)
======================  ==============  ============================================
``one_shot``            allreduce       k: every rank sends its whole buffer to
                                        every other and reduces all it received
``two_shot``            allreduce       k + 1: a direct reduce-scatter (rank j
                                        reduces chunk j), then a direct allgather
``direct``              reduce_scatter  k: chunk j goes to rank j, which reduces it
``direct``              allgather       1: every rank's block to every other
``direct``              broadcast       1: the root sends to every rank
======================  ==============  ============================================

``one_shot`` moves (p-1) n per rank and reduces (p-1) n: for small messages,
where one step beats log2 p. ``two_shot`` moves and reduces what the ring does,
(p-1)/p n, in two steps. They are the one-shot and two-shot allreduces of
GPU libraries (TensorRT-LLM's custom allreduce, vLLM's) and of DeepSpeed's CPU
shared-memory allreduce, written as schedules.

Every rank combines the values of one element in rank order, ``x0 + x1 + ... +
x(p-1)``, so floating-point results are the same bits on every rank: rank r
holds ``x_r``; it first sums ``x_0 .. x_r`` in order in the scratch of rank 0's
message, copies that into place, then adds ``x_(r+1)`` onwards. (Not ``x_r + s``
for ``s + x_r``: MIN and MAX of +0 and -0 give the second operand's sign.) The peers' messages are listed by
distance (r+1, r+2, ...), so ranks do not all send to the same peer first.
"""
from __future__ import annotations

from ringcomm.schedule import (SCRATCH_SLOTS, Builder, Context, Copy, Reduce, Region, Schedule,
                               pieces, split_even)


def _peers(ctx: Context) -> list[int]:
    """Every other rank, nearest first (r+1, r+2, ... modulo p)."""
    p, r = ctx.size, ctx.rank
    return [(r + s) % p for s in range(1, p)]


def _in_rank_order(r: int, dst: Region, got: dict[int, Region]) -> list[Reduce]:
    """Local steps that leave in ``dst`` (which holds rank ``r``'s value) the reduction
    of rank 0's value, rank 1's, ... in that order; ``got[j]`` holds rank j's
    value (j != r) and may be overwritten."""
    before = sorted(j for j in got if j < r)
    after = sorted(j for j in got if j > r)
    out = []
    if before:  # acc = x0 op ... op x(r-1) op x_r, folded left, then into dst
        acc = got[before[0]]
        out += [Reduce(acc, got[j]) for j in before[1:]]
        out += [Reduce(acc, dst), Copy(dst, acc)]
    return out + [Reduce(dst, got[j]) for j in after]


def _windows(b: Builder, peers: list[int], longest: int, seg: int) -> dict:
    """Per peer, up to ``SCRATCH_SLOTS`` scratch slots of one segment each, no more than
    there are segments (receives of later segments reuse them once their reduction
    ran)."""
    slot = min(seg, longest)
    n = min(SCRATCH_SLOTS, -(-longest // slot))
    tmp = b.scratch(len(peers) * n * slot)
    return {j: [Region(tmp, (i * n + w) * slot, slot) for w in range(n)]
            for i, j in enumerate(peers)}


def _slot(slots: list[Region], k: int, n: int) -> Region:
    """The first ``n`` elements of the slot segment ``k`` is received into."""
    s = slots[k % len(slots)]
    return Region(s.buf, s.off, n)


def _reduce_direct(b: Builder, out_of: dict[int, Region], mine: Region) -> None:
    """A direct reduce-scatter: ``out_of[j]`` (a region per peer j) goes to rank j;
    every peer's region for this rank arrives and is reduced into ``mine`` (which
    holds this rank's own), segment by segment."""
    ctx = b.ctx
    peers = _peers(ctx)
    parts = {j: pieces(rg, ctx.seg) for j, rg in out_of.items()}
    into = pieces(mine, ctx.seg)
    k_max = max([len(into), *(len(v) for v in parts.values())])
    if k_max == 0:
        return
    slots = _windows(b, peers, mine.n, ctx.seg) if into else {}
    for k in range(k_max):
        sends = [(j, parts[j][k]) for j in peers if k < len(parts[j])]
        recvs, got = [], {}
        if k < len(into):
            d = into[k]
            for j in peers:
                got[j] = _slot(slots[j], k, d.n)
                recvs.append((j, got[j]))
            b.step(sends, recvs, _in_rank_order(ctx.rank, d, got))
        else:
            b.step(sends)


def _gather_direct(b: Builder, mine: Region, theirs: dict[int, Region]) -> None:
    """A direct allgather: ``mine`` to every peer, peer j's into ``theirs[j]``, one step
    (empty regions send nothing; every rank knows every length)."""
    peers = _peers(b.ctx)
    b.step([(j, mine) for j in peers if mine.n],
           [(j, theirs[j]) for j in peers if theirs[j].n])


def one_shot(ctx: Context) -> Schedule:
    """Allreduce of buffer 0: every rank's whole buffer to every other, each reducing
    all of them, in segments of ``ctx.seg``."""
    b = Builder(ctx)
    if ctx.size == 1:
        return b.build()
    data = Region(0, 0, ctx.layout[0])
    peers = _peers(ctx)
    segments = pieces(data, ctx.seg)
    if not segments:
        return b.build()
    slots = _windows(b, peers, data.n, ctx.seg)
    for k, d in enumerate(segments):
        got = {j: _slot(slots[j], k, d.n) for j in peers}
        b.step([(j, d) for j in peers], [(j, got[j]) for j in peers],
               _in_rank_order(ctx.rank, d, got))
    return b.build()


def two_shot(ctx: Context) -> Schedule:
    """Allreduce of buffer 0: chunk j (of p) reduced on rank j from every rank's chunk j
    sent straight to it, then sent from rank j to every rank."""
    b = Builder(ctx)
    p, r = ctx.size, ctx.rank
    if p == 1:
        return b.build()
    chunks = split_even(Region(0, 0, ctx.layout[0]), p)
    _reduce_direct(b, {j: chunks[j] for j in _peers(ctx)}, chunks[r])
    _gather_direct(b, chunks[r], {j: chunks[j] for j in _peers(ctx)})
    return b.build()


def reduce_scatter(ctx: Context) -> Schedule:
    """Reduce-scatter of chunks 0..p-1 into the output (buffer p): chunk j straight to
    rank j, which reduces what every rank sent into its own chunk, then copies it
    out."""
    b = Builder(ctx)
    p, r = ctx.size, ctx.rank
    chunks = [Region(i, 0, n) for i, n in enumerate(ctx.layout)]
    _reduce_direct(b, {j: chunks[j] for j in _peers(ctx)}, chunks[r])
    if chunks[r].n:
        b.local(Copy(Region(p, 0, chunks[r].n), chunks[r]))
    return b.build()


def allgather(ctx: Context) -> Schedule:
    """Allgather of the input (buffer p) into chunks 0..p-1, one step."""
    b = Builder(ctx)
    p, r = ctx.size, ctx.rank
    n = ctx.layout[r]
    if n:
        b.local(Copy(Region(r, 0, n), Region(p, 0, n)))
    _gather_direct(b, Region(p, 0, n), {j: Region(j, 0, ctx.layout[j]) for j in range(p)})
    return b.build()


def broadcast(ctx: Context) -> Schedule:
    """Broadcast of the root's buffer 0: the root sends it to every rank, one step."""
    b = Builder(ctx)
    data = Region(0, 0, ctx.layout[0])
    if ctx.size > 1 and data.n:
        if ctx.rank == ctx.root:
            b.step(sends=[(j, data) for j in _peers(ctx)])
        else:
            b.step(recvs=[(ctx.root, data)])
    return b.build()


#: what ``import ringcomm`` registers of this module: (collective, name) -> builder
REGISTERS = {("allreduce", "one_shot"): one_shot, ("allreduce", "two_shot"): two_shot,
             ("allgather", "direct"): allgather, ("broadcast", "direct"): broadcast,
             ("reduce_scatter", "direct"): reduce_scatter}
#: each algorithm's row in docs/architecture.md's generated table: name -> (its
#: steps, where it wins)
ROWS = {
    'one_shot': (
        "one step per segment: every rank's buffer to every rank, each reducing all p"
        ' in rank order (the same bits everywhere)',
        'not yet: on one host with shared memory, small messages from 3 ranks on; '
        "auto's rows for it await a measurement on a host with a core per rank (at 2 "
        'ranks it is recursive doubling)'),
    'two_shot': (
        'a direct reduce-scatter (chunk j from every rank straight to rank j, '
        "segmented), then a direct allgather: k + 1 steps, the ring's bytes",
        'not yet: large messages on one host from 3 ranks on, as above (at 2 ranks it'
        " is the ring's messages)"),
    'direct': (
        'one step (reduce_scatter: one per segment), every rank straight to every '
        'rank',
        'not yet, as above; select it by hand'),
}
