"""Post-local SGD (Lin et al., ICLR 2020): allreduce gradients over the whole group
for a warm-up, then only within a subgroup (a host), with the model averaged
across subgroups now and then by torch's ``PostLocalSGDOptimizer``.

The state is torch's ``PostLocalSGDState``, so a state made for torch's
``post_localSGD_hook`` drives this one alike. The optimizer side needs nothing of
DDP's: ``torch.distributed.optim.PostLocalSGDOptimizer`` with a
``PeriodicModelAverager`` wraps any optimizer of a ``ddp`` model.
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

from ddp.comm_hooks.default import allreduce_hook, noop_hook

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]


def _host_subgroup() -> dist.ProcessGroup:
    """This rank's group of ranks on its host (torch's default subgroup), made with
    ``dist.new_subgroups``: one group per run of ranks-per-host ranks."""
    per_host = (torch.cuda.device_count() if torch.cuda.is_available()
                else int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0))
    if per_host < 1:
        raise RuntimeError(
            "post_localSGD_hook: state.subgroup is None and the ranks per host are unknown "
            "(no CUDA devices, no LOCAL_WORLD_SIZE): give PostLocalSGDState a subgroup, "
            "for example dist.new_subgroups(group_size=...)[0]")
    subgroup, _ = dist.new_subgroups(group_size=per_host)
    return subgroup


def post_localSGD_hook(state: PostLocalSGDState,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average over ``state.process_group`` for ``state.start_localSGD_iter``
    iterations, then over ``state.subgroup`` (or not at all, with
    ``post_local_gradient_allreduce=False``).

    Args:
        state: torch's ``PostLocalSGDState``. ``process_group`` None means the DDP
            instance's group; ``subgroup`` None means one group per host, made on
            the first local iteration (every rank gets there together).
        bucket: the bucket to reduce.
    Returns:
        A future holding the bucket's buffer, averaged over the group in force.
    Raises:
        TypeError: ``state`` is not a ``PostLocalSGDState``.
        RuntimeError: ``subgroup`` is None and the ranks per host are unknown.
    """
    if not isinstance(state, PostLocalSGDState):
        raise TypeError(f"post_localSGD_hook: state must be a torch.distributed.algorithms."
                        f"ddp_comm_hooks.post_localSGD_hook.PostLocalSGDState, got "
                        f"{type(state).__name__}")
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(state.process_group, bucket)
    if not state.post_local_gradient_allreduce:
        return noop_hook(None, bucket)
    if state.subgroup is None:
        state.subgroup = _host_subgroup()
    return allreduce_hook(state.subgroup, bucket)
