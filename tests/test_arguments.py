"""The process group's input checks and method table, without launching ranks."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ringcomm.front import arguments
from ringcomm.front.arguments import Inputs
from ringcomm.front.process_group import METHODS, ProcessGroupRingcomm

# rank 1 of 3; "cpu" runs over NCCL here, so the contiguity rule applies to CPU tensors
G = Inputs(rank=1, size=3, nccl_type="cpu")


def test_every_collective_torch_can_call_is_in_the_table():
    """Each ProcessGroup method torch binds with an ``*Options`` argument (aliases
    such as ``_allgather_base`` included) is served by a request builder."""
    torch_collectives = {
        n for n in dir(dist.ProcessGroup)
        if re.search(r"opts: torch\._C\._distributed_c10d\.\w+Options",
                     getattr(getattr(dist.ProcessGroup, n), "__doc__", "") or "")}
    assert len(torch_collectives) >= 16  # torch 2.11's docstrings match 16, 2.13's 20
    refused = set(ProcessGroupRingcomm.REFUSED)
    assert torch_collectives - refused <= set(METHODS), sorted(torch_collectives - refused
                                                               - set(METHODS))
    for name in METHODS:
        method = getattr(ProcessGroupRingcomm, name)
        assert method.__name__ == name and method.__doc__, name
    pg = ProcessGroupRingcomm(0, 1, None, timedelta(seconds=5), store=dist.HashStore(),
                              cpu_error="unused")
    for name in refused:
        with pytest.raises(RuntimeError, match=f"ringcomm {name} .*not supported"):
            getattr(pg, name)(None)
    pg.shutdown()


def test_options_accepts_what_torch_bindings_accept():
    assert isinstance(arguments.options(None, dist.AllreduceOptions), dist.AllreduceOptions)
    o = dist.BroadcastOptions()
    assert arguments.options(o, dist.BroadcastOptions) is o
    assert arguments.options(dist.ReduceOp.MAX, dist.AllreduceOptions).reduceOp == dist.ReduceOp.MAX
    assert arguments.options(2, dist.ReduceOptions).rootRank == 2
    with pytest.raises(TypeError, match="expected AllreduceOptions, got str"):
        arguments.options("sum", dist.AllreduceOptions)
    with pytest.raises(TypeError, match="expected BarrierOptions, got int"):
        arguments.options(3, dist.BarrierOptions)


# (what is wrong, the call, the exception type, a needle of its message)
REFUSED = [
    ("not a tensor", lambda: G.tensor([1, 2], "allreduce"), TypeError,
     "allreduce: tensor must be a torch.Tensor, got list"),
    ("sparse", lambda: G.tensor(torch.eye(2).to_sparse(), "broadcast"), ValueError,
     "layout torch.sparse_coo; only dense"),
    ("non-contiguous on the NCCL device", lambda: G.tensor(torch.ones(4, 4).t(), "reduce"),
     ValueError, "not contiguous; NCCL needs contiguous"),
    ("two tensors", lambda: G.single([torch.ones(1)] * 2, "allreduce"), ValueError,
     "exactly one tensor (one device per process), got 2"),
    ("no tensor", lambda: G.single([], "allreduce"), ValueError, "got 0"),
    ("root out of range", lambda: G.root(3, "broadcast"), ValueError,
     "root rank 3 is out of range for a group of 3"),
    ("negative root", lambda: G.root(-1, "gather"), ValueError, "root rank -1"),
    ("peer out of range", lambda: G.peer(5, "send"), ValueError, "peer rank 5 is out of range"),
    ("peer is self", lambda: G.peer(1, "recv"), ValueError, "rank 1 cannot recv to/from itself"),
    ("list too short", lambda: G.per_rank([torch.ones(2)] * 2, torch.ones(2), "allgather"),
     ValueError, "has 2 tensors, expected one per rank (3)"),
    ("list dtype", lambda: G.per_rank([torch.ones(2), torch.ones(2, dtype=torch.int64),
                                       torch.ones(2)], torch.ones(2), "allgather"),
     ValueError, "tensor 1 of the list has dtype torch.int64, expected torch.float32"),
    ("own entry of another size",
     lambda: G.per_rank([torch.ones(2), torch.ones(5), torch.ones(2)], torch.ones(2), "allgather"),
     ValueError, "tensor 1 of the list has 5 elements, this rank's tensor has 2"),
    ("non-root passes a list",
     lambda: G.root_list([[torch.ones(1)] * 3], torch.ones(1), 0, "gather", "output"),
     ValueError, "only the root (rank 0) takes outputs"),
    ("root passes two lists",
     lambda: G.root_list([[], []], torch.ones(1), 1, "scatter", "input"),
     ValueError, "the root needs one input list, got 2"),
    ("gathered output too small", lambda: G.gathered(torch.ones(5), torch.ones(2), "ag"),
     ValueError, "output has 5 elements, expected 3 x 2"),
    ("gathered dtypes differ",
     lambda: G.gathered(torch.ones(6, dtype=torch.float64), torch.ones(2), "ag"),
     ValueError, "output dtype torch.float64 != input dtype torch.float32"),
    ("scattered input too small", lambda: G.scattered(torch.ones(2), torch.ones(5)),
     ValueError, "reduce_scatter_tensor: input has 5 elements, expected 3 x 2"),
    ("coalesced counts differ", lambda: G.pairs([torch.ones(1)], [], "agc"), ValueError,
     "1 outputs for 0 inputs"),
    ("coalesced empty", lambda: G.pairs([], [], "agc"), ValueError, "no tensors given"),
    ("coalesced lists in the wrong layout",
     lambda: G.coalesced_lists([[torch.ones(1)] * 3], [torch.ones(1)] * 3, "allgather_coalesced"),
     ValueError, "expected 3 output lists (one per rank), each with 3 tensors"),
    ("all_to_all lists", lambda: G.all_to_all([torch.ones(1)] * 2, [torch.ones(1)] * 3),
     ValueError, "2 output tensors, expected one per rank (3)"),
    ("all_to_all dtypes",
     lambda: G.all_to_all([torch.ones(1)] * 3, [torch.ones(1, dtype=torch.int32)] * 3),
     ValueError, "all tensors must share one dtype"),
    ("all_to_all own sizes",
     lambda: G.all_to_all([torch.ones(1), torch.ones(2), torch.ones(1)], [torch.ones(1)] * 3),
     ValueError, "output 1 has 2 elements but input 1 has 1"),
    ("rows not divisible", lambda: G.split_rows(torch.ones(4, 2), [], "input"), ValueError,
     "input has 4 rows, not divisible by the world size 3; pass split sizes"),
    ("splits not summing", lambda: G.split_rows(torch.ones(4, 2), [1, 1, 1], "output"),
     ValueError, "output split sizes [1, 1, 1] must be 3 non-negative row counts summing to 4"),
    ("negative split", lambda: G.split_rows(torch.ones(4), [5, -1, 0], "input"), ValueError,
     "must be 3 non-negative"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_input_is_named(case):
    _, call, exc, needle = case
    with pytest.raises(exc) as info:
        call()
    assert needle in str(info.value)
    assert str(info.value).startswith("ringcomm")


def test_devices_must_match_within_a_call():
    meta = torch.empty(2, device="meta")
    with pytest.raises(ValueError, match="output is on meta but the call's first tensor is on cpu"):
        G.tensor(meta, "allgather", "output", like=torch.ones(2))


def test_contiguity_is_required_only_on_the_nccl_device():
    strided = torch.ones(4, 4).t()
    assert Inputs(1, 3, nccl_type="cuda").tensor(strided, "allreduce") is strided


def test_good_inputs_pass_and_give_their_parts():
    out, inp = torch.zeros(2), torch.arange(6.0)
    assert [s.tolist() for s in G.scattered(out, inp)] == [[0, 1], [2, 3], [4, 5]]
    assert [s.numel() for s in G.scattered(torch.zeros(0), torch.zeros(0))] == [0, 0, 0]
    assert G.split_rows(torch.ones(6, 2), [], "input") == [(0, 4), (4, 8), (8, 12)]
    assert G.split_rows(torch.ones(4, 3), [0, 3, 1], "input") == [(0, 0), (0, 9), (9, 12)]
    lst = [torch.ones(1), torch.ones(2), torch.ones(7)]  # only this rank's entry must match
    assert G.per_rank(lst, torch.ones(2), "allgather") is lst
    assert G.root_list([], torch.ones(2), 0, "gather", "output") is None
    assert G.root_list([lst], torch.ones(2), 1, "gather", "output") is lst
    # sizes may differ everywhere but in this rank's own slot
    assert G.all_to_all([torch.ones(4), torch.ones(1), torch.ones(0)],
                        [torch.ones(3), torch.ones(1), torch.ones(9)]) is None
