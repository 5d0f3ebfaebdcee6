"""auto by simulated time (RINGCOMM_TOPOLOGY / Options(topology=...)): where the
measured tables do not cover a call, the fastest simulated algorithm runs; where
they do, they win; a file for another number of ranks leaves auto to its tables; a
bad file is refused naming it. And a real job under mpiexec with the variable set."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conftest import mpirun
from ringcomm.algorithms import REGISTRY, is_schedule, select
from ringcomm.front.planner import Planner
from ringcomm.settings import Options
from ringcomm.sim import load, simulate
from ringcomm.sim.choose import band

ROOT = Path(__file__).resolve().parent.parent
TOPO = ROOT / "examples" / "topologies"


def _planner(size: int, topology: Path | str, **kw) -> Planner:
    return Planner(0, size, Options(topology=str(topology), **kw).resolve())


def _fastest(collective: str, path: Path, nbytes: int) -> str:
    """The oracle: every schedule algorithm simulated here, the fastest at three
    significant digits, registry order breaking ties."""
    topo = load(path)
    times = {}
    for name, build in REGISTRY[collective].items():
        if is_schedule(build) and getattr(build, "fixed_world_size", None) is None:
            r = simulate(collective, name, build, topo, nbytes)
            if r.seconds is not None:
                times[name] = float(f"{r.seconds:.3g}")
    return min(times, key=times.get)


@pytest.mark.parametrize("nbytes", [4096, 1 << 20, 16 << 20])
def test_auto_runs_the_fastest_simulated_algorithm(nbytes, caplog):
    planner = _planner(8, TOPO / "two_racks.json")
    with caplog.at_level(logging.INFO, logger="ringcomm"):
        name = planner.choose("allreduce", nbytes)
    assert name == _fastest("allreduce", TOPO / "two_racks.json", band(nbytes))
    assert f"-> {name} (simulated on {TOPO / 'two_racks.json'})" in caplog.text
    assert "simulated allreduce" in caplog.text  # every candidate's time logged
    # allgather counts one rank's chunk: the simulation times the whole buffer
    assert planner.choose("allgather", nbytes // 8 or 1) == _fastest(
        "allgather", TOPO / "two_racks.json", band(nbytes // 8 * 8 or 8))


def test_measured_rows_win_over_the_simulator(tmp_path, caplog):
    doc = json.loads((TOPO / "one_switch.json").read_text())
    doc["hosts"]["count"] = 2
    two = tmp_path / "two.json"
    two.write_text(json.dumps(doc))
    planner = _planner(2, two)
    with caplog.at_level(logging.INFO, logger="ringcomm"):
        name = planner.choose("allreduce", 1 << 20)
    assert name == select.choose(select.DEFAULT_TUNING, "allreduce", 1 << 20, 2)
    assert "(measured table)" in caplog.text and "simulated" not in caplog.text
    # a user's own table for a world size counts as measured there
    table = tmp_path / "tuning.json"
    table.write_text(json.dumps({"allreduce": {"8": [[None, "tree"]]}}))
    assert _planner(8, TOPO / "two_racks.json", tuning_file=str(table)).choose(
        "allreduce", 16 << 20) == "tree"


def test_a_transport_collective_the_table_picks_is_not_simulated_away(tmp_path, caplog):
    """The simulator times schedules only: where a table that is not measured at this
    size picks shm_direct (a user's default row) it stays; where the transport cannot
    take it (ranks on several hosts), the fallback is the fastest simulated schedule."""
    table = tmp_path / "tuning.json"
    table.write_text(json.dumps({"allreduce": {"default": [[None, "shm_direct"]]}}))
    planner = _planner(8, TOPO / "two_racks.json", tuning_file=str(table))
    with caplog.at_level(logging.INFO, logger="ringcomm"):
        assert planner.choose("allreduce", 1 << 20) == "shm_direct"
    assert "(modelled table)" in caplog.text and "simulated allreduce" not in caplog.text
    assert planner.instead_of_own("allreduce", 1 << 20) == _fastest(
        "allreduce", TOPO / "two_racks.json", band(1 << 20))
    # without a topology: the modelled table's schedule
    plain = Planner(0, 8, Options().resolve())
    assert plain.instead_of_own("allreduce", 1 << 20) == select.choose(
        select.MODELLED, "allreduce", 1 << 20, 8)


def test_a_file_for_other_ranks_leaves_auto_to_its_tables(caplog):
    with caplog.at_level(logging.INFO, logger="ringcomm"):
        planner = _planner(4, TOPO / "two_racks.json")
        name = planner.choose("allreduce", 1 << 20)
    assert name == select.choose(select.DEFAULT_TUNING, "allreduce", 1 << 20, 4)
    assert "describes 8 ranks, this group has 4" in caplog.text
    assert "(modelled table)" in caplog.text


def test_a_bad_topology_is_refused_naming_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hosts": {"count": 2}, "intra_host": {"bandwidth": "1 GB/s"}, '
                   '"nics": {}}')
    with pytest.raises(ValueError, match="RINGCOMM_TOPOLOGY.*bad.json.*nics.bandwidth"):
        _planner(2, bad)
    with pytest.raises(ValueError, match="RINGCOMM_TOPOLOGY.*no-such"):
        _planner(2, tmp_path / "no-such.json")


@pytest.mark.wide  # 7 s of make test's 10 minutes; the planner's choices: the tests above
def test_under_mpiexec_the_variable_picks_by_simulation(tmp_path):
    script = tmp_path / "sim_auto.py"
    script.write_text(
        "import torch, torch.distributed as dist, ringcomm\n"
        "dist.init_process_group('ringcomm')\n"
        "p, r = dist.get_world_size(), dist.get_rank()\n"
        "t = torch.full((1 << 18,), float(r + 1))\n"
        "dist.all_reduce(t)\n"
        "assert torch.equal(t, torch.full_like(t, p * (p + 1) / 2)), t[:4]\n"
        "print(f'rank {r}: 1 checks passed', flush=True)\n"
        "dist.destroy_process_group()\n")
    out = mpirun(4, str(script), timeout=180,
                 env={"RINGCOMM_TOPOLOGY": str(TOPO / "one_switch.json"),
                      "RINGCOMM_DEBUG": "INFO"})
    assert out.stdout.count("1 checks passed") == 4, out.stdout
    expected = _fastest("allreduce", TOPO / "one_switch.json", 1 << 20)
    assert f"-> {expected} (simulated on {TOPO / 'one_switch.json'})" in out.stderr, \
        out.stderr[-3000:]
