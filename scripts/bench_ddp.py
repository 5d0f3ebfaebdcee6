"""The DDP paper's experiments (Li et al., VLDB 2020, section 5) for ``ddp/`` and
torch's DistributedDataParallel, on ringcomm and on gloo, side by side in one run.

    mpiexec -n 2 python scripts/bench_ddp.py --json out.json --plot out/
    torchrun --nproc-per-node 2 scripts/bench_ddp.py --quick
    python scripts/bench_ddp.py --quick            # one process, world size 1

Sections (``--sections``, default all):

1. ``breakdown``: forward, backward, communication not hidden behind backward,
   optimizer step per iteration, for every configuration (DDP implementation x
   backend); and overlap on (bucketed DDP) against overlap off (backward under
   ``no_sync()``, then one allreduce of all gradients flattened into one buffer).
2. ``buckets``: time per iteration against ``bucket_cap_mb`` (0 = one allreduce
   per parameter, ..., one bucket for everything).
3. ``scaling``: throughput on the first k ranks (subgroups) for k = 1, 2, 4 up
   to the world size, and the fraction of linear scaling.
4. ``nosync``: ``no_sync()`` for n-1 of every n iterations; amortized time per
   iteration.

Every configuration trains the same model from the same initial weights on the
same seeded synthetic data; before timing, the parameters after a few steps must
agree across ranks and across configurations, or the run fails. Times are
wall-clock spans on each rank; a number is the maximum over ranks of each rank's
median over iterations (as in ``python -m ringcomm.bench``). After the run the
speed targets in ``scripts/bench_ddp_targets.json`` are checked and reported
(a miss never fails the run).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's ddp/ when run as a script
    sys.path.insert(0, str(ROOT))

import ringcomm  # noqa: E402  (registers the backend; under mpiexec it fills in RANK etc.)
from ringcomm.bench.cli import Parser, free_port, names  # noqa: E402
from ringcomm.bench.session import cpu_model, loadavg, mpi_library, version_of  # noqa: E402
from ringcomm.bench.sizes import format_size  # noqa: E402
from ringcomm.bench.timing import Progress  # noqa: E402
from ringcomm.bootstrap import MPI_LAUNCHER_VARS  # noqa: E402

import ddp  # noqa: E402

SCHEMA = "ringcomm.bench_ddp/1"
TARGETS_SCHEMA = "ringcomm.bench_ddp.targets/1"
DEFAULT_TARGETS = str(Path(__file__).resolve().with_name("bench_ddp_targets.json"))
PROG = "bench_ddp.py"

SECTIONS = ("breakdown", "buckets", "scaling", "nosync")
MODELS = ("resnet", "bert")
IMPLS = ("ours", "torch")
BACKENDS = ("ringcomm", "gloo")
#: bucket_cap_mb values of the sweep; "all" is a cap larger than the model (one bucket)
BUCKET_CAPS: tuple = (0, 1, 5, 10, 25, 50, 100, "all")
QUICK_BUCKET_CAPS: tuple = (0, 25, "all")
NOSYNC_EVERY = (1, 2, 4, 8)
SCALING_WORLDS = (1, 2, 4)
#: the order of the spans of one iteration (comm: overlap off's flat allreduce only)
SPANS = ("forward", "backward", "comm", "optimizer", "total")
#: optimizer of every configuration (small steps: the timed runs go on for hundreds)
LR, MOMENTUM = 1e-3, 0.9
#: steps before the parameters are compared across ranks and configurations
VERIFY_STEPS = 3
VERIFY_RTOL, VERIFY_ATOL = 1e-4, 1e-6
#: different seeded batches per rank; iterations cycle through them
DATA_POOL = 4
EXPOSED_METHOD = ("exposed communication = backward with synchronization - backward of the "
                  "same model under no_sync() (the computation alone), each the max over "
                  "ranks of the per-rank median")
OVERLAP_OFF = ("overlap off = backward under no_sync(), then one allreduce of all gradients "
               "flattened into one buffer, divided by the world size and copied back")


# ----------------------------------------------------------------------------
# models: torch.nn only, sized by a table
# ----------------------------------------------------------------------------
class ResidualBlock(nn.Module):
    """conv-bn-relu-conv-bn plus the input, then relu (ResNet's basic block)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def resnet(widths: Sequence[int], classes: int) -> nn.Module:
    """A stem, then per width a stride-2 conv (after the first) and one residual block,
    global average pooling and a linear classifier."""
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
                               nn.BatchNorm2d(widths[0]), nn.ReLU()]
    c = widths[0]
    for i, w in enumerate(widths):
        if i:
            layers += [nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(w),
                       nn.ReLU()]
        c = w
        layers.append(ResidualBlock(c))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


class TinyBert(nn.Module):
    """Token and position embeddings, post-norm encoder layers, a vocabulary head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ff: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.pos[: tokens.shape[1]]))


#: model -> size -> hyper-parameters; "quick" is the --quick size
MODEL_SIZES = {
    "resnet": {"full": dict(widths=(64, 128, 256, 512), classes=100, image=8, batch=8),
               "quick": dict(widths=(32, 64, 128, 256), classes=100, image=8, batch=8)},
    "bert": {"full": dict(vocab=8192, d=256, layers=2, heads=4, ff=1024, seq=32, batch=4),
             "quick": dict(vocab=4096, d=128, layers=2, heads=4, ff=512, seq=32, batch=8)},
}


@dataclasses.dataclass
class ModelSpec:
    """One benchmark model: how to build it, its seeded data and its loss."""

    name: str
    hp: dict
    seed: int

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)  # same initial weights on every rank and configuration
        h = self.hp
        if self.name == "resnet":
            return resnet(h["widths"], h["classes"])
        return TinyBert(h["vocab"], h["d"], h["layers"], h["heads"], h["ff"], h["seq"])

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s batch of step ``step`` (deterministic)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        h = self.hp
        if self.name == "resnet":
            x = torch.randn(h["batch"], 3, h["image"], h["image"], generator=g)
            return x, torch.randint(0, h["classes"], (h["batch"],), generator=g)
        x = torch.randint(0, h["vocab"], (h["batch"], h["seq"]), generator=g)
        return x, torch.randint(0, h["vocab"], (h["batch"], h["seq"]), generator=g)

    @staticmethod
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def describe(self, module: nn.Module) -> dict:
        params = [p for p in module.parameters() if p.requires_grad]
        h = self.hp
        if self.name == "resnet":
            what = (f"ResNet-style CNN: widths {list(h['widths'])}, one residual block each, "
                    f"{h['classes']} classes; input 3x{h['image']}x{h['image']}")
            sample = f"3x{h['image']}x{h['image']} images"
        else:
            what = (f"BERT-style encoder: vocabulary {h['vocab']}, d_model {h['d']}, "
                    f"{h['layers']} TransformerEncoderLayers ({h['heads']} heads, ff {h['ff']}), "
                    f"vocabulary head; sequences of {h['seq']} tokens")
            sample = f"sequences of {h['seq']} tokens"
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        return {"description": what, "parameters": sum(p.numel() for p in params),
                "parameter_tensors": len(params), "gradient_bytes": grad_bytes,
                "gradient_mib": round(grad_bytes / 2**20, 2), "batch_per_rank": h["batch"],
                "sample": sample}


# ----------------------------------------------------------------------------
# configurations and the replicas that are timed
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    """A DDP implementation on a backend; impl ``off`` is overlap off (see OVERLAP_OFF)."""

    impl: str
    backend: str

    @property
    def name(self) -> str:
        return f"{self.impl}/{self.backend}"


def wrap(config: Config, module: nn.Module, group: dist.ProcessGroup,
         cap_mb: float | None) -> nn.Module:
    """``module`` in ``config``'s DDP on ``group``; ``cap_mb`` None: the implementation's
    default (25 MiB, first bucket 1 MiB, for both)."""
    if config.impl == "torch":
        return nn.parallel.DistributedDataParallel(module, process_group=group,
                                                   bucket_cap_mb=cap_mb)
    # ours, and overlap off (ours under no_sync, reduced by hand)
    return ddp.DistributedDataParallel(module, process_group=group,
                                       bucket_cap_mb=25 if cap_mb is None else cap_mb)


class Replica:
    """One configuration's model, optimizer and data on this rank, ready to time.

    Args:
        spec: the model.
        config: implementation and backend.
        group: the process group to train over.
        cap_mb: bucket cap (None: default; "all": one bucket for everything).
        every: synchronize every ``every``-th iteration (no_sync the others); 0: never
            (backward alone, for the exposed-communication difference).
    """

    def __init__(self, spec: ModelSpec, config: Config, group: dist.ProcessGroup,
                 cap_mb: float | str | None = None, every: int = 1):
        self.spec, self.config, self.group, self.every = spec, config, group, every
        self.world = dist.get_world_size(group)
        module = spec.build()
        if cap_mb == "all":
            grad_mib = spec.describe(module)["gradient_bytes"] / 2**20
            cap_mb = math.ceil(grad_mib) + 1
        self.cap_mb = cap_mb
        self.net = wrap(config, module, group, cap_mb)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(self.net.parameters(), lr=LR, momentum=MOMENTUM)
        me = dist.get_rank(group)
        self.batches = [spec.batch(me, s) for s in range(DATA_POOL)]

    def synced(self, i: int) -> bool:
        """Whether iteration ``i`` runs DDP's synchronization (the last of each cycle)."""
        return self.config.impl != "off" and self.every > 0 and i % self.every == self.every - 1

    def iteration(self, i: int) -> tuple[float, ...]:
        """One training step on batch ``i``; returns the spans (seconds, in SPANS order)."""
        x, y = self.batches[i % len(self.batches)]
        ctx = contextlib.nullcontext() if self.synced(i) else self.net.no_sync()
        clock = time.perf_counter
        t0 = clock()
        with ctx:
            loss = self.spec.loss(self.net(x), y)
            t1 = clock()
            loss.backward()
        t2 = clock()
        if self.config.impl == "off":
            self._allreduce_flat()
        t3 = clock()
        self.opt.step()
        self.opt.zero_grad()
        t4 = clock()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0

    def _allreduce_flat(self) -> None:
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def num_buckets(self) -> int | None:
        """Buckets in use (after the rebuild), where the implementation says."""
        if isinstance(self.net, ddp.DistributedDataParallel):
            return len(self.net.reducer.buckets)
        try:
            sizes = self.net._get_ddp_logging_data().get("rebuilt_bucket_sizes")
            return len(str(sizes).split(",")) if sizes else None
        except Exception:  # noqa: BLE001 - a private torch API; the count is only informative
            return None

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])


# ----------------------------------------------------------------------------
# the world: process groups side by side, untimed exchanges
# ----------------------------------------------------------------------------
def auto_threads(ranks: int) -> int:
    """torch threads per rank for ``--threads auto``: ``$OMP_NUM_THREADS`` when set (a
    launcher or the user chose), else the cores shared out among the ranks. More
    threads than cores per rank starve the backends' communication threads."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) // ranks)


class World:
    """This rank, the process group of each backend (the default group's backend
    first, the others from ``dist.new_group``), subgroups of the first k ranks for
    scaling, and a gloo group for the untimed exchanges (a waiting gloo rank sleeps)."""

    def __init__(self, args: argparse.Namespace):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        timeout = datetime.timedelta(seconds=args.timeout)
        self.groups = {args.backend_list[0]: dist.group.WORLD}
        for b in args.backend_list[1:]:
            self.groups[b] = dist.new_group(backend=b, timeout=timeout)
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout)
        self.cores = os.cpu_count() or 1
        self.threads = int(args.threads) if args.threads != "auto" else auto_threads(self.size)
        torch.set_num_threads(self.threads)
        self.scaling_worlds = sorted({k for k in SCALING_WORLDS if k <= self.size} | {self.size})
        # per k: (backend -> group, control group); None on ranks outside the first k
        self.sub: dict[int, tuple[dict, Any] | None] = {}
        if "scaling" in args.section_list:
            for k in self.scaling_worlds:
                if k == self.size:
                    self.sub[k] = (self.groups, self.ctrl)
                    continue
                ranks = list(range(k))
                gs = {b: dist.new_group(ranks, backend=b, timeout=timeout)
                      for b in args.backend_list}
                ctrl = dist.new_group(ranks, backend="gloo", timeout=timeout)
                self.sub[k] = (gs, ctrl) if self.rank < k else None

    def oversubscribed(self, k: int | None = None) -> bool:
        return (k or self.size) > self.cores

    def gather(self, obj: Any) -> list:
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def agree(self, err: str | None) -> str | None:
        """The first error any rank saw, on every rank."""
        errs = [e for e in self.gather(err) if e]
        return errs[0] if errs else None


# ----------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------
def nosync_cycles(iters: int, n: int) -> int:
    """Timed cycles of n iterations: about ``iters`` iterations, at least 3 cycles."""
    return max(3, math.ceil(iters / n))


def measure(replicas: dict[str, Replica], cycles: int, warmup: int, rounds: int,
            ctrl: Any, progress: Progress, what: str) -> dict[str, dict]:
    """Time ``cycles`` cycles (``every`` iterations each) of every replica on this rank.

    Each replica first runs ``warmup`` synchronized iterations (the first builds the
    buckets from the observed gradient order). The timed cycles are split into
    ``rounds`` rounds that visit the replicas in turn, rotating the order, so load
    from other processes falls on all of them alike; the ranks of ``ctrl`` start each
    batch together. Returns per replica this rank's per-cycle spans (seconds per
    iteration, amortized over the cycle), as a list of rows in SPANS order.
    """
    names = list(replicas)
    for name in names:
        r = replicas[name]
        for i in range(warmup):
            r.iteration(r.every - 1 if r.every else i)  # synchronized where it ever is
    rounds = max(1, min(rounds, cycles))
    times: dict[str, list] = {n: [] for n in names}
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection pause in one rank stalls all of them
    try:
        for rnd in range(rounds):
            k = rnd % len(names)
            for name in names[k:] + names[:k]:
                progress.step(f"{what} {name}")
                r = replicas[name]
                cycle = max(1, r.every)
                n = cycles // rounds + (1 if rnd < cycles % rounds else 0)
                dist.barrier(group=ctrl)
                for _ in range(n):
                    spans = np.zeros(len(SPANS))
                    for i in range(cycle):
                        spans += r.iteration(i)
                    times[name].append((spans / cycle).tolist())
    finally:
        if gc_was:
            gc.enable()
    return times


def statistics(world: World, mine: dict[str, list] | None) -> dict[str, dict]:
    """Combine every rank's spans: per span, each rank's median (ms) and their maximum.
    Ranks that did not take part pass None."""
    meds = None
    if mine is not None:
        meds = {n: np.median(np.array(rows), axis=0).tolist() for n, rows in mine.items()}
    everyone = [m for m in world.gather(meds) if m is not None]
    out = {}
    for name in everyone[0]:
        per_rank = np.array([m[name] for m in everyone]) * 1e3  # ranks x spans, ms
        out[name] = {"ms": {s: round(float(per_rank[:, j].max()), 3) for j, s in enumerate(SPANS)},
                     "rank_median_ms": {s: [round(float(v), 3) for v in per_rank[:, j]]
                                        for j, s in enumerate(SPANS)},
                     "samples": len(mine[name]) if mine else None}
    return out


# ----------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------
class Bench:
    """Runs the selected sections for the selected models on this rank."""

    def __init__(self, args: argparse.Namespace, world: World):
        self.a, self.w = args, world
        self.configs = [Config(i, b) for b in args.backend_list for i in args.impl_list]
        self.offs = [Config("off", b) for b in args.backend_list]
        size = "quick" if args.quick else "full"
        self.specs = [ModelSpec(m, MODEL_SIZES[m][size], seed=17 + i)
                      for i, m in enumerate(args.model_list)]
        self.progress = Progress(self._planned_steps(), world.rank == 0 and (
            args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())))
        self.doc: dict = {"schema": SCHEMA}

    def _planned_steps(self) -> int:
        a, nc = self.a, len(self.configs)
        per_model = {"breakdown": (2 * nc + len(self.offs)) * a.rounds,
                     "buckets": len(a.caps) * nc * a.rounds,
                     "scaling": len(self.w.scaling_worlds) * nc * a.rounds,
                     "nosync": nc * sum(min(a.rounds, nosync_cycles(a.iters, n))
                                        for n in NOSYNC_EVERY)}
        return len(self.specs) * sum(per_model[s] for s in a.section_list)

    def _timed(self, replicas: dict[str, Replica], cycles: int, what: str,
               ctrl: Any = None) -> dict[str, dict]:
        mine = None
        if replicas is not None:
            mine = measure(replicas, cycles, self.a.warmup, self.a.rounds,
                           ctrl or self.w.ctrl, self.progress, what)
        return statistics(self.w, mine)

    # -- verification -------------------------------------------------------------
    def verify(self, spec: ModelSpec) -> dict:
        """Train every configuration (and overlap off) VERIFY_STEPS steps from the same
        start on the same data; the parameters must agree across ranks and with the
        first configuration. Raises RuntimeError (on every rank) when they do not."""
        out, ref = {}, None
        for config in self.configs + self.offs:
            rep = Replica(spec, config, self.w.groups[config.backend])
            for i in range(VERIFY_STEPS):
                rep.iteration(i)
            flat = rep.flat_params()
            del rep
            if ref is None:
                ref = flat
            rank0 = flat.clone()
            dist.broadcast(rank0, group=self.w.ctrl, group_src=0)
            diffs = (float((flat - rank0).abs().max()), float((flat - ref).abs().max()))
            oks = (bool(torch.allclose(flat, rank0, VERIFY_RTOL, VERIFY_ATOL)),
                   bool(torch.allclose(flat, ref, VERIFY_RTOL, VERIFY_ATOL)))
            everyone = self.w.gather((diffs, oks))
            across = max(e[0][0] for e in everyone)
            versus = max(e[0][1] for e in everyone)
            ok_ranks, ok_ref = all(e[1][0] for e in everyone), all(e[1][1] for e in everyone)
            out[config.name] = {"max_abs_diff_across_ranks": across,
                                f"max_abs_diff_vs_{self.configs[0].name}": versus,
                                "ok": ok_ranks and ok_ref}
            if not (ok_ranks and ok_ref):
                what = ("differ across ranks" if not ok_ranks else
                        f"differ from {self.configs[0].name}'s")
                raise RuntimeError(
                    f"bench_ddp: verification failed for {spec.name} with {config.name}: after "
                    f"{VERIFY_STEPS} steps the parameters {what} (max |diff| across ranks "
                    f"{across:.3g}, vs {self.configs[0].name} {versus:.3g}; allclose rtol "
                    f"{VERIFY_RTOL:g} atol {VERIFY_ATOL:g}). The timings would compare "
                    "different computations; not timing.")
        return out

    # -- sections -------------------------------------------------------------------
    def breakdown(self, spec: ModelSpec) -> dict:
        reps: dict[str, Replica] = {}
        for c in self.configs:
            g = self.w.groups[c.backend]
            reps[c.name] = Replica(spec, c, g)
            reps[c.name + " no_sync"] = Replica(spec, c, g, every=0)
        for c in self.offs:
            reps[c.name] = Replica(spec, c, self.w.groups[c.backend], every=0)
        st = self._timed(reps, self.a.iters, f"breakdown {spec.name}")
        rows = {}
        for c in self.configs:
            s, ns = st[c.name]["ms"], st[c.name + " no_sync"]["ms"]
            rows[c.name] = {
                "impl": c.impl, "backend": c.backend, "forward_ms": s["forward"],
                "backward_ms": s["backward"], "backward_compute_ms": ns["backward"],
                "exposed_comm_ms": round(s["backward"] - ns["backward"], 3),
                "optimizer_ms": s["optimizer"], "total_ms": s["total"],
                "total_no_sync_ms": ns["total"], "buckets": reps[c.name].num_buckets(),
                "sync": st[c.name], "no_sync": st[c.name + " no_sync"]}
        overlap = {}
        for c in self.offs:
            o = st[c.name]["ms"]
            rows[c.name] = {"impl": "off", "backend": c.backend, "forward_ms": o["forward"],
                            "backward_ms": o["backward"], "comm_ms": o["comm"],
                            "optimizer_ms": o["optimizer"], "total_ms": o["total"],
                            "spans": st[c.name]}
            entry = {"off_total_ms": o["total"], "off_comm_ms": o["comm"],
                     "comm_share_off": round(o["comm"] / o["total"], 4)}
            for impl in self.a.impl_list:
                on = rows[f"{impl}/{c.backend}"]
                saving = o["total"] - on["total_ms"]
                entry[impl] = {
                    "on_total_ms": on["total_ms"], "saving_ms": round(saving, 3),
                    "saving_pct": round(100 * saving / o["total"], 2),
                    # how much of the flat allreduce's time the buckets hid behind backward
                    "hidden_comm_fraction": round(1 - on["exposed_comm_ms"] / o["comm"], 3)
                    if o["comm"] > 0 else None}
            overlap[c.backend] = entry
        return {"rows": rows, "overlap": overlap}

    def buckets(self, spec: ModelSpec) -> dict:
        rows = []
        for cap in self.a.caps:
            reps = {c.name: Replica(spec, c, self.w.groups[c.backend], cap_mb=cap)
                    for c in self.configs}
            st = self._timed(reps, self.a.iters, f"buckets {spec.name} cap {cap}")
            for c in self.configs:
                rows.append({"config": c.name, "impl": c.impl, "backend": c.backend,
                             "bucket_cap_mb": cap, "cap_used_mb": reps[c.name].cap_mb,
                             "buckets": reps[c.name].num_buckets(),
                             "total_ms": st[c.name]["ms"]["total"],
                             "backward_ms": st[c.name]["ms"]["backward"], "spans": st[c.name]})
            del reps
        return {"rows": rows}

    def scaling(self, spec: ModelSpec) -> dict:
        rows = []
        batch = spec.hp["batch"]
        for k in self.w.scaling_worlds:
            sub = self.w.sub[k]
            reps = None
            if sub is not None:  # the first k ranks train; the others wait in statistics()
                groups, ctrl = sub
                reps = {c.name: Replica(spec, c, groups[c.backend]) for c in self.configs}
                mine = measure(reps, self.a.iters, self.a.warmup, self.a.rounds, ctrl,
                               self.progress, f"scaling {spec.name} k={k}")
                st = statistics(self.w, mine)
            else:
                st = statistics(self.w, None)
            for c in self.configs:
                t = st[c.name]["ms"]["total"]
                rows.append({"config": c.name, "impl": c.impl, "backend": c.backend,
                             "world": k, "total_ms": t,
                             "samples_per_s": round(k * batch / (t / 1e3), 2),
                             "oversubscribed": self.w.oversubscribed(k), "spans": st[c.name]})
            del reps
        base = {r["config"]: r["samples_per_s"] for r in rows if r["world"] == 1}
        for r in rows:
            r["scaling_fraction"] = round(r["samples_per_s"] / (r["world"] * base[r["config"]]), 4)
        return {"rows": rows, "batch_per_rank": batch,
                "note": "weak scaling: the batch per rank stays fixed; the ranks outside the "
                        "first k wait at a gloo barrier (sleeping)"}

    def nosync(self, spec: ModelSpec) -> dict:
        rows = []
        for n in NOSYNC_EVERY:
            reps = {c.name: Replica(spec, c, self.w.groups[c.backend], every=n)
                    for c in self.configs}
            cycles = nosync_cycles(self.a.iters, n)
            st = self._timed(reps, cycles, f"nosync {spec.name} n={n}")
            for c in self.configs:
                rows.append({"config": c.name, "impl": c.impl, "backend": c.backend, "n": n,
                             "amortized_ms": st[c.name]["ms"]["total"], "cycles": cycles,
                             "spans": st[c.name]})
            del reps
        one = {r["config"]: r["amortized_ms"] for r in rows if r["n"] == 1}
        for r in rows:
            r["speedup_vs_n1"] = round(one[r["config"]] / r["amortized_ms"], 3)
        return {"rows": rows, "statistic": "per rank: median over cycles of n iterations of "
                                           "the cycle's time / n; max over ranks"}

    # -- everything ---------------------------------------------------------------------
    def run(self) -> dict:
        a, w = self.a, self.w
        self.doc["meta"] = self.meta()
        if w.rank == 0:
            print(header_text(self.doc["meta"]), flush=True)
        self.doc["verification"] = {}
        for spec in self.specs:
            self.doc["verification"][spec.name] = self.verify(spec)
        if w.rank == 0:
            print(verification_text(self.doc["verification"]), flush=True)
        for section in a.section_list:
            self.doc[section] = {}
            for spec in self.specs:
                part = getattr(self, section)(spec)
                self.doc[section][spec.name] = part
                if w.rank == 0:
                    self.progress.clear()
                    print(SECTION_TEXT[section](spec.name, part, self.doc["meta"]), flush=True)
        self.progress.done()
        self.doc["meta"]["load_average"]["end"] = loadavg()
        return self.doc

    def meta(self) -> dict:
        a, w = self.a, self.w
        models = {}
        for spec in self.specs:
            models[spec.name] = {**spec.describe(spec.build()), "hyperparameters":
                                 {k: list(v) if isinstance(v, tuple) else v
                                  for k, v in spec.hp.items()}}
        launcher = ("torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else
                    "mpiexec" if any(v in os.environ for v in MPI_LAUNCHER_VARS) else "none")
        try:
            mpi = mpi_library()
        except Exception as e:  # noqa: BLE001 - informative only
            mpi = f"unknown ({e})"
        return {
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world_size": w.size, "launcher": launcher, "cores": w.cores,
            "torch_threads_per_rank": w.threads, "oversubscribed": w.oversubscribed(),
            "cpu": cpu_model(),
            "versions": {"ringcomm": ringcomm.__version__, "torch": torch.__version__,
                         "mpi4py": version_of("mpi4py"), "mpi_library": mpi,
                         "numpy": np.__version__, "matplotlib": version_of("matplotlib"),
                         "python": platform.python_version()},
            "quick": a.quick, "models": models, "sections": a.section_list,
            "configurations": [c.name for c in self.configs],
            "default_group_backend": a.backend_list[0],
            "overlap_off": OVERLAP_OFF,
            "optimizer": f"SGD lr {LR:g} momentum {MOMENTUM:g}, zero_grad() after each step",
            "bucket_caps_mb": list(a.caps),
            "breakdown_buckets": "each implementation's default: 25 MiB, first bucket 1 MiB",
            "timing": {"warmup": a.warmup, "iters": a.iters, "rounds": a.rounds,
                       "clock": "time.perf_counter spans on each rank",
                       "statistic": "max over ranks of each rank's median over iterations",
                       "exposed_comm": EXPOSED_METHOD},
            "verification": {"steps": VERIFY_STEPS, "rtol": VERIFY_RTOL, "atol": VERIFY_ATOL},
            "load_average": {"start": loadavg(), "end": None},
            "argv": sys.argv[1:],
        }


# ----------------------------------------------------------------------------
# speed targets (data in bench_ddp_targets.json)
# ----------------------------------------------------------------------------
_TARGET_KEYS = {"name": str, "metric": str, "models": str, "of": str, "versus": str,
                "bound": str, "goal": (int, float)}
METRICS = ("iteration_ratio", "overlap_saving")


def load_targets(path: str) -> list[dict]:
    """The targets in the JSON file at ``path``.

    Raises:
        ValueError: unreadable, or a target lacks a field or has a bad one (named).
    """
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--targets {path!r}: cannot read it: {e}") from e
    if not isinstance(doc, dict) or doc.get("schema") != TARGETS_SCHEMA:
        raise ValueError(f"--targets {path!r}: not a targets file (schema must be "
                         f"{TARGETS_SCHEMA!r})")
    for i, t in enumerate(doc.get("targets", [])):
        where = f"--targets {path!r}, target {i}"
        for k, typ in _TARGET_KEYS.items():
            if not isinstance(t.get(k), typ) or isinstance(t.get(k), bool):
                raise ValueError(f"{where}: field {k!r} is missing or of the wrong type")
        if t["metric"] not in METRICS:
            raise ValueError(f"{where}: metric must be one of {', '.join(METRICS)}, "
                             f"got {t['metric']!r}")
        if t["bound"] not in ("<=", ">="):
            raise ValueError(f"{where}: bound must be '<=' or '>=', got {t['bound']!r}")
    return doc.get("targets", [])


def comm_heavy_model(doc: dict) -> str | None:
    """The measured model whose flat allreduce takes the largest share of an overlap-off
    iteration on the default group's backend."""
    over = doc.get("breakdown", {})
    b = doc["meta"]["default_group_backend"]
    shares = {m: part["overlap"][b]["comm_share_off"] for m, part in over.items()
              if b in part["overlap"]}
    return max(shares, key=shares.get) if shares else None


def check_targets(doc: dict, spec: list[dict]) -> tuple[str, list[dict]]:
    """Compare the breakdown section of ``doc`` with the targets; text and records.

    ``iteration_ratio``: total time per iteration of ``of`` / of ``versus``.
    ``overlap_saving``: (``versus`` - ``of``) / ``versus``, ``versus`` being an
    overlap-off configuration. ``models``: ``each`` (every measured model must meet
    it), ``comm_heavy`` (:func:`comm_heavy_model`) or a model name.
    """
    lines = ["#", f"# speed targets ({doc['meta']['world_size']} ranks; checked, never fatal)"]
    recs = []
    rows_by_model = {m: part["rows"] for m, part in doc.get("breakdown", {}).items()}
    for t in spec:
        models = (list(rows_by_model) if t["models"] == "each" else
                  [comm_heavy_model(doc)] if t["models"] == "comm_heavy" else [t["models"]])
        per_model = {}
        for m in models:
            rows = rows_by_model.get(m or "", {})
            if t["of"] in rows and t["versus"] in rows:
                a, b = rows[t["of"]]["total_ms"], rows[t["versus"]]["total_ms"]
                value = a / b if t["metric"] == "iteration_ratio" else (b - a) / b
                per_model[m] = {"of_ms": a, "versus_ms": b, "value": round(value, 4),
                                "ratio": round(a / b, 4)}
        rec = {**t, "per_model": per_model}
        stated = (f", stated for {t['ranks']} ranks" if t.get("ranks") not in
                  (None, doc["meta"]["world_size"]) else "")
        head = f"#   {t['name']}{stated}: "
        if not per_model:
            rec.update(met=None, value=None, ratio=None)
            lines.append(head + f"NOT MEASURED (needs the breakdown section with {t['of']} and "
                         f"{t['versus']}" + (f" for model {t['models']}" if t["models"] not in
                                             ("each", "comm_heavy") else "") + ")")
        else:
            good = {m: (e["value"] <= t["goal"] if t["bound"] == "<=" else e["value"] >= t["goal"])
                    for m, e in per_model.items()}
            worst = (max if t["bound"] == "<=" else min)(per_model, key=lambda m: per_model[m]["value"])
            e = per_model[worst]
            rec.update(met=all(good.values()), value=e["value"], ratio=e["ratio"], worst_model=worst)
            shown = (f"{e['value']:.3f}x" if t["metric"] == "iteration_ratio"
                     else f"saves {100 * e['value']:.1f}%")
            lines.append(head + f"{worst}: {t['of']} {e['of_ms']:.1f} ms vs {t['versus']} "
                         f"{e['versus_ms']:.1f} ms = {shown} (ratio {e['ratio']:.3f}; target "
                         f"{t['bound']} {t['goal']:g}) {'MET' if rec['met'] else 'MISSED'}")
        recs.append(rec)
    return "\n".join(lines), recs


# ----------------------------------------------------------------------------
# text on stdout
# ----------------------------------------------------------------------------
def _over(meta: dict, k: int | None = None) -> str:
    k = k or meta["world_size"]
    return f" (OVERSUBSCRIBED: {k} ranks on {meta['cores']} cores)" if k > meta["cores"] else ""


def header_text(meta: dict) -> str:
    v = meta["versions"]
    lines = [
        f"# ringcomm bench_ddp {meta['started']}" + (" (quick)" if meta["quick"] else ""),
        f"# world: {meta['world_size']} ranks, launcher {meta['launcher']}, {meta['cores']} "
        f"cores ({meta['cpu']}), torch threads per rank {meta['torch_threads_per_rank']}"
        + _over(meta),
        f"# versions: ringcomm {v['ringcomm']}, torch {v['torch']}, mpi4py {v['mpi4py']}, "
        f"{v['mpi_library']}, numpy {v['numpy']}, python {v['python']}",
        f"# configurations: {', '.join(meta['configurations'])} (implementation/backend; "
        f"{meta['default_group_backend']} is the default group, the others dist.new_group)",
    ]
    for name, m in meta["models"].items():
        lines.append(f"# model {name}: {m['description']}; {m['parameters'] / 1e6:.2f} M "
                     f"parameters in {m['parameter_tensors']} tensors, gradients "
                     f"{format_size(m['gradient_bytes'])}; batch {m['batch_per_rank']} "
                     f"{m['sample']} per rank")
    t = meta["timing"]
    lines += [f"# timing: {t['clock']}; warm-up {t['warmup']}, {t['iters']} timed iterations "
              f"in {t['rounds']} rounds across configurations; {t['statistic']}",
              f"# {t['exposed_comm']}",
              f"# {meta['overlap_off']}",
              f"# optimizer: {meta['optimizer']}",
              "# load average at start: " + " ".join(
                  f"{x:.2f}" for x in meta["load_average"]["start"] or [])
              + f" (other processes on these {meta['cores']} cores skew every number)"]
    return "\n".join(lines)


def verification_text(ver: dict) -> str:
    worst = max(max(v for k, v in r.items() if k.startswith("max_abs")) for m in ver.values()
                for r in m.values())
    n = sum(len(m) for m in ver.values())
    return (f"# verification: after {VERIFY_STEPS} steps the parameters of all {n} "
            f"(model, configuration) pairs agree across ranks and configurations "
            f"(max |diff| {worst:.2g}): OK")


def breakdown_text(model: str, part: dict, meta: dict) -> str:
    lines = ["#", f"# 1. latency breakdown per iteration, {model}, {meta['world_size']} ranks "
                  f"(ms)" + _over(meta),
             f"# {'configuration':<16} {'forward':>8} {'backward':>9} {'compute':>8} "
             f"{'exposed':>8} {'comm':>7} {'optim':>7} {'total':>8} {'buckets':>7}"]
    for name, r in part["rows"].items():
        if r["impl"] == "off":
            lines.append(f"  {name:<16} {r['forward_ms']:8.1f} {r['backward_ms']:9.1f} "
                         f"{r['backward_ms']:8.1f} {'--':>8} {r['comm_ms']:7.1f} "
                         f"{r['optimizer_ms']:7.1f} {r['total_ms']:8.1f} {1:>7}")
        else:
            nb = "--" if r["buckets"] is None else str(r["buckets"])
            lines.append(f"  {name:<16} {r['forward_ms']:8.1f} {r['backward_ms']:9.1f} "
                         f"{r['backward_compute_ms']:8.1f} {r['exposed_comm_ms']:8.1f} "
                         f"{'--':>7} {r['optimizer_ms']:7.1f} {r['total_ms']:8.1f} {nb:>7}")
    lines.append("# (compute = backward under no_sync(); exposed = backward - compute; comm = "
                 "overlap off's flat allreduce)")
    for b, o in part["overlap"].items():
        per = "; ".join(f"{impl} {e['on_total_ms']:.1f} ms saves {e['saving_ms']:.1f} ms "
                        f"({e['saving_pct']:.1f}%), hides "
                        + (f"{100 * e['hidden_comm_fraction']:.0f}%" if e["hidden_comm_fraction"]
                           is not None else "--") + " of the allreduce"
                        for impl, e in o.items() if isinstance(e, dict))
        lines.append(f"# overlap on vs off, {b}: off {o['off_total_ms']:.1f} ms (allreduce "
                     f"{o['off_comm_ms']:.1f} ms, {100 * o['comm_share_off']:.0f}%); {per}")
    return "\n".join(lines)


def _cap_label(cap: Any) -> str:
    return "one" if cap == "all" else str(cap)


def buckets_text(model: str, part: dict, meta: dict) -> str:
    configs = list(dict.fromkeys(r["config"] for r in part["rows"]))
    caps = list(dict.fromkeys(r["bucket_cap_mb"] for r in part["rows"]))
    lines = ["#", f"# 2. time per iteration (ms) against bucket_cap_mb, {model} "
                  "(0: one bucket per parameter; one: a cap above the model size; "
                  "[n]: buckets used)" + _over(meta),
             f"# {'cap (MB)':>8} " + " ".join(f"{c:>22}" for c in configs)]
    for cap in caps:
        cells = []
        for c in configs:
            r = next(r for r in part["rows"] if r["config"] == c and r["bucket_cap_mb"] == cap)
            nb = f"[{r['buckets']}]" if r["buckets"] is not None else ""
            cells.append(f"{r['total_ms']:15.1f} {nb:>6}")
        lines.append(f"  {_cap_label(cap):>8} " + " ".join(cells))
    return "\n".join(lines)


def scaling_text(model: str, part: dict, meta: dict) -> str:
    configs = list(dict.fromkeys(r["config"] for r in part["rows"]))
    worlds = sorted({r["world"] for r in part["rows"]})
    lines = ["#", f"# 3. scaling, {model}: samples/s over all ranks (fraction of linear), "
                  f"batch {part['batch_per_rank']} per rank",
             f"# {'ranks':>5} " + " ".join(f"{c:>22}" for c in configs)]
    for k in worlds:
        cells = []
        for c in configs:
            r = next(r for r in part["rows"] if r["config"] == c and r["world"] == k)
            cells.append(f"{r['samples_per_s']:13.1f} ({r['scaling_fraction']:5.2f})")
        lines.append(f"  {k:>5} " + " ".join(cells) + _over(meta, k))
    return "\n".join(lines)


def nosync_text(model: str, part: dict, meta: dict) -> str:
    configs = list(dict.fromkeys(r["config"] for r in part["rows"]))
    lines = ["#", f"# 4. skipping synchronization, {model}: amortized ms per iteration with "
                  "no_sync() for n-1 of every n (speed-up over n=1)" + _over(meta),
             f"# {'n':>5} " + " ".join(f"{c:>22}" for c in configs)]
    for n in sorted({r["n"] for r in part["rows"]}):
        cells = []
        for c in configs:
            r = next(r for r in part["rows"] if r["config"] == c and r["n"] == n)
            cells.append(f"{r['amortized_ms']:13.1f} ({r['speedup_vs_n1']:5.2f}x)")
        lines.append(f"  {n:>5} " + " ".join(cells))
    return "\n".join(lines)


SECTION_TEXT: dict[str, Callable[[str, dict, dict], str]] = {
    "breakdown": breakdown_text, "buckets": buckets_text, "scaling": scaling_text,
    "nosync": nosync_text}


# ----------------------------------------------------------------------------
# plots, one per question
# ----------------------------------------------------------------------------
def plot(doc: dict, out_dir: str) -> list[str]:
    """PNGs in ``out_dir`` (bench_ddp_<section>.png); returns their paths.

    Raises:
        ImportError: no matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    meta, written = doc["meta"], []
    sub = (f"{meta['world_size']} ranks, {meta['cores']} cores"
           + (" (oversubscribed)" if meta["oversubscribed"] else "") + f", {meta['started']}")

    def panels(section: str) -> tuple[Any, Any]:
        models = list(doc[section])
        fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
        return fig, list(zip(models, axes[0]))

    def save(fig: Any, section: str, title: str) -> None:
        fig.suptitle(f"{title}\n{sub}", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"bench_ddp_{section}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "breakdown" in doc:
        fig, ps = panels("breakdown")
        parts = (("forward", "C0"), ("backward compute", "C1"),
                 ("exposed communication", "C3"), ("optimizer", "C2"))
        for model, ax in ps:
            rows = doc["breakdown"][model]["rows"]
            names = list(rows)
            stacks = []
            for n in names:
                r = rows[n]
                if r["impl"] == "off":
                    stacks.append((r["forward_ms"], r["backward_ms"], r["comm_ms"],
                                   r["optimizer_ms"]))
                else:
                    stacks.append((r["forward_ms"], r["backward_compute_ms"],
                                   max(0.0, r["exposed_comm_ms"]), r["optimizer_ms"]))
            bottom = np.zeros(len(names))
            for j, (label, color) in enumerate(parts):
                vals = np.array([s[j] for s in stacks])
                ax.bar(names, vals, bottom=bottom, label=label, color=color)
                bottom += vals
            ax.set_title(model)
            ax.set_ylabel("ms per iteration")
            ax.set_ylim(0, 1.3 * max(bottom))  # room for the legend above the bars
            ax.tick_params(axis="x", rotation=30)
            ax.legend(fontsize=8, ncol=2, loc="upper center")
            ax.grid(True, axis="y", alpha=0.3)
        save(fig, "breakdown", "Latency breakdown (off = no overlap: flat allreduce after backward)")

    def lines(section: str, x_key: str, y_key: str, xlabel: str, ylabel: str, title: str,
              xticks: Callable | None = None, extra: Callable | None = None) -> None:
        fig, ps = panels(section)
        for model, ax in ps:
            rows = doc[section][model]["rows"]
            for i, c in enumerate(dict.fromkeys(r["config"] for r in rows)):
                pts = [r for r in rows if r["config"] == c]
                xs = [xticks(r[x_key]) if xticks else r[x_key] for r in pts]
                ax.plot(xs, [r[y_key] for r in pts], marker="o", color=f"C{i}", label=c)
                if extra:
                    extra(ax, pts, xs, i, c)
            ax.set_title(model)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        save(fig, section, title)

    if "buckets" in doc:
        caps = list(dict.fromkeys(r["bucket_cap_mb"] for m in doc["buckets"].values()
                                  for r in m["rows"]))
        pos = {c: i for i, c in enumerate(caps)}

        def cap_ticks(ax, pts, xs, i, c):
            ax.set_xticks(range(len(caps)), [_cap_label(c) for c in caps])

        lines("buckets", "bucket_cap_mb", "total_ms", "bucket_cap_mb (one = one bucket)",
              "ms per iteration", "Time per iteration against bucket size",
              xticks=lambda c: pos[c], extra=cap_ticks)
    if "scaling" in doc:
        fig, ps = panels("scaling")
        for model, ax in ps:
            rows = doc["scaling"][model]["rows"]
            ax2 = ax.twinx()
            for i, c in enumerate(dict.fromkeys(r["config"] for r in rows)):
                pts = [r for r in rows if r["config"] == c]
                ks = [r["world"] for r in pts]
                ax.plot(ks, [r["samples_per_s"] for r in pts], marker="o", color=f"C{i}", label=c)
                ax2.plot(ks, [r["scaling_fraction"] for r in pts], marker="x", linestyle="--",
                         color=f"C{i}")
            over = [r["world"] for r in rows if r["oversubscribed"]]
            if over:
                ax.axvspan(min(over) - 0.5, max(over) + 0.5, color="grey", alpha=0.15,
                           label="oversubscribed")
            ax.set_xticks(sorted({r["world"] for r in rows}))
            ax.set_title(model)
            ax.set_xlabel("ranks")
            ax.set_ylabel("samples/s (solid)")
            ax2.set_ylabel("fraction of linear scaling (dashed)")
            ax2.set_ylim(0, 1.1)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        save(fig, "scaling", "Throughput and scaling fraction against world size")
    if "nosync" in doc:
        lines("nosync", "n", "amortized_ms", "synchronize every n iterations (no_sync the others)",
              "amortized ms per iteration", "Skipping synchronization with no_sync()")
    return written


# ----------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sections", default="all",
                   help=f"comma list of {', '.join(SECTIONS)}, or all")
    p.add_argument("--model", default=None,
                   help="resnet, bert or both (default: both; resnet with --quick)")
    p.add_argument("--impls", default="ours,torch", help="DDP implementations: ours, torch")
    p.add_argument("--backends", default="ringcomm,gloo",
                   help="backends; the first is the default group's, the others come from "
                        "dist.new_group")
    p.add_argument("--quick", action="store_true",
                   help="smaller models, fewer iterations and bucket sizes (under a minute "
                        "on 2 ranks)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per configuration (default 8, 3 with --quick)")
    p.add_argument("--warmup", type=int, default=2, help="synchronized iterations first")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds that visit the configurations in turn, rotating the order "
                        "(default: one per timed iteration, the finest interleaving, so that "
                        "bursts of load from other processes fall on every configuration)")
    p.add_argument("--threads", default="auto",
                   help="torch threads per rank; auto = $OMP_NUM_THREADS if set, else "
                        "cores / ranks")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any collective may take (process group timeout)")
    p.add_argument("--json", metavar="FILE", help="write every measured number as JSON")
    p.add_argument("--plot", metavar="DIR", help="write one PNG per section (matplotlib)")
    p.add_argument("--targets", metavar="JSON", default=DEFAULT_TARGETS,
                   help="speed targets to check; 'none' for none")
    p.add_argument("--progress", nargs="?", const="on", choices=("auto", "on", "off"),
                   default="auto", help="progress bar on rank 0's stderr (auto: when it is "
                                        "a terminal; --progress alone: on)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; a bad flag exits 2 naming it (rank 0 prints)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        a.section_list = names(a.sections, SECTIONS, "section (--sections)")
        model = a.model if a.model is not None else ("resnet" if a.quick else "both")
        a.model_list = (list(MODELS) if model.strip().lower() == "both"
                        else names(model, MODELS, "model (--model)"))
        a.impl_list = names(a.impls, IMPLS, "DDP implementation (--impls)")
        a.backend_list = names(a.backends, BACKENDS, "backend (--backends)")
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    a.iters = a.iters if a.iters is not None else (3 if a.quick else 8)
    a.rounds = a.rounds if a.rounds is not None else a.iters
    a.caps = QUICK_BUCKET_CAPS if a.quick else BUCKET_CAPS
    for flag, v, low in (("--iters", a.iters, 1), ("--rounds", a.rounds, 1),
                         ("--warmup", a.warmup, 1)):
        if v < low:
            parser.error(f"{flag} must be at least {low}, got {v}")
    if a.timeout <= 0:
        parser.error(f"--timeout must be positive, got {a.timeout:g}")
    if a.threads != "auto" and not (a.threads.isdigit() and int(a.threads) > 0):
        parser.error(f"--threads must be a positive number or auto, got {a.threads!r}")
    if a.targets.strip().lower() in ("", "none"):
        a.targets = None
    else:
        try:
            a.target_list = load_targets(a.targets)
        except ValueError as e:
            parser.error(str(e))
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0, 1 (verification failed or an error), 2 (bad flags)."""
    args = parse_args(argv)
    launched = any(v in os.environ for v in (*MPI_LAUNCHER_VARS, "TORCHELASTIC_RUN_ID", "RANK"))
    if not launched:
        print("bench_ddp: note: no launcher found; running 1 rank (world size 1). Launch with "
              "`mpiexec -n 2 python scripts/bench_ddp.py` or `torchrun --nproc-per-node 2 "
              "scripts/bench_ddp.py` to compare across ranks.", file=sys.stderr)
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(args.backend_list[0],
                            timeout=datetime.timedelta(seconds=args.timeout))
    rc = 0
    try:
        world = World(args)
        err = None
        try:
            doc = Bench(args, world).run()
        except RuntimeError as e:  # verification failed (on every rank), or a backend error
            err = str(e)
        err = world.agree(err)
        if err:
            if world.rank == 0:
                print(f"bench_ddp: error: {err}", file=sys.stderr, flush=True)
            return 1
        if world.rank == 0:
            rc = finish(doc, args)
        rc = world.gather(rc)[0]
    finally:
        dist.destroy_process_group()
    return rc


def finish(doc: dict, args: argparse.Namespace) -> int:
    """Rank 0 after the run: targets, JSON, plots. Returns the exit status."""
    print("# load average at end: " + " ".join(
        f"{x:.2f}" for x in doc["meta"]["load_average"]["end"] or []), flush=True)
    if args.targets:
        text, recs = check_targets(doc, args.target_list)
        doc["targets"] = {"file": os.path.relpath(args.targets, ROOT)
                          if args.targets.startswith(str(ROOT)) else args.targets,
                          "results": recs}
        print(text, flush=True)
    try:
        if args.plot:
            try:
                for path in plot(doc, args.plot):
                    print(f"# plot: {path}", flush=True)
            except ImportError as e:
                print(f"# plots skipped: matplotlib is not installed ({e}); "
                      "pip install matplotlib", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"# json: {args.json}", flush=True)
    except OSError as e:
        print(f"bench_ddp: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
