"""Hierarchical allreduce for groups spanning several hosts: reduce within each
host to its first rank (the host's *leader*), allreduce among the leaders with a
chosen algorithm, broadcast within each host.

Links inside a host (shared memory, NVLink) are much faster than between hosts,
so only one rank per host should talk across: the inter-host phase moves the
buffer once per host instead of once per rank. The host layout comes from
``ctx.hosts`` (the launcher's, or ``RINGCOMM_LOCAL_SIZE``); hosts may hold
different numbers of ranks. On one host it is a binomial reduce and broadcast
(a tree allreduce); with one rank per host it is the inter-host algorithm alone.

The phases are other registered builders, composed with
:meth:`ringcomm.schedule.Builder.include`: ``reduce``/``tree`` and
``broadcast``/``tree`` (binomial, pipelined) within hosts, any ``allreduce``
builder across them. Steps: ``2 ceil(log2 L)`` binomial steps per segment-pipeline
within hosts of up to L ranks, plus the inter-host algorithm's steps on H hosts.

The registered ``"hierarchical"`` uses :func:`by_size` across hosts: on two hosts
recursive doubling up to :data:`SMALL_BYTES` and the ring above, on more what
``auto``'s modelled rows pick for that many ranks (by the message's bytes, its
dtype's, ``ctx.itemsize``). Another
combination is one line::

    from ringcomm.library import hierarchical
    ringcomm.register_algorithm("allreduce", "hier_rab", hierarchical.make(inter="rabenseifner"))
"""
from __future__ import annotations

from typing import Callable

from ringcomm.algorithms import REGISTRY, select
from ringcomm.schedule import Builder, Context, Schedule


def _small_bytes() -> int:
    """The largest message the built-in 2-rank allreduce tuning (``select.py``, from
    the committed measurements) gives to recursive doubling: the leaders' exchange is
    a 2-rank exchange per step, over MPI."""
    rows = select.DEFAULT_TUNING["allreduce"].get("2", [])
    # where it gives recursive doubling no row (on one host, shm_direct took the whole
    # table), the last crossover measured over MPI: 1 MiB
    return max((upto for upto, algo in rows if algo == "recursive_doubling" and upto),
               default=1 << 20)


#: across two hosts, recursive doubling up to this many bytes and the ring above
SMALL_BYTES = _small_bytes()

Build = Callable[[Context], Schedule]


def _lookup(collective: str, inter: "str | Build") -> Build:
    """A builder by registered name (looked up when the schedule is built, so a
    replaced registration is followed), or the builder itself."""
    if callable(inter):
        return inter
    algos = REGISTRY[collective]
    build = algos.get(inter)
    if build is None or not callable(build):
        builders = sorted(name for name, f in algos.items() if callable(f))
        raise ValueError(f"hierarchical: {collective} algorithm {inter!r} is not a registered "
                         f"schedule builder (native and unknown names cannot be composed); "
                         f"builders: {builders}")
    return build


def leaders_algorithm(hosts: int, elements: int, itemsize: int = 4) -> str:
    """The allreduce :func:`by_size` runs among ``hosts`` leaders on ``elements``
    elements of ``itemsize`` bytes: on 2 hosts recursive doubling up to
    :data:`SMALL_BYTES`, the ring above (as measured across hosts); on more, what
    auto's modelled rows give for that many ranks and bytes (``select.MODELLED``:
    recursive doubling, tree, Rabenseifner, double tree or ring by size), since a
    ring among 256 leaders would take 510 steps for 64 KiB."""
    nbytes = elements * itemsize
    if hosts <= 2:
        return "recursive_doubling" if nbytes <= SMALL_BYTES else "ring"
    return select.choose(select.MODELLED, "allreduce", nbytes, hosts, bands=False)


def by_size(ctx: Context) -> Schedule:
    """Allreduce among the leaders, by their number and the call's bytes
    (:func:`leaders_algorithm`)."""
    return _lookup("allreduce", leaders_algorithm(ctx.size, ctx.layout[0], ctx.itemsize))(ctx)


def make(inter: "str | Build" = "ring", *, intra_reduce: "str | Build" = "tree",
         intra_broadcast: "str | Build" = "tree") -> Build:
    """A hierarchical allreduce builder.

    Args:
        inter: the allreduce among the hosts' leaders: a registered name or a builder.
        intra_reduce, intra_broadcast: the reduce to the leader (root 0 of the host's
            ranks) and the broadcast from it, by name or builder.
    Returns:
        ``build(ctx) -> Schedule``, to pass to :func:`ringcomm.register_algorithm`.
    Raises:
        ValueError: (when a schedule is built) a name that is not a registered builder.
    """
    for coll, x in (("allreduce", inter), ("reduce", intra_reduce),
                    ("broadcast", intra_broadcast)):
        if not callable(x) and not isinstance(x, str):
            raise TypeError(f"hierarchical.make: the {coll} must be a name or a builder, got "
                            f"{type(x).__name__}")

    def hierarchical(ctx: Context) -> Schedule:
        b = Builder(ctx)
        n = ctx.layout[0]
        if ctx.size == 1 or n == 0:
            return b.build()
        hosts = ctx.host_ranks()
        mine = hosts[ctx.host_of(ctx.rank)]
        i = mine.index(ctx.rank)
        local = len(mine)
        if local > 1:
            sub = Context("reduce", local, i, (n,), root=0, seg=ctx.seg, itemsize=ctx.itemsize)
            b.include(_lookup("reduce", intra_reduce)(sub), ranks=mine, buffers=[0])
        if i == 0 and len(hosts) > 1:
            leaders = [h[0] for h in hosts]
            sub = Context("allreduce", len(hosts), leaders.index(ctx.rank), (n,), seg=ctx.seg,
                          itemsize=ctx.itemsize)
            b.include(_lookup("allreduce", inter)(sub), ranks=leaders, buffers=[0])
        if local > 1:
            sub = Context("broadcast", local, i, (n,), root=0, seg=ctx.seg,
                          itemsize=ctx.itemsize)
            b.include(_lookup("broadcast", intra_broadcast)(sub), ranks=mine, buffers=[0])
        return b.build()

    name = inter if isinstance(inter, str) else getattr(inter, "__name__", "builder")
    hierarchical.__name__ = f"hierarchical_{name}"
    hierarchical.__qualname__ = hierarchical.__name__
    return hierarchical


#: the registered default: recursive doubling or ring across hosts, by size
allreduce = make(inter=by_size)


#: what ``import ringcomm`` registers of this module: (collective, name) -> builder
REGISTERS = {("allreduce", "hierarchical"): allreduce}
#: each algorithm's row in docs/architecture.md's generated table: name -> (its
#: steps, where it wins)
ROWS = {
    'hierarchical': (
        "binomial reduce within each host, any registered allreduce among the hosts' "
        'first ranks (`hierarchical.make(inter=...)`; default, on two hosts: '
        'recursive doubling up to the largest size the built-in 2-rank tuning gives '
        "it, ring above; on more: auto's modelled pick for that many ranks, "
        '`leaders_algorithm`), binomial broadcast within each host',
        'groups spanning several hosts with several ranks on some host (`ctx.hosts`)'),
}
