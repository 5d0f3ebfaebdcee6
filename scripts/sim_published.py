#!/usr/bin/env python3
"""The simulator beside published measurements, where they describe their setup.

    python scripts/sim_published.py --json docs/data/sim_published.json

* ASTRA-sim's validation against NCCL on an HGX-H100 server
  (https://astra-sim.github.io/astra-sim-docs/validation/hardware/gpu-validation-hgx-h100.html):
  8 H100s on NVSwitches, 900 GB/s bidirectional per GPU, NCCL's ring allreduce
  forced (``NCCL_ALGO=Ring``); the page reports the highest bandwidth NCCL reached,
  741.34 GB/s bidirectional, that is 370.67 GB/s of nccl-tests' bus bandwidth each
  way. The ring is simulated on ``examples/topologies/dgx_8gpu.json`` (450 GB/s a
  port each way) twice: as ringcomm runs it (the file's software: each step's
  reduction a pass of its own after the step's messages), and the links alone
  (software free: what NCCL's kernels, which reduce as the bytes arrive, come near).
  The links-alone figure is the model's bound: the gap to the published figure is
  the share of NVLink's rate NCCL does not reach (protocol and packet overhead),
  which the model does not have.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ringcomm.algorithms import REGISTRY  # noqa: E402
from ringcomm.bench.sizes import BUSBW_FACTOR  # noqa: E402
from ringcomm.sim import load, simulate  # noqa: E402

#: software that costs nothing: the links alone
FREE = {"call_us": 0, "step_us": 0, "message_us": 0, "reduce_gbps": 1e12, "copy_gbps": 1e12}
#: (name, source, topology, collective, algorithm, bytes, published busbw GB/s, note)
PUBLISHED = [
    ("NCCL ring allreduce, 8 H100 (HGX, NVSwitch)",
     "https://astra-sim.github.io/astra-sim-docs/validation/hardware/gpu-validation-hgx-h100.html",
     "examples/topologies/dgx_8gpu.json", "allreduce", "ring", 8 << 30, 741.34 / 2,
     "the page's highest measured bandwidth, 741.34 GB/s bidirectional, halved"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the comparison here")
    a = ap.parse_args(argv)
    rows = []
    for name, source, topo_path, coll, algo, nbytes, published, note in PUBLISHED:
        topo = load(ROOT / topo_path)
        got = {}
        for how, software in (("ringcomm", None), ("links", FREE)):
            if software is not None:
                topo.software = dict(software)
            r = simulate(coll, algo, REGISTRY[coll][algo], topo, nbytes, segment_bytes=1 << 40)
            if r.refused:
                print(f"{name}: {r.refused}", file=sys.stderr)
                return 1
            got[how] = nbytes / r.seconds * BUSBW_FACTOR[coll](topo.size) / 1e9
        link = topo.intra_bandwidth / 1e9
        rows.append({"name": name, "source": source, "topology": topo_path,
                     "collective": coll, "algorithm": algo, "bytes": nbytes,
                     "ranks": topo.size, "published_busbw_gbps": published,
                     "published_note": note, "link_gbps": link,
                     "simulated_ringcomm_busbw_gbps": round(got["ringcomm"], 1),
                     "simulated_links_busbw_gbps": round(got["links"], 1),
                     "links_over_published": round(got["links"] / published, 3),
                     "published_share_of_link": round(published / link, 3)})
        print(f"{name}: published {published:.1f} GB/s; simulated: ringcomm's ring "
              f"{got['ringcomm']:.1f} GB/s, links alone {got['links']:.1f} GB/s "
              f"({got['links'] / published:.2f}x the published)")
    doc = {"schema": "ringcomm.sim_published/1",
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
