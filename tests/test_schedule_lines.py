"""A fusion file's device-schedule lines are checked as they are read (nvtp/ir/schedule_calls.py):
an axis outside the tensor's loop domain, a split that does not divide, a parallel type used
twice, a device axis whose extent is not the mesh's, a tensor parallelized without a mesh are
refused with the line and what is legal, by ``nvtp replay`` and ``nvtp shard`` alike (they were
read modulo the rank, or ignored: a 3-D tensor's ``axis(7)`` replayed with exit 0)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nvtp import cli
from nvtp.dump.sharded import from_dump
from nvtp.ir.parser import DumpError, parse
from tests.long_fusions import text

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    """``nvtp shard`` of a one-layer MLP over 2 devices: T1 [32, 8] split on axis 0, T2 [8, 32] on
    axis 1, T5 = linear(T4, T2) with its contraction split (loop domain [4, 8, 32])."""
    root = tmp_path_factory.mktemp("lines")
    (root / "mlp.py").write_text(text("mlp", 8))
    assert cli.main(["shard", str(root / "mlp.py"), "--plan", "megatron", "--devices", "2", "--out", str(root / "tp2.py")]) == 0
    return (root / "tp2.py").read_text()


def _edit(source: str, old: str, new: str) -> tuple[str, int]:
    i = source.index(old)
    return source[:i] + new + source[i + len(old):], source[:i].count("\n") + 1


def test_an_axis_outside_the_loop_domain_is_refused_by_replay_and_shard_with_its_line(sharded, tmp_path):
    bad, line = _edit(sharded, "T2.axis(1).parallelize", "T2.axis(7).parallelize")
    path = tmp_path / "bad.py"
    path.write_text(bad)
    for args in (["replay", str(path)], ["shard", str(path), "--plan", "megatron", "--devices", "2", "--out", str(tmp_path / "out.py")]):
        run = subprocess.run([sys.executable, "-m", "nvtp", *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert run.returncode == 3, (args, run.stdout, run.stderr)
        assert f"{path}:{line}: T2.axis(7).parallelize(ParallelType.mesh_x): T2 has 3 loop axes here ([8, 2, 16]: its 2 axes, " \
               "then 1 split(s) so far), so the axis must be in 0..2 (or -3..-1); got 7" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
    assert not (tmp_path / "out.py").exists()


BAD = [  # (line, replacement, what the refusal says, the refused line after the edited one: None if elsewhere)
    ("T1.outer_split(0, 2)", "T1.outer_split(0, 3)", "T1.outer_split(0, 3): loop axis 0 has 32 entries, which 3 does not divide", 0),
    ("T1.outer_split(0, 2)", "T1.outer_split(0, 4)",
     "T1.axis(0).parallelize(ParallelType.mesh_x): the axis has 4 entries but the mesh has 2 devices along mesh_x", 1),
    ("T1.axis(0).parallelize(ParallelType.mesh_x)", "T1.axis(0).parallelize(ParallelType.mesh_x)\n    T1.axis(2).parallelize(ParallelType.mesh_x)",
     "T1 is parallelized with ParallelType.mesh_x twice, on iteration loop axes 0 and 2", 1),
    ("    T4.set_device_mesh(mesh)\n", "", "T4 is parallelized with ParallelType.mesh_x but has no device mesh", None),
    ("T2.axis(1).parallelize(ParallelType.mesh_x)", "T2.axis(1).parallelize(ParallelType.mesh_z)", "got ParallelType.mesh_z", 0),
    ("T5.outer_split(2, 2)", "T5.outer_split(3, 2)", "T5 has 3 loop axes here ([4, 8, 32]: its 2 axes, then 1 reduction axis(es))", 0),
]


@pytest.mark.parametrize("old,new,says,after", BAD, ids=["split", "extent", "twice", "no-mesh", "mesh_z", "reduction"])
def test_a_wrong_schedule_line_is_refused_with_its_line_and_what_is_legal(sharded, old, new, says, after):
    bad, line = _edit(sharded, old, new)
    with pytest.raises(DumpError) as e:
        parse(bad, "bad.py")
    assert str(e.value).startswith("bad.py:") and says in str(e.value), str(e.value)
    if after is not None:
        assert str(e.value).startswith(f"bad.py:{line + after}: "), str(e.value)


def test_negative_axes_count_from_the_end_as_in_nvfuser(sharded):
    same, _ = _edit(sharded, "T1.axis(0).parallelize", "T1.axis(-3).parallelize")
    assert from_dump(parse(same, "same.py")).shardings == from_dump(parse(sharded, "tp2.py")).shardings
