"""Where a small allreduce's time goes: the same 4 KiB allreduce timed layer by
layer, from MPI alone up to ``dist.all_reduce``, along the path a call takes:
``dist.all_reduce`` -> the group's method -> the prepared call (found by its
key) -> the engine -> the program (executor) -> the transport -> MPI.

    mpiexec -n 2 python scripts/bench_layers.py --flight --json docs/data/layers_2ranks.json

Each row adds one layer of ringcomm on top of the row before; times are the
maximum over ranks of the best of 5 rounds (each round times every layer in
turn) of the mean over many calls.
With ``--flight``, a last row is ``dist.all_reduce`` again with the flight recorder
on (:mod:`ringcomm.trace.flight`): what recording each call costs.
``--algo`` picks the algorithm (default recursive doubling: one exchange and
one add at 2 ranks). ``--deepspeed`` adds a row before ringcomm's: DeepSpeed's
shared-memory allreduce op called directly (no ProcessGroup dispatch), where
DeepSpeed is installed and its CPU op builds; ``--dispatch`` one of torch's
dispatch alone, ``dist.all_reduce`` into a process group that does nothing.
``--gap`` puts a barrier and a pause (``ringcomm.bench``'s ``--gap``) before
each call and times each alone: the median, and the median from the last rank's
start of the call (one clock on one host), which leaves out how far apart the
pause left the ranks.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import timeit

import numpy as np
import torch
import torch.distributed as dist

import ringcomm
from ringcomm.bench.cli import parse_gap
from ringcomm.bench.columns import register_null_backend
from ringcomm.bench.report import gap_text
from ringcomm.bench.timing import make_gap
from ringcomm.front import reductions
from ringcomm.trace import flight

#: the row of --dispatch: no collective (no peer to wait for), so it has no time
#: "from the last rank's start"
DISPATCH = "torch's dispatch alone (dist.all_reduce into a do-nothing group)"
#: the flight recorder's size in the last row (torch's default)
FLIGHT_ENTRIES = 2000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--algo", default="recursive_doubling")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds over all layers; each layer's best round is kept")
    ap.add_argument("--deepspeed", action="store_true",
                    help="also time DeepSpeed's shared-memory allreduce op (same ranks)")
    ap.add_argument("--dispatch", action="store_true",
                    help="also time torch's dispatch alone: dist.all_reduce into a process "
                         "group that does nothing (the floor column's first part)")
    ap.add_argument("--flight", action="store_true",
                    help="a last row: dist.all_reduce with the flight recorder on")
    ap.add_argument("--gap", type=parse_gap, default=None, metavar="US|busy:US|compute[:N]",
                    help="before each call an MPI barrier and this pause (as ringcomm.bench's "
                         "--gap), each call timed alone and the median kept")
    ap.add_argument("--json", help="write the results here (rank 0)")
    a = ap.parse_args(argv)
    dist.init_process_group("ringcomm")
    from mpi4py import MPI

    rank, p = dist.get_rank(), dist.get_world_size()
    if p != 2:
        raise SystemExit("bench_layers: run it on exactly 2 ranks")
    pg = ringcomm.get_group()
    world = ringcomm.launch.bootstrap.world_comm()
    n = a.bytes // 4
    t, s = torch.ones(n), torch.empty(n)
    peer = 1 - rank
    ringcomm.set_algorithm("allreduce", a.algo)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    call, args = reductions.allreduce(pg, [t], opts)
    program, lane = call.programs[0], call.lane
    tp, engine = lane.tp, lane.engine
    fa = MPI.buffer.fromaddress
    # the group's MPI communicator (under shared memory, the MPI transport it wraps)
    mpi_tp = getattr(tp, "inner", tp)
    comm = mpi_tp.comm.Dup()
    by_hand = [comm.Recv_init([fa(s.data_ptr(), s.nbytes), MPI.BYTE], peer, 7),
               comm.Send_init([fa(t.data_ptr(), t.nbytes), MPI.BYTE], peer, 7)]
    # as a program binds them: on the transport that carries them (a small message
    # skips the shared-memory wrapper for the MPI transport inside it)
    carrier = tp.carrier([(peer, s.nbytes), (peer, t.nbytes)])
    through = carrier.batch([carrier.recv_init(s, peer, 9), carrier.send_init(t, peer, 9)])

    def persistent_by_hand():
        MPI.Prequest.Startall(by_hand)
        for q in by_hand:
            while not q.Test():
                pass

    def transport_exchange():
        carrier.start(through)
        carrier.wait(through)

    def program_run():
        tp.begin(60.0)
        program.run([t])
        tp.end()

    def prepared_call():
        tp.begin(60.0)
        call.execute(*args)
        tp.end()

    peers = [("MPI's own Allreduce (mpi4py)", lambda: comm.Allreduce(MPI.IN_PLACE, t.numpy()))]
    if a.dispatch:
        null = dist.new_group(backend=register_null_backend())
        peers.append((DISPATCH, lambda: dist.all_reduce(t, group=null)))
    if a.deepspeed:
        from ringcomm.bench.columns import deepspeed_allreduce, release_deepspeed_segment

        ds, ds_t = deepspeed_allreduce(p), torch.ones(n)
        world.Barrier()  # every rank mapped every segment: none needs the names any more
        release_deepspeed_segment(rank)
        peers.append(("DeepSpeed's shared-memory allreduce (its op, no dispatch)",
                      lambda: ds(ds_t)))
    layers = [
        *peers,
        ("one exchange, persistent requests by hand (mpi4py)", persistent_by_hand),
        (f"one exchange through the transport ({type(carrier).__name__}: start, wait)",
         transport_exchange),
        (f"the program ({type(program).__name__}.run): messages + local work", program_run),
        ("the prepared call (execute)", prepared_call),
        ("the engine (inline run, deadline, completed Work)",
         lambda: engine.submit(call, args, async_op=False, timeout_s=60.0)),
        ("ProcessGroupRingcomm.allreduce (key, lookup)", lambda: pg.allreduce([t], opts)),
        ("dist.all_reduce", lambda: dist.all_reduce(t)),
    ]
    if a.flight:  # the last row runs with the group's flight recorder on (off by default)
        layers.append((f"dist.all_reduce, flight recorder on ({FLIGHT_ENTRIES} entries)",
                       lambda: dist.all_reduce(t)))
    recorder = (flight.Recorder(FLIGHT_ENTRIES), None)

    def recording(i: int, on: bool) -> None:
        if a.flight and i == len(layers) - 1:
            pg.flight = recorder[0] if on else recorder[1]

    for i, (_, fn) in enumerate(layers):
        recording(i, True)
        for _ in range(200):
            fn()
        recording(i, False)
    # rounds visit every layer in turn, so a slow spell of the machine touches them
    # all alike instead of the layers timed during it
    best = [float("inf")] * len(layers)
    gap = make_gap(a.gap)

    late = [float("inf")] * len(layers)

    def after_gaps(i: int, fn) -> float:
        """The median of ``a.calls`` calls, each after a barrier and the gap; and
        (into ``late[i]``) the median from the last rank's start of a call to this
        rank's end of it (the ranks share one clock on one host), which leaves out
        how far apart the gap left them."""
        t0s, t1s = [], []
        for _ in range(a.calls):
            world.Barrier()
            gap()
            t0s.append(time.perf_counter())
            fn()
            t1s.append(time.perf_counter())
        starts = np.max(world.allgather(np.array(t0s)), axis=0)
        late[i] = min(late[i], float(np.median(np.array(t1s) - starts)) * 1e6)
        return float(np.median(np.array(t1s) - np.array(t0s))) * 1e6

    for _ in range(a.rounds):
        for i, (_, fn) in enumerate(layers):
            world.Barrier()
            recording(i, True)
            best[i] = min(best[i], after_gaps(i, fn) if gap else
                          timeit.timeit(fn, number=a.calls) / a.calls * 1e6)
            recording(i, False)
    rows = [(name, max(world.allgather(us))) for (name, _), us in zip(layers, best)]
    lates = [max(world.allgather(us)) for us in late]
    if rank == 0:
        how = f", after {gap_text(a.gap)}" if a.gap else ""
        last = " from the last rank's start |" if a.gap else ""
        print(f"| {a.bytes} B allreduce, {a.algo}, 2 ranks{how} | time per call | added |{last}")
        print("|---|---:|---:|" + ("---:|" if a.gap else ""))
        prev = None
        for i, (name, us) in enumerate(rows):
            # the rows after the peers each add one layer to the row before
            added = f"{us - prev:+.1f} us" if prev is not None and i > len(peers) else ""
            after = ("" if not a.gap else " |" if name == DISPATCH else f" {lates[i]:.1f} us |")
            print(f"| {name} | {us:.1f} us | {added} |{after}")
            prev = us
        if a.flight:
            print(f"flight recorder: {rows[-1][1] / rows[-2][1] - 1:+.1%} of dist.all_reduce's "
                  "time")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"schema": "ringcomm.bench_layers/1",
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "bytes": a.bytes, "algorithm": a.algo, "world_size": p,
                           "gap": a.gap,
                           "peers": [name for name, _ in peers],
                           "rows": [{"layer": k, "time_us": v,
                                     **({"from_last_start_us": w}
                                        if a.gap and k != DISPATCH else {})}
                                    for (k, v), w in zip(rows, lates)]}, f, indent=1)
    for q in by_hand:
        q.Free()
    carrier.free(list(through.handles))
    comm.Free()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
