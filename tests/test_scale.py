"""ringcomm at the sizes its users run (``make test-scale``, a few minutes): the
checker proves contents at 1,024 and 4,096 ranks and refuses wrong algorithms there;
every rank of a 1,024-rank allreduce, and of a 256-rank run of every other
collective, runs in this one process (``run_schedule(executor="events")``) and ends
with the closed-form result."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import ringcomm  # noqa: F401  (registers the library's algorithms)
from ringcomm.algorithms import BUILTIN, REGISTRY, is_schedule
from ringcomm.execution import checker
from ringcomm.schedule import ScheduleError
from ringcomm.testing import run_schedule
from test_world import pairs_counting_twice

pytestmark = pytest.mark.scale


@pytest.mark.parametrize("name", ["ring", "tree", "double_tree", "rabenseifner"])
def test_allreduce_contents_proved_at_1024_ranks(name):
    layout, seg = checker.shapes("allreduce", 1024, 1)[1]  # uneven chunks
    st = checker.check(REGISTRY["allreduce"][name], "allreduce", 1024, layout, seg=seg)
    assert st.messages >= 1023


@pytest.mark.parametrize("name", ["recursive_doubling", "rabenseifner", "tree"])
def test_allreduce_contents_proved_at_4096_ranks(name):
    st = checker.check(REGISTRY["allreduce"][name], "allreduce", 4096, (4096 + 4095,))
    assert st.rounds >= 12


def _ring_without_its_last_reduction(ctx):
    """Ring allreduce whose rank 0 receives the others' sum of its own chunk in the
    last reduce-scatter step, and never adds it."""
    s = REGISTRY["allreduce"]["ring"](ctx)
    if ctx.rank:
        return s
    steps = list(s.steps)
    steps[ctx.size - 2] = steps[ctx.size - 2]._replace(local=())
    return dataclasses.replace(s, steps=tuple(steps))


def test_a_missing_contribution_is_refused_at_1024_ranks():
    with pytest.raises(ScheduleError, match=r"rank 0 buffer 0 element 0 ends as element 0 from "
                                            r"ranks \{0\}, expected element 0 from ranks "
                                            r"\{0\.\.1023\}"):
        checker.check(_ring_without_its_last_reduction, "allreduce", 1024, (1024,))


def test_a_rank_counted_twice_is_refused_at_4096_ranks():
    with pytest.raises(ScheduleError, match=r"rank 4000 step 0: element 0 would count ranks "
                                            r"\{4001\} twice"):
        checker.check(pairs_counting_twice(4000), "allreduce", 4096, (1,))


ALLREDUCE = sorted(n for c, n in BUILTIN if c == "allreduce" and is_schedule(REGISTRY[c][n]))


@pytest.mark.parametrize("name", ALLREDUCE)
def test_every_builtin_allreduce_on_1024_in_process_ranks(name):
    p, n = 1024, 3000
    bufs = [[torch.arange(n, dtype=torch.float64) + r] for r in range(p)]
    run_schedule(REGISTRY["allreduce"][name], "allreduce", p, (n,), bufs, executor="events")
    want = torch.arange(n, dtype=torch.float64) * p + p * (p - 1) / 2
    bad = [r for r in range(p) if not torch.equal(bufs[r][0], want)]
    assert not bad, f"{name}: ranks {bad[:5]} differ"


def _closed_form(collective: str, p: int, root: int):
    """Inputs of every rank and the results the collective must leave (None: not
    checked), chunks of 1-3 elements valued by rank and chunk."""
    c = [1 + (i % 3) for i in range(p)]
    full = (lambda n, v: torch.full((n,), float(v), dtype=torch.float64))
    junk = (lambda n: torch.full((n,), -1.0, dtype=torch.float64))
    if collective == "broadcast":
        bufs = [[torch.arange(5.0, dtype=torch.float64) if r == root else junk(5)]
                for r in range(p)]
        return (5,), bufs, [[torch.arange(5.0, dtype=torch.float64)] for _ in range(p)]
    if collective == "reduce":
        bufs = [[full(4, r)] for r in range(p)]
        return (4,), bufs, [[full(4, p * (p - 1) / 2) if r == root else None] for r in range(p)]
    if collective == "allgather":
        bufs = [[junk(c[i]) for i in range(p)] + [full(c[r], r)] for r in range(p)]
        return tuple(c), bufs, [[full(c[i], i) for i in range(p)] + [None] for _ in range(p)]
    if collective == "reduce_scatter":
        bufs = [[full(c[i], r + i) for i in range(p)] + [junk(c[r])] for r in range(p)]
        return tuple(c), bufs, [[None] * p + [full(c[r], p * (p - 1) / 2 + p * r)]
                                for r in range(p)]
    if collective == "gather":
        bufs = [[junk(c[i]) if r == root else None for i in range(p)] + [full(c[r], r)]
                for r in range(p)]
        return tuple(c), bufs, [[full(c[i], i) for i in range(p)] + [None] if r == root
                                else [None] * (p + 1) for r in range(p)]
    if collective == "scatter":
        bufs = [[full(c[i], i) if r == root else None for i in range(p)] + [junk(c[r])]
                for r in range(p)]
        return tuple(c), bufs, [[None] * p + [full(c[r], r)] for r in range(p)]
    if collective == "alltoall":
        m = tuple(tuple(1 + (i + j) % 2 for j in range(p)) for i in range(p))
        bufs = [[full(m[r][j], r * p + j) for j in range(p)] + [junk(m[i][r]) for i in range(p)]
                for r in range(p)]
        return m, bufs, [[None] * p + [full(m[i][r], i * p + r) for i in range(p)]
                         for r in range(p)]
    if collective == "barrier":
        return (1,), [[torch.ones(1, dtype=torch.float64)] for _ in range(p)], \
            [[None] for _ in range(p)]
    raise AssertionError(collective)


OTHERS = sorted((c, n) for c, n in BUILTIN if c != "allreduce" and is_schedule(REGISTRY[c][n]))


@pytest.mark.parametrize("collective,name", OTHERS, ids=[f"{c}-{n}" for c, n in OTHERS])
def test_every_other_builtin_collective_on_256_in_process_ranks(collective, name):
    p = 256
    root = 77 if collective in checker.ROOTED else 0
    layout, bufs, want = _closed_form(collective, p, root)
    run_schedule(REGISTRY[collective][name], collective, p, layout, bufs, root=root,
                 executor="events")
    for r in range(p):
        for b, w in enumerate(want[r]):
            if w is not None:
                assert torch.equal(bufs[r][b], w), (collective, name, r, b, bufs[r][b], w)
