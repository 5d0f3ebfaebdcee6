"""Lanes: what runs a group's calls on one device. A lane is a channel (the MPI
transport for CPU tensors, an NCCL communicator for a CUDA device) and the
engine that drives it (a progress thread for MPI, a stream and a watchdog for
NCCL). :class:`Lanes` holds a group's lanes and creates NCCL ones on first use.

A group may have several channels per device (``Options(num_channels=K)``):
K communicators, each with its own engine. Successive collectives take them in
turn (the group's call number modulo K, the same on every rank), so up to K
collectives progress at once instead of queueing behind one another, as the
round-robin process groups of the DDP paper (section 4.2.2) do.

What torch promises of one group still holds there: collectives on the same
tensors run in issue order (:class:`TensorOrder`). A collective whose tensors
an unfinished one on another channel also uses waits for it first (on a GPU its
stream waits for that one's end event; on the CPU its engine waits), so only
collectives on different tensors overlap.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ringcomm.mismatch import CollectiveMismatch
from ringcomm.trace import flight
from ringcomm.transport import (Link, Transport, TransportAborted, TransportPeerFailed,
                                TransportPeerLost)

#: how many reports (a mismatch, a rank that left) the group's store holds: a long wait
#: reads this one counter, and the reports only once it is not zero
_NEWS_KEY = "ringcomm/news"
#: where the group's first failure is reported ("rank\ntext", the group's store): a
#: collective that failed on a rank (a timeout, a mismatch), or a rank that left
#: with a non-zero code; every other rank fails on reading it
_FAILURE_KEY = "ringcomm/failure"
#: ``/<rank>``: how that rank left ("code\ntext"); ``/<rank>/seen``: how many peers
#: have read it (:mod:`ringcomm.front.departure`)
_LEFT_KEY = "ringcomm/left"
#: a rank that ended normally may have sent its last messages just before: a wait on
#: it fails only once it stayed unfinished this long after the notice was read
LEFT_GRACE_S = 0.5


class _Turn(threading.local):
    k = 0


class Lane:
    """One device's channel and engine."""

    __slots__ = ("tp", "engine", "key", "token", "on_stream", "channel")

    def __init__(self, tp: Link, engine: Any, on_stream: bool, channel: int = 0):
        self.tp = tp
        self.engine = engine
        self.key = str(tp.device)
        #: which of the group's channels on this device (``Options.num_channels``)
        self.channel = channel
        #: the barrier's one byte
        self.token = torch.zeros(1, dtype=torch.uint8, device=tp.device)
        #: collectives are enqueued on a stream (NCCL), not run to completion (MPI)
        self.on_stream = on_stream


class TensorOrder:
    """Issue order on the same tensors across a group's channels.

    Remembers, per tensor storage, the last collective that used it and on which
    lane; :meth:`after_earlier` gives the unfinished ones on other lanes that a new
    collective must follow. Storage addresses can be reused once freed: that only
    orders a collective after an unrelated one, never the other way round.
    """

    #: storages remembered before the finished collectives are forgotten
    LIMIT = 4096

    def __init__(self) -> None:
        self._last: dict[int, tuple[Lane, Any]] = {}

    @staticmethod
    def _keys(tensors: Any) -> list[int]:
        # the storage's start, without making a storage object (views of one buffer
        # share it, whatever their offsets)
        return [t.data_ptr() - t.storage_offset() * t.element_size()
                for t in tensors if t.numel()]

    def after_earlier(self, lane: Lane, tensors: Any) -> tuple[list[int], list]:
        """The storage keys of ``tensors`` and the Works on other lanes, not yet
        complete, that last used any of them."""
        keys = self._keys(tensors)
        deps = []
        last = self._last
        for k in keys:
            prev = last.get(k)
            if prev is not None and prev[0] is not lane and not prev[1].is_completed() \
                    and prev[1] not in deps:
                deps.append(prev[1])
        return keys, deps

    def issued(self, lane: Lane, keys: list[int], work: Any) -> None:
        """``work`` on ``lane`` is now the last user of the storages ``keys``."""
        entry = (lane, work)
        last = self._last
        for k in keys:
            last[k] = entry
        if len(last) > self.LIMIT:
            # in place, from a snapshot: another thread may issue meanwhile, and an entry
            # it has just replaced stays
            for k, v in list(last.items()):
                if v[1].is_completed() and last.get(k) is v:
                    del last[k]


class Ordered:
    """A prepared call that first waits for the Works it must follow (on a stream:
    the stream waits; on the CPU: the engine's thread waits)."""

    __slots__ = ("call", "name", "lane", "blocking", "deps")

    def __init__(self, call: Any, deps: list):
        self.call, self.name, self.lane, self.deps = call, call.name, call.lane, deps
        self.blocking = getattr(call, "blocking", False)

    def execute(self, *args: Any) -> Any:
        for work in self.deps:
            work.wait()
        self.deps = []
        return self.call.execute(*args)

    def touched(self, args: Any) -> list:
        return self.call.touched(args)


class Lanes:
    """A group's lanes: the CPU lane (if MPI loaded) and one NCCL lane per device,
    plus two-rank NCCL lanes for send/recv, one per peer and direction.

    Args:
        rank, size: this rank and the group size.
        cpu: the CPU lane, or None where MPI could not be loaded (``cpu_error`` says why).
        store: the group's c10d store; NCCL communicators exchange their ids through it.
        timeout_s: the group's timeout (NCCL set-up waits at most this long).
        describe: the group's name for error messages.
        nccl: ``cupy.cuda.nccl`` or a stand-in (default: loaded on first use).
        nccl_type: tensors of this device type run over NCCL.
    """

    def __init__(self, rank: int, size: int, cpu: Lane | list[Lane] | None, *, store: Any,
                 timeout_s: float, describe: Callable[[], str], cpu_error: str | None = None,
                 nccl: Any = None, nccl_type: str = "cuda", channels: int = 1):
        self.rank, self.size = rank, size
        #: the CPU lanes, one per channel (empty where MPI could not be loaded)
        self.cpus: list[Lane] = [] if cpu is None else cpu if isinstance(cpu, list) else [cpu]
        if self.cpus and len(self.cpus) != channels:
            raise ValueError(f"ringcomm: {len(self.cpus)} CPU lanes for {channels} channels")
        self.channels = channels
        #: issue order on the same tensors across channels (None for one channel)
        self.order: TensorOrder | None = TensorOrder() if channels > 1 else None
        for lane in self.cpus:
            # a failed collective leaves the ranks in an unknown state: the whole group
            # is unusable, whichever channel it ran on
            lane.engine.on_failure = self.mark_broken
            if store is not None and isinstance(lane.tp, Transport):
                lane.tp.peer_failure = self._peer_failure
        # the channel the next collective runs on (see :meth:`turn_to`), per thread: a
        # future callback's collective takes its own lane's (ringcomm.runtime.engine)
        self._turn = _Turn()
        self.nccl_type = nccl_type
        self._cpu_error = cpu_error
        self._store = store
        self._timeout_s = timeout_s
        self._describe = describe
        self._nccl_lib = nccl
        #: the NCCL device the group is bound to (init_process_group(device_id=...)),
        #: the only one it then serves, as torch's NCCL backend
        self.bound: torch.device | None = None
        #: why the group's lanes are gone (shut down or aborted); None while usable
        self.closed: str | None = None
        self._devices: dict[str, list[Lane]] = {}
        self._pairs: dict[tuple, Lane] = {}
        self._nccl_count = 0
        self._lock = threading.Lock()
        #: peers whose notice of leaving (code 0) was first read, and when
        self._left_read: dict[int, float] = {}
        self._left_told: set[int] = set()
        #: the store's news counter at the last look_for_news
        self._news_read = 0
        #: a failure elsewhere in the group was read: this rank reports none of its own
        self._heard = False
        #: the store failed a request (its host ended): it is not asked again
        self._store_gone = False

    @property
    def cpu(self) -> Lane | None:
        """The CPU lane of channel 0 (point-to-point messages use it)."""
        return self.cpus[0] if self.cpus else None

    @property
    def turn(self) -> int:
        """The channel this thread's next collective runs on."""
        return self._turn.k

    def turn_to(self, call: int) -> None:
        """Run this thread's next collective on channel ``call mod K``: every rank
        numbers its calls alike, so every rank puts the same collective on the same
        channel."""
        self._turn.k = call % self.channels

    def nested_lane(self) -> Lane | None:
        """The CPU lane whose progress thread is calling (a future callback issuing a
        collective), else None."""
        for lane in self.cpus:
            if lane.engine.on_progress_thread():
                return lane
        return None

    def for_tensor(self, t: torch.Tensor, op: str, channel: int | None = None) -> Lane:
        """The lane that runs a call on ``t``'s device (created on first use): the
        current turn's channel, or ``channel``.

        Raises:
            ValueError: the device is not supported, or the library it needs (MPI for
                CPU tensors, CuPy with NCCL for CUDA tensors) is missing.
        """
        return self.for_device(t.device, op, channel)

    def for_device(self, dev: torch.device, op: str, channel: int | None = None) -> Lane:
        k = self.turn if channel is None else channel
        if dev.type == self.nccl_type:
            lanes = self._devices.get(str(dev))
            return (lanes if lanes is not None else self._nccl_lanes(dev, op))[k]
        if dev.type == "cpu":
            if not self.cpus:
                raise ValueError(f"ringcomm {op}: CPU tensors run over MPI, which could not be "
                                 f"loaded here ({self._cpu_error}); move the tensors to a CUDA "
                                 "device, or install MPI (pip install mpich)")
            return self.cpus[k]
        raise ValueError(f"ringcomm {op}: tensors on {dev} are not supported; ringcomm runs "
                         f"CPU tensors over MPI and {self.nccl_type} tensors over NCCL")

    def siblings(self, lane: Lane) -> list[Lane]:
        """The other channels' lanes of ``lane``'s device."""
        group = self.cpus if lane in self.cpus else self._devices.get(lane.key, [])
        return [other for other in group if other is not lane]

    def for_barrier(self, opts: Any) -> Lane:
        """The barrier's lane: the device torch names (``device_ids``), else MPI,
        else the first device this group used, else the current CUDA device."""
        dev = getattr(opts, "device", None)
        ids = list(getattr(opts, "device_ids", None) or [])
        if (ids and (dev is None or dev.type == "cpu") and self.nccl_type == "cuda"
                and (not self.cpus or self._cuda_usable())):
            # as gloo, a CPU-only process reads device_ids as no device at all
            # (Accelerate passes them on every barrier)
            dev = torch.device("cuda", ids[0])
        if isinstance(dev, torch.device) and dev.type == self.nccl_type:
            if dev.type == "cuda" and dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            return self.for_device(dev, "barrier")
        if self.cpus:
            return self.cpus[self.turn]
        if self._devices:  # no MPI: the first device this group used
            return next(iter(self._devices.values()))[self.turn]
        if self.nccl_type == "cuda" and torch.cuda.is_available():
            return self.for_device(torch.device("cuda", torch.cuda.current_device()), "barrier")
        return self.for_device(torch.device("cpu"), "barrier")

    def _cuda_usable(self) -> bool:
        """CUDA devices and an NCCL library to run them with are both here."""
        if self._nccl_lib is not None:
            return True
        if not torch.cuda.is_available():
            return False
        from ringcomm.transport import nccl
        try:
            self._nccl_lib = nccl.load()
        except nccl.NcclUnavailable:
            return False
        return True

    def set_timeout(self, timeout_s: float) -> None:
        """NCCL communicators made from now on wait at most ``timeout_s`` for peers."""
        self._timeout_s = timeout_s

    def error(self) -> BaseException | None:
        """The failure that made the group unusable, if one did."""
        for lane in [*self.cpus, *self._nccl()]:
            if lane.engine.error is not None:
                return lane.engine.error
        return None

    def mark_broken(self, err: BaseException, report: bool = True) -> None:
        """Every lane of the group refuses later collectives with ``err``. A failure
        found here (a timeout, a mismatch; not another rank's report, nor a shutdown
        or abort of this rank's own) is reported to the group's other ranks: those that
        wait for this one learn of it at their next look
        (:meth:`ringcomm.transport.mpi.MPITransport.wait`), not at their deadline, and
        the others within ``RINGCOMM_WATCH_S`` (:mod:`ringcomm.front.watch`), so a
        late rank's call fails too."""
        for lane in [*self.cpus, *self._nccl()]:
            lane.engine.mark_broken(err)
        if self.closed is not None:
            return  # this rank's own shutdown or abort, or the process's end
        if report and self._store is not None and not self._heard:
            cause, mismatch = err, None
            # heard from a peer, unless this rank saw the peer end (it tells the others)
            while cause is not None and (not isinstance(
                    cause, (TransportPeerFailed, TransportAborted))
                    or isinstance(cause, TransportPeerLost)):
                if isinstance(cause, CollectiveMismatch):
                    mismatch = cause
                cause = cause.__cause__
            if cause is None:
                self._report(f"{mismatch} (found by rank {self.rank})" if mismatch is not None
                             else str(err))
        # every rank of the group dumps, once the others can learn of it
        flight.dump_for_failure(f"{self._describe()} failed: {err}"[:500])

    def _report(self, text: str) -> None:
        """Make ``text`` the group's failure unless one is reported already."""
        try:
            self._store.compare_set(_FAILURE_KEY, "", f"{self.rank}\n{text}")
            self._store.add(_NEWS_KEY, 1)
        except Exception:  # noqa: BLE001  (a store that is gone: the peers time out)
            pass

    def _reported(self, ack: bool = True) -> tuple[int, str] | None:
        """The group's reported failure: (the reporting rank, its text); None if none.
        A reader acknowledges a rank's notice of leaving (:meth:`left_seen_by_all`),
        here or with :meth:`_ack`."""
        store = self._store
        if not store.check([_FAILURE_KEY]):
            return None
        who, text = store.get(_FAILURE_KEY).decode(errors="replace").split("\n", 1)
        if ack:
            self._ack(int(who))
        return int(who), text

    def _ack(self, rank: int) -> None:
        """Tell ``rank``, leaving, that this rank has read why (it may end the job);
        once, whichever thread reads it first."""
        with self._lock:
            if rank == self.rank or rank in self._left_told:
                return
            self._left_told.add(rank)
        self._store.add(f"{_LEFT_KEY}/{rank}/seen", 1)

    def look_for_news(self) -> str | None:
        """Called every ``RINGCOMM_WATCH_S`` (:mod:`ringcomm.front.watch`): if another
        rank reported a failure since the last look, break the group with it and
        return its text (the group's later collectives fail at once, as on the rank
        that found it); else None. One store read when nothing happened."""
        if (self._store is None or self._store_gone or self.closed is not None
                or self.error() is not None):
            return None
        try:
            news = self._store.add(_NEWS_KEY, 0)
            if news == self._news_read:
                return None
            self._news_read = news
            reported = self._reported(ack=False)
        except Exception:  # noqa: BLE001  (a store that is gone tells nothing)
            self._store_gone = True  # and is not asked again (each try prints torch's warning)
            return None
        if reported is None or reported[0] == self.rank:
            return None
        who, text = reported
        self._heard = True  # the group's failure is known: this rank reports none
        err = dist.DistBackendError(f"ringcomm: {self._describe()}, rank {self.rank}: a "
                                    f"failure elsewhere in the group: {text}")
        for lane in self._nccl():
            # its calls in flight can never complete: abort the communicator, failing them
            fail = getattr(lane.engine, "fail_from_elsewhere", None)
            if fail is not None:
                fail(err)
        self.mark_broken(err, report=False)
        try:  # after the flight recorder's dump: a rank that left may end the job now
            self._ack(who)
        except Exception:  # noqa: BLE001  (a store that is gone: nobody waits for it)
            pass
        return text

    def _peer_failure(self, peers: Iterable[int] = (), gone: bool = False) -> str | None:
        """What a rank of the group reported (:meth:`mark_broken`), or how one of
        ``peers`` (those a wait needs) left (:meth:`announce_left`), if any; ``gone``:
        the caller saw their process end (no grace for a normal end then)."""
        if self._store_gone:
            return None
        try:
            store = self._store
            if not store.add(_NEWS_KEY, 0):  # the common case: one round trip
                return None
            reported = self._reported()
            if reported is not None:
                return reported[1]
            for peer in peers:
                key = f"{_LEFT_KEY}/{peer}"
                if not store.check([key]):
                    continue
                code, text = store.get(key).decode(errors="replace").split("\n", 1)
                if code == "0" and not gone:  # its last messages may still be on their way
                    first = self._left_read.setdefault(peer, time.monotonic())
                    if time.monotonic() - first < LEFT_GRACE_S:
                        continue
                self._ack(peer)
                return f"{text}, while rank {self.rank} waited for it"
        except Exception:  # noqa: BLE001  (a store that is gone tells nothing)
            self._store_gone = True  # and is not asked again (each try prints torch's warning)
        return None

    def announce_left(self, who: str, how: str, code: int) -> None:
        """This process (``who``: this rank, its pid and host) is leaving, ``how``
        (:mod:`ringcomm.front.departure`): tell the group's ranks through its store
        and, for a failure, through the shared memory of the peers on this host (read
        at once, with no grace)."""
        if self._store is not None and not self._store_gone:
            try:
                self._store.set(f"{_LEFT_KEY}/{self.rank}", f"{code}\n{who} {how}")
                self._store.add(_NEWS_KEY, 1)
            except Exception:  # noqa: BLE001  (a store that is gone: nothing to tell)
                pass
            if code:  # a failure of the group's: every rank learns it (look_for_news)
                self._report(f"{who} {how}")
        if code:
            for lane in self.cpus:
                tell = getattr(lane.tp, "tell_peers", None)
                if tell is not None:  # its readers name the rank and host themselves
                    tell(how)

    def waiting_for(self) -> str | None:
        """The peers the group's CPU lanes last waited for (the flight recorder's
        words for a call still open at a dump)."""
        texts = [t for t in (getattr(lane.tp, "waiting_for", lambda: None)()
                             for lane in self.cpus) if t]
        return "; ".join(texts) or None

    def left_seen_by_all(self) -> bool:
        """Every other rank of the group has read this rank's notice of leaving."""
        try:
            return self._store.add(f"{_LEFT_KEY}/{self.rank}/seen", 0) >= self.size - 1
        except Exception:  # noqa: BLE001  (a store that is gone: nobody will read it)
            return True

    def pair(self, device: torch.device, peer: int, op: str, send: bool) -> tuple[Lane, int]:
        """The two-rank NCCL communicator (and its own stream) that carries this rank's
        ``dist.send`` calls to ``peer`` (``send``) or its ``dist.recv`` calls from
        ``peer`` on ``device``; the first message between the two ranks makes both
        directions' communicators, by the two ranks alone. Returns the lane and the
        peer's rank in it.

        One communicator per direction, unlike torch's NCCL backend (one per pair):
        torch groups a ``batch_isend_irecv`` into one NCCL group only for its own
        C++ groups, so a Python group gets each send and receive separately. On one
        communicator a symmetric exchange (both ranks: send, then receive, as every
        pipeline schedule's step is) would queue each rank's receive behind its send,
        and past NCCL's buffering each send waits for a receive that cannot start.
        With a communicator and a stream per direction, a rank's sends never wait
        behind its receives, and messages of one direction still match in issue
        order (``tag`` is ignored, as in torch's NCCL backend).

        Raises:
            ValueError: a device other than the one the group is bound to, or CuPy
                with NCCL missing.
            DistBackendError: the group was shut down or aborted.
        """
        self._refuse_if_closed(device, op)
        self._refuse_off_bound(device, op)
        lib = self._library(op)
        key = (str(device), peer, send)
        with self._lock:
            lane = self._pairs.get(key)
            if lane is None:
                # Both directions at once, the lower rank's sending one first: making a
                # communicator waits for the other rank, so if each rank made the one
                # its first call needs (rank 0 sending, rank 1 sending too), each would
                # wait at another. Both ends count the pair's communicators made so far
                # (two per device) alike.
                n = sum(1 for k in self._pairs if k[1] == peer) // 2
                lo, hi = min(self.rank, peer), max(self.rank, peer)
                for src, dst in ((lo, hi), (hi, lo)):
                    out = src == self.rank
                    self._pairs[(str(device), peer, out)] = self._new_nccl_lane(
                        lib, device, f"ringcomm/nccl/p2p/{src}-{dst}/{n}", 0 if out else 1, 2)
                lane = self._pairs[key]
        return lane, 1 if send else 0

    def pair_peers(self) -> list[tuple[int, str]]:
        """The peers this rank has a communicator with for send/recv, and which way
        (``"send"`` or ``"recv"``), one entry per device."""
        return sorted((k[1], "send" if k[2] else "recv") for k in self._pairs)

    def _library(self, op: str) -> Any:
        if self._nccl_lib is None:
            from ringcomm.transport import nccl
            try:
                self._nccl_lib = nccl.load()
            except nccl.NcclUnavailable as e:
                raise ValueError(f"ringcomm {op}: {e}") from None
        return self._nccl_lib

    def _nccl_lanes(self, device: torch.device, op: str) -> list[Lane]:
        """This group's NCCL communicators on ``device``, one per channel, created now:
        every rank creates its k-th at the same call, so the k-th communicators of all
        ranks are one."""
        self._refuse_if_closed(device, op)
        self._refuse_off_bound(device, op)
        lib = self._library(op)
        with self._lock:
            lanes = self._devices.get(str(device))
            if lanes is None:
                lanes = []
                for k in range(self.channels):
                    lane = self._new_nccl_lane(lib, device, f"ringcomm/nccl/{self._nccl_count}",
                                               self.rank, self.size)
                    lane.channel = k
                    lane.engine.on_failure = self.mark_broken
                    lanes.append(lane)
                    self._nccl_count += 1
                self._devices[str(device)] = lanes
        return lanes

    def _refuse_off_bound(self, device: torch.device, op: str) -> None:
        bound = self.bound
        if bound is not None and (device.type, device.index or 0) != (bound.type, bound.index or 0):
            raise ValueError(f"ringcomm {op}: {self._describe()} is bound to {self.bound} "
                             f"(init_process_group(device_id=...)), and a tensor on {device} "
                             f"was given; move it to {self.bound}, or use a group that is "
                             "not bound to a device")

    def _refuse_if_closed(self, device: torch.device, op: str) -> None:
        if self.closed is not None:
            raise dist.DistBackendError(f"ringcomm {op}: {self._describe()} on {device} has "
                                        f"been {self.closed}; its communicators are gone")

    def _new_nccl_lane(self, lib: Any, device: torch.device, prefix: str, rank: int,
                       size: int) -> Lane:
        from ringcomm.runtime.streams import StreamEngine, streams_for
        from ringcomm.transport.nccl import NcclLink, connect

        if self._store is None:
            raise ValueError("ringcomm: this group has no store to set up NCCL communicators")
        # a stand-in for NCCL brings the streams that go with it (FakeNccl's keep CUDA's
        # rules on CPU tensors)
        streams = getattr(lib, "ringcomm_streams", streams_for)(device)
        comm = connect(lib, self._store, prefix, rank, size, self._timeout_s,
                       streams.device_context)
        tp = NcclLink(lib, comm, rank, size, device, streams.handle)
        what = self._describe() + ("" if size == self.size else f" (pair {prefix})")
        engine = StreamEngine(tp, streams, lambda: what)
        return Lane(tp, engine, True)

    def close(self, reason: str, nccl_wait_s: float) -> bool:
        """End every lane: the CPU lane's running collective is interrupted with
        ``reason``; NCCL lanes are destroyed once idle (aborted after ``nccl_wait_s``).
        True when no CPU collective runs any more (one stuck in MPI past 5 s may)."""
        idle = True
        self.closed = "aborted" if nccl_wait_s == 0 else "shut down"
        for cpu in self.cpus:
            idle = cpu.engine.shutdown(wait_s=5.0, interrupt=reason) and idle
            tp = cpu.tp
            assert isinstance(tp, Transport)
            tp.close()
        for lane in self._take_nccl():
            lane.engine.close(nccl_wait_s)
        return idle

    def stop_threads(self, wait_s: float) -> None:
        """At interpreter exit: stop the progress thread; NCCL communicators are
        destroyed if idle, else aborted (left to CuPy's finalizer, a destroy could
        wait for work that never finishes)."""
        if self.closed is None:  # the process's end: no failure of the group's to report
            self.closed = "the process is ending"
        for cpu in self.cpus:
            cpu.engine.shutdown(wait_s=wait_s)
        for lane in self._nccl():
            lane.engine.close(0.0)

    def _nccl(self) -> list[Lane]:
        # pair() and _nccl_lanes() add to the dicts from other threads (holding _lock
        # while a communicator connects): list() copies each at once, under the GIL
        devices, pairs = list(self._devices.values()), list(self._pairs.values())
        return [*(lane for lanes in devices for lane in lanes), *pairs]

    def _take_nccl(self) -> list[Lane]:
        with self._lock:
            lanes = self._nccl()
            self._devices, self._pairs = {}, {}
        return lanes
