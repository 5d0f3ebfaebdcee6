"""Run algorithms on in-process ranks, for developing and testing them: no MPI, no
launcher, any world size.

* :func:`run_schedule` runs a schedule builder with either executor: the
  point-to-point one over threads (as on MPI) or the grouped one under the
  NCCL-rules simulator (as on NCCL)::

      from ringcomm.testing import run_schedule
      bufs = [[torch.arange(10.0)] for _ in range(4)]          # per rank, per buffer
      run_schedule(ring.allreduce, "allreduce", 4, (10,), bufs, executor="nccl-sim")

* :func:`run_ranks` calls any function with a point-to-point transport per rank.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from . import ops
from .checker import local_layout
from .executors import Plan, run_grouped, run_p2p
from .schedule import Context
from .simulator import SimFabric
from .transport.base import Transport
from .transport.local import LocalFabric

EXECUTORS = ("threads", "nccl-sim")


def run_ranks(size: int, fn: Callable[[Transport], Any], timeout_s: float = 30.0) -> list[Any]:
    """Call ``fn(transport)`` on ``size`` threads, one per rank; return their results
    in rank order.

    Raises:
        RuntimeError: some rank raised (the first error is chained) or did not finish
            within ``timeout_s``.
    """
    fabric = LocalFabric(size)
    results: list[Any] = [None] * size
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        tp = fabric.transport(rank)
        tp.begin("run_ranks", timeout_s)
        try:
            results[rank] = fn(tp)
        except BaseException as e:  # noqa: BLE001
            errors.append((rank, e))
        finally:
            tp.end()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"run_ranks: ranks still running after {timeout_s}s")
    if errors:
        rank, err = min(errors, key=lambda e: e[0])
        raise RuntimeError(f"run_ranks: rank {rank} failed: {type(err).__name__}: {err}") from err
    return results


def run_schedule(build: Callable, collective: str, size: int, layout: tuple,
                 bufs: Sequence[Sequence[torch.Tensor | None]], *, op=ops.SUM, root: int = 0,
                 seg: int = 1 << 30, executor: str = "threads",
                 timeout_s: float = 30.0) -> None:
    """Run schedule builder ``build`` for ``collective`` on ``size`` in-process ranks.

    Args:
        layout: the global layout (as :func:`ringcomm.checker.check` takes it).
        bufs: per rank, the caller's 1-D buffers in the collective's order
            (``ringcomm.schedule.BUFFERS``); results are written into them.
        op: the reduce op (a ``ReduceOp.RedOpType``) of reducing collectives.
        seg: elements per pipeline segment.
        executor: ``"threads"`` (point-to-point, as on MPI) or ``"nccl-sim"`` (one
            group per step under NCCL's rules, as on NCCL).
    Raises:
        RuntimeError: a rank failed or timed out (threads).
        ringcomm.simulator.SimulatorError: the schedule cannot complete under NCCL's rules.
    """
    plans = [Plan(build(Context(collective, size, r, local_layout(collective, layout, r, root),
                                root, seg))) for r in range(size)]

    def views(r: int) -> list:
        dtype = next((b.dtype for b in bufs[r] if b is not None), torch.uint8)
        return plans[r].bind(bufs[r], lambda i, n: torch.empty(n, dtype=dtype))

    if executor == "nccl-sim":
        fabric = SimFabric(size)
        for r in range(size):
            run_grouped(plans[r], fabric.comm(r), views(r), op)
        fabric.drain()
    elif executor == "threads":
        run_ranks(size, lambda tp: run_p2p(plans[tp.rank], tp, views(tp.rank), op), timeout_s)
    else:
        raise ValueError(f"run_schedule: executor must be one of {EXECUTORS}, got {executor!r}")
