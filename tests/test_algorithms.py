"""Every registered algorithm on in-process ranks (threads) for world sizes 1-8,
against a single-process computation. Fast, so it covers sizes and shapes the
multi-process tests cannot afford."""
from __future__ import annotations

import pytest
import torch

from ringcomm import ops
from ringcomm.algorithms import REGISTRY, common
from ringcomm.testing import run_ranks

WORLD = [1, 2, 3, 4, 5, 6, 7, 8]
SEGMENT_BYTES = [8, 64, 1 << 20]  # many segments (window wraps), a few, one


def inputs(p: int, n: int, dtype=torch.int64) -> list[torch.Tensor]:
    return [torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(r * 97 + n))
            .to(dtype) for r in range(p)]


@pytest.mark.parametrize("p", WORLD)
@pytest.mark.parametrize("algo", sorted(REGISTRY["allreduce"]))
@pytest.mark.parametrize("seg", SEGMENT_BYTES)
def test_allreduce(p, algo, seg):
    for n in (0, 1, p - 1, p, 7, 103):
        xs = inputs(p, n)
        want = torch.stack(xs).sum(0)
        bufs = [x.clone() for x in xs]
        run_ranks(p, lambda tp: REGISTRY["allreduce"][algo](tp, bufs[tp.rank], ops.SUM,
                                                             segment_bytes=seg))
        for r in range(p):
            assert torch.equal(bufs[r], want), (p, algo, seg, n, r)


@pytest.mark.parametrize("p", WORLD)
@pytest.mark.parametrize("op", [ops.MAX, ops.MIN, ops.PRODUCT, ops.BXOR])
def test_allreduce_ops(p, op):
    xs = [torch.randint(1, 4, (50,), generator=torch.Generator().manual_seed(r)) for r in range(p)]
    wide = torch.stack(xs)
    want = {ops.MAX: wide.amax(0), ops.MIN: wide.amin(0), ops.PRODUCT: wide.prod(0),
            ops.BXOR: xs[0].clone()}[op]
    if op == ops.BXOR:
        for x in xs[1:]:
            want = want ^ x
    for algo, fn in REGISTRY["allreduce"].items():
        bufs = [x.clone() for x in xs]
        run_ranks(p, lambda tp: fn(tp, bufs[tp.rank], op, segment_bytes=16))
        assert all(torch.equal(b, want) for b in bufs), (algo, op)


@pytest.mark.parametrize("p", WORLD)
@pytest.mark.parametrize("algo", sorted(REGISTRY["broadcast"]))
def test_broadcast_every_root(p, algo):
    for root in range(p):
        for n in (0, 1, 33):
            xs = inputs(p, n)
            bufs = [x.clone() for x in xs]
            run_ranks(p, lambda tp: REGISTRY["broadcast"][algo](tp, bufs[tp.rank], root,
                                                                 segment_bytes=24))
            assert all(torch.equal(b, xs[root]) for b in bufs), (p, algo, root, n)


@pytest.mark.parametrize("p", WORLD)
def test_reduce_every_root(p):
    for root in range(p):
        xs = inputs(p, 41)
        bufs = [x.clone() for x in xs]
        run_ranks(p, lambda tp: REGISTRY["reduce"]["tree"](tp, bufs[tp.rank], ops.SUM, root,
                                                            segment_bytes=16))
        assert torch.equal(bufs[root], torch.stack(xs).sum(0)), (p, root)


@pytest.mark.parametrize("p", WORLD)
def test_reduce_scatter_and_allgather_uneven(p):
    lengths = [(3 * i) % 5 for i in range(p)]  # includes empty chunks
    blocks = [[torch.randint(-9, 9, (ln,), generator=torch.Generator().manual_seed(r * 31 + i))
               for i, ln in enumerate(lengths)] for r in range(p)]
    work = [[b.clone() for b in rank_blocks] for rank_blocks in blocks]
    run_ranks(p, lambda tp: REGISTRY["reduce_scatter"]["ring"](tp, work[tp.rank], ops.SUM,
                                                                segment_bytes=8))
    for r in range(p):
        assert torch.equal(work[r][r], sum(blocks[q][r] for q in range(p))), (p, r)
    gathered = [[torch.full((ln,), -1, dtype=torch.int64) for ln in lengths] for _ in range(p)]
    for r in range(p):
        gathered[r][r].copy_(blocks[r][r])
    run_ranks(p, lambda tp: REGISTRY["allgather"]["ring"](tp, gathered[tp.rank], segment_bytes=8))
    for r in range(p):
        for i in range(p):
            assert torch.equal(gathered[r][i], blocks[i][i]), (p, r, i)


@pytest.mark.parametrize("p", WORLD)
def test_barrier_waits_for_everyone(p):
    import threading
    arrived = []
    lock = threading.Lock()

    def body(tp):
        with lock:
            arrived.append(tp.rank)
        REGISTRY["barrier"]["dissemination"](tp, segment_bytes=0)
        with lock:
            return len(arrived)

    assert run_ranks(p, body) == [p] * p


def test_bf16_and_fp16_exact():
    for dtype in (torch.bfloat16, torch.float16):
        xs = inputs(5, 77, dtype)
        want = torch.stack([x.double() for x in xs]).sum(0).to(dtype)
        for algo, fn in REGISTRY["allreduce"].items():
            bufs = [x.clone() for x in xs]
            run_ranks(5, lambda tp: fn(tp, bufs[tp.rank], ops.SUM, segment_bytes=32))
            assert all(torch.equal(b, want) for b in bufs), (dtype, algo)


def test_mismatched_sizes_fail_instead_of_hanging():
    bufs = [torch.ones(10), torch.ones(20)]
    with pytest.raises(RuntimeError):
        run_ranks(2, lambda tp: REGISTRY["allreduce"]["tree"](tp, bufs[tp.rank], ops.SUM,
                                                               segment_bytes=1 << 20),
                  timeout_s=2)


def test_tree_shapes():
    for p in range(1, 20):
        for root in range(p):
            edges = {}
            for r in range(p):
                parent, kids = common.binomial(r, p, root)
                assert (parent is None) == (r == root)
                for k in kids:
                    assert common.binomial(k, p, root)[0] == r
                edges[r] = parent
            for r in range(p):  # every rank reaches the root in at most log2 p hops
                hops, x = 0, r
                while edges[x] is not None:
                    x, hops = edges[x], hops + 1
                assert x == root and hops <= max(p - 1, 0).bit_length()


def test_split_even():
    t = torch.arange(10)
    parts = common.split_even(t, 4)
    assert [x.numel() for x in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat(parts), t)
    assert [x.numel() for x in common.split_even(torch.arange(2), 5)] == [1, 1, 0, 0, 0]
