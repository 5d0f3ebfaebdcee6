"""Which machine this process runs on.

Bottom layer: imports nothing of ringcomm.
"""
from __future__ import annotations

import socket

__all__ = ["identity"]


def identity() -> str:
    """This machine's identity: host name and boot id. Processes that share memory
    share both; two machines (or containers on two machines) given one host name do
    not share the boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
