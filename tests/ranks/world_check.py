"""Per-rank program: a world that disagrees with the launcher, and a group this rank
is not in, end in clear errors or warnings, never a hang.

Modes (run under ``mpiexec -n 2``):
  env       WORLD_SIZE=3 in the environment: ringcomm replaces it with MPI's size (and
            says so), the job runs; a collective on a group without this rank
            returns at once with torch's warning, leaving the tensor alone.
  explicit  init_process_group(world_size=3) under two processes: every rank gets an
            error naming the disagreement (ringcomm's, or torch's rendezvous timeout)
            within the 5 s timeout.
  twin TAG  (under torchrun, two jobs at once on one host) the world formed holds this
            job's ranks only: their allreduce sums this job's values, and their
            allgather sees only this job's tag.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm  # noqa: F401
from _common import Checker


def main(mode: str) -> None:
    rank = int(os.environ["RANK"])
    c = Checker(rank)
    if mode == "env":
        dist.init_process_group("ringcomm", timeout=timedelta(seconds=30))
        c.check(dist.get_world_size() == 2, f"world size {dist.get_world_size()}, MPI has 2")
        t = torch.ones(2)
        dist.all_reduce(t)
        c.check(torch.equal(t, torch.full((2,), 2.0)), f"allreduce gave {t}")
        g = dist.new_group([0], backend="ringcomm")
        if rank == 1:
            t = torch.ones(2)
            t0 = time.monotonic()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                work = dist.all_reduce(t, group=g)
            took = time.monotonic() - t0
            c.case("a collective on a group this rank is not in",
                   "; ".join(str(w.message) for w in seen) or "no warning", took)
            c.check(work is None and torch.equal(t, torch.ones(2)) and took < 1.0,
                    f"not a member: returned {work}, tensor {t}, after {took:.2f}s")
            c.check(any("does not belong to the given group" in str(w.message)
                        for w in seen), f"no warning: {[str(w.message) for w in seen]}")
        dist.barrier()
        dist.destroy_process_group()
    elif mode == "twin":
        tag = float(sys.argv[2])
        dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
        p = dist.get_world_size()
        t = torch.full((100,), tag * 1000 + rank + 1)
        dist.all_reduce(t)
        want = p * tag * 1000 + p * (p + 1) / 2
        c.check(bool((t == want).all()), f"job {tag:g}: allreduce gave {t[0].item()}, want {want}")
        tags = [torch.zeros(1) for _ in range(p)]
        dist.all_gather(tags, torch.tensor([tag]))
        c.check([x.item() for x in tags] == [tag] * p, f"job {tag:g}: tags {tags}")
        dist.destroy_process_group()
    else:
        t0 = time.monotonic()
        try:
            dist.init_process_group("ringcomm", world_size=3, rank=rank,
                                    timeout=timedelta(seconds=5))
            c.check(False, "a world of 3 was set up with 2 processes")
        except Exception as e:  # noqa: BLE001 - ringcomm's RuntimeError or torch's store error
            took = time.monotonic() - t0
            c.case("init_process_group(world_size=3) with two processes", e, took)
            c.check("of 3" in str(e) or "2/3" in str(e), f"the error does not name it: {e}")
            c.check(took < 15, f"the error took {took:.1f}s")
    c.finish()


if __name__ == "__main__":
    main(sys.argv[1])
