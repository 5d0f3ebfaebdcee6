"""MPI's world started whole under torchrun and plain srun: ringcomm answers the
process-manager interface MPI asks at ``MPI_Init`` from the group's c10d store.

Under mpiexec, MPICH's ``MPI_Init`` learns its rank, the job's size and every
peer's address from the process manager, over PMI-1's wire protocol: lines of
``cmd=... key=value`` on a socket whose descriptor is in ``PMI_FD``. Without a
process manager each process would start as a singleton, to be merged with the
others afterwards (:func:`ringcomm.launch.bootstrap._connect_world`, a tree of
``ceil(log2 p)`` rounds of accept, connect and merge).

Here every process serves its own MPI library instead: :func:`start_world` opens a
socket pair, answers the library's end from a thread (:class:`Server`) and starts
MPI with ``PMI_RANK``/``PMI_SIZE`` set to torch's rank and size. The process
manager's key-value space and barriers become keys of the group's store:

* ``put``/``get``: ``pmi/kv/<key>`` (MPICH puts one address card per host, and
  reads them after a barrier);
* ``barrier_in``: a counter per barrier; the last rank to come sets ``.../out``,
  which every rank waits for, bounded by ``RINGCOMM_CONNECT_TIMEOUT``; a rank that
  does not come is named;
* ``PMI_process_mapping`` (which ranks share a host, so that MPI uses shared
  memory between them): rank 0 writes it once from the hosts the ranks recorded in
  :func:`ringcomm.launch.network.compare_hosts` (a network namespace is a host),
  so no rank reads every other rank's host name.

``MPI.COMM_WORLD`` then holds torch's ranks in torch's order, made in one
``MPI_Init`` (about as fast as under mpiexec) rather than in rounds of merges.
A library that does not speak PMI-1 over ``PMI_FD`` (Open MPI) starts as a
singleton, and the caller merges as before. ``RINGCOMM_PMI=0`` turns this off.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta

log = logging.getLogger("ringcomm")

#: what this server tells the library about its limits (MPICH's own process manager
#: says the same)
KVSNAME_MAX, KEYLEN_MAX, VALLEN_MAX = 256, 256, 1024

#: the variables MPI reads at start; removed again once it has started, so that
#: nothing later (a child process, :func:`ringcomm.launch.launchers.launched_by_mpi`)
#: takes this process for one started by mpiexec
ENV = ("PMI_FD", "PMI_RANK", "PMI_SIZE")


def process_mapping(machines: list[str]) -> str | None:
    """PMI's ``PMI_process_mapping`` for ranks on ``machines`` (one name per rank, in
    rank order): ``(vector,(node,count,ranks),...)``, each triple ``count`` hosts
    numbered from ``node`` holding ``ranks`` consecutive ranks each. Hosts are
    numbered in order of their first rank. None when the text exceeds
    :data:`VALLEN_MAX` (the library then compares host names, one read a rank)."""
    ids: dict[str, int] = {}
    runs: list[list[int]] = []  # [host, consecutive ranks on it]
    for name in machines:
        node = ids.setdefault(name, len(ids))
        if runs and runs[-1][0] == node:
            runs[-1][1] += 1
        else:
            runs.append([node, 1])
    merged: list[list[int]] = []
    for node, ranks in runs:  # consecutive hosts with as many ranks each: one triple
        prev = merged[-1] if merged else None
        if prev is not None and prev[0] + prev[1] == node and prev[2] == ranks:
            prev[1] += 1
        else:
            merged.append([node, 1, ranks])
    text = "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in merged) + ")"
    return text if len(text) < VALLEN_MAX else None


def ranks_text(ranks: list) -> str:
    """``rank 3``, ``ranks 3, 5`` or ``ranks 4-7`` (for errors)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _fields(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


class Server:
    """Answers one process's MPI library over PMI-1 from ``store`` (a fresh prefix of
    the group's store, :func:`ringcomm.launch.bootstrap.fresh_store`).

    Args:
        store: the group's store.
        rank, size: torch's rank of this process and the world's size.
        limit_s: how long a barrier of MPI's start may wait for the other ranks.
        finish_s: how long the barrier of ``MPI_Finalize`` may (the group's timeout:
            under mpiexec it waits for every rank to finish, however long).
        machine: this process's host, for the library's ``hostname[r]`` keys when
            there is no process mapping (namespaces on one machine differ).
        mapping: ``PMI_process_mapping``, or None.
    """

    def __init__(self, store, rank: int, size: int, limit_s: float, finish_s: float,
                 machine: str, mapping: str | None):
        self.store, self.rank, self.size = store, rank, size
        self.limit_s, self.finish_s = limit_s, finish_s
        self.machine, self.mapping = machine.replace(" ", "_"), mapping
        self.started = False  # MPI_Init returned: the next barrier is MPI_Finalize's
        self.barriers = 0
        self.failure: str | None = None  # why a barrier failed, for the caller's error
        self.finished = threading.Event()
        self.sock: socket.socket | None = None
        self._sending = threading.Lock()
        self.busy = False  # answering a request (a barrier waits under its own limit)
        self.last = time.monotonic()  # when the last request was answered

    def serve(self, sock: socket.socket) -> None:
        """Answer requests until the library finalizes or closes its end."""
        self.sock = sock
        with sock, sock.makefile("r", encoding="ascii", newline="\n") as f:
            for line in f:
                fields = _fields(line)
                self.busy = True
                try:
                    reply = self.answer(fields)
                except Exception as e:  # the store failed: the library gets an error
                    log.error("ringcomm: MPI's process-manager request %s failed: %s",
                              fields.get("cmd"), e)
                    reply = f"cmd={_REPLY.get(fields.get('cmd', ''), 'error')} rc=-1"
                finally:
                    self.busy, self.last = False, time.monotonic()
                if reply is None:
                    break
                self._send(reply)
                if fields.get("cmd") == "finalize":
                    break
        self.finished.set()

    def quiet_s(self) -> float:
        """Seconds since the library's last request was answered (0 while one is)."""
        return 0.0 if self.busy else time.monotonic() - self.last

    def _send(self, reply: str) -> None:
        with self._sending:
            self.sock.sendall(reply.encode("ascii") + b"\n")

    def answer_finalize_ahead(self) -> None:
        """Answer the library's last request before it asks: MPICH says ``finalize``
        from a C exit handler, after Python (and this thread) has stopped."""
        if not self.finished.is_set():
            self.finished.set()
            self._send("cmd=finalize_ack rc=0")

    def answer(self, f: dict[str, str]) -> str | None:
        """The reply to one request (None: the library is aborting)."""
        cmd = f.get("cmd", "")
        if cmd == "init":
            return "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"
        if cmd == "get_maxes":
            return (f"cmd=maxes rc=0 kvsname_max={KVSNAME_MAX} keylen_max={KEYLEN_MAX} "
                    f"vallen_max={VALLEN_MAX}")
        if cmd == "get_appnum":
            return "cmd=appnum rc=0 appnum=0"
        if cmd == "get_my_kvsname":
            return "cmd=my_kvsname rc=0 kvsname=ringcomm"
        if cmd == "get_universe_size":
            return f"cmd=universe_size rc=0 size={self.size}"
        if cmd == "put":
            key, value = f["key"], f.get("value", "")
            if key.startswith("hostname["):  # the host as ringcomm sees it
                value = self.machine
            self.store.set(f"pmi/kv/{key}", value)
            return "cmd=put_result rc=0"
        if cmd == "get":
            return self._get(f["key"])
        if cmd == "barrier_in":
            return self._barrier()
        if cmd == "finalize":
            return "cmd=finalize_ack rc=0"
        if cmd == "abort":
            log.error("ringcomm: MPI aborts this process (exit code %s)",
                      f.get("exitcode", "?"))
            return None
        return (f"cmd={_REPLY.get(cmd, cmd)} rc=-1 msg=ringcomm_serves_no_{cmd or 'command'}"
                "_use_mpiexec")

    def _get(self, key: str) -> str:
        if key == "PMI_process_mapping" and self.mapping is not None:
            return f"cmd=get_result rc=0 value={self.mapping}"
        if not key.startswith("PMI_"):  # PMI_*: attributes of the job this server has not
            full = f"pmi/kv/{key}"
            if self.store.check([full]):
                return f"cmd=get_result rc=0 value={self.store.get(full).decode()}"
        return "cmd=get_result rc=-1 msg=key_not_found"

    def _barrier(self) -> str:
        import torch.distributed as dist

        n, self.barriers = self.barriers, self.barriers + 1
        key = f"pmi/barrier/{n}"
        self.store.set(f"{key}/{self.rank}", b"1")
        if self.store.add(key, 1) == self.size:
            self.store.set(f"{key}/out", b"1")
        limit, what, why = (
            (self.finish_s, "MPI_Finalize's barrier", "the world group's timeout")
            if self.started else
            (self.limit_s, f"MPI_Init's barrier {n + 1}", "RINGCOMM_CONNECT_TIMEOUT"))
        try:
            self.store.wait([f"{key}/out"], timedelta(seconds=limit))
        except dist.DistStoreError:
            missing = [r for r in range(self.size) if not self.store.check([f"{key}/{r}"])]
            self.failure = (f"the world of {self.size} ranks: {ranks_text(missing)} did not "
                            f"reach {what} within {limit:g} s ({why}): stopped, or stuck "
                            "before it; MPI ends this process")
            log.error("ringcomm bootstrap: %s", self.failure)
            return "cmd=barrier_out rc=-1"
        return "cmd=barrier_out rc=0"


#: the reply's command for each request's, for errors
_REPLY = {"init": "response_to_init", "get_maxes": "maxes", "get_appnum": "appnum",
          "get_my_kvsname": "my_kvsname", "get_universe_size": "universe_size",
          "put": "put_result", "get": "get_result", "barrier_in": "barrier_out",
          "finalize": "finalize_ack"}


def _libmpi() -> ctypes.CDLL:
    """The MPI library mpi4py loaded (the same handle: it is loaded already)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libmpi" in path and ".so" in path:
                return ctypes.CDLL(path)
    raise RuntimeError("ringcomm: cannot find the MPI library mpi4py loaded")


def _init_thread(MPI) -> None:
    """``MPI_Init_thread`` with Python's lock released, as mpi4py's ``Init_thread``
    does not: this process's :class:`Server` thread answers the library meanwhile.
    Then what mpi4py does after starting MPI: its error handlers (``rc.errors``)."""
    import mpi4py

    provided = ctypes.c_int(0)
    code = _libmpi().MPI_Init_thread(None, None, ctypes.c_int(MPI.THREAD_MULTIPLE),
                                     ctypes.byref(provided))
    if code != 0:
        raise RuntimeError(f"ringcomm: MPI_Init_thread failed (MPI error {code})")
    handler = {"exception": MPI.ERRORS_RETURN, "fatal": MPI.ERRORS_ARE_FATAL,
               "abort": getattr(MPI, "ERRORS_ABORT", None)}.get(mpi4py.rc.errors)
    if handler is not None:
        for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
            comm.Set_errhandler(handler)


class InitTimeout(RuntimeError):
    """``MPI_Init`` went on past its limit after its last process-manager request: it
    waits on the network (its call cannot be cancelled; the process cannot use MPI)."""


def _started(MPI, server: Server, limit_s: float) -> None:
    """:func:`_init_thread` in a thread of its own, watched: past ``limit_s`` with no
    request from the library (MPICH connects the hosts inside ``MPI_Init`` once the
    addresses are exchanged, and waits on a network path it cannot use forever),
    raise :class:`InitTimeout`. A request's own wait (a barrier) has its own limit."""
    outcome: list = []

    def run():
        try:
            _init_thread(MPI)
            outcome.append(None)
        except BaseException as e:  # handed to the caller
            outcome.append(e)

    t = threading.Thread(target=run, name="ringcomm-mpi-init", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.05)
        if t.is_alive() and server.quiet_s() > limit_s:
            raise InitTimeout(f"MPI_Init did not complete within {limit_s:g} s of its last "
                              "process-manager request")
    if outcome[0] is not None:
        raise outcome[0]


def _machines(store, size: int, timeout: timedelta) -> list[str]:
    keys = [f"ringcomm/net/{r}" for r in range(size)]
    store.wait(keys, timeout)
    try:
        values = store.multi_get(keys)
    except (AttributeError, NotImplementedError, RuntimeError):  # a store without it
        values = [store.get(k) for k in keys]
    return [json.loads(v)["machine"] for v in values]


def shared_mapping(store, rank: int, size: int, timeout: timedelta) -> str | None:
    """``PMI_process_mapping`` for the group, made by rank 0 and read by the others
    (one key; ``""`` stands for none)."""
    if rank == 0:
        mapping = process_mapping(_machines(store, size, timeout))
        store.set("pmi/mapping", mapping or "")
        return mapping
    store.wait(["pmi/mapping"], timeout)
    return store.get("pmi/mapping").decode() or None


#: this process's server, once it started MPI
_server: Server | None = None


def serving() -> bool:
    """Whether this process's MPI was started by :func:`start_world` and not finalized:
    its ``MPI_Finalize`` then waits, in a barrier this process's Python serves, for
    every rank to finalize (as under mpiexec); see :func:`finalize`."""
    return _server is not None and not _server.finished.is_set()


def finalize() -> None:
    """``MPI_Finalize`` with Python's lock released, while Python still runs the
    thread that serves its barrier (mpi4py's own runs after Python has stopped).
    Call it at exit, once no thread uses MPI; nothing to do unless :func:`serving`."""
    if not serving():
        return
    code = _libmpi().MPI_Finalize()
    if code != 0:
        log.error("ringcomm: MPI_Finalize failed (MPI error %d)", code)
    _server.answer_finalize_ahead()


def start_world(store, rank: int, size: int, timeout: timedelta, limit_s: float,
                machine: str):
    """Start MPI in this process as rank ``rank`` of a ``size``-rank world served from
    ``store``, and return mpi4py's ``MPI``. The caller checks ``MPI.COMM_WORLD``: a
    library that ignores ``PMI_FD`` leaves a singleton.

    Raises:
        RuntimeError: MPI was already started in this process.
        DistBackendError: a rank did not reach one of MPI's start-up barriers.
    """
    import mpi4py
    import torch.distributed as dist

    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized():
            raise RuntimeError("ringcomm: MPI already started in this process")
    mpi4py.rc.initialize = False  # started below, with the GIL released
    mpi4py.rc.finalize = True
    from mpi4py import MPI

    global _server
    server = Server(store, rank, size, limit_s, timeout.total_seconds(), machine,
                    shared_mapping(store, rank, size, timeout))
    ours, theirs = socket.socketpair()
    threading.Thread(target=server.serve, args=(ours,), name="ringcomm-pmi",
                     daemon=True).start()
    os.set_inheritable(theirs.fileno(), False)
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(PMI_FD=str(theirs.fileno()), PMI_RANK=str(rank), PMI_SIZE=str(size))
    try:
        _started(MPI, server, limit_s)
    except RuntimeError as e:
        if server.failure:
            raise dist.DistBackendError(f"ringcomm bootstrap: rank {rank}: "
                                        f"{server.failure}") from e
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    # the library keeps its end (it says "finalize" on it at the end); ours is the thread's
    theirs.detach()
    server.started, _server = True, server
    return MPI
