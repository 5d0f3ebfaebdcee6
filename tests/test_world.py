"""The whole-group engine (:mod:`ringcomm.execution.world`) against NCCL's rules as
:class:`ringcomm.execution.nccl_rules.Rules` runs them, message by message: on
random schedules, complete or not, both give the same rounds and counts, or the
same refusal in the same words; and the checker proves contents at sizes past
one machine word of ranks."""
from __future__ import annotations

import dataclasses
import logging
import random

import pytest

from ringcomm.algorithms import REGISTRY, ring
from ringcomm.execution import checker
from ringcomm.execution.nccl_rules import Rules
from ringcomm.execution.world import World
from ringcomm.schedule import Builder, Context, Copy, Reduce, Region, ScheduleError, Step


def _random_steps(rng: random.Random, p: int, events: int, mismatch: float):
    """Per rank a list of steps ``[(sends, recvs)]`` of ``(peer, n)``: random
    exchanges put into random steps, so some complete, some deadlock, some leave a
    message without a partner (a rank's steps cut short) or disagree on a size."""
    steps = [[[[], []] for _ in range(rng.randint(1, 6))] for _ in range(p)]
    for _ in range(events):
        a, b = rng.sample(range(p), 2)
        n = rng.randint(0, 4)
        m = n + 1 if rng.random() < mismatch else n
        rng.choice(steps[a])[0].append((b, n))
        rng.choice(steps[b])[1].append((a, m))
    if rng.random() < 0.2:
        r = rng.randrange(p)
        steps[r] = steps[r][:-1] or [[[], []]]
    return steps


def _by_rules(steps, p: int):
    rules = Rules(p)
    for r, rank_steps in enumerate(steps):
        for i, (sends, recvs) in enumerate(rank_steps):
            ops = [("send", q, n, lambda: None) for q, n in sends]
            ops += [("recv", q, n, lambda data: None) for q, n in recvs]
            rules.add_group(r, ops, f"step {i}")
            rules.add_local(r, lambda: None, f"step {i}")
    try:
        rules.drain()
    except ScheduleError as e:
        return str(e)
    return rules.rounds, rules.busiest_bytes, rules.sent


def _by_world(steps, p: int):
    ranks = []
    for rank_steps in steps:
        regions, compiled = [], []
        for sends, recvs in rank_steps:
            def reg(n):
                regions.append((0, 0, n, False))
                return len(regions) - 1
            compiled.append(([(q, reg(n)) for q, n in sends], [(q, reg(n)) for q, n in recvs],
                             []))
        ranks.append((regions, compiled))
    try:
        counts = World(ranks).run()
    except ScheduleError as e:
        return str(e)
    return counts.rounds, counts.busiest, counts.sent.tolist()


@pytest.mark.parametrize("seed", range(200))
def test_world_runs_the_rounds_of_the_rules(seed):
    rng = random.Random(seed)
    p = rng.randint(2, 7)
    steps = _random_steps(rng, p, rng.randint(1, 14), 0.05)
    assert _by_world(steps, p) == _by_rules(steps, p)


def test_world_refuses_a_peer_that_is_no_other_rank():
    with pytest.raises(ScheduleError, match="rank 1 step 0: send peer 1 is not another rank"):
        World([([(0, 0, 1, True)], [([(1, 0)], [], [])])] * 2)


def _star_missing_one(ctx):
    """Every rank sends to rank 0, which sums all but the last and sends the sum
    back: rank p-1's contribution is left out."""
    b = Builder(ctx)
    n, p, r = ctx.layout[0], ctx.size, ctx.rank
    if r:
        b.step(sends=[(0, (0, 0, n))])
        b.step(recvs=[(0, (0, 0, n))])
        return b.build()
    tmp = b.scratch(n * (p - 1))
    b.step(recvs=[(q, (tmp, (q - 1) * n, n)) for q in range(1, p)],
           local=[Reduce((0, 0, n), (tmp, (q - 1) * n, n)) for q in range(1, p - 1)])
    b.step(sends=[(q, (0, 0, n)) for q in range(1, p)])
    return b.build()


@pytest.mark.parametrize("p", [8, 64, 130])
def test_a_contribution_left_out_is_refused_past_62_ranks(p):
    with pytest.raises(ScheduleError, match=rf"rank 0 buffer 0 element 0 ends as element 0 from "
                                            rf"ranks {{0\.\.{p - 2}}}, expected element 0 from "
                                            rf"ranks {{0\.\.{p - 1}}}" if p > 17 else "ends as"):
        checker.check(_star_missing_one, "allreduce", p, (2,))


def test_an_allreduce_without_steps_is_refused_at_any_size():
    for p in (8, 64, 1024):
        with pytest.raises(ScheduleError, match=r"ends as element 0 from ranks \{0\}, expected"):
            checker.check(lambda ctx: Builder(ctx).build(), "allreduce", p, (1,))


def pairs_counting_twice(victim: int):
    """Pairs of ranks swap and add one element; rank ``victim`` adds its partner's
    twice."""
    def build(ctx):
        b = Builder(ctx)
        t = b.scratch(1)
        peer = ctx.rank ^ 1
        b.step(sends=[(peer, (0, 0, 1))], recvs=[(peer, (t, 0, 1))],
               local=[Reduce((0, 0, 1), (t, 0, 1))] * (2 if ctx.rank == victim else 1))
        return b.build()
    return build


def test_a_rank_counted_twice_is_named_past_62_ranks():
    with pytest.raises(ScheduleError, match=r"allreduce rank 99 step 0: element 0 would count "
                                            r"ranks \{98\} twice"):
        checker.check(pairs_counting_twice(99), "allreduce", 128, (1,))


def _ring_unless_large(ctx):
    """Ring allreduce, but from 100 ranks on rank 0 ends by copying element 1 over
    element 0: a fault of the contents only, which a proof at fewer ranks cannot see."""
    s = ring.allreduce(ctx)
    if ctx.size >= 100 and ctx.rank == 0:
        overwrite = Step((), (), (Copy(Region(0, 0, 1), Region(0, 1, 1)),))
        return dataclasses.replace(s, steps=(*s.steps, overwrite))
    return s


def test_a_users_proof_at_the_groups_size_when_it_fits(caplog):
    from ringcomm.execution.user_checks import LAST_PROOF, check_user_schedule
    with pytest.raises(ScheduleError, match="algorithm 'big' is wrong: allreduce on 128 ranks"):
        check_user_schedule(_ring_unless_large, Context("allreduce", 128, 0, (256,)), "big")
    check_user_schedule(ring.allreduce, Context("allreduce", 128, 0, (256,)), "ring128")
    assert LAST_PROOF[("ring128", "allreduce", 128)].proven == 128
    assert "proven at" not in caplog.text


def test_a_proof_over_its_budget_says_which_size_it_proved(caplog):
    """With no time to spare the contents are proven at 8 ranks only, and rank 0 says
    so; the fault at 128 ranks goes unseen, and nothing claims it was seen."""
    from ringcomm.execution.user_checks import LAST_PROOF, check_user_schedule
    with caplog.at_level(logging.WARNING, "ringcomm"):
        for rank in (0, 1):
            check_user_schedule(_ring_unless_large, Context("allreduce", 128, rank, (256,)),
                                "big", budget_s=0)
    proof = LAST_PROOF[("big", "allreduce", 128)]
    assert (proof.size, proof.proven) == (128, 8)
    assert caplog.text.count("its contents were proven at 8 ranks, not at 128") == 1
    assert "its structure (sizes, matching, no deadlock) was checked at 128 ranks" in caplog.text


def test_a_broken_structure_is_refused_at_the_groups_size_whatever_the_budget():
    def unmatched_above_64(ctx):
        s = ring.allreduce(ctx)
        if ctx.rank == 70:
            return dataclasses.replace(s, steps=s.steps[1:])
        return s
    from ringcomm.execution.user_checks import check_user_schedule
    with pytest.raises(ScheduleError, match="on 128 ranks.*(unmatched|size mismatch|deadlock)"):
        check_user_schedule(unmatched_above_64, Context("allreduce", 128, 0, (256,)), "u",
                            budget_s=0)


def test_proofs_in_slices_prove_and_refuse_alike(monkeypatch):
    """The contents move in parts of SLICE_ELEMENTS elements: a round cut into
    parts of 3 proves what it proves whole, and refuses with the same words."""
    from ringcomm.execution import contents

    whole = {}
    for sliced in (False, True):
        if sliced:
            monkeypatch.setattr(contents, "SLICE_ELEMENTS", 3)
        for name in ("ring", "tree"):
            for layout, seg in checker.shapes("allreduce", 13, 2):
                st = checker.check(REGISTRY["allreduce"][name], "allreduce", 13, layout,
                                   seg=seg)
                whole.setdefault((name, layout), st)
                assert whole[(name, layout)] == st
        with pytest.raises(ScheduleError) as e:
            checker.check(_star_missing_one, "allreduce", 20, (5,))
        whole.setdefault("refusal", str(e.value))
        assert whole["refusal"] == str(e.value)


def test_the_events_executor_refuses_a_region_past_its_buffer():
    """One tensor holds every rank's buffers: a region past its own would read or
    write a neighbour's, so it is refused before anything runs."""
    import torch

    from ringcomm.testing import run_schedule

    def past_the_end(ctx):
        b = Builder(ctx)
        peer = 1 - ctx.rank
        b.step(sends=[(peer, (0, 0, 4))], recvs=[(peer, (0, 2, 4))])  # [2, 6) of 4
        return b.build()
    bufs = [[torch.zeros(4)] for _ in range(2)]
    with pytest.raises(ValueError, match=r"rank 0's region \[2, 6\) of buffer 0 is outside"):
        run_schedule(past_the_end, "allreduce", 2, (4,), bufs, executor="events")
