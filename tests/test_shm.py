"""The shared-memory transport (ringcomm/transport/shm/): its layout, every
collective over it against an oracle, several hosts (shared memory inside each,
MPI between), and its faults under both launchers: a killed rank, mismatched sizes,
a directory too small, two jobs on one host at once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import ringcomm
from conftest import BIN, LAUNCHERS, RANKS, _env, checks_passed, mpirun, shm_segments, torchrun
from ringcomm.transport.shm import Geometry

#: small slots: messages of every test size take several chunks and fill the FIFO
SMALL = {"RINGCOMM_SHM_SLOT_BYTES": "4096", "RINGCOMM_SHM_SLOTS": "2",
         "RINGCOMM_SHM_MIN_BYTES": "0", "RINGCOMM_SHM_DIRECT_BYTES": "4096"}


def test_geometry_places_nothing_twice():
    """Counters, tags and slots of every outbox lie apart, counters on lines of
    their own, slots page-aligned, all inside the segment."""
    for npeers, slots, slot_bytes in ((1, 2, 4096), (3, 4, 256 * 1024), (7, 5, 5000)):
        g = Geometry(npeers, slots, slot_bytes)
        spans = [(0, 512)] + [(g.tail_at(j), g.tail_at(j) + 128) for j in range(npeers)]
        for j in range(npeers):
            spans.append((g.outbox_at(j), g.outbox_at(j) + 128 + g.meta_bytes))
            spans += [(g.slot_at(j, s), g.slot_at(j, s) + g.slot_bytes) for s in range(slots)]
            assert all(g.slot_at(j, s) % 4096 == 0 for s in range(slots))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
        assert spans[-1][1] <= g.nbytes
        assert g.slot_bytes >= slot_bytes


def test_the_window_lies_apart_page_aligned_and_where_its_views_write():
    """shm_direct's window (two lines, then two buffers) lies after every outbox, its
    lines on cache lines of their own within its page, its buffers page-aligned and
    apart; Window's views of each rank's buffers write exactly there."""
    import mmap

    import numpy as np

    from ringcomm.transport.shm import Window

    for npeers, direct in ((1, 4096), (3, 1 << 20), (7, 5000)):
        g = Geometry(npeers, 2, 4096, direct)
        last_outbox = g.outbox_at(npeers - 1) + g.outbox_bytes
        page = g.window_at()
        lines = [(g.line_at(b), g.line_at(b) + 128) for b in (0, 1)]
        bufs = [(page + 4096 + b * g.direct_bytes, page + 4096 + (b + 1) * g.direct_bytes)
                for b in (0, 1)]
        assert last_outbox <= page and page % 4096 == 0
        assert all(page <= a and b <= page + 4096 for a, b in lines)
        assert lines[0][1] <= lines[1][0] and lines[0][0] % 128 == 0
        assert bufs[0][1] <= bufs[1][0] and all(a % 4096 == 0 for a, _ in bufs)
        assert g.direct_bytes >= direct and bufs[1][1] == g.nbytes
        maps = [mmap.mmap(-1, g.nbytes) for _ in range(npeers + 1)]
        try:
            win = Window(g, [(mm, memoryview(mm).cast("B").cast("q")) for mm in maps])
            assert win.lines == (lines[0][0] // 8, lines[1][0] // 8)
            for r, mm in enumerate(maps):
                for b in (0, 1):
                    win.buffers(b)[r][:] = 1 + 2 * r + b
                    seg = np.frombuffer(mm, dtype=np.uint8)
                    assert (seg[bufs[b][0]:bufs[b][1]] == 1 + 2 * r + b).all()
                assert not np.frombuffer(mm, dtype=np.uint8)[:bufs[0][0]].any()
            del win, seg
        finally:
            for mm in maps:
                mm.close()


def test_shm_direct_is_registered_for_what_the_transport_serves():
    """REGISTRY names shm_direct for exactly the collectives the transport's window
    runs (the builders' layer cannot import the transport's list)."""
    from ringcomm.algorithms import REGISTRY, SHM_DIRECT
    from ringcomm.transport.shm import direct as shm_direct

    registered = {c for c, algos in REGISTRY.items() if algos.get("shm_direct") is SHM_DIRECT}
    assert registered == set(shm_direct.COLLECTIVES)


def test_shared_memory_option_overrides_the_variable_and_is_checked():
    assert ringcomm.Options().resolve({}).shared_memory is True
    assert ringcomm.Options().resolve({"RINGCOMM_SHM": "0"}).shared_memory is False
    assert ringcomm.Options(shared_memory=True).resolve({"RINGCOMM_SHM": "0"}).shared_memory
    with pytest.raises(ValueError, match="Options.shared_memory must be True or False, got 0"):
        ringcomm.Options(shared_memory=0).resolve({})


# 3 ranks (9 s): make test-wide; 3 ranks on one host over shared memory: test_library_launch
@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.wide)])
def test_collectives_over_shared_memory(n):
    before = shm_segments()
    mpirun(n, "shm_check.py", "correct", timeout=240, env=SMALL)
    assert shm_segments() <= before


def test_shared_memory_inside_hosts_mpi_between():
    """RINGCOMM_LOCAL_SIZE=2 on 4 ranks: two 'hosts'; each rank reaches its block's
    peer through shared memory and the other block through MPI, hierarchical too."""
    mpirun(4, "shm_check.py", "correct", timeout=300, env={**SMALL, "RINGCOMM_LOCAL_SIZE": "2"})


@pytest.mark.parametrize("launcher,sizes", [
    ("mpiexec", "40000,45000"),  # both over shared memory
    pytest.param("torchrun", "40000,45000", marks=pytest.mark.wide),  # make test's time
    ("mpiexec", "32000,33500"),  # 128000 B over MPI, 134000 B over shared memory
    pytest.param("mpiexec", "33500,32000", marks=pytest.mark.wide),  # the same, turned
    ("mpiexec", "100,200"),  # both over MPI
])
def test_mismatched_sizes_fail_at_once(launcher, sizes):
    """Ranks reduce different sizes with ringcomm's own schedule (MPI's own collective,
    which auto may pick at some sizes, has undefined results there)."""
    before = shm_segments()
    out = LAUNCHERS[launcher](2, "shm_check.py", "mismatch", "--sizes", sizes, timeout=120,
                              env={"RINGCOMM_ALGO": "allreduce=recursive_doubling"})
    checks_passed(out.stdout, 2)  # both ranks, each naming the mismatch
    assert shm_segments() <= before


@pytest.mark.parametrize("launcher,sizes,algos", [
    ("mpiexec", "100,200", "shm_direct"),  # one round each, of other calls
    pytest.param("torchrun", "100,300000", "shm_direct",
                 marks=pytest.mark.wide),  # one round against several
    ("mpiexec", "40000,40000", "shm_direct,recursive_doubling"),  # against a FIFO message
    pytest.param("mpiexec", "40000,40000", "recursive_doubling,shm_direct",
                 marks=pytest.mark.wide),  # the same, turned (make test's time)
    ("mpiexec", "1000,1000", "shm_direct,recursive_doubling"),  # against one over MPI
])
def test_shm_direct_mismatches_fail_at_once(launcher, sizes, algos):
    """shm_direct against itself with other sizes (the signatures on the windows'
    lines differ), and against a schedule (a message waits where the other rank
    looks at the windows): every rank fails naming the mismatch."""
    before = shm_segments()
    out = LAUNCHERS[launcher](2, "shm_check.py", "mismatch", "--sizes", sizes, "--algos", algos,
                              timeout=120)
    checks_passed(out.stdout, 2)  # both ranks, each naming the mismatch
    assert shm_segments() <= before


@pytest.mark.parametrize("launcher,calls,n", [
    ("mpiexec", "broadcast:shm_direct:0,broadcast:shm_direct:1", 1000),  # roots differ
    pytest.param("torchrun", "allgather:shm_direct,reduce_scatter:shm_direct", 1000,
                 marks=pytest.mark.wide),  # collectives
    ("mpiexec", "barrier:shm_direct,broadcast:shm_direct:0", 1000),  # a barrier's round
    ("mpiexec", "barrier:shm_direct,barrier:dissemination", 1000),  # against its schedule
    ("mpiexec", "broadcast:shm_direct:0,broadcast:tree:0", 40000),  # against a schedule
    pytest.param("mpiexec", "allgather:ring,allgather:shm_direct", 40000,
                 marks=pytest.mark.wide),  # the same with another collective
])
def test_shm_direct_collectives_mismatches_fail_at_once(launcher, calls, n):
    """shm_direct's broadcast, allgather and reduce_scatter: ranks that make different
    calls over the windows (other roots, other collectives), or one over the windows
    and one a schedule's message: every rank fails naming the mismatch."""
    before = shm_segments()
    out = LAUNCHERS[launcher](2, "shm_check.py", "mismatch", "--calls", calls,
                              "--sizes", str(n), timeout=120)
    checks_passed(out.stdout, 2)  # both ranks, each naming the mismatch
    assert shm_segments() <= before


@pytest.mark.wide  # 12 s; the kill under mpiexec stays in make test
def test_a_killed_rank_ends_the_others_wait_torchrun(tmp_path):
    """The last of 3 ranks SIGKILLs itself at an allreduce; torchrun is told to look
    at its workers only every 10 s, so the others must find out themselves: each
    fails naming a rank that stopped, long before the group's 60 s timeout, leaves no
    segment behind, and writes what it found to a file."""
    before = shm_segments()
    t0 = time.monotonic()
    out = torchrun(3, "shm_check.py", "kill", timeout=120, check=False,
                   env={"SHM_CHECK_OUT": str(tmp_path)}, launcher_args=["--monitor-interval=10"])
    found = {p.name: p.read_text() for p in tmp_path.iterdir()}
    text = out.stdout + out.stderr
    assert sorted(found) == ["rank0", "rank1"], (found, text[-3000:])
    for name, result in found.items():
        assert result.startswith("survived") and "FAIL" not in result, (name, result)
    assert "exited while rank" in text and "rank 2" in text, text[-3000:]
    assert time.monotonic() - t0 < 55
    assert shm_segments() <= before


@pytest.mark.parametrize("algo", ["auto", "shm_direct"])
def test_a_killed_rank_ends_the_job_mpiexec(algo):
    """Under mpiexec, hydra ends the whole job when a rank dies (even with
    -disable-auto-cleanup): no rank hangs, none leaves a segment, and a survivor
    that reports first names the dead rank."""
    before = shm_segments()
    t0 = time.monotonic()
    out = mpirun(3, "shm_check.py", "kill", timeout=120, check=False,
                 env={"SHM_CHECK_OUT": "/nonexistent", "RINGCOMM_ALGO": f"allreduce={algo}"})
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "killing myself" in text, text[-3000:]
    assert time.monotonic() - t0 < 60, "the job outlived the group's timeout"
    if "failed (group" in text:
        assert "rank 2 (pid" in text and "exited while rank" in text, text[-3000:]
    assert shm_segments() <= before


def _small_tmpfs(size: str):
    d = tempfile.mkdtemp(prefix="ringcomm-tmpfs-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    return d


@pytest.mark.parametrize("launcher", ["mpiexec", pytest.param("torchrun", marks=pytest.mark.wide)])
def test_a_full_directory_falls_back_to_mpi(launcher):
    """A 64 KiB tmpfs cannot hold two 1 MiB segments: group creation warns, naming
    the sizes, and the collectives run over MPI, correctly."""
    d = _small_tmpfs("64k")
    try:
        out = LAUNCHERS[launcher](2, "shm_check.py", "correct", "--expect", "mpi", timeout=240,
                                  env={"RINGCOMM_SHM_DIR": d})
        text = out.stdout + out.stderr
        assert "shared memory is not used" in text, text[-3000:]
        assert "MiB free" in text and "needs" in text, text[-3000:]
        assert not os.listdir(d)
    finally:
        subprocess.run(["umount", d])
        os.rmdir(d)


@pytest.mark.wide  # 9 s, kept out of make test's 10 minutes
def test_two_jobs_on_one_host_at_once():
    """Two jobs whose segments would share names if names were per host: both pass."""
    env = {**SMALL}
    procs = [subprocess.Popen([str(BIN / "mpiexec"), "-n", "2", sys.executable, str(RANKS / "shm_check.py"),
                               "correct"], env=_env(env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for _ in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=400)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            pytest.fail("two jobs at once: a job outlived 400 s")
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]


def _plan(steps, n=8, scratch=1):
    """A two-rank allreduce plan of rank 0 from ``steps(b, tmp)``."""
    from ringcomm.execution.plan import Plan
    from ringcomm.schedule import Builder, Context

    b = Builder(Context("allreduce", 2, 0, (n,)))
    tmps = [b.scratch(n) for _ in range(scratch)]
    steps(b, *tmps)
    return Plan(b.build())


def test_held_receives_are_those_only_one_local_step_reads():
    """Plan.held_receives: a receive into scratch that one reduction reads is held;
    one whose scratch is read again, sent on, partly overwritten, or that is not the
    last its step awaits from that peer, is not; nor is one into a caller buffer."""
    from ringcomm.schedule import Copy, Reduce
    D = 0

    def swap_sum(b, t):
        b.step(sends=[(1, (D, 0, 8))], recvs=[(1, (t, 0, 8))], local=[Reduce((D, 0, 8), (t, 0, 8))])
    assert _plan(swap_sum).held_receives() == {0: (0, 0)}

    def read_twice(b, t):
        b.step(sends=[(1, (D, 0, 8))], recvs=[(1, (t, 0, 8))],
               local=[Reduce((D, 0, 8), (t, 0, 8)), Reduce((D, 0, 8), (t, 0, 8))])
    assert _plan(read_twice).held_receives() == {}

    def sent_on(b, t):
        swap_sum(b, t)
        b.step(sends=[(1, (t, 0, 8))], recvs=[(1, (D, 0, 8))])
    assert _plan(sent_on).held_receives() == {}

    def refilled_then_sent(b, t):
        swap_sum(b, t)
        b.step(recvs=[(1, (t, 0, 8))])
        b.step(sends=[(1, (t, 0, 8))])
    assert _plan(refilled_then_sent).held_receives() == {0: (0, 0)}

    def two_from_one_peer(b, t, u):
        b.step(sends=[(1, (D, 0, 8))], recvs=[(1, (t, 0, 8)), (1, (u, 0, 8))],
               local=[Reduce((D, 0, 8), (t, 0, 8)), Reduce((D, 0, 8), (u, 0, 8))])
    assert _plan(two_from_one_peer, scratch=2).held_receives() == {1: (0, 1)}

    def into_the_caller(b, t):
        b.step(sends=[(1, (D, 0, 8))], recvs=[(1, (D, 0, 8))])
    assert _plan(into_the_caller).held_receives() == {}

    def copied_out_half_read_later(b, t):
        b.step(recvs=[(1, (t, 0, 8))], local=[Copy((D, 0, 8), (t, 0, 8))])
        b.step(local=[Reduce((D, 0, 4), (t, 4, 4))])
    assert _plan(copied_out_half_read_later).held_receives() == {}


def test_a_later_calls_message_numbered_alike_is_no_mismatch_until_it_stays(monkeypatch):
    """A rank that waits long for a message over one path, and sees on the other path a
    message from the same peer with the same number but another call's tag, cannot tell
    at once whether the peer sent this message the other way (sizes differ) or is
    already in its next call, whose message overtook the awaited one on the faster path
    (the awaited one then completes at the next test). It is a mismatch only if the
    sight stays while the wait goes on; once seen (a full-suite run under load), the
    second kind failed a correct burst of collectives on several channels."""
    from ringcomm.transport import base, shm
    from ringcomm.transport.shm import transport

    clock = [100.0]
    monkeypatch.setattr(transport, "_monotonic", lambda: clock[0])
    t = shm.ShmTransport.__new__(shm.ShmTransport)
    t.number_bits, t.rank, t.signs = 14, 2, base.Signs()
    awaited, later = (5 << 14) | 3, (9 << 14) | 3  # the same number, 3, of two calls
    a = base.Handle(None, None, 0, "recv", tag=awaited)
    b = base.Handle(None, None, 1, "recv", tag=awaited)  # another receive of the wait

    def look(h, found, dt=shm.PROBE_S, got=7):
        clock[0] += dt
        t._same_number(h, found, "over shared memory", got)

    # seen, then again: not yet a mismatch; gone at a look: it starts again
    look(a, later)
    look(a, later, shm.PROBE_S * 10)
    look(a, None)
    look(a, later)
    look(a, later, base.MISMATCH_S * 0.9)
    # two receives of one wait, each with its own sign, looked at in turn: neither
    # resets the other, and looks far apart (a loaded machine) still count
    look(b, later)
    look(a, later, 0.0, got=8)  # the peer's memory moved on: anew
    with pytest.raises(base.TransportMismatch, match="tagged 147459 where one tagged 81923"):
        look(b, later, 0.3)
        look(a, later, 0.3, got=8)
        look(b, later, 0.3)  # b's sign has lasted 0.9 s, a's 0.6 s: no mismatch yet
        look(a, later, 0.3, got=8)  # a's has lasted 1.2 s: the mismatch
    # and b's, looked at next, has lasted 1.5 s
    with pytest.raises(base.TransportMismatch, match="tagged 147459 where one tagged 81923"):
        look(b, later, 0.3)
    # a new wait forgets what the last one saw
    t.signs.clear()
    look(a, later, 5.0, got=8)
    # the tag itself is no mismatch, nor another number
    for found in (awaited, (9 << 14) | 4):
        for _ in range(30):
            look(a, found)
