"""Run collective algorithms on in-process ranks (threads), for algorithm development
and tests: no MPI, no launcher, any world size.

    from ringcomm.testing import run_ranks
    results = run_ranks(5, lambda tp: my_allreduce(tp, buf_for(tp.rank), ...))
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from .transport.base import Transport
from .transport.local import LocalFabric


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
