"""The CUDA path where NCCL and CUDA are unforgiving, over a stand-in that is not
kinder than they are (:mod:`ringcomm.testing.fake_nccl`): groups closed on every
path, memory recorded on the stream that uses it, no abort under a thread inside
NCCL, AVG as NCCL computes it, torch's Work semantics, and NCCL errors that say why.
Each test here failed before the fix it guards."""
from __future__ import annotations

import math
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ringcomm.front.process_group import ProcessGroupRingcomm
from ringcomm.runtime.streams import StreamWork
from ringcomm.testing import FakeNccl, nccl_groups
from ringcomm.testing.fake_nccl import FakeNcclError
from ringcomm.transport import nccl


def _group(rank: int, size: int, store, lib: FakeNccl, name: str) -> ProcessGroupRingcomm:
    return ProcessGroupRingcomm(rank, size, None, timedelta(seconds=10), None, name,
                                store=store, cpu_error="not used", nccl=lib,
                                nccl_device_type="cpu")


# -- 1. a group is closed however its calls end ------------------------------------------

@pytest.mark.parametrize("algorithm,method,call", [
    ("ring", "send", lambda pg, t: pg.allreduce([t])),
    ("native", "broadcast",  # uneven allgather: NCCL's own broadcasts, one group
     lambda pg, t: pg.allgather([[torch.empty(r + 1) for r in range(2)]],
                                [torch.ones(pg.rank() + 1)])),
])
def test_a_call_failing_inside_a_group_leaves_no_group_open(algorithm, method, call):
    lib = FakeNccl(timeout_s=10)
    second_store = dist.HashStore()

    def body(pg):
        me = pg.rank()
        coll = "allreduce" if method == "send" else "allgather"
        pg.set_algorithm(coll, algorithm)
        call(pg, torch.ones(8)).wait()  # both ranks' communicators made
        second = _group(me, 2, second_store, lib, "second")
        second.set_algorithm("allreduce", "ring")
        second.allreduce([torch.ones(2)]).wait()
        failed = None
        if me == 0:  # fails as it is issued, before anything is sent: rank 1 is not needed
            lib.fail_next(method, rank=0)
            with pytest.raises(dist.DistBackendError) as failed:
                call(pg, torch.ones(8)).wait()
        depth = lib.group_depth()
        # the same thread, another group: its calls must run, not queue in an open group
        u = torch.full((6,), float(me + 1))
        second.allreduce([u]).wait()
        second.shutdown()
        return failed and str(failed.value), depth, u

    results = nccl_groups(2, body, lib=lib, timeout_s=30)
    assert "NCCL_ERROR_SYSTEM_ERROR" in results[0][0]
    assert [depth for _, depth, _ in results] == [0, 0]
    for _, _, u in results:
        assert torch.equal(u, torch.full((6,), 3.0))


def test_the_stand_in_holds_a_groups_error_to_its_outermost_end():
    lib = FakeNccl()
    comm = lib.NcclCommunicator(1, lib.get_unique_id(), 0)
    comm.abort()
    lib.groupStart()
    lib.groupStart()
    with pytest.raises(FakeNcclError, match="INVALID_ARGUMENT"):
        comm.send(0, 0, 1, 0, 0)
    lib.groupEnd()  # inner: nothing yet
    with pytest.raises(FakeNcclError, match="INVALID_ARGUMENT"):
        lib.groupEnd()
    assert lib.group_depth() == 0
    assert "aborted" in lib.last_error()


# -- 2. memory a call owns is recorded on the stream it is used on ---------------------

@pytest.mark.parametrize("what", ["allreduce_coalesced", "reduce", "reduce_scatter"])
def test_buffers_a_call_owns_are_recorded_on_its_stream(what):
    def body(pg):
        me, p = pg.rank(), pg.size()
        if what == "allreduce_coalesced":
            a, b = torch.ones(5), torch.ones(3, dtype=torch.int64)
            pg.allreduce_coalesced([a, b]).wait()
            return a, torch.full((5,), 2.0)
        if what == "reduce":
            o = dist.ReduceOptions()
            o.rootRank = 0
            t = torch.full((7,), float(me + 1))
            pg.reduce([t], o).wait()
            return t, torch.full((7,), 3.0 if me == 0 else float(me + 1))
        out = torch.empty(4)
        pg._reduce_scatter_base(out, torch.arange(4.0 * p), dist.ReduceScatterOptions())
        return out, torch.arange(4.0 * p).view(p, -1)[me] * p

    for got, want in nccl_groups(2, body):
        assert torch.equal(got, want)


def test_the_stand_in_refuses_memory_not_recorded_on_the_stream():
    lib = FakeNccl()
    streams = lib.ringcomm_streams(torch.device("cpu"))
    comm = lib.NcclCommunicator(1, lib.get_unique_id(), 0)
    kept, other = torch.ones(4), torch.ones(4)
    with streams.on_stream():  # recorded: fine
        comm.allReduce(kept.data_ptr(), kept.data_ptr(), 4, 7, 0, streams.handle)
        streams.keep_alive([kept])
    with pytest.raises(RuntimeError, match="not recorded on the collective's stream"):
        with streams.on_stream():
            comm.allReduce(other.data_ptr(), other.data_ptr(), 4, 7, 0, streams.handle)
            streams.keep_alive([kept])


# -- 3. no abort under a thread inside NCCL ------------------------------------------------

def test_closing_a_group_waits_for_the_thread_inside_nccl():
    lib = FakeNccl()

    def body(pg):
        pg.set_algorithm("allreduce", "ring")
        pg.allreduce([torch.ones(4)]).wait()
        t = torch.full((4,), float(pg.rank() + 1))
        if pg.rank() == 1:
            time.sleep(1.0)  # rank 0 waits inside NCCL's group meanwhile
            pg.allreduce([t]).wait()
            return t
        closer = threading.Timer(0.3, pg.shutdown)  # another thread of rank 0
        closer.start()
        pg.allreduce([t]).wait()
        closer.join()
        return t

    results = nccl_groups(2, body, lib=lib)
    assert lib.unsafe == []
    assert all(torch.equal(t, torch.full((4,), 3.0)) for t in results)
    assert lib.calls["destroy"] >= 1


def _pair_of_comms(lib: FakeNccl) -> list:
    """Both ranks' communicators of one two-rank FakeNccl communicator (made on two
    threads: each creation blocks until the other rank's)."""
    uid, comms = lib.get_unique_id(), [None, None]

    def make(r: int) -> None:
        comms[r] = lib.NcclCommunicator(2, uid, r)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(comms), "the communicator was not made"
    return comms


def test_the_stand_in_records_an_abort_under_a_thread_inside_nccl():
    # a destroy blocks while the communicator's work has not run (rank 1 never
    # receives); an abort from another thread then frees it under that thread
    lib = FakeNccl(timeout_s=5)
    handle, _ = lib.new_stream("test")
    c0, _ = _pair_of_comms(lib)
    data = torch.ones(4)
    c0.send(data.data_ptr(), 16, 1, 1, handle)
    closer = threading.Thread(target=c0.destroy, daemon=True)
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive(), "destroy() returned with the communicator's send not run"
    c0.abort()
    closer.join(5)
    assert not closer.is_alive()
    assert any("aborted while 1 other thread" in u for u in lib.unsafe), lib.unsafe


def test_torch_ops_on_a_simulated_stream_run_later_and_check_their_arguments_now():
    from ringcomm.testing.sim_stream import Deferred, SimStream

    stream = SimStream("test", 5.0)
    gate = threading.Event()
    stream.enqueue(lambda: gate.wait(5), "a kernel still running")
    a = torch.ones(4)
    with Deferred(stream):
        a.add_(1)                      # in place: queued behind the running kernel
        doubled = a * 2                # functional: its output allocated now
        with pytest.raises(RuntimeError, match="broadcast"):
            a.add_(torch.ones(3))      # the host refuses bad arguments as it issues
    assert torch.equal(a, torch.ones(4)), "an op ran before the stream got to it"
    gate.set()
    with Deferred(stream):
        total = a.sum().item()         # the host reads: it waits for the stream
    assert total == 8.0 and torch.equal(doubled, torch.full((4,), 4.0))


def test_the_stand_in_blocks_as_nccl_does():
    lib = FakeNccl(timeout_s=0.5)
    # creating a communicator waits for every rank of it
    with pytest.raises(RuntimeError, match="only 1 of 2 ranks joined"):
        lib.NcclCommunicator(2, lib.get_unique_id(), 0)
    lib.timeout_s = 5
    handle, stream = lib.new_stream("test")
    c0, c1 = _pair_of_comms(lib)
    src, dst = torch.full((4,), 3.0), torch.zeros(4)
    c0.send(src.data_ptr(), 16, 1, 1, handle)  # enqueued: returns before rank 1 receives
    closer = threading.Thread(target=c0.destroy, daemon=True)
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive(), "destroy() returned before the communicator's work ran"
    other, _ = lib.new_stream("test-1")
    c1.recv(dst.data_ptr(), 16, 1, 0, other)
    closer.join(5)
    assert not closer.is_alive() and lib.unsafe == []
    stream.synchronize("the test")
    assert torch.equal(dst, src)
    # a stream handle CUDA never gave out is refused, as CUDA refuses it
    with pytest.raises(FakeNcclError, match="UNHANDLED_CUDA_ERROR"):
        c1.send(src.data_ptr(), 16, 1, 0, 0xBAD)
    assert "not a stream of this process" in lib.last_error()


# -- 4. AVG as NCCL computes it ----------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["ring", "tree", "native"])
def test_avg_on_an_nccl_lane_premultiplies_as_ncclavg_does(algorithm):
    big = torch.full((64,), 40000.0, dtype=torch.float16)  # their sum overflows fp16
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(64, generator=g).to(torch.bfloat16) for _ in range(2)]

    def body(pg):
        pg.set_algorithm("allreduce", algorithm)
        out = []
        for t in (big.clone(), xs[pg.rank()].clone()):
            pg.allreduce([t], _avg()).wait()
            out.append(t)
        o = dist.ReduceOptions()
        o.reduceOp, o.rootRank = dist.ReduceOp.AVG, 0
        r = big.clone()
        pg.reduce([r], o).wait()
        return out + [r]

    for rank, (overflowing, mixed, reduced) in enumerate(nccl_groups(2, body)):
        assert torch.equal(overflowing, big), overflowing[:4]  # 20000 + 20000, not inf / 2
        assert torch.equal(mixed, xs[0] * 0.5 + xs[1] * 0.5)
        if rank == 0:
            assert torch.equal(reduced, big)


def test_avg_on_the_nccl_stand_in_itself_premultiplies():
    lib = FakeNccl()
    comm = lib.NcclCommunicator(1, lib.get_unique_id(), 0)
    from ringcomm.testing.fake_nccl import _fold

    parts = [torch.tensor([40000.0], dtype=torch.float16)] * 2
    assert torch.equal(_fold(parts, 4), parts[0])
    assert torch.equal(_fold([torch.tensor([7]), torch.tensor([-2])], 4), torch.tensor([2]))
    comm.destroy()


def _avg() -> dist.AllreduceOptions:
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.AVG
    return o


# -- 6. torch's Work semantics ---------------------------------------------------------------

def test_synchronize_orders_the_current_stream_without_blocking_the_cpu():
    class NotYet:
        @staticmethod
        def query() -> bool:
            return False

    waited = []
    streams = SimpleNamespace(wait_on_current=waited.append)
    work = StreamWork("allreduce", SimpleNamespace(streams=streams), NotYet, 0.0, math.inf,
                      [], blocking=False)
    done = threading.Thread(target=work.synchronize, daemon=True)
    done.start()
    done.join(2.0)
    assert not done.is_alive(), "synchronize() blocked the CPU on a collective in flight"
    assert waited == [NotYet]


def _late_allreduce(lib: FakeNccl) -> list:
    """Each rank's allreduce of a 1-element ones tensor on a stand-in whose groups
    take 0.2 s, read as soon as ``wait()`` returned; and whether the Work was
    pending right after it was issued."""
    def body(pg):
        pg.set_algorithm("allreduce", "ring")
        pg.allreduce([torch.ones(1)]).wait()  # communicators made
        t = torch.ones(1)
        work = pg.allreduce([t])
        pending = not work.is_completed()
        work.wait()
        return t.item(), pending

    return nccl_groups(2, body, lib=lib, timeout_s=20)


def test_work_completes_later_on_its_stream_and_wait_orders_the_reader_after_it():
    assert _late_allreduce(FakeNccl(delay_s=0.2)) == [(2.0, True), (2.0, True)]


def test_the_stand_in_catches_a_wait_that_does_not_order_the_reader(monkeypatch):
    # a deliberately wrong engine: Work.wait() that does not make the caller's
    # stream wait for the collective; on a GPU the reader then reads stale memory
    from ringcomm.testing.fake_nccl import FakeStreams

    monkeypatch.setattr(FakeStreams, "wait_on_current", lambda self, event: None)
    assert _late_allreduce(FakeNccl(delay_s=0.2)) == [(1.0, True), (1.0, True)]


# -- 8. NCCL's errors say why ------------------------------------------------------------------

def test_a_failed_communicator_says_what_nccl_said_and_what_it_means():
    lib = FakeNccl(timeout_s=3)
    lib.fail_next("NcclCommunicator", rank=0, status=5,
                  detail="Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 0")

    def body(pg):
        if pg.rank() == 0:
            with pytest.raises(RuntimeError) as e:
                pg.allreduce([torch.ones(2)])
            return str(e.value)
        with pytest.raises(Exception):  # rank 0's communicator never comes
            pg.allreduce([torch.ones(2)]).wait()
        return ""

    msg = nccl_groups(2, body, lib=lib, timeout_s=20)[0]
    for part in ("NCCL_ERROR_INVALID_USAGE", "NCCL said: Duplicate GPU detected",
                 "NCCL_MULTI_RANK_GPU_ENABLE=1", "rank 0 of 2"):
        assert part in msg, (part, msg)


def test_a_failed_collective_says_what_nccl_said():
    lib = FakeNccl()

    def body(pg):
        pg.set_algorithm("allreduce", "ring")
        pg.allreduce([torch.ones(2)]).wait()
        if pg.rank() == 0:
            lib.fail_next("send", rank=0, status=6, detail="socket closed by peer 1")
        else:  # its peer is gone: it hangs, as on a GPU, until its watchdog gives up
            pg.set_timeout(timedelta(seconds=2))
        with pytest.raises(dist.DistBackendError) as e:
            pg.allreduce([torch.ones(2)]).wait()
        return str(e.value)

    msg = nccl_groups(2, body, lib=lib, timeout_s=20)[0]
    assert "NCCL_ERROR_REMOTE_ERROR" in msg and "NCCL said: socket closed by peer 1" in msg
    assert "a remote rank exited" in msg


@pytest.mark.parametrize("status,name,meaning", [
    (8, "NCCL_ERROR_TIMEOUT", "its own time limit"),
    (7, "NCCL_ERROR_IN_PROGRESS", "still in progress"),
])
def test_statuses_cupy_cannot_name_are_explained_like_the_others(status, name, meaning):
    # CuPy's NcclError has no name for 7 and 8: making one raises KeyError(status),
    # which is what the failing call then raises (the stand-in does as CuPy does)
    lib = FakeNccl()

    def body(pg):
        pg.set_algorithm("allreduce", "ring")
        pg.allreduce([torch.ones(2)]).wait()
        if pg.rank() == 0:
            lib.fail_next("send", rank=0, status=status, detail="peer 1 did not answer")
        else:
            pg.set_timeout(timedelta(seconds=2))
        with pytest.raises(dist.DistBackendError) as e:
            pg.allreduce([torch.ones(2)]).wait()
        return e.value

    err = nccl_groups(2, body, lib=lib, timeout_s=20)[0]
    assert isinstance(err.__cause__, KeyError)
    msg = str(err)
    assert f"{name}: " in msg and "NCCL said: peer 1 did not answer" in msg, msg
    assert meaning in msg, msg


def test_an_operation_in_progress_is_not_an_asynchronous_error():
    # ncclCommGetAsyncError answers ncclInProgress while a call has not finished: the
    # watchdog goes on; a real asynchronous error (6) fails the group
    lib = FakeNccl()

    def body(pg):
        pg.allreduce([torch.ones(2)]).wait()
        lib.fail_next("check_async_error", rank=pg.rank(), status=7)
        deadline = time.monotonic() + 10
        while ("check_async_error", pg.rank()) in lib.faults and time.monotonic() < deadline:
            time.sleep(0.01)  # the watchdog looks every 50 ms
        assert ("check_async_error", pg.rank()) not in lib.faults, "the watchdog never looked"
        t = torch.ones(3)
        pg.allreduce([t]).wait()
        return t, pg.lanes.error()

    for t, error in nccl_groups(2, body, lib=lib, timeout_s=20):
        assert torch.equal(t, torch.full((3,), 2.0)) and error is None


def test_errors_that_are_not_nccls_are_left_as_they_are():
    assert nccl.explain(FakeNccl(), ValueError("x")) == ""  # the caller's own text stays
    assert nccl.explain(FakeNccl(), KeyError(8)) == ""  # a KeyError not raised by NcclError
    assert nccl.last_error(object()) == ""  # no NCCL library in this process


# -- 9. point-to-point as pipelines call it ----------------------------------------------

@pytest.mark.parametrize("n", [4, 1 << 16])
def test_a_symmetric_exchange_posted_op_by_op_completes(n):
    # batch_isend_irecv on a Python group: torch posts each operation on its own (it
    # coalesces only C++ groups), so both ranks issue [send][recv] before waiting, as
    # every pipeline step does; on one communicator per pair NCCL matches the two
    # sends against each other and each waits for a receive queued behind it
    def body(pg):
        me = pg.rank()
        peer = 1 - me
        got = torch.zeros(n)
        works = [pg.send([torch.full((n,), float(me + 1))], peer), pg.recv([got], peer)]
        for w in works:
            w.wait()
        # and again the other way round, receives first
        again = torch.zeros(n)
        works = [pg.recv([again], peer), pg.send([torch.full((n,), float(me + 5))], peer)]
        for w in works:
            w.wait()
        return got[0].item(), again[0].item()

    assert nccl_groups(2, body, timeout_s=20) == [(2.0, 6.0), (1.0, 5.0)]


def test_the_stand_in_hangs_a_symmetric_exchange_on_one_communicator_per_pair(monkeypatch):
    # a deliberately wrong ringcomm: one communicator (and stream) for both directions,
    # as torch's NCCL backend has for its own, coalesced, batches; the stand-in hangs
    # as NCCL does, until the watchdog gives up
    from ringcomm.front.lanes import Lanes

    right = Lanes.pair
    monkeypatch.setattr(Lanes, "pair", lambda self, device, peer, op, send: right(
        self, device, peer, op, self.rank < peer))
    lib = FakeNccl(timeout_s=10)

    def body(pg):
        pg.set_timeout(timedelta(seconds=2))
        me = pg.rank()
        got = torch.zeros(4)
        works = [pg.send([torch.full((4,), float(me + 1))], 1 - me), pg.recv([got], 1 - me)]
        with pytest.raises(dist.DistBackendError, match="timed out after 2s"):
            for w in works:
                w.wait()

    nccl_groups(2, body, lib=lib, timeout_s=20)
    assert any("no matching receive" in h for h in lib.hung), lib.hung


def test_a_coalescing_manager_batch_of_sends_and_receives_is_one_work():
    # torch's _coalescing_manager(device=...) asks the group to start and end a batch
    # (torch's NCCL backend makes it one NCCL group); each operation inside is posted
    # at once and the batch's Work waits for all of them
    from ringcomm.testing import nccl_world

    def body(rank):
        peer, got = 1 - rank, torch.zeros(4)
        with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
            dist.isend(torch.full((4,), float(rank + 1)), peer)
            dist.irecv(got, peer)
        cm.wait()
        pg = dist.group.WORLD
        with pytest.raises(ValueError, match="no batch is open"):
            pg._end_coalescing(torch.device("cpu"))
        pg._start_coalescing(torch.device("cpu"))
        with pytest.raises(ValueError, match="already open"):
            pg._start_coalescing(torch.device("cpu"))
        pg._end_coalescing(torch.device("cpu")).wait()  # an empty batch
        # one batch, one device (CPU tensors are this stand-in's "CUDA" ones)
        pg._start_coalescing(torch.device("meta"))
        with pytest.raises(ValueError, match=r"ringcomm send .*a batch of sends and receives "
                                             r"on meta .* was given a tensor on cpu"):
            dist.isend(torch.ones(2), peer)
        pg._end_coalescing(torch.device("meta"))
        return got[0].item()

    assert nccl_world(2, body, timeout_s=20) == [2.0, 1.0]


def test_the_first_message_needs_only_the_two_ranks():
    # torch's NCCL backend makes the pair's communicator alone; a rank that takes no
    # part (rank 2 here) must not be waited for
    lib = FakeNccl(timeout_s=5)
    made = threading.Event()

    def body(pg):
        me = pg.rank()
        got = torch.zeros(3)
        if me == 0:
            pg.send([torch.full((3,), 7.0)], 1).wait()
        elif me == 1:
            pg.recv([got], 0).wait()
            made.set()
        else:
            assert made.wait(10), "ranks 0 and 1 waited for rank 2"
        return got[0].item(), lib.calls["NcclCommunicator"]

    out = nccl_groups(3, body, lib=lib, timeout_s=20)
    assert out[1][0] == 7.0
    # the pair's two communicators (one per direction), each at both its ranks
    assert lib.calls["NcclCommunicator"] == 4


def test_a_send_outside_the_group_is_refused_naming_op_and_device():
    def body(pg):
        with pytest.raises(ValueError, match=r"ringcomm send of a tensor on cpu: peer rank 5 "
                                             r"is out of range for a group of 2"):
            pg.send([torch.ones(2)], 5)
        with pytest.raises(ValueError, match=r"ringcomm recv of a tensor on cpu: rank"):
            pg.recv([torch.ones(2)], pg.rank())

    nccl_groups(2, body)


# -- bad input ---------------------------------------------------------------------------

def test_a_tensor_off_the_bound_device_is_refused_naming_group_device_and_op():
    def body(pg):
        pg.lanes.bound = torch.device("cpu", 1)  # as a group bound to another GPU
        with pytest.raises(ValueError, match=r"ringcomm allreduce: group 'fake-nccl' is bound "
                                             r"to cpu:1 .*a tensor on cpu was given"):
            pg.allreduce([torch.ones(2)])

    nccl_groups(1, body)


def test_a_communicator_used_after_abort_is_refused_naming_group_device_and_op():
    def body(pg):
        pg.allreduce([torch.ones(2)]).wait()
        pg.abort()
        with pytest.raises(dist.DistBackendError,
                           match=r"ringcomm broadcast: group 'fake-nccl' on cpu has been "
                                 r"aborted"):
            pg.broadcast([torch.ones(2)], dist.BroadcastOptions())

    nccl_groups(2, body)


def _report_elsewhere(pg, text: str) -> None:
    """What another rank's failure leaves in the group's store (Lanes.mark_broken)."""
    pg.lanes._store.compare_set("ringcomm/failure", "", f"{1 - pg.rank()}\n{text}")
    pg.lanes._store.add("ringcomm/news", 1)


def test_a_failure_read_from_the_store_fails_the_calls_in_flight_on_nccl():
    """A collective enqueued on a stream when another rank's failure is read (the
    watch thread, ringcomm.front.watch) can never complete: the communicator is
    aborted and the call fails at once, instead of the stream hanging (the watchdog
    stops watching a broken lane)."""
    def body(pg):
        pg.allreduce([torch.ones(4)]).wait()
        if pg.rank() == 1:
            time.sleep(4)  # never joins the second allreduce
            return None
        threading.Timer(0.5, lambda: (_report_elsewhere(pg, "rank 1 timed out"),
                                      pg.lanes.look_for_news())).start()
        t0 = time.monotonic()
        with pytest.raises(dist.DistBackendError, match="a failure elsewhere in the group: "
                                                        "rank 1 timed out"):
            pg.allreduce([torch.ones(4)]).wait()
        return time.monotonic() - t0

    took = nccl_groups(2, body, lib=FakeNccl(), timeout_s=20.0)[0]
    assert took < 2.0, took  # not the 20 s timeout


def test_the_process_ending_with_a_call_on_the_stream_reports_no_failure():
    """At exit a collective still on a stream is aborted (ringcomm's exit hook): that
    is this process's end, not a failure of the group its peers must hear of."""
    seen = {}

    def body(pg):
        pg.allreduce([torch.ones(4)]).wait()
        if pg.rank() == 1:  # does not join the last allreduce
            time.sleep(1.0)
            seen["report"] = pg.lanes._reported(ack=False)
            return
        pg.allreduce([torch.ones(4)])  # still on the stream
        pg._stop_threads(wait_s=1.0)

    nccl_groups(2, body, lib=FakeNccl(), timeout_s=10.0)
    assert seen == {"report": None}
