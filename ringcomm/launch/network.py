"""The network path of a job that spans hosts: which MPI netmod, which interface.

On one host MPI's defaults work. Across hosts they may not: the MPICH wheel's
default netmod (UCX) hangs in ``MPI_Comm_connect`` between singletons on
different hosts, which is how ringcomm joins torchrun's processes. So before
MPI starts, the ranks meet once through torch's store and compare where they
run (host name and network namespace). When they span hosts ringcomm sets, for
the variables the user left unset:

* ``MPIR_CVAR_CH4_NETMOD=ofi`` and ``FI_PROVIDER=tcp``: libfabric's TCP provider
  (under torchrun; under mpiexec the launcher already wired MPI up);
* ``FI_TCP_IFACE`` (or ``UCX_NET_DEVICES`` when the netmod is UCX),
  ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME``: the interface that carries
  this host's traffic to the store (``MASTER_ADDR``), or ``RINGCOMM_IFACE`` when
  it is set.

Every choice is logged at INFO (``RINGCOMM_DEBUG=INFO``) and kept in
:data:`last` for the error raised when bootstrap cannot connect.
"""
from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import json
import logging
import os
import socket
import struct
from datetime import timedelta

from ringcomm import settings

log = logging.getLogger("ringcomm")

#: the variables that decide the network path, named in bootstrap's errors
VARIABLES = ("RINGCOMM_IFACE", "MPIR_CVAR_CH4_NETMOD", "FI_PROVIDER", "FI_TCP_IFACE",
             "UCX_NET_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "MASTER_ADDR")

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interfaces() -> dict[str, str]:
    """This machine's network interfaces that have an IPv4 address: name -> address."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                found[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address, or down
                continue
    return found


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def source_address(host: str) -> str | None:
    """The local IPv4 address this machine sends from to reach ``host`` (a name or
    address); None when ``host`` does not resolve or no route leads to it."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: picks a route, sends nothing
            return s.getsockname()[0]
    except OSError:
        return None


def interface_toward(host: str) -> tuple[str | None, str | None]:
    """(interface, local address) that carry traffic to ``host``; (None, None) when
    unknown. The interface is ``"lo"``-like when ``host`` is this machine's loopback."""
    addr = source_address(host)
    if addr is None:
        return None, None
    for name, a in interfaces().items():
        if a == addr:
            return name, addr
    return None, addr


def machine_id() -> str:
    """Names where this process runs, as far as networking goes: the host name and the
    network namespace (two namespaces on one machine are two hosts to MPI)."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{netns}"


@dataclasses.dataclass
class Path:
    """The network path chosen for a group.

    Attributes:
        spans_hosts: the group's ranks run on more than one host.
        iface: the interface chosen for MPI and NCCL (None: left to them).
        address: this rank's address on ``iface``.
        set_vars: the variables ringcomm set, name -> value.
        hosts: host name of each rank that was compared (rank -> name), for errors.
    """

    spans_hosts: bool = False
    iface: str | None = None
    address: str | None = None
    set_vars: dict[str, str] = dataclasses.field(default_factory=dict)
    hosts: dict[int, str] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        """One paragraph for errors: hosts, interface and every deciding variable."""
        hosts = ", ".join(f"rank {r} on {h}" for r, h in sorted(self.hosts.items()))
        env = " ".join(f"{v}={os.environ[v]}" for v in VARIABLES if v in os.environ)
        mine = (f"this rank uses interface {self.iface} ({self.address})" if self.iface
                else "no interface was chosen (MPI picks one)")
        ours = (" (set by ringcomm: " + ", ".join(self.set_vars) + ")") if self.set_vars else ""
        return (f"{hosts or 'hosts unknown'}; {mine}. Variables: {env or 'none set'}{ours}. "
                f"Check that the hosts reach each other on that interface, or choose it "
                f"with RINGCOMM_IFACE=<interface> (interfaces here: "
                f"{', '.join(interfaces()) or 'none'}), or set MPI's own: "
                f"MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=<interface>, or "
                f"MPIR_CVAR_CH4_NETMOD=ucx UCX_NET_DEVICES=<interface>")


#: the path of the last group that compared hosts (for errors and tests)
last: Path | None = None


def chosen_iface() -> str | None:
    """``RINGCOMM_IFACE`` checked against this machine's interfaces (None if unset).

    Raises:
        ValueError: the variable names an interface this machine lacks.
    """
    name = settings.get("RINGCOMM_IFACE")
    if not name:
        return None
    have = interfaces()
    if name not in have:
        raise ValueError(f"ringcomm: RINGCOMM_IFACE={name!r} is not an interface of this "
                         f"host ({socket.gethostname()}) with an IPv4 address; it has: "
                         f"{', '.join(sorted(have)) or 'none'}")
    return name


def advertised_address() -> str:
    """An address of this host that ranks on other hosts can reach, for the store
    ``MASTER_ADDR`` names under mpiexec: ``RINGCOMM_IFACE``'s address; else the host
    entry mpiexec launched this rank on (``PMI_HOSTNAME``), resolved, when it is one
    of this machine's addresses; else the host name's address unless it is loopback;
    else the host name.
    """
    forced = chosen_iface()
    if forced is not None:
        return interfaces()[forced]
    mine = set(interfaces().values())
    # (name, whether its address must be one of this machine's)
    for name, local in ((os.environ.get("PMI_HOSTNAME"), True), (socket.gethostname(), False)):
        if not name:
            continue
        try:
            addr = socket.gethostbyname(name)
        except OSError:
            continue
        if not _loopback(addr) and (addr in mine or not local):
            return addr
    return socket.gethostname()


def apply(iface: str | None, spans_hosts: bool, set_netmod: bool) -> dict[str, str]:
    """Set the network variables the user left unset; returns what was set.

    ``set_netmod``: MPI is not started yet and must reach other hosts on its own
    (torchrun's singletons), so pick libfabric over TCP.
    """
    new: dict[str, str] = {}

    def default(var: str, value: str) -> None:
        if not os.environ.get(var):
            os.environ[var] = new[var] = value

    if spans_hosts and set_netmod:
        default("MPIR_CVAR_CH4_NETMOD", "ofi")
        if os.environ["MPIR_CVAR_CH4_NETMOD"] == "ofi":
            default("FI_PROVIDER", "tcp")
    if iface is not None and spans_hosts and _loopback(interfaces().get(iface, "")):
        iface = None  # loopback reaches no other host: leave the choice to MPI and NCCL
    if iface is not None and (spans_hosts or settings.get("RINGCOMM_IFACE")):
        netmod = os.environ.get("MPIR_CVAR_CH4_NETMOD", "")
        if netmod == "ofi" and os.environ.get("FI_PROVIDER", "tcp").startswith("tcp"):
            default("FI_TCP_IFACE", iface)
        if netmod in ("ucx", "") and settings.get("RINGCOMM_IFACE"):
            default("UCX_NET_DEVICES", iface)
        default("NCCL_SOCKET_IFNAME", iface)
        # torch's gloo binds to the host name's address, else to loopback: name the
        # interface for the gloo groups a job makes beside ringcomm's
        default("GLOO_SOCKET_IFNAME", iface)
    if new:
        log.info("ringcomm: network path %s", " ".join(f"{k}={v}" for k, v in new.items()))
    return new


def _record(rank: int) -> dict:
    master = os.environ.get("MASTER_ADDR", "")
    iface, addr = interface_toward(master) if master else (None, None)
    return {"rank": rank, "machine": machine_id(), "host": socket.gethostname(),
            "iface": iface, "addr": addr}


def host_of(store, rank: int) -> str:
    """The host name rank ``rank`` recorded in :func:`compare_hosts` ("unknown" if none)."""
    key = f"ringcomm/net/{rank}"
    try:
        return json.loads(store.get(key))["host"] if store.check([key]) else "unknown"
    except Exception:  # a broken store must not hide the error being reported
        return "unknown"


def _get(store, key: str, timeout: timedelta) -> bytes:
    store.wait([key], timeout)
    return store.get(key)


#: how often a rank waiting for the others to start says so
WAIT_REPORT_S = 30.0


def _missing(store, size: int) -> list[int]:
    return [r for r in range(size) if not store.check([f"ringcomm/net/{r}"])]


def _wait_for_all(store, rank: int, size: int, timeout: timedelta) -> None:
    """Wait until every rank has recorded itself, logging a warning every
    :data:`WAIT_REPORT_S` (rank 0 names the missing ranks); past ``timeout``, raise
    naming them."""
    waited = timedelta(0)
    while True:
        step = min(timeout - waited, timedelta(seconds=WAIT_REPORT_S))
        try:
            store.wait(["ringcomm/net/all"], step)
            return
        except Exception as e:  # the store's timeout (DistStoreError)
            waited += step
            if waited >= timeout:
                raise type(e)(f"ringcomm bootstrap: rank {rank} waited {timeout} for ranks "
                              f"{_missing(store, size) or '?'} to start ({e})") from None
            arrived = store.add("ringcomm/net/arrived", 0)
            who = f": ranks {_missing(store, size)}" if rank == 0 else ""
            log.warning("ringcomm bootstrap: rank %d has waited %d s for %d of %d ranks to "
                        "start%s (the group's timeout is %s)", rank, waited.total_seconds(),
                        size - arrived, size, who, timeout)


def compare_hosts(store, rank: int, size: int, timeout: timedelta,
                  set_netmod: bool) -> Path:
    """Meet every rank of a group through ``store`` (bounded by ``timeout``), decide
    whether the group spans hosts and set the network variables (:func:`apply`).

    Two records per rank and three counters on the store, whatever the size; a rank
    on the store's own host also reads the records of the ranks before the first
    rank on another host, to find the interface that leads there.

    Raises:
        ValueError: ``RINGCOMM_IFACE`` is not an interface here.
        DistStoreError: a rank did not arrive within ``timeout``.
    """
    global last
    forced = chosen_iface()
    mine = _record(rank)
    store.set(f"ringcomm/net/{rank}", json.dumps(mine))
    first = mine if rank == 0 else json.loads(_get(store, "ringcomm/net/0", timeout))
    if mine["machine"] != first["machine"]:
        store.add("ringcomm/net/elsewhere", 1)
    if store.add("ringcomm/net/arrived", 1) == size:
        store.set("ringcomm/net/all", b"1")
    _wait_for_all(store, rank, size, timeout)
    spans = store.add("ringcomm/net/elsewhere", 0) > 0
    path = Path(spans_hosts=spans, hosts={0: first["host"], rank: mine["host"]})
    iface, addr = mine["iface"], mine["addr"]
    if spans and (iface is None or _loopback(addr or "")):
        # The store is on this host: take the route to the first rank elsewhere.
        for r in range(size):
            other = json.loads(_get(store, f"ringcomm/net/{r}", timeout))
            if other["machine"] != mine["machine"] and other["addr"]:
                path.hosts[r] = other["host"]
                iface, addr = interface_toward(other["addr"])
                break
    if forced is not None:
        iface, addr = forced, interfaces()[forced]
    path.iface, path.address = iface, addr
    path.set_vars = apply(iface, spans, set_netmod)
    last = path
    return path
