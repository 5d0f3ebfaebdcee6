"""Checks of a call's arguments: pure functions of the arguments and the group's
shape (rank, size, which device type runs over NCCL), run before anything is
sent, so a bad call is refused on the caller's thread with a message that names
the operation and the argument at fault. No ranks are needed to test them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist


def options(opts: Any, cls: type) -> Any:
    """``opts`` as a ``cls`` (a torch ``*Options`` class). Accepts what torch's own
    ProcessGroup bindings accept from Python callers: an options object, None, a
    ReduceOp (DDP's join passes one) or a root rank."""
    if opts is None:
        return cls()
    if isinstance(opts, cls):
        return opts
    out = cls()
    if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)) and hasattr(out, "reduceOp"):
        out.reduceOp = opts
        return out
    if isinstance(opts, int) and not isinstance(opts, bool) and hasattr(out, "rootRank"):
        out.rootRank = opts
        return out
    raise TypeError(f"ringcomm: expected {cls.__name__}, got {type(opts).__name__}")


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The checks of one group: this rank, the group size, and the device type
    whose tensors run over NCCL (which needs them contiguous)."""

    rank: int
    size: int
    nccl_type: str = "cuda"

    def tensor(self, t: Any, op: str, what: str = "tensor",
               like: torch.Tensor | None = None) -> torch.Tensor:
        """One tensor argument; ``like``: a tensor of the same call it must share a
        device with."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ringcomm {op}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"ringcomm {op}: {what} has layout {t.layout}; only dense tensors")
        if like is not None and t.device != like.device:
            raise ValueError(f"ringcomm {op}: {what} is on {t.device} but the call's first "
                             f"tensor is on {like.device}; one call takes tensors of one device")
        if t.device.type == self.nccl_type and not t.is_contiguous():
            raise ValueError(f"ringcomm {op}: {what} on {t.device} is not contiguous; NCCL "
                             "needs contiguous tensors (pass t.contiguous())")
        return t

    def single(self, tensors: Any, op: str) -> torch.Tensor:
        """The one tensor of torch's one-device-per-process list."""
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if len(tensors) != 1:
            raise ValueError(f"ringcomm {op}: expected a list with exactly one tensor "
                             f"(one device per process), got {len(tensors)}")
        return self.tensor(tensors[0], op)

    def same_dtype(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        if out.dtype != inp.dtype:
            raise ValueError(f"ringcomm {op}: output dtype {out.dtype} != input dtype {inp.dtype}")

    def root(self, root: int, op: str) -> int:
        if not 0 <= root < self.size:
            raise ValueError(f"ringcomm {op}: root rank {root} is out of range for a group "
                             f"of {self.size}")
        return root

    def peer(self, peer: int, op: str, device: torch.device | None = None) -> int:
        where = "" if device is None else f" of a tensor on {device}"
        if not 0 <= peer < self.size:
            raise ValueError(f"ringcomm {op}{where}: peer rank {peer} is out of range for a "
                             f"group of {self.size}")
        if peer == self.rank:
            raise ValueError(f"ringcomm {op}{where}: rank {peer} cannot {op} to/from itself")
        return peer

    def per_rank(self, lst: list, like: torch.Tensor, op: str) -> list[torch.Tensor]:
        """A list of one tensor per rank, of ``like``'s dtype and device, whose entry
        for this rank has ``like``'s size (torch's rule; other entries may differ)."""
        if len(lst) != self.size:
            raise ValueError(f"ringcomm {op}: the tensor list has {len(lst)} tensors, "
                             f"expected one per rank ({self.size})")
        for i, x in enumerate(lst):
            self.tensor(x, op, f"tensor {i} of the list", like)
            if x.dtype != like.dtype:
                raise ValueError(f"ringcomm {op}: tensor {i} of the list has dtype {x.dtype}, "
                                 f"expected {like.dtype}")
        if lst[self.rank].numel() != like.numel():
            raise ValueError(f"ringcomm {op}: tensor {self.rank} of the list has "
                             f"{lst[self.rank].numel()} elements, this rank's tensor has "
                             f"{like.numel()}")
        return lst

    def root_list(self, lists: list, like: torch.Tensor, root: int, op: str,
                  what: str) -> list[torch.Tensor] | None:
        """The root's per-rank list of gather/scatter; None on the other ranks,
        which must pass none."""
        if self.rank == root:
            if len(lists) != 1:
                raise ValueError(f"ringcomm {op}: the root needs one {what} list, got {len(lists)}")
            return self.per_rank(lists[0], like, op)
        if lists and any(len(x) for x in lists):
            raise ValueError(f"ringcomm {op}: only the root (rank {root}) takes {what}s")
        return None

    def gathered(self, out: torch.Tensor, inp: torch.Tensor, op: str,
                 like: torch.Tensor | None = None) -> None:
        """``out`` holds one ``inp`` per rank (all_gather_into_tensor)."""
        self.tensor(inp, op, "input", like)
        self.tensor(out, op, "output", inp)
        self.same_dtype(out, inp, op)
        if out.numel() != inp.numel() * self.size:
            raise ValueError(f"ringcomm {op}: output has {out.numel()} elements, expected "
                             f"{self.size} x {inp.numel()} (world size x input)")

    def scattered(self, out: torch.Tensor, inp: torch.Tensor,
                  op: str = "reduce_scatter_tensor") -> list[torch.Tensor]:
        """``inp`` holds one ``out`` per rank (reduce_scatter_tensor); returns its
        per-rank slices."""
        self.tensor(out, op, "output")
        self.tensor(inp, op, "input", out)
        self.same_dtype(out, inp, op)
        if inp.numel() != out.numel() * self.size:
            raise ValueError(f"ringcomm {op}: input has {inp.numel()} elements, expected "
                             f"{self.size} x {out.numel()} (world size x output)")
        if not out.numel():
            return [inp.reshape(-1)[:0]] * self.size
        return list(inp.reshape(-1).view(self.size, -1).unbind(0))

    def pairs(self, outputs: list, inputs: list, op: str) -> None:
        """The coalesced calls: one output per input, at least one."""
        if len(outputs) != len(inputs):
            raise ValueError(f"ringcomm {op}: {len(outputs)} outputs for {len(inputs)} inputs")
        if not inputs:
            raise ValueError(f"ringcomm {op}: no tensors given")

    def coalesced_lists(self, output_lists: list, inputs: list, op: str) -> None:
        """all_gather_coalesced in torch's layout: ``output_lists[rank][input]``."""
        if not inputs:
            raise ValueError(f"ringcomm {op}: no input tensors given")
        if len(output_lists) != self.size or any(len(o) != len(inputs) for o in output_lists):
            raise ValueError(f"ringcomm {op}: expected {self.size} output lists (one per rank), "
                             f"each with {len(inputs)} tensors (one per input); got lists of "
                             f"lengths {[len(o) for o in output_lists]}")
        for i, x in enumerate(inputs):
            self.tensor(x, op, f"input {i}", like=inputs[0])
            self.per_rank([output_lists[r][i] for r in range(self.size)], x, op)

    def all_to_all(self, outputs: list, inputs: list, op: str = "all_to_all") -> None:
        for what, lst in (("output", outputs), ("input", inputs)):
            if len(lst) != self.size:
                raise ValueError(f"ringcomm {op}: {len(lst)} {what} tensors, expected one "
                                 f"per rank ({self.size})")
        for i, (o, x) in enumerate(zip(outputs, inputs)):
            self.tensor(o, op, f"output {i}", inputs[0])
            self.tensor(x, op, f"input {i}", inputs[0])
            if o.dtype != inputs[0].dtype or x.dtype != inputs[0].dtype:
                raise ValueError(f"ringcomm {op}: all tensors must share one dtype")
        me = self.rank
        if outputs[me].numel() != inputs[me].numel():
            raise ValueError(f"ringcomm {op}: output {me} has {outputs[me].numel()} elements "
                             f"but input {me} has {inputs[me].numel()}")

    def split_rows(self, t: torch.Tensor, splits: list[int], what: str,
                   op: str = "all_to_all_single") -> list[tuple[int, int]]:
        """Element bounds of each rank's rows of ``t`` (all_to_all_single): equal
        splits when ``splits`` is empty, else the given row counts (zeros allowed)."""
        p = self.size
        rows = t.shape[0] if t.dim() else 1
        if not splits:
            if rows % p:
                raise ValueError(f"ringcomm {op}: {what} has {rows} rows, not divisible by "
                                 f"the world size {p}; pass split sizes")
            splits = [rows // p] * p
        if len(splits) != p or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"ringcomm {op}: {what} split sizes {splits} must be {p} "
                             f"non-negative row counts summing to {rows}")
        per_row = t.numel() // rows if rows else 0
        bounds, a = [], 0
        for s in splits:
            bounds.append((a * per_row, (a + s) * per_row))
            a += s
        return bounds
