"""Per-rank program: torch's backend contract on ringcomm, against gloo on the same
torch (what gloo does is the oracle; where this torch's gloo lacks a feature,
ringcomm's answer is checked against one process's computation).

Cases: ``_get_backend`` and its flags, ``batch_isend_irecv`` rings, ``split_group``,
``new_group`` from a bound device (a ringcomm group and torch's NCCL, a stand-in on
CPU), ``set_timeout`` (and a collective that then
times out at the new limit), ``get_error``, another backend's ``pg_options``, and
``init_process_group(device_id=...)`` where this torch allows it on CPU.

Prints one ``feature: {...}`` line per feature with its outcome, which
``scripts/torch_compat.py`` collects into the version table.

Usage: mpiexec -n N python contract_check.py [device_id]
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm
from _common import Checker, run_checks

VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def feature(name: str, outcome: str) -> None:
    print("feature: " + json.dumps({"feature": name, "torch": torch.__version__,
                                    "outcome": outcome}), flush=True)


def ring(group, rank: int, p: int, n: int) -> torch.Tensor:
    """batch_isend_irecv: every rank sends to the next and receives from the last."""
    out = torch.zeros(n)
    ops = [dist.P2POp(dist.isend, torch.full((n,), float(rank)), (rank + 1) % p, group),
           dist.P2POp(dist.irecv, out, (rank - 1) % p, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out


@dataclass
class Ctx:
    """What every check shares: this rank, the world size, the checker, the default
    group, a gloo group over the same ranks, and whether the group is bound to cpu:0."""
    rank: int
    p: int
    c: Checker
    world: object
    gloo: object
    bind: bool


def init(bind: bool) -> bool:
    """The default ringcomm group, bound to cpu:0 if ``bind`` and this torch allows it;
    whether it is bound."""
    try:
        dist.init_process_group("ringcomm", timeout=timedelta(seconds=60),
                                **({"device_id": torch.device("cpu", 0)} if bind else {}))
    except ValueError as e:
        # before 2.15 torch itself refuses a CPU device_id, before any backend is made
        if not (bind and "accelerator" in str(e)):
            raise
        feature("init_process_group(device_id=cpu:0)", "torch refuses a CPU device_id "
                "(for every backend); CUDA: scripts/gpu_check.sh")
        bind = False
        dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    return bind


def check_bound_device(ctx: Ctx) -> None:
    """init_process_group(device_id=cpu:0): the device is kept, collectives work."""
    if not ctx.bind:
        return
    c, p = ctx.c, ctx.p
    c.check(ctx.world.bound_device_id == torch.device("cpu", 0),
            f"bound_device_id is {ctx.world.bound_device_id}")
    x = torch.full((5,), float(ctx.rank + 1))
    dist.all_reduce(x)
    c.check(torch.equal(x, torch.full((5,), p * (p + 1) / 2)), f"all_reduce gave {x}")
    dist.barrier()  # torch passes the bound device to the barrier
    feature("init_process_group(device_id=cpu:0)", "works, bound_device_id kept")


def check_get_backend(ctx: Ctx) -> None:
    """_get_backend and its flags, as gloo answers them."""
    c, world, gloo = ctx.c, ctx.world, ctx.gloo
    ours, ref = world._get_backend(torch.device("cpu")), gloo._get_backend(torch.device("cpu"))
    c.check(ours.supports_coalescing == ref.supports_coalescing,
            f"supports_coalescing: ringcomm {ours.supports_coalescing}, gloo {ref.supports_coalescing}")
    c.check(ours.supports_splitting is True, "supports_splitting")  # check_split_group
    c.check(ours.name() == "ringcomm", f"name() is {ours.name()!r}")
    c.check(ours.supports_tensor_alloc(torch.device("cpu")) is False, "supports_tensor_alloc")
    c.check({d.type for d in world._device_types} == {d.type for d in gloo._device_types},
            f"_device_types: {world._device_types} vs gloo {gloo._device_types}")
    for group in (world, gloo):
        try:
            group._get_backend(torch.device("xpu"))
            c.check(False, f"{group}: _get_backend(xpu) returned")
        except RuntimeError:
            pass
    c.check(str(ours.get_error()).endswith("SUCCESS"), f"get_error() is {ours.get_error()}")
    feature("_get_backend(cpu/cuda)", "works, flags as gloo's")


def check_batch_isend_irecv(ctx: Ctx) -> None:
    """batch_isend_irecv rings, the same as gloo's."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    for n in (1, 1000, 100_000):
        got, want = c.run(f"batch_isend_irecv {n} (ringcomm)", ring, None, rank, p, n), \
            c.run(f"batch_isend_irecv {n} (gloo)", ring, ctx.gloo, rank, p, n)
        if got is not None and want is not None:
            c.check(torch.equal(got, want), f"batch_isend_irecv {n}: {got[:3]} vs {want[:3]}")
    feature("batch_isend_irecv", "works, same as gloo")


def check_pg_options(ctx: Ctx) -> None:
    """Another backend's pg_options: accepted with a warning; a dict is refused."""
    c = ctx.c
    gloo_opts = dist.ProcessGroupGloo._Options()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = dist.new_group(backend="ringcomm", pg_options=gloo_opts)
    c.check(any("ignores them" in str(w.message) for w in caught),
            f"no warning for gloo's options: {[str(w.message) for w in caught]}")
    y = torch.ones(3)
    dist.all_reduce(y, group=other)
    c.check(torch.equal(y, torch.full((3,), float(ctx.p))), f"group with gloo options: {y}")
    try:
        dist.new_group(backend="ringcomm", pg_options={"num_channels": 2})
        c.check(False, "a dict as pg_options was accepted")
    except TypeError as e:
        c.check("pg_options" in str(e), f"dict pg_options: {e}")
    feature("pg_options of another backend", "accepted with a warning")


def check_split_group(ctx: Ctx) -> None:
    """split_group: where this torch's gloo splits on CPU, the same as gloo."""
    c, rank, p = ctx.c, ctx.rank, ctx.p
    halves = [list(range(0, p, 2)), list(range(1, p, 2))]
    mine = halves[rank % 2]
    outcomes = {}
    for name, parent in (("ringcomm", ctx.world), ("gloo", ctx.gloo)):
        try:
            sub = dist.split_group(parent, split_ranks=halves)
            z = torch.full((4,), float(rank))
            dist.all_reduce(z, group=sub)
            outcomes[name] = ("ok", z, dist.get_process_group_ranks(sub))
        except Exception as e:  # noqa: BLE001
            outcomes[name] = ("error", type(e).__name__, str(e)[:200])
    want = torch.full((4,), float(sum(mine)))
    if outcomes["ringcomm"][0] == "ok":
        c.check(torch.equal(outcomes["ringcomm"][1], want), f"split_group sum {outcomes}")
        c.check(outcomes["ringcomm"][2] == mine, f"split_group ranks {outcomes}")
    if outcomes["gloo"][0] == "ok":
        c.check(outcomes["ringcomm"][0] == "ok", f"gloo splits, ringcomm does not: {outcomes}")
    elif outcomes["ringcomm"][0] == "error":
        c.check(outcomes["ringcomm"][1] == outcomes["gloo"][1],
                f"split_group fails differently: {outcomes}")
    feature("split_group", "works, same as gloo" if outcomes["ringcomm"][0] == "ok" else
            f"torch refuses it here, as for gloo: {outcomes['ringcomm'][1]}")


def check_set_timeout(ctx: Ctx) -> None:
    """set_timeout, then a collective that times out at the new limit, and get_error;
    the ranks meet on gloo after it."""
    c = ctx.c
    for bad in (timedelta(0), timedelta(seconds=-1)):
        try:
            ctx.world.set_timeout(bad)
            c.check(False, f"set_timeout({bad}) was accepted")
        except ValueError:
            pass
    short = dist.new_group(backend="ringcomm")
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timedelta(seconds=2), group=short)
    else:
        ringcomm.set_timeout(timedelta(seconds=2), group=short)
    c.check(short.options._timeout == timedelta(seconds=2), f"options._timeout {short.options._timeout}")
    if ctx.rank == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=short)
            c.check(False, "a collective no peer joined returned")
        except dist.DistBackendError as e:
            took = time.monotonic() - t0
            c.check(1.5 < took < 10 and "timed out after 2s" in str(e),
                    f"timed out after {took:.1f}s: {e}")
        c.check(str(short.get_error()).endswith("TIMEOUT"), f"get_error() {short.get_error()}")
    feature("set_timeout", "works: the next collective times out at the new limit")
    feature("get_error", "works: SUCCESS, then TIMEOUT")
    dist.barrier(group=ctx.gloo)


def check_nccl_group_from_a_bound_default(ctx: Ctx) -> None:
    """With the default ringcomm group bound to a device, torch's new_group of another
    backend: torch's NCCL (a stand-in on CPU torch: ProcessGroupNCCL.Options.split_from
    takes only a ProcessGroupNCCL) is made on its own, not split from ringcomm's group;
    a rank outside a new group gets no NOCOLOR split on ringcomm's group."""
    from ringcomm.testing.torch_nccl import torch_nccl

    c, world, rank, p = ctx.c, ctx.world, ctx.rank, ctx.p
    # bound as init_process_group(device_id=...) binds it (cpu:0 on torch >= 2.15; by
    # hand elsewhere: torch's set-up reads only the attribute)
    by_hand = world.bound_device_id is None
    if by_hand:
        world.bound_device_id = torch.device("cuda", 0)
    try:
        c.check(dist.distributed_c10d._get_split_source(world, *(
            ("nccl",) if VERSION >= (2, 15) else ())) is None,
            "ringcomm's bound group was offered as a split source")
        with torch_nccl() as nccl_cls:
            before = len(nccl_cls.made)
            ref = c.run("new_group(backend='nccl') from a bound ringcomm group",
                        dist.new_group, backend="nccl")
            # rank 0 alone: rank 1 is outside it (torch's NOCOLOR split path)
            c.run("new_group([0], backend='nccl') from a bound ringcomm group",
                  dist.new_group, [0], backend="nccl")
        if ref is not None:
            offered = [o for made in nccl_cls.made[before:] for o in made.offered]
            c.check(offered == [], f"torch offered split sources {offered}")
    finally:
        if by_hand:
            world.bound_device_id = None
    if ref is not None:
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=ref)
        c.check(torch.equal(t, torch.full((3,), p * (p + 1) / 2)), f"nccl group's sum {t}")
    feature("new_group(backend='nccl') with ringcomm bound", "works: made on its own, "
            "not split from ringcomm")


#: run in this order on every rank (the ranks must issue the same collectives)
CHECKS = [check_bound_device, check_get_backend, check_batch_isend_irecv, check_pg_options,
          check_split_group, check_nccl_group_from_a_bound_default, check_set_timeout]


def main() -> None:
    bind = init(len(sys.argv) > 1 and sys.argv[1] == "device_id")
    rank = dist.get_rank()
    ctx = Ctx(rank, dist.get_world_size(), Checker(rank), dist.group.WORLD,
              dist.new_group(backend="gloo"), bind)
    run_checks(CHECKS, ctx)
    ctx.c.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
