"""Launcher detection and the MPI communicators behind each process group.

Three ways to start a job, one script:

* ``mpiexec -n N python script.py``: MPI already connects the processes. On
  ``import ringcomm`` we fill in RANK / WORLD_SIZE / LOCAL_RANK and a
  MASTER_ADDR / MASTER_PORT agreed over MPI, so ``init_process_group("ringcomm")``
  needs no arguments and torch ranks equal MPI ranks.
* ``torchrun`` (or any env:// launch without mpiexec): ringcomm answers MPI's
  process-manager requests from the c10d store (:mod:`ringcomm.launch.pmi`,
  :func:`start_world`), so one ``MPI_Init`` makes ``MPI.COMM_WORLD`` torch's world.
  Where it cannot (``RINGCOMM_PMI=0``, MPI started before ringcomm, a library that
  ignores ``PMI_FD``), each process is an MPI singleton, and they join in a binary
  tree of merges (:func:`merge_rounds`): in each round neighbouring blocks of ranks
  connect through an MPI port whose name the left block's first rank publishes in
  the c10d store, and each intercommunicator is merged left block first, so after
  ``ceil(log2 N)`` rounds one intracommunicator's ranks equal torch's.

* ``srun`` without an MPI plugin: the job's SLURM_* variables are read as
  torchrun's (:mod:`ringcomm.launch.slurm`), then as under torchrun.

Every group first agrees, through its store, on a namespace no earlier process
used (:func:`ringcomm.launch.group_store.fresh_store`): torchrun's agent keeps one store across restarts, so
keys of the processes it replaced are still there.

Subgroups are carved from the world communicator with ``Comm.Create_group``,
which only the group's members call (as torch only calls the backend creator
on members).

A *standalone* group (:func:`ringcomm.connect_group`: torchft's replica groups,
re-formed at every quorum change with other members) is connected afresh over its
own store every time, as the world is under torchrun: it neither reads nor keeps
the world communicator, so any number of them, with any members, can be made in
one process, beside a ringcomm world group or without one.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta

from ringcomm import mpi_serial, settings
from ringcomm.launch import hosts, network, pmi
from ringcomm.launch.group_store import store_wait
from ringcomm.launch.launchers import launched_by_mpi

log = logging.getLogger("ringcomm")

_lock = threading.Lock()
_world = None  # the world intracommunicator once known (MPI.Intracomm)


def mpi():
    """mpi4py's ``MPI`` module, MPI started (under ``srun --mpi=pmix`` ringcomm may
    have imported it unstarted: :func:`ringcomm.launch.slurm.leave_pmix_if_unusable`)."""
    from mpi4py import MPI

    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


def world_comm():
    """The MPI intracommunicator over torch's world ranks, ranked like torch
    (``MPI.COMM_WORLD`` under mpiexec, the joined singletons under torchrun); None
    until a ringcomm world group exists. For running MPI's own collectives beside
    ringcomm's; do not free it."""
    return _world


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def setup_env_from_mpi() -> None:
    """Under an MPI launcher, export the variables torch's env:// rendezvous reads.

    RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE come from MPI; MASTER_ADDR
    and MASTER_PORT are kept if the user set them, else rank 0 picks a free port
    and an address the other hosts reach (:func:`network.advertised_address`), and
    every rank learns them over MPI. ``RINGCOMM_IFACE`` is applied before MPI starts.
    """
    forced = network.chosen_iface()
    if forced is not None:  # before MPI starts, so that MPI uses it too
        network.apply(forced, spans_hosts=False, set_netmod=False)
    MPI = mpi()

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    # a host's name: the world rank of its first rank
    hosts.mpi_node = node.bcast(rank, root=0)
    node.Free()
    single_node = world.allreduce(1 if local_size == size else 0, op=MPI.MIN) == 1
    mine = None
    if rank == 0:
        mine = ("127.0.0.1" if single_node else network.advertised_address(), _free_port())
    addr0, port0 = world.bcast(mine, root=0)
    for key, value in (("RANK", rank), ("WORLD_SIZE", size)):
        old = os.environ.get(key)
        if old is not None and old != str(value):
            log.warning("ringcomm: replacing %s=%s with the MPI value %s", key, old, value)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_size))
    os.environ.setdefault("MASTER_ADDR", addr0)
    os.environ.setdefault("MASTER_PORT", str(port0))
    if not single_node:  # NCCL's interface: the one toward the store, as under torchrun
        iface = forced or network.interface_toward(os.environ["MASTER_ADDR"])[0]
        network.apply(iface, spans_hosts=True, set_netmod=False)


def mpi_started() -> bool:
    """True once this process has initialized MPI (through mpi4py)."""
    mod = sys.modules.get("mpi4py.MPI")
    return mod is not None and mod.Is_initialized()


def prepare_network(store, rank: int, size: int, timeout: timedelta,
                    standalone: bool = False) -> None:
    """Before a group's communicator is built from singletons (torchrun, or a
    standalone group): meet the group's ranks through ``store`` and choose the network
    path MPI will use (:mod:`ringcomm.launch.network`). Nothing to do for other groups
    under mpiexec or once the world communicator exists: MPI is wired up then."""
    if not standalone and (launched_by_mpi() or _world is not None):
        return
    path = network.compare_hosts(store, rank, size, timeout, set_netmod=not mpi_started())
    if path.spans_hosts and mpi_started() and not os.environ.get("MPIR_CVAR_CH4_NETMOD"):
        log.warning("ringcomm: this group spans hosts but MPI was started before ringcomm "
                    "could choose its network path; if bootstrap hangs, set "
                    "MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp before MPI starts")


def start_world(store, rank: int, size: int, timeout: timedelta, members: list[int],
                standalone: bool = False) -> None:
    """Start MPI with torch's world whole in ``MPI.COMM_WORLD`` (:mod:`ringcomm.launch.pmi`)
    when this group is the world under torchrun or plain srun and MPI has not started:
    one ``MPI_Init`` instead of the rounds of merges of :func:`_connect_world`. Called
    after :func:`prepare_network` (MPI's network path is chosen before it starts).
    Nothing to do for other groups, or with ``RINGCOMM_PMI=0``."""
    global _world
    if (standalone or members or size == 1 or launched_by_mpi() or _world is not None
            or mpi_started() or not settings.get("RINGCOMM_PMI")):
        return
    MPI = pmi.load_mpi()
    if MPI is None:  # started already, or no MPI library: joined otherwise, if at all
        return
    limit = setup_limit(timeout)
    try:
        whole = pmi.start_world(MPI, store, rank, size, timeout, limit)
    except pmi.InitTimeout:
        what = f"rank {rank}'s MPI_Init in the world of {size}"
        _stuck.append(what)  # no MPI_Finalize after a start that never ended
        raise _network_error(what, f"did not complete within {limit:g} s of its last "
                             "request to ringcomm's process manager", store,
                             0 if rank else size - 1) from _Stuck(what)
    if not whole:  # a library that does not read PMI_FD: a singleton, merged as before
        log.info("ringcomm: %s started as a singleton; forming the world in rounds of "
                 "merges", MPI.Get_library_version().splitlines()[0].strip())
        return
    _first_exchange(MPI.COMM_WORLD, store, rank, size, limit)
    with _lock:
        _world = MPI.COMM_WORLD


def setup_limit(timeout: timedelta) -> float:
    """How long each MPI step of a group's set-up may take once its ranks have met at
    the store: the smaller of the group's ``timeout`` and ``RINGCOMM_CONNECT_TIMEOUT``."""
    return min(timeout.total_seconds(), settings.get("RINGCOMM_CONNECT_TIMEOUT"))


#: the MPI calls of failed set-ups still blocking in their threads (see _bounded)
_stuck: list[str] = []


def stuck_calls() -> list[str]:
    """What MPI calls of failed set-ups still block in their threads: MPI cannot cancel
    them, so this process cannot finalize MPI (:mod:`ringcomm.front.departure` ends it
    without)."""
    return list(_stuck)


def _asks(give_up) -> bool:
    """``give_up()``, an error in it read as no."""
    try:
        return bool(give_up())
    except Exception:  # noqa: BLE001 - the wait goes on to its limit
        return False


class _Stuck(Exception):
    """Marks an error raised while an MPI call still blocks in its thread: what that
    call uses (a port, a communicator) must not be freed under it."""


def _bounded(call, what: str, timeout: timedelta, store=None, peer: int = -1,
             limit_s: float | None = None, give_up=None):
    """``call()``, which blocks in MPI with no timeout of its own, bounded by ``limit_s``
    (None: :func:`setup_limit`): past it, raise ``DistBackendError`` caused by
    :class:`_Stuck` (the call itself stays blocked in its thread: MPI cannot cancel it).
    With a ``store``, a connection to ``peer``: the error names the hosts, interfaces
    and variables to check. ``give_up()``, asked every :data:`LOOK_S`, may end the wait
    early (as if out of time). Runs outside :data:`ringcomm.mpi_serial.LOCK`, for the reason
    given there. A communicator the call returns after its caller gave up is freed."""
    limit = setup_limit(timeout) if limit_s is None else limit_s
    result: list = []
    guard = threading.Lock()
    late = []  # set once the caller gave up

    def run():
        try:
            outcome = (True, call())
        except BaseException as e:  # handed to the caller
            outcome = (False, e)
        with guard:
            if not late:
                result.append(outcome)
                return
            _stuck.remove(what)  # it ended after all
        if outcome[0] and hasattr(outcome[1], "Free"):
            mpi_serial.locked(outcome[1].Free)

    t = threading.Thread(target=run, name=f"ringcomm-bootstrap-{what}", daemon=True)
    t.start()
    began = time.monotonic()
    gave_up = False
    try:
        while t.is_alive() and (left := began + limit - time.monotonic()) > 0:
            t.join(min(LOOK_S, left) if give_up else left)
            if give_up and t.is_alive() and _asks(give_up):
                gave_up = True
                break
    finally:  # whatever ends the wait, a call still running is known to be stuck
        with guard:
            if not result:
                late.append(True)
                _stuck.append(what)
    if not result:
        import torch.distributed as dist

        within = (f"did not complete: the ranks it waited for reported failing after "
                  f"{time.monotonic() - began:.1f} s" if gave_up else
                  f"did not complete within {round(limit, 1):g} s")
        if store is None:
            raise dist.DistBackendError(
                f"ringcomm bootstrap: {what} {within}: a member of the group stopped, died, "
                "or is setting up another group first (raise RINGCOMM_CONNECT_TIMEOUT for "
                "slow starts)") from _Stuck(what)
        raise _network_error(what, within, store, peer) from _Stuck(what)
    ok, value = result[0]
    if not ok:
        raise value
    return value


def _network_error(what: str, within: str, store, peer: int) -> Exception:
    """The error of an MPI exchange with ``peer`` that did not complete: the hosts,
    interfaces and variables of the network path (:class:`ringcomm.launch.network.Path`)."""
    import torch.distributed as dist

    path = network.last or network.Path()
    path.hosts.setdefault(peer, network.host_of(store, peer))
    return dist.DistBackendError(
        f"ringcomm bootstrap: {what} {within}, so the MPI connection between the ranks' "
        f"hosts does not work (or a rank stopped). {path.describe()}")


def _first_exchange(world, store, rank: int, size: int, limit_s: float) -> None:
    """A barrier over a world MPI started whole, bounded by ``limit_s``: ``MPI_Init``
    exchanged addresses through the store only, so a network path MPI cannot use shows
    here first, named (as a failed merge of the tree names it)."""
    import torch.distributed as dist
    from mpi4py import MPI

    what = f"rank {rank}'s first MPI exchange with the world of {size}"
    peer = 0 if rank else size - 1
    try:
        mpi_serial.barrier(world, what, limit_s)
    except dist.DistBackendError:
        _stuck.append(what)  # the barrier cannot be cancelled: no MPI_Finalize after it
        raise _network_error(what, f"did not complete within {round(limit_s, 1):g} s",
                             store, peer) from None
    except MPI.Exception as e:
        raise _network_error(what, f"failed ({e.Get_error_string().strip()})", store,
                             peer) from None


def _joined(inter, high: bool, limit_s: float):
    """The intracommunicator of both sides of ``inter`` (freed): ``high`` puts this side
    last. Merge has no non-blocking form: it runs under the MPI lock once a bounded
    barrier has seen every rank of both sides arrive."""
    try:
        mpi_serial.barrier(inter, "the barrier before merging a newcomer", limit_s)
        with mpi_serial.LOCK:
            return inter.Merge(high=high)
    finally:
        mpi_serial.locked(inter.Free)


def merge_rounds(size: int) -> list[list[tuple[int, int, int]]]:
    """How :func:`_connect_world` joins ``size`` singletons: a binary tree, one list of
    merges per round. A merge ``(left, right, end)`` joins the block of ranks
    ``[left, right)`` (which accepts) and ``[right, end)`` (which connects) into
    ``[left, end)``, in that order, so the final communicator is ranked like torch
    with no renumbering. The merges of a round run at once: ``ceil(log2(size))``
    rounds, where admitting one rank at a time took ``size - 1``."""
    rounds, width = [], 1
    while width < size:
        rounds.append([(lo, lo + width, min(lo + 2 * width, size))
                       for lo in range(0, size, 2 * width) if lo + width < size])
        width *= 2
    return rounds


#: where a side of a merge that failed reports whom it waited for: one key a side of
#: a merge (``<prefix>/<round>/<left>/<side>``, side ``a`` accepting or ``c``
#: connecting), and a count of reports, the one key a waiting rank polls; nothing is
#: written while nothing fails
REPORTS = "ringcomm/absent"
#: how long a rank whose merge timed out waits for the other block's own reports: its
#: ranks that waited in an earlier round for a rank that never came time out first
REPORT_GRACE_S = 2.0
#: how often a rank waiting for a merge looks at the count of reports
LOOK_S = 1.0


class _Reports:
    """The failure reports of one rank's formation of a group (see :data:`REPORTS`).

    A block of ranks reports through its spine: every merge that formed a block
    ``[lo, hi)`` involved ``lo``'s side, so a failure anywhere inside it surfaces in a
    report of a merge ``(round, lo)``, by ``lo``'s side (naming the block it waited
    for) or by the other side (naming ``lo``'s). Reading one block's reports costs two
    keys a round. Every store access is best effort: a store that fails leaves a
    report unread or unwritten, never an error in place of the timeout's."""

    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank
        self.seen = 0  # the count of reports at the last look

    def _key(self, k: int, left: int, side: str) -> str:
        return f"{REPORTS}/{k}/{left}/{side}"

    def count(self) -> int:
        try:
            return int(self.store.add(f"{REPORTS}/n", 0))
        except Exception:  # noqa: BLE001 - best effort (see the class)
            return 0

    def about(self, k: int, lo: int, hi: int, own: tuple | None = None) -> list[dict]:
        """The reports that name ranks of ``[lo, hi)``, from the merges of rounds
        before ``k`` on ``lo``'s spine and from ``own`` (``(round, left, side)``: this
        rank's side of the current merge, where its first rank may have reported)."""
        keys = [self._key(j, lo, side) for j in range(k) for side in "ac"]
        if own is not None:
            keys.append(self._key(*own))
        out = []
        for key in keys:
            try:
                if self.store.check([key]):
                    r = json.loads(self.store.get(key))
                    r["missing"] = [q for q in r["missing"] if lo <= q < hi]
                    if r["missing"]:
                        out.append(r)
            except Exception:  # noqa: BLE001 - best effort (see the class)
                continue
        return out

    def changed(self, k: int, lo: int, hi: int, own: tuple | None = None) -> bool:
        """Whether reports name ranks of ``[lo, hi)`` (looked up only when the count of
        reports grew since the last look: one store operation a look)."""
        n = self.count()
        if n == self.seen:
            return False
        self.seen = n
        return bool(self.about(k, lo, hi, own))

    def absent(self, k: int, left: int, side: str, lo: int, hi: int,
               grace_s: float) -> tuple[list, str]:
        """This rank's side of merge ``(k, left)`` timed out waiting for ``[lo, hi)``:
        the ranks that never came, and who missed them first, as the block's own
        reports name them within ``grace_s`` (a block of one cannot report on itself:
        no wait), else the whole block. This side's report is written."""
        deadline = time.monotonic() + (grace_s if hi - lo > 1 else 0.0)
        while True:
            theirs = self.about(k, lo, hi, (k, left, side))
            if theirs or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if theirs:
            missing = sorted({q for r in theirs for q in r["missing"]})
            seen = min(theirs, key=lambda r: r["round"])["seen"]
        else:
            missing = list(range(lo, hi))
            seen = f"rank {self.rank} in round {k + 1}"
        try:
            self.store.set(self._key(k, left, side),
                           json.dumps({"round": k, "missing": missing, "seen": seen}))
            self.store.add(f"{REPORTS}/n", 1)
        except Exception:  # noqa: BLE001 - best effort (see the class)
            pass
        return missing, seen


def _wait_port(store, key: str, deadline: float, failed) -> str:
    """The port published under ``key``, by ``deadline`` (monotonic): waited for in
    slices of :data:`LOOK_S`, in which ``failed()`` (the block that would publish it
    reported failing) ends the wait early. Raises DistStoreError past the deadline or
    on such a report."""
    import torch.distributed as dist

    began = time.monotonic()
    while True:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise dist.DistStoreError(f"Their MPI port did not appear within "
                                      f"{time.monotonic() - began:.1f} s.")
        try:
            return store_wait(store, key, timedelta(seconds=min(LOOK_S, left_s))).decode()
        except dist.DistStoreError:
            if failed():
                raise dist.DistStoreError(
                    f"Their MPI port had not appeared after {time.monotonic() - began:.1f} "
                    "s, when they reported failing.") from None


def _connect_world(store, rank: int, size: int, timeout: timedelta):
    """Join ``size`` MPI singletons into one intracommunicator ranked like torch, in
    the rounds of :func:`merge_rounds`.

    In each merge the accepting block's first rank publishes its port in the store
    for that round only (``ringcomm/port/<round>/<rank>``), when its block is ready
    to accept: a block merged in an earlier round cannot connect to a port that
    still accepts another. Store traffic: one key per merge, ``size - 1`` in all.
    Every rank has met the others in :func:`prepare_network`, so each MPI connect
    and accept below is bounded by ``RINGCOMM_CONNECT_TIMEOUT`` (a limit), and the
    wait for round k's port by k + 1 limits from the start (the accepting block may
    have had more rounds to go). A rank that never comes to its merge is named by
    every rank that waited for it, whatever the round (:class:`_Reports`). On failure
    the port is closed and the partial communicator freed, unless an MPI call still
    blocks on them."""
    import torch.distributed as dist

    MPI = mpi()

    limit = setup_limit(timeout)
    began = time.monotonic()
    reports = _Reports(store, rank)
    if size == 1:
        return mpi_serial.dup(MPI.COMM_SELF, "a one-rank group's communicator", limit)
    port = comm = None
    stuck = False
    try:
        comm = mpi_serial.dup(MPI.COMM_SELF, f"rank {rank}'s communicator", limit)
        for k, merges in enumerate(merge_rounds(size)):
            merge = next((m for m in merges if m[0] <= rank < m[2]), None)
            if merge is None:
                continue  # this rank's block has no partner this round
            left, right, end = merge
            block = comm
            key = f"ringcomm/port/{k}/{left}"
            other = (right, end) if rank < right else (left, right)
            side = "a" if rank < right else "c"

            def failed(k=k, other=other, own=(k, left, side)) -> bool:
                # the block this side waits for reported failing, or this side's first
                # rank did (it waited for that block's port)
                return reports.changed(k, *other, own)

            try:
                if rank < right:  # the accepting side, first in the merged order
                    if rank == left:
                        if port is None:
                            port = mpi_serial.locked(MPI.Open_port)
                        store.set(key, port)
                    merged = _bounded(
                        lambda: _joined(block.Accept(port if rank == left else None, root=0),
                                        False, limit),
                        f"rank {rank}'s MPI accept of ranks {right}-{end - 1}", timeout,
                        store, right, give_up=failed)
                else:
                    port_name = (_wait_port(store, key, began + (k + 1) * limit, failed)
                                 if rank == right else None)
                    # the first rank has the port: one limit to connect; the others wait
                    # for it too (it comes within k + 1 limits), then one more
                    merged = _bounded(
                        lambda: _joined(block.Connect(port_name, root=0), True, limit),
                        f"rank {rank}'s MPI connect to ranks {left}-{right - 1}", timeout,
                        store, left,
                        limit if rank == right else
                        max(limit, began + (k + 2) * limit - time.monotonic()), failed)
            except (dist.DistBackendError, dist.DistStoreError) as e:
                stuck_call = isinstance(e.__cause__, _Stuck)
                if not isinstance(e, dist.DistStoreError) and not stuck_call:
                    raise
                missing, seen = reports.absent(k, left, side, *other,
                                               min(REPORT_GRACE_S, limit))
                detail = str(e).removeprefix("ringcomm bootstrap: ")
                err = dist.DistBackendError(
                    f"ringcomm bootstrap: forming a group of {size}, {pmi.ranks_text(missing)} did "
                    f"not join: stopped before {'its' if len(missing) == 1 else 'their'} "
                    f"merge, or MPI cannot connect to {'it' if len(missing) == 1 else 'them'} "
                    f"(first missed by {seen}); rank {rank} waited for "
                    f"{pmi.ranks_text(list(range(*other)))} in round {k + 1} of "
                    f"{len(merge_rounds(size))}. {detail[:1].upper()}{detail[1:]}")
                raise err from e.__cause__ if stuck_call else None
            comm = None  # freed once, even if Free raises
            mpi_serial.locked(block.Free)
            comm = merged
        if comm.Get_rank() != rank or comm.Get_size() != size:
            raise RuntimeError(f"ringcomm bootstrap: built a communicator with rank "
                               f"{comm.Get_rank()}/{comm.Get_size()}, expected {rank}/{size}")
        done, comm = comm, None
        return done
    except BaseException as e:
        stuck = isinstance(e.__cause__, _Stuck)
        raise
    finally:
        if not stuck:
            if comm is not None:
                mpi_serial.locked(comm.Free)
            if port is not None:
                mpi_serial.locked(MPI.Close_port, port)


def group_comm(store, rank: int, size: int, global_ranks: list[int], timeout: timedelta,
               standalone: bool = False):
    """A new intracommunicator for a torch group (the caller owns it).

    Args:
        store: the group's c10d store (used only to connect singletons).
        rank, size: this process's rank in the group and the group size.
        global_ranks: the group's members as world ranks, in group-rank order;
            empty for the default (world) group.
        timeout: bound on waiting for peers during set-up.
        standalone: connect the ranks that meet at ``store`` afresh, whatever
            world this process has (``global_ranks`` unused).
    Raises:
        RuntimeError: MPI's world does not match torch's.
    """
    MPI = mpi()

    if standalone:
        return _connect_world(store, rank, size, timeout)
    global _world
    with _lock:
        if launched_by_mpi() and _world is None:
            _world = MPI.COMM_WORLD
        if not global_ranks:  # the world group
            if _world is None:
                _world = _connect_world(store, rank, size, timeout)
            if _world.Get_size() != size or _world.Get_rank() != rank:
                raise RuntimeError(
                    f"ringcomm: torch says rank {rank} of {size} but MPI says rank "
                    f"{_world.Get_rank()} of {_world.Get_size()}; launch with mpiexec or "
                    "torchrun and let ringcomm fill in RANK/WORLD_SIZE")
            return mpi_serial.dup(_world, "the world group's communicator",
                                  setup_limit(timeout))
        if _world is None:
            # The world group is not a ringcomm group: connect this group's members.
            return _connect_world(store, rank, size, timeout)
        world = _world
    with mpi_serial.LOCK:
        whole = world.Get_group()
        members = whole.Incl(list(global_ranks))
        whole.Free()

    def make():
        try:
            return world.Create_group(members)
        finally:  # here: a call stuck in it keeps the group it uses
            mpi_serial.locked(members.Free)

    comm = _bounded(make, f"the communicator of ranks {global_ranks}", timeout)
    if comm.Get_rank() != rank:
        mpi_serial.locked(comm.Free)
        raise RuntimeError(f"ringcomm: group rank {comm.Get_rank()} != torch's {rank} for "
                           f"ranks {global_ranks}")
    return comm
