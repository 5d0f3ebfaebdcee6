"""In-process ranks: any world size on threads, no MPI, no launcher.
:func:`run_ranks` (a point-to-point transport per rank), :func:`run_schedule`
(a builder on either executor), :func:`nccl_groups` (process groups on the
NCCL path over FakeNccl) and :func:`nccl_world` (torch's default group, per thread,
on that path). :mod:`ringcomm.testing` hands these names on."""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Sequence

import torch

from ringcomm import ops
from ringcomm.execution.checker import local_layout
from ringcomm.execution.executors import GroupProgram, P2PProgram
from ringcomm.execution.plan import Plan
from ringcomm.execution.simulator import SimFabric
from ringcomm.schedule import Context, Schedule
from ringcomm.testing.fake_nccl import FakeNccl
from ringcomm.testing.local import LocalFabric
from ringcomm.transport.base import Transport


EXECUTORS = ("threads", "nccl-sim", "events")


def run_ranks(size: int, fn: Callable[[Transport], Any], timeout_s: float = 30.0,
              transports: Sequence[Transport] | None = None) -> list[Any]:
    """Call ``fn(transport)`` on ``size`` threads, one per rank; return their results
    in rank order. The transports are a new :class:`LocalFabric`'s, or ``transports``
    (one per rank, kept by the caller from run to run, as programs bound to them
    need).

    Raises:
        RuntimeError: some rank raised (the first error is chained) or did not finish
            within ``timeout_s``.
    """
    if transports is None:
        fabric = LocalFabric(size)
        transports = [fabric.transport(r) for r in range(size)]

    def body(rank: int) -> Any:
        tp = transports[rank]
        tp.begin(timeout_s)
        try:
            return fn(tp)
        finally:
            tp.end()

    return _on_threads("run_ranks", size, body, timeout_s)


def _on_threads(what: str, size: int, body: Callable[[int], Any], timeout_s: float) -> list:
    """``body(rank)`` on ``size`` threads; the results in rank order, or the lowest
    rank's error."""
    results: list[Any] = [None] * size
    errors: list[tuple[int, BaseException]] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as e:  # noqa: BLE001
            errors.append((rank, e))

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{what}: ranks still running after {timeout_s}s")
    if errors:
        rank, err = min(errors, key=lambda e: e[0])
        raise RuntimeError(f"{what}: rank {rank} failed: {type(err).__name__}: {err}") from err
    return results


def run_schedule(build: Callable, collective: str, size: int, layout: tuple,
                 bufs: Sequence[Sequence[torch.Tensor | None]], *, op=ops.SUM, root: int = 0,
                 seg: int = 1 << 30, executor: str = "threads",
                 timeout_s: float = 30.0, hosts: tuple = ()) -> None:
    """Run schedule builder ``build`` for ``collective`` on ``size`` in-process ranks.

    Args:
        layout: the global layout (as :func:`ringcomm.execution.checker.check` takes it).
        bufs: per rank, the caller's 1-D buffers in the collective's order
            (``ringcomm.schedule.BUFFERS``); results are written into them.
        op: the reduce op (a ``ReduceOp.RedOpType``) of reducing collectives.
        seg: elements per pipeline segment.
        executor: ``"threads"`` (point-to-point, as on MPI, a thread per rank),
            ``"nccl-sim"`` (one group per step under NCCL's rules, as on NCCL) or
            ``"events"`` (every rank in this thread, in NCCL's rounds:
            :func:`run_events`; the one that reaches thousands of ranks).
        hosts: the host of every rank (:class:`ringcomm.schedule.Context`); empty: one host.
    Raises:
        RuntimeError: a rank failed or timed out (threads).
        ringcomm.execution.simulator.SimulatorError: the schedule cannot complete under NCCL's rules.
    """
    def built(r: int):
        return build(Context(collective, size, r, local_layout(collective, layout, r, root),
                             root, seg, tuple(hosts)))

    if executor == "events":
        return run_events((built(r) for r in range(size)), size, bufs, op)
    plans = [Plan(built(r)) for r in range(size)]

    def scratch(r: int) -> list[torch.Tensor]:
        dtype = next((b.dtype for b in bufs[r] if b is not None), torch.uint8)
        return [torch.empty(n, dtype=dtype) for n in plans[r].scratch]

    if executor == "nccl-sim":
        fabric = SimFabric(size)
        for r in range(size):
            GroupProgram(plans[r], fabric.comm(r), scratch(r), op).run(bufs[r])
        fabric.drain()
    elif executor == "threads":
        run_ranks(size, lambda tp: P2PProgram(plans[tp.rank], tp, scratch(tp.rank), op).run(
            bufs[tp.rank]), timeout_s)
    else:
        raise ValueError(f"run_schedule: executor must be one of {EXECUTORS}, got {executor!r}")


def run_events(schedules: Iterable[Schedule], size: int,
               bufs: Sequence[Sequence[torch.Tensor | None]], op=ops.SUM) -> None:
    """Every rank's schedule run in this thread, round by round in the order of
    NCCL's rules (:class:`ringcomm.execution.world.World`), on one tensor holding
    every rank's buffers end to end. Each schedule is compiled as a plan compiles it
    (:func:`ringcomm.execution.plan.compile_steps`) and dropped, so memory holds
    arrays, not every rank's plan. A round's messages are one gather and one scatter,
    its local work one reduction per kind (:func:`ringcomm.ops.reducer`, the
    executors' operator) over every rank at once; the results are copied back into
    ``bufs``.

    Raises:
        ringcomm.schedule.ScheduleError: the schedules cannot complete under NCCL's
            rules (a deadlock, a message without a partner, a size mismatch).
    """
    from ringcomm.execution.plan import COPY, REDUCE_SRC_FIRST, compile_steps
    from ringcomm.execution.world import Memory, World

    lengths: list[list[int]] = []

    def compiled():
        for r, s in enumerate(schedules):
            lens = [0 if b is None else b.numel() for b in bufs[r]] + list(s.scratch)
            lengths.append(lens)
            yield compile_steps(s, lens)

    world = World(compiled(), size)
    memory = Memory(world, lengths)
    dtype = next((b.dtype for row in bufs for b in row if b is not None), torch.float32)
    flat = torch.zeros(memory.total, dtype=dtype)
    for r, row in enumerate(bufs):
        for b, t in enumerate(row):
            if t is not None and t.numel():
                flat[memory.base[r][b]:memory.base[r][b] + t.numel()] = t.reshape(-1)
    reducers = {kind: ops.reducer(op, src_first=kind == REDUCE_SRC_FIRST) for kind in (1, 2)}

    def at(regions) -> torch.Tensor:
        return torch.from_numpy(memory.elements(regions))

    def messages(batch) -> None:
        flat[at(batch.dst)] = flat[at(batch.src)]

    def local(batch) -> None:
        for kind in set(batch.kind.tolist()):
            mine = batch.kind == kind
            dst, src = at(batch.dst[mine]), at(batch.src[mine])
            if kind == COPY:
                flat[dst] = flat[src]
            else:
                acc = flat[dst]
                reducers[kind](acc, flat[src])
                flat[dst] = acc

    world.run(local, messages)
    for r, row in enumerate(bufs):
        for b, t in enumerate(row):
            if t is not None and t.numel():
                t.view(-1).copy_(flat[memory.base[r][b]:memory.base[r][b] + t.numel()])


def nccl_groups(size: int, fn: Callable[[Any], Any], *, lib: FakeNccl | None = None,
                timeout_s: float = 30.0, options: Any = None) -> list[Any]:
    """Call ``fn(pg)`` on ``size`` threads, each with a ringcomm process group whose
    CPU tensors run over the NCCL path with :class:`FakeNccl` (communicators set up
    through a shared in-process store); return the results in rank order.

    Raises:
        RuntimeError: some rank raised (the first error is chained) or did not finish.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from ringcomm.front.process_group import ProcessGroupRingcomm

    lib = lib or FakeNccl()
    store = dist.HashStore()

    def body(rank: int) -> Any:
        pg = ProcessGroupRingcomm(rank, size, None, timedelta(seconds=timeout_s), options,
                                  "fake-nccl", store=store, cpu_error="not used",
                                  nccl=lib, nccl_device_type="cpu")
        try:
            return fn(pg)
        finally:
            pg.shutdown()

    return _on_threads("nccl_groups", size, body, timeout_s)


#: the torch backend name of :func:`nccl_world`'s groups, registered on first use
FAKE_NCCL_BACKEND = "ringcomm_fake_nccl"
_world_lib: list = [None]  # the FakeNccl of the nccl_world running now
_world_lock = threading.Lock()


def _fake_nccl_group(dist_opts: Any, pg_options: Any) -> Any:
    """torch's creator for :data:`FAKE_NCCL_BACKEND`: a ringcomm group whose CPU
    tensors take the NCCL path over the running :func:`nccl_world`'s FakeNccl."""
    from ringcomm.front.contract import options_from_torch
    from ringcomm.front.process_group import ProcessGroupRingcomm

    return ProcessGroupRingcomm(dist_opts.group_rank, dist_opts.group_size, None,
                                dist_opts.timeout, options_from_torch(pg_options),
                                str(dist_opts.group_id), store=dist_opts.store,
                                cpu_error="not used: CPU tensors take the NCCL path here",
                                nccl=_world_lib[0], nccl_device_type="cpu",
                                global_ranks=list(dist_opts.global_ranks_in_group))


def nccl_world(size: int, fn: Callable[[int], Any], *, lib: FakeNccl | None = None,
               timeout_s: float = 60.0) -> list[Any]:
    """Call ``fn(rank)`` on ``size`` threads, each with torch's default process group
    initialised (``dist.init_process_group``) to a ringcomm group whose CPU tensors
    take the NCCL path over :class:`FakeNccl`, as CUDA tensors would on a GPU: code
    that calls ``torch.distributed``'s functions itself (``torch.distributed.pipelining``,
    DDP) runs on it unchanged. ``dist.new_group`` makes more such groups. Each thread
    has a world of its own (torch's thread-local world for threaded tests), for the
    duration of the call; one such world runs at a time.

    Raises:
        RuntimeError: some rank raised (the first error is chained) or did not finish.
    """
    from datetime import timedelta

    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg

    with _world_lock:
        if FAKE_NCCL_BACKEND.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(FAKE_NCCL_BACKEND, _fake_nccl_group,
                                          extended_api=True, devices=["cpu"])
        _world_lib[0] = lib or FakeNccl()
        store = dist.HashStore()
        # torch's registry of group names per thread too (every thread's world names
        # its default group alike), as torch's own threaded tests set it
        isolate = torch._C._distributed_c10d._set_thread_isolation_mode
        multi_threaded_pg._install_threaded_pg()
        isolate(True)
        try:
            def body(rank: int) -> Any:
                dist.init_process_group(FAKE_NCCL_BACKEND, store=store, rank=rank,
                                        world_size=size, timeout=timedelta(seconds=timeout_s))
                try:
                    return fn(rank)
                finally:
                    dist.destroy_process_group()

            return _on_threads("nccl_world", size, body, timeout_s)
        finally:
            isolate(False)
            multi_threaded_pg._uninstall_threaded_pg()
            _world_lib[0] = None


# -- every collective against a single-process oracle ---------------------------------

#: reduce ops checked by default, by name
