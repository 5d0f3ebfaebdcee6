"""Per-rank program for a job that only SLURM_* variables describe (as plain
``srun`` starts it: every process an MPI singleton): ``init_process_group("ringcomm")``
with no arguments, ranks and sizes from Slurm, collectives against expected values,
a subgroup, and the host layout from ``SLURM_NODEID``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import ringcomm
from _common import Checker


def main() -> None:
    dist.init_process_group("ringcomm")
    rank, p = dist.get_rank(), dist.get_world_size()
    c = Checker(rank)
    c.check(rank == int(os.environ["SLURM_PROCID"]), f"rank {rank} is not SLURM_PROCID")
    c.check(p == int(os.environ["SLURM_NTASKS"]), f"world size {p} is not SLURM_NTASKS")
    c.check(os.environ["LOCAL_RANK"] == os.environ["SLURM_LOCALID"], "LOCAL_RANK")
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    c.check(torch.equal(t, torch.full((1000,), float(p * (p + 1) // 2))), f"allreduce {t[:3]}")
    outs = [torch.empty(3) for _ in range(p)]
    dist.all_gather(outs, torch.full((3,), float(rank)))
    c.check(all(torch.equal(o, torch.full((3,), float(r))) for r, o in enumerate(outs)),
            "all_gather")
    sub = dist.new_group([0, p - 1], backend="ringcomm")
    if rank in (0, p - 1):
        s = torch.ones(4)
        dist.all_reduce(s, group=sub)
        c.check(torch.equal(s, torch.full((4,), 2.0 if p > 1 else 1.0)), f"subgroup {s}")
    # hosts as Slurm numbers its nodes
    nodes = [int(x) for x in os.environ["TEST_SLURM_NODES"].split(",")]
    hosts = ringcomm.get_group().planner.hosts
    first: dict[int, int] = {}
    want = tuple(first.setdefault(n, len(first)) for n in nodes) if len(set(nodes)) > 1 else ()
    c.check(tuple(hosts) == want, f"hosts {hosts}, Slurm nodes {nodes}")
    dist.barrier()
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
