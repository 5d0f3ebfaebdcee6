"""The run: verification, then the paper's experiments (sections) per model."""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

import ringcomm
from ringcomm import trace
from ringcomm.bench.session import cpu_model, loadavg, mpi_library, version_of
from ringcomm.bench.timing import Progress
from ringcomm.bench.cli import launcher

from ddp.bench import hooks, tracing
from ddp.bench.configs import Config, Replica, World
from ddp.bench.constants import (EXPOSED_METHOD, LR, MOMENTUM, NOSYNC_EVERY, OVERLAP_OFF,
                                 RR_MECHANISM, SCHEMA, VERIFY_ATOL, VERIFY_RTOL, VERIFY_STEPS)
from ddp.bench.measure import measure, nosync_cycles, statistics
from ddp.bench.models import MODEL_SIZES, ModelSpec
from ddp.bench.report import SECTION_TEXT, header_text, verification_text
from ddp.bench.tracing import Tracer

#: how a speed-up over the smallest K is judged
RR_VERDICT_RULE = ("faster (slower) when the interquartile ranges of the time per iteration "
                   "do not overlap, K's whole range below (above) the baseline's; otherwise "
                   "no difference beyond noise")

#: the graph section's variants: DDP arguments beyond the defaults
GRAPH_VARIANTS = {"default": {}, "find_unused_parameters": {"find_unused_parameters": True},
                  "static_graph": {"static_graph": True}}

#: iterations recorded per K for the round-robin section's trace (--quick: 2)
RR_TRACED_ITERS = 5


def rr_name(config: Config, k: int) -> str:
    return f"{config.name} K={k}"


def rr_verdict(row: dict, base: dict) -> str:
    """faster / slower / no difference beyond noise (see RR_VERDICT_RULE)."""
    if row["q3_ms"] < base["q1_ms"]:
        return "faster"
    if row["q1_ms"] > base["q3_ms"]:
        return "slower"
    return "no difference beyond noise"


class Bench:
    """Runs the selected sections for the selected models on this rank."""

    def __init__(self, args: argparse.Namespace, world: World, tracer: Tracer | None = None):
        self.a, self.w = args, world
        self.tracer = tracer or Tracer(None)
        self.configs = [Config(i, b) for b in args.backend_list for i in args.impl_list]
        self.offs = [Config("off", b) for b in args.backend_list]
        #: the configuration whose trace overhead and traced iteration are measured
        self.traced = next((c for c in self.configs if c.name == tracing.TRACED), None)
        #: model -> configuration -> merged trace of one iteration (rank 0; for the timeline)
        self.traces: dict[str, dict[str, dict]] = {}
        #: model -> K -> merged trace of the round-robin section's traced iterations
        self.rr_traces: dict[str, dict[int, dict]] = {}
        size = "quick" if args.quick else "full"
        self.specs = [ModelSpec(m, MODEL_SIZES[m][size], seed=17 + i)
                      for i, m in enumerate(args.model_list)]
        self.progress = Progress(self._planned_steps(), world.rank == 0 and (
            args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())))
        self.doc: dict = {"schema": SCHEMA}

    def _planned_steps(self) -> int:
        a, nc = self.a, len(self.configs)
        per_model = {"breakdown": (2 * nc + len(self.offs) + bool(self.traced)) * a.rounds,
                     "buckets": len(a.caps) * nc * a.rounds,
                     "scaling": len(self.w.scaling_worlds) * nc * a.rounds,
                     "nosync": nc * sum(min(a.rounds, nosync_cycles(a.iters, n))
                                        for n in NOSYNC_EVERY),
                     "roundrobin": len(a.rr_caps) * nc * len(a.channel_list) * a.rounds,
                     "hooks": sum(not isinstance(hooks.hook_for(h, c.impl, c.backend), str)
                                  for c in self.configs
                                  for h in hooks.hook_names(a.quick)) * a.rounds,
                     "graph": len(GRAPH_VARIANTS) * nc * a.rounds}
        return len(self.specs) * sum(per_model[s] for s in a.section_list)

    def _timed(self, replicas: dict[str, Replica], cycles: int, what: str,
               ctrl: Any = None, session: Callable | None = None) -> dict[str, dict]:
        mine = None
        if replicas is not None:
            mine = measure(replicas, cycles, self.a.warmup, self.a.rounds,
                           ctrl or self.w.ctrl, self.progress, what, session)
        return statistics(self.w, mine)

    # -- verification -------------------------------------------------------------
    def verify(self, spec: ModelSpec) -> dict:
        """Train every configuration (and overlap off, and with the roundrobin section
        every configuration on every round-robin group at the section's smallest
        cap) VERIFY_STEPS steps from the same start on the same data; the parameters
        must agree across ranks and with the first configuration. Raises
        RuntimeError (on every rank) when they do not."""
        runs = [(c.name, c, self.w.groups[c.backend], None) for c in self.configs + self.offs]
        if "roundrobin" in self.a.section_list:
            cap = min(self.a.rr_caps)
            runs += [(rr_name(c, k), c, g, cap) for c, k, g in self.rr_configs()]
        out, ref = {}, None
        ref_name = runs[0][0]
        for name, config, group, cap in runs:
            rep = Replica(spec, config, group, cap_mb=cap)
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
            out[name] = {"max_abs_diff_across_ranks": across,
                         f"max_abs_diff_vs_{ref_name}": versus, "ok": ok_ranks and ok_ref}
            if not (ok_ranks and ok_ref):
                what = ("differ across ranks" if not ok_ranks else
                        f"differ from {ref_name}'s")
                raise RuntimeError(
                    f"bench_ddp: verification failed for {spec.name} with {name}: after "
                    f"{VERIFY_STEPS} steps the parameters {what} (max |diff| across ranks "
                    f"{across:.3g}, vs {ref_name} {versus:.3g}; allclose rtol "
                    f"{VERIFY_RTOL:g} atol {VERIFY_ATOL:g}). The timings would compare "
                    "different computations; not timing.")
        return out

    def rr_configs(self) -> list[tuple[Config, int, Any]]:
        """The roundrobin section's (configuration, K, group): every implementation
        on every backend's round-robin group of K communicators."""
        return [(c, k, self.w.rr[(c.backend, k)]) for c in self.configs
                for k in self.a.channel_list]

    # -- sections -------------------------------------------------------------------
    def breakdown(self, spec: ModelSpec) -> dict:
        reps: dict[str, Replica] = {}
        for c in self.configs:
            g = self.w.groups[c.backend]
            reps[c.name] = Replica(spec, c, g)
            reps[c.name + " no_sync"] = Replica(spec, c, g, every=0)
        for c in self.offs:
            reps[c.name] = Replica(spec, c, self.w.groups[c.backend], every=0)
        if self.traced:
            reps[self.traced.name + " traced"] = Replica(
                spec, self.traced, self.w.groups[self.traced.backend], traced=True)

        def session(r: Replica):  # recording on for the traced replica only
            return self.tracer.own() if r.traced else self.tracer.off()

        st = self._timed(reps, self.a.iters, f"breakdown {spec.name}", session=session)
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
        out = {"rows": rows, "overlap": overlap}
        if self.traced:
            name = self.traced.name
            off, on = st[name]["ms"]["total"], st[name + " traced"]["ms"]["total"]
            out["trace_overhead"] = {
                "config": name, "method": tracing.OVERHEAD_METHOD, "off_total_ms": off,
                "on_total_ms": on, "overhead_ms": round(on - off, 3),
                "overhead_pct": round(100 * (on - off) / off, 2), "traced": st[name + " traced"]}
            out["trace_breakdown"] = self.traced_iteration(spec, rows)
        return out

    def traced_iteration(self, spec: ModelSpec, rows: dict) -> dict | None:
        """One synchronized iteration of the traced configuration (and one of overlap
        off on its backend), after warm-up, each under a recording of its own; rank 0
        merges the ranks' traces, keeps them for the timeline and reads the breakdown
        from the spans (next to the wall-clock one of ``rows``)."""
        c = self.traced
        recorded: dict[str, dict] = {}
        for config, every in ((c, 1), (Config("off", c.backend), 0)):
            if every == 0 and config not in self.offs:
                continue
            rep = Replica(spec, config, self.w.groups[config.backend], every=every)
            for i in range(max(2, self.a.warmup)):  # the first rebuilds the buckets
                rep.iteration(i)
            dist.barrier(group=self.w.ctrl)
            with self.tracer.own() as rec:
                rep.iteration(0)
            recorded[config.name] = rec.document()
            del rep
        everyone = self.w.gather(recorded)
        if self.w.rank != 0:
            return None
        ranks = list(range(self.w.size))
        merged = {n: trace.merge([e[n] for e in everyone]) for n in recorded}
        self.traces[spec.name] = merged
        row = rows[c.name]
        try:
            spans = tracing.breakdown(merged[c.name], ranks)
            off = (tracing.off_breakdown(merged[tracing.TRACED_OFF], ranks)
                   if tracing.TRACED_OFF in merged else None)
        except ValueError as e:  # rank 0 alone: report it, do not stop the run
            return {"config": c.name, "method": tracing.TRACE_METHOD, "error": str(e)}
        out = {"config": c.name, "method": tracing.TRACE_METHOD, **spans,
               # backward without the exposed communication, as the trace's span
               "wall_clock_ms": {"forward": row["forward_ms"],
                                 "backward": row["backward_compute_ms"],
                                 "exposed_comm": row["exposed_comm_ms"],
                                 "optimizer": row["optimizer_ms"], "total": row["total_ms"]},
               "events": sum(1 for e in merged[c.name]["traceEvents"] if e.get("ph") != "M")}
        if off is not None:
            out["off"] = {"config": tracing.TRACED_OFF, **off}
        return out

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

    def roundrobin(self, spec: ModelSpec) -> dict:
        """Time per iteration with K communicators used in turn (ringcomm's channels,
        K gloo groups in round robin), for each K and bucket cap; every K of a cap
        in the same interleaved rounds; speed-ups and verdicts against the smallest K
        (``speedup_vs_k1``, ``base_k``). Then a few traced iterations of ``ddp/`` on
        ringcomm's group per K at the smallest cap (:meth:`rr_traced`)."""
        rows = []
        for cap in self.a.rr_caps:
            reps = {rr_name(c, k): Replica(spec, c, g, cap_mb=cap)
                    for c, k, g in self.rr_configs()}
            st = self._timed(reps, self.a.iters, f"roundrobin {spec.name} cap {cap}")
            for c, k, _ in self.rr_configs():
                name = rr_name(c, k)
                rows.append({"config": c.name, "impl": c.impl, "backend": c.backend, "k": k,
                             "bucket_cap_mb": cap, "buckets": reps[name].num_buckets(),
                             "total_ms": st[name]["ms"]["total"],
                             "q1_ms": st[name]["q1_ms"]["total"],
                             "q3_ms": st[name]["q3_ms"]["total"],
                             "backward_ms": st[name]["ms"]["backward"], "spans": st[name]})
            del reps
        base_k = min(self.a.channel_list)
        by = {(r["config"], r["bucket_cap_mb"], r["k"]): r for r in rows}
        for r in rows:
            b = by[(r["config"], r["bucket_cap_mb"], base_k)]
            r["speedup_vs_k1"] = round(b["total_ms"] / r["total_ms"], 4)
            r["verdict"] = rr_verdict(r, b) if r["k"] != base_k else "baseline"
        out = {"rows": rows, "channels": list(self.a.channel_list), "base_k": base_k,
               "caps": list(self.a.rr_caps), "communicators": self.w.rr_communicators(),
               "mechanism": {b: RR_MECHANISM[b] for b in self.a.backend_list},
               "verdict_rule": RR_VERDICT_RULE}
        if "ringcomm" in self.a.backend_list and "ours" in self.a.impl_list:
            out["trace"] = self.rr_traced(spec)
        return out

    def hooks(self, spec: ModelSpec) -> dict:
        """Time per iteration with each communication hook (:data:`hooks.HOOKS`), each
        implementation with its own hooks, on each backend; then one more synchronized
        iteration per replica, untimed, counts what its hook hands to collectives
        (collectives, payload and wire bytes per rank). Ratios are against the
        allreduce hook of the same configuration."""
        rows, reps = [], {}
        for c in self.configs:
            for h in hooks.hook_names(self.a.quick):
                got = hooks.hook_for(h, c.impl, c.backend)
                if isinstance(got, str):
                    rows.append({"config": c.name, "impl": c.impl, "backend": c.backend,
                                 "hook": h, "skipped": got})
                    continue
                reps[f"{c.name} {h}"] = Replica(spec, c, self.w.groups[c.backend], hook=got)
        st = self._timed(reps, self.a.iters, f"hooks {spec.name}")
        counts = {}
        for name, r in reps.items():
            with hooks.counted(r.group) as tally:
                r.iteration(0)
            counts[name] = tally
        del reps
        for c in self.configs:
            for h in hooks.hook_names(self.a.quick):
                name = f"{c.name} {h}"
                if name not in st:
                    continue
                rows.append({"config": c.name, "impl": c.impl, "backend": c.backend, "hook": h,
                             "total_ms": st[name]["ms"]["total"],
                             "backward_ms": st[name]["ms"]["backward"],
                             "collectives": counts[name]["collectives"],
                             "payload_bytes": counts[name]["payload_bytes"],
                             "wire_bytes": round(counts[name]["wire_bytes"]),
                             "spans": st[name]})
        base = {r["config"]: r for r in rows if r["hook"] == "allreduce" and "skipped" not in r}
        for r in rows:
            b = base.get(r["config"])
            if "skipped" in r or b is None:
                continue
            r["time_vs_allreduce"] = round(r["total_ms"] / b["total_ms"], 3)
            r["wire_vs_allreduce"] = (round(r["wire_bytes"] / b["wire_bytes"], 4)
                                      if b["wire_bytes"] else None)
        return {"rows": rows, "wire_method": hooks.WIRE_METHOD,
                "powerSGD": {"start_powerSGD_iter": hooks.START_ITER, "min_compression_rate": 2,
                             "use_error_feedback": True, "warm_start": True},
                "note": "each implementation with its own hooks (ddp.comm_hooks, torch's "
                        "ddp_comm_hooks); noop sends nothing: the computation alone"}

    def graph(self, spec: ModelSpec) -> dict:
        """Time per iteration with DDP's defaults, with ``find_unused_parameters`` (a
        graph walk and a used-parameter allreduce every iteration) and with
        ``static_graph`` (both once, in the first iteration); ``static_saving_pct``:
        static_graph's saving over find_unused_parameters."""
        rows = []
        reps = {f"{c.name} {v}": Replica(spec, c, self.w.groups[c.backend], options=o)
                for c in self.configs for v, o in GRAPH_VARIANTS.items()}
        st = self._timed(reps, self.a.iters, f"graph {spec.name}")
        del reps
        for c in self.configs:
            for v in GRAPH_VARIANTS:
                name = f"{c.name} {v}"
                rows.append({"config": c.name, "impl": c.impl, "backend": c.backend,
                             "variant": v, "total_ms": st[name]["ms"]["total"],
                             "backward_ms": st[name]["ms"]["backward"], "spans": st[name]})
        by = {(r["config"], r["variant"]): r for r in rows}
        savings = {}
        for c in self.configs:
            fu = by[(c.name, "find_unused_parameters")]["total_ms"]
            sg = by[(c.name, "static_graph")]["total_ms"]
            savings[c.name] = {"find_unused_ms": fu, "static_graph_ms": sg,
                               "static_saving_pct": round(100 * (fu - sg) / fu, 2)}
        return {"rows": rows, "static_vs_find_unused": savings}

    def rr_traced(self, spec: ModelSpec) -> dict | None:
        """RR_TRACED_ITERS (2 with --quick) synchronized iterations of ``ours/ringcomm``
        per K at the smallest cap, after warm-up, recorded with ringcomm.trace; rank 0
        reads from each how many bucket allreduces overlapped and how long they ran
        (:func:`tracing.concurrency_median`) and keeps the traces for the timelines."""
        c, cap = Config("ours", "ringcomm"), min(self.a.rr_caps)
        iters = 2 if self.a.quick else RR_TRACED_ITERS
        recorded: dict[int, dict] = {}
        for k in self.a.channel_list:
            rep = Replica(spec, c, self.w.rr[("ringcomm", k)], cap_mb=cap)
            for i in range(max(2, self.a.warmup)):
                rep.iteration(i)
            dist.barrier(group=self.w.ctrl)
            with self.tracer.own() as rec:
                for i in range(iters):
                    rep.iteration(i)
            recorded[k] = rec.document()
            del rep
        everyone = self.w.gather(recorded)
        if self.w.rank != 0:
            return None
        ranks = list(range(self.w.size))
        out = {"config": c.name, "bucket_cap_mb": cap, "method": tracing.CONCURRENCY_METHOD,
               "iterations": iters, "per_k": {}}
        for k in recorded:
            merged = trace.merge([e[k] for e in everyone])
            self.rr_traces.setdefault(spec.name, {})[k] = merged
            try:
                out["per_k"][str(k)] = tracing.concurrency_median(merged, ranks, iters)
            except ValueError as e:  # rank 0 alone: report it, do not stop the run
                out["per_k"][str(k)] = {"error": str(e)}
        return out

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
        started_by = launcher()
        try:
            mpi = mpi_library()
        except Exception as e:  # noqa: BLE001 - informative only
            mpi = f"unknown ({e})"
        return {
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world_size": w.size, "launcher": started_by, "cores": w.cores,
            "hosts": {h: w.hosts.count(h) for h in dict.fromkeys(w.hosts)}, "links": w.links,
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
            "roundrobin": ({"channels": list(a.channel_list), "bucket_caps_mb": list(a.rr_caps)}
                           if "roundrobin" in a.section_list else None),
            "breakdown_buckets": "each implementation's default: 25 MiB, first bucket 1 MiB",
            "timing": {"warmup": a.warmup, "iters": a.iters, "rounds": a.rounds,
                       "clock": "time.perf_counter spans on each rank",
                       "statistic": "max over ranks of each rank's median over iterations",
                       "exposed_comm": EXPOSED_METHOD,
                       "trace_overhead": tracing.OVERHEAD_METHOD,
                       "trace_breakdown": tracing.TRACE_METHOD},
            "trace": ({"path": a.trace, "note": "--trace: every section but the breakdown "
                       "(whose untraced runs pause it) was timed with the run's recording on"}
                      if a.trace else None),
            "verification": {"steps": VERIFY_STEPS, "rtol": VERIFY_RTOL, "atol": VERIFY_ATOL},
            "load_average": {"start": loadavg(), "end": None},
            "argv": sys.argv[1:],
        }
