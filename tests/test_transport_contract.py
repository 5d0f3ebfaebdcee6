"""The transport contract as a user meets it (docs/architecture.md, "Writing a
transport"): the template, examples/store_transport.py, and ringcomm's own tcp
transport run every collective of a torchrun world against a single-process
oracle without MPI (tcp also the rest of torch.distributed against gloo, and a
rank that ends is named by every rank at once); a transport's own
collective, declared with ``register_transport_collective``, runs where its
transport is and is refused by name elsewhere; bad names and mismatched ranks get
errors that say what was wrong."""
from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ringcomm
from ringcomm import algorithms
from ringcomm.front import create
from ringcomm.front.process_group import ProcessGroupRingcomm
from ringcomm.testing.collectives import oracle
from ringcomm.testing.in_process import _on_threads
from ringcomm.testing.local import LocalFabric, LocalTransport
from ringcomm.transport.shm import direct as shm_direct
from ringcomm.transport.base import ALONE

from conftest import assert_checks, torchrun

STORE = {"RINGCOMM_TRANSPORT": "store"}
TCP = {"RINGCOMM_TRANSPORT": "tcp"}


def test_the_template_transport_runs_every_collective_without_mpi():
    out = torchrun(3, "transport_check.py", "collectives", env=STORE, timeout=240).stdout
    # the ranks' lines may interleave on the shared stdout
    passed = dict(re.findall(r"rank (\d): (\d+) checks passed over the store transport", out))
    assert sorted(passed) == ["0", "1", "2"], out
    assert all(int(n) > 100 for n in passed.values()), passed


def test_the_tcp_transport_runs_every_collective_without_mpi():
    out = torchrun(3, "transport_check.py", "collectives", env=TCP, timeout=240).stdout
    passed = dict(re.findall(r"rank (\d): (\d+) checks passed over the tcp transport", out))
    assert sorted(passed) == ["0", "1", "2"], out
    assert all(int(n) > 100 for n in passed.values()), passed


@pytest.mark.wide  # 16 s; every collective on tcp: make test
def test_the_rest_of_torch_distributed_on_tcp_matches_gloo():
    """send/recv (tags, any source, batch_isend_irecv rings), gather, scatter,
    all_to_all, object and coalesced collectives and bad input, against gloo, on 4
    ranks of the tcp transport."""
    out = torchrun(4, "more_collectives_check.py", env=TCP, timeout=240).stdout
    assert_checks(out, "more_collectives_check torchrun tcp n=4", 4)


def test_a_rank_that_ends_on_tcp_is_named_by_every_rank_at_once():
    """Rank 1's process ends while the others wait in an allreduce with it: rank 2
    sees its connection close and says so to the group; rank 0, which waits for
    rank 2, learns that rank 1 left (not that rank 2 did), each long before the
    60 s timeout."""
    out = torchrun(3, "transport_check.py", "dies", env=TCP, timeout=120).stdout
    lines = re.findall(r"rank (\d): failed naming rank 1 after ([\d.]+) s: (.*)", out)
    assert sorted(r for r, _, _ in lines) == ["0", "2"], out
    assert all(float(s) < 30 for _, s, _ in lines), lines
    assert all("rank 1: its connection closed" in text for _, _, text in lines), lines


@pytest.mark.wide  # 14 s; the MPI transport's missing ranks: make test
@pytest.mark.parametrize("env", [STORE, {"RINGCOMM_TRANSPORT": "tcp"}], ids=["store", "tcp"])
def test_a_rank_missing_on_a_transport_without_mpi_is_named_by_the_others(env):
    out = torchrun(3, "transport_check.py", "stalled", env=env, timeout=120).stdout
    assert out.count("timed out naming rank 1") == 2, out


def test_an_unknown_transport_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"no transport 'nope'.*known: \[.*'mpi'"):
        ringcomm.connect_group(dist.HashStore(), 0, 1,
                               options=ringcomm.Options(transport="nope"))
    with pytest.raises(ValueError, match="Options.transport must be a name"):
        ringcomm.connect_group(dist.HashStore(), 0, 1, options=ringcomm.Options(transport=3))


def _refuse(setup):
    raise RuntimeError(f"rank {setup.rank}'s factory ran")


def _connect_two(names: tuple[str, str], timeout_s: float) -> dict[int, BaseException]:
    """Two ranks on threads make a group over one store, rank r naming transport
    ``names[r]``; what each raised (a rank still blocked after 30 s is missing)."""
    store = dist.HashStore()
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        try:
            ringcomm.connect_group(store, rank, 2, timeout=timedelta(seconds=timeout_s),
                                   options=ringcomm.Options(transport=names[rank]))
        except BaseException as e:  # noqa: BLE001
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for name in names:
            if name != "mpi":
                create.TRANSPORTS.pop(name, None)
    return errors


def test_ranks_naming_different_transports_are_told_which_rank_named_what():
    """Rank 1 learns from the store, before its factory runs, that rank 0 named
    another transport (it would wait in another set-up)."""
    ringcomm.register_transport("first", _refuse, replace=True)
    ringcomm.register_transport("second", _refuse, replace=True)
    errors = _connect_two(("first", "second"), 5)
    assert "rank 0's factory ran" in str(errors[0])
    assert "rank 1 names transport 'second' where rank 0 names 'first'" in str(errors[1])


def test_a_rank_0_with_an_unknown_transport_leaves_no_rank_waiting():
    """Rank 0 says its choice before it finds the name unknown: the others learn
    that it differs at once instead of waiting for a key that never comes (the old
    order left rank 1 blocked for the group's timeout)."""
    ringcomm.register_transport("known", _refuse, replace=True)
    errors = _connect_two(("typo", "known"), 60)
    assert sorted(errors) == [0, 1], errors
    assert "no transport 'typo'" in str(errors[0])
    assert "rank 1 names transport 'known' where rank 0 names 'typo'" in str(errors[1])


@pytest.mark.parametrize("name, connect, why", [
    ("has space", lambda s: None, "is not a name"),
    ("mpi", lambda s: None, "exists; pass replace=True"),
    ("fine", 42, "is not callable"),
])
def test_register_transport_refuses_bad_input(name, connect, why):
    with pytest.raises(ValueError, match=why):
        ringcomm.register_transport(name, connect)
    assert "fine" not in create.TRANSPORTS


# -- a transport's own collective --------------------------------------------------------
class _Pool:
    """What the ranks of an in-process fabric share for their own allreduce."""

    def __init__(self, size: int):
        self.parts: list = [None] * size
        self.turn = threading.Barrier(size, timeout=10)


class PooledTransport(LocalTransport):
    """The in-process transport with an allreduce of its own ("pooled"): every rank
    puts its tensor in a shared pool, and each sums them in rank order."""

    def __init__(self, fabric: LocalFabric, rank: int, pool: _Pool):
        super().__init__(fabric, rank)
        self.pool = pool

    def check_own(self, name, collective, dtype, op):
        if name == "pooled" and collective == "allreduce":
            return
        super().check_own(name, collective, dtype, op)

    def own_init(self, name, collective, layout, dtype, op, signature, epoch, names, root=0):
        if name != "pooled":
            return super().own_init(name, collective, layout, dtype, op, signature, epoch,
                                    names, root)
        tp = self

        class Program:
            def run(self, bufs):
                tp.pool.parts[tp.rank] = bufs[0].clone()
                tp.pool.turn.wait()
                total = tp.pool.parts[0].clone()
                for part in tp.pool.parts[1:]:
                    total += part
                tp.pool.turn.wait()
                bufs[0].copy_(total)

            def close(self):
                pass

        return Program()


@pytest.fixture
def pooled():
    own = ringcomm.register_transport_collective(
        "pooled", ("allreduce",), "a PooledTransport (the test's in-process pool)")
    yield own
    for c in own.collectives:
        algorithms.REGISTRY[c].pop("pooled")
    algorithms.RESERVED.discard("pooled")


def _groups(size: int, make_tp, body) -> list:
    fabric = LocalFabric(size)

    def run(rank: int):
        pg = ProcessGroupRingcomm(rank, size, make_tp(fabric, rank), timedelta(seconds=10),
                                  ringcomm.Options(), "contract")
        try:
            return body(rank, pg)
        finally:
            pg.shutdown()

    return _on_threads("contract", size, run, 30)


def test_a_transport_collective_runs_on_its_transport_against_the_oracle(pooled):
    size, pool = 3, _Pool(3)
    inputs = [torch.randn(50, generator=torch.Generator().manual_seed(r)) for r in range(size)]

    def body(rank, pg):
        pg.set_algorithm("allreduce", "pooled")
        t = inputs[rank].clone()
        pg.allreduce([t]).wait()
        return t

    results = _groups(size, lambda f, r: PooledTransport(f, r, pool), body)
    want = oracle(inputs, "SUM")
    for t in results:
        assert torch.equal(t, want)


def test_a_transport_collective_elsewhere_is_refused_naming_what_it_needs(pooled):
    def body(rank, pg):
        pg.set_algorithm("allreduce", "pooled")
        with pytest.raises(ValueError) as e:
            pg.allreduce([torch.ones(4)]).wait()
        return str(e.value)

    for text in _groups(2, LocalFabric.transport, body):
        assert "LocalTransport has no collective 'pooled'" in text, text
        assert "needs a PooledTransport" in text, text


def test_a_transport_collective_name_is_reserved_and_cannot_be_unregistered(pooled):
    with pytest.raises(ValueError, match="reserved"):
        ringcomm.register_algorithm("allreduce", "pooled", lambda ctx: None)
    with pytest.raises(ValueError, match="transport's own collective"):
        ringcomm.unregister_algorithm("allreduce", "pooled")
    with pytest.raises(ValueError, match="exists"):
        ringcomm.register_transport_collective("ring", ("allreduce",), "x")
    with pytest.raises(ValueError, match="exists"):
        ringcomm.register_transport_collective("pooled", ("allreduce", "broadcast"), "x")
    with pytest.raises(ValueError, match="unknown collective"):
        ringcomm.register_transport_collective("x", ("allmagic",), "x")
    assert ringcomm.register_transport_collective("pooled", ("allreduce",), "y") is pooled


def test_one_rank_runs_any_transport_collective_as_a_copy():
    """A group of one rank has every rank on one host: shm_direct (and any transport
    collective of ALONE) runs there as a copy, whatever the transport."""
    assert algorithms.SHM_DIRECT.collectives == shm_direct.COLLECTIVES == ALONE

    def body(rank, pg):
        pg.set_algorithm("allreduce", "shm_direct")
        pg.set_algorithm("allgather", "shm_direct")
        t = torch.arange(5.0)
        pg.allreduce([t]).wait()
        out = [torch.full((5,), -1.0)]
        pg.allgather([out], [torch.arange(5.0)]).wait()
        pg.set_algorithm("barrier", "shm_direct")
        pg.barrier(dist.BarrierOptions()).wait()
        return t, out[0]

    [(t, gathered)] = _groups(1, LocalFabric.transport, body)
    assert torch.equal(t, torch.arange(5.0)) and torch.equal(gathered, torch.arange(5.0))


# -- the checks catch a transport that loses a write ---------------------------------------
class LosingTransport(LocalTransport):
    """The in-process transport, except that messages to rank 0 land in a buffer of
    their own: the receive completes, and the caller's memory is never written."""

    def recv_init(self, buf, peer, tag):
        if self.rank == 0:
            buf = torch.zeros_like(buf)
        return super().recv_init(buf, peer, tag)


def test_a_receive_never_written_fails_the_oracle_checks():
    """Every output check_collectives hands a collective is filled with UNWRITTEN
    first, so an element the call never wrote shows whatever the memory held before
    (with torch.empty it could hold the right answer from an earlier call)."""
    from ringcomm.testing import check_collectives
    from ringcomm.testing.collectives import UNWRITTEN, unwritten

    only = {c: [] for c in algorithms.REGISTRY}
    only["allgather"] = ["ring"]

    def body(rank, pg):
        try:
            check_collectives(pg, "cpu", dtypes=(torch.float32,), reduce_ops=("SUM",),
                              numel=5, algorithms=only)
        except AssertionError as e:
            return str(e)
        return ""

    out = _groups(2, LosingTransport, body)
    assert "allgather[ring] torch.float32: differs from the oracle" in out[0], out
    assert out[1] == "", out
    assert torch.equal(unwritten(3, dtype=torch.float16), torch.full((3,), float(UNWRITTEN),
                                                                     dtype=torch.float16))
    assert unwritten(2, dtype=torch.int8).tolist() == [127, 127]
