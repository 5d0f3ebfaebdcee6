"""Round-robin process groups: the DDP paper's section 4.2.2 mechanism, as the peer
of ringcomm's channels (``ringcomm.Options(num_channels=K)``).

The paper wrapped K gloo (or NCCL) process groups in
``torch.distributed._round_robin_process_groups([pg1, ..., pgK])``, a
``ProcessGroupRoundRobin`` that sends each successive collective to the next group,
so that several of DDP's bucket allreduces progress at once. torch has since
removed both (torch 2.13 has neither), so this module rebuilds it: a Python
``dist.ProcessGroup`` that forwards every collective to one of K gloo backends in
turn and returns that backend's own ``Work``. It is registered as the backend
``"gloo-rr"``, so ``dist.new_group(backend="gloo-rr", pg_options=RoundRobinOptions(3))``
makes one that ``dist.all_reduce(group=...)``, ``dist.get_rank(group)`` and both
DDPs accept; each of its K gloo backends sits on its own prefix of the new
group's store. Like torch's, it refuses point-to-point messages (which would
need the same group on both sides) and runs barrier on every backend in turn.
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Callable

import torch.distributed as dist

#: the backend name under which :func:`register` puts the round-robin group
BACKEND = "gloo-rr"
#: what the section's JSON and doc say about the mechanism
MECHANISM = ("K gloo process groups used in turn by successive collectives (call number "
             "mod K), as torch's removed _round_robin_process_groups / "
             "ProcessGroupRoundRobin did; rebuilt in ddp.bench.roundrobin as a Python "
             "ProcessGroup over K ProcessGroupGloo backends")


@dataclasses.dataclass(frozen=True)
class RoundRobinOptions:
    """``pg_options`` of a ``gloo-rr`` group: how many gloo backends it rotates over."""

    groups: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.groups, int) and self.groups >= 1):
            raise ValueError(f"RoundRobinOptions.groups must be a positive int, got "
                             f"{self.groups!r}")


class RoundRobinGroup(dist.ProcessGroup):
    """A process group whose successive collectives run on ``backends[n % K]``.

    Args:
        rank, size: this process's rank in the group and the group size.
        backends: K torch backends (or process groups) of the same ranks.
    """

    def __init__(self, rank: int, size: int, backends: list[Any]):
        super().__init__(rank, size)
        if not backends:
            raise ValueError("RoundRobinGroup needs at least one backend")
        self.backends = list(backends)
        self._calls = 0
        self._name = ""
        self._desc = ""

    @property
    def num_groups(self) -> int:
        return len(self.backends)

    def _next(self) -> Any:
        b = self.backends[self._calls % len(self.backends)]
        self._calls += 1
        return b

    def getBackendName(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def barrier(self, opts: Any = None) -> dist.Work:
        # every backend's earlier work, then the last barrier's Work for the caller
        works = [b.barrier(opts) if opts is not None else b.barrier() for b in self.backends]
        for w in works[:-1]:
            w.wait()
        return works[-1]

    def _refuse(self, *args: Any, **kwargs: Any) -> dist.Work:
        raise RuntimeError("RoundRobinGroup does not support point-to-point messages "
                           "(as torch's ProcessGroupRoundRobin did not)")

    send = recv = recv_anysource = _refuse


def _forward(name: str) -> Callable[..., dist.Work]:
    def method(self: RoundRobinGroup, *args: Any, **kwargs: Any) -> dist.Work:
        return getattr(self._next(), name)(*args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"RoundRobinGroup.{name}"
    return method


#: the collectives forwarded to the next backend (torch's ProcessGroup method names)
FORWARDED = ("allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather",
             "_allgather_base", "allgather_coalesced", "gather", "scatter", "reduce_scatter",
             "_reduce_scatter_base", "alltoall", "alltoall_base")
for _name in FORWARDED:
    setattr(RoundRobinGroup, _name, _forward(_name))


def _create(dist_opts: Any, pg_options: Any) -> RoundRobinGroup:
    """Backend creator torch calls (extended API) for each ``gloo-rr`` group."""
    opts = pg_options if isinstance(pg_options, RoundRobinOptions) else RoundRobinOptions()
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout if isinstance(dist_opts.timeout, datetime.timedelta) else \
        datetime.timedelta(seconds=300)
    backends = []
    for k in range(opts.groups):
        store = dist.PrefixStore(f"rr{k}/", dist_opts.store)
        backends.append(dist.ProcessGroupGloo(store, rank, size, timeout))
    return RoundRobinGroup(rank, size, backends)


def register() -> None:
    """Register the ``gloo-rr`` backend with torch (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def new_group(groups: int, timeout: datetime.timedelta) -> RoundRobinGroup:
    """A ``gloo-rr`` group of every rank over ``groups`` gloo backends (collective:
    every rank calls it, in the same order as its other ``new_group`` calls)."""
    register()
    return dist.new_group(backend=BACKEND, pg_options=RoundRobinOptions(groups),
                          timeout=timeout)
