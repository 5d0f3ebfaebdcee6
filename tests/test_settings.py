"""ringcomm.settings: every RINGCOMM_* variable in one table, parsed with errors
that name the variable, and the README's table generated from it."""
from __future__ import annotations

import dataclasses
import re
import pytest

import ringcomm
from ringcomm import settings
from ringcomm.settings import Options

from conftest import ROOT


def _code() -> list:
    files = [ROOT / "tests" / "conftest.py", *(ROOT / "tests" / "ranks").rglob("*.py")]
    for folder in ("ringcomm", "ddp", "scripts", "examples"):
        files += (ROOT / folder).rglob("*.py")
    return files


def test_every_variable_the_code_names_is_in_the_table_and_read_through_it():
    named, raw_reads = set(), []
    for path in _code():
        text = path.read_text()
        named |= set(re.findall(r"RINGCOMM_[A-Z_]+[A-Z]", text))
        rel = path.relative_to(ROOT).as_posix()
        raw_reads += [(rel, v) for v in re.findall(
            r"(?:environ\.get\(|environ\[|getenv\()\s*[\"'](RINGCOMM_\w+)", text)]
    assert named <= set(settings.BY_NAME), sorted(named - set(settings.BY_NAME))
    # the benchmark records the variable as given in its metadata; all else parses
    assert raw_reads == [("ringcomm/bench/session.py", "RINGCOMM_ALGO")], raw_reads
    for s in settings.SETTINGS:
        assert s.meaning and s.scope in ("library", "benchmark", "tests"), s


def test_every_options_field_has_its_variable():
    fields = {f.name for f in dataclasses.fields(Options)}
    assert fields == {s.option for s in settings.SETTINGS if s.option}


def test_values_are_parsed_and_defaults_apply():
    env = {"RINGCOMM_SEGMENT_BYTES": "4096", "RINGCOMM_BLOCKING_WAIT": "yes",
           "RINGCOMM_DEBUG": "detail", "RINGCOMM_SPIN_US": "12.5", "RINGCOMM_ALGO": "ring"}
    assert settings.get("RINGCOMM_SEGMENT_BYTES", env) == 4096
    assert settings.get("RINGCOMM_BLOCKING_WAIT", env) is True
    assert settings.get("RINGCOMM_BLOCKING_WAIT", {"RINGCOMM_BLOCKING_WAIT": "0"}) is False
    assert settings.get("RINGCOMM_DEBUG", env) == "DETAIL"
    assert settings.get("RINGCOMM_SPIN_US", env) == 12.5
    assert settings.get("RINGCOMM_ALGO", env) == {"*": "ring"}  # the planner expands it
    assert settings.get("RINGCOMM_ALGO", {"RINGCOMM_ALGO": "ring, allreduce=tree"}) == {
        "*": "ring", "allreduce": "tree"}
    assert settings.get("RINGCOMM_SEGMENT_BYTES", {}) == 2 * 1024 * 1024
    assert settings.get("RINGCOMM_SEGMENT_BYTES", {"RINGCOMM_SEGMENT_BYTES": " "}) == 2 << 20
    assert settings.get("RINGCOMM_TUNING", {}) is None
    with pytest.raises(KeyError):
        settings.get("RINGCOMM_NOPE", {})


@pytest.mark.parametrize("name,value,needle", [
    ("RINGCOMM_SEGMENT_BYTES", "2M", "expected a whole number"),
    ("RINGCOMM_SEGMENT_BYTES", "0", "at least 1"),
    ("RINGCOMM_SPIN_US", "fast", "expected a number"),
    ("RINGCOMM_MAX_SLEEP_US", "-1", "at least 0"),
    ("RINGCOMM_BLOCKING_WAIT", "maybe", "expected one of"),
    ("RINGCOMM_DEBUG", "VERBOSE", "expected OFF, INFO or DETAIL"),
    ("RINGCOMM_ALGO", "allreduce=", "expected `name` or `collective=name` items"),
    ("RINGCOMM_ALGO", "=ring", "expected `name` or `collective=name` items"),
    ("RINGCOMM_ALGO", "ring tree", "expected `name` or `collective=name` items"),
    ("RINGCOMM_ALGO", "ring,tree", "expected one algorithm name for every collective"),
])
def test_a_bad_value_names_the_variable(name, value, needle):
    with pytest.raises(ValueError) as info:
        settings.get(name, {name: value})
    msg = str(info.value)
    assert msg.startswith(f"ringcomm: {name}={value!r} is not valid") and needle in msg, msg


def test_options_resolve_over_the_environment():
    env = {"RINGCOMM_ALGO": "allreduce=tree,broadcast=ring", "RINGCOMM_SEGMENT_BYTES": "64"}
    got = Options(algorithms={"allreduce": "ring"}).resolve(env)
    assert got.algorithms == {"allreduce": "ring", "broadcast": "ring"}
    assert got.segment_bytes == 64 and got.tuning_file is None
    assert Options(segment_bytes=8, tuning_file="t.json").resolve(env).segment_bytes == 8
    with pytest.raises(ValueError, match="Options.segment_bytes must be a positive"):
        Options(segment_bytes=0).resolve({})
    assert ringcomm.Options is Options


def test_readme_table_is_generated_from_the_settings():
    readme = (ROOT / "README.md").read_text()
    assert settings.render_into(readme) == readme, "README's settings table is stale"
    for s in settings.SETTINGS:
        assert f"| `{s.name}` |" in readme


def test_stale_table_is_replaced():
    text = f"x\n{settings.BEGIN}\n| old |\n{settings.END}\ny\n"
    new = settings.render_into(text)
    assert "| old |" not in new and "`RINGCOMM_SEGMENT_BYTES`" in new and new.endswith("y\n")
    assert settings.render_into(new) == new
    with pytest.raises(ValueError, match="no <!-- settings:begin -->"):
        settings.render_into("no markers")


def test_every_log_line_says_which_rank_wrote_it(tmp_path):
    from conftest import mpirun

    prog = tmp_path / "log_rank_probe.py"
    prog.write_text("import torch, torch.distributed as dist, ringcomm\n"
                    "dist.init_process_group('ringcomm')\n"
                    "dist.all_reduce(torch.ones(10))\n"
                    "dist.destroy_process_group()\n")
    proc = mpirun(2, str(prog), env={"RINGCOMM_DEBUG": "INFO"}, timeout=60)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.startswith("[ringcomm ")]
    assert lines, proc.stderr
    assert {line.split("] ", 1)[1][:7] for line in lines} == {"rank 0:", "rank 1:"}, lines
