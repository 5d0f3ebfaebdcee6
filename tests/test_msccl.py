"""MSCCL's XML on ringcomm (ringcomm.msccl): hand-written algorithms of every step type
and collective load, pass the checker and give a single-process oracle's results on
both executors (point-to-point, and one group per step under NCCL's rules);
every schedule ringcomm has exports and reads back to the same results; wrong XML
is refused naming its gpu, tb and step; the command line; and runs under mpiexec
against gloo (tests/ranks/msccl_check.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ringcomm
from conftest import ROOT, _env, assert_checks, mpirun
from ringcomm import msccl, ops
from ringcomm.algorithms import REGISTRY, is_schedule
from ringcomm.execution import checker
from ringcomm.msccl.translate import explain
from ringcomm.msccl.xmlformat import Gpu, Program, Step, StepType, ThreadBlock, write
from ringcomm.schedule import Context, ScheduleError, ShapeNotServed
from ringcomm.testing import run_schedule


def step(s, kind, src=("i", -1), dst=("o", -1), cnt=1, dep=(-1, -1), hasdep=False):
    return Step(s, kind, src[0], src[1], dst[0], dst[1], cnt, dep[0], dep[1], hasdep)


def prog(name, coll, ngpus, chunks, gpus, inplace=True, s_chunks=0):
    return Program(name, coll, ngpus, chunks, 1, "Simple", inplace, not inplace, 0, 0,
                   tuple(Gpu(g, 0, 0, s_chunks, tuple(tbs)) for g, tbs in enumerate(gpus)))


def ring_allreduce_fused(p=3) -> Program:
    """Chunk k starts at rank k (s), is reduced on its way (rrs), stored reduced at rank
    k-1 (rrcs) and passed on (rcs) until every rank has it (r)."""
    gpus = []
    for r in range(p):
        c = [(r - k) % p for k in range(2 * p - 1)]
        kinds = ["s"] + ["rrs"] * (p - 2) + ["rrcs"] + ["rcs"] * (p - 2) + ["r"]
        steps = []
        for s, (kind, k) in enumerate(zip(kinds, c)):
            steps.append(step(s, kind, ("i", k), ("i", k)))
        gpus.append([ThreadBlock(0, (r + 1) % p, (r - 1) % p, 0, tuple(steps))])
    return prog(f"ring_fused_{p}", "allreduce", p, p, gpus)


def pairs_with_scratch() -> Program:
    """2 ranks: a receive into scratch, a local reduce in another thread block waiting
    for it, a nop carrying a dependency, then the exchange of the reduced halves."""
    gpus = []
    for r in range(2):
        q = 1 - r
        net = ThreadBlock(0, q, q, 0, (
            step(0, "s", ("i", q), ("s", 0)),
            step(1, "r", ("i", r), ("s", 0), hasdep=True),
            step(2, "nop", dep=(1, 0)),
            step(3, "s", ("i", r), ("i", r), dep=(1, 0)),
            step(4, "r", ("i", q), ("i", q))))
        work = ThreadBlock(1, -1, -1, 0, (step(0, "re", ("s", 0), ("i", r), dep=(0, 1),
                                               hasdep=True),))
        gpus.append([net, work])
    return prog("pairs_scratch", "allreduce", 2, 2, gpus, s_chunks=1)


def out_of_place_rrc() -> Program:
    """2 ranks, out of place: rrc receives straight into o and adds i to it."""
    gpus = []
    for r in range(2):
        q = 1 - r
        gpus.append([ThreadBlock(0, q, q, 0, (
            step(0, "s", ("i", q), ("o", q)),
            step(1, "rrc", ("i", r), ("o", r)),
            step(2, "s", ("o", r), ("o", r)),
            step(3, "r", ("o", q), ("o", q))))])
    return prog("rrc_oop", "allreduce", 2, 2, gpus, inplace=False)


def in_place_rrc() -> Program:
    """2 ranks, in place: rrc with its source as destination (a temporary is used)."""
    gpus = []
    for r in range(2):
        q = 1 - r
        gpus.append([ThreadBlock(0, q, q, 0, (
            step(0, "s", ("i", q)), step(1, "rrc", ("i", r), ("i", r)),
            step(2, "s", ("i", r)), step(3, "r", dst=("i", q))))])
    return prog("rrc_ip", "allreduce", 2, 2, gpus)


def alltoall_with_copy() -> Program:
    gpus = []
    for r in range(2):
        q = 1 - r
        gpus.append([ThreadBlock(0, q, q, 0, (step(0, "s", ("i", q), ("o", r)),
                                              step(1, "r", ("i", r), ("o", q)))),
                     ThreadBlock(1, -1, -1, 0, (step(0, "cpy", ("i", r), ("o", r)),))])
    return prog("a2a_copy", "alltoall", 2, 2, gpus, inplace=False)


def allgather_ring(p=3) -> Program:
    gpus = []
    for r in range(p):
        steps = [step(0, "s", ("i", 0), ("o", r))]
        steps += [step(k, "rcs", dst=("o", (r - k) % p)) for k in range(1, p - 1)]
        steps += [step(p - 1, "r", dst=("o", (r - p + 1) % p))]
        gpus.append([ThreadBlock(0, (r + 1) % p, (r - 1) % p, 0, tuple(steps)),
                     ThreadBlock(1, -1, -1, 0, (step(0, "cpy", ("i", 0), ("o", r)),))])
    return prog(f"ag_ring_{p}", "allgather", p, p, gpus, inplace=False)


def allgather_in_place() -> Program:
    gpus = []
    for r in range(2):
        q = 1 - r
        gpus.append([ThreadBlock(0, q, q, 0, (step(0, "s", ("o", r), ("o", r)),
                                              step(1, "r", ("o", q), ("o", q))))])
    return prog("ag_ip", "allgather", 2, 2, gpus)


def reducescatter_pair() -> Program:
    gpus = []
    for r in range(2):
        q = 1 - r
        gpus.append([ThreadBlock(0, q, q, 0, (step(0, "s", ("i", q), ("o", 0)),
                                              step(1, "rrc", ("i", r), ("o", 0))))])
    return prog("rs_pair", "reducescatter", 2, 2, gpus, inplace=False)


HAND = [ring_allreduce_fused(3), ring_allreduce_fused(4), pairs_with_scratch(),
        out_of_place_rrc(), in_place_rrc(), alltoall_with_copy(), allgather_ring(3),
        allgather_in_place(), reducescatter_pair()]


def oracle_run(alg: msccl.Algorithm, per_chunk: int, executor: str, seg: int) -> None:
    """Run ``alg`` on in-process ranks with integer data and compare every rank's
    result with a single-process computation."""
    p, coll, root = alg.ranks, alg.collective, alg.root or 0
    lay = alg.shape(per_chunk)
    g = torch.Generator().manual_seed(per_chunk)
    if coll == "broadcast":
        xs = [torch.randint(-9, 9, (lay[0],), generator=g).float() for _ in range(p)]
        bufs = [[x.clone()] for x in xs]
        want = [[xs[root]] for _ in range(p)]
    elif coll == "reduce":
        xs = [torch.randint(-9, 9, (lay[0],), generator=g).float() for _ in range(p)]
        bufs = [[x.clone()] for x in xs]
        want = [[sum(xs)] if r == root else [None] for r in range(p)]
    elif coll == "allreduce":
        xs = [torch.randint(-9, 9, (lay[0],), generator=g).float() for _ in range(p)]
        bufs = [[x.clone()] for x in xs]
        want = [[sum(xs)] for _ in range(p)]
    elif coll == "allgather":
        xs = [torch.randint(-9, 9, (lay[0],), generator=g).float() for _ in range(p)]
        bufs = [[torch.full((lay[0],), -1.0) for _ in range(p)] + [xs[r].clone()]
                for r in range(p)]
        want = [[x for x in xs] + [xs[r]] for r in range(p)]
    elif coll == "reduce_scatter":
        xs = [[torch.randint(-9, 9, (lay[0],), generator=g).float() for _ in range(p)]
              for _ in range(p)]
        bufs = [[t.clone() for t in xs[r]] + [torch.empty(lay[0])] for r in range(p)]
        want = [[None] * p + [sum(xs[k][r] for k in range(p))] for r in range(p)]
    else:
        n = lay[0][0]
        xs = [[torch.randint(-9, 9, (n,), generator=g).float() for _ in range(p)]
              for _ in range(p)]
        bufs = [[t.clone() for t in xs[r]] + [torch.empty(n) for _ in range(p)]
                for r in range(p)]
        want = [[xs[r][j] for j in range(p)] + [xs[i][r] for i in range(p)] for r in range(p)]
    run_schedule(alg.build, coll, p, lay, bufs, op=ops.SUM, seg=seg, executor=executor,
                 root=root)
    for r in range(p):
        for b, w in enumerate(want[r]):
            if w is not None:
                assert torch.equal(bufs[r][b], w), (alg.name, executor, r, b)


@pytest.mark.parametrize("program", HAND, ids=lambda x: x.name)
@pytest.mark.parametrize("executor", ["threads", "nccl-sim"])
def test_hand_written_algorithms_match_the_oracle(program, executor):
    alg = msccl.load(write(program))
    assert (alg.name, alg.ranks, alg.chunks) == (program.name, program.ngpus,
                                                   program.nchunksperloop)
    for per_chunk, seg in ((1, 1 << 30), (5, 2), (6, 1 << 30)):  # seg 2: three slices
        oracle_run(alg, per_chunk, executor, seg)


def test_every_step_type_and_collective_is_covered():
    kinds = {st.type for p in HAND for g in p.gpus for tb in g.tbs for st in tb.steps}
    assert kinds == {"s", "r", "rcs", "rrs", "rrc", "rrcs", "cpy", "re", "nop"}
    assert {p.coll for p in HAND} == {"allreduce", "allgather", "reducescatter", "alltoall"}
    # broadcast and reduce: every exported schedule, below
    assert {p.inplace for p in HAND} == {True, False}


RING2 = """<!-- a comment before the algo element is allowed -->
<algo name="ring2" proto="Simple" nchannels="1" nchunksperloop="2" ngpus="2" coll="allreduce" inplace="1" outofplace="0" minBytes="0" maxBytes="65536">
  <gpu id="0" i_chunks="2" o_chunks="0" s_chunks="0">
    <tb id="0" send="1" recv="1" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrcs" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="r" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="1" i_chunks="2" o_chunks="0" s_chunks="0">
    <tb id="0" send="0" recv="0" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrcs" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="r" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
</algo>
"""


def test_xml_text_and_files_load_with_what_they_declare(tmp_path):
    f = tmp_path / "ring2.xml"
    f.write_text(RING2)
    for source in (RING2, str(f), f):
        alg = msccl.load(source)
        assert (alg.collective, alg.ranks, alg.chunks) == ("allreduce", 2, 2)
        assert (alg.program.proto, alg.program.max_bytes) == ("Simple", 65536)
        oracle_run(alg, 3, "threads", 1 << 30)
    assert msccl.parse(write(alg.program)) == alg.program  # write() reads back unchanged


ROUND_TRIP = [(c, a) for c in ("allreduce", "allgather", "reduce_scatter", "alltoall",
                                "broadcast", "reduce")
              for a, b in REGISTRY[c].items() if is_schedule(b)]


@pytest.mark.parametrize("collective, algo", ROUND_TRIP)
def test_every_schedule_exports_and_reads_back_to_the_same_results(collective, algo):
    for p in (2, 3, 4, 5):
        alg = msccl.load(msccl.to_xml(collective, algo, p))
        assert alg.collective == collective and alg.ranks == p
        alg.prove(multiple=3, seg=2)  # several slices per chunk
    oracle_run(msccl.load(msccl.to_xml(collective, algo, 3, chunks=6)), 4, "threads", 3)


def test_the_export_follows_msccl_tools_layout():
    text = msccl.to_xml("allreduce", "ring", 3)
    lines = text.splitlines()
    assert lines[0].startswith('<algo name="ring_allreduce_3" proto="Simple" nchannels="1" '
                               'nchunksperloop="3" ngpus="3" coll="allreduce" inplace="1" '
                               'outofplace="0" minBytes="0" maxBytes="0">')
    assert not text.startswith("<?xml") and "\t" not in text
    assert all(line.count("<") == 1 for line in lines)  # one element per line
    for line in lines:
        if "<step " in line:
            assert line.strip().endswith("/>") and line.startswith("      ")
    assert all(line.count('="') <= 16 for line in lines)  # the runtime reads 16 attributes
    assert "reducescatter" in msccl.to_xml("reduce_scatter", "ring", 2)
    # the checks MSCCL's runtime reader makes (docs/msccl-format.md, section 7), on
    # exports with many dependencies
    for coll, algo, n in (("allreduce", "ring", 5), ("allreduce", "rabenseifner", 4),
                          ("alltoall", "pairwise", 4), ("allgather", "bruck", 5)):
        p = msccl.parse(msccl.to_xml(coll, algo, n))
        for g in p.gpus:
            assert [tb.id for tb in g.tbs] == list(range(len(g.tbs)))
            for tb in g.tbs:
                assert [st.s for st in tb.steps] == list(range(len(tb.steps)))
                assert all(st.cnt < 72 for st in tb.steps)
                for i, st in enumerate(tb.steps):  # nops lead to a step with its own dep
                    if st.type == "nop":
                        after = next(x for x in tb.steps[i:] if x.type != "nop")
                        assert after.depid >= 0, (coll, algo, g.id, tb.id, i)
                    if st.depid >= 0:  # what is waited on publishes
                        assert g.tbs[st.depid].steps[st.deps].hasdep
                    if st.type in ("s", "r"):
                        assert (tb.send if st.type == "s" else tb.recv) >= 0


def _mutate(program: Program, gpu: int, tb: int, at: int, **change) -> str:
    g = program.gpus[gpu]
    t = g.tbs[tb]
    steps = list(t.steps)
    steps[at] = Step(**{**steps[at].__dict__, **change})
    tbs = list(g.tbs)
    tbs[tb] = ThreadBlock(t.id, t.send, t.recv, t.chan, tuple(steps))
    gpus = list(program.gpus)
    gpus[gpu] = Gpu(g.id, g.i_chunks, g.o_chunks, g.s_chunks, tuple(tbs))
    return write(Program(**{**program.__dict__, "gpus": tuple(gpus)}))


def test_wrong_xml_is_refused_naming_its_gpu_tb_and_step():
    ring = ring_allreduce_fused(3)
    cases = [
        (_mutate(ring, 1, 0, 1, cnt=2), "gpu 0 tb 0 step 0 (s) sends 1 chunks to gpu 1, whose "
         "matching receive gpu 1 tb 0 step 1 (rrs) takes 2"),  # a wrong cnt
        (_mutate(ring, 1, 0, 2, cnt=2), "gpu 1 tb 0 step 2: chunks 2..3 of i (srcoff=2, cnt=2) are outside its 3 "
         "chunks"),  # outside i
        (_mutate(ring, 2, 0, 0, srcoff=1), "reduces element 1 with element 2 (in the XML: rank "
         "0 step 0 is gpu 0 tb 0 step 0 (s), gpu 0 tb 0 step 1 (rrs))"),  # mixes chunks
        (_mutate(ring, 0, 0, 2, type="rrs"), "rank 0 buffer 0 element 1 (chunk 1) ends as "
         "element 1 from ranks {0}, expected element 1 from ranks {0, 1, 2}"),  # not stored
        (_mutate(pairs_with_scratch(), 0, 1, 0, depid=0, deps=3), "which does not publish"),
        (_mutate(ring, 0, 0, 1, type="x"), "gpu 0 tb 0 step 1: type='x'"),
        (_mutate(ring, 0, 0, 1, s=4), "gpu 0 tb 0 step 1: s=4"),
        (RING2.replace('<gpu id="1"', '<gpu id="0"'), "gpu 0 appears twice"),
        (RING2.replace('ngpus="2"', 'ngpus="3"'), "gpus [2] have no <gpu>"),
        (RING2.replace('coll="allreduce"', 'coll="custom"'), "coll='custom' is not served"),
        (RING2.replace('send="1" recv="1"', 'send="0" recv="1"'), "send=0 is not another"),
        (RING2.replace("<algo", "<alg").replace("</algo>", "</alg>"), "expected <algo>"),
        ("<algo", "not well-formed"),
    ]
    for text, needle in cases:
        with pytest.raises(ValueError) as e:
            msccl.load(text)
        assert needle in str(e.value), (needle, str(e.value))
    # a cycle: each rank's step 0 waits for a step that waits for it
    gpus = []
    for r in range(2):
        q = 1 - r
        gpus.append([ThreadBlock(0, q, -1, 0, (step(0, "s", ("i", 0), dep=(1, 0)),)),
                     ThreadBlock(1, -1, q, 0, (step(0, "r", dst=("i", 1), dep=(0, 0),
                                                    hasdep=True),))])
    cyc = [[ThreadBlock(0, g[0].send, -1, 0, (Step(**{**g[0].steps[0].__dict__,
                                                      "hasdep": True}),)), g[1]] for g in gpus]
    with pytest.raises(ValueError, match="cannot finish.*gpu 0 tb 0 step 0 \\(s\\)"):
        msccl.load(write(prog("cycle", "allreduce", 2, 2, cyc)))


def test_step_types_say_what_they_receive_do_and_send():
    # type -> (receives, local work, sends), as MSCCL's runtime runs them
    table = {"s": (False, None, True), "r": (True, None, False), "rcs": (True, None, True),
             "rrs": (True, "reduce", True), "rrc": (True, "reduce", False),
             "rrcs": (True, "reduce", True), "cpy": (False, "copy", False),
             "re": (False, "reduce", False), "nop": (False, None, False)}
    assert [t.value for t in StepType] == list(table)  # the order refusals list them in
    for t in StepType:
        local = "reduce" if t.reduces else "copy" if t.copies else None
        assert (t.receives, local, t.sends) == table[t.value], t
        assert t.local == (not t.receives and not t.sends)
        assert StepType(t.value) is t and t == t.value and f"{t}" == t.value
    assert StepType.RECV_REDUCE_COPY_SEND == "rrcs" and not StepType.NOP.uses_src
    assert {t for t in StepType if t.uses_dst} == set(StepType) - {
        StepType.SEND, StepType.RECV_REDUCE_SEND, StepType.NOP}
    st = msccl.parse(RING2).gpus[0].tbs[0].steps[1]
    assert st.type is StepType.RECV_REDUCE_COPY_SEND and st.kind is st.type
    assert Step(0, "cpy", "i", 0, "o", 0, 1).kind is StepType.COPY  # a caller's spelling


def test_a_refusal_names_the_xml_from_the_checkers_finding_not_its_words(monkeypatch):
    ring = ring_allreduce_fused(3)
    mixes = _mutate(ring, 2, 0, 0, srcoff=1)  # rank 0's first reduction mixes chunks
    unstored = _mutate(ring, 0, 0, 2, type="rrs")  # rank 0's chunk 1 is never stored
    in_xml = "(in the XML: rank 0 step 0 is gpu 0 tb 0 step 0 (s), gpu 0 tb 0 step 1 (rrs))"
    alg = msccl.Algorithm(msccl.parse(mixes))
    with pytest.raises(ScheduleError) as e:
        checker.check(alg.build, "allreduce", 3, alg.shape())
    f = checker.finding_of(e.value)
    assert (f.kind, f.rank, f.step, f.steps_named()) == ("reduce", 0, 0, [(0, 0)])
    tr = alg.translation(Context("allreduce", 3, 0, alg.shape()))
    assert explain("other words", f, tr, alg.program) == f"other words {in_xml}"
    assert explain("not the checker's", None, tr, alg.program) == "not the checker's"
    # both ends of a message, from a finding that names the peer's step
    both = checker.Finding("size mismatch", rank=1, step=0, peer=2, peer_step=1)
    assert explain("m", both, tr, alg.program) == (
        "m (in the XML: rank 1 step 0 is gpu 1 tb 0 step 1 (rrs), gpu 1 tb 0 step 0 (s); "
        "rank 2 step 1 is gpu 2 tb 0 step 2 (rrcs), gpu 2 tb 0 step 1 (rrs))")
    # a wrong element's chunk, after the words that name it, or at the end without them
    wrong = checker.Finding("wrong result", rank=0, buffer=0, element=1)
    assert explain("x", wrong, tr, alg.program) == "x (rank 0 buffer 0 element 1 is in chunk 1)"
    # the checker reworded: the same XML steps and chunk are named
    from ringcomm.execution import contents
    monkeypatch.setattr(contents, "describe_id", lambda coll, p, ident: "something")
    with pytest.raises(ValueError) as e:
        msccl.load(mixes)
    assert "something" in str(e.value) and str(e.value).endswith(in_xml), str(e.value)
    with pytest.raises(ValueError) as e:
        msccl.load(unstored)
    assert "rank 0 buffer 0 element 1 (chunk 1) ends as something from ranks {0}" in str(e.value)


def test_a_shape_it_does_not_serve_is_refused_naming_what_it_serves():
    alg = msccl.load(write(ring_allreduce_fused(3)))
    from ringcomm.schedule import Context
    with pytest.raises(ShapeNotServed, match="written for ngpus=3 ranks; this group has 4"):
        alg.build(Context("allreduce", 4, 0, (12,)))
    with pytest.raises(ShapeNotServed, match="needs a multiple of 3 elements, got 10"):
        alg.build(Context("allreduce", 3, 0, (10,)))
    ag = msccl.load(write(allgather_ring(3)))
    with pytest.raises(ShapeNotServed, match="same size"):
        ag.build(Context("allgather", 3, 0, (2, 3, 2)))
    assert alg.build(Context("allreduce", 3, 1, (0,))).steps == ()  # nothing to do
    bc = msccl.load(msccl.to_xml("broadcast", "tree", 3))  # root 0: it receives nothing
    assert bc.root == 0
    with pytest.raises(ShapeNotServed, match="from root 0 .*this call's root is 2"):
        bc.build(Context("broadcast", 3, 1, (3,), root=2))
    with pytest.raises(ValueError, match="names no root"):  # every rank receives
        msccl.load(write(Program(**{**ring_allreduce_fused(3).__dict__, "coll": "broadcast"})))


def test_register_msccl_names_and_refusals():
    name = ringcomm.register_msccl(write(ring_allreduce_fused(3)))
    try:
        assert name == "ring_fused_3" and name in REGISTRY["allreduce"]
        with pytest.raises(ValueError, match="exists"):
            ringcomm.register_msccl(write(ring_allreduce_fused(3)))
        assert ringcomm.register_msccl(write(ring_allreduce_fused(3)), name="mine") == "mine"
        with pytest.raises(ValueError, match="must be letters"):
            ringcomm.register_msccl(write(ring_allreduce_fused(3)), name="a,b")
    finally:
        for n in ("ring_fused_3", "mine"):
            if n in REGISTRY["allreduce"]:
                ringcomm.unregister_algorithm("allreduce", n)
    with pytest.raises(ValueError, match="no allreduce schedule named 'native'"):
        msccl.to_xml("allreduce", "native", 4)
    with pytest.raises(ValueError, match="multiple of world_size=3"):
        msccl.to_xml("allgather", "ring", 3, chunks=4)


def test_the_command_line(tmp_path, capsys):
    """``python -m ringcomm.msccl``: export as a user runs it (its own process, once),
    then check the file and a broken one through the same main() in this process
    (each process more is 2-3 s of torch's import in make test)."""
    from ringcomm.msccl.__main__ import main

    out = tmp_path / "r4.xml"
    cmd = [sys.executable, "-m", "ringcomm.msccl", "export", "ring", "allreduce", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(None), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out.write_text(proc.stdout)
    capsys.readouterr()
    assert main(["check", str(out)]) == 0
    said = capsys.readouterr().out
    for words in ("ring_allreduce_4: allreduce on 4 ranks, 4 chunks per loop",
                  "proven: every rank's result is right", "rounds of messages: 6",
                  "busiest link: "):
        assert words in said, (words, said)
    bad = tmp_path / "bad.xml"
    bad.write_text(RING2.replace('cnt="1" depid="-1" deps="-1" hasdep="0"/>\n      <step s="2"',
                                 'cnt="2" depid="-1" deps="-1" hasdep="0"/>\n      <step s="2"', 1))
    assert main(["check", str(bad)]) == 1
    assert "refused: MSCCL XML: gpu 0 tb 0 step 1" in capsys.readouterr().err


@pytest.mark.wide  # 14 s, kept out of make test's 10 minutes; the XML's schedules run in-process
def test_under_mpiexec_against_gloo(tmp_path):
    for i, p in enumerate((ring_allreduce_fused(3), allgather_ring(3))):
        (tmp_path / f"hand{i}.xml").write_text(write(p))
    out = mpirun(3, "msccl_check.py", str(tmp_path), timeout=180).stdout
    assert_checks(out, "msccl_check mpiexec n=3", 3)


def test_on_the_nccl_lane_over_fake_nccl():
    """Registered, chosen and run through a ringcomm group whose tensors go over the NCCL
    path (FakeNccl): one group per step, the oracle's results."""
    from ringcomm.testing import FakeNccl, check_collectives, nccl_groups

    name = ringcomm.register_msccl(write(ring_allreduce_fused(3)), name="msccl_nccl_ring")
    lib = FakeNccl()
    try:  # (check_collectives' allgather has uneven blocks, which MSCCL's do not serve)
        counts = nccl_groups(3, lambda pg: check_collectives(
            pg, "cpu", dtypes=(torch.float32, torch.int64), reduce_ops=("SUM", "MAX"),
            numel=300, algorithms={"allreduce": [name]}), lib=lib)
    finally:
        ringcomm.unregister_algorithm("allreduce", name)
    assert min(counts) > 0 and lib.calls["send"] > 0 and lib.calls["groupStart"] > 0


def test_the_benchmark_times_an_msccl_file_next_to_the_built_ins(tmp_path):
    import json

    f = tmp_path / "pairs.xml"
    f.write_text(write(pairs_with_scratch()))
    out = tmp_path / "b.json"
    mpirun(2, str(ROOT / "scripts" / "compare_collectives.py"), "-b", "64", "-e", "4K", "-f",
           "64", "-n", "3", "-w", "0", "--min-time", "0", "--rounds", "1", "-c", "--coll",
           "allreduce", "--algos", "ring", "--msccl", str(f), "--peers", "none",
           "--targets", "none", "--json", str(out), timeout=120)
    rows = [r for r in json.loads(out.read_text())["results"] if r["column"] == "pairs_scratch"]
    assert [r["size"] for r in rows] == [64, 4096]
    assert all(r["status"] == "ok" and r["wrong"] == 0 for r in rows), rows


def test_the_worked_example_in_the_docs_loads_and_is_right():
    import re

    text = (ROOT / "docs" / "msccl.md").read_text()
    xml = re.findall(r"```xml\n(.*?)```", text, re.S)[0]
    alg = msccl.load(xml)
    assert (alg.name, alg.ranks, alg.chunks) == ("allpairs2", 2, 2)
    for executor in ("threads", "nccl-sim"):
        oracle_run(alg, 7, executor, 3)
    assert alg.prove(multiple=(1 << 20) // 4 // 2).rounds == 2  # what the docs say


def test_auto_takes_an_msccl_files_byte_range_when_asked():
    from ringcomm.algorithms import select

    text = write(Program(**{**ring_allreduce_fused(3).__dict__, "min_bytes": 1024,
                            "max_bytes": 4096}))
    name = ringcomm.register_msccl(text, name="banded", auto=True)
    try:
        table = select.load_tuning()
        assert select.choose(table, "allreduce", 2048, 3) == "banded"
        assert select.choose(table, "allreduce", 8192, 3) != "banded"  # above maxBytes
        assert select.choose(table, "allreduce", 512, 3) != "banded"  # below minBytes
        assert select.choose(table, "allreduce", 2048, 4) != "banded"  # another world size
        # replaced without auto: the band goes
        ringcomm.register_msccl(text, name="banded", replace=True)
        assert select.choose(table, "allreduce", 2048, 3) != "banded"
    finally:
        ringcomm.unregister_algorithm("allreduce", name)
    assert not any(b[2] == "banded" for bands in select.BANDS.values() for b in bands)
    with pytest.raises(ValueError, match="auto=True for an alltoall"):
        ringcomm.register_msccl(write(alltoall_with_copy()), auto=True)
