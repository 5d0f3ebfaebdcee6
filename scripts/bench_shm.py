"""One exchange between two ranks through each transport ringcomm has on one host:
the MPI transport (persistent requests) and the shared-memory transport (FIFOs of
slots), at sizes around where one overtakes the other. Rounds alternate the two,
each size's best round is kept; the JSON is what ``RINGCOMM_SHM_MIN_BYTES`` (the size
from which messages take shared memory) is read against.

    mpiexec -n 2 python scripts/bench_shm.py --json docs/data/shm_transport_2ranks.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import ringcomm  # noqa: F401  (starts MPI as the library does)
from ringcomm import settings
from ringcomm.transport import shm
from ringcomm.transport.mpi import MPITransport

SIZES = (4096, 16384, 65536, 131072, 262144, 1 << 20, 4 << 20)


def exchange_us(tp, comm, nbytes: int, calls: int, peer: int) -> float:
    """Microseconds of one exchange of ``nbytes`` each way, the best of 3 rounds."""
    a, b = torch.ones(max(nbytes // 4, 1)), torch.empty(max(nbytes // 4, 1))
    hs = [tp.recv_init(b, peer, 5), tp.send_init(a, peer, 5)]
    batch = tp.batch(hs)
    tp.begin(60.0)
    for _ in range(10):
        tp.start(batch)
        tp.wait(batch)
    best = float("inf")
    for _ in range(3):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            tp.start(batch)
            tp.wait(batch)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    tp.end()
    tp.free(hs)
    return max(comm.allgather(best))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds over both transports")
    ap.add_argument("--json", help="write the results here (rank 0)")
    a = ap.parse_args(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("bench_shm: run it on exactly 2 ranks under mpiexec")
    peer = 1 - comm.Get_rank()
    mpi_tp = MPITransport(comm.Dup())
    dup = comm.Dup()
    shm_tp = shm.connect(MPITransport(dup), dup, ())
    if not isinstance(shm_tp, shm.ShmTransport):
        raise SystemExit("bench_shm: shared memory could not be set up here")
    shm_tp.min_bytes = 0  # every size through shared memory
    best: dict = {}
    for _ in range(a.rounds):
        for name, tp in (("mpi", mpi_tp), ("shm", shm_tp)):
            for n in SIZES:
                calls = max(20, min(3000, (64 << 20) // n))
                us = exchange_us(tp, comm, n, calls, peer)
                best[name, n] = min(best.get((name, n), float("inf")), us)
    if comm.Get_rank() == 0:
        print("| bytes each way | MPI transport | shared memory | shared / MPI |")
        print("|---:|---:|---:|---:|")
        for n in SIZES:
            m, s = best["mpi", n], best["shm", n]
            print(f"| {n} | {m:.1f} us | {s:.1f} us | {s / m:.2f} |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"schema": "ringcomm.bench_shm/1",
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "slot_bytes": shm_tp.geometry.slot_bytes,
                           "slots": shm_tp.geometry.slots,
                           "min_bytes_setting": settings.get("RINGCOMM_SHM_MIN_BYTES"),
                           "rows": [{"bytes": n, "mpi_us": best["mpi", n],
                                     "shm_us": best["shm", n]} for n in SIZES]}, f, indent=1)
    shm_tp.close()
    mpi_tp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
