"""ringcomm's process-manager server (launch/pmi.py) without MPI: the host map it
gives MPI, and PMI-1's wire protocol as MPICH speaks it, from several ranks at once
over one store (tests/ranks/pmi_check.py runs it under MPI, through torchrun)."""
from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from ringcomm.launch import pmi


def _parse(text: str) -> list[tuple[int, int, int]]:
    """PMI_process_mapping's triples, read back."""
    assert text.startswith("(vector,") and text.endswith(")")
    body = text[len("(vector,"):-1]
    return [tuple(int(x) for x in t.strip("()").split(",")) for t in body.split("),(")]


def _expand(text: str, size: int) -> list[int]:
    """The host of each rank, as MPICH reads the mapping: each triple (node, count,
    ranks) gives ``ranks`` consecutive ranks to each of ``count`` hosts from ``node``,
    in order (ringcomm's map names every rank; it never relies on a repeat)."""
    hosts: list[int] = []
    for node, count, ranks in _parse(text):
        for h in range(node, node + count):
            hosts.extend([h] * ranks)
    assert len(hosts) == size, text
    return hosts


@pytest.mark.parametrize("machines", [
    ["a"] * 8,                                    # one host
    ["a"] * 4 + ["b"] * 4 + ["c"] * 4,            # torchrun on 3 hosts
    ["a", "b"] * 3,                               # cyclic
    ["a", "a", "b", "c", "c", "c"],               # uneven
    [f"h{i}" for i in range(300)],                # a host a rank
])
def test_the_host_map_gives_every_rank_its_host(machines):
    text = pmi.process_mapping(machines)
    ids = {m: i for i, m in enumerate(dict.fromkeys(machines))}
    assert _expand(text, len(machines)) == [ids[m] for m in machines]


def test_a_host_map_too_long_for_a_value_is_left_to_host_names():
    import random

    pick = random.Random(0)
    machines = [f"h{pick.randrange(97)}" for _ in range(2000)]  # about a triple a rank
    assert pmi.process_mapping(machines) is None
    assert pmi.process_mapping(["a"] * 16384 + ["b"] * 16384) == "(vector,(0,2,16384))"


class _Library:
    """One rank's MPI library: writes requests on its end of the socket, reads replies."""

    def __init__(self, store, rank: int, size: int, limit_s: float = 10.0,
                 mapping: str | None = None):
        self.server = pmi.Server(store, rank, size, limit_s, 30.0, "ringcomm-job1",
                                 mapping)
        ours, self.sock = socket.socketpair()
        self.thread = threading.Thread(target=self.server.serve, args=(ours,), daemon=True)
        self.thread.start()
        self.reader = self.sock.makefile("r")

    def ask(self, line: str) -> dict[str, str]:
        self.sock.sendall(line.encode() + b"\n")
        return dict(kv.split("=", 1) for kv in self.reader.readline().split())


def _barrier(libs: list) -> list:
    """Every library enters a barrier at once; their replies, in order."""
    replies: list = [None] * len(libs)

    def enter(i):
        replies[i] = libs[i].ask("cmd=barrier_in")

    threads = [threading.Thread(target=enter, args=(i,)) for i in range(len(libs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return replies


def test_mpich_start_up_conversation_over_one_store():
    """Three ranks through init: maxes, puts before a barrier are read after it by
    every rank, the host map, attributes the job has not, a command not served."""
    store = dist.HashStore()
    libs = [_Library(store, r, 3, mapping="(vector,(0,1,3))") for r in range(3)]
    for lib in libs:
        assert lib.ask("cmd=init pmi_version=1 pmi_subversion=1") == {
            "cmd": "response_to_init", "pmi_version": "1", "pmi_subversion": "1", "rc": "0"}
        assert lib.ask("cmd=get_maxes")["vallen_max"] == str(pmi.VALLEN_MAX)
        assert lib.ask("cmd=get_my_kvsname")["kvsname"] == "ringcomm-job1"
    got = libs[1].ask("cmd=get kvsname=ringcomm key=PMI_process_mapping")
    assert got == {"cmd": "get_result", "rc": "0", "value": "(vector,(0,1,3))"}
    assert libs[1].ask("cmd=get kvsname=ringcomm key=PMI_hwloc_xmlfile")["rc"] == "-1"
    assert libs[0].ask("cmd=put kvsname=ringcomm key=card-0 value=00AB")["rc"] == "0"
    assert libs[2].ask("cmd=get kvsname=ringcomm key=card-1")["rc"] == "-1"
    assert _barrier(libs) == [{"cmd": "barrier_out", "rc": "0"}] * 3
    for lib in libs:
        assert lib.ask("cmd=get kvsname=ringcomm key=card-0")["value"] == "00AB"
    # MPI_Comm_spawn's request spans lines up to "endcmd": one answer, then in step
    libs[0].sock.sendall(b"mcmd=spawn\nnprocs=2\nexecname=a.out\nendcmd\n")
    spawn = dict(kv.split("=", 1) for kv in libs[0].reader.readline().split())
    assert spawn["cmd"] == "spawn_result" and spawn["rc"] == "-1"
    assert libs[0].ask("cmd=get_appnum") == {"cmd": "appnum", "rc": "0", "appnum": "0"}
    published = libs[0].ask("cmd=publish_name service=s port=p")
    assert published["rc"] == "-1" and "mpiexec" in published["msg"]
    for lib in libs:
        assert lib.ask("cmd=finalize") == {"cmd": "finalize_ack", "rc": "0"}
        lib.thread.join(5)
        assert lib.server.finished.is_set() and not lib.thread.is_alive()


def test_host_names_pass_through_where_there_is_no_map():
    """Without a host map MPICH compares the host name it puts for each rank with its
    own gethostname(): the values must stay what it put."""
    store = dist.HashStore()
    lib = _Library(store, 0, 1)
    assert lib.ask("cmd=get kvsname=ringcomm key=PMI_process_mapping")["rc"] == "-1"
    lib.ask("cmd=put kvsname=ringcomm key=hostname[0] value=vm")
    assert lib.ask("cmd=get kvsname=ringcomm key=hostname[0]")["value"] == "vm"


def test_another_protocol_is_refused_by_name_not_waited_on():
    """PMI-2 frames its commands with a length and no newline: a line reader would
    wait for ever; the server names the protocol and closes."""
    lib = _Library(dist.HashStore(), 0, 1)
    lib.sock.sendall(b"    49cmd=fullinit;pmijobid=1;pmirank=0;threaded=FALSE;")
    lib.thread.join(5)
    assert not lib.thread.is_alive() and "PMI-1" in lib.server.failure
    with pytest.raises(ConnectionResetError):  # closed with the request unread
        lib.reader.readline()


def test_a_barrier_names_the_ranks_that_never_came():
    store = dist.HashStore()
    libs = [_Library(store, r, 4, limit_s=0.5) for r in (0, 2)]
    assert _barrier(libs) == [{"cmd": "barrier_out", "rc": "-1"}] * 2
    for lib in libs:
        assert lib.server.failure.startswith("the world of 4 ranks: ranks 1, 3 did not "
                                             "reach MPI_Init's barrier 1 within 0.5 s")


def test_a_broken_store_is_an_error_to_the_library_not_a_dead_server():
    class Broken:
        def set(self, *a):
            raise dist.DistStoreError("connection reset")

    lib = _Library(Broken(), 0, 2)
    assert lib.ask("cmd=put kvsname=ringcomm key=k value=v") == {"cmd": "put_result",
                                                                   "rc": "-1"}
    assert lib.ask("cmd=get_appnum")["rc"] == "0"  # still serving


def test_the_job_and_its_map_are_made_once_from_what_each_rank_recorded():
    import json

    store = dist.HashStore()
    for r, machine in enumerate(["a", "a", "b", "b"]):
        store.set(f"ringcomm/net/{r}", json.dumps({"machine": machine}))
    job, mapping = pmi.shared_job(store, 0, 4, timedelta(seconds=5))
    assert mapping == "(vector,(0,2,2))" and job.startswith("ringcomm-")
    assert pmi.shared_job(store, 3, 4, timedelta(seconds=5)) == (job, mapping)
    other = dist.HashStore()  # another job: another name (MPICH's world id)
    for r in range(4):
        other.set(f"ringcomm/net/{r}", json.dumps({"machine": "a"}))
    assert pmi.shared_job(other, 0, 4, timedelta(seconds=5))[0] != job
