"""Wrong schedules are refused with a precise message, by the checker (without
running them) and by the NCCL-rules simulator (running them), never by a hang."""
from __future__ import annotations

import threading

import pytest
import torch

from ringcomm.execution import checker
from ringcomm import ops
from ringcomm.algorithms import ring
from ringcomm.execution.executors import GroupProgram
from ringcomm.execution.plan import Plan
from ringcomm.execution.user_checks import check_user_schedule as _check_user_schedule
from ringcomm.schedule import Builder, Context, Copy, Reduce, Region, ScheduleError
from ringcomm.execution.simulator import SimFabric, SimulatorError
from ringcomm.testing import run_schedule


def swap_sum(ctx, *, recv_n=None, reduce_twice=False, skip_recv_on=None, rank1_keeps=False):
    """Two ranks exchange buffers and add; knobs break it in one way each."""
    b = Builder(ctx)
    n = ctx.layout[0]
    tmp = b.scratch(n)
    peer = 1 - ctx.rank
    rn = n if recv_n is None or ctx.rank != 1 else recv_n
    recvs = [] if skip_recv_on == ctx.rank else [(peer, (tmp, 0, rn))]
    local = [Reduce((0, 0, n), (tmp, 0, n))] * (2 if reduce_twice else 1)
    if (rank1_keeps and ctx.rank == 1) or skip_recv_on == ctx.rank:
        local = []
    b.step(sends=[(peer, (0, 0, n))], recvs=recvs, local=local)
    return b.build()


def test_correct_schedule_passes():
    stats = checker.check(swap_sum, "allreduce", 2, (4,))
    assert stats.rounds == 1 and stats.sent_max == 4 and stats.reduced_max == 4


def test_size_mismatch_is_named():
    with pytest.raises(ScheduleError, match=r"size mismatch: rank 0 step 0 sends 4 elements to "
                                            r"rank 1, whose matching receive \(step 0\) takes 3"):
        checker.check(lambda c: swap_sum(c, recv_n=3), "allreduce", 2, (4,))


def test_missing_receive_is_named():
    with pytest.raises(ScheduleError, match=r"rank 0 step 0: send of 4 elements to rank 1 has "
                                            r"no matching receive on rank 1"):
        checker.check(lambda c: swap_sum(c, skip_recv_on=1), "allreduce", 2, (4,))


def test_double_count_is_named():
    with pytest.raises(ScheduleError, match=r"allreduce rank 0 step 0: element 0 would count "
                                            r"ranks \{1\} twice"):
        checker.check(lambda c: swap_sum(c, reduce_twice=True), "allreduce", 2, (4,))


def test_missing_contribution_is_named():
    with pytest.raises(ScheduleError, match=r"rank 1 buffer 0 element 0 ends as element 0 from "
                                            r"ranks \{1\}, expected element 0 from ranks \{0, 1\}"):
        checker.check(lambda c: swap_sum(c, rank1_keeps=True), "allreduce", 2, (4,))


def test_wrong_element_is_named():
    def shifted(ctx):  # reduces the peer's element e+1 into element e
        b = Builder(ctx)
        tmp = b.scratch(4)
        peer = 1 - ctx.rank
        b.step(sends=[(peer, (0, 0, 4))], recvs=[(peer, (tmp, 0, 4))],
               local=[Reduce((0, 0, 3), (tmp, 1, 3)), Reduce((0, 3, 1), (tmp, 0, 1))])
        return b.build()
    with pytest.raises(ScheduleError, match=r"step 0: reduces element 0 with element 1"):
        checker.check(shifted, "allreduce", 2, (4,))


def receive_first(ctx):
    """Ring allgather as the old code ran it: every receive first, then the sends."""
    b = Builder(ctx)
    p, r = ctx.size, ctx.rank
    chunks = [Region(i, 0, n) for i, n in enumerate(ctx.layout)]
    b.local(Copy(chunks[r], Region(p, 0, ctx.layout[r])))
    left, right = (r - 1) % p, (r + 1) % p
    b.step(recvs=[(left, chunks[(r - s - 1) % p]) for s in range(p - 1)])
    for s in range(p - 1):
        b.step(sends=[(right, chunks[(r - s) % p])])
    return b.build()


def test_cycle_is_named_by_checker():
    with pytest.raises(ScheduleError, match=r"deadlock under NCCL's group rules: rank \d step 1 "
                                            r"\(receive of 2 elements from rank \d\) waits for "
                                            r"rank \d, whose match is in its step 2"):
        checker.check(receive_first, "allgather", 3, (2, 2, 2))


def _allgather_bufs(p: int, n: int):
    return [[torch.zeros(n) for _ in range(p)] + [torch.full((n,), float(r))] for r in range(p)]


def test_cycle_ends_in_simulator_error_not_a_hang():
    with pytest.raises(SimulatorError, match="deadlock"):
        run_schedule(receive_first, "allgather", 3, (2, 2, 2), _allgather_bufs(3, 2),
                     executor="nccl-sim")


def test_simulator_with_one_thread_per_rank():
    """Ranks enqueue from their own threads and synchronize, as processes would: a
    good schedule completes, a cyclic one fails on every rank."""
    for build, ok in ((ring.allgather, True), (receive_first, False)):
        p = 4
        fabric = SimFabric(p)
        bufs = _allgather_bufs(p, 3)
        outcome = [None] * p

        def body(r):
            comm = fabric.comm(r)
            plan = Plan(build(Context("allgather", p, r, (3,) * p, 0, 2)))
            GroupProgram(plan, comm, [torch.empty(n) for n in plan.scratch], None).run(bufs[r])
            try:
                comm.synchronize(timeout_s=20)
                outcome[r] = "ok"
            except SimulatorError as e:
                outcome[r] = str(e)
            finally:
                comm.close()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if ok:
            assert outcome == ["ok"] * p
            assert all(torch.equal(bufs[r][i], torch.full((3,), float(i)))
                       for r in range(p) for i in range(p))
        else:
            assert all(o and "deadlock" in o for o in outcome), outcome


def test_structural_errors():
    def outside(ctx):
        b = Builder(ctx)
        b.step(sends=[(1 - ctx.rank, (0, 2, 4))], recvs=[(1 - ctx.rank, (0, 0, 2))])
        return b.build()
    with pytest.raises(ScheduleError, match=r"region \(0, 2, 4\) is outside buffer 0 of 4"):
        checker.check(outside, "allreduce", 2, (4,))

    def overlapping(ctx):
        b = Builder(ctx)
        b.step(sends=[(1 - ctx.rank, (0, 0, 4))], recvs=[(1 - ctx.rank, (0, 0, 4))])
        return b.build()
    with pytest.raises(ScheduleError, match="in the same step"):
        checker.check(overlapping, "allreduce", 2, (4,))

    def reduces_in_broadcast(ctx):
        b = Builder(ctx)
        b.local(Reduce((0, 0, 1), (0, 1, 1)))
        return b.build()
    with pytest.raises(ScheduleError, match="broadcast does not reduce"):
        checker.check(reduces_in_broadcast, "broadcast", 1, (2,))


def test_barrier_must_wait_for_everyone():
    def hasty(ctx):  # tokens only from the left neighbour: not a barrier for p > 2
        b = Builder(ctx)
        p, r = ctx.size, ctx.rank
        if p > 1:
            have = b.scratch(2)
            b.local(Copy((have, 0, 1), (0, 0, 1)))
            b.step(sends=[((r + 1) % p, (have, 0, 1))], recvs=[((r - 1) % p, (have, 1, 1))])
        return b.build()
    checker.check(hasty, "barrier", 2, (1,))
    with pytest.raises(ScheduleError, match=r"rank 0 leaves without having heard .* from ranks \[1\]"):
        checker.check(hasty, "barrier", 3, (1,))


def test_user_schedule_refused_before_it_runs():
    ctx = Context("allreduce", 2, 0, (1 << 20,), 0, 1 << 16)
    _check_user_schedule(swap_sum, ctx, "swap_sum")  # large shapes are checked scaled down
    with pytest.raises(ValueError, match=r"algorithm 'bad' is wrong: allreduce on 2 ranks.*twice"):
        _check_user_schedule(lambda c: swap_sum(c, reduce_twice=True), ctx, "bad")


def test_stats_count_rounds_and_bytes():
    # ring allreduce on 4 ranks, 1 segment per chunk: 2(p-1) rounds, each rank sends
    # 2(p-1)/p of the buffer and reduces (p-1)/p of it
    s = checker.check(ring.allreduce, "allreduce", 4, (400,), seg=100)
    assert (s.rounds, s.sent_max, s.reduced_max, s.busiest) == (6, 600, 300, 600)


@pytest.mark.parametrize("executor", ["threads", "nccl-sim"])
def test_a_users_schedule_sums_on_both_executors(executor):
    bufs = [[torch.arange(6.0) * (r + 1)] for r in range(2)]
    run_schedule(swap_sum, "allreduce", 2, (6,), bufs, op=ops.SUM, executor=executor)
    assert all(torch.equal(b[0], torch.arange(6.0) * 3) for b in bufs)


def test_inputs_must_survive():
    def clobbers_input(ctx):  # allgather that receives the peer's block into its input
        b = Builder(ctx)
        r, peer = ctx.rank, 1 - ctx.rank
        b.local(Copy((r, 0, 3), (2, 0, 3)))
        b.step(sends=[(peer, (2, 0, 3))], recvs=[(peer, (peer, 0, 3))])
        b.step(sends=[(peer, (r, 0, 3))], recvs=[(peer, (2, 0, 3))])
        return b.build()
    with pytest.raises(ScheduleError, match=r"rank 0 buffer 2 element 0 ends as element 0 of "
                                            r"chunk 1 from ranks \{1\}, expected element 0 "
                                            r"of chunk 0"):
        checker.check(clobbers_input, "allgather", 2, (3, 3))


def test_local_op_overlapping_itself_is_refused():
    def shifts(ctx):
        b = Builder(ctx)
        b.local(Copy((0, 0, 3), (0, 1, 3)))
        return b.build()
    with pytest.raises(ScheduleError, match=r"copy destination \(0, 0, 3\) overlaps its source"):
        checker.check(shifts, "broadcast", 1, (4,))


def test_checked_schedule_is_the_one_that_runs():
    calls = []

    def fickle(ctx):  # a builder with hidden state: right the first time only
        calls.append(ctx.rank)
        return swap_sum(ctx, reduce_twice=len(calls) > 2)
    ctx = Context("allreduce", 2, 0, (4,), 0, 1 << 16)
    sched = _check_user_schedule(fickle, ctx, "fickle")
    assert len(calls) == 2  # built once per rank, for the check; that schedule is returned
    assert len(sched.steps[0].local) == 1


def _outside(ctx):
    b = Builder(ctx)
    b.step(sends=[(1 - ctx.rank, (0, 2, 4))], recvs=[(1 - ctx.rank, (0, 0, 2))])
    return b.build()


def _self_send(ctx):
    b = Builder(ctx)
    b.step(sends=[(ctx.rank, (0, 0, 1))])
    return b.build()


FINDINGS = [  # (builder, collective, size, layout, the finding's fields, words in the message)
    (lambda c: swap_sum(c, recv_n=3), "allreduce", 2, (4,),
     dict(kind="size mismatch", rank=0, step=0, peer=1, peer_step=0),
     ["rank 0 step 0 sends 4 elements to rank 1, whose matching receive (step 0)"]),
    (lambda c: swap_sum(c, skip_recv_on=1), "allreduce", 2, (4,),
     dict(kind="unmatched", rank=0, step=0, peer=1, peer_step=None, more=()),
     ["rank 0 step 0: send of 4 elements to rank 1 has no matching receive"]),
    (lambda c: swap_sum(c, reduce_twice=True), "allreduce", 2, (4,),
     dict(kind="reduce", rank=0, step=0, buffer=0, element=0), ["allreduce rank 0 step 0: "]),
    (lambda c: swap_sum(c, rank1_keeps=True), "allreduce", 2, (4,),
     dict(kind="wrong result", rank=1, step=None, buffer=0, element=0),
     ["rank 1 buffer 0 element 0 ends as"]),
    (_outside, "allreduce", 2, (4,), dict(kind="structure", rank=0, step=0, peer=1),
     ["allreduce rank 0 step 0: send to rank 1 region"]),
    (_self_send, "allreduce", 2, (4,), dict(kind="peer", rank=0, step=0, peer=0),
     ["rank 0 step 0: send peer 0 is not another rank"]),
    (lambda c: 3, "allreduce", 2, (4,), dict(kind="builder", rank=0),
     ["returned int on rank 0"]),
]


@pytest.mark.parametrize("case", FINDINGS, ids=lambda c: c[4]["kind"])
def test_a_refusal_carries_what_its_message_says_as_data(case):
    build, coll, p, lay, fields, words = case
    with pytest.raises(ScheduleError) as e:
        checker.check(build, coll, p, lay)
    f = checker.finding_of(e.value)
    assert type(e.value) is ScheduleError and f is not None
    assert {k: getattr(f, k) for k in fields} == fields
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_deadlocks_finding_is_its_cycle_in_the_messages_order():
    with pytest.raises(ScheduleError) as e:
        checker.check(receive_first, "allgather", 4, (2, 2, 2, 2))
    f = checker.finding_of(e.value)
    cycle = [f, *f.more]
    assert f.kind == "deadlock" and len(cycle) == 4
    assert [x.peer for x in cycle] == [x.rank for x in cycle[1:] + cycle[:1]]  # a cycle
    text, at = str(e.value), 0
    for x in cycle:  # each entry as the message says it, in its order
        words = (f"rank {x.rank} step {x.step} (receive of 2 elements from rank {x.peer}) "
                 f"waits for rank {x.peer}, whose match is in its step {x.peer_step}")
        assert text.find(words, at) >= at, (words, text)
        at = text.find(words, at)
    assert f.steps_named()[:2] == [(f.rank, f.step), (f.peer, f.peer_step)]


def test_findings_pass_through_a_users_check_and_only_the_checker_gives_one():
    ctx = Context("allreduce", 2, 0, (8,), 0, 4)
    with pytest.raises(ScheduleError) as e:
        _check_user_schedule(lambda c: swap_sum(c, reduce_twice=True), ctx, "bad")
    f = checker.finding_of(e.value)
    assert (f.kind, f.rank, f.step) == ("reduce", 0, 0)
    assert checker.finding_of(ValueError("rank 0 step 1: not the checker's")) is None
    with pytest.raises(ValueError, match="unknown kind"):
        checker.Finding("mystery")
