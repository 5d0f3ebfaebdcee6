"""torchft's live recovery on ringcomm (`make test-frameworks`): two replica groups of
one process each on a lighthouse, as torchft's own examples run, with
ringcomm.torchft.ProcessGroupRingcommFT as the replica group
(tests/ranks/torchft_replica.py).

* A replica killed between steps: the other keeps stepping alone; the restarted one
  heals from it over torchft's checkpoint transport and trains on; both end with the
  same parameters, equal to one process replaying the committed steps with the
  participants each step had.
* A replica killed while its peer is inside the allreduce: the survivor's collective
  fails at once with ringcomm's error naming the dead rank (torchft's and the
  adapter's errored() both say so), torchft does not commit that step, and the
  survivor goes on alone to the same replay.

Every replica that is not killed ends on its own: torchft's manager shut down, the
adapter's group released.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import RANKS, ROOT, _env, need

pytestmark = pytest.mark.frameworks

PROGRAM = RANKS / "torchft_replica.py"
LIMIT_S = 200
#: steps of the kill-between-steps case: the survivor keeps stepping (about 0.15 s a
#: step) while the killed replica restarts (a few seconds), which heals by step 25 here
STEPS = 60


@pytest.fixture
def lighthouse():
    # the frameworks extra brings torchft where its wheels exist (pyproject.toml)
    need("torchft", installed_here=platform.system() == "Linux"
         and platform.machine() == "x86_64" and sys.version_info < (3, 14))
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
                              heartbeat_timeout_ms=2000)
    yield server.address()
    server.shutdown()


class Replicas:
    """The replica processes of one test, their output in files, all ended at exit."""

    def __init__(self, out: Path, address: str):
        self.out, self.env = out, _env({"TORCHFT_LIGHTHOUSE": address})
        self.procs: list[tuple[int, subprocess.Popen, Path]] = []

    def start(self, replica: int, *args: str) -> subprocess.Popen:
        log = self.out / f"stdout-{replica}-{len(self.procs)}.txt"
        p = subprocess.Popen([sys.executable, str(PROGRAM), str(replica), str(self.out), *args],
                             cwd=ROOT, env=self.env, stdout=log.open("w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((replica, p, log))
        return p

    def go(self, deadline: float) -> None:
        """Once every replica started so far says so, let them train."""
        for _, p, _ in self.procs:
            self.wait_for(p, "started", deadline)
        (self.out / "go").touch()

    def wait_for(self, p: subprocess.Popen, text: str, deadline: float) -> None:
        log = next(f for _, q, f in self.procs if q is p)
        while text not in log.read_text():
            if p.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no {text!r} from the replica (exit {p.poll()}):\n"
                            f"{self.outputs()}")
            time.sleep(0.1)

    def finish(self, deadline: float) -> None:
        """Every replica still running exits 0 before ``deadline``, on its own, after
        shutting torchft's manager and ringcomm's group down."""
        for _, p, _ in self.procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a replica hung (still running after {LIMIT_S} s):\n"
                            f"{self.outputs()}")
        bad = [(r, p.returncode) for r, p, _ in self.procs if p.returncode not in (0, -9)]
        assert not bad, f"replicas exited {bad}:\n{self.outputs()}"
        for r, p, log in self.procs:
            if p.returncode == 0:
                assert "group released: True, forgotten: True, errored after: None" \
                    in log.read_text(), \
                    f"replica {r} did not release its group:\n{self.outputs()}"

    def outputs(self) -> str:
        return "\n".join(f"--- replica {r} (pid {p.pid})\n{f.read_text()[-3000:]}"
                         for r, p, f in self.procs)

    def kill_all(self) -> None:
        for _, p, _ in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def records(self, p: subprocess.Popen) -> list[dict]:
        text = (self.out / f"replica-{self.replica_of(p)}-{p.pid}.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]

    def params(self, p: subprocess.Popen) -> list[torch.Tensor]:
        text = (self.out / f"params-{self.replica_of(p)}-{p.pid}.json").read_text()
        return [torch.tensor(v) for v in json.loads(text)]

    def replica_of(self, p: subprocess.Popen) -> int:
        return next(r for r, q, _ in self.procs if q is p)


@pytest.fixture
def replicas(tmp_path, lighthouse):
    group = Replicas(tmp_path, lighthouse)
    yield group
    group.kill_all()


def replay(runs: dict[int, list[list[dict]]]) -> tuple[list[torch.Tensor], list[int]]:
    """One process applying every committed step as torchft defines it: the sum of the
    gradients of the replicas that took part (each on its own batch; a healing replica
    adds zeros), divided by the step's number of participants, then SGD. (At step 0
    torchft heals every replica but one to the same start and still counts it, so there
    the divisor is larger than the number of gradients.) ``runs``: per replica, the
    records of each of its processes. Returns the parameters and the participants of
    each step."""
    sys.path.insert(0, str(RANKS))
    from torchft_replica import LR, batch, model

    taking_part: dict[int, list[int]] = {}
    counts: dict[int, int] = {}
    for replica, processes in runs.items():
        for records in processes:
            for rec in records:
                if not rec["committed"]:
                    continue
                assert counts.setdefault(rec["step"], rec["participants"]) == \
                    rec["participants"], f"step {rec['step']}: participants disagree"
                if rec["participating"]:
                    assert rec["drawn"] == rec["step"], rec
                    taking_part.setdefault(rec["step"], []).append(replica)
    steps = sorted(taking_part)
    assert steps == list(range(len(steps))), f"committed steps {steps} are not 0, 1, ..."
    net = model()
    for s in steps:
        assert 1 <= len(taking_part[s]) <= counts[s], \
            f"step {s}: {counts[s]} participants counted, replicas {taking_part[s]} took part"
        total = [torch.zeros_like(p) for p in net.parameters()]
        for r in sorted(taking_part[s]):
            net.zero_grad()
            x, y = batch(s, r)
            nn.functional.mse_loss(net(x), y).backward()
            total = [t + p.grad for t, p in zip(total, net.parameters())]
        with torch.no_grad():
            for p, t in zip(net.parameters(), total):
                p.add_(t / counts[s], alpha=-LR)
    return [p.detach() for p in net.parameters()], [counts[s] for s in steps]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=1e-6, atol=1e-7)
                                    for x, y in zip(a, b))


def test_a_replica_killed_between_steps_heals_from_the_survivor(replicas):
    deadline = time.monotonic() + LIMIT_S
    # both stop after the same step, long after the restarted one can have healed
    survivor = replicas.start(0, "ddp", "--steps", str(STEPS))
    doomed = replicas.start(1, "ddp", "--hold-after", "3", "--steps", str(STEPS))
    replicas.go(deadline)
    replicas.wait_for(doomed, "holding after step 3", deadline)
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait()
    reborn = replicas.start(1, "ddp", "--steps", str(STEPS))
    replicas.finish(deadline)

    mine, its = replicas.records(survivor), replicas.records(reborn)
    assert all(r["committed"] and r["error"] is None and r["group_error"] is None
               for r in mine), mine
    assert [r["step"] for r in mine] == list(range(len(mine))), "the survivor skipped a step"
    assert mine[0]["participants"] == 2, "the first quorum did not have both replicas"
    # the restarted replica's first step heals it: it takes no part, then trains
    assert its[0]["step"] > 3 and not its[0]["participating"] and its[0]["committed"], its
    assert len(its) >= 4 and [r["participants"] for r in its[1:]] == [2] * (len(its) - 1), its
    want, counts = replay({0: [mine], 1: [replicas.records(doomed), its]})
    assert 1 in counts and counts[-1] == 2, f"participants per step: {counts}"
    assert [torch.equal(a, b) for a, b in zip(replicas.params(survivor),
                                              replicas.params(reborn))] == [True] * len(want)
    assert same(replicas.params(survivor), want), "differs from the replay of the steps"


def test_a_replica_killed_inside_the_allreduce_leaves_the_survivor_training(replicas):
    deadline = time.monotonic() + LIMIT_S
    survivor = replicas.start(0, "manual", "--steps", "7")
    dying = replicas.start(1, "manual", "--die-in", "3", "--steps", "7")
    replicas.go(deadline)
    replicas.wait_for(dying, "dying in step 3", deadline)
    replicas.finish(deadline)
    assert dying.returncode == -9

    mine = replicas.records(survivor)
    failed = [r for r in mine if not r["committed"]]
    assert len(failed) == 1 and failed[0]["step"] == 3, mine
    assert "rank 1" in failed[0]["error"] and "ringcomm" in failed[0]["error"].lower(), failed
    # the adapter says so too, and the dead peer was seen, not waited out: the step
    # failed well within the group's 15 s timeout
    assert "TransportPeerLost" in failed[0]["group_error"], failed  # seen to end here
    assert "exited while rank 0 waited" in failed[0]["group_error"], failed
    assert failed[0]["seconds"] < 10, failed
    assert all(r["group_error"] is None for r in mine if r["committed"]), mine
    want, counts = replay({0: [mine], 1: [replicas.records(dying)]})
    assert counts == [2, 2, 2, 1, 1, 1, 1], f"participants per step: {counts}"
    assert same(replicas.params(survivor), want), "differs from the replay of the steps"
