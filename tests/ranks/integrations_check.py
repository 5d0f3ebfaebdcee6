"""Per-rank program: training frameworks on ringcomm, as docs/integrations.md shows them.

Usage: integrations_check.py FRAMEWORK DIR   (DIR: a directory every rank can write)

  torch         torch.distributed.checkpoint (a plain state dict, and an FSDP2-sharded
                one saved and loaded back into a differently initialised model), and
                FSDP2 training in fp32 and with bf16 mixed precision, bit-identical
                to the same run on gloo
  lightning     PyTorch Lightning, DDPStrategy(process_group_backend="ringcomm")
  accelerate    HF Accelerate, with the process group created first
  transformers  the transformers Trainer, with the process group created first

The frameworks train a small model for a few SGD steps on rank-dependent batches;
the result must equal one process training on the whole batch (Lightning,
Accelerate), or be identical on every rank and carried by ringcomm (Trainer,
whose optimiser and data order are its own).
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import ringcomm
from _common import Checker

STEPS = 3
PER_RANK = 4


def tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def data(n: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g)


def oracle_params(world: int, lr: float) -> list[torch.Tensor]:
    """One process, the whole batch, plain SGD: what data-parallel training must give."""
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(STEPS):
        x, y = data(PER_RANK * world, seed=step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def same_everywhere(c: Checker, what: str, tensors: list[torch.Tensor]) -> None:
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    c.check(torch.equal(flat, ref), f"{what}: replicas differ across ranks")


def close_to(c: Checker, what: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    ok = len(got) == len(want) and all(
        torch.allclose(a.detach().double(), b.double(), rtol=1e-5, atol=1e-6)
        for a, b in zip(got, want))
    c.check(ok, f"{what}: differs from one process on the whole batch")


# -- torch alone: DCP and FSDP2 -------------------------------------------------------
def fsdp_train(group, steps: int, mixed: bool) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = tiny(seed=3)
    mesh = DeviceMesh.from_group(group, "cpu")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = data(PER_RANK, seed=100 * dist.get_rank() + step)
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def check_torch(c: Checker, directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    world = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    for mixed in (False, True):
        what = "FSDP2 " + ("bf16 mixed precision" if mixed else "fp32")
        ours, ref = fsdp_train(world, STEPS, mixed), fsdp_train(gloo, STEPS, mixed)
        c.check(all(torch.equal(a, b) for a, b in zip(ours, ref)),
                f"{what}: parameters differ from gloo's")
    # DCP, a plain state dict: every rank saves the same tensors; load restores them
    model = tiny(seed=5)
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(directory, "plain"))
    fresh = tiny(seed=6)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(directory, "plain"))
    fresh.load_state_dict(state)
    c.check(all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters())),
            "DCP plain: loaded parameters differ from the saved ones")
    # DCP, FSDP2-sharded: each rank saves its shards; a differently initialised
    # sharded model loads them back
    mesh = DeviceMesh.from_group(world, "cpu")
    sharded = fully_shard(tiny(seed=8), mesh=mesh)
    want = [p.full_tensor().detach().clone() for p in sharded.parameters()]
    dcp.save(get_model_state_dict(sharded), checkpoint_id=os.path.join(directory, "sharded"))
    other = fully_shard(tiny(seed=9), mesh=mesh)
    state = get_model_state_dict(other)
    dcp.load(state, checkpoint_id=os.path.join(directory, "sharded"))
    set_model_state_dict(other, state)
    got = [p.full_tensor().detach() for p in other.parameters()]
    c.check(all(torch.equal(a, b) for a, b in zip(got, want)),
            "DCP FSDP2-sharded: loaded parameters differ from the saved ones")


# -- frameworks -----------------------------------------------------------------------
def check_lightning(c: Checker, directory: str) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    world = int(os.environ["WORLD_SIZE"])

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tiny()

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            r = dist.get_rank()
            for step in range(STEPS):
                x, y = data(PER_RANK * world, seed=step)
                yield x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK]

    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=world, num_nodes=1, max_steps=STEPS,
                        strategy=DDPStrategy(process_group_backend="ringcomm"),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=directory)
    trainer.fit(module, torch.utils.data.DataLoader(Batches(), batch_size=None))
    c.check(isinstance(dist.group.WORLD, ringcomm.ProcessGroupRingcomm),
            f"Lightning's group is {type(dist.group.WORLD).__name__}, not ringcomm's")
    close_to(c, "Lightning", list(module.net.parameters()), oracle_params(world, 0.1))
    same_everywhere(c, "Lightning", list(module.net.parameters()))


def check_accelerate(c: Checker, directory: str) -> None:
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))  # before Accelerator
    from accelerate import Accelerator

    world, r = dist.get_world_size(), dist.get_rank()
    accelerator = Accelerator(cpu=True)
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    for step in range(STEPS):
        x, y = data(PER_RANK * world, seed=step)
        x, y = x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK]
        opt.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
    params = list(accelerator.unwrap_model(model).parameters())
    c.check(accelerator.num_processes == world, f"Accelerate sees {accelerator.num_processes} "
                                                f"processes, expected {world}")
    close_to(c, "Accelerate", params, oracle_params(world, 0.1))
    same_everywhere(c, "Accelerate", params)


def check_transformers(c: Checker, directory: str) -> None:
    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))  # before the arguments
    from transformers import Trainer, TrainingArguments

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = tiny()

        def forward(self, x, labels):
            return {"loss": nn.functional.mse_loss(self.net(x), labels)}

    x, y = data(64)
    rows = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    model = Model()
    before = [p.detach().clone() for p in model.parameters()]
    pg = ringcomm.get_group()
    seq = pg.seq
    args = TrainingArguments(output_dir=directory, use_cpu=True, max_steps=STEPS,
                             per_device_train_batch_size=PER_RANK, report_to=[],
                             save_strategy="no", logging_strategy="no", learning_rate=0.05,
                             disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows).train()
    params = list(model.parameters())
    c.check(args.world_size == dist.get_world_size(), f"Trainer world size {args.world_size}")
    c.check(pg.seq > seq, "the Trainer ran no collective on ringcomm's group")
    c.check(any(not torch.equal(a, b) for a, b in zip(params, before)), "nothing was trained")
    same_everywhere(c, "transformers Trainer", params)


def main() -> None:
    framework, directory = sys.argv[1], sys.argv[2]
    if framework in ("torch",):
        dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    c = Checker(int(os.environ.get("RANK", "0")))
    {"torch": check_torch, "lightning": check_lightning, "accelerate": check_accelerate,
     "transformers": check_transformers}[framework](c, directory)
    dist.barrier()
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
