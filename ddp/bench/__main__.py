"""``python -m ddp.bench``: the DDP paper's experiments (see :mod:`ddp.bench`)."""
from ddp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m ddp.bench"))
