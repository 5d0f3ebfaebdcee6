"""The hooks section's communication hooks, for both DDPs, and the count of what
each hands to collectives in one iteration.

Each hook runs with the hook of its own implementation: ``ddp.comm_hooks`` on
``ddp/``, torch's ``ddp_comm_hooks`` on torch's DDP. Two of torch 2.13's fail on
CPU (batched PowerSGD, quantization: see docs/ddp.md), and torch's PowerSGD
hook cannot run on gloo with several buckets; those torch rows are skipped with
the reason.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as t_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as t_power

from ddp import comm_hooks as ours

#: PowerSGD compresses from this iteration on (the warm-up runs before it)
START_ITER = 2

TORCH_FAILS = "torch 2.13's hook fails on CPU (docs/ddp.md)"


def _power(rank: int) -> Callable[[Any], Any]:
    return lambda group: t_power.PowerSGDState(
        process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=START_ITER,
        min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)


def _group(group: Any) -> Any:
    return group


#: hook name -> (state factory taking the group, ours, torch's or the reason it is skipped)
HOOKS: dict[str, tuple[Callable[[Any], Any], Callable, Callable | str]] = {
    "allreduce": (_group, ours.allreduce_hook, t_default.allreduce_hook),
    "fp16": (_group, ours.fp16_compress_hook, t_default.fp16_compress_hook),
    "powerSGD r=1": (_power(1), ours.powerSGD_hook, t_power.powerSGD_hook),
    "powerSGD r=4": (_power(4), ours.powerSGD_hook, t_power.powerSGD_hook),
    "batched powerSGD r=1": (_power(1), ours.batched_powerSGD_hook, TORCH_FAILS),
    "quantization": (_group, ours.quantization_pertensor_hook, TORCH_FAILS),
    "noop": (lambda group: None, ours.noop_hook, debugging_hooks.noop_hook),
}


TORCH_RACES = ("torch's PowerSGD hook issues its later allreduces from gloo's callback "
               "threads: with several buckets their order differs between ranks, which "
               "hangs or aborts (docs/ddp.md)")


#: the hooks of a --quick run
QUICK_HOOKS = ("allreduce", "powerSGD r=1", "quantization", "noop")


def hook_names(quick: bool) -> tuple[str, ...]:
    """The hooks the section times."""
    return QUICK_HOOKS if quick else tuple(HOOKS)


def hook_for(name: str, impl: str, backend: str) -> tuple[Callable, Callable[[Any], Any]] | str:
    """(hook, state factory) of ``impl`` (ours, torch) for hook ``name`` on ``backend``,
    or why it is not run."""
    make, mine, theirs = HOOKS[name]
    if impl == "ours":
        return mine, make
    if isinstance(theirs, str):
        return theirs
    if theirs is t_power.powerSGD_hook and backend == "gloo":
        return TORCH_RACES
    return theirs, make


#: how a collective's payload n (one rank's tensor) becomes bytes each rank sends with
#: a bandwidth-optimal algorithm on p ranks
WIRE = {"all_reduce": lambda n, p: 2 * (p - 1) * n / p,
        "all_gather_into_tensor": lambda n, p: (p - 1) * n,
        "all_gather_single": lambda n, p: (p - 1) * n}
WIRE_METHOD = ("bytes each rank sends, with bandwidth-optimal algorithms on p ranks: "
               "allreduce of n bytes 2(p-1)n/p, all-gather of n bytes per rank (p-1)n")


@contextlib.contextmanager
def counted(group: Any) -> Iterator[dict]:
    """Count the collectives on ``group`` that go through ``torch.distributed``'s
    ``all_reduce``, ``all_gather_into_tensor`` and ``all_gather_single`` (what both
    DDPs' Python hooks call):
    ``{"collectives", "payload_bytes", "wire_bytes"}``, filled while the block runs."""
    tally = {"collectives": 0, "payload_bytes": 0, "wire_bytes": 0.0}
    p = dist.get_world_size(group)
    originals = {name: getattr(dist, name) for name in WIRE if hasattr(dist, name)}

    def counting(name: str) -> Callable:
        original = originals[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if name == "all_reduce" else (args[1] if len(args) > 1
                                                          else kwargs["input_tensor"])
            if kwargs.get("group", group) is group:
                n = tensor.numel() * tensor.element_size()
                tally["collectives"] += 1
                tally["payload_bytes"] += n
                tally["wire_bytes"] += WIRE[name](n, p)
            return original(*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        yield tally
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
