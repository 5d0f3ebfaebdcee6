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
import time
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ddp.buckets import FIRST_BUCKET_CAP_BYTES, MB
from ddp.comm_hooks import CommHook
from ddp.delayed import DelayedAllreduce
from ddp.mixed_precision import MixedPrecision
from ddp.reducer import Reducer
from ringcomm import trace

#: Under torch.compile, what DDP does around the module's forward (collectives, hooks
#: on the outputs, clocks) runs eagerly. torch's lazy form of torch.compiler.disable
#: imports torch._dynamo at the first call, not at ``import ddp`` (2 s of a 3 s
#: import); torch's optimizers import it when they are made, so a training loop
#: pays nothing more
_eager = torch._disable_dynamo

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
                        chunk_bytes: int = BROADCAST_CHUNK_BYTES, src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with group rank ``src``'s values, in flat chunks.

    Tensors are grouped by dtype and device (one collective moves one dtype) and
    packed into chunks of at most ``chunk_bytes`` (a larger tensor travels alone).
    Every rank of ``group`` must call it with tensors of the same shapes and dtypes.

    Args:
        tensors: written in place (call under ``torch.no_grad()`` for parameters).
        group: the group.
        chunk_bytes: upper bound on one broadcast's size.
        src: the group rank whose values everyone gets.
    """
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    root = dist.get_rank(group) == src
    for ts in by_kind.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in ts + [None]:
            nbytes = 0 if t is None else t.numel() * t.element_size()
            if chunk and (t is None or size + nbytes > chunk_bytes):
                flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                dist.broadcast(flat, group=group, group_src=src)
                if not root:
                    offset = 0
                    for c in chunk:
                        c.detach().copy_(flat[offset:offset + c.numel()].view(c.shape))
                        offset += c.numel()
                chunk, size = [], 0
            if t is not None:
                chunk.append(t)
                size += nbytes


def _common_rank(mine: int | None, group: dist.ProcessGroup, device: torch.device) -> int:
    """The largest group rank among those that offer themselves (``mine`` not None); a
    collective: every rank calls it."""
    t = torch.tensor([-1 if mine is None else mine], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


class _JoinHook(JoinHook):
    """What a rank that ran out of inputs does while the others still train
    (:meth:`DistributedDataParallel.join`): each iteration, the collectives of one
    training iteration, in the order the training ranks issue them
    (:meth:`DistributedDataParallel._pre_forward`, then backward), with zero
    gradients; at the end, the final model from the last rank to join."""

    def __init__(self, ddp: "DistributedDataParallel", divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.rebuild_buckets()
        ddp._sync_buffers_before_forward(training=False)
        sync = torch.zeros(1, device=ddp._device)
        dist.all_reduce(sync, group=ddp.process_group)  # the training ranks' 1 or 0
        should_sync = bool(sync.item())
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = _common_rank(ddp._rank if is_last_joiner else None, ddp.process_group,
                           ddp._device)
        state = list(ddp.module.parameters())
        if ddp.broadcast_buffers:
            state += ddp._sync_buffer_list
        with torch.no_grad():
            broadcast_coalesced(state, ddp.process_group, src=src)


def _delayed_names(module: nn.Module, named: Sequence[tuple[str, Any]] | None,
                   hook_param: Any) -> set[str]:
    """The names of the delayed parameters, checked against the module (local checks:
    every rank raises alike, before any collective)."""
    if (named is None) != (hook_param is None):
        raise ValueError("DistributedDataParallel: delay_all_reduce_named_params and "
                         "param_to_hook_all_reduce go together: give both or neither")
    if named is None:
        return set()
    mine = dict(module.named_parameters())
    names = set()
    for entry in named:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise ValueError(f"DistributedDataParallel: delay_all_reduce_named_params must "
                             f"hold (name, parameter) pairs, got {entry!r}")
        name, p = entry
        if mine.get(name) is not p:
            raise ValueError(f"DistributedDataParallel: delay_all_reduce_named_params: "
                             f"{name!r} is not that parameter of the module")
        names.add(name)
    if not any(hook_param is p for p in mine.values()):
        raise ValueError("DistributedDataParallel: param_to_hook_all_reduce is not a "
                         "parameter of the module")
    return names


def _check_arguments(module: nn.Module, process_group: dist.ProcessGroup | None,
                     bucket_cap_mb: float | None, gradient_as_bucket_view: bool,
                     delay_all_reduce_named_params: Sequence[tuple[str, Any]] | None,
                     param_to_hook_all_reduce: Any, mixed_precision: Any, device_mesh: Any
                     ) -> tuple[float, dist.ProcessGroup, set[str], MixedPrecision | None]:
    """DistributedDataParallel's argument checks, local ones first (they raise
    identically on every rank before any collective). Returns the bucket cap in MiB,
    the process group, the delayed parameters' names and the mixed precision (or
    None)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, "
                        f"got {type(module).__name__}")
    if bucket_cap_mb is None:
        bucket_cap_mb = 25
    if not bucket_cap_mb >= 0:  # also refuses NaN
        raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be 0 (one bucket "
                         f"per parameter) or positive, got {bucket_cap_mb}")
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("DistributedDataParallel: give process_group or "
                             "device_mesh, not both")
        if device_mesh.ndim != 1:
            raise ValueError(f"DistributedDataParallel: device_mesh must be 1-D (DDP "
                             f"trains over one dimension), got {device_mesh.ndim} "
                             f"dimensions; pass mesh['name'] for one of them")
        process_group = device_mesh.get_group(mesh_dim=0)
    if process_group is None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedDataParallel: no process group; call "
                               "torch.distributed.init_process_group first")
        process_group = dist.distributed_c10d._get_default_group()
    if dist.get_rank(process_group) < 0:
        raise ValueError("DistributedDataParallel: this process is not a member of "
                         "the given process group")
    delayed = _delayed_names(module, delay_all_reduce_named_params,
                             param_to_hook_all_reduce)
    mp = MixedPrecision(mixed_precision, module) if mixed_precision is not None else None
    if mp is not None and gradient_as_bucket_view:
        raise ValueError("DistributedDataParallel: mixed_precision and "
                         "gradient_as_bucket_view do not go together: gradients are "
                         "computed in param_dtype and reduced in reduce_dtype, so they "
                         "cannot live in the buckets")
    return bucket_cap_mb, process_group, delayed, mp


def _split_parameters(module: nn.Module, named_params: list[tuple[str, nn.Parameter]],
                      delayed: set[str]) -> tuple[list[tuple[str, nn.Parameter]],
                                                  list[tuple[str, nn.Parameter]]]:
    """The trainable (name, parameter) pairs: those for the buckets, and the delayed
    ones. Raises if nothing is left for the buckets or a module is sparse."""
    trainable = [(n, p) for n, p in named_params if p.requires_grad]
    if not trainable:
        raise RuntimeError("DistributedDataParallel: the module has no parameter that "
                           "requires a gradient; there is nothing to synchronize")
    held = [(n, p) for n, p in trainable if n in delayed]
    trainable = [(n, p) for n, p in trainable if n not in delayed]
    if held and not trainable:
        raise ValueError("DistributedDataParallel: delay_all_reduce_named_params names "
                         "every trainable parameter; leave at least one to the buckets")
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise RuntimeError(f"DistributedDataParallel: '{name}' produces sparse "
                               "gradients, which this implementation does not reduce; "
                               "use sparse=False")
    return trainable, held


class DistributedDataParallel(nn.Module, Joinable):
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
        static_graph: the model uses the same parameters every iteration (as torch's
            ``static_graph``): the first synchronized iteration finds the unused ones
            (even without ``find_unused_parameters``), later iterations skip the graph
            walk and the used-parameter allreduce.
        delay_all_reduce_named_params: ``(name, parameter)`` pairs kept out of the
            buckets and averaged in one allreduce of their own at the end of
            backward, after the buckets, waited for before backward returns (see
            :mod:`ddp.delayed`). Not with ``join()``.
        param_to_hook_all_reduce: a parameter of the module, given with
            ``delay_all_reduce_named_params`` as torch requires (torch launches the
            delayed allreduce from its gradient; here the moment is fixed).
        mixed_precision: torch's ``_MixedPrecision(param_dtype, reduce_dtype,
            buffer_dtype)`` (see :mod:`ddp.mixed_precision`): forward and backward in
            ``param_dtype``, buckets in ``reduce_dtype``, full precision for the
            optimizer. Not with ``gradient_as_bucket_view``.
        init_sync: False skips construction's collectives (the model check and the
            broadcast of rank 0's state): each rank keeps its own parameters, which
            the caller must have made equal.
        device_mesh: a 1-D ``DeviceMesh`` to train over, instead of
            ``process_group``.
        forward_sync_buffers: torch 2.13's successor of ``broadcast_buffers`` for the
            broadcasts before each forward; buffers are then always synchronized at
            construction (``broadcast_buffers=False`` also skips that one).
    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``bucket_cap_mb`` is negative or not a number, this process
            is not in ``process_group``, or the delayed parameters are given
            without their hook parameter (or the other way round), name no
            parameter of the module, or are all of its trainable ones.
        RuntimeError: no process group is initialized; the model differs across
            ranks (on every rank); no parameter requires a gradient; the model has
            sparse embeddings.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float | None = 25, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, broadcast_buffers: bool = True,
                 static_graph: bool = False,
                 delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
                 param_to_hook_all_reduce: nn.Parameter | None = None,
                 mixed_precision: Any = None, init_sync: bool = True,
                 device_mesh: Any = None, forward_sync_buffers: bool | None = None):
        nn.Module.__init__(self)
        Joinable.__init__(self)  # join() (uneven inputs) is off until asked for
        self._divide_by_initial_world_size = True
        bucket_cap_mb, process_group, delayed, mp = _check_arguments(
            module, process_group, bucket_cap_mb, gradient_as_bucket_view,
            delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
            device_mesh)
        init_buffers = broadcast_buffers
        if forward_sync_buffers is not None:
            broadcast_buffers, init_buffers = forward_sync_buffers, True
        self.module = module
        self.process_group = process_group
        self.device_mesh = device_mesh
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.bucket_bytes_cap = int(bucket_cap_mb * MB)
        self.world_size = dist.get_world_size(process_group)
        self._rank = dist.get_rank(process_group)

        named_params = list(module.named_parameters())  # shared parameters appear once
        named_buffers = list(module.named_buffers())
        device = named_params[0][1].device if named_params else torch.device("cpu")
        self._device = device
        # Before anything else: a mismatch would make later collectives disagree in
        # size (hang or garbage); the fingerprint turns that into an error everywhere.
        if init_sync:
            verify_same_model(named_params, named_buffers, process_group, device)
        trainable, held = _split_parameters(module, named_params, delayed)

        # As torch does, broadcast_buffers=False also leaves buffers out of this
        # first broadcast, so rank-local buffers stay rank-local.
        start_state = [p for _, p in named_params]
        if init_buffers:
            start_state += [b for _, b in named_buffers]
        if init_sync:
            with torch.no_grad():
                broadcast_coalesced(start_state, process_group)
        self._sync_buffer_list = [b for _, b in named_buffers]
        self._mp = mp
        if mp is not None:
            mp.cast_buffers(self._sync_buffer_list)
        self.reducer = self._build_reducer(trainable, held, mp)
        # As in torch: a backward is synchronized when its forward ran with grad
        # enabled outside no_sync; buffers are synced before a forward that follows
        # such a forward (or the first one).
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._forward_ns, self._forwards = 0, 0  # synchronized forwards, for logging_data

    def _build_reducer(self, trainable: list[tuple[str, nn.Parameter]],
                       held: list[tuple[str, nn.Parameter]],
                       mp: MixedPrecision | None) -> Reducer:
        """The reducer of the bucketed parameters; the delayed ones' allreduce on it."""
        reduce_dtype = mp.reduce_dtype if mp is not None else None
        reducer = Reducer(
            [p for _, p in trainable], [n for n, _ in trainable], self.process_group,
            self.bucket_bytes_cap, min(FIRST_BUCKET_CAP_BYTES, self.bucket_bytes_cap),
            self.find_unused_parameters, self.gradient_as_bucket_view, self.static_graph,
            bucket_dtype=reduce_dtype)
        reducer.mp = mp
        if held:
            reducer.delayed = DelayedAllreduce(
                [p for _, p in held], [n for n, _ in held], self.process_group,
                reduce_dtype=reduce_dtype)
        return reducer

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; arm gradient synchronization for the coming backward.

        Raises:
            RuntimeError: the previous synchronized backward never finished reducing.
        """
        start, inputs, kwargs = self._pre_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs)
        return self._post_forward(output, start)

    def logging_data(self) -> dict[str, Any]:
        """What this DDP is and has done, under the names of torch's
        ``_get_ddp_logging_data()``: configuration, bucket sizes in bytes (first
        layout, and after the rebuild), the last iteration's gradient order and
        unused bytes, and mean times per synchronized iteration in nanoseconds.

        ``avg_backward_compute_time`` runs from the first gradient event to the end
        of backward's computation; ``avg_backward_comm_time`` from the first bucket's
        launch to the return of the last wait; their overlap is the part of
        communication before computation ended. torch samples these every 100
        iterations on CUDA; here every synchronized iteration counts.
        """
        r = self.reducer
        iters = r.num_synced_backwards
        t = r.timing

        def mean(total: int, n: int) -> int:
            return total // n if n else 0

        def sizes(bs: Sequence[int]) -> str:
            return ", ".join(map(str, bs))

        params = r.params
        return {
            "world_size": self.world_size, "rank": self._rank,
            "module_name": type(self.module).__name__,
            "backend_name": dist.get_backend(self.process_group),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "broadcast_buffers": int(self.broadcast_buffers),
            "static_graph": int(self.static_graph),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.nbytes for p in params),
            "dtypes": ", ".join(dict.fromkeys(str(p.dtype).removeprefix("torch.")
                                              for p in params)),
            "bucket_sizes": sizes(r.initial_bucket_bytes or []),
            "has_rebuilt_buckets": int(r._rebuilt),
            "rebuilt_bucket_sizes": sizes(b.buffer.nbytes for b in r.buckets)
            if r._rebuilt else "",
            "rebuilt_per_bucket_param_indices": " | ".join(
                " ".join(map(str, b.param_indices)) for b in r.buckets) if r._rebuilt else "",
            "num_buckets_reduced": len(r.buckets),
            "iteration": iters,
            "prev_iteration_grad_ready_order_indices": sizes(r.last_ready_order),
            "unused_parameter_size": r.unused_bytes,
            "comm_hook": getattr(r._comm_hook, "__qualname__", repr(r._comm_hook))
            if r._comm_hook_registered else "",
            "avg_forward_compute_time": mean(self._forward_ns, self._forwards),
            "avg_backward_compute_time": mean(t["backward_compute"], iters),
            "avg_backward_comm_time": mean(t["backward_comm"], iters),
            "avg_backward_compute_comm_overlap_time": mean(t["overlap"], iters),
        }

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's name for :meth:`logging_data`."""
        return self.logging_data()

    # Under torch.compile, only the wrapped module's forward is traced (_eager).
    @_eager
    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, tuple, dict]:
        """Everything before the module's forward: the clocks at its start and whether
        mixed precision swapped the parameters now, and the inputs (cast, with mixed
        precision)."""
        start = (time.perf_counter_ns(), trace.now() if trace.active() else 0.0)
        joining = self._join_config.enable
        grad = torch.is_grad_enabled()
        if grad:
            self.reducer.check_idle()
        # In join(): tell the ranks that ran out of inputs that this one trains on; the
        # number that do is the divisor when divide_by_initial_world_size is False.
        work = Join.notify_join_context(self) if joining else None
        self.reducer.set_divisor_work(
            work if work is not None and not self._divide_by_initial_world_size else None)
        if grad:
            # Before the forward allocates activations: the old and new buckets
            # briefly coexist.
            self.reducer.rebuild_buckets()
        self._sync_buffers_before_forward(training=True)
        if joining:  # whether the joined ranks have a backward to shadow
            flag = torch.ones(1, device=self._device) if (
                grad and self.require_backward_grad_sync) else torch.zeros(1, device=self._device)
            dist.all_reduce(flag, group=self.process_group)
        swapped = False
        if self._mp is not None:
            inputs, kwargs, swapped = self._mp.swap_in(inputs, kwargs)
        return (*start, swapped), inputs, kwargs

    @_eager
    def _post_forward(self, output: Any, start: tuple) -> Any:
        """Everything after the module's forward: arm (or disarm) the reducer."""
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            self.reducer.prepare_for_backward(output)
            self._forward_ns += time.perf_counter_ns() - start[0]
            self._forwards += 1
        else:
            self.require_forward_param_sync = False
            if torch.is_grad_enabled():
                self.reducer.disarm()
        if self._mp is not None and not torch.is_grad_enabled() and start[2]:
            # no backward comes to put full precision back; a swap made by an earlier
            # forward whose backward is still to come is left to that backward
            self._mp.restore()
        if trace.active():
            trace.complete("forward", "ddp", start[1] or trace.now(), trace.now())
        return output

    def _sync_buffers_before_forward(self, training: bool) -> None:
        """Rank 0's buffers to every rank before a forward that follows a synchronized
        one; in join(), the largest training rank's (rank 0 may have run out of
        inputs, its buffers stale). ``training``: this rank has inputs."""
        if not (self.require_forward_param_sync and self.broadcast_buffers
                and self._sync_buffer_list and self.world_size > 1):
            return
        src = 0
        if self._join_config.enable:
            src = _common_rank(self._rank if training else None, self.process_group,
                               self._device)
        with torch.no_grad():
            broadcast_coalesced(self._sync_buffer_list, self.process_group, src=src)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Train on uneven inputs: ``with model.join(): for x in my_batches: ...``.

        A rank that runs out of inputs shadows the others' collectives (zero gradients)
        until every rank is done, so nobody hangs; then every rank takes the last
        rank's model. As in torch's DDP (whose ``Join`` this is), gradients are
        divided by the initial world size, or with ``divide_by_initial_world_size=False``
        by the number of ranks still training.

        Args:
            divide_by_initial_world_size: see above.
            enable: False turns the context into a no-op (even inputs).
            throw_on_early_termination: raise on every rank as soon as one runs out
                of inputs, instead of shadowing.
        """
        if enable and self.reducer.delayed is not None:
            raise RuntimeError("DistributedDataParallel.join: not with "
                               "delay_all_reduce_named_params (not built: the ranks out of "
                               "inputs would have to shadow the delayed allreduce too)")
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook :class:`torch.distributed.algorithms.Join` runs on a rank that ran
        out of inputs (see :meth:`join`)."""
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

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
