"""What is timed: configurations (DDP implementation x backend), the replicas that
train them on this rank, and the world of process groups they train over."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ringcomm
from ringcomm.bench import links

import ddp
from ddp.bench import roundrobin
from ddp.bench.constants import BACKEND_OPTIONS, DATA_POOL, LR, MOMENTUM, SCALING_WORLDS
from ddp.bench.models import ModelSpec

@dataclasses.dataclass(frozen=True)
class Config:
    """A DDP implementation on a backend; impl ``off`` is overlap off (see OVERLAP_OFF)."""

    impl: str
    backend: str

    @property
    def name(self) -> str:
        return f"{self.impl}/{self.backend}"


def wrap(config: Config, module: nn.Module, group: dist.ProcessGroup,
         cap_mb: float | None, **options: Any) -> nn.Module:
    """``module`` in ``config``'s DDP on ``group``; ``cap_mb`` None: the implementation's
    default (25 MiB, first bucket 1 MiB, for both); ``options``: more DDP arguments."""
    if config.impl == "torch":
        return nn.parallel.DistributedDataParallel(module, process_group=group,
                                                   bucket_cap_mb=cap_mb, **options)
    # ours, and overlap off (ours under no_sync, reduced by hand)
    return ddp.DistributedDataParallel(module, process_group=group,
                                       bucket_cap_mb=25 if cap_mb is None else cap_mb,
                                       **options)


class Replica:
    """One configuration's model, optimizer and data on this rank, ready to time.

    Args:
        spec: the model.
        config: implementation and backend.
        group: the process group to train over.
        cap_mb: bucket cap (None: default; "all": one bucket for everything).
        every: synchronize every ``every``-th iteration (no_sync the others); 0: never
            (backward alone, for the exposed-communication difference).
        traced: timed with a ringcomm.trace recording on (the trace overhead).
        options: more arguments of the DDP (``static_graph``, ``find_unused_parameters``).
        hook: ``(hook, state factory)`` to register, the factory taking ``group``.
    """

    def __init__(self, spec: ModelSpec, config: Config, group: dist.ProcessGroup,
                 cap_mb: float | str | None = None, every: int = 1, traced: bool = False,
                 options: dict | None = None, hook: tuple | None = None):
        self.spec, self.config, self.group, self.every = spec, config, group, every
        self.traced = traced
        self.world = dist.get_world_size(group)
        module = spec.build()
        if cap_mb == "all":
            grad_mib = spec.describe(module)["gradient_bytes"] / 2**20
            cap_mb = math.ceil(grad_mib) + 1
        self.cap_mb = cap_mb
        self.net = wrap(config, module, group, cap_mb, **(options or {}))
        if hook is not None:
            fn, make_state = hook
            self.net.register_comm_hook(make_state(group), fn)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(self.net.parameters(), lr=LR, momentum=MOMENTUM)
        me = dist.get_rank(group)
        self.batches = [spec.batch(me, s) for s in range(DATA_POOL)]

    def synced(self, i: int) -> bool:
        """Whether iteration ``i`` runs DDP's synchronization (the last of each cycle)."""
        return self.config.impl != "off" and self.every > 0 and i % self.every == self.every - 1

    def iteration(self, i: int) -> tuple[float, ...]:
        """One training step on batch ``i``; returns the spans (seconds, in SPANS order)."""
        x, y = self.batches[i % len(self.batches)]
        ctx = contextlib.nullcontext() if self.synced(i) else self.net.no_sync()
        clock = time.perf_counter
        t0 = clock()
        with ctx:
            loss = self.spec.loss(self.net(x), y)
            t1 = clock()
            loss.backward()
        t2 = clock()
        if self.config.impl == "off":
            self._allreduce_flat()
        t3 = clock()
        self.opt.step()
        self.opt.zero_grad()
        t4 = clock()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0

    def _allreduce_flat(self) -> None:
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def num_buckets(self) -> int | None:
        """Buckets in use (after the rebuild), where the implementation says."""
        if isinstance(self.net, ddp.DistributedDataParallel):
            return len(self.net.reducer.buckets)
        try:
            sizes = self.net._get_ddp_logging_data().get("rebuilt_bucket_sizes")
            return len(str(sizes).split(",")) if sizes else None
        except Exception:  # noqa: BLE001 - a private torch API; the count is only informative
            return None

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])


def auto_threads(ranks: int) -> int:
    """torch threads per rank for ``--threads auto``: ``$OMP_NUM_THREADS`` when set (a
    launcher or the user chose), else the cores shared out among the ranks. More
    threads than cores per rank starve the backends' communication threads."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) // ranks)


def new_group(backend: str, timeout: datetime.timedelta, ranks=None) -> dist.ProcessGroup:
    """``dist.new_group`` for one of the benchmark's backends (``ringcomm-mpi``:
    ringcomm with the options of ``constants.BACKEND_OPTIONS``)."""
    real, opts = BACKEND_OPTIONS.get(backend, (backend, None))
    return dist.new_group(ranks, backend=real, timeout=timeout,
                          pg_options=ringcomm.Options(**opts) if opts else None)


def rr_group(backend: str, k: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A group of every rank with ``k`` communicators used in turn: ringcomm with
    ``Options(num_channels=k)``, gloo as ``k`` gloo groups in round robin
    (:mod:`ddp.bench.roundrobin`). Collective: every rank calls it in the same order."""
    real, opts = BACKEND_OPTIONS.get(backend, (backend, {}))
    if real == "ringcomm":  # the description names its progress threads in traces
        return dist.new_group(backend="ringcomm", timeout=timeout, group_desc=f"K={k}",
                              pg_options=ringcomm.Options(num_channels=k, **opts))
    if backend == "gloo":
        return roundrobin.new_group(k, timeout)
    raise ValueError(f"bench_ddp: no round-robin group for backend {backend!r}")


class World:
    """This rank, the process group of each backend (the default group's backend
    first, the others from ``dist.new_group``), subgroups of the first k ranks for
    scaling, and a gloo group for the untimed exchanges (a waiting gloo rank sleeps)."""

    def __init__(self, args: argparse.Namespace):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        timeout = datetime.timedelta(seconds=args.timeout)
        self.groups = {args.backend_list[0]: dist.group.WORLD}
        for b in args.backend_list[1:]:
            self.groups[b] = new_group(b, timeout)
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout)
        #: host name of each rank, and the links between them when there are several
        self.hosts = self.gather(socket.gethostname())
        self.links = (links.measure(self.hosts, self.rank, group=self.groups["ringcomm"])
                      if len(set(self.hosts)) > 1 and "ringcomm" in self.groups else None)
        self.cores = os.cpu_count() or 1
        self.threads = int(args.threads) if args.threads != "auto" else auto_threads(self.size)
        torch.set_num_threads(self.threads)
        self.scaling_worlds = sorted({k for k in SCALING_WORLDS if k <= self.size} | {self.size})
        # per k: (backend -> group, control group); None on ranks outside the first k
        self.sub: dict[int, tuple[dict, Any] | None] = {}
        if "scaling" in args.section_list:
            for k in self.scaling_worlds:
                if k == self.size:
                    self.sub[k] = (self.groups, self.ctrl)
                    continue
                ranks = list(range(k))
                gs = {b: new_group(b, timeout, ranks) for b in args.backend_list}
                ctrl = dist.new_group(ranks, backend="gloo", timeout=timeout)
                self.sub[k] = (gs, ctrl) if self.rank < k else None
        #: (backend, K) -> a group of every rank with K communicators used in turn
        self.rr: dict[tuple[str, int], Any] = {}
        if "roundrobin" in args.section_list:
            for b in args.backend_list:
                for k in args.channel_list:
                    self.rr[(b, k)] = rr_group(b, k, timeout)

    def rr_communicators(self) -> dict[str, dict[int, int]]:
        """backend -> K -> the communicators its round-robin group really has (asked
        of the group: ringcomm's num_channels, the gloo-rr group's backends)."""
        out: dict[str, dict[int, int]] = {}
        for (b, k), g in self.rr.items():
            out.setdefault(b, {})[k] = (ringcomm.get_group(g).num_channels
                                        if b.startswith("ringcomm")
                                        else g.num_groups)
        return out

    def oversubscribed(self, k: int | None = None) -> bool:
        return (k or self.size) > self.cores

    def gather(self, obj: Any) -> list:
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def agree(self, err: str | None) -> str | None:
        """The first error any rank saw, on every rank."""
        errs = [e for e in self.gather(err) if e]
        return errs[0] if errs else None
