"""What a call costs torch's dispatch into each form a Python backend can take, on
a torch whose C++ ``Backend`` Python can subclass (2.15 and newer): a do-nothing
``ProcessGroup`` subclass (ringcomm's form) against a do-nothing ``Backend``
subclass under torch's own ``ProcessGroup``. One rank, a 4 KiB ``all_reduce``;
prints JSON ``{"torch": ..., "process_group_us": ..., "backend_us": ...}`` (the best
of 5 rounds of 20000 calls, each form in a fresh process).

    python scripts/bench_front.py
"""
from __future__ import annotations

import json
import subprocess
import sys
import time


def one(form: str) -> float:
    import torch
    import torch.distributed as dist
    from torch.futures import Future

    class Done(dist.Work):
        def __init__(self, tensors):
            super().__init__()
            self.tensors = tensors

        def wait(self, timeout=None):
            return True

        def get_future(self):
            f = Future()
            f.set_result(self.tensors)
            return f

    class AsProcessGroup(dist.ProcessGroup):
        def allreduce(self, tensors, opts=None):
            return Done(tensors)

        def getBackendName(self):
            return "front"

    class AsBackend(torch._C._distributed_c10d.Backend):
        def allreduce(self, tensors, opts=None):
            return Done(tensors)

        def getBackendName(self):
            return "front"

    cls = AsProcessGroup if form == "process_group" else AsBackend
    dist.Backend.register_backend("front", lambda o, _: cls(o.group_rank, o.group_size),
                                  extended_api=True, devices=["cpu"])
    dist.init_process_group("front", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(1024)
    for _ in range(2000):
        dist.all_reduce(t)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20000):
            dist.all_reduce(t)
        best = min(best, (time.perf_counter() - t0) / 20000 * 1e6)
    return best


def main() -> int:
    if len(sys.argv) > 1:
        print(one(sys.argv[1]))
        return 0
    import torch
    try:
        torch._C._distributed_c10d.Backend(0, 1)
    except TypeError:
        print(json.dumps({"torch": torch.__version__, "skipped": "Backend cannot be "
                          "subclassed from Python on this torch"}))
        return 0
    out = {"torch": torch.__version__}
    for form in ("process_group", "backend"):
        proc = subprocess.run([sys.executable, __file__, form], capture_output=True, text=True,
                              check=True)
        out[f"{form}_us"] = round(float(proc.stdout.strip().splitlines()[-1]), 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
