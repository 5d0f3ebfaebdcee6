"""DistributedDataParallel's arguments, checked where every rank raises alike
before any collective: the module, the bucket cap, the group (or device mesh), the
delayed parameters and mixed precision."""
from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist
from torch import nn

from ddp.mixed_precision import MixedPrecision


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


def check_arguments(module: nn.Module, process_group: dist.ProcessGroup | None,
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


def split_parameters(module: nn.Module, named_params: list[tuple[str, nn.Parameter]],
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
