"""Every setting of ringcomm in one table: the ``RINGCOMM_*`` environment
variables and the fields of :class:`Options`, each with its type, default and
meaning.

Code reads a variable through :func:`get`, which parses it and, for a value
that does not parse, raises a ``ValueError`` naming the variable. The README's
settings table is :func:`markdown`, written between its ``settings`` markers by
``scripts/doc_numbers.py``.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable.

    Attributes:
        name: the variable, ``RINGCOMM_...``.
        kind: how its value is read: ``bool``, ``int``, ``float``, ``path``, ``name``,
            ``level`` or ``algorithms``.
        default: the value when it is unset or empty.
        meaning: one line for the README.
        scope: who reads it: ``library``, ``benchmark`` or ``tests``.
        option: the :class:`Options` field that overrides it for one group.
        minimum: the smallest value allowed (numbers).
    """

    name: str
    kind: str
    default: Any
    meaning: str
    scope: str = "library"
    option: str | None = None
    minimum: float | None = None

    def parse(self, raw: str) -> Any:
        """The value of ``raw``; ``ValueError`` naming the variable when it is not one."""
        raw = raw.strip()
        if not raw:
            return self.default
        try:
            value = _PARSERS[self.kind](raw)
        except ValueError as e:
            why = str(e).removeprefix("ringcomm: ")
            raise ValueError(f"ringcomm: {self.name}={raw!r} is not valid: {why}") from None
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"ringcomm: {self.name}={raw!r} is not valid: it must be at "
                             f"least {self.minimum:g}")
        return value


def _bool(raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected one of {'/'.join(_TRUE + _FALSE)}")


def _int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("expected a whole number") from None


def _float(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("expected a number") from None


def _level(raw: str) -> str:
    up = raw.upper()
    if up not in ("OFF", "INFO", "DETAIL"):
        raise ValueError("expected OFF, INFO or DETAIL")
    return up


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def _algorithms(raw: str) -> dict[str, str]:
    """``RINGCOMM_ALGO``'s syntax: comma-separated ``collective=name`` items and at most
    one bare ``name`` (every collective that has it: key ``"*"``). The names are
    checked against the registry by the planner (:func:`ringcomm.algorithms.expand_choices`)."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in raw.split(","))):
        coll, eq, name = (s.strip() for s in item.partition("="))
        if not eq:
            coll, name = "*", coll
            if "*" in out:
                raise ValueError(f"expected one algorithm name for every collective, got "
                                 f"{out['*']!r} and {name!r} (name the collectives: "
                                 f"`allreduce=ring,broadcast=tree`)")
        if not (_NAME.fullmatch(name) and (coll == "*" or _NAME.fullmatch(coll))):
            raise ValueError(f"expected `name` or `collective=name` items, got {item!r}")
        out[coll] = name
    return out


_PARSERS: dict[str, Callable[[str], Any]] = {
    "bool": _bool, "int": _int, "float": _float, "path": str, "name": str, "level": _level,
    "algorithms": _algorithms,
}

SETTINGS: tuple[Setting, ...] = (
    Setting("RINGCOMM_ALGO", "algorithms", {},
            "algorithm per collective: `ring` (every collective that has one) or "
            "`allreduce=tree,broadcast=ring`; unlisted ones use `auto`",
            option="algorithms"),
    Setting("RINGCOMM_TRANSPORT", "name", "mpi",
            "the transport of CPU tensors: `mpi`, `tcp` (sockets, no MPI: "
            "`ringcomm.transport.tcp`), or the name of one given to "
            "`ringcomm.register_transport` (docs/architecture.md, \"Writing a transport\")",
            option="transport"),
    Setting("RINGCOMM_SEGMENT_BYTES", "int", 2 * 1024 * 1024,
            "pipeline segment of the pipelined algorithms, in bytes",
            option="segment_bytes", minimum=1),
    Setting("RINGCOMM_TUNING", "path", None,
            "JSON table that replaces `auto`'s built-in size thresholds",
            option="tuning_file"),
    Setting("RINGCOMM_TOPOLOGY", "path", None,
            "a topology file (docs/simulator.md): `auto` picks by simulated time where "
            "its measured tables do not cover a call; the group must have the file's ranks",
            option="topology"),
    Setting("RINGCOMM_NUM_CHANNELS", "int", 1,
            "communicators per group, used in turn by successive collectives (round-robin), "
            "so several collectives progress at once", option="num_channels", minimum=1),
    Setting("RINGCOMM_LOCAL_SIZE", "int", 0,
            "ranks per host, as consecutive blocks of world ranks, for hierarchical "
            "algorithms; 0 takes the layout from the launcher", option="local_size",
            minimum=0),
    Setting("RINGCOMM_SHM", "bool", True,
            "ranks of a group on one host exchange messages through shared memory "
            "(`ringcomm.transport.shm`, under the `mpi` transport); off: over MPI",
            option="shared_memory"),
    Setting("RINGCOMM_SHM_DIR", "path", "/dev/shm",
            "directory (a tmpfs) where shared-memory segments are made; each is unlinked "
            "as soon as every rank mapped it"),
    Setting("RINGCOMM_SHM_SLOT_BYTES", "int", 256 * 1024,
            "bytes of one slot of a shared-memory FIFO, rounded up to a page (a message "
            "travels in chunks of it)", minimum=4096),
    Setting("RINGCOMM_SHM_MIN_BYTES", "int", 128 * 1024,
            "messages below this size go over MPI even between ranks on one host: MPI's "
            "eager path is faster there (docs/data/shm_transport_2ranks.json)", minimum=0),
    Setting("RINGCOMM_SHM_DIRECT_BYTES", "int", 1024 * 1024,
            "bytes of each of the two buffers of a rank's shm_direct window, rounded up to a "
            "page (a longer call takes several rounds); mapped only where every rank "
            "of the group shares one host; 0: no window", minimum=0),
    Setting("RINGCOMM_SHM_SLOTS", "int", 8,
            "slots of each shared-memory FIFO (one per peer and direction): a rank maps "
            "peers x slots x slot bytes of its own; the default holds a whole 2 MiB "
            "pipeline segment, which a reduction then reads from the sender's slots",
            minimum=2),
    Setting("RINGCOMM_IFACE", "name", None,
            "network interface for MPI and NCCL when ranks span hosts (default: the one "
            "that carries this host's traffic to `MASTER_ADDR`); see docs/multi-node.md"),
    Setting("RINGCOMM_CONNECT_TIMEOUT", "float", 60.0,
            "seconds each MPI step of a group's set-up (torchrun's connect and accept, "
            "the set-up's collectives) may take once every rank has met at the store, "
            "before it fails (a connect naming hosts and interfaces)",
            minimum=1),
    Setting("RINGCOMM_PMI", "bool", True,
            "under torchrun and plain srun, start MPI with the world whole: ringcomm "
            "answers MPI's process-manager requests (PMI-1) from the c10d store; `0` "
            "starts each process alone and joins them in a tree of merges"),
    Setting("RINGCOMM_DEBUG", "level", "OFF",
            "`INFO` logs each `auto` choice; `DETAIL` also compares every collective's "
            "kind and sizes across ranks before it runs"),
    Setting("RINGCOMM_CHECK_BUDGET_S", "float", 60.0,
            "seconds a user's algorithm's first-use proof may take on each rank: its "
            "structure (sizes, matching, no deadlock) is always checked at the group's "
            "size, its contents there when that fits, else at the largest size that "
            "fits, with a warning naming it", minimum=0),
    Setting("RINGCOMM_WATCH_S", "float", 1.0,
            "how often, in seconds, each rank reads its groups' store for a failure "
            "elsewhere in the group (a timeout, a mismatch, a rank that raised), so a "
            "rank outside any collective learns of it too; 0 never", minimum=0),
    Setting("RINGCOMM_FR_SIGNAL", "name", "SIGUSR2",
            "the signal that makes a rank write its flight recorder dump (when "
            "`TORCH_FR_BUFFER_SIZE` turns the recorder on and nothing else handles "
            "the signal); `off`: none"),
    Setting("RINGCOMM_BLOCKING_WAIT", "bool", False,
            "`Work.wait()` on CUDA tensors blocks the CPU until the collective finished "
            "(as `TORCH_NCCL_BLOCKING_WAIT`)"),
    Setting("RINGCOMM_SPIN_US", "float", 50000.0,
            "how long a wait on MPI polls without sleeping, in microseconds", minimum=0),
    Setting("RINGCOMM_MAX_SLEEP_US", "float", 500.0,
            "longest nap between polls once spinning is over, in microseconds", minimum=0),
    Setting("RINGCOMM_TRACE", "path", None,
            "record a timeline of collectives and DDP buckets; each rank writes this "
            "path with `.rank<r>` before the suffix at exit (`ringcomm.trace`)"),
    Setting("RINGCOMM_NCCL_HOSTID_PER_RANK", "bool", False,
            "give each rank its own `NCCL_HOSTID`, so ranks can share one GPU with "
            "NCCL < 2.30.3", scope="benchmark"),
    Setting("RINGCOMM_RECORD_CHECKS", "bool", False,
            "re-record `tests/expected_checks.json`, the check counts of the rank programs",
            scope="tests"),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of variable ``name`` now (its default when unset).

    Raises:
        KeyError: ``name`` is not one of :data:`SETTINGS`.
        ValueError: the value does not parse; the message names the variable.
    """
    env = os.environ if environ is None else environ
    return BY_NAME[name].parse(env.get(name, ""))


@dataclasses.dataclass
class Options:
    """Per-group settings, passed as ``pg_options`` to ``init_process_group`` / ``new_group``.

    A field left unset falls back to its environment variable (the :data:`SETTINGS`
    entry whose ``option`` names the field), then to that variable's default.

    Attributes:
        algorithms: collective -> algorithm name (e.g. ``{"allreduce": "ring"}``;
            key ``"*"``: every collective that has that algorithm); these entries
            win over ``RINGCOMM_ALGO``'s.
        segment_bytes: pipeline segment size in bytes.
        tuning_file: JSON tuning table for ``auto``.
        topology: a topology file (docs/simulator.md); ``auto`` then picks by simulated
            time for the calls its measured tables do not cover.
        num_channels: communicators of the group (K MPI communicators, or K NCCL
            communicators per device); successive collectives use them in turn, so up
            to K progress at once.
        local_size: ranks per host as consecutive blocks of world ranks (0: from the
            launcher), for hierarchical algorithms.
        shared_memory: whether ranks of the group on one host exchange messages
            through shared memory (False: every message over MPI); off on every rank
            where it is off on any.
        transport: the transport of CPU tensors (``"mpi"``, ``"tcp"``, or a name given to
            :func:`ringcomm.register_transport`); every rank of a group names the same.
    """

    algorithms: dict[str, str] = dataclasses.field(default_factory=dict)
    segment_bytes: int | None = None
    tuning_file: str | None = None
    topology: str | None = None
    num_channels: int | None = None
    local_size: int | None = None
    shared_memory: bool | None = None
    transport: str | None = None

    def resolve(self, environ: Mapping[str, str] | None = None) -> "Options":
        """A copy with every field decided: from this object, else from the
        environment, else the default (``algorithms`` merges the variable's choices
        under this object's; the names are the planner's to check).

        Raises:
            ValueError: a field or variable holds a bad value; the message names it.
        """
        algos = {**get("RINGCOMM_ALGO", environ), **self.algorithms}
        tuning = self.tuning_file or get("RINGCOMM_TUNING", environ)
        return Options(algorithms=algos,
                       segment_bytes=self._count("segment_bytes", environ, "bytes"),
                       tuning_file=tuning,
                       topology=self.topology or get("RINGCOMM_TOPOLOGY", environ),
                       num_channels=self._count("num_channels", environ, "communicators"),
                       local_size=self._count("local_size", environ, "ranks"),
                       shared_memory=self._flag("shared_memory", environ),
                       transport=self._name("transport", environ))

    def _name(self, field: str, environ: Mapping[str, str] | None) -> str:
        """Field ``field`` decided: this object's value (checked), else its variable's."""
        value = getattr(self, field)
        if value is None:
            return get(_variable_of(field).name, environ)
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise ValueError(f"ringcomm: Options.{field} must be a name, got {value!r}")
        return value

    def _flag(self, field: str, environ: Mapping[str, str] | None) -> bool:
        """Field ``field`` decided: this object's value (checked), else its variable's."""
        value = getattr(self, field)
        if value is None:
            return get(_variable_of(field).name, environ)
        if not isinstance(value, bool):
            raise ValueError(f"ringcomm: Options.{field} must be True or False, got {value!r}")
        return value

    def _count(self, field: str, environ: Mapping[str, str] | None, unit: str) -> int:
        """Field ``field`` decided: this object's value (checked), else its variable's."""
        value = getattr(self, field)
        setting = _variable_of(field)
        if value is None:
            return get(setting.name, environ)
        low = int(setting.minimum or 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            what = "a positive" if low >= 1 else "a non-negative"
            raise ValueError(f"ringcomm: Options.{field} must be {what} whole number of "
                             f"{unit}, got {value!r}")
        return value


def _variable_of(field: str) -> Setting:
    """The setting whose ``option`` is :class:`Options` field ``field``."""
    return next(s for s in SETTINGS if s.option == field)


# -- the README's table -------------------------------------------------------------
BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def _default_text(s: Setting) -> str:
    if s.kind == "int" and isinstance(s.default, int) and s.default and s.default % 1024 == 0:
        return f"{s.default} ({s.default >> 20} MiB)" if s.default % (1 << 20) == 0 \
            else f"{s.default} ({s.default >> 10} KiB)"
    if s.default in (None, {}):
        return "unset"
    if isinstance(s.default, bool):
        return "0" if not s.default else "1"
    return f"{s.default:g}" if isinstance(s.default, float) else str(s.default)


def markdown() -> str:
    """The settings table: one row per variable, with the :class:`Options` field
    that overrides it for one group."""
    rows = ["| variable | for | type | default | meaning | per group |",
            "|---|---|---|---|---|---|"]
    for s in SETTINGS:
        per_group = f"`Options({s.option}=...)`" if s.option else ""
        rows.append(f"| `{s.name}` | {s.scope} | {s.kind} | {_default_text(s)} | {s.meaning} "
                    f"| {per_group} |")
    return "\n".join(rows)


def _block(text: str) -> tuple[int, int]:
    a, b = text.find(BEGIN), text.find(END)
    if a < 0 or b < a:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return a + len(BEGIN), b


def render_into(text: str) -> str:
    """``text`` with its settings block replaced by :func:`markdown`."""
    a, b = _block(text)
    return f"{text[:a]}\n{markdown()}\n{text[b:]}"
