"""The flight recorder: the last collectives and messages of every ringcomm group of
this process, dumped in torch's own format when something goes wrong.

torch's NCCL and gloo groups keep such a record, and its analyzer
(``python -m torch.distributed.flight_recorder.fr_trace DIR``) reads every rank's
dump and names the first collective that not every rank reached. ringcomm writes
the same pickle, so torch's tooling reads it (torch 2.13 and 2.15), and
``python -m ringcomm.flight_recorder DIR`` adds what each missing rank did last.

What it keeps, per call: torch's sequence numbers (per group, collectives and
point-to-point calls counted apart, 1-based, as torch numbers them), the op in the
analyzer's spelling (``gloo:all_reduce`` for a CPU tensor, ``nccl:...`` for a CUDA
one: torch 2.13's analyzer takes no other library name), the algorithm, sizes and
dtypes, and its state: *started* (issued, not known to have finished; for the
newest open call of a group, the peers its last wait was on) or *completed*, with
times.

torch's variables, read once when the first group is made:

* ``TORCH_FR_BUFFER_SIZE`` (or ``TORCH_NCCL_TRACE_BUFFER_SIZE``): the calls kept,
  process-wide; 0 turns it off. Unset: off, see :data:`DEFAULT_ENTRIES`.
* ``TORCH_FR_DUMP_TEMP_FILE`` (or ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``): the dump's
  path before the rank, ``~/.cache/torch/comm_lib_trace_rank_`` by default.
* ``TORCH_NCCL_DUMP_ON_TIMEOUT`` (or ``TORCH_FR_DUMP_ON_TIMEOUT``), on by default:
  dump when a collective of the process fails (a timeout, a mismatch), and when the
  process learns that one failed on another rank (:mod:`ringcomm.front.watch`), so
  every rank of the group dumps, in a collective or not.

:func:`dump` writes one on demand; so does the signal ``RINGCOMM_FR_SIGNAL`` names
(``SIGUSR2`` by default; only where nothing else handles it).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import signal
import socket
import threading
import time
import weakref
from typing import Any

__all__ = ["GroupTag", "Recorder", "recorder", "dump", "dump_path", "DEFAULT_ENTRIES", "VERSION"]

log = logging.getLogger("ringcomm")

#: calls kept when TORCH_FR_BUFFER_SIZE is unset: 0, off. torch keeps 2000 by default;
#: ringcomm's record costs its 4 KiB allreduce more than the 2% it may take unasked
#: (``scripts/bench_layers.py``, docs/debugging-a-hang.md)
DEFAULT_ENTRIES = 0
#: the format's version as torch 2.13 and 2.15 write it (their analyzer needs every
#: rank's to be the same "major.minor")
VERSION = "2.10"
#: torch's op names (its analyzer knows only these) for a ProcessGroup's methods
OP_NAMES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "allreduce_coalesced",
    "broadcast": "broadcast", "reduce": "reduce", "allgather": "all_gather",
    "_allgather_base": "_all_gather_base", "allgather_coalesced": "ALLGATHER_coalesced",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "gather": "gather",
    "scatter": "scatter", "barrier": "barrier",
    # torch's analyzer knows these by other names
    "all_gather_single": "_all_gather_base",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter_single": "_reduce_scatter_base",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "gather_single": "gather", "gather_into_tensor": "gather",
    "all_to_all_single": "all_to_all",
}
#: collectives whose output is the ranks' inputs side by side, and the reverse:
#: recorded as one tensor of the whole, as torch's NCCL backend records them (its
#: analyzer checks output = input x ranks)
_GATHERS = {"allgather", "_allgather_base", "all_gather_single"}
_SCATTERS = {"reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single"}

# the fields of an entry (a list: one is made per call, on its caller's thread)
_ID, _GROUP, _SEQ, _P2P_SEQ, _META, _CREATED, _TIMEOUT, _WORK = range(8)


def _finished(work: Any) -> bool:
    """Whether ``work`` is known to have finished, from its state alone: a dump may run
    in a signal handler, between two bytecodes of a thread holding MPI's lock, where
    ``is_completed()`` (which tests MPI requests, and may run callbacks) would
    deadlock. A message not yet tested reads as unfinished."""
    if getattr(work, "_done", False) or getattr(work, "_finished", False):
        return True
    query = getattr(getattr(work, "_end", None), "query", None)  # a stream's event
    try:
        return bool(query()) if query is not None else False
    except Exception:  # noqa: BLE001 - a torn-down stream: not known to have finished
        return False


def _env(*names: str) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return v
    return None


def dump_path(rank: int) -> str:
    """Where rank ``rank`` dumps: ``TORCH_FR_DUMP_TEMP_FILE`` (or
    ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, or torch's default) followed by the rank."""
    prefix = _env("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if prefix is None:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                  ".cache")
        prefix = os.path.join(cache, "torch", "comm_lib_trace_rank_")
    return f"{prefix}{rank}"


def _dtype_name(t: Any) -> str:
    # torch's ScalarType names ("Float", "BFloat16", "Long"), as torch's dumps write them
    return _SCALAR_NAMES.get(t.dtype) or str(t.dtype).removeprefix("torch.").title()


def _scalar_names() -> dict:
    import torch

    return {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
            torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
            torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
            torch.bool: "Bool", torch.complex64: "ComplexFloat",
            torch.complex128: "ComplexDouble"}


_SCALAR_NAMES: dict = {}


def _tensors(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return [x] if hasattr(x, "dtype") and hasattr(x, "shape") else []


def call_meta(method: str, lib: str, args: tuple, size: int, algorithm: str) -> tuple:
    """What an entry says of a call of ProcessGroup method ``method`` with torch's
    ``args`` (outputs first, then inputs; one list for in-place collectives):
    ``(profiling name, input sizes, input dtypes, output sizes, output dtypes,
    algorithm)``. Made once per prepared call: its shape is the call's."""
    if not _SCALAR_NAMES:
        _SCALAR_NAMES.update(_scalar_names())
    tensors = [_tensors(a) for a in args[:2]]
    outs = tensors[0] if tensors else []
    ins = tensors[1] if len(tensors) > 1 and tensors[1] else outs
    if method in ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "barrier"):
        outs = ins = tensors[0] if tensors else []
    in_sizes = [list(t.shape) for t in ins]
    out_sizes = [list(t.shape) for t in outs]
    if method in _GATHERS and ins:  # the gathered whole, one tensor
        out_sizes = [[size * ins[0].numel()]]
    elif method in _SCATTERS and outs:
        in_sizes = [[size * outs[0].numel()]]
    name = f"{lib}:{OP_NAMES.get(method, method)}"
    algorithm = algorithm.partition("[")[2].rstrip("]") or algorithm  # allreduce[ring]
    return (name, in_sizes, [_dtype_name(t) for t in ins], out_sizes,
            [_dtype_name(t) for t in outs], algorithm)


class GroupTag:
    """A group as its entries name it (torch sets a group's name after making it:
    the group keeps its tag's up to date)."""

    __slots__ = ("name", "desc", "ranks", "waiting")

    def __init__(self, name: str, desc: str, ranks: list[int]):
        self.name, self.desc, self.ranks = name, desc, list(ranks)
        #: a weak reference to a function naming the peers the group's running call
        #: waits for (or None); asked at a dump
        self.waiting: Any = None

    def waiting_for(self) -> str | None:
        fn = self.waiting() if self.waiting is not None else None
        try:
            return fn() if fn is not None else None
        except Exception:  # noqa: BLE001 - a dump must not fail on a torn-down group
            return None


class Recorder:
    """The process's ring of the last ``capacity`` calls, of every group."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        #: the entries, at their id modulo the capacity (the allreduce short path
        #: writes them itself: ringcomm.front.reductions)
        self.ring: list = [None] * capacity
        #: the next entry's id (atomic: several threads may record)
        self.next_id = itertools.count().__next__
        # reentrant: a dump asked for by signal may interrupt one being written
        self._lock = threading.RLock()
        #: the dumps this process wrote
        self._written: set[str] = set()
        self.dumped_at: float | None = None

    def record(self, group: GroupTag, seq: int, p2p_seq: int, meta: tuple,
               timeout_s: float) -> list:
        """A call of ``group`` issued now: its entry, to be :meth:`issued` its Work."""
        i = self.next_id()
        entry = [i, group, seq, p2p_seq, meta, time.time_ns(), timeout_s, None]
        self.ring[i % self.capacity] = entry
        return entry

    @staticmethod
    def issued(entry: list, work: Any, done: bool) -> None:
        """The call's Work: ``done`` (it returned finished, with no error, from the
        caller's thread), or what :meth:`held` keeps of it."""
        entry[_WORK] = True if done else Recorder.held(work)

    @staticmethod
    def held(work: Any) -> Any:
        """What an entry keeps of a Work not known to be done: its error if it failed
        already, else a weak reference, asked at the dump (a ring of Works would keep
        their tensors alive)."""
        exc = getattr(work, "_exc", None)
        return str(exc) if exc is not None else weakref.ref(work)

    def entries(self) -> list[list]:
        """The kept entries, oldest first."""
        return sorted((e for e in self.ring if e is not None), key=lambda e: e[_ID])

    def snapshot(self, stacks: bool = True) -> dict:
        """The dump, as torch's writer makes it (``pickle`` it to a file)."""
        now = time.time_ns()
        entries, status, groups, last_open = [], {}, {}, {}
        for e in self.entries():
            tag = e[_GROUP]
            name, desc = tag.name, tag.desc
            groups[name] = {"name": name, "desc": desc, "ranks": str(tag.ranks)}
            (profiling, in_sizes, in_dtypes, out_sizes, out_dtypes, algo) = e[_META]
            held, created = e[_WORK], e[_CREATED]
            # completed, with no error (a timed-out call stays started): a call that
            # returned finished from its caller's thread within microseconds of its
            # creation; else its Work, found completed at this dump (gone: the engine
            # let it go once finished)
            done, error = None, None
            if held is True:
                done = created
            elif isinstance(held, str):
                error = held
            elif held is not None:
                work = held()
                error = getattr(work, "_exc", None)
                if work is None or (error is None and _finished(work)):
                    done = now
            state = "completed" if done is not None else "started"
            started = created
            is_p2p = " " in profiling
            entry = {
                "record_id": e[_ID], "pg_id": 0, "process_group": (name, desc),
                "thread_name": "", "thread_id": "",
                "collective_seq_id": e[_SEQ], "p2p_seq_id": e[_P2P_SEQ],
                "op_id": e[_SEQ] + e[_P2P_SEQ], "profiling_name": profiling,
                "time_created_ns": e[_CREATED],
                "input_sizes": in_sizes, "input_dtypes": in_dtypes,
                "output_sizes": out_sizes, "output_dtypes": out_dtypes,
                "state": state, "time_discovered_started_ns": started,
                "time_discovered_completed_ns": done, "retired": done is not None,
                "timeout_ms": int(e[_TIMEOUT] * 1000), "is_p2p": is_p2p,
                "algorithm": algo,
            }
            if error is not None:
                entry["error"] = str(error)[:2000]
            if state == "started":
                last_open[name] = (entry, tag)
            if stacks:
                entry["frames"] = []
            entries.append(entry)
            st = status.setdefault(name, {"last_enqueued_collective": -1,
                                          "last_started_collective": -1,
                                          "last_completed_collective": -1})
            if not is_p2p:
                st["last_enqueued_collective"] = e[_SEQ]
                st["last_started_collective"] = e[_SEQ]
                if done is not None:
                    st["last_completed_collective"] = e[_SEQ]
        for entry, tag in last_open.values():  # the newest call of a group still open
            if "error" not in entry:
                entry["waiting_for"] = tag.waiting_for()
        return {"version": VERSION, "pg_config": groups, "comm_lib_version": "ringcomm",
                "pg_status": status, "entries": entries, "host_name": socket.gethostname(),
                "pid": os.getpid(), "dump_time_ns": now}

    def write(self, rank: int, why: str) -> str | None:
        """Write the dump to :func:`dump_path` (``rank``: this process's world rank);
        its path, or None where it could not be written (a warning says why: the
        training goes on). A file there that another process wrote since this one
        started (two jobs sharing ``TORCH_FR_DUMP_TEMP_FILE``, or two ranks one
        rank number) is replaced, with a warning naming the path."""
        path = dump_path(rank)
        tmp = f"{path}.{os.getpid()}.tmp"  # whole or not at all: renamed once written
        with self._lock:
            with contextlib.suppress(OSError):
                if path not in self._written and os.stat(path).st_mtime > _PROCESS_STARTED:
                    log.warning("ringcomm: rank %d's flight recorder dump replaces %s, which "
                                "another process wrote since this one started: give each "
                                "job its own TORCH_FR_DUMP_TEMP_FILE", rank, path)
            try:
                data = pickle.dumps(self.snapshot())
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
                self._written.add(path)
            except Exception as e:  # noqa: BLE001 - a dump never ends the training
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                log.warning("ringcomm: rank %d could not write its flight recorder dump to "
                            "%s (%s): %s", rank, path, why, e)
                return None
        log.warning("ringcomm: rank %d wrote its flight recorder dump to %s (%s)", rank, path, why)
        return path


#: when this process started (as far as this module knows): a dump file newer than
#: that, not written here, is another process's
_PROCESS_STARTED = time.time()
_recorder: Recorder | None = None
_made = False
_made_lock = threading.Lock()


def recorder() -> Recorder | None:
    """The process's recorder, made on first use from ``TORCH_FR_BUFFER_SIZE``; None
    when it is off."""
    global _recorder, _made
    if _made:
        return _recorder
    with _made_lock:
        if not _made:
            raw = _env("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
            try:
                n = DEFAULT_ENTRIES if raw is None else int(raw)
            except ValueError:
                raise ValueError(f"ringcomm: TORCH_FR_BUFFER_SIZE={raw!r} is not valid: "
                                 "expected a whole number of calls (0: off)") from None
            _recorder = Recorder(n) if n > 0 else None
            if _recorder is not None:
                _install_signal()
            _made = True
    return _recorder


def dump_on_failure() -> bool:
    """``TORCH_NCCL_DUMP_ON_TIMEOUT`` (or ``TORCH_FR_DUMP_ON_TIMEOUT``): on unless 0."""
    raw = _env("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_ON_TIMEOUT")
    return raw is None or raw.strip().lower() not in ("0", "false", "no", "off")


def world_rank() -> int:
    """This process's rank in torch's world (its dump's name)."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - torch half torn down at exit
        pass
    return int(os.environ.get("RANK", "0") or 0)


def dump(why: str = "asked for") -> str | None:
    """Write this process's flight recorder dump now; its path (None: the recorder
    is off, or the file could not be written)."""
    rec = recorder()
    return rec.write(world_rank(), why) if rec is not None else None


def dump_for_failure(why: str) -> str | None:
    """A failure here or elsewhere: dump, if dumps on failure are on, once per second
    at most (several groups may learn of one failure)."""
    rec = recorder()
    if rec is None or not dump_on_failure():
        return None
    if rec.dumped_at is not None and time.monotonic() - rec.dumped_at < 1.0:
        return None
    rec.dumped_at = time.monotonic()  # set by failure dumps only: one asked for never skips one
    return rec.write(world_rank(), why)


def _install_signal() -> None:
    from ringcomm import settings

    name = settings.get("RINGCOMM_FR_SIGNAL")
    if name.lower() in ("off", "none") or threading.current_thread() is not threading.main_thread():
        return
    sig = getattr(signal, name, None)
    if sig is None:
        raise ValueError(f"ringcomm: RINGCOMM_FR_SIGNAL={name!r} is not a signal")
    if signal.getsignal(sig) not in (signal.SIG_DFL, None):
        return  # the program handles it: leave it so
    def handler(*_: Any) -> None:
        # on a thread of its own: the handler runs between two bytecodes of the main
        # thread, which may hold a lock the dump needs; the main thread may be stuck
        # in a C call too (then the signal waits for it: Python runs handlers only
        # between bytecodes)
        threading.Thread(target=dump, args=(f"signal {name}",), daemon=True,
                         name="ringcomm-flight-dump").start()

    signal.signal(sig, handler)
