"""The DDP paper's experiments (Li et al., VLDB 2020, section 5) for ``ddp/`` and
torch's DistributedDataParallel, on ringcomm and on gloo, side by side in one run.

    mpiexec -n 2 python -m ddp.bench --json out.json --plot out/
    torchrun --nproc-per-node 2 -m ddp.bench --quick
    python -m ddp.bench --quick                     # one process, world size 1

(``scripts/bench_ddp.py`` is the same entry point as a script.)

Sections (``--sections``, default all):

1. ``breakdown``: forward, backward, communication not hidden behind backward,
   optimizer step per iteration, for every configuration (DDP implementation x
   backend); and overlap on (bucketed DDP) against overlap off (backward under
   ``no_sync()``, then one allreduce of all gradients flattened into one buffer).
   Also ``ours/ringcomm`` with a ``ringcomm.trace`` recording on (the trace
   overhead), and one traced iteration of it (and of overlap off): the breakdown
   read from its spans, as a cross-check, and with ``--plot`` its timeline.
2. ``buckets``: time per iteration against ``bucket_cap_mb`` (0 = one allreduce
   per parameter, ..., one bucket for everything).
3. ``scaling``: throughput on the first k ranks (subgroups) for k = 1, 2, 4 up
   to the world size, and the fraction of linear scaling.
4. ``nosync``: ``no_sync()`` for n-1 of every n iterations; amortized time per
   iteration.
5. ``roundrobin``: time per iteration with K communicators used in turn by
   successive collectives (``--channels``, default 1, 3, 5, the paper's
   experiment): ringcomm groups made with ``ringcomm.Options(num_channels=K)``, and
   K gloo groups in round robin (:mod:`ddp.bench.roundrobin`, the paper's own
   setting, which torch no longer ships), at DDP's default bucket cap and a small
   one (``--rr-caps``, default 25 and 1); median, quartiles, speed-up over the
   smallest K and a verdict. Then a few traced iterations of ``ours/ringcomm`` per
   K at the smallest cap: how many allreduces ran at once and for how long, and
   with ``--plot`` the timelines of the smallest and largest K.
6. ``hooks``: time per iteration with each communication hook (allreduce, fp16,
   PowerSGD at rank 1 and 4, batched PowerSGD, uint8 quantization, noop; four of
   them with ``--quick``), each DDP with its own hooks, and what one iteration
   hands to collectives: their number, payload and wire bytes per rank
   (:mod:`ddp.bench.hooks`).
7. ``graph``: time per iteration with DDP's defaults, ``find_unused_parameters``
   and ``static_graph``; static_graph's saving over find_unused_parameters.

Every configuration trains the same model from the same initial weights on the
same seeded synthetic data; before timing, the parameters after a few steps must
agree across ranks and across configurations, or the run fails. Times are
wall-clock spans on each rank; a number is the maximum over ranks of each rank's
median over iterations (as in ``python -m ringcomm.bench``). After the run the
speed targets in ``ddp/bench/targets.json`` are checked and reported
(a miss never fails the run).

Modules: :mod:`~ddp.bench.models` (the models and their data),
:mod:`~ddp.bench.configs` (configurations, replicas, the world of process
groups), :mod:`~ddp.bench.measure` (timing and statistics),
:mod:`~ddp.bench.experiments` (the sections), :mod:`~ddp.bench.tracing`
(``--trace``, the trace overhead, one traced iteration: its breakdown and
timeline), :mod:`~ddp.bench.roundrobin` (K gloo groups in turn),
:mod:`~ddp.bench.targets`, :mod:`~ddp.bench.report` (text),
:mod:`~ddp.bench.plots`, :mod:`~ddp.bench.paper` (the generated blocks of
docs/paper-reproduction.md) and :mod:`~ddp.bench.cli`.
"""
