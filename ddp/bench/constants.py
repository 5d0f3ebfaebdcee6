"""Names, sizes and fixed settings shared by the modules of :mod:`ddp.bench`."""
from __future__ import annotations

from pathlib import Path

SCHEMA = "ringcomm.bench_ddp/1"
TARGETS_SCHEMA = "ringcomm.bench_ddp.targets/1"
#: the shipped speed targets (package data)
DEFAULT_TARGETS = str(Path(__file__).resolve().with_name("targets.json"))
PROG = "bench_ddp.py"

SECTIONS = ("breakdown", "buckets", "scaling", "nosync", "roundrobin", "hooks", "graph")
MODELS = ("resnet", "bert", "mlp")
#: the paper's two kinds of model (--model both)
PAPER_MODELS = ("resnet", "bert")
IMPLS = ("ours", "torch")
BACKENDS = ("ringcomm", "gloo", "ringcomm-mpi")
#: a backend name of this benchmark that is another's with options: ringcomm-mpi is
#: ringcomm with its shared-memory transport off (every message over MPI), to show
#: what shared memory changes in the same run; not the default group's
BACKEND_OPTIONS = {"ringcomm-mpi": ("ringcomm", {"shared_memory": False})}
#: bucket_cap_mb values of the sweep; "all" is a cap larger than the model (one bucket)
BUCKET_CAPS: tuple = (0, 1, 5, 10, 25, 50, 100, "all")
QUICK_BUCKET_CAPS: tuple = (0, 25, "all")
NOSYNC_EVERY = (1, 2, 4, 8)
#: communicators per group of the round-robin section (the paper's 1, 3, 5 groups)
RR_CHANNELS = (1, 3, 5)
#: bucket caps of the round-robin section: DDP's default (25 MB, the paper's setting:
#: 2 buckets here) and a small one (1 MB: 8 buckets, so several allreduces can be in
#: flight at once, as with the paper's larger models at the default cap)
RR_CAPS: tuple = (25, 1)
#: how each backend gets K communicators in the round-robin section
RR_MECHANISM = {"ringcomm": "ringcomm.Options(num_channels=K): one ringcomm group of K MPI "
                            "communicators, each with its own progress thread, used in turn",
                "ringcomm-mpi": "as ringcomm, with Options(shared_memory=False)",
                "gloo": "K gloo groups in turn (ddp.bench.roundrobin: torch's removed "
                        "_round_robin_process_groups rebuilt, the paper's setting)"}
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
