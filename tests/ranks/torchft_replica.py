"""One torchft replica group (one process) training on ringcomm, as torchft's own
examples run: a Manager on the lighthouse at TORCHFT_LIGHTHOUSE, its replica group
ringcomm's (ringcomm.torchft.ProcessGroupRingcommFT), torchft's optimizer wrapper.

Usage: torchft_replica.py REPLICA OUT MODE --steps N [--hold-after K] [--die-in K]

  MODE ddp      torchft's DistributedDataParallel reduces the gradients (its comm hook)
  MODE manual   manager.allreduce of each gradient, then wait(): the path on which a
                peer dying inside an allreduce leaves the survivor training (torchft's
                DDP wrapper crashes there on any backend, see docs/integrations.md)

  --hold-after K  after committing step K, print "holding" and sleep (to be killed)
  --die-in K      in step K, once the quorum is made and before the gradients are
                  reduced, kill this process: its peers are inside their allreduce
  --steps N       stop once step N is reached

Training starts once OUT/go exists (the test makes it when every first replica has
started, so that the first quorum has them all). Every replica starts from the same
parameters. Step s's batch depends on s and
REPLICA only, so the steps can be replayed in one process. After every step the
replica appends one JSON line to OUT/replica-REPLICA-PID.jsonl: the step the quorum
gave, the step its batch was drawn for, whether it took part, how many took part,
whether the step committed, and the error torchft saw, if any. At the end it writes its parameters to
OUT/params-REPLICA-PID.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import TCPStore

from torchft import Manager
from torchft.ddp import DistributedDataParallel
from torchft.optim import OptimizerWrapper

from ringcomm.torchft import ProcessGroupRingcommFT

LR = 0.05
DEADLINE_S = 150


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("replica", type=int)
    ap.add_argument("out")
    ap.add_argument("mode", choices=["ddp", "manual"])
    ap.add_argument("--hold-after", type=int)
    ap.add_argument("--die-in", type=int)
    ap.add_argument("--steps", type=int, required=True)
    a = ap.parse_args()

    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = ProcessGroupRingcommFT(timeout=timedelta(seconds=15))
    manager = Manager(
        pg=group,
        min_replica_size=1,
        load_state_dict=lambda sd: (net.load_state_dict(sd["model"]),
                                    opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": net.state_dict(), "optim": opt.state_dict()},
        replica_id=f"replica_{a.replica}", store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, timeout=timedelta(seconds=15),
        quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=15))
    forward = DistributedDataParallel(manager, net) if a.mode == "ddp" else net
    optimizer = OptimizerWrapper(manager, opt)
    log = open(os.path.join(a.out, f"replica-{a.replica}-{os.getpid()}.jsonl"), "w")
    print(f"replica {a.replica}: started, pid {os.getpid()}", flush=True)

    deadline = time.monotonic() + DEADLINE_S
    while not os.path.exists(os.path.join(a.out, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    while time.monotonic() < deadline:
        optimizer.zero_grad()  # starts the quorum
        drawn = manager.current_step()  # a healing replica's is its own, old one
        x, y = batch(drawn, a.replica)
        loss = nn.functional.mse_loss(forward(x), y)
        manager.wait_quorum()
        begun = time.monotonic()
        if a.die_in is not None and manager.current_step() == a.die_in:
            print(f"replica {a.replica}: dying in step {a.die_in}", flush=True)
            time.sleep(0.5)  # the peer is in its allreduce by now
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        if a.mode == "manual":
            for w in [manager.allreduce(p.grad) for p in net.parameters()]:
                w.wait()
        step = manager.current_step()
        record = {"step": step, "drawn": drawn, "participating": manager.is_participating(),
                  "participants": manager.num_participants()}
        optimizer.step()
        record["committed"] = manager.current_step() > step
        record["seconds"] = time.monotonic() - begun
        err = manager.errored()
        record["error"] = None if err is None else f"{type(err.original_exception).__name__}: " \
                                                   f"{err.original_exception}"
        # the adapter's own view, asked before the next quorum replaces the group
        mine = group.errored()
        record["group_error"] = None if mine is None else f"{type(mine).__name__}: {mine}"
        log.write(json.dumps(record) + "\n")
        log.flush()
        if a.hold_after is not None and step == a.hold_after and record["committed"]:
            print(f"replica {a.replica}: holding after step {step}", flush=True)
            time.sleep(DEADLINE_S)
        if manager.current_step() >= a.steps:
            break
        time.sleep(0.1)
    else:
        print(f"replica {a.replica}: out of time at step {manager.current_step()}", flush=True)
    with open(os.path.join(a.out, f"params-{a.replica}-{os.getpid()}.json"), "w") as f:
        json.dump([p.detach().tolist() for p in net.parameters()], f)
    print(f"replica {a.replica}: done at step {manager.current_step()}", flush=True)
    manager.shutdown(wait=True)
    inner = group._pg  # ringcomm's group of the last quorum
    group.shutdown()  # the adapter releases its group; torchft's base only forgets it
    print(f"replica {a.replica}: shut down, group released: {released(inner)}, "
          f"forgotten: {group._pg is None}, errored after: {group.errored()}", flush=True)


def released(pg) -> bool:
    """Whether ringcomm's group ``pg`` refuses work as a shut-down group does."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    try:
        pg.allreduce([torch.ones(4)], opts).wait()
    except Exception as e:  # noqa: BLE001
        return "shut down" in str(e)
    return False


if __name__ == "__main__":
    main()
