"""The short path's written-out copies, each timed against the other form, so
that a copy stays only where it saves time: interleaved, on 2 ranks.

* ``allreduce key`` (kept): ``reductions.allreduce_prepared`` writes the key of
  ``_allreduce_key`` out, against a call of ``_allreduce_key`` (the key built and
  looked up, 4 KiB);
* ``engine`` (merged): ``Engine.submit``'s idle branch calls ``_run_inline``,
  against its body written out there, as the code had it (a call that does
  nothing);
* ``program loop`` (merged): ``P2PProgram.run``'s one loop, which tests the trace
  once per step, against a second loop without trace hooks, as the code had it,
  for a schedule of one step (recursive doubling, 4 KiB) and of many (a
  pipelined tree, 64 KiB in 1 KiB segments).

Times are the maximum over ranks of the best of ``--rounds`` rounds of the mean over
``--calls`` calls; the two forms of a row alternate within each round, each
first in every other round.

    mpiexec -n 2 python scripts/bench_copies.py --json docs/data/hot_path_copies.json
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import timeit

import torch
import torch.distributed as dist

import ringcomm
from ringcomm import algorithms
from ringcomm.execution import executors
from ringcomm.front import reductions
from ringcomm.runtime.work import Done


def untraced_run(program, bufs) -> None:
    """``P2PProgram.run`` with a second loop of its own for when the trace is off
    (the form the code had)."""
    key = bufs[0].data_ptr() if len(bufs) == 1 else executors._key(bufs)
    bd = program._bindings.get(key)
    if bd is None:
        key, bd = program._binding(bufs)
    steps, _, tp = bd
    start, wait = tp.start, tp.wait
    try:
        for actions, work in steps:
            for is_wait, b in actions:
                if is_wait:
                    wait(b)
                else:
                    start(b)
            for fn, d, s in work:
                fn(d, s)
    except BaseException as e:
        raise program._failed(key, bd, bufs, e)


def inline_submit(engine, call, args, async_op: bool, timeout_s: float):
    """``Engine.submit`` up to its idle branch, with ``_run_inline``'s body written out
    there (the form the code had)."""
    thread = engine._thread
    if thread is not None and threading.current_thread() is thread:
        raise RuntimeError("bench_copies: not from a callback")
    if not async_op and not engine._queue and engine._own.acquire(False):
        try:
            if engine._error is None and not engine._stopped:
                tp = engine.tp
                tp.begin(timeout_s)
                try:
                    value = call.execute(*args)
                finally:
                    tp.end()
                work = engine._last = Done(call.name, value, None)
                return work
            return engine._run_inline(call, args, timeout_s)
        finally:
            engine._own.release()
    raise RuntimeError("bench_copies: the lane is not idle")


class _Nothing:
    name = "nothing"

    def execute(self) -> None:
        return None


def _program(pg, nbytes: int, algo: str):
    n = nbytes // 4
    t = torch.ones(n)
    pg.set_algorithm("allreduce", algo)
    opts = dist.AllreduceOptions()
    call, _ = reductions.allreduce(pg, [t], opts)
    return call.programs[0], t


def rows(pg, calls: int, rounds: int) -> list[tuple[str, object, object]]:
    """(what, the form in the code, the other form) for every copy measured."""
    t = torch.ones(1024)
    opts = dist.AllreduceOptions()
    dist.all_reduce(t)  # the call is prepared
    g = pg

    def key_written_out():
        return g.calls.get(("allreduce", t.dtype, t.numel(), t.device, t.is_contiguous(),
                            hash(opts.reduceOp), 0, g.planner.algos["allreduce"],
                            algorithms.generation))

    def key_by_function():
        return g.calls.get(reductions._allreduce_key(g, t, opts, t.is_contiguous()))

    out = [("allreduce key (4 KiB, built and looked up)", key_written_out, key_by_function)]
    engine, nothing = pg.lanes.cpu.engine, _Nothing()
    out.append(("engine: submit's idle branch (a call that does nothing)",
                lambda: engine.submit(nothing, (), False, 60.0),
                lambda: inline_submit(engine, nothing, (), False, 60.0)))
    small = dist.new_group(backend="ringcomm", pg_options=ringcomm.Options(segment_bytes=1024))
    for what, group, nbytes, algo in (("1 step: recursive doubling, 4 KiB", pg, 4096,
                                       "recursive_doubling"),
                                      ("many steps: tree, 64 KiB in 1 KiB segments",
                                       ringcomm.get_group(small), 65536, "tree")):
        program, buf = _program(group, nbytes, algo)
        tp = program.tp

        def as_written(program=program, buf=buf, tp=tp):
            tp.begin(60.0)
            program.run([buf])
            tp.end()

        def untraced(program=program, buf=buf, tp=tp):
            tp.begin(60.0)
            untraced_run(program, [buf])
            tp.end()

        out.append((f"program loop, {what} ({program.plan.nsteps} steps)", as_written,
                    untraced))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="write the results here (rank 0)")
    a = ap.parse_args(argv)
    dist.init_process_group("ringcomm")
    if dist.get_world_size() != 2:
        raise SystemExit("bench_copies: run it on exactly 2 ranks")
    world = ringcomm.launch.bootstrap.world_comm()
    measured = rows(ringcomm.get_group(), a.calls, a.rounds)
    for _, x, y in measured:
        for _ in range(200):
            x(), y()
    best = [[float("inf"), float("inf")] for _ in measured]
    for r in range(a.rounds):
        for i, (_, x, y) in enumerate(measured):
            # each form first in every other round: the one timed second runs warmer
            for j, fn in (((0, x), (1, y)) if r % 2 == 0 else ((1, y), (0, x))):
                world.Barrier()
                best[i][j] = min(best[i][j], timeit.timeit(fn, number=a.calls) / a.calls * 1e6)
    out = [{"copy": what, "in_code_us": max(world.allgather(b[0])),
            "other_us": max(world.allgather(b[1]))} for (what, _, _), b in zip(measured, best)]
    if dist.get_rank() == 0:
        print("| copy | in the code | the other form | difference |")
        print("|---|---:|---:|---:|")
        for r in out:
            print(f"| {r['copy']} | {r['in_code_us']:.2f} us | {r['other_us']:.2f} us | "
                  f"{r['other_us'] - r['in_code_us']:+.2f} us |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"schema": "ringcomm.bench_copies/1",
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "world_size": 2, "rows": out}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
