"""Per-rank program: the shared-memory transport (ringcomm/transport/shm/).

Modes (first argument):

``correct``: every collective and algorithm against a single-process oracle, at
sizes around the slot size (run with small slots: chunking and full FIFOs), over
the transport the group got; which ranks it reaches through shared memory (all on
one host, a block's with ``RINGCOMM_LOCAL_SIZE``); that no segment of the job is
left in the directory once the group exists; ``--expect mpi`` where set-up must
have fallen back to MPI.

``mismatch``: rank 0 reduces fewer elements than the others (``--sizes``; on both
sides of ``RINGCOMM_SHM_MIN_BYTES``, the two sizes go different ways), or runs
another algorithm (``--algos``: shm_direct against a schedule), or rank 0 and the
others make different calls (``--calls``: shm_direct broadcast, allgather,
reduce_scatter of other collectives or roots, or against a schedule): every rank
fails with an error naming the sizes or the mismatch, well before the group's
timeout.

``kill``: the last rank kills itself (SIGKILL) at a collective; every other rank
fails, naming that rank and its host, well before the group's timeout, and writes
what it found to ``$SHM_CHECK_OUT/rank<r>``.
"""
from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from ringcomm import settings
from ringcomm.front.create import GROUPS
from ringcomm.testing import check_collectives
from ringcomm.transport.shm import ShmTransport
from _common import Checker

TIMEOUT_S = 60.0


def world_group():
    return next(g for g in GROUPS if g.size() == dist.get_world_size())


def transports():
    return [lane.tp for lane in world_group().lanes.cpus]


def left_in_directory(tp) -> list[str]:
    return [p for p in getattr(tp, "segments", ()) if os.path.exists(p)]


def correct(c: Checker, rank: int, size: int, expect: str) -> None:
    tps = transports()
    if expect == "mpi":
        c.check(not any(isinstance(tp, ShmTransport) for tp in tps),
                f"set-up should have fallen back to MPI, got {[type(t).__name__ for t in tps]}")
    else:
        local = settings.get("RINGCOMM_LOCAL_SIZE") or size
        block = [r for r in range(size) if r // local == rank // local and r != rank]
        for tp in tps:
            c.check(isinstance(tp, ShmTransport), f"transport is {type(tp).__name__}")
            if isinstance(tp, ShmTransport):
                peers = tp.same_host_peers()
                c.check(peers == block, f"same-host peers {peers} != {block}")
                c.check(not left_in_directory(tp), f"segments left: {left_in_directory(tp)}")
    slot = settings.get("RINGCOMM_SHM_SLOT_BYTES")
    for numel in (1, slot // 4 - 1, slot // 4 + 1, 3 * slot // 4 + 5):
        c.count += c.run(f"check_collectives numel={numel}", check_collectives, world_group(),
                         "cpu", dtypes=(torch.float32, torch.int64), numel=numel) or 0
    # a large message through few small slots, each algorithm of allreduce
    x = torch.arange(300_000, dtype=torch.float64) + rank
    want = torch.arange(300_000, dtype=torch.float64) * size + sum(range(size))
    for algo in ("ring", "tree", "recursive_doubling", "double_tree"):
        g = dist.new_group(pg_options=ringcomm.Options(algorithms={"allreduce": algo}))
        y = x.clone()
        c.run(f"allreduce {algo}", dist.all_reduce, y, group=g)
        c.check(torch.equal(y, want), f"allreduce {algo}: wrong sum")
    if expect != "mpi":
        # one group off by its options; one off on rank 0 only (off on every rank)
        for what, opt in (("every rank", False), ("rank 0", rank != 0)):
            g = dist.new_group(pg_options=ringcomm.Options(shared_memory=opt))
            kinds = [type(lane.tp).__name__ for lane in ringcomm.get_group(g).lanes.cpus]
            c.check(kinds == ["MPITransport"], f"shared_memory=False on {what}: {kinds}")
            y = x.clone()
            c.run(f"allreduce shared_memory=False on {what}", dist.all_reduce, y, group=g)
            c.check(torch.equal(y, want), f"shared_memory=False on {what}: wrong sum")
    direct(c, rank, size, expect)
    if size % 2 == 0 and settings.get("RINGCOMM_LOCAL_SIZE"):
        g = dist.new_group(pg_options=ringcomm.Options(algorithms={"allreduce": "hierarchical"}))
        y = x.clone()
        c.run("allreduce hierarchical", dist.all_reduce, y, group=g)
        c.check(torch.equal(y, want), "allreduce hierarchical: wrong sum")


def direct(c: Checker, rank: int, size: int, expect: str) -> None:
    """shm_direct: served where every rank shares the host (several rounds of a small
    window, every rank the same bits of a MIN or MAX of signed zeros), refused naming
    the reason elsewhere."""
    one_host = expect != "mpi" and not settings.get("RINGCOMM_LOCAL_SIZE")
    g = dist.new_group(pg_options=ringcomm.Options(algorithms={"allreduce": "shm_direct"}))
    served = [lane.tp.direct is not None for lane in ringcomm.get_group(g).lanes.cpus
              if isinstance(lane.tp, ShmTransport)]
    c.check(served == ([True] if one_host else [False] * len(served)),
            f"shm_direct window: {served}, every rank on one host: {one_host}")
    x = torch.arange(300_000, dtype=torch.float64) + rank
    want = torch.arange(300_000, dtype=torch.float64) * size + sum(range(size))
    if not one_host:
        try:
            dist.all_reduce(x.clone(), group=g)
            c.check(False, "shm_direct ran on a group of several hosts")
        except ValueError as e:
            c.check("one host" in str(e), f"refusal names no reason: {e}")
        return
    window = settings.get("RINGCOMM_SHM_DIRECT_BYTES")
    y = x.clone()
    c.run("allreduce shm_direct", dist.all_reduce, y, group=g)
    c.check(torch.equal(y, want), f"allreduce shm_direct of {x.nbytes // window + 1} rounds: "
                                  "wrong sum")
    direct_others(c, rank, size, window)
    gen = torch.Generator().manual_seed(rank)
    zeros = torch.where(torch.rand(1000, generator=gen) < 0.5, 0.0, -0.0)
    for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        z = zeros.clone()
        dist.all_reduce(z, op=op, group=g)
        bits = [torch.empty(1000, dtype=torch.int32) for _ in range(size)]
        dist.all_gather(bits, z.view(torch.int32))
        c.check(all(torch.equal(b, bits[0]) for b in bits),
                f"shm_direct {op}: ranks disagree on the sign of a zero")


def _rounds(call, *args, **kw) -> int:
    """The shm_direct rounds a call took on this rank's window (the world group's
    transport and the groups' share none: a group's own transport counts)."""
    g = kw["group"]
    tp = ringcomm.get_group(g).lanes.cpus[0].tp
    before = tp.rounds
    call(*args, **kw)
    return tp.rounds - before


def direct_others(c: Checker, rank: int, size: int, window: int) -> None:
    """shm_direct's broadcast, allgather and reduce_scatter against a single-process
    oracle, in several rounds of the window, in place and not, with uneven chunks;
    each takes the rounds its sizes give (it ran over the window, not a schedule)."""
    g = dist.new_group(pg_options=ringcomm.Options(algorithms={
        c_: "shm_direct" for c_ in ("broadcast", "allgather", "reduce_scatter")}))
    def of(r: int, n: int, dtype=torch.float32) -> torch.Tensor:
        return ((torch.arange(n) * (r + 3)) % 251).to(dtype)
    for n, dtype in ((70_001, torch.float32), (5, torch.bfloat16), (0, torch.float32),
                     (20_000, torch.int64)):
        nbytes, isz = n * dtype.itemsize, dtype.itemsize
        whole = max(-(-nbytes // window), 1)  # rounds of a per-rank part of n elements
        for root in range(size):
            t = of(root, n, dtype) if rank == root else torch.zeros(n, dtype=dtype)
            k = _rounds(dist.broadcast, t, root, group=g)
            # (a broadcast of nothing is done before it reaches an algorithm)
            c.check(torch.equal(t, of(root, n, dtype)) and k == (whole if n else 0),
                    f"broadcast shm_direct root={root} {dtype} n={n}: rounds {k}/{whole}")
        outs = [torch.full((n,), 7, dtype=dtype) for _ in range(size)]
        k = _rounds(dist.all_gather, outs, of(rank, n, dtype), group=g)
        c.check(all(torch.equal(o, of(r, n, dtype)) for r, o in enumerate(outs))
                and k == whole, f"allgather shm_direct {dtype} n={n}: rounds {k}/{whole}")
        flat = torch.zeros(n * size, dtype=dtype)  # in place: the input is its own chunk
        mine = flat[rank * n:(rank + 1) * n]
        mine.copy_(of(rank, n, dtype))
        dist.all_gather_into_tensor(flat, mine, group=g)
        c.check(torch.equal(flat, torch.cat([of(r, n, dtype) for r in range(size)])),
                f"allgather shm_direct in place {dtype} n={n}")
        # an input that overlaps the output without being this rank's chunk (one
        # element off it): as gloo, every rank gets the inputs as they were
        spare = torch.zeros(n * size + 1, dtype=dtype)
        shifted = spare[rank * n + 1:(rank + 1) * n + 1]
        shifted.copy_(of(rank, n, dtype))
        dist.all_gather_into_tensor(spare[:n * size], shifted, group=g)
        c.check(torch.equal(spare[:n * size], torch.cat([of(r, n, dtype) for r in range(size)])),
                f"allgather shm_direct, input overlapping the output, {dtype} n={n}")
        # reduce_scatter: chunk j of rank r's input is of(r + j); rank order sums
        stride = max(window // size // 64 * 64, isz) // isz
        per_chunk = max(-(-n // stride), 1)
        inp = torch.cat([of(rank + j, n, dtype) for j in range(size)])
        want = of(0 + rank, n, dtype)
        for r in range(1, size):
            want = want + of(r + rank, n, dtype)
        out = torch.empty(n, dtype=dtype)
        k = _rounds(dist.reduce_scatter_tensor, out, inp.clone(), group=g)
        c.check(torch.equal(out, want) and k == per_chunk,
                f"reduce_scatter shm_direct {dtype} n={n}: rounds {k}/{per_chunk}")
        inp2 = inp.clone()  # the output is this rank's chunk of the input
        dist.reduce_scatter_tensor(inp2[rank * n:(rank + 1) * n], inp2, group=g)
        c.check(torch.equal(inp2[rank * n:(rank + 1) * n], want),
                f"reduce_scatter shm_direct in place {dtype} n={n}")
        # an output that overlaps the inputs without being this rank's chunk (one
        # element off it): as gloo, the result of the inputs as they were
        base = torch.cat([inp, torch.zeros(1, dtype=dtype)])
        shifted = base[rank * n + 1:(rank + 1) * n + 1]
        dist.reduce_scatter(shifted, [base[j * n:(j + 1) * n] for j in range(size)], group=g)
        c.check(torch.equal(shifted, want),
                f"reduce_scatter shm_direct, output overlapping the inputs, {dtype} n={n}")
    direct_barrier(c, rank, size)
    direct_coalesced(c, rank, size, window)
    # uneven allgather chunks: rank i gives i + 1 elements, in several rounds
    big = window // 4 + 3
    outs = [torch.empty(big * (i + 1)) for i in range(size)]
    dist.all_gather(outs, of(rank, big * (rank + 1)), group=g)
    c.check(all(torch.equal(o, of(r, big * (r + 1))) for r, o in enumerate(outs)),
            "allgather shm_direct of uneven chunks")


def direct_coalesced(c: Checker, rank: int, size: int, window: int) -> None:
    """allreduce_coalesced over shm_direct, against a single-process oracle: tensors
    contiguous and apart are reduced where they lie (no packed buffer is ever made),
    their pieces crossing the window's rounds, one of them empty, two dtypes; a list
    that names one tensor twice, a non-contiguous tensor or AVG packs as before."""
    g = dist.new_group(pg_options=ringcomm.Options(algorithms={"allreduce": "shm_direct"}))
    pg = ringcomm.get_group(g)
    per_round = window // 4
    sizes = (per_round // 3, 0, per_round + 7, 5, 2 * per_round)

    def inputs(r: int, dtype=torch.float32) -> list[torch.Tensor]:
        return [((torch.arange(n) * (r + 2) + i) % 97).to(dtype) for i, n in enumerate(sizes)]

    def want(dtype=torch.float32) -> list[torch.Tensor]:
        every = [inputs(r, dtype) for r in range(size)]
        return [sum(x[i] for x in every) for i in range(len(sizes))]

    def reduce(ts: list, op=dist.ReduceOp.SUM) -> None:
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = op
        pg.allreduce_coalesced(ts, opts).wait()

    def packed_buffers() -> int:
        return sum(1 for call in pg.calls.values() if hasattr(call, "parts")
                   for part in call.parts if part.flat is not None)

    ts = inputs(rank) + inputs(rank, torch.int64)
    for _ in range(2):  # the second call finds its pieces bound
        ts = inputs(rank) + inputs(rank, torch.int64)
        reduce(ts)
        c.check(all(torch.equal(t, w) for t, w in zip(ts, want() + want(torch.int64))),
                "allreduce_coalesced shm_direct in place: wrong sums")
    c.check(packed_buffers() == 0, "allreduce_coalesced shm_direct packed contiguous tensors")
    x = inputs(rank)[2]
    twice = [x, x.clone()[:5], x]  # x twice: reduced where it lies, the second would read sums
    reduce(twice)
    full = want()[2]
    c.check(torch.equal(twice[0], full) and torch.equal(twice[1], full[:5]),
            "allreduce_coalesced shm_direct of one tensor named twice: wrong sums")
    grid = torch.arange(64.0).view(8, 8) * (rank + 1)
    apart = [grid.t(), torch.ones(3)]  # non-contiguous: packed
    reduce(apart)
    c.check(torch.equal(apart[0], (torch.arange(64.0).view(8, 8) * sum(range(1, size + 1))).t())
            and torch.equal(apart[1], torch.full((3,), float(size))),
            "allreduce_coalesced shm_direct of a non-contiguous tensor: wrong sums")
    avg = inputs(rank)
    reduce(avg, dist.ReduceOp.AVG)
    c.check(all(torch.allclose(t, w / size) for t, w in zip(avg, want())),
            "allreduce_coalesced shm_direct AVG: wrong averages")
    c.check(packed_buffers() == 3, f"packed buffers: {packed_buffers()}, want 3 (twice, "
                                   "non-contiguous, AVG)")
    ring = ringcomm.get_group(dist.new_group(pg_options=ringcomm.Options(
        algorithms={"allreduce": "ring"})))
    says = (pg.reduces_in_place(inputs(rank)), pg.reduces_in_place(twice),
            pg.reduces_in_place(apart), ring.reduces_in_place(inputs(rank)))
    c.check(says == (True, False, False, False), f"reduces_in_place: {says}, want "
            "True for shm_direct's apart tensors, False named twice, non-contiguous, or a ring")


def direct_barrier(c: Checker, rank: int, size: int) -> None:
    """shm_direct's barrier is auto's on one host: one round of the window, and no
    rank leaves before the last one arrived (that one sleeps first, then says it came
    in the store; the others read every rank's word once they left)."""
    g = dist.new_group()
    c.check(_rounds(dist.barrier, group=g) == 1, "auto's barrier on one host: not one round")
    store = dist.distributed_c10d._get_default_store()
    if rank == size - 1:
        time.sleep(0.3)
    store.set(f"direct-barrier/{rank}", "1")
    store.get(f"direct-barrier/{rank}")  # (a get waits for the set on this connection)
    t0 = time.monotonic()
    dist.barrier(group=g)
    waited = time.monotonic() - t0
    c.check(store.check([f"direct-barrier/{r}" for r in range(size)]),
            "shm_direct barrier returned before every rank arrived")
    c.check(rank == size - 1 or waited > 0.2, f"rank {rank} waited only {waited:.3f} s")


def must_fail(c: Checker, what: str, x: torch.Tensor, call=None) -> str:
    """Run an allreduce of ``x`` (or ``call()``) that must fail well before the group's
    timeout; the error's text ("" when it returned)."""
    t0 = time.monotonic()
    try:
        call() if call is not None else dist.all_reduce(x)
    except Exception as e:  # noqa: BLE001
        took = time.monotonic() - t0
        c.case(f"shm: {what}", e, took)
        c.check(took < TIMEOUT_S / 2, f"took {took:.1f} s, the group's timeout is {TIMEOUT_S}")
        return str(e)
    c.check(False, f"{what}: the call returned")
    return ""


def _call(spec: str, n: int):
    """A collective of ``n`` floats per rank, from ``COLLECTIVE:ALGORITHM[:ROOT]``."""
    coll, algo, *root = spec.split(":")
    ringcomm.set_algorithm(coll, algo)
    p = dist.get_world_size()
    if coll == "barrier":
        return dist.barrier
    if coll == "broadcast":
        t = torch.ones(n)
        return lambda: dist.broadcast(t, int(root[0]) if root else 0)
    if coll == "allgather":
        outs, x = [torch.empty(n) for _ in range(p)], torch.ones(n)
        return lambda: dist.all_gather(outs, x)
    out, x = torch.empty(n), torch.ones(n * p)
    return lambda: dist.reduce_scatter_tensor(out, x)


#: words of ringcomm's insides that a mismatch's message must not use: it speaks of
#: calls, sizes and ranks, on every transport
INTERNAL_WORDS = ("round", "schedule", "shm_direct collective", "window", "shared memory")


def user_words(c: Checker, text: str) -> None:
    inside = [w for w in INTERNAL_WORDS if w in text.lower()]
    c.check(not inside, f"the mismatch's message speaks of {inside}: {text}")


def mismatch_calls(c: Checker, rank: int, calls: tuple[str, ...], n: int) -> None:
    """Rank 0 makes the first call, the others the last (``--calls``): shm_direct
    collectives of one size that differ in collective or root, or one against a
    schedule; every rank fails naming the mismatch."""
    call = _call(calls[0] if rank == 0 else calls[-1], n)
    text = must_fail(c, f"mismatched calls {calls[0]} and {calls[-1]}", None, call)
    c.check("mismatch" in text, f"error names no mismatch: {text}")
    user_words(c, text)


def mismatch(c: Checker, rank: int, size: int, sizes: tuple[int, int],
             algos: tuple[str, ...]) -> None:
    if algos:  # rank 0 runs the first algorithm, the others the last
        ringcomm.set_algorithm("allreduce", algos[0] if rank == 0 else algos[-1])
    x = torch.ones(sizes[0] if rank == 0 else sizes[1])
    text = must_fail(c, f"mismatched allreduce sizes {sizes[0]} and {sizes[1]} floats", x)
    c.check("size" in text or "mismatch" in text, f"error names no size: {text}")
    user_words(c, text)


def kill(c: Checker, rank: int, size: int) -> None:
    x = torch.ones(100_000)  # above RINGCOMM_SHM_MIN_BYTES: over shared memory
    dist.all_reduce(x)  # every rank is up and mapped
    victim = size - 1
    if rank == victim:
        print(f"rank {rank}: killing myself at the second allreduce", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    text = must_fail(c, "a rank killed at an allreduce", x)
    c.check(f"rank {victim}" in text, f"error does not name rank {victim}: {text}")
    for tp in transports():
        c.check(not left_in_directory(tp), f"segments left: {left_in_directory(tp)}")
    # to a file: hydra may stop forwarding output once it saw a rank die
    out = os.environ.get("SHM_CHECK_OUT", "")
    if os.path.isdir(out):
        with open(os.path.join(out, f"rank{rank}"), "w") as f:
            f.write("survived\n" + "".join(f"FAIL {x}\n" for x in c.failures))
    os._exit(1 if c.failures else 0)  # the group cannot be torn down with a dead member


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("correct", "mismatch", "kill"))
    p.add_argument("--expect", choices=("shm", "mpi"), default="shm")
    p.add_argument("--sizes", default="100,200",
                   help="mismatch: the elements rank 0 and the others reduce")
    p.add_argument("--algos", default="",
                   help="mismatch: the allreduce algorithms of rank 0 and of the others")
    p.add_argument("--calls", default="",
                   help="mismatch: rank 0's call and the others', COLLECTIVE:ALGORITHM[:ROOT] "
                        "each, of the first of --sizes floats per rank")
    args = p.parse_args()
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=TIMEOUT_S))
    rank, size = dist.get_rank(), dist.get_world_size()
    c = Checker(rank)
    if args.mode == "kill":
        kill(c, rank, size)  # exits: a group with a dead member cannot be torn down
    elif args.mode == "mismatch" and args.calls:
        mismatch_calls(c, rank, tuple(args.calls.split(",")), int(args.sizes.split(",")[0]))
    elif args.mode == "mismatch":
        mismatch(c, rank, size, tuple(int(x) for x in args.sizes.split(",")),
                 tuple(a for a in args.algos.split(",") if a))
    else:
        correct(c, rank, size, args.expect)
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
