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

MPI's start and end run on one thread of this module's (:class:`_Life`):
mpi4py's ``Init_thread`` and ``Finalize`` hold Python's lock, which the serving
thread needs. So ``MPI.Is_thread_main()`` is False on Python's main thread, and
``MPI.Finalize`` is replaced by :func:`finalize` (a script may still call it).
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
import uuid
from datetime import timedelta

from ringcomm.launch.group_store import get_all

log = logging.getLogger("ringcomm")

#: what this server tells the library about its limits (MPICH's own process manager
#: says the same; older PMI clients read a reply into 1,024 bytes)
KVSNAME_MAX, KEYLEN_MAX, VALLEN_MAX = 256, 256, 1024

#: the variables MPI reads at start; removed again once it has started, so that
#: nothing later (a child process, :func:`ringcomm.launch.launchers.launched_by_mpi`)
#: takes this process for one started by mpiexec
ENV = ("PMI_FD", "PMI_RANK", "PMI_SIZE")


def ranks_text(ranks: list) -> str:
    """``rank 3``, ``ranks 3, 5`` or ``ranks 4-7`` (for errors)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def process_mapping(machines: list[str]) -> str | None:
    """PMI's ``PMI_process_mapping`` for ranks on ``machines`` (one name per rank, in
    rank order): ``(vector,(node,count,ranks),...)``, each triple ``count`` hosts
    numbered from ``node`` holding ``ranks`` consecutive ranks each. Hosts are
    numbered in order of their first rank. None when the text exceeds
    :data:`VALLEN_MAX` (hosts interleaved in more than about 80 runs): MPICH then
    compares the host names each rank puts, every rank reading every other's."""
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


def _fields(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


class Server:
    """Answers one process's MPI library over PMI-1 from ``store`` (a fresh prefix of
    the group's store, :func:`ringcomm.launch.group_store.fresh_store`).

    Args:
        store: the group's store.
        rank, size: torch's rank of this process and the world's size.
        limit_s: how long a barrier of MPI's start may wait for the other ranks.
        finish_s: how long a barrier after it (``MPI_Finalize`` holds one with some
            of MPICH's networks) may: the group's timeout, as under mpiexec it waits
            for every rank to finish, however long.
        job: the key-value space's name, this job's own (MPICH derives the world's
            id from it, which tells two jobs' ranks apart once they connect).
        mapping: ``PMI_process_mapping``, or None.
    """

    def __init__(self, store, rank: int, size: int, limit_s: float, finish_s: float,
                 job: str, mapping: str | None):
        self.store, self.rank, self.size = store, rank, size
        self.limit_s, self.finish_s = limit_s, finish_s
        self.job, self.mapping = job, mapping
        self.started = False  # MPI_Init returned: later barriers wait finish_s
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
        with sock:
            head = sock.recv(4, socket.MSG_PEEK)
            if head and head != b"cmd=":  # PMI-2 (length-prefixed) or something else
                self.failure = ("MPI speaks another process-manager protocol than PMI-1 "
                                f"(it began with {head!r}); unset MPIR_CVAR_PMI_VERSION, "
                                "or set RINGCOMM_PMI=0")
                log.error("ringcomm: %s", self.failure)
            else:
                self._serve(sock)
        self.finished.set()

    def _serve(self, sock: socket.socket) -> None:
        with sock.makefile("r", encoding="ascii", errors="replace", newline="\n") as f:
            for line in f:
                if line.startswith("mcmd="):  # a spawn: lines up to "endcmd"
                    while line and not line.startswith("endcmd"):
                        line = f.readline()
                    self._send("cmd=spawn_result rc=-1 errmsg=ringcomm_serves_no_spawn")
                    continue
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
                    return
                self._send(reply)
                if fields.get("cmd") == "finalize":
                    return

    def quiet_s(self) -> float:
        """Seconds since the library's last request was answered (0 while one is)."""
        return 0.0 if self.busy else time.monotonic() - self.last

    def _send(self, reply: str) -> None:
        with self._sending:
            self.sock.sendall(reply.encode("ascii") + b"\n")

    def answer_finalize_ahead(self) -> None:
        """Answer the library's last request before it asks: MPICH says ``finalize``
        from a C exit handler, after Python (and this thread) has stopped."""
        if not self.finished.is_set() and self.sock is not None:
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
            return f"cmd=my_kvsname rc=0 kvsname={self.job}"
        if cmd == "get_universe_size":
            return f"cmd=universe_size rc=0 size={self.size}"
        if cmd == "put":
            self.store.set(f"pmi/kv/{f['key']}", f.get("value", ""))
            return "cmd=put_result rc=0"
        if cmd == "get":
            return self._get(f["key"])
        if cmd == "barrier_in":
            return self._barrier()
        if cmd == "finalize":
            return "cmd=finalize_ack rc=0"
        if cmd == "abort":
            log.error("ringcomm: MPI aborts this process: %s",
                      " ".join(f"{k}={v}" for k, v in f.items() if k != "cmd"))
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
        self.store.append(f"{key}/who", f"{self.rank} ")
        if self.store.add(key, 1) == self.size:
            self.store.set(f"{key}/out", b"1")
        limit, what, why = (
            (self.finish_s, f"MPI's barrier {n + 1} (after its start)",
             "the world group's timeout")
            if self.started else
            (self.limit_s, f"MPI_Init's barrier {n + 1}", "RINGCOMM_CONNECT_TIMEOUT"))
        try:
            self.store.wait([f"{key}/out"], timedelta(seconds=limit))
        except dist.DistStoreError:
            came = {int(r) for r in self.store.get(f"{key}/who").split()}
            missing = [r for r in range(self.size) if r not in came]
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


class InitTimeout(RuntimeError):
    """``MPI_Init`` went on past its limit after its last process-manager request: it
    waits on the network (its call cannot be cancelled; the process cannot use MPI)."""


def _library(MPI) -> ctypes.CDLL:
    """The MPI library behind mpi4py: symbols are looked up through mpi4py's own
    module, which is linked to it (so the handle is the one already loaded)."""
    return ctypes.CDLL(MPI.__file__)


class _Life(threading.Thread):
    """The thread that starts MPI and, at exit, finalizes it, with Python's lock
    released (ctypes) so that this process's :class:`Server` can answer meanwhile:
    the MPI standard wants both on one thread. It then does what mpi4py does after
    starting MPI: its error handlers (``rc.errors``)."""

    def __init__(self, MPI):
        super().__init__(name="ringcomm-mpi", daemon=True)
        self.MPI, self.lib = MPI, _library(MPI)
        self.started = threading.Event()  # MPI_Init returned (or failed: see error)
        self.error: BaseException | None = None
        self.provided = -1
        self._finalize = threading.Event()
        self.finalized = threading.Event()

    def run(self) -> None:
        try:
            self._init()
        except BaseException as e:  # handed to the caller
            self.error = e
        self.started.set()
        if self.error is not None:
            return
        self._finalize.wait()
        code = self.lib.MPI_Finalize()
        if code != 0:
            log.error("ringcomm: MPI_Finalize failed (MPI error %d)", code)
        self.finalized.set()

    def _init(self) -> None:
        import mpi4py

        MPI, provided = self.MPI, ctypes.c_int(0)
        code = self.lib.MPI_Init_thread(None, None, ctypes.c_int(MPI.THREAD_MULTIPLE),
                                        ctypes.byref(provided))
        if code != 0:
            raise RuntimeError(f"ringcomm: MPI_Init_thread failed (MPI error {code})")
        self.provided = provided.value
        handler = {"exception": MPI.ERRORS_RETURN, "fatal": MPI.ERRORS_ARE_FATAL,
                   "abort": getattr(MPI, "ERRORS_ABORT", None)}.get(mpi4py.rc.errors)
        if handler is not None:
            for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
                comm.Set_errhandler(handler)

    def finalize(self) -> None:
        """``MPI_Finalize`` on this thread; returns when it has."""
        self._finalize.set()
        self.finalized.wait()


def _started(life: _Life, server: Server, limit_s: float) -> None:
    """Start ``life``'s thread and wait for ``MPI_Init``, watched: past ``limit_s``
    with no request from the library (MPICH connects the hosts inside ``MPI_Init``
    once the addresses are exchanged, and waits on a network path it cannot use
    forever), raise :class:`InitTimeout`. A request's own wait (a barrier) has its
    own limit."""
    life.start()
    while not life.started.wait(0.05):
        if server.quiet_s() > limit_s:
            raise InitTimeout(f"MPI_Init did not complete within {limit_s:g} s of its last "
                              "process-manager request")
    if life.error is not None:
        raise life.error
    if life.provided < life.MPI.THREAD_MULTIPLE:
        log.warning("ringcomm: MPI provides thread level %d, not MPI_THREAD_MULTIPLE",
                    life.provided)


def _machines(store, size: int, timeout: timedelta) -> list[str]:
    keys = [f"ringcomm/net/{r}" for r in range(size)]
    store.wait(keys, timeout)
    return [json.loads(v)["machine"] for v in get_all(store, keys)]


def shared_job(store, rank: int, size: int, timeout: timedelta) -> tuple[str, str | None]:
    """The job's name and ``PMI_process_mapping`` (None: none), made by rank 0 and read
    by the others (one key)."""
    if rank == 0:
        job = {"name": f"ringcomm-{uuid.uuid4().hex[:12]}",
               "mapping": process_mapping(_machines(store, size, timeout))}
        store.set("pmi/job", json.dumps(job))
    else:
        store.wait(["pmi/job"], timeout)
        job = json.loads(store.get("pmi/job"))
    return job["name"], job["mapping"]


#: this process's MPI thread and server, once MPI started through them
_life: _Life | None = None
_server: Server | None = None
#: the library's end of a socket pair whose MPI_Init never returned: kept open, so
#: that its descriptor number is never reused under the library
_held: list[socket.socket] = []


def serving() -> bool:
    """Whether this process's MPI world was started whole by :func:`start_world` and
    not yet finalized: :func:`finalize` must end it (see there)."""
    return _server is not None and not _life.finalized.is_set()


def finalize() -> None:
    """End MPI started by :func:`start_world`: ``MPI_Finalize`` on the thread that
    started it, while Python still runs the thread that serves its barrier (mpi4py's
    own runs after Python has stopped), then the answer to the library's last request
    ahead (:meth:`Server.answer_finalize_ahead`). A script that called
    ``MPI.Finalize()`` itself gets that answer only. Call it at exit, once no thread
    uses MPI; nothing to do unless this module started MPI."""
    if _life is None or _life.finalized.is_set():
        return
    if not _life.MPI.Is_finalized():
        _life.finalize()
    if _server is not None:
        _server.answer_finalize_ahead()


def load_mpi():
    """mpi4py's ``MPI``, MPI not started, or None: MPI was started already, or the
    MPI library cannot be loaded (the MPI transport's import says why, where CPU
    tensors need it)."""
    try:
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False  # started by _Life
            mpi4py.rc.finalize = True
        from mpi4py import MPI

        _library(MPI)
    except (ImportError, OSError, RuntimeError):
        return None
    return None if MPI.Is_initialized() else MPI


def start_world(MPI, store, rank: int, size: int, timeout: timedelta,
                limit_s: float) -> bool:
    """Start MPI (``MPI`` from :func:`load_mpi`) in this process as rank ``rank`` of a
    ``size``-rank world served from ``store``. False when the library ignored
    ``PMI_FD`` and started as a singleton (it is then not served: the caller joins
    the world otherwise).

    Raises:
        InitTimeout: ``MPI_Init`` waits on the network (see :func:`_started`).
        DistBackendError: a rank did not reach one of MPI's start-up barriers.
    """
    import torch.distributed as dist

    global _life, _server
    job, mapping = shared_job(store, rank, size, timeout)
    server = Server(store, rank, size, limit_s, timeout.total_seconds(), job, mapping)
    life = _Life(MPI)
    ours, theirs = socket.socketpair()
    threading.Thread(target=server.serve, args=(ours,), name="ringcomm-pmi",
                     daemon=True).start()
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(PMI_FD=str(theirs.fileno()), PMI_RANK=str(rank), PMI_SIZE=str(size))
    try:
        _started(life, server, limit_s)
    except InitTimeout:
        _held.append(theirs)  # the library may still use it
        raise
    except RuntimeError as e:
        _held.append(theirs)
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
    world = MPI.COMM_WORLD
    if (world.Get_size(), world.Get_rank()) != (size, rank):  # ignored PMI_FD
        theirs.close()  # the server sees the end of its socket and stops
        _life = life  # MPI runs: it ends on the thread that started it
        return False
    # the library keeps its end (it says "finalize" on it at the end); ours is the thread's
    theirs.detach()
    server.started, _life, _server = True, life, server
    # mpi4py's own would finalize holding Python's lock, which this server needs
    MPI.Finalize = finalize
    return True
