"""Measuring: the run over every (collective, dtype, op, size, column), how many
calls to time, batches of timed calls that visit the columns in turn, the
statistics of one row (:class:`Bench`), the floor column's arithmetic
(:func:`floor_point`), the local reduction cost for the model
(:meth:`Bench.gamma_for`) and the progress bar.

A column that fails is a result (``unsupported`` on first use, ``error`` after
having worked), never a crash, and every rank takes the same branch: errors are
exchanged before anyone acts on them.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

import ringcomm
from ringcomm import ops
from ringcomm.bench import cost_model
from ringcomm.bench.check import check
from ringcomm.bench.columns import (TORCH_PG_METHOD, Column, buffers, release_deepspeed_segment,
                                    static_unsupported, torch_dtype)
from ringcomm.bench.report import header_text, table_footer, table_heading, table_row
from ringcomm.bench.results import SCHEMA, Point
from ringcomm.bench.session import Session, loadavg
from ringcomm.bench.sizes import (BUSBW_FACTOR, ELEMENT_SIZE, REDUCING, Shape, auto_nbytes,
                                  format_size, message_sizes, shape_for)


def _noop() -> None:
    pass


class Bench:
    """Runs the comparison on this rank, over the columns of ``session``."""

    def __init__(self, session: Session):
        self.s, self.args = session, session.args
        self._unsupported: dict[tuple, str] = {}
        self._ran: set[tuple] = set()
        self.results: list[dict] = []
        self.gamma: dict[str, float] = {}
        self.load_end: list[float] | None = None
        #: --gap's pause before each timed call (None: none), made once for the run
        self.gap = make_gap(self.args.gap)

    # -- agreeing across ranks -------------------------------------------------
    def _agree(self, err: str | None) -> str | None:
        """The first error any rank saw (every rank gets the same answer)."""
        errs = [e for e in self.s.ctrl.allgather(err) if e]
        return errs[0] if errs else None

    def _everywhere(self, fn: Callable[[], Any]) -> tuple[Any, str | None]:
        """Run ``fn``; return its value and the first error any rank saw, so that every
        rank drops a failing column together."""
        value, err = None, None
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        return value, self._agree(err)

    @staticmethod
    def _select(col: Column, coll: str) -> None:
        # ringcomm's columns share one group: pick the column's algorithm before each batch.
        if col.kind in ("ringcomm", "ringcomm-cuda"):
            ringcomm.set_algorithm(coll, col.algo)

    # -- one column at one size ------------------------------------------------
    def prepare(self, col: Column, coll: str, shape: Shape, dtype_name: str, op: str,
                bufs: dict, more: list[dict] = ()
                ) -> "Point | tuple[Callable[[], None], Callable[[], None], int | None]":
        """Check that ``col`` runs this collective (and, with -c, runs it right: on
        ``bufs``; with ``--concurrent``, ``more`` holds the other collectives' buffers).

        Returns:
            A Point when the column does not run here (skipped, unsupported, error);
            else ``(call, sync, wrong elements on this rank or None)``.
        """
        key = (col.name, coll, dtype_name, op)
        if col.skipped:
            return Point(col.name, "skipped", reason=col.skipped)
        if key in self._unsupported:
            return Point(col.name, "unsupported", reason=self._unsupported[key])
        static = static_unsupported(col, coll, dtype_name, self.args.concurrent)
        if static:
            self._unsupported[key] = static
            return Point(col.name, "unsupported", reason=static)
        sync = torch.cuda.synchronize if col.device == "cuda" else _noop
        err: str | None = None
        wrong = None
        call = _noop
        first = key not in self._ran
        try:
            self._select(col, coll)
            call = self.s.calls.make_call(col, coll, bufs, op, more)
            if self.args.check and col.kind != "floor":  # the floor computes nothing
                wrong = check(col.device, coll, shape, dtype_name, op, bufs, call, sync,
                              rank=self.s.rank, p=self.s.p, root=self.args.root)
            else:
                call()
                sync()
        except Exception as e:  # noqa: BLE001 - a column's failure is a result, not a crash
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        err = self._agree(err)  # every rank takes the same branch from here on
        if err and "No backend type associated" in err and col.kind.startswith("ringcomm"):
            # torch's words when the Python process group lacks the method it calls
            method = TORCH_PG_METHOD.get(coll, coll)
            err = f"ringcomm's process group has no {method}() yet (torch: {err})"
        if err:
            # Failing on first use means "not there"; failing later is a real error.
            if first:
                self._unsupported[key] = err
                return Point(col.name, "unsupported", reason=err)
            return Point(col.name, "error", reason=err)
        if first and col.kind == "deepspeed":
            # every rank has made its segment and mapped its peers' (agreed above)
            release_deepspeed_segment(self.s.rank)
        self._ran.add(key)
        return call, sync, wrong

    def iterations(self, col: Column, coll: str, call: Callable[[], None],
                   sync: Callable[[], None]) -> int:
        """Warm up ``col``, then pick how many calls to time (the same on every rank)."""
        a = self.args
        self._select(col, coll)
        for _ in range(a.warmup):
            call()
        sync()
        iters = a.iters
        if a.min_time > 0:
            t0 = time.perf_counter()
            call()
            sync()
            one = max(time.perf_counter() - t0, 1e-7)
            iters = min(a.max_iters, max(a.iters, math.ceil(a.min_time / one)))
        return max(self.s.ctrl.allgather(iters))

    def batch(self, col: Column, coll: str, call: Callable[[], None],
              sync: Callable[[], None], n: int) -> np.ndarray:
        """Time ``n`` calls of ``col`` after one untimed call, all ranks starting together."""
        self._select(col, coll)
        call()  # the first call after another column's may pay for switching
        sync()
        times = np.empty(n)
        clock = time.perf_counter
        barrier = self.s.ctrl.barrier
        barrier()
        gap = self.gap
        each = self.args.barrier_each or gap is not None
        for k in range(n):
            if each:
                barrier()
            if gap is not None:
                gap()
            t0 = clock()
            call()
            sync()
            times[k] = clock() - t0
        return times

    # -- one row ---------------------------------------------------------------
    def measure_row(self, coll: str, shape: Shape, dtype_name: str, op: str,
                    progress: "Progress") -> dict[str, Point]:
        """Every column at one size. Timed calls run in ``--rounds`` rounds that visit
        the columns in turn (rotating the order), so load from other processes on
        the machine falls on every column alike and the ratios stay fair."""
        dtype = torch_dtype(dtype_name)
        row: dict[str, Point] = {}
        ready: dict[str, tuple] = {}
        bufs_by_dev: dict[str, dict] = {}
        more_by_dev: dict[str, list[dict]] = {}  # --concurrent: the other collectives' buffers
        for col in self.s.columns:
            progress.step(f"{coll} {dtype_name} {format_size(shape.size)} {col.name}")
            if col.device not in bufs_by_dev and not col.skipped:
                bufs_by_dev[col.device] = buffers(shape, dtype, col.device, self.s.p)
                more_by_dev[col.device] = [buffers(shape, dtype, col.device, self.s.p)
                                           for _ in range(self.args.concurrent - 1)]
            got = self.prepare(col, coll, shape, dtype_name, op, bufs_by_dev.get(col.device, {}),
                               more_by_dev.get(col.device, []))
            if isinstance(got, Point):
                row[col.name] = got
            else:
                ready[col.name] = (col, *got)
        for bufs in bufs_by_dev.values():
            for b in bufs.values():
                if hasattr(b, "zero_"):
                    b.zero_()  # neutral data while timing: no overflow, no denormals
        iters: dict[str, int] = {}
        for name, (col, call, sync, _) in list(ready.items()):
            n, err = self._everywhere(lambda: self.iterations(col, coll, call, sync))
            if err:
                row[name] = Point(name, "error", reason=err)
                del ready[name]
            else:
                iters[name] = n
        rounds = max(1, min(self.args.rounds, min(iters.values(), default=1)))
        times: dict[str, list] = {name: [] for name in ready}
        names = list(ready)
        gc.collect()
        gc.disable()  # a collection pause inside one rank stalls all of them
        try:
            for r in range(rounds):
                k = r % len(names) if names else 0
                for name in names[k:] + names[:k]:
                    if name not in ready:
                        continue
                    col, call, sync, _ = ready[name]
                    n = iters[name] // rounds + (1 if r < iters[name] % rounds else 0)
                    ts, err = self._everywhere(lambda: self.batch(col, coll, call, sync, n))
                    if err:
                        row[name] = Point(name, "error", reason=err)
                        del ready[name]
                    else:
                        times[name].append(ts)
        finally:
            gc.enable()
        for name, (col, _, _, wrong) in ready.items():
            row[name] = self._statistics(col, coll, shape, dtype_name, np.concatenate(times[name]),
                                         wrong)
        for col in self.s.columns:
            if col.kind == "floor" and row[col.name].status == "ok":
                row[col.name] = floor_point(row[col.name], row.get("mpi"), coll, shape.size,
                                            self.s.p)
        return {c.name: row[c.name] for c in self.s.columns}

    def _statistics(self, col: Column, coll: str, shape: Shape, dtype_name: str,
                    ts: np.ndarray, wrong: int | None) -> Point:
        """The point of one column from this rank's times ``ts`` and every other rank's."""
        q25, med, q75 = (float(x) * 1e6 for x in np.percentile(ts, [25, 50, 75]))
        everyone = self.s.ctrl.allgather((q25, med, q75, wrong))  # one exchange for all stats
        q25s, meds, q75s = ([e[i] for e in everyone] for i in range(3))
        if wrong is not None:
            wrong = sum(e[3] for e in everyone)
        t_us = max(meds)
        # --concurrent N: t_us is the time of N collectives; bandwidths are aggregate
        algbw = shape.size * self.args.concurrent / (t_us * 1e-6) / 1e9
        pt = Point(col.name, "ok", t_us, algbw, algbw * BUSBW_FACTOR[coll](self.s.p), wrong,
                   len(ts), meds, q25s, q75s)
        if col.algo == "auto":
            self._select(col, coll)  # algorithm_for answers for the current setting
            pt.auto_choice = self.s.pg.algorithm_for(
                coll, auto_nbytes(coll, shape, ELEMENT_SIZE[dtype_name]))
        return pt

    # -- the local reduction, for the cost model ------------------------------
    def gamma_for(self, dtype_name: str, op: str) -> float:
        """Seconds per byte of a local reduction (``dst op= src``), measured here: the
        one a CPU schedule's steps run (:func:`ringcomm.ops.serial_reducer`, on operands
        over the tensors' memory, as the point-to-point executor binds them)."""
        key = f"{dtype_name}/{op}"
        if key in self.gamma:
            return self.gamma[key]
        dtype = torch_dtype(dtype_name)
        esize = ELEMENT_SIZE[dtype_name]
        reduce_ = ops.serial_reducer({"sum": ops.SUM, "avg": ops.AVG, "prod": ops.PRODUCT,
                                      "min": ops.MIN, "max": ops.MAX}[op], dtype)
        samples = []
        top = max(64 << 10, min(self.args.maxbytes, 16 << 20))
        for nbytes in sorted({64 << 10, 1 << 20, top}):
            n = max(1, nbytes // esize)
            d, s = torch.ones(n, dtype=dtype), torch.ones(n, dtype=dtype)
            dv, sv = (ops.operand(ops.memory(t.data_ptr(), t.nbytes), dtype) for t in (d, s))
            reduce_(dv, sv)
            reps = max(3, min(200, (32 << 20) // nbytes))
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                reduce_(dv, sv)
                ts.append(time.perf_counter() - t0)
            samples.append((self.s.p, n * esize, float(np.median(ts))))
        g = cost_model.fit("local", None, samples, segment_bytes=1).beta
        g = max(self.s.ctrl.allgather(g))
        self.gamma[key] = g
        return g

    # -- the run ---------------------------------------------------------------
    def run(self) -> None:
        """Measure every (collective, dtype, op, size, column) and print the table."""
        a, s = self.args, self.s
        groups = []
        for coll in a.collectives:
            for dt in a.dtypes:
                for op in (a.ops if coll in REDUCING else ["none"]):
                    groups.append((coll, dt, op))
        sizes = message_sizes(a.minbytes, a.maxbytes, a.stepfactor, a.stepbytes)
        total = len(groups) * len(sizes) * len(s.columns)
        progress = Progress(total, s.rank == 0 and (
            a.progress == "on" or (a.progress == "auto" and sys.stderr.isatty())))
        if s.rank == 0:
            print(header_text(self.meta(), s.columns, a), flush=True)
        for coll, dt, op in groups:
            esize = ELEMENT_SIZE[dt]
            shapes, seen = [], set()
            for size in sizes:
                sh = shape_for(coll, size, esize, s.p)
                if sh.size not in seen:
                    seen.add(sh.size)
                    shapes.append(sh)
            if s.rank == 0:
                print(table_heading(s.columns, coll, dt, op, s.p, s.pick_width), flush=True)
            root = a.root if coll == "broadcast" else -1
            for sh in shapes:
                row = self.measure_row(coll, sh, dt, op, progress)
                for pt in row.values():
                    self.results.append({
                        "collective": coll, "size": sh.size, "count": sh.count, "dtype": dt,
                        "redop": op, "root": root, **dataclasses.asdict(pt)})
                if s.rank == 0:
                    progress.clear()
                    print(table_row(s.columns, sh, dt, op, root, row, s.pick_width), flush=True)
            if s.rank == 0:
                print(table_footer(s.columns, self.results, coll, dt, op), flush=True)
        progress.done()
        self.load_end = loadavg()
        if not a.no_model:
            for coll, dt, op in groups:
                if coll in REDUCING:
                    self.gamma_for(dt, op)

    def meta(self) -> dict:
        return self.s.meta(self.gamma, self.load_end)

    def document(self) -> dict:
        """Everything this run measured, in the JSON schema (``SCHEMA``)."""
        return {"schema": SCHEMA, "meta": self.meta(), "results": self.results}


def make_gap(spec: dict | None) -> Callable[[], None] | None:
    """The pause ``--gap`` puts before each timed call (None: none): a sleep, a busy
    wait, or a matmul on buffers made here (make it once, call it every time)."""
    if spec is None:
        return None
    if "matmul" in spec:
        n = spec["matmul"]
        a, b, out = torch.rand(n, n), torch.rand(n, n), torch.empty(n, n)
        return lambda: torch.mm(a, b, out=out)
    if "busy_us" in spec:
        seconds, clock = spec["busy_us"] * 1e-6, time.perf_counter

        def busy() -> None:
            end = clock() + seconds
            while clock() < end:
                pass
        return busy
    seconds = spec["sleep_us"] * 1e-6
    return lambda: time.sleep(seconds)


def floor_point(null: Point, mpi: Point | None, coll: str, size: int, p: int) -> Point:
    """The floor column's point: on each rank, its median time of ``dist.all_reduce``
    into the do-nothing group (``null``) plus its median of MPI's own collective
    (the ``mpi`` column); the time is the maximum over ranks, as for every column."""
    if mpi is None or mpi.status != "ok":
        why = mpi.reason if mpi is not None else "no mpi column"
        return Point(null.column, mpi.status if mpi is not None else "unsupported",
                     reason=f"no mpi time at this size ({why})")

    def add(a, b):
        return [x + y for x, y in zip(a, b)] if a and b else None

    meds = add(null.rank_median_us, mpi.rank_median_us)
    t_us = max(meds)
    algbw = size / (t_us * 1e-6) / 1e9
    return Point(null.column, "ok", t_us, algbw, algbw * BUSBW_FACTOR[coll](p), None,
                 null.iters, meds, add(null.rank_q25_us, mpi.rank_q25_us),
                 add(null.rank_q75_us, mpi.rank_q75_us), dispatch_us=null.time_us)


class Progress:
    """A one-line progress bar on stderr (rank 0, terminals only unless forced)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.n = max(1, total), enabled, 0
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()
        self.last = 0.0

    def step(self, what: str) -> None:
        self.n += 1
        if not self.enabled:
            return
        frac = (self.n - 1) / self.total
        now = time.monotonic()
        if self.tty:
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r[{bar:<30}] {self.n}/{self.total} {what[:50]:<50}")
            sys.stderr.flush()
        elif now - self.last > 10:
            self.last = now
            print(f"# progress {self.n}/{self.total} ({frac:.0%}, {now - self.started:.0f} s): "
                  f"{what}", file=sys.stderr, flush=True)

    def clear(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r" + " " * 96 + "\r")
            sys.stderr.flush()

    def done(self) -> None:
        self.clear()
