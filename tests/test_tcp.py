"""The tcp transport (ringcomm/transport/tcp.py): messages against what was sent,
both directions of a large exchange at once, users' messages from any rank, and
every failure named: another size, another call, a rank gone, a stranger's
connection, an interrupt, the deadline. Whole worlds on it run in
tests/test_transport_contract.py."""
from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ringcomm
from ringcomm.front.create import TRANSPORTS, GroupSetup
from ringcomm.transport import tcp
from ringcomm.transport.base import (TransportAborted, TransportMismatch, TransportPeerFailed,
                                     TransportPeerLost, TransportTimeout)


@pytest.fixture
def world(monkeypatch):
    """``make(size)``: that many connected tcp transports over one store (closed after)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    made = []

    def make(size: int, timeout_s: float = 10.0):
        store = dist.HashStore()
        options = ringcomm.Options(transport="tcp").resolve()
        # each rank's factory reads every rank's host: on threads, as on processes
        tps = [tps[0][0] for tps in _on_threads(*(
            lambda r=r: TRANSPORTS["tcp"](GroupSetup(store, r, size, timedelta(seconds=timeout_s),
                                               timeout_s, options, (), True))
            for r in range(size)))]
        made.extend(tps)
        for tp in tps:
            tp.begin(timeout_s)
        return tps

    yield make
    for tp in made:
        tp.close()


def _on_threads(*fns):
    """Run each function on its own thread; their results, or raise the first error."""
    out, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    if errors:
        raise errors[0]
    return out


def _exchange(tp, peer: int, send: torch.Tensor, recv: torch.Tensor, tag: int = 5):
    batch = tp.batch([tp.recv_init(recv, peer, tag), tp.send_init(send, peer, tag)])
    tp.start(batch)
    tp.wait(batch)


def test_an_exchange_both_ways_at_once_delivers_every_byte(world):
    """8 MiB each way, both ranks sending before either receives: more than the
    sockets hold, so each wait must read while it writes."""
    a, b = world(2)
    n = 2 << 20
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    got = [torch.full((n,), float("nan")) for _ in range(2)]
    _on_threads(lambda: _exchange(a, 1, xs[0], got[0]), lambda: _exchange(b, 0, xs[1], got[1]))
    assert torch.equal(got[0], xs[1]) and torch.equal(got[1], xs[0])


def test_messages_of_one_tag_match_in_order_and_early_ones_wait(world):
    """Three messages sent before their receives start (each arrives early), and one
    to this rank itself; each receive takes the one started in its place."""
    a, b = world(2)
    sent = [torch.arange(4.0) + 10 * i for i in range(3)]
    sends = a.batch([a.send_init(t, 1, 7) for t in sent])
    a.start(sends)
    a.wait(sends)
    time.sleep(0.05)
    got = [torch.zeros(4) for _ in range(3)]
    recvs = b.batch([b.recv_init(t, 0, 7) for t in got])
    b.start(recvs)
    b.wait(recvs)
    assert all(torch.equal(g, s) for g, s in zip(got, sent))
    mine, back = torch.tensor([1.5, 2.5]), torch.zeros(2)
    _exchange(a, 0, mine, back)
    assert torch.equal(back, mine)


def test_empty_and_bfloat16_messages(world):
    a, b = world(2)
    x = torch.randn(33).to(torch.bfloat16)
    got, empty = torch.zeros(33, dtype=torch.bfloat16), torch.zeros(0)
    _on_threads(lambda: _exchange(a, 1, x, torch.zeros(33, dtype=torch.bfloat16)),
                lambda: _exchange(b, 0, x.clone(), got))
    assert torch.equal(got, x)
    _on_threads(lambda: _exchange(a, 1, empty, torch.zeros(0), tag=9),
                lambda: _exchange(b, 0, empty, torch.zeros(0), tag=9))


def test_a_receive_of_another_size_names_both_sizes(world):
    a, b = world(2)
    with pytest.raises(RuntimeError, match="received 40 bytes from rank 0 where 16 were"):
        _on_threads(lambda: _exchange(a, 1, torch.zeros(10), torch.zeros(10)),
                    lambda: _exchange(b, 0, torch.zeros(10), torch.zeros(4)))


def test_a_peer_in_another_call_is_found(world):
    """Rank 0 sends tag 3 where rank 1 awaits tag 4: the first message from rank 0
    is one nothing takes, so rank 1 is told, not left to its deadline."""
    a, b = world(2)
    sends = a.batch([a.send_init(torch.ones(4), 1, 3)])
    a.start(sends)
    a.wait(sends)
    b.begin(30)
    began = time.monotonic()
    with pytest.raises(TransportMismatch, match="tagged 3 where one tagged 4"):
        _exchange_recv(b, 0, torch.zeros(4), 4)
    assert time.monotonic() - began < 20


def _exchange_recv(tp, peer, buf, tag):
    batch = tp.batch([tp.recv_init(buf, peer, tag)])
    tp.start(batch)
    tp.wait(batch)


def test_the_deadline_names_the_awaited_rank(world):
    a, _ = world(2, timeout_s=0.3)
    with pytest.raises(TransportTimeout, match="recv from rank 1"):
        _exchange_recv(a, 1, torch.zeros(4), 1)


def test_an_interrupt_ends_a_wait_within_milliseconds(world):
    a, _ = world(2)
    threading.Timer(0.2, a.interrupt, ("shut down by the test",)).start()
    began = time.monotonic()
    with pytest.raises(TransportAborted, match="shut down by the test"):
        _exchange_recv(a, 1, torch.zeros(4), 1)
    assert time.monotonic() - began < 2


def test_a_peer_whose_connection_closes_is_named_at_once(world):
    a, b = world(2)
    _on_threads(lambda: _exchange(a, 1, torch.ones(2), torch.zeros(2)),
                lambda: _exchange(b, 0, torch.ones(2), torch.zeros(2)))
    b.close()
    with pytest.raises(TransportPeerLost, match="rank 1: its connection closed.*rank 0 waited"):
        _exchange_recv(a, 1, torch.zeros(4), 2)
    assert issubclass(TransportPeerLost, TransportPeerFailed)


def test_a_connection_with_another_token_is_refused(world):
    """A stranger (another job on a reused port, a stale rank) that connects is
    closed, and a message it sends never reaches a receive."""
    a, b = world(2)
    address, port, _ = a._peers(0)
    with socket.create_connection((address, port), timeout=5) as s:
        s.sendall(tcp._HELLO.pack(b"x" * 16, 1) + tcp._HEADER.pack(0, 1, 16) + bytes(16))
        got = torch.zeros(4)
        _on_threads(lambda: _exchange(a, 1, torch.ones(4), got, tag=1),
                    lambda: _exchange(b, 0, torch.full((4,), 2.0), torch.zeros(4), tag=1))
        assert torch.equal(got, torch.full((4,), 2.0))
        s.settimeout(5)
        try:
            assert s.recv(1) == b"", "the stranger's connection stayed open"
        except ConnectionResetError:  # closed with its bytes unread
            pass


def test_users_messages_from_any_rank_and_their_sizes(world):
    a, b, c = world(3)
    into = torch.zeros(3)
    h = a.p2p_irecv(into, None, 11)
    b.p2p_isend(torch.full((3,), 7.0), 0, 11)
    assert a.p2p_wait(h, time.monotonic() + 10)
    assert a.p2p_source(h) == 1 and torch.equal(into, torch.full((3,), 7.0))
    # a schedule's message with the same tag is not a user's
    c.p2p_isend(torch.ones(2), 0, 12)
    sends = b.batch([b.send_init(torch.full((2,), 5.0), 0, 12)])
    b.start(sends)
    got = torch.zeros(2)
    _exchange_recv(a, 1, got, 12)
    assert torch.equal(got, torch.full((2,), 5.0))
    short = a.p2p_irecv(torch.zeros(1), 2, 12)
    with pytest.raises(RuntimeError, match="dist.recv of 4 bytes got a message of 8 bytes"):
        a.p2p_wait(short, time.monotonic() + 10)
    pending = a.p2p_irecv(torch.zeros(1), 2, 13)
    assert not a.p2p_wait(pending, time.monotonic() + 0.05)
    a.p2p_cancel(pending)
    assert not a.user_pending()
    with pytest.raises(ValueError, match="tag -1 is out of range"):
        a.p2p_isend(torch.ones(1), 1, -1)


def test_bad_buffers_are_refused_by_name(world):
    a, _ = world(2)
    with pytest.raises(ValueError, match="contiguous"):
        a.send_init(torch.zeros(4, 4).t(), 1, 0)
    with pytest.raises(ValueError, match="no rank 5 in a group of 2"):
        a.start(a.batch([a.send_init(torch.zeros(1), 5, 0)]))


def test_a_group_made_with_tcp_runs_collectives_against_the_oracle(monkeypatch):
    """``Options(transport="tcp")`` through ringcomm.connect_group, ranks on threads."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    from ringcomm.testing.collectives import oracle

    store, size = dist.HashStore(), 3
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(size)]

    def rank(r):
        def body():
            pg = ringcomm.connect_group(store, r, size, timeout=timedelta(seconds=30),
                                        options=ringcomm.Options(transport="tcp"))
            try:
                t = inputs[r].clone()
                pg.allreduce([t]).wait()
                return t
            finally:
                pg.shutdown()
        return body

    for t in _on_threads(*(rank(r) for r in range(size))):
        assert torch.allclose(t, oracle(inputs, "SUM"))


def test_receives_take_messages_in_the_order_they_were_started(world):
    """An any-source receive started before one from rank 1 takes rank 1's first
    message; the later receive takes the second."""
    a, b = world(2)
    anyone, from_1 = torch.zeros(2), torch.zeros(2)
    first = a.p2p_irecv(anyone, None, 4)
    second = a.p2p_irecv(from_1, 1, 4)
    for v in (1.0, 2.0):
        b.p2p_isend(torch.full((2,), v), 0, 4)
    assert a.p2p_wait(first, time.monotonic() + 10) and a.p2p_wait(second, time.monotonic() + 10)
    assert anyone.tolist() == [1.0, 1.0] and from_1.tolist() == [2.0, 2.0]


def test_users_messages_on_one_thread_while_a_schedules_wait_on_another(world):
    """Both threads move the same sockets and queues: every message of each still
    arrives whole and in its place."""
    a, b = world(2)
    n, rounds = 1 << 16, 40

    def users(tp, peer):
        for i in range(rounds):
            got = torch.zeros(n)
            h = tp.p2p_irecv(got, peer, 1)
            tp.p2p_isend(torch.full((n,), float(i + 100 * peer)), peer, 1)
            assert tp.p2p_wait(h, time.monotonic() + 30)
            assert torch.equal(got, torch.full((n,), float(i + 100 * (1 - peer))))

    def schedules(tp, peer):
        for i in range(rounds):
            got = torch.zeros(n)
            _exchange(tp, peer, torch.full((n,), float(-i - 100 * peer)), got, tag=i)
            assert torch.equal(got, torch.full((n,), float(-i - 100 * (1 - peer))))

    _on_threads(lambda: users(a, 1), lambda: users(b, 0),
                lambda: schedules(a, 1), lambda: schedules(b, 0))


def test_a_closed_transport_refuses_its_waits_as_aborted(world):
    a, _ = world(2)
    h = a.p2p_irecv(torch.zeros(1), 1, 0)
    a.close()
    with pytest.raises(TransportAborted, match="closed"):
        a.p2p_done(h)


# -- open files: a group of p ranks may hold 2 (p - 1) connections a rank -------------
resource = pytest.importorskip("resource")


@pytest.fixture
def files_limit():
    """``set(soft)`` lowers this process's soft limit on open files for the test; the
    limit is restored after (the hard one is never touched)."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)

    def set_soft(soft: int) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))

    yield set_soft
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


def _lowest_free_fd() -> int:
    """The number the next file opened gets (the limit is on numbers: every number
    below a soft limit of this one is taken)."""
    fd = os.dup(0)
    os.close(fd)
    return fd


def test_set_up_raises_the_soft_limit_to_fit_every_connection(files_limit, monkeypatch):
    monkeypatch.setattr(tcp, "_wanted", [0, None])
    files_limit(tcp.open_files() + 8)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    start = tcp.open_files()
    tcp.make_room(600, 2)  # 2 channels: a listener and 2 x 599 connections each
    want = start + 2 * (2 * 599 + 1) + tcp.SPARE_FILES
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert soft == (want if hard == resource.RLIM_INFINITY else min(want, hard)), (soft, want)
    # a second group counts the first's connections too; a smaller limit is never set
    tcp.make_room(2, 1)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= soft


def test_set_up_warns_naming_a_hard_limit_too_low(monkeypatch, caplog):
    set_to = []

    class Limits:  # a process whose hard limit is 128 open files, 64 of them allowed now
        RLIMIT_NOFILE, RLIM_INFINITY = resource.RLIMIT_NOFILE, resource.RLIM_INFINITY

        @staticmethod
        def getrlimit(which):
            return (64, 128)

        @staticmethod
        def setrlimit(which, limits):
            set_to.append(limits)

    monkeypatch.setattr(tcp, "resource", Limits)
    monkeypatch.setattr(tcp, "_wanted", [0, 30])
    with caplog.at_level("WARNING", logger="ringcomm"):
        tcp.make_room(100, 1)
    assert set_to == [(128, 128)]
    said = caplog.text
    assert "a group of 100 ranks may hold 198 connections" in said, said
    assert "may open only 128 files (hard limit, ulimit -Hn)" in said, said


def test_a_connection_past_the_open_file_limit_is_named(world, files_limit):
    """No file left to connect with: the send fails at once, naming the limit."""
    a, _ = world(2)
    files_limit(_lowest_free_fd())
    with pytest.raises(RuntimeError, match=r"rank 0 cannot connect to rank 1 .*out of open "
                                           r"files.*may open \d+ files \(ulimit -n\).*2 connections"):
        a.start([a.send_init(torch.ones(4), 1, 5)])


def test_a_connection_that_cannot_be_accepted_is_named_not_waited_out(world, files_limit):
    """One file left: the sender's connection takes it, and the receiver, which cannot
    accept, fails at once naming the limit instead of spinning to its deadline."""
    a, b = world(2, timeout_s=30)
    files_limit(_lowest_free_fd() + 1)  # one number left: the sender's connection's
    a.start([a.send_init(torch.ones(4), 1, 5)])
    got = b.recv_init(torch.zeros(4), 0, 5)
    b.start([got])
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 cannot accept a connection: out of open "
                                           r"files.*\(ulimit -n\)"):
        b.wait([got])
    assert time.monotonic() - began < 5
