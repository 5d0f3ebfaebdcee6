"""The backend creator torch calls for each ringcomm group: connects the group's
ranks (a fresh store namespace, then the CPU transport the options name: by
default MPI's network path, one MPI communicator per channel and shared memory on
each host) and makes the :class:`ProcessGroupRingcomm` over them.

CPU transports are made by the factories of :data:`TRANSPORTS`
(:func:`register_transport`); docs/architecture.md, "Writing a transport", says
what one must do."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import weakref
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ringcomm import mpi_serial
from ringcomm.algorithms import expand_choices
from ringcomm.front.contract import never_a_split_source, options_from_torch
from ringcomm.front import watch
from ringcomm.front.process_group import ProcessGroupRingcomm
from ringcomm.launch import bootstrap, group_store, hosts, network
from ringcomm.settings import Options

__all__ = ["create_group", "connect_group", "register", "register_transport", "GroupSetup",
           "TransportUnavailable", "TRANSPORTS", "GROUPS"]

log = logging.getLogger("ringcomm")

#: every ringcomm group alive in this process (their threads stop at exit)
GROUPS: "weakref.WeakSet[ProcessGroupRingcomm]" = weakref.WeakSet()


def create_group(dist_opts: Any, pg_options: Any) -> ProcessGroupRingcomm:
    """Backend creator torch calls (extended API) for each ringcomm group.

    Args:
        dist_opts: torch's ``_DistributedBackendOptions`` (store, group rank and size,
            timeout, group id, the members' global ranks; from torch 2.15 also the
            ``ProcessGroup`` torch made, whose ``bound_device_id`` is the
            ``device_id`` of ``init_process_group``/``new_group``).
        pg_options: :class:`ringcomm.Options`, None, or another backend's options
            (ignored with a warning).
    """
    options = _options(pg_options)  # checked before anything is read or connected
    pg = _connect(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                  dist_opts.timeout, options, str(dist_opts.group_id),
                  list(dist_opts.global_ranks_in_group), standalone=False)
    # torch >= 2.15 binds the device on the group it made before asking for ours
    bound = getattr(getattr(dist_opts, "process_group", None), "bound_device_id", None)
    if bound is not None:
        pg.eager_connect_single_device(bound)
    return pg


def connect_group(store: dist.Store, rank: int, size: int,
                  timeout: timedelta = timedelta(minutes=30), options: Any = None,
                  name: str | None = None) -> ProcessGroupRingcomm:
    """A ringcomm group of the ``size`` processes that call this with ``store``, each
    with its own ``rank``, outside torch's registry of groups (as torchft makes its
    replica groups, through :mod:`ringcomm.torchft`).

    The group is connected afresh every time: it neither uses nor becomes the world
    group, so a process may make any number of them, one after another or side by
    side, with other members each time, beside a ringcomm world group or without one.
    Release one with ``shutdown()`` or ``abort()``. It may be made on any thread while
    other groups' collectives run; every MPI step of its set-up after the members meet
    at ``store`` is bounded by ``RINGCOMM_CONNECT_TIMEOUT``. Its ranks' hosts are told
    apart by host name and boot id (``RINGCOMM_LOCAL_SIZE``, which numbers one
    launch's world ranks, does not apply).

    Args:
        store: a c10d store every member reaches (a ``PrefixStore`` of its own for
            each group: the members meet under ``ringcomm/`` in it).
        rank, size: this process's rank in the group, and the group's size.
        timeout: the limit of set-up and of every collective of the group.
        options: :class:`ringcomm.Options` or None.
        name: the group's name in errors and traces.
    Raises:
        ValueError: ``rank`` or ``size`` out of range, or ``timeout`` not positive.
        DistBackendError: members did not arrive within ``timeout``.
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"ringcomm.connect_group: size {size!r} must be a positive int")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"ringcomm.connect_group: rank {rank!r} must be an int in "
                         f"[0, {size})")
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"ringcomm.connect_group: timeout {timeout!r} must be a positive "
                         "timedelta")
    resolved = _options(options)
    global _standalone
    _standalone += 1
    return _connect(store, rank, size, timeout, resolved,
                    name or f"standalone-{_standalone}", [], standalone=True)


#: how many standalone groups this process made (their default names)
_standalone = 0


def _options(pg_options: Any) -> Options:
    """The group's options, resolved, their algorithm names checked."""
    options = (options_from_torch(pg_options) or Options()).resolve()
    options.algorithms = expand_choices(options.algorithms)
    return options


@dataclasses.dataclass(frozen=True)
class GroupSetup:
    """What a transport factory (:func:`register_transport`) gets to connect one
    group's ranks.

    Attributes:
        store: the group's own store (a fresh namespace: keys written here are seen by
            this group's current processes only).
        rank, size: this process's rank in the group, and the group's size.
        timeout: the group's timeout (set-up and every collective).
        limit_s: what one step of set-up may take (``RINGCOMM_CONNECT_TIMEOUT``,
            within ``timeout``): a step past it must fail, naming who did not come.
        options: the group's resolved :class:`ringcomm.Options` (``num_channels``:
            how many transports to make, ``local_size``, ``shared_memory``).
        members: the group ranks' world ranks (empty: the group is the world).
        standalone: a group of :func:`connect_group`, outside torch's registry.
    """

    store: Any
    rank: int
    size: int
    timeout: timedelta
    limit_s: float
    options: Options
    members: Sequence[int]
    standalone: bool

    @property
    def world_rank(self) -> int:
        return self.members[self.rank] if self.members else self.rank

    def hosts(self) -> tuple[int, ...]:
        """Every rank's host number (empty: one host), agreed through the store (each
        rank reads ``size`` keys): for a transport with no faster way."""
        return hosts.store_host_layout(
            self.store, self.rank, self.size, self.world_rank, self.options.local_size,
            self.standalone, timedelta(seconds=self.limit_s))


class TransportUnavailable(RuntimeError):
    """A transport factory's library is missing on this machine. A group whose CPU
    transport cannot be made still serves CUDA tensors where CUDA is there (NCCL);
    without CUDA the group is not made."""


#: ``connect(setup: GroupSetup) -> (transports, hosts)``: one
#: :class:`ringcomm.transport.Transport` per channel (``setup.options.num_channels``),
#: each owned by the group from then on, and every rank's host number (empty: one
#: host); by the name ``RINGCOMM_TRANSPORT`` / ``Options.transport`` gives
TRANSPORTS: dict[str, Callable[[GroupSetup], tuple[list, tuple]]] = {}


def register_transport(name: str, connect: Callable[[GroupSetup], tuple[list, tuple]], *,
                       replace: bool = False) -> None:
    """Make ``connect`` the factory of CPU transport ``name``, chosen with
    ``RINGCOMM_TRANSPORT=name`` or ``Options(transport=name)`` (on every rank of a
    group). ``connect(setup)`` runs on each rank when a group is made and returns one
    transport per channel and the ranks' host numbers (:meth:`GroupSetup.hosts` finds
    them through the store). Each step of it that waits for other ranks must end
    within ``setup.limit_s``, naming who did not come; on failure it releases what it
    made. It may raise :class:`TransportUnavailable` where its library is missing.

    Raises:
        ValueError: ``name`` is not a name, is taken (and ``replace`` is False), or
            ``connect`` is not callable.
    """
    from ringcomm.settings import _NAME

    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"ringcomm.register_transport: {name!r} is not a name")
    if name in TRANSPORTS and not replace:
        raise ValueError(f"ringcomm.register_transport: transport {name!r} exists; pass "
                         "replace=True to override it")
    if not callable(connect):
        raise ValueError(f"ringcomm.register_transport: {connect!r} is not callable")
    TRANSPORTS[name] = connect


def _connect(store: Any, rank: int, size: int, timeout: timedelta, options: Options,
             group_id: str, members: list[int], standalone: bool) -> ProcessGroupRingcomm:
    """Connect a group's ranks (a fresh store namespace, then the CPU transport of
    ``options``) and make its group."""
    transports, cpu_error, hosts = None, None, ()
    torch_store, store = store, group_store.fresh_store(store, rank, size, timeout)
    setup = GroupSetup(store, rank, size, timeout, bootstrap.setup_limit(timeout), options,
                       members, standalone)
    connect = _factory(setup)
    try:
        transports, hosts = connect(setup)
    except TransportUnavailable as e:
        # A GPU-only machine may lack the MPI library: CUDA tensors still run over
        # NCCL, CPU tensors get this reason.
        if not torch.cuda.is_available():
            raise (e.__cause__ or e) from None
        cpu_error = str(e)
        log.warning("ringcomm: the %s transport is not available (%s); only CUDA tensors "
                    "can be used", options.transport, cpu_error)
    pg = ProcessGroupRingcomm(rank, size, transports, timeout, options, group_id,
                              store=store, cpu_error=cpu_error, hosts=hosts,
                              torch_store=torch_store, global_ranks=members)
    GROUPS.add(pg)
    if size > 1:
        watch.watch(pg)
    return pg


def _factory(setup: GroupSetup) -> Callable:
    """The factory of the transport the group's options name. Rank 0 says its choice
    in the store first, known or not, and every other rank compares: a rank that
    named another transport would wait in another set-up."""
    name = setup.options.transport
    if setup.size > 1:
        if setup.rank == 0:
            setup.store.set("transport", name)
        else:
            try:
                first = group_store.store_wait(setup.store, "transport",
                                               timedelta(seconds=setup.limit_s)).decode()
            except (RuntimeError, dist.DistStoreError) as e:
                raise dist.DistBackendError(
                    f"ringcomm: rank 0 did not say which transport it uses within "
                    f"{setup.limit_s:g} s ({e})") from None
            if first != name:
                raise ValueError(f"ringcomm: rank {setup.rank} names transport {name!r} "
                                 f"where rank 0 names {first!r}: every rank of a group "
                                 "names the same (RINGCOMM_TRANSPORT, Options.transport)")
    connect = TRANSPORTS.get(name)
    if connect is None:
        raise ValueError(f"ringcomm: no transport {name!r} (RINGCOMM_TRANSPORT or "
                         f"Options.transport); known: {sorted(TRANSPORTS)}. A transport of "
                         "your own is known once the module that calls "
                         "ringcomm.register_transport for it is imported.")
    return connect


def _mpi_transports(setup: GroupSetup) -> tuple[list, tuple]:
    """The ``"mpi"`` transport: MPI's network path and world (before MPI starts:
    importing the MPI transport starts it), one MPI communicator per channel, each
    wrapped in shared memory to the ranks on its host."""
    store, rank, size, timeout = setup.store, setup.rank, setup.size, setup.timeout
    bootstrap.prepare_network(store, rank, size, timeout, setup.standalone)
    bootstrap.start_world(store, rank, size, timeout, setup.members, setup.standalone)
    try:
        from ringcomm.transport.mpi import MPITransport
    except (ImportError, RuntimeError, OSError) as e:
        raise TransportUnavailable(f"{type(e).__name__}: {e}") from e
    return _transports(setup, MPITransport)


def _transports(setup: GroupSetup, MPITransport: type) -> tuple[list, tuple]:
    """The group's MPI transports, one per channel, and its host layout. Each MPI step
    may take ``setup.limit_s``; on failure, what was made is released (a communicator
    still used by a blocked MPI call is left to it)."""
    from ringcomm.transport import shm

    limit, options = setup.limit_s, setup.options
    comm = bootstrap.group_comm(setup.store, setup.rank, setup.size, list(setup.members),
                                setup.timeout, setup.standalone)
    comms, transports = [comm], []
    try:
        layout = hosts.host_layout(comm, setup.world_rank, options.local_size,
                                   setup.standalone, limit)
        # one communicator per channel: messages of different channels never match
        for k in range(1, options.num_channels):
            comms.append(mpi_serial.dup(comm, f"channel {k}'s communicator", limit))
        # ranks sharing a host exchange a schedule's messages through shared memory
        for k, c in enumerate(comms):
            transports.append(MPITransport(c, limit))  # owns c from here
            transports[k] = shm.connect(transports[k], c, layout, k, options.shared_memory,
                                        limit)
        return transports, layout
    except BaseException:
        for tp in transports:
            tp.close()
        for c in comms[len(transports):]:
            mpi_serial.locked(c.Free)
        raise


TRANSPORTS["mpi"] = _mpi_transports


def _tcp_address(setup: GroupSetup) -> str:
    """The address a rank's tcp transport listens on: ``RINGCOMM_IFACE``'s; else,
    where the group spans hosts, the one toward the others (the ranks meet once in
    the store, :func:`ringcomm.launch.network.compare_hosts`, which also names it for
    the gloo and NCCL groups a job makes beside this one); else the one toward
    ``MASTER_ADDR``; else the host's advertised address."""
    forced = network.chosen_iface()
    if forced is not None:
        return network.interfaces()[forced]
    if setup.size > 1:
        path = network.compare_hosts(setup.store, setup.rank, setup.size,
                                     timedelta(seconds=setup.limit_s),
                                     set_netmod=not bootstrap.mpi_started())
        if path.spans_hosts and path.address:
            return path.address
    master = os.environ.get("MASTER_ADDR")
    return (network.source_address(master) if master else None) or network.advertised_address()


def _tcp_transports(setup: GroupSetup) -> tuple[list, tuple]:
    """The ``"tcp"`` transport (:mod:`ringcomm.transport.tcp`): sockets, no MPI. One
    listening socket per channel, published in the group's store with a random
    token; connections opened when first used."""
    from ringcomm.transport import tcp

    address, made = _tcp_address(setup), []
    limit = timedelta(seconds=setup.limit_s)
    tcp.make_room(setup.size, setup.options.num_channels)
    try:
        for k in range(setup.options.num_channels):
            sock, token = tcp.listener(address, setup.size), secrets.token_bytes(16)
            try:
                setup.store.set(f"tcp/{k}/{setup.rank}", json.dumps(
                    {"address": address, "port": sock.getsockname()[1], "token": token.hex()}))
            except BaseException:
                sock.close()
                raise

            def peers(peer: int, k: int = k) -> tuple[str, int, bytes]:
                try:
                    info = json.loads(group_store.store_wait(setup.store, f"tcp/{k}/{peer}",
                                                             limit))
                except (RuntimeError, dist.DistStoreError) as e:
                    raise RuntimeError(f"ringcomm tcp transport: rank {peer} did not say where "
                                       f"it listens within {setup.limit_s:g} s ({e})") from None
                return info["address"], info["port"], bytes.fromhex(info["token"])

            made.append(tcp.TcpTransport(setup.rank, setup.size, sock, token, peers,
                                         setup.limit_s))
        return made, setup.hosts()
    except BaseException:
        for tp in made:
            tp.close()
        raise


TRANSPORTS["tcp"] = _tcp_transports


def register() -> None:
    """Register the ``"ringcomm"`` backend with torch (again: nothing happens).

    torch >= 2.15 attaches its flight recorder to a new group unless the group's
    backend records itself; its hooks fire only for collectives torch dispatches in
    C++, which a Python group's are not, so ringcomm counts as recording itself (its
    own timeline: ``RINGCOMM_TRACE``). A bound ringcomm group is never offered as
    the split source of another backend's group
    (:func:`ringcomm.front.contract.never_a_split_source`).
    """
    never_a_split_source()
    if "RINGCOMM" not in dist.Backend._plugins:
        dist.Backend.register_backend("ringcomm", create_group, extended_api=True,
                                      devices=["cpu", "cuda"])
    self_recording = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if self_recording is not None:
        self_recording.add("ringcomm")
