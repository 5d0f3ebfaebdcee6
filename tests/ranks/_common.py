"""Shared by per-rank programs: collect failures, report them, exit non-zero."""
from __future__ import annotations

import json
import os
import re
import sys
import traceback


#: a check's words naming a collective and the algorithm it ran: ``allreduce[ring]``
_PAIR = re.compile(r"\b([a-z_]+\[[a-z_0-9]+\])")


class Checker:
    """Collects failed checks so one run reports all of them."""

    def __init__(self, rank: int):
        self.rank = rank
        self.failures: list[str] = []
        self.count = 0
        #: the ``collective[algorithm]`` pairs named by checks that passed, written to
        #: $CHECKS_COVERED_DIR/rank<r>.json where a test asks (it compares them with
        #: the registry: conftest.covered_pairs)
        self.covered: set[str] = set()

    def check(self, ok: bool, what: str) -> None:
        self.count += 1
        if not ok:
            self.failures.append(what)
        else:
            self.covered.update(_PAIR.findall(what))

    def case(self, what: str, outcome: BaseException | str, seconds: float | None = None) -> None:
        """Print what a failure or bad-input case produced, for docs/reliability.md
        (scripts/reliability_report.py collects these lines)."""
        if isinstance(outcome, BaseException):
            outcome = f"{type(outcome).__name__}: {outcome}"
        print("case: " + json.dumps({"case": what, "rank": self.rank, "outcome": str(outcome),
                                     "seconds": None if seconds is None else round(seconds, 2)}),
              flush=True)

    def run(self, what: str, fn, *args, **kwargs):
        """Run ``fn``; an exception counts as a failure named ``what``."""
        self.count += 1
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001
            self.failures.append(f"{what}: {traceback.format_exc(limit=4)}")
            return None

    def finish(self) -> None:
        if self.failures:
            print(f"rank {self.rank}: {len(self.failures)} of {self.count} checks failed:",
                  file=sys.stderr)
            for f in self.failures[:30]:
                print(f"  rank {self.rank}: FAIL {f}", file=sys.stderr)
            sys.stderr.flush()
            sys.exit(1)
        where = os.environ.get("CHECKS_COVERED_DIR")
        if where:  # a file, not stdout: the launcher interleaves the ranks' output
            with open(os.path.join(where, f"rank{self.rank}.json"), "w") as f:
                json.dump(sorted(self.covered), f)
        print(f"rank {self.rank}: {self.count} checks passed", flush=True)


def run_checks(checks, ctx) -> None:
    """Run a per-rank program's named checks in order, each given ``ctx`` (its shared
    state, with ``ctx.rank``). Every rank runs the same list, so the ranks issue the
    same collectives in the same order. A check that raises ends the run there, as one
    long ``main`` would (going on could leave the ranks at different collectives): the
    check is named on stderr and the exception propagates, so the exit is non-zero."""
    for check in checks:
        try:
            check(ctx)
        except BaseException:
            print(f"rank {ctx.rank}: check {check.__name__} raised", file=sys.stderr,
                  flush=True)
            raise


def init():
    """ringcomm as the default group plus a gloo group over the same ranks: rank,
    world size, the two groups by name, and a Checker."""
    import torch.distributed as dist

    import ringcomm  # noqa: F401  (registers the backend)

    dist.init_process_group("ringcomm")
    groups = {"ringcomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    rank = dist.get_rank()
    return rank, dist.get_world_size(), groups, Checker(rank)


def done(c: Checker) -> None:
    """End the run: every rank leaves the groups together (torch's threads are
    joined now, not in destructors racing interpreter exit), then the checks'
    verdict."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    c.finish()


def check_trained(c: Checker, what: str, ours: list, ref: list, gloo, rtol: float,
                  atol: float) -> None:
    """Parameters trained on ringcomm (``ours``) match those trained on gloo (``ref``),
    and are the same on every rank (compared over the ``gloo`` group)."""
    import torch
    import torch.distributed as dist

    for i, (a, b) in enumerate(zip(ours, ref)):
        c.check(torch.allclose(a, b, rtol=rtol, atol=atol),
                f"{what} parameter {i}: max diff {(a - b).abs().max().item()}")
    flat = torch.cat([q.flatten() for q in ours])
    first = flat.clone()
    dist.broadcast(first, src=0, group=gloo)
    c.check(torch.equal(flat, first), f"{what}: replicas diverged")
