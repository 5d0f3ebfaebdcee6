"""The DDP paper's experiments for ``ddp/`` and torch's DDP: ``python -m ddp.bench``
as a script (see ddp/bench/__init__.py).

    mpiexec -n 2 python scripts/bench_ddp.py --json out.json --plot out/
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's ddp/

from ddp.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(prog="bench_ddp.py"))
