"""Predict before you run: any registered algorithm timed on a described cluster.

    python -m ringcomm.sim examples/topologies/two_racks.json --algos ring,tree -b 64K -e 16M

or, from Python::

    from ringcomm.sim import load, simulate
    from ringcomm.algorithms import REGISTRY
    topo = load("examples/topologies/fat_tree_1024.json")
    r = simulate("allreduce", "ring", REGISTRY["allreduce"]["ring"], topo, 16 << 20)
    r.seconds, r.busiest_link, r.shares()

The modules, bottom up: :mod:`~ringcomm.sim.topology` (the file format, checked),
:mod:`~ringcomm.sim.network` (links and routes), :mod:`~ringcomm.sim.program` (every
rank's slots and messages, from every rank's schedule or rank 0's rotated),
:mod:`~ringcomm.sim.engine` (max-min fair flows, event by event or round by round),
:mod:`~ringcomm.sim.costs` (the software's costs), :mod:`~ringcomm.sim.cell`
(one proven, timed cell), :mod:`~ringcomm.sim.cli` (the command line). The design,
the format and the validation: docs/simulator.md.
"""
from __future__ import annotations

import importlib

#: public name -> the module that defines it (imported on first use, so that the
#: cost model can use :mod:`~ringcomm.sim.layouts` without the rest)
_LAZY = {"load": "topology", "parse": "topology", "Topology": "topology",
         "TopologyError": "topology", "simulate": "cell", "Result": "cell",
         "Network": "network", "layout_for": "layouts"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"ringcomm.sim.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'ringcomm.sim' has no attribute {name!r}")


__all__ = sorted(_LAZY)
