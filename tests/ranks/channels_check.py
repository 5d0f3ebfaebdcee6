"""Per-rank program: a ringcomm group of three channels (Options(num_channels=3))
against gloo: bursts of asynchronous collectives of every kind in flight at once,
a barrier after them, point-to-point messages beside them, and training with
torch's DDP and with ddp/ (whose buckets then reduce on different channels).
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ringcomm
from ddp import DistributedDataParallel as OurDDP
from _common import Checker
from _ddp_common import Classifier, train_classifier


def train(wrapper, group) -> list[torch.Tensor]:
    torch.manual_seed(0)
    # small buckets: several allreduces in flight per backward, on different channels
    return train_classifier(wrapper, Classifier(), group, bucket_cap_mb=0.002, batch=6)


def burst(group, rank: int, p: int) -> list[torch.Tensor]:
    """Collectives issued back to back with async_op=True, then all waited."""
    g = torch.Generator().manual_seed(rank)
    works, outs = [], []
    for i, n in enumerate((1, 7, 5000, 300000, 33)):
        t = torch.randint(-8, 8, (n,), generator=g).float()
        works.append(dist.all_reduce(t, group=group, async_op=True))
        b = torch.randint(-8, 8, (n,), generator=g).double()
        works.append(dist.broadcast(b, src=i % p, group=group, async_op=True))
        outs += [t, b]
    x = torch.randint(0, 100, (9,), generator=g)
    gathered = torch.empty(9 * p, dtype=x.dtype)
    works.append(dist.all_gather_into_tensor(gathered, x, group=group, async_op=True))
    rs = torch.empty(5)
    works.append(dist.reduce_scatter_tensor(rs, torch.randint(0, 9, (5 * p,), generator=g).float(),
                                            group=group, async_op=True))
    a2a = torch.empty(3 * p)
    works.append(dist.all_to_all_single(a2a, torch.randint(0, 9, (3 * p,), generator=g).float(),
                                        group=group, async_op=True))
    outs += [gathered, rs, a2a]
    for w in works:
        w.wait()
    return outs


def main() -> int:
    dist.init_process_group("ringcomm", pg_options=ringcomm.Options(num_channels=3))
    rank, p = dist.get_rank(), dist.get_world_size()
    c = Checker(rank)
    c.check(ringcomm.get_group().num_channels == 3, "the world group has 3 channels")
    gloo = dist.new_group(backend="gloo")

    for rep in range(3):
        ours, ref = burst(None, rank, p), burst(gloo, rank, p)
        for i, (a, b) in enumerate(zip(ours, ref)):
            c.check(torch.equal(a, b), f"burst {rep} result {i} differs from gloo")

    works = [dist.all_reduce(torch.ones(1000) * rank, async_op=True) for _ in range(4)]
    dist.barrier()
    c.check(all(w.is_completed() for w in works), "barrier returned before earlier work")

    # point-to-point beside collectives: always on channel 0, whatever the turn
    if p > 1:
        peer = (rank + 1) % p
        src = (rank - 1) % p
        for k in range(3):
            dist.all_reduce(torch.ones(3))  # moves the turn on
            out = torch.full((5,), float(rank * 10 + k))
            inbox = torch.empty(5)
            reqs = [dist.isend(out, peer), dist.irecv(inbox, src)]
            for r in reqs:
                r.wait()
            c.check(torch.equal(inbox, torch.full((5,), float(src * 10 + k))),
                    f"isend/irecv round {k}")

    ref = train(TorchDDP, gloo)
    for name, wrapper in (("torch DDP", TorchDDP), ("ddp/", OurDDP)):
        got = train(wrapper, None)
        c.check(all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, ref)),
                f"{name} on 3 channels differs from torch DDP on gloo")

    sub = dist.new_group(backend="ringcomm", pg_options=ringcomm.Options(num_channels=2))
    t = torch.ones(10) * rank
    works = [dist.all_reduce(t.clone(), group=sub, async_op=True) for _ in range(5)]
    for w in works:
        w.wait()
    c.check(ringcomm.get_group(sub).num_channels == 2, "a subgroup with its own channels")
    dist.barrier()
    dist.destroy_process_group()
    c.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
