"""ringcomm's collective benchmark: ringcomm's algorithms against the MPI
library's own collectives, gloo and NCCL, in one run, with nccl-tests style
tables, JSON/CSV/Markdown/plot output, an alpha-beta-gamma cost model, tuning
for ``auto`` and speed targets.

Run it with ``python -m ringcomm.bench`` (or ``scripts/compare_collectives.py``)
under ``mpiexec`` or ``torchrun``; ``docs/benchmarks.md`` describes the flags
and the output. The modules, in the order a run uses them:

* :mod:`~ringcomm.bench.cli`: the command line and the entry points;
* :mod:`~ringcomm.bench.sizes`: collectives, dtypes, ops, message sizes and shapes;
* :mod:`~ringcomm.bench.columns`: the contenders and how each calls a collective;
* :mod:`~ringcomm.bench.session`: the world, the agreed columns, the metadata;
* :mod:`~ringcomm.bench.check`: the correctness check (``-c``);
* :mod:`~ringcomm.bench.timing`: measuring every row;
* :mod:`~ringcomm.bench.results`: the result records and queries over them;
* :mod:`~ringcomm.bench.report`: tables on stdout, Markdown, CSV, plot;
* :mod:`~ringcomm.bench.styles`: one look per implementation in every plot;
* :mod:`~ringcomm.bench.analysis`: cost-model fits, predictions, crossovers;
* :mod:`~ringcomm.bench.cost_model`: the cost model itself;
* :mod:`~ringcomm.bench.tuning`: measured tuning for ``auto``;
* :mod:`~ringcomm.bench.targets`: the speed targets (data in ``targets.json``).
"""
