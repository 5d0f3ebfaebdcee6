"""DistributedDataParallel: the module wrapper users see.

It mirrors ``torch.nn.parallel.DistributedDataParallel`` (same constructor
arguments for the features it has, ``module``, ``no_sync``,
``register_comm_hook``, a state_dict with the same ``module.`` prefix), so a
training script switches by changing one import. The gradient machinery is in
:mod:`ddp.reducer`; bucket layout in :mod:`ddp.buckets`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddp.buckets import FIRST_BUCKET_CAP_BYTES, MB
from ddp.comm_hooks import CommHook
from ddp.reducer import Reducer
from ringcomm import trace

__all__ = ["DistributedDataParallel", "describe_mismatch"]

#: Parameters and buffers are broadcast in flat chunks of at most this many bytes:
#: one collective per chunk instead of one per tensor, bounded extra memory.
BROADCAST_CHUNK_BYTES = 64 * MB

# One entry of a model description: kind ("parameter"/"buffer"), name, shape,
# dtype and requires_grad. Everything but the name must agree across ranks.
Entry = tuple[str, str, list[int], str, bool]


def _entries(named_params: Sequence[tuple[str, torch.Tensor]],
             named_buffers: Sequence[tuple[str, torch.Tensor]]) -> list[Entry]:
    out: list[Entry] = []
    for kind, named in (("parameter", named_params), ("buffer", named_buffers)):
        for name, t in named:
            out.append((kind, name, list(t.shape), str(t.dtype),
                        bool(t.requires_grad) if kind == "parameter" else False))
    return out


def _key(e: Entry | None) -> tuple | None:
    return None if e is None else (e[0], tuple(e[2]), e[3], e[4])


def _fmt(e: Entry | None) -> str:
    if e is None:
        return "nothing there"
    kind, name, shape, dtype, rg = e
    extra = "" if kind == "buffer" else f", requires_grad={rg}"
    return f"{kind} '{name}' of shape {tuple(shape)}, dtype {dtype}{extra}"


def describe_mismatch(per_rank: Sequence[Sequence[Entry]]) -> str | None:
    """Name the first parameter or buffer whose shape, dtype or requires_grad differs.

    Args:
        per_rank: each rank's model description (parameters in registration order,
            then buffers; lists where JSON turned tuples into lists are fine).
    Returns:
        A message naming the position, each rank's entry there and which ranks
        hold which, or None when all ranks agree.
    """
    ranks = [[tuple(e) for e in entries] for entries in per_rank]
    longest = max(len(e) for e in ranks)
    for pos in range(longest):
        at = [e[pos] if pos < len(e) else None for e in ranks]
        keys = [_key(a) for a in at]
        if len(set(keys)) == 1:
            continue
        holders: dict[tuple | None, list[int]] = {}
        for r, k in enumerate(keys):
            holders.setdefault(k, []).append(r)
        parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: "
                 f"{_fmt(at[rs[0]])}" for rs in holders.values()]
        first = next(r for r, a in enumerate(at) if a is not None)
        kind, name = at[first][0], at[first][1]
        kind_pos = sum(1 for e in ranks[first][:pos] if e[0] == kind)
        msg = (f"the wrapped model differs across ranks at {kind} #{kind_pos} ('{name}'): "
               + "; ".join(parts))
        counts = [(sum(e[0] == "parameter" for e in r), sum(e[0] == "buffer" for e in r))
                  for r in ranks]
        if len(set(counts)) > 1:
            msg += " (numbers differ: " + "; ".join(
                f"rank {r}: {p} parameters, {b} buffers" for r, (p, b) in enumerate(counts)) + ")"
        return msg + (". Every rank must wrap the same model: the same parameters and "
                      "buffers with the same shapes, dtypes and requires_grad, in the same order.")
    return None


def _gather(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def verify_same_model(named_params: Sequence[tuple[str, torch.Tensor]],
                      named_buffers: Sequence[tuple[str, torch.Tensor]],
                      group: dist.ProcessGroup, device: torch.device) -> None:
    """Check, with one small all_gather, that every rank has the same parameters and buffers.

    Each rank sends a fixed-size fingerprint (counts and a digest of shapes, dtypes
    and requires_grad). Only when fingerprints differ do ranks exchange their full
    descriptions, so every rank can name the first mismatch and all raise the same
    error: no rank goes on to a broadcast the others will never join.

    Args:
        named_params: (name, parameter) in registration order.
        named_buffers: (name, buffer) in registration order.
        group: the group whose ranks must agree.
        device: where the exchanged tensors live (one the group's backend supports).
    Raises:
        RuntimeError: on every rank, when the descriptions differ.
    """
    entries = _entries(named_params, named_buffers)
    blob = json.dumps([_key(e) for e in entries]).encode()
    digest = int.from_bytes(hashlib.sha256(blob).digest()[:8], "little", signed=True)
    n_params = len(named_params)
    mine = torch.tensor([n_params, len(entries) - n_params, digest], dtype=torch.int64,
                        device=device)
    rows = _gather(mine, group)
    if all(torch.equal(r, rows[0]) for r in rows):
        return
    payload = json.dumps(entries).encode()
    sizes = _gather(torch.tensor([len(payload)], dtype=torch.int64, device=device), group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    blobs = _gather(buf.to(device), group)
    per_rank = [json.loads(bytes(b[:int(s.item())].cpu().numpy()))
                for b, s in zip(blobs, sizes)]
    msg = describe_mismatch(per_rank) or "the fingerprints of the model differ across ranks"
    raise RuntimeError(f"DistributedDataParallel (rank {dist.get_rank(group)} of "
                       f"{dist.get_world_size(group)}): {msg}")


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup,
                        chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> None:
    """Overwrite ``tensors`` on every rank with group rank 0's values, in flat chunks.

    Tensors are grouped by dtype and device (one collective moves one dtype) and
    packed into chunks of at most ``chunk_bytes`` (a larger tensor travels alone).
    Every rank of ``group`` must call it with tensors of the same shapes and dtypes.

    Args:
        tensors: written in place (call under ``torch.no_grad()`` for parameters).
        group: the group; its rank 0 is the source.
        chunk_bytes: upper bound on one broadcast's size.
    """
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    root = dist.get_rank(group) == 0
    for ts in by_kind.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in ts + [None]:
            nbytes = 0 if t is None else t.numel() * t.element_size()
            if chunk and (t is None or size + nbytes > chunk_bytes):
                flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                dist.broadcast(flat, group=group, group_src=0)
                if not root:
                    offset = 0
                    for c in chunk:
                        c.detach().copy_(flat[offset:offset + c.numel()].view(c.shape))
                        offset += c.numel()
                chunk, size = [], 0
            if t is not None:
                chunk.append(t)
                size += nbytes


class DistributedDataParallel(nn.Module):
    """Data-parallel training: wrap a model; gradients are averaged across ranks in backward.

    All ranks start from rank 0's parameters and buffers; after each
    ``loss.backward()`` every ``param.grad`` holds the gradient averaged over the
    group, so identical optimizer steps keep the replicas identical. Gradients
    are reduced in buckets while backward is still running.

    Args:
        module: the model; every rank must pass the same architecture.
        process_group: group to train over (default: the default group). Any
            backend works (ringcomm, gloo, mpi); only all_reduce, broadcast,
            all_gather are used.
        bucket_cap_mb: bucket size cap in MiB (the first bucket is capped at
            ``min(1, bucket_cap_mb)`` MiB so communication starts early). 0 gives
            every parameter its own bucket (one allreduce per parameter), as in
            torch's DDP.
        find_unused_parameters: walk the autograd graph after each forward to
            find parameters that get no gradient this iteration, so their buckets
            need not wait for them; parameters no rank used keep ``grad``
            unchanged. Needed whenever some parameters can go unused.
        gradient_as_bucket_view: make each ``param.grad`` a view into its bucket,
            saving one copy and the memory of one gradient per parameter.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to
            all ranks at construction and before each forward. With False, buffers
            are never synchronized, not even at construction (as in torch).
    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``bucket_cap_mb`` is negative or not a number, or this process
            is not in ``process_group``.
        RuntimeError: no process group is initialized; the model differs across
            ranks (on every rank); no parameter requires a gradient; the model has
            sparse embeddings.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float | None = 25, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, broadcast_buffers: bool = True):
        super().__init__()
        # Local argument checks first: they raise identically on every rank before
        # any collective.
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, "
                            f"got {type(module).__name__}")
        if bucket_cap_mb is None:
            bucket_cap_mb = 25
        if not bucket_cap_mb >= 0:  # also refuses NaN
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be 0 (one bucket "
                             f"per parameter) or positive, got {bucket_cap_mb}")
        if process_group is None:
            if not dist.is_initialized():
                raise RuntimeError("DistributedDataParallel: no process group; call "
                                   "torch.distributed.init_process_group first")
            process_group = dist.distributed_c10d._get_default_group()
        if dist.get_rank(process_group) < 0:
            raise ValueError("DistributedDataParallel: this process is not a member of "
                             "the given process group")

        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_bytes_cap = int(bucket_cap_mb * MB)
        self.world_size = dist.get_world_size(process_group)

        named_params = list(module.named_parameters())  # shared parameters appear once
        named_buffers = list(module.named_buffers())
        device = named_params[0][1].device if named_params else torch.device("cpu")
        # Before anything else: a mismatch would make later collectives disagree in
        # size (hang or garbage); the fingerprint turns that into an error everywhere.
        verify_same_model(named_params, named_buffers, process_group, device)

        trainable = [(n, p) for n, p in named_params if p.requires_grad]
        if not trainable:
            raise RuntimeError("DistributedDataParallel: the module has no parameter that "
                               "requires a gradient; there is nothing to synchronize")
        for name, m in module.named_modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
                raise RuntimeError(f"DistributedDataParallel: '{name}' produces sparse "
                                   "gradients, which this implementation does not reduce; "
                                   "use sparse=False")

        # As torch does, broadcast_buffers=False also leaves buffers out of this
        # first broadcast, so rank-local buffers stay rank-local.
        start_state = [p for _, p in named_params]
        if broadcast_buffers:
            start_state += [b for _, b in named_buffers]
        with torch.no_grad():
            broadcast_coalesced(start_state, process_group)
        self._sync_buffer_list = [b for _, b in named_buffers]

        self.reducer = Reducer(
            [p for _, p in trainable], [n for n, _ in trainable], process_group,
            self.bucket_bytes_cap, min(FIRST_BUCKET_CAP_BYTES, self.bucket_bytes_cap),
            find_unused_parameters, gradient_as_bucket_view)
        # As in torch: a backward is synchronized when its forward ran with grad
        # enabled outside no_sync; buffers are synced before a forward that follows
        # such a forward (or the first one).
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; arm gradient synchronization for the coming backward.

        Raises:
            RuntimeError: the previous synchronized backward never finished reducing.
        """
        with trace.span("forward", "ddp"):
            return self._forward(*inputs, **kwargs)

    def _forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self.reducer.check_idle()
            # Before the forward allocates activations: the old and new buckets
            # briefly coexist.
            self.reducer.rebuild_buckets()
        if (self.require_forward_param_sync and self.broadcast_buffers
                and self._sync_buffer_list and self.world_size > 1):
            with torch.no_grad():
                broadcast_coalesced(self._sync_buffer_list, self.process_group)
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            self.reducer.prepare_for_backward(output)
        else:
            self.require_forward_param_sync = False
            if torch.is_grad_enabled():
                self.reducer.disarm()
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward accumulates gradients locally with no communication.

        The first synchronized backward after leaving the context averages the
        accumulated gradients. What counts is where the *forward* ran: a forward
        inside ``no_sync`` gives an unsynchronized backward.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> torch.futures.Future``.

        The future must hold a tensor shaped like ``bucket.buffer()``: the bucket
        averaged over the group. ``ddp.comm_hooks`` has ``allreduce_hook``,
        ``fp16_compress_hook`` and ``bf16_compress_hook`` (their ``state`` is a
        process group, or None for this wrapper's group); torch's own DDP hooks
        work too. Call it on every rank, once, before the first forward.

        Raises:
            TypeError: ``hook`` is not callable.
            RuntimeError: a hook is already registered or training has started.
        """
        self.reducer.register_comm_hook(state, hook)
