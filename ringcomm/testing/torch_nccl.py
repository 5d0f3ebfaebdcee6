"""A stand-in for torch's own NCCL backend (``ProcessGroupNCCL``) where torch has
none, as CPU builds do: ``dist.new_group(backend="nccl")`` then goes through
torch's own group set-up (``_new_process_group_helper``: split source, options,
sequence numbers, registration) to a gloo group in NCCL's place, which serves
CPU tensors as the reference a GPU run would get from NCCL.

It refuses what ``ProcessGroupNCCL`` refuses at set-up: ``Options.split_from``
takes only a ``ProcessGroupNCCL`` (torch's binding raises a TypeError for anything
else), so a backend that torch offers as the split source of an NCCL group fails
here as it does on a GPU::

    with torch_nccl():
        ref = dist.new_group(backend="nccl")   # a gloo group, made as NCCL's would be
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch.distributed as dist

__all__ = ["torch_nccl", "install", "StandInProcessGroupNCCL"]


class _Options:
    """``ProcessGroupNCCL.Options``: the fields torch's set-up writes."""

    def __init__(self, is_high_priority_stream: bool = False):
        self.is_high_priority_stream = is_high_priority_stream
        self._timeout = None
        self._split_from: Any = None
        self.split_color = 0
        self.global_ranks_in_group: list[int] = []
        self.group_name = ""
        #: every object torch offered as ``split_from`` (None included)
        self.offered: list[Any] = []

    @property
    def split_from(self) -> Any:
        return self._split_from

    @split_from.setter
    def split_from(self, value: Any) -> None:
        self.offered.append(value)
        if value is not None and not isinstance(value, StandInProcessGroupNCCL):
            # the message torch's binding gives for an argument of the wrong type
            raise TypeError("(): incompatible function arguments. The following argument "
                            "types are supported:\n    1. (self: torch._C._distributed_c10d."
                            "ProcessGroupNCCL.Options, arg0: torch._C._distributed_c10d."
                            f"ProcessGroupNCCL) -> None\n\nInvoked with: {value!r}")
        self._split_from = value


class StandInProcessGroupNCCL(dist.ProcessGroupGloo):
    """A gloo backend in ``ProcessGroupNCCL``'s place, made from NCCL's options."""

    Options = _Options
    #: the options of every group made, in order (for tests)
    made: list[_Options] = []

    def __init__(self, store: Any, rank: int, size: int, options: _Options | None = None,
                 device_id: Any = None):
        options = options if options is not None else _Options()
        super().__init__(store, rank, size, options._timeout)
        self.options_given = options
        StandInProcessGroupNCCL.made.append(options)

    def perform_nocolor_split(self, device: Any) -> None:
        """A rank outside a group split from this one: nothing to make."""


def install() -> Callable[[], None]:
    """From now on, torch's ``new_group(backend="nccl")`` makes a
    :class:`StandInProcessGroupNCCL` (for CPU and CUDA tensors: the host's tensors
    are what a CPU machine has), and ``torch.cuda.nccl.version()``, which torch's
    logging asks when an "nccl" group's call fails, answers ``(0, 0, 0)``. Returns
    what undoes it (a group made meanwhile keeps working, but its failures then
    ask a CPU torch for an NCCL version it lacks)."""
    import torch.cuda.nccl as cuda_nccl

    c10d = dist.distributed_c10d
    # torch 2.15 makes "nccl" groups as ProcessGroupNCCL2 (same options, a device)
    classes = ("ProcessGroupNCCL", "ProcessGroupNCCL2")
    saved = {name: getattr(c10d, name, None) for name in (*classes, "is_nccl_available")}
    caps = dist.Backend.backend_capability
    saved_caps, saved_version = caps.get("nccl"), cuda_nccl.version
    for name in classes:
        setattr(c10d, name, StandInProcessGroupNCCL)
    c10d.is_nccl_available = lambda: True
    caps["nccl"] = ["cpu", "cuda"]
    cuda_nccl.version = lambda: (0, 0, 0)

    def undo() -> None:
        for name, value in saved.items():
            if value is None:
                delattr(c10d, name)
            else:
                setattr(c10d, name, value)
        caps["nccl"] = saved_caps
        cuda_nccl.version = saved_version

    return undo


@contextlib.contextmanager
def torch_nccl() -> Iterator[type[StandInProcessGroupNCCL]]:
    """:func:`install` within the block. Yields the class; its ``made`` lists the
    options of the groups made."""
    undo = install()
    try:
        yield StandInProcessGroupNCCL
    finally:
        undo()
