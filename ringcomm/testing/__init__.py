"""Run algorithms on in-process ranks, for developing and testing them: no MPI, no
launcher, any world size.

* :func:`run_schedule` runs a schedule builder with any executor: the
  point-to-point one over threads (as on MPI), the grouped one under the
  NCCL-rules simulator (as on NCCL), or ``"events"``: every rank in this thread,
  in NCCL's rounds, to thousands of ranks (:func:`run_events`)::

      from ringcomm.testing import run_schedule
      bufs = [[torch.arange(10.0)] for _ in range(4)]          # per rank, per buffer
      run_schedule(ring.allreduce, "allreduce", 4, (10,), bufs, executor="nccl-sim")

* :func:`run_ranks` calls any function with a point-to-point transport per rank.
* :func:`nccl_groups` runs process groups whose CPU tensors take the NCCL path,
  over :class:`~ringcomm.testing.fake_nccl.FakeNccl` (also importable from here);
  :func:`nccl_world` makes such a group torch's default one on each thread, for
  code that calls ``torch.distributed`` itself (pipelining, DDP).
* :func:`check_collectives` checks every collective of a group against a
  single-process oracle.
"""
from __future__ import annotations

from ringcomm.testing.collectives import CHECK_OPS, check_collectives
from ringcomm.testing.fake_nccl import FakeNccl
from ringcomm.testing.in_process import (EXECUTORS, nccl_groups, nccl_world, run_events,
                                        run_ranks, run_schedule)

__all__ = ["CHECK_OPS", "EXECUTORS", "FakeNccl", "check_collectives", "nccl_groups",
           "nccl_world", "run_events", "run_ranks", "run_schedule"]
