"""Round-robin channels (``Options(num_channels=K)``): a group of K communicators
gives the same results as a group of one, lets a collective complete while
another channel is held, orders a barrier after every channel's earlier work,
and runs over MPI, the in-process transport and the NCCL path (FakeNccl).
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ringcomm
from ringcomm.front.process_group import ProcessGroupRingcomm
from ringcomm.testing import FakeNccl, check_collectives, nccl_groups
from ringcomm.testing.in_process import _on_threads
from ringcomm.testing.local import LocalFabric

from conftest import assert_checks, mpirun, torchrun


def _groups(size: int, channels: int, body, timeout_s: float = 10.0) -> list:
    """Run ``body(rank, pg)`` on ``size`` threads, each with a ringcomm group of
    ``channels`` channels over the in-process transport (one fabric per channel)."""
    fabrics = [LocalFabric(size) for _ in range(channels)]

    def run(rank: int):
        pg = ProcessGroupRingcomm(rank, size, [f.transport(rank) for f in fabrics],
                                  timedelta(seconds=timeout_s),
                                  ringcomm.Options(num_channels=channels), f"ch{channels}")
        try:
            return body(rank, pg)
        finally:
            pg.shutdown()

    return _on_threads("channels", size, run, timeout_s)


#: the sizes of _burst's allreduces and broadcasts (ring, tree and recursive doubling)
BURST_SIZES = (5, 1000, 70000, 3, 40000, 1)


def _burst_inputs(rank: int, p: int) -> dict:
    """Rank ``rank``'s inputs of :func:`_burst` (random floats, seeded by the rank)."""
    g = torch.Generator().manual_seed(rank)
    pairs = [(torch.randn(n, generator=g), torch.randn(n, generator=g)) for n in BURST_SIZES]
    return {"allreduce": [a for a, _ in pairs], "broadcast": [b for _, b in pairs],
            "allgather": torch.randn(17, generator=g),
            "reduce_scatter": torch.randn(9 * p, generator=g),
            "alltoall": torch.randn(4 * p, generator=g)}


def _burst(rank: int, pg) -> list[torch.Tensor]:
    """Fifteen collectives in flight at once, then every result: allreduces of
    several sizes, broadcasts from every root in turn, an all-gather, a
    reduce-scatter and an all-to-all."""
    p = pg.size()
    x = _burst_inputs(rank, p)
    works, outs = [], []
    for i, (t, b) in enumerate(zip(x["allreduce"], x["broadcast"])):
        works.append(pg.allreduce([t]))
        outs.append(t)
        opts = dist.BroadcastOptions()
        opts.rootRank = i % p
        works.append(pg.broadcast([b], opts))
        outs.append(b)
    gathered = torch.empty(17 * p)
    works.append(pg._allgather_base(gathered, x["allgather"]))
    outs.append(gathered)
    rs_out = torch.empty(9)
    works.append(pg._reduce_scatter_base(rs_out, x["reduce_scatter"]))
    outs.append(rs_out)
    a2a = torch.empty(4 * p)
    works.append(pg.alltoall_base(a2a, x["alltoall"], [], []))
    outs.append(a2a)
    for w in works:
        w.wait()
    return outs


def _burst_oracle(rank: int, p: int) -> list[torch.Tensor]:
    """What :func:`_burst` returns on ``rank``, computed in one process from every
    rank's inputs."""
    xs = [_burst_inputs(r, p) for r in range(p)]
    want = []
    for i in range(len(BURST_SIZES)):
        want.append(sum(x["allreduce"][i] for x in xs))
        want.append(xs[i % p]["broadcast"][i])
    want.append(torch.cat([x["allgather"] for x in xs]))
    want.append(sum(x["reduce_scatter"] for x in xs).view(p, -1)[rank])
    want.append(torch.cat([x["alltoall"].view(p, -1)[rank] for x in xs]))
    return want


@pytest.mark.parametrize("size", [2, 3, 4])
def test_many_channels_give_the_results_of_one_and_of_the_oracle(size):
    one = _groups(size, 1, _burst)
    three = _groups(size, 3, _burst)
    for rank in range(size):
        want = _burst_oracle(rank, size)
        for i, (a, b, w) in enumerate(zip(one[rank], three[rank], want, strict=True)):
            # the same algorithms on the same inputs: bit for bit
            assert torch.equal(a, b), f"rank {rank} result {i} differs with 3 channels"
            # sums in another order: within float32's rounding
            assert torch.allclose(b, w, rtol=1e-5, atol=1e-5), f"rank {rank} result {i} is wrong"


def test_every_collective_and_algorithm_on_three_channels():
    counts = _groups(3, 3, lambda rank, pg: check_collectives(pg, "cpu",
                                                              dtypes=(torch.float32, torch.int64)))
    assert min(counts) > 100


class _Hold:
    """A call that keeps its lane busy until ``release`` is set."""

    name = "hold"

    def __init__(self, release: threading.Event):
        self.release = release

    def execute(self) -> None:
        self.release.wait(30)


def test_a_collective_completes_while_another_channel_is_held():
    """Channel 1's progress thread is held; the first allreduce (call 1, channel 1)
    queues behind it, the second (call 2, channel 0) completes anyway. With one
    channel both queue behind the held thread."""

    def body(channels: int):
        release = threading.Event()
        sampled = threading.Barrier(2)

        def run(rank: int, pg):
            held = pg.lanes.cpus[1 % channels].engine
            hold = held.submit(_Hold(release), (), async_op=True, timeout_s=60)
            first = pg.allreduce([torch.ones(4)])
            second = pg.allreduce([torch.ones(4)])
            deadline = time.monotonic() + 5
            while not second.is_completed() and time.monotonic() < deadline:
                time.sleep(0.01)
            done = (first.is_completed(), second.is_completed())
            sampled.wait(30)  # both ranks looked before anything is released
            release.set()
            for w in (hold, first, second):
                w.wait()
            return done

        return _groups(2, channels, run)

    assert body(2) == [(False, True)] * 2
    assert body(1) == [(False, False)] * 2


def test_barrier_waits_for_earlier_work_on_every_channel():
    def run(rank: int, pg):
        if rank == 1:
            time.sleep(0.3)  # rank 0's allreduce waits for this rank
        works = [pg.allreduce([torch.ones(1000) * rank]) for _ in range(3)]
        pg.barrier().wait()
        return [w.is_completed() for w in works]

    assert _groups(2, 3, run) == [[True] * 3, [True] * 3]


def test_channels_need_one_transport_each():
    with pytest.raises(ValueError, match="2 transports given for num_channels=3"):
        fab = LocalFabric(1)
        ProcessGroupRingcomm(0, 1, [fab.transport(0), fab.transport(0)], timedelta(seconds=5),
                             ringcomm.Options(num_channels=3))
    with pytest.raises(ValueError, match="Options.num_channels must be a positive"):
        ringcomm.Options(num_channels=0).resolve()


@pytest.mark.parametrize("size", [2, 3])
def test_nccl_path_with_channels(size):
    lib = FakeNccl()
    opts = ringcomm.Options(num_channels=2)
    counts = nccl_groups(size, lambda pg: check_collectives(
        pg, "cpu", dtypes=(torch.float32,), reduce_ops=("SUM", "MAX")), lib=lib, options=opts)
    assert min(counts) > 40
    # one communicator per channel, the same on every rank
    assert lib.calls["NcclCommunicator"] == 2 * size


@pytest.mark.parametrize("launch,n", [pytest.param(mpirun, 3, marks=pytest.mark.wide),
                                     pytest.param(torchrun, 2, marks=pytest.mark.wide)],
                         ids=["mpiexec3", "torchrun2"])
def test_channels_under_launchers(launch, n):
    out = launch(n, "channels_check.py", timeout=240).stdout
    assert_checks(out, f"channels_check {launch.__name__} n={n}", n)


def test_a_failure_on_one_channel_breaks_every_channel():
    """A collective that times out on channel 1 leaves the ranks in an unknown state:
    the next collectives fail at once with its error, on channel 0 as on channel 1."""

    def run(rank: int, pg):
        opts = dist.AllreduceOptions()
        opts.timeout = timedelta(seconds=0.5)
        if rank == 0:  # rank 1 never joins this allreduce (call 1, channel 1)
            w = pg.allreduce([torch.ones(3)], opts)
            with pytest.raises(dist.DistBackendError, match="timed out"):
                w.wait()
            errors = []
            for _ in range(2):  # calls 2 and 3: channels 0 and 1
                with pytest.raises(dist.DistBackendError, match="unusable") as e:
                    pg.allreduce([torch.ones(3)]).wait()
                errors.append(str(e.value))
            return all("timed out" in m for m in errors)
        return True

    assert _groups(2, 2, run) == [True, True]


def _same_tensor_twice(rank: int, pg) -> torch.Tensor:
    """Two asynchronous allreduces of one tensor, on neighbouring channels, with a late
    peer: both wait for it at once unless the second follows the first."""
    t = torch.full((1 << 18,), 1.0)
    if rank == 1:
        time.sleep(0.3)
    first, second = pg.allreduce([t]), pg.allreduce([t])
    second.wait()
    first.wait()
    return t


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_on_the_same_tensor_keep_issue_order_across_channels(size):
    for t in _groups(size, 2, _same_tensor_twice):
        assert torch.equal(t, torch.full_like(t, float(size * size)))



def test_the_order_forgets_finished_collectives_and_keeps_unfinished_ones():
    from ringcomm.front.lanes import TensorOrder

    class W:
        def __init__(self, done):
            self.done = done

        def is_completed(self):
            return self.done

    order, lane, other = TensorOrder(), object(), object()
    pending = W(False)
    keep = torch.ones(3)
    keys, deps = order.after_earlier(lane, [keep])
    order.issued(lane, keys, pending)
    alive = [torch.ones(2) for _ in range(TensorOrder.LIMIT + 1)]  # distinct storages
    for t in alive:  # finished collectives on other storages
        k, _ = order.after_earlier(lane, [t])
        order.issued(lane, k, W(True))
    assert len(order._last) <= 2  # pruned to the unfinished one (and one issued since)
    assert order.after_earlier(other, [keep[1:]])[1] == [pending]  # a view: same storage
    assert order.after_earlier(lane, [keep])[1] == []  # same lane: already in order
