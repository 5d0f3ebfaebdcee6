"""Per-rank program: failures end with a clear error on every rank, never a hang.

Modes:
  timeout   rank 0 never joins an allreduce; the others must get a DistBackendError
            naming the op and their rank within the group timeout — from the progress
            thread through Work.wait() and through the future — and later calls must
            fail fast.
  mismatch  ranks call allreduce with different sizes, then broadcast with different
            dtypes, under RINGCOMM_DEBUG=DETAIL; every rank must get an error naming
            the mismatch.
  tags      the same mismatches without debug mode: the calls' message tags differ,
            so a rank that waits names the mismatch within seconds, well before
            the group timeout (op, collective, dtype), and the ranks waiting on it
            learn of it from the store; a broadcast whose every rank is its root
            sends no message anyone receives and stays undetected (documented).
  late      the last rank calls an allreduce after the others timed out in it: its
            call fails at once too, naming their timeout.
  abort     rank 0 never joins an allreduce; rank 1 aborts its group, rank 2 shuts it
            down, half a second in: the running collective must end within a second
            (the group timeout is a minute), and later calls must fail at once.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from _common import Checker, run_checks


#: a mismatch found from message tags either names the peer's call or says how to
#: have it named
NAMED_OR_HOW = ("as far as its message tags tell", "RINGCOMM_DEBUG=DETAIL")


def expect_error(c: Checker, what: str, fn, *needles: str, exc=dist.DistBackendError,
                 either: tuple[str, ...] = ()) -> float:
    """Run ``fn``, which must raise ``exc`` whose message holds every one of
    ``needles`` and, if given, one of ``either``; the seconds it took."""
    t0 = time.monotonic()
    try:
        fn()
    except exc as e:
        msg = str(e)
        c.case(what, e, time.monotonic() - t0)
        for n in needles:
            c.check(n.lower() in msg.lower(), f"{what}: {n!r} not in message: {msg[:300]}")
        if either:
            c.check(any(n in msg for n in either), f"{what}: none of {either} in: {msg}")
    except Exception as e:  # noqa: BLE001
        c.check(False, f"{what}: expected DistBackendError, got {type(e).__name__}: {e}")
    else:
        c.check(False, f"{what}: no error raised")
    return time.monotonic() - t0


@dataclass
class Ctx:
    """What every check shares: this rank, the world size, the checker, and the group
    timeout in seconds."""
    rank: int
    p: int
    c: Checker
    timeout: float


def check_timeout(ctx: Ctx) -> None:
    """timeout: rank 0 never joins; the others' error comes through Work.wait() and
    the future, within the group timeout, and later calls fail fast."""
    c, rank, timeout = ctx.c, ctx.rank, ctx.timeout
    if rank == 0:
        time.sleep(timeout + 3)  # never calls the collective
        return
    t = torch.ones(100000)
    work = dist.all_reduce(t, async_op=True)  # runs on the progress thread
    took = expect_error(c, "async wait", work.wait, "allreduce", "timed out", f"rank {rank}")
    c.check(took < 10 * timeout, f"timeout took {took:.1f}s, limit {timeout}s")
    c.check(work.is_completed() and not work.is_success(), "work state after failure")
    # torch re-raises errors of then-callbacks as RuntimeError with the message kept
    expect_error(c, "future", lambda: work.get_future().wait(), "timed out",
                 exc=RuntimeError)
    took = expect_error(c, "later call", lambda: dist.all_reduce(torch.ones(3)), "unusable")
    c.check(took < 1.0, f"a call on a broken group took {took:.1f}s")


def check_late(ctx: Ctx) -> None:
    """late: the last rank calls the allreduce after the others timed out in it; its
    call fails too, at once, naming their timeout (as NCCL's abort fails a late
    rank), instead of completing with the messages they sent before: every rank
    agrees on the outcome."""
    c, rank, timeout = ctx.c, ctx.rank, ctx.timeout
    t = torch.ones(1024)
    if rank == ctx.p - 1:
        time.sleep(timeout + 1.8)  # the others' timeout and the watch's look (1 s) pass
        took = expect_error(c, "the late rank's call", lambda: dist.all_reduce(t),
                            "failure elsewhere in the group", "timed out")
        c.check(took < 1.0, f"the late rank's call failed after {took:.2f}s")
    else:
        expect_error(c, "timeout", lambda: dist.all_reduce(t), "timed out")
    dist.barrier(group=dist.new_group(backend="gloo"))  # every rank's outcome is in


def check_abort(ctx: Ctx) -> None:
    """abort: rank 0 never joins; rank 1 aborts, rank 2 shuts down half a second in:
    the running collective ends within a second, later calls fail at once."""
    c, rank = ctx.c, ctx.rank
    if rank == 0:
        time.sleep(3)  # never calls the collective
        c.check(True, "rank 0 stayed away")
        return
    pg = ringcomm.get_group()
    work = dist.all_reduce(torch.ones(100000), async_op=True)
    time.sleep(0.5)
    how = "aborted" if rank == 1 else "shut down"
    t0 = time.monotonic()
    pg.abort() if rank == 1 else pg.shutdown()
    took = expect_error(c, f"wait after {how}", work.wait, "allreduce", "interrupted",
                        how) + (time.monotonic() - t0)
    c.check(took < 1.5, f"the running collective ended {took:.2f}s after {how}")
    took = expect_error(c, "later call", lambda: dist.all_reduce(torch.ones(3)), "shut down")
    c.check(took < 0.5, f"a call after {how} took {took:.2f}s")


def check_mismatch(ctx: Ctx) -> None:
    """mismatch (debug mode): sizes, then dtypes, named on every rank."""
    c, rank = ctx.c, ctx.rank
    n = 10 if rank == 0 else 20
    expect_error(c, "size mismatch", lambda: dist.all_reduce(torch.ones(n)), "mismatch")
    # the same sizes in another dtype: every collective's fingerprint holds its dtype
    fresh = dist.new_group(backend="ringcomm")
    t = torch.ones(8, dtype=torch.float32 if rank == 0 else torch.int32)
    expect_error(c, "dtype mismatch", lambda: dist.broadcast(t, src=0, group=fresh),
                 "mismatch", "broadcast")


#: tags: the group timeout; every error must come before it
TAGS_LIMIT = 3.0


def check_tags_op(ctx: Ctx) -> None:
    """tags: ranks reduce with different ops; named well before the timeout."""
    op = dist.ReduceOp.SUM if ctx.rank == 0 else dist.ReduceOp.MAX
    took = expect_error(ctx.c, "op mismatch, no debug mode",
                        lambda: dist.all_reduce(torch.ones(1000), op=op), "mismatch",
                        either=NAMED_OR_HOW)
    ctx.c.check(took < TAGS_LIMIT - 0.5, f"op mismatch named after {took:.2f}s")


def check_tags_collective(ctx: Ctx) -> None:
    """tags: rank 0 allreduces while the others broadcast; rank 0 names it."""
    c, rank = ctx.c, ctx.rank
    other = dist.new_group(backend="ringcomm")
    call = (lambda: dist.all_reduce(torch.ones(8), group=other)) if rank == 0 else \
        (lambda: dist.broadcast(torch.ones(8), src=1, group=other))
    if rank == 0:
        took = expect_error(c, "allreduce against broadcast, no debug mode", call,
                            "mismatch", "allreduce")
        c.check(took < TAGS_LIMIT - 0.5, f"allreduce against broadcast named after {took:.2f}s")
    else:  # ranks 1.. form a broadcast of their own: theirs may complete
        try:
            call()
        except dist.DistBackendError as e:
            c.check("mismatch" in str(e), f"broadcast side: {e}")
        c.check(True, "broadcast side")


def check_tags_dtype(ctx: Ctx) -> None:
    """tags: a broadcast whose receivers expect another dtype; they name it."""
    c, rank = ctx.c, ctx.rank
    fresh = dist.new_group(backend="ringcomm")
    t = torch.ones(8, dtype=torch.float32 if rank == 0 else torch.int32)
    if rank == 0:  # the root only sends: it cannot see the receivers' dtype
        dist.broadcast(t, src=0, group=fresh)
        c.check(True, "root")
    else:
        took = expect_error(c, "dtype mismatch, no debug mode",
                            lambda: dist.broadcast(t, src=0, group=fresh), "mismatch",
                            "int32")
        c.check(took < TAGS_LIMIT - 0.5, f"dtype mismatch named after {took:.2f}s")


def check_tags_every_root(ctx: Ctx) -> None:
    """tags: every rank its own root: no rank receives, no message can tell."""
    alone = dist.new_group(backend="ringcomm")
    x = torch.full((4,), float(ctx.rank))
    dist.broadcast(x, src=ctx.rank, group=alone)
    ctx.c.check(torch.equal(x, torch.full((4,), float(ctx.rank))) and ctx.p > 1,
                "a broadcast from every rank returns each rank's own tensor")


def check_short(ctx: Ctx) -> None:
    """short: rank 1 sends fewer elements than the root expects: MPI itself would
    accept the short message and leave stale data; ringcomm must say so."""
    c, rank = ctx.c, ctx.rank
    mine = torch.full((3 if rank == 1 else 5,), float(rank))
    outs = [torch.zeros(5) for _ in range(ctx.p)] if rank == 0 else None
    if rank == 0:
        expect_error(c, "short message", lambda: dist.gather(mine, outs, dst=0),
                     "12 bytes from rank 1", "20 were expected")
    else:
        dist.gather(mine, None, dst=0)
        c.check(True, "sender")


def check_mismatch_op(ctx: Ctx) -> None:
    """mismatch_op (debug mode): an allreduce against a barrier, named on both sides."""
    if ctx.rank == 0:
        expect_error(ctx.c, "op mismatch", lambda: dist.all_reduce(torch.ones(4)), "barrier")
    else:
        expect_error(ctx.c, "op mismatch", dist.barrier, "allreduce")


def check_refused(ctx: Ctx) -> None:
    """refused: bad input on the root only: the root gets a ValueError at once; the
    others are already inside the scatter and learn of it from the tags of the root's
    next call, which carry its new epoch, so that call cannot pair with their scatter;
    every rank's error names the mismatch."""
    c, rank = ctx.c, ctx.rank
    if rank != 0:
        # the root's next call carries the new epoch's tags: named, not a timeout
        expect_error(c, "scatter without root", lambda: dist.scatter(torch.empty(4), src=0),
                     "scatter", "mismatch", "rank 0 runs a call of another epoch")
        return
    try:
        dist.scatter(torch.empty(4), [torch.ones(4)] * (ctx.p + 1), src=0)
        c.check(False, "scatter with a list too long: no error")
    except ValueError as e:
        c.case("scatter with a list too long, on the root only", e)
        c.check("expected one per rank" in str(e), f"message: {e}")
    expect_error(c, "root's next call", lambda: dist.all_reduce(torch.ones(4)),
                 "mismatch", "another epoch")


#: each mode's checks, run in this order on every rank
MODES = {
    "timeout": [check_timeout],
    "late": [check_late],
    "mismatch": [check_mismatch],
    "tags": [check_tags_op, check_tags_collective, check_tags_dtype, check_tags_every_root],
    "abort": [check_abort],
    "short": [check_short],
    "mismatch_op": [check_mismatch_op],
    "refused": [check_refused],
}


def main(mode: str) -> None:
    timeout = 60.0 if mode == "abort" else 3.0
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=timeout))
    rank = dist.get_rank()
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}")
    ctx = Ctx(rank, dist.get_world_size(), Checker(rank), timeout)
    run_checks(MODES[mode], ctx)
    ctx.c.finish()


if __name__ == "__main__":
    main(sys.argv[1])
