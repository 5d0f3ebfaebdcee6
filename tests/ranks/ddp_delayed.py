"""DDP's delay_all_reduce_named_params (run with mpiexec -n 2).

The second and third layers are kept out of the buckets and averaged in one
allreduce of their own at the end of backward. The oracle is torch's DDP without
delay over gloo: the same averaged gradients, so the same parameters after four
momentum steps, with and without no_sync micro-steps, on ringcomm and on gloo,
whichever parameter is hooked. A delayed layer one rank leaves unused still ends
with equal gradients everywhere (nothing hangs). Bad arguments and join() are
refused at once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _ddp_common import compare_tensors, done, init, params
from ddp import DistributedDataParallel as DDP

TOL = (1e-9, 1e-12)


def net(seed: int = 5) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


class Branch(nn.Module):
    """net(), with its last two layers skipped where asked (a data-dependent graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = net()

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        return (torch.tanh(self.seq[0](x)) if skip else self.seq(x)).sum()


def delayed_args(m: nn.Module, hook: str = "0.weight") -> dict:
    named = dict(m.named_parameters())
    return {"delay_all_reduce_named_params": [(n, p) for n, p in named.items()
                                              if n.startswith(("2.", "4."))],
            "param_to_hook_all_reduce": named[hook]}


def train(model: nn.Module, rank: int, micro: int) -> bool:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        opt.zero_grad()
        for k in range(micro):
            g = torch.Generator().manual_seed(100 * rank + 10 * step + k)
            x, y = torch.randn(4, 6, generator=g, dtype=torch.float64), \
                torch.randint(0, 3, (4,), generator=g)
            last = k == micro - 1
            ctx = model.no_sync() if not last else torch.enable_grad()
            with ctx:
                F.cross_entropy(model(x), y).backward()
        opt.step()
    return True


def main() -> None:
    rank, world, groups, c = init()
    for micro in (1, 2):
        want = net()
        train(nn.parallel.DistributedDataParallel(want, process_group=groups["gloo"]),
              rank, micro)
        for backend, group in groups.items():
            what = f"delayed layers 2, 4 on {backend}, {micro} micro-steps"
            m = net()
            model = DDP(m, process_group=group, **delayed_args(m))
            c.check(len(model.reducer.params) == 2, f"{what}: {len(model.reducer.params)} "
                    "parameters in the buckets, expected the first layer's 2")
            got = c.run(what, train, model, rank, micro)
            if got:
                compare_tensors(c, what, params(m), params(want), *TOL)

    # the hook parameter does not decide the moment: hooking the last layer's weight
    # (whose gradient comes first) still averages complete gradients
    want = net()
    train(nn.parallel.DistributedDataParallel(want, process_group=groups["gloo"]), rank, 1)
    m = net()
    model = DDP(m, process_group=groups["ringcomm"], **delayed_args(m, hook="4.weight"))
    if c.run("hooked on the last layer's weight", train, model, rank, 1):
        compare_tensors(c, "hooked on the last layer's weight", params(m), params(want), *TOL)

    # a delayed layer that one rank does not use: the ranks still issue the same
    # collectives in the same order (the delayed allreduce at the end of backward)
    # and every replica gets the same gradient
    m = Branch()
    named = dict(m.named_parameters())
    model = DDP(m, process_group=groups["ringcomm"], find_unused_parameters=True,
                delay_all_reduce_named_params=[(n, p) for n, p in named.items()
                                               if n.startswith(("seq.2.", "seq.4."))],
                param_to_hook_all_reduce=named["seq.0.weight"])
    x = torch.randn(4, 6, dtype=torch.float64)
    c.run("a delayed layer unused on rank 0", lambda: model(x, skip=rank == 0).backward())
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in m.parameters()]
    everyone = [None] * world
    dist.all_gather_object(everyone, grads, group=groups["gloo"])
    c.check(all(all(torch.equal(a, b) for a, b in zip(e, everyone[0])) for e in everyone),
            "a delayed layer unused on rank 0: the ranks' gradients differ")

    m = net()
    named = dict(m.named_parameters())
    bad = {"the delayed parameters alone": {"delay_all_reduce_named_params": [
               ("2.weight", named["2.weight"])]},
           "the hook parameter alone": {"param_to_hook_all_reduce": named["0.weight"]},
           "a name that is not that parameter": {
               "delay_all_reduce_named_params": [("2.weight", named["4.weight"])],
               "param_to_hook_all_reduce": named["0.weight"]},
           "a hook parameter from elsewhere": {
               "delay_all_reduce_named_params": [("2.weight", named["2.weight"])],
               "param_to_hook_all_reduce": nn.Parameter(torch.zeros(1))},
           "every parameter delayed": {
               "delay_all_reduce_named_params": list(named.items()),
               "param_to_hook_all_reduce": named["0.weight"]}}
    for what, kwargs in bad.items():
        try:
            DDP(m, process_group=groups["ringcomm"], **kwargs)
            c.check(False, f"{what}: accepted")
        except ValueError as e:
            c.check("DistributedDataParallel" in str(e), f"{what}: {e}")
            c.case(f"delay_all_reduce_named_params: {what}", e)
    model = DDP(m, process_group=groups["ringcomm"], **delayed_args(m))
    try:
        model.join()
        c.check(False, "join() with delayed parameters: accepted")
    except RuntimeError as e:
        c.check("delay_all_reduce_named_params" in str(e), f"join(): {e}")
    done(c)


if __name__ == "__main__":
    main()
