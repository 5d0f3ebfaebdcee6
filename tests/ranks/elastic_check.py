"""Per-rank program: training that survives torchrun's restarts, resuming from a DCP
checkpoint.

Usage: elastic_check.py DIR [--crash-at STEP] [--crash-rank R] [--expect-restarts N]
                            [--expect-world W] [--timeout S]

A small MLP trains ``STEPS`` steps with ddp/ over ringcomm (SGD with momentum, so
the optimizer's state matters too). Each step's global batch of ``GLOBAL`` samples
is fixed by the step number and split evenly over the ranks; each rank's loss is
its mean, and DDP averages the gradients, so every step is the same arithmetic at
any world size: the oracle is one process training on the global batches.

After each step the model and optimizer state go into a DCP checkpoint
(``DIR/step-K``); a start resumes from the newest complete one. With
``--crash-at STEP`` the process ``--crash-rank`` kills itself with SIGKILL in the
middle of that step (after its forward, while its peers are in the step's
allreduce), on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0). torchrun
(``--max-restarts 1``) then stops the survivors and starts every rank again; the
new group forms and training resumes from step ``STEP - 1``'s checkpoint.

When the run ends, each rank checks its parameters against the oracle and across
ranks, and that it resumed where the checkpoints say, after ``--expect-restarts``
restarts, at world size ``--expect-world``; rank 0 saves them to
``DIR/final.pt`` so the test can compare a crashed run with an uninterrupted one.
Each step and each resume is printed (``step K world W attempt A``).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringcomm  # noqa: E402,F401  (registers the backend)
from _common import Checker  # noqa: E402
from ddp import DistributedDataParallel as DDP  # noqa: E402

STEPS, GLOBAL = 6, 12  # 12 samples split evenly over 1, 2, 3 or 4 ranks
LR, MOMENTUM = 0.1, 0.9


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def optimizer(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(GLOBAL, 5, generator=g, dtype=torch.float64),
            torch.randn(GLOBAL, 3, generator=g, dtype=torch.float64))


def oracle() -> list[torch.Tensor]:
    m = model()
    opt = optimizer(m)
    for step in range(1, STEPS + 1):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()
    return [p.detach() for p in m.parameters()]


def newest_checkpoint(directory: str) -> int:
    """The newest step whose checkpoint is complete (rank 0 marks it after the save,
    which every rank has finished by then), 0 if none."""
    done = [int(n.split("-")[1]) for n in os.listdir(directory)
            if n.startswith("step-") and os.path.exists(os.path.join(directory, n, "done"))]
    return max(done, default=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--crash-at", type=int, default=0)
    ap.add_argument("--crash-rank", type=int, default=1, help="-1: any rank of this launch")
    ap.add_argument("--lose-node", action="store_true",
                    help="the crashing rank kills its torchrun agent first: its node is lost")
    ap.add_argument("--expect-restarts", type=int, default=None,
                    help="this agent's restarts (torchrun counts them per agent)")
    ap.add_argument("--expect-resume", type=int, default=0)
    ap.add_argument("--expect-world", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--backend", default="ringcomm")
    args = ap.parse_args()

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    c = Checker(rank)
    if GLOBAL % world:
        raise SystemExit(f"world size {world} does not divide the global batch {GLOBAL}")
    per = GLOBAL // world

    m = model()
    ddp_model = DDP(m, bucket_cap_mb=0.0005)  # several buckets
    opt = optimizer(ddp_model)
    start = newest_checkpoint(args.dir)
    if start:
        state = dict(zip(("model", "optim"), get_state_dict(ddp_model, opt)))
        dcp.load(state, checkpoint_id=os.path.join(args.dir, f"step-{start}"))
        set_state_dict(ddp_model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    print(f"rank {rank}: resume from step {start} world {world} attempt {attempt}", flush=True)

    for step in range(start + 1, STEPS + 1):
        x, y = batch(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        loss = F.mse_loss(ddp_model(x), y)
        if step == args.crash_at and attempt == 0 and args.crash_rank in (rank, -1):
            print(f"rank {rank}: killing {'my agent and ' if args.lose_node else ''}myself "
                  f"in step {step}", flush=True)
            if args.lose_node:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        path = os.path.join(args.dir, f"step-{step}")
        msd, osd = get_state_dict(ddp_model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        dist.barrier()
        if rank == 0:
            open(os.path.join(path, "done"), "w").close()
        print(f"rank {rank}: step {step} world {world} attempt {attempt}", flush=True)

    got = [p.detach() for p in m.parameters()]
    want = oracle()
    for i, (a, b) in enumerate(zip(got, want)):
        c.check(torch.allclose(a, b, rtol=1e-10, atol=1e-12),
                f"parameter {i}: max diff {(a - b).abs().max().item()} from one process")
    flat = torch.cat([p.reshape(-1) for p in got])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    c.check(torch.equal(flat, ref), "parameters differ across ranks")
    if args.expect_restarts is not None:
        c.check(attempt == args.expect_restarts,
                f"finished after {attempt} restarts, expected {args.expect_restarts}")
    c.check(start == args.expect_resume,
            f"resumed from step {start}, expected {args.expect_resume}")
    if args.expect_world:
        c.check(world == args.expect_world, f"world size {world}, expected {args.expect_world}")
    if rank == 0:
        torch.save(got, os.path.join(args.dir, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
