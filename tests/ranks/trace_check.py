"""Under RINGCOMM_TRACE: a few DDP iterations whose trace tests/test_trace.py
checks after the run (the ranks' files, merged). Here: the recording is on from
import, and ringcomm's spans show up in a torch.profiler trace as
record_function ranges."""
from __future__ import annotations

import torch
import torch.distributed as dist
from _common import Checker

import ddp
from ringcomm import trace


def main() -> None:
    dist.init_process_group("ringcomm")
    rank = dist.get_rank()
    c = Checker(rank)
    c.check(trace.active(), "RINGCOMM_TRACE starts a recording at import")
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    model = ddp.DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=0.3)
    c.check(len(model.reducer.buckets) >= 3, f"{len(model.reducer.buckets)} buckets, want >= 3")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        loss = model(torch.randn(64, 256, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    # The lane's progress thread may still be finishing the last bucket's future
    # callbacks, and a collective issued meanwhile runs there, outside this thread's
    # profile: a barrier first leaves the lane idle, so the allreduce runs here.
    dist.barrier()
    if hasattr(dist.AllreduceOptions(), "asyncOp"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            dist.all_reduce(torch.ones(100))
        names = {e.key for e in prof.key_averages()}
        c.check(any(n.startswith("ringcomm: allreduce[") for n in names),
                f"ringcomm's allreduce is a profiler range: {sorted(names)[:20]}")
    else:
        # torch < 2.8 does not tell a backend which calls are synchronous: every one
        # runs on the lane's progress thread, outside this thread's profile
        print(f"rank {rank}: the profiler range is not checked on torch {torch.__version__}")
    dist.barrier()
    dist.destroy_process_group()
    c.finish()


if __name__ == "__main__":
    main()
