"""Per-rank program for a job Slurm started, checked against what the launch says:

* ``--launch slurm``: plain ``srun`` (no MPI plugin), every process an MPI
  singleton and only ``SLURM_*`` variables describing the job: ranks, sizes and
  the local rank are Slurm's, and the host layout follows ``SLURM_NODEID``;
* ``--launch slurm --pmix``: ``srun --mpi=pmix`` with an MPI library that cannot
  use PMIx (the ``mpich`` wheel): the ``PMIX_*`` variables hidden from MPI, then
  as plain ``srun``;
* ``--launch mpi``: ``srun --mpi=pmi2``: MPI's world is the job, ranked as Slurm
  ranks its tasks;
* ``--launch torchrun``: ``srun torchrun ...``: torchrun's variables win over
  Slurm's (each Slurm task is an agent with several workers).

Then ``init_process_group("ringcomm")`` with no arguments, collectives against
gloo over the same ranks, a subgroup, and the host layout (``TEST_SLURM_NODES``:
the node of each rank).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import ringcomm
from ringcomm.launch import bootstrap, slurm
from _common import Checker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launch", choices=("slurm", "mpi", "torchrun"), default="slurm")
    ap.add_argument("--pmix", action="store_true",
                    help="srun --mpi=pmix: the PMIx variables were hidden from MPI")
    a = ap.parse_args()
    dist.init_process_group("ringcomm")
    rank, p = dist.get_rank(), dist.get_world_size()
    c = Checker(rank)
    env = os.environ
    c.check(slurm.launched_by_slurm() == (a.launch == "slurm"), "read as a Slurm launch")
    c.check(bootstrap.launched_by_mpi() == (a.launch == "mpi"), "read as an MPI launch")
    if a.launch == "torchrun":
        c.check(rank == int(env["RANK"]) and p == int(env["WORLD_SIZE"]), "torchrun's ranks")
        c.check(p == int(env["SLURM_NTASKS"]) * int(env["LOCAL_WORLD_SIZE"]),
                "torchrun's world is agents x workers")
    else:
        c.check(rank == int(env["SLURM_PROCID"]), f"rank {rank} is not SLURM_PROCID")
        c.check(p == int(env["SLURM_NTASKS"]), f"world size {p} is not SLURM_NTASKS")
    if a.launch == "slurm":
        c.check(env["LOCAL_RANK"] == env["SLURM_LOCALID"], "LOCAL_RANK")
    c.check(("PMIX_RANK" in slurm.hidden_pmix) == a.pmix, f"PMIx hidden: {a.pmix}")
    c.check(not any(k.startswith("PMIX_") for k in env) or not a.pmix, "PMIX_* left for MPI")
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(rank)
    for n in (1000, 70000):
        t = torch.randint(-50, 50, (n,), generator=g).float()
        want = t.clone()
        dist.all_reduce(want, group=gloo)
        dist.all_reduce(t)
        c.check(torch.equal(t, want), f"allreduce n={n} against gloo")
    x = torch.randint(0, 99, (3,), generator=g).float()
    outs, want = [torch.empty(3) for _ in range(p)], [torch.empty(3) for _ in range(p)]
    dist.all_gather(outs, x)
    dist.all_gather(want, x, group=gloo)
    c.check(all(torch.equal(o, w) for o, w in zip(outs, want)), "all_gather against gloo")
    sub = dist.new_group([0, p - 1], backend="ringcomm")
    if rank in (0, p - 1):
        s = torch.ones(4)
        dist.all_reduce(s, group=sub)
        c.check(torch.equal(s, torch.full((4,), 2.0 if p > 1 else 1.0)), f"subgroup {s}")
    # hosts as Slurm numbers its nodes
    nodes = [int(x) for x in env["TEST_SLURM_NODES"].split(",")]
    c.check(len(nodes) == p, f"TEST_SLURM_NODES names {len(nodes)} ranks of {p}")
    hosts = ringcomm.get_group().planner.hosts
    first: dict[int, int] = {}
    expect = tuple(first.setdefault(n, len(first)) for n in nodes) if len(set(nodes)) > 1 else ()
    c.check(tuple(hosts) == expect, f"hosts {hosts}, Slurm nodes {nodes}")
    dist.barrier()
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
