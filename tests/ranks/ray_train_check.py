"""Ray Train on ringcomm, as its users run it: one local Ray, a TorchTrainer of two CPU
workers with TorchConfig(backend=...), the model wrapped by ray.train.torch's
prepare_model (torch's DDP), once on gloo and once on ringcomm. The two runs must give
the same parameters bit for bit, each on the backend it asked for.

Usage: ray_train_check.py DIR   (DIR: where the runs write; Ray's own files go to
RAY_TMPDIR). Nothing in the workers imports ringcomm: on torch >= 2.15 torch finds it
by name (the entry point torch.distributed.backends, ringcomm installed); on older
torch ray.init's worker_process_setup_hook registers it in each worker as it starts.
"""
from __future__ import annotations

import os
import sys

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from _common import Checker

#: the torch that finds a backend by name without an import
BY_NAME = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15)


def train_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist
    import ray.train
    import ray.train.torch

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    dist.barrier()
    if rank == 0:
        state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save({"params": state, "backend": dist.get_backend(),
                    "group": type(dist.group.WORLD).__name__}, config["out"])


def fit(backend: str, directory: str) -> dict:
    out = os.path.join(directory, f"{backend}.pt")
    TorchTrainer(train_loop, train_loop_config={"out": out},
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                 torch_config=TorchConfig(backend=backend, timeout_s=120),
                 run_config=RunConfig(name=f"check-{backend}", storage_path=directory)).fit()
    return torch.load(out, weights_only=False)


def main() -> None:
    directory = os.path.abspath(sys.argv[1])
    c = Checker(0)
    # Train V2 (Ray's default): the controller takes no CPU, each worker one
    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env=None if BY_NAME else {
                 "worker_process_setup_hook": "ringcomm.register_backend"})
    try:
        gloo, ours = fit("gloo", directory), fit("ringcomm", directory)
    finally:
        ray.shutdown()
    c.check(gloo["backend"] == "gloo", f"the gloo run ran on {gloo['backend']}")
    c.check(ours["backend"] == "ringcomm" and ours["group"] == "ProcessGroupRingcomm",
            f"the ringcomm run ran on {ours['backend']} ({ours['group']})")
    c.check(sorted(gloo["params"]) == sorted(ours["params"]), "the models differ")
    for name, p in gloo["params"].items():
        c.check(torch.equal(p, ours["params"][name]), f"{name} differs from gloo's")
    print(f"ray {ray.__version__}, torch {torch.__version__}, "
          f"{'by name' if BY_NAME else 'worker_process_setup_hook'}", flush=True)
    c.finish()


if __name__ == "__main__":
    main()
