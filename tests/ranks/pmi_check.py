"""Per-rank program: under torchrun, ringcomm starts MPI with the world whole
(launch/pmi.py: it answers MPI's process-manager requests from the c10d store).

Modes (under torchrun):
  world   MPI.COMM_WORLD is torch's world, ranked like torch, and is the world
          group's communicator; MPI sees which ranks share a host (its shared-memory
          split has LOCAL_WORLD_SIZE ranks); the PMI variables are gone once MPI has
          started, so nothing takes the process for one of mpiexec's; collectives
          agree with a sum computed here; a standalone group (connect_group: ports,
          accept and connect between MPI worlds) forms inside this world; and the
          script's own MPI.Finalize() ends MPI (its barrier served meanwhile), the
          job exiting 0.
  lost    rank 1 stalls before MPI starts (after meeting the others at the store):
          every other rank names it when MPI_Init's first barrier times out
          (RINGCOMM_CONNECT_TIMEOUT) and MPI ends the process; the test reads stderr.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from _common import Checker
from ringcomm.launch import bootstrap, launchers, pmi


def world(c: Checker, rank: int) -> None:
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    from mpi4py import MPI

    size = dist.get_world_size()
    w = MPI.COMM_WORLD
    c.check((w.Get_rank(), w.Get_size()) == (rank, size),
            f"MPI's world is rank {w.Get_rank()} of {w.Get_size()}, torch's {rank} of {size}")
    c.check(bootstrap.world_comm() is w, "the world group's communicator is not COMM_WORLD")
    c.check(pmi.serving(), "this process does not serve its MPI")
    left = [k for k in pmi.ENV if k in os.environ]
    c.check(not left, f"PMI variables left after MPI started: {left}")
    c.check(not launchers.launched_by_mpi(), "the process now reads as one of mpiexec's")
    node = w.Split_type(MPI.COMM_TYPE_SHARED)
    c.check(node.Get_size() == int(os.environ["LOCAL_WORLD_SIZE"]),
            f"MPI's host has {node.Get_size()} ranks, torchrun's {os.environ['LOCAL_WORLD_SIZE']}")
    node.Free()
    c.check(w.allreduce(rank + 1) == size * (size + 1) // 2, "MPI's own allreduce")
    for n in (7, 70_000):  # below and above shared memory's slot
        t = torch.arange(n, dtype=torch.float64) + rank
        dist.all_reduce(t)
        want = size * torch.arange(n, dtype=torch.float64) + size * (size - 1) / 2
        c.check(torch.equal(t, want), f"allreduce of {n}: {t[:4]}")
    store = dist.PrefixStore("standalone", dist.distributed_c10d._get_default_store())
    g = ringcomm.connect_group(store, rank, size, timedelta(seconds=30))
    t = torch.full((5,), float(rank))
    g.allreduce([t]).wait()
    c.check(bool((t == size * (size - 1) / 2).all()), f"the standalone group's allreduce: {t}")
    g.shutdown()
    dist.destroy_process_group()
    # mpi4py's own Finalize holds Python's lock through MPI's barrier, which this
    # process serves: ringcomm's stands in for it
    MPI.Finalize()
    c.check(MPI.Is_finalized() and not pmi.serving(), "the script's MPI.Finalize()")


def lost(c: Checker, rank: int) -> None:
    if rank == 1:
        pmi._Life._init = lambda self: time.sleep(60)
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    c.check(False, "a world formed without rank 1")


def main(mode: str) -> None:
    rank = int(os.environ["RANK"])
    c = Checker(rank)
    {"world": world, "lost": lost}[mode](c, rank)
    c.finish()


if __name__ == "__main__":
    main(sys.argv[1])
