"""The software's costs the simulator adds to the network's: per call, per step (a
group), per message, and the local reduction's and copy's speed.

A topology file may set any of them (``"software"``); the rest come from
``software.json`` beside this module, fitted to a committed benchmark run of this
machine (``python -m ringcomm.sim.costs docs/data/compare_2ranks.json`` writes it,
and a test holds it to that run): the cost model's fit of the ring allreduce gives
the per-step cost (its ``alpha``: one round of the executor with its messages on
one host) and the reduction's speed (``1/gamma``, measured as a local reduction).
The per-call cost is that fit's ``o``, which is 0 when the run measured one world
size (``o`` and ``alpha`` cannot be told apart there); copies go at the reduction's
speed, as the run does not measure them apart.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ringcomm.sim.engine import Costs
from ringcomm.sim.topology import Topology

DEFAULTS = Path(__file__).with_name("software.json")


def fitted(run: dict, source: str) -> dict:
    """The software costs of a benchmark run's JSON (``ringcomm.bench --json``).

    Raises:
        ValueError: the run has no cost-model fit of the ring allreduce.
    """
    fits = (run.get("analysis") or {}).get("cost_model", {}).get("fits", [])
    ring = [f for f in fits if f["collective"] == "allreduce" and f["algorithm"] == "ring"
            and f.get("dtype", "float") == "float"]
    if not ring:
        raise ValueError(f"{source}: no cost-model fit of the ring allreduce (a run of "
                         "ringcomm.bench with a ring column and its analysis)")
    f = ring[0]
    return {"call_us": round(f["o"] * 1e6, 3), "step_us": round(f["alpha"] * 1e6, 3),
            "message_us": 0.0, "reduce_gbps": round(1e-9 / f["gamma"], 3),
            "copy_gbps": round(1e-9 / f["gamma"], 3),
            "fitted_from": {"file": source, "started": run.get("meta", {}).get("started"),
                            "world_sizes": f.get("world_sizes"),
                            "launcher": run.get("meta", {}).get("launcher")}}


def defaults() -> dict:
    """The committed defaults (``software.json``)."""
    return json.loads(DEFAULTS.read_text())


def costs(topo: Topology, esize: int) -> Costs:
    """The :class:`~ringcomm.sim.engine.Costs` of ``topo``: its file's software costs,
    the defaults for the rest."""
    d = {**defaults(), **topo.software}
    return Costs(call=d["call_us"] * 1e-6, step=d["step_us"] * 1e-6,
                 message=d["message_us"] * 1e-6, reduce_bw=d["reduce_gbps"] * 1e9,
                 copy_bw=d["copy_gbps"] * 1e9, esize=esize)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ringcomm.sim.costs BENCH_RUN.json  (writes "
              f"{DEFAULTS.name})", file=sys.stderr)
        return 2
    src = Path(args[0])
    DEFAULTS.write_text(json.dumps(fitted(json.loads(src.read_text()), src.as_posix()),
                                   indent=1) + "\n")
    print(f"wrote {DEFAULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
