"""2-D meshes (dp, tp) in nvFuser's output: sharded dumps with ``mesh_x`` and ``mesh_y``.

A dump sharded over a (dp, tp) mesh holds one ``DeviceMesh(torch.tensor([[...], [...]]))``; tp's
splits are parallelized with ``ParallelType.mesh_x`` (nvFuser's last mesh axis), dp's with
``mesh_y``. Checked here: nvFuser builds the printed file from its text (mesh extents tell the two
parallel types apart on a (2, 4) mesh), nvtp reads the schedule back to the same shardings, the
parser refuses malformed 2-D schedules with file:line, and the command line shards with
``--mesh 2x2`` and replays the file on 4 gloo ranks against the unsharded float64 evaluation.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from nvtp import cli, dump
from nvtp.dump.mesh import MeshJob, prepare
from nvtp.dump.sharded import from_dump, write_sharded
from nvtp.execute.nvfuser import build_from_text, compare_definition
from nvtp.ir.parser import DumpError, parse
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Shard, _StridedShard
from nvtp.sharding.schedule import schedule_steps
from nvtp.sharding.sharded import ShardedFusion
from tests.dumps import tiny_dump

ROOT = Path(__file__).resolve().parents[1]

# role, plan, fsdp, the shape of one rank's x ([B, T, E] = [2, 16, 64]) on a (dp, tp) = (2, 4) mesh
CASES = [
    ("fwd", "megatron", False, (1, 16, 64)),  # dp splits the batch; megatron keeps x whole on tp
    ("bwd", "megatron", True, (1, 16, 64)),
    ("fwd", "megatron-sp", True, (1, 4, 64)),  # sequence parallel: tp splits the sequence too
]


def _sharded_file(role: str, plan: str, fsdp: bool, mesh: tuple[int, int], out: Path) -> tuple[ShardedFusion, Path]:
    fwd, bwd = tiny_dump("bf16")  # `nvtp dump --config tiny`: the default dtype
    sharded = prepare(MeshJob(str(fwd if role == "fwd" else bwd), plan, None, mesh=mesh, fsdp=fsdp, backend="nvfuser")).sharded  # as nvtp shard
    return sharded, write_sharded(sharded, out, f"nvtp shard ... --plan {plan} --mesh {'x'.join(map(str, mesh))}")


@pytest.mark.parametrize("role,plan,fsdp,x_shape", CASES, ids=[f"{r}-{p}-{'fsdp' if f else 'ddp'}" for r, p, f, _ in CASES])
def test_nvfuser_builds_the_2d_dump_from_its_text(tmp_path, role, plan, fsdp, x_shape):
    sharded, path = _sharded_file(role, plan, fsdp, (2, 4), tmp_path / "d.py")
    text = path.read_text()
    assert "mesh = nvfuser_direct.multidevice.DeviceMesh(torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]))" in text
    fd = build_from_text(text, str(path))  # nvFuser reads the file itself
    assert compare_definition(parse(text, str(path)).fusion, fd) == []
    math = fd.fusion.print_math()
    # mesh_x is the last mesh axis (tp, 4 devices), mesh_y the one before (dp, 2 devices)
    assert set(re.findall(r"deviceIdx\.x\d+\{(\d+)\}", math)) == {"4"}
    assert set(re.findall(r"deviceIdx\.y\d+\{(\d+)\}", math)) == {"2"}
    x_line = next(line for line in math.splitlines() if line.strip().startswith("T0_"))
    assert re.search(r"\[ideviceIdx\.y\d+\{2\}, iS\d+\{1\}", x_line), x_line  # x's batch: split over dp first
    # the inputs list holds one rank's shards
    assert parse(text).inputs[0].shape == x_shape
    # nvtp_info names the axes, which nvFuser's mesh does not
    assert '"devices": "2x4"' in text and '"mesh": "dp,tp"' in text


@pytest.mark.parametrize("role,plan,fsdp", [("fwd", "megatron", False), ("bwd", "megatron", True)])
def test_the_2d_schedule_reads_back_as_printed(tmp_path, role, plan, fsdp):
    """parse(print(x)): the schedule as data is the one printed, and the shardings it gives every
    tensor (one placement per mesh axis) are the sharding pass's."""
    sharded, path = _sharded_file(role, plan, fsdp, (2, 2), tmp_path / "d.py")
    steps = schedule_steps(sharded)
    assert parse(path.read_text()).schedule == steps
    assert {s.args[1] for s in steps if s.kind == "parallelize"} == {"mesh_x", "mesh_y"}
    back = from_dump(dump.load(path))
    assert back.mesh == DeviceMesh.of_shape((2, 2), ("dp", "tp"))
    tensors = [n for n, v in sharded.fusion.values.items() if hasattr(v, "shape")]
    assert {n: back.shardings[n] for n in tensors} == {n: sharded.shardings[n] for n in tensors}
    assert {(k, s.kind, s.axis) for k, s in back.set_steps.items()} == {(k, s.kind, s.axis) for k, s in sharded.set_steps.items()}
    if fsdp:  # FSDP's gathers are on dp, its gradient reduce-scatters too
        assert {s.axis for s in back.set_steps.values() if s.kind in ("allgather", "reduce_scatter")} == {0}


def test_two_mesh_axes_on_one_tensor_axis_nest_their_splits(tmp_path):
    """dp Shard(0) and tp _StridedShard(0, 2) on a flattened [B*T, C] (the batch and the sequence):
    one chain of outer splits, dp's digit outside tp's, each parallelized by its own axis."""
    text = ("import torch\nfrom nvfuser_direct import FusionDefinition, DataType\n\n"
            "def f(fd : FusionDefinition) -> None :\n"
            "    T0 = fd.define_tensor(shape=[32, 64], contiguity=[True, True], dtype=DataType.Float)\n"
            "    T1 = fd.ops.neg(T0)\n"
            "    fd.add_output(T1)\n")
    fusion = parse(text).fusion
    mesh = DeviceMesh.of_shape((2, 4), ("dp", "tp"))
    both = (Shard(0), _StridedShard(0, split_factor=2))
    sharded = ShardedFusion(fusion, fusion, mesh, {"T0": both, "T1": both}, {}, None, "explicit", None)
    from dataclasses import replace

    from nvtp.ir.printer import format_file, format_schedule

    printed = format_file(replace(fusion, attrs={"mesh": "dp,tp"}), extra_imports=["import nvfuser_direct", "from nvfuser_direct import ParallelType"],
                          extra_body=format_schedule(schedule_steps(sharded)))
    path = tmp_path / "nested.py"
    path.write_text(printed)
    fd = build_from_text(printed, str(path))
    x_line = next(line for line in fd.fusion.print_math().splitlines() if line.strip().startswith("T0_"))
    assert re.search(r"\[ideviceIdx\.y\d+\{2\}, ideviceIdx\.x\d+\{4\}, iS\d+\{4\}, iS\d+\{64\}\]", x_line), x_line
    back = from_dump(dump.load(path))
    assert back.shardings["T0"] == both and back.shardings["T1"] == both


def _one_line(text: str, old: str, new: str) -> tuple[str, int]:
    """``text`` with the first ``old`` replaced by ``new``, and the line it is on."""
    i = text.index(old)
    return text[:i] + new + text[i + len(old):], text[:i].count("\n") + 1


@pytest.fixture(scope="module")
def two_d_text(tmp_path_factory) -> str:
    return _sharded_file("fwd", "megatron", False, (2, 2), tmp_path_factory.mktemp("m2d") / "f.py")[1].read_text()


MESH_2D = "DeviceMesh(torch.tensor([[0, 1], [2, 3]]))"
BAD = [
    (MESH_2D, "DeviceMesh([[0, 1], [2, 3]])", "refuses a nested list"),
    (MESH_2D, "DeviceMesh(torch.tensor([[0, 1], [2]]))", "all of one length"),
    (MESH_2D, "DeviceMesh(torch.tensor([[0, 1], [1, 3]]))", "repeats a device"),
    (MESH_2D, "DeviceMesh(torch.arange(4).reshape(2, 2))", "DeviceMesh(torch.tensor([[0, 1], [2, 3]]))"),
    ("ParallelType.mesh_y", "ParallelType.mesh_z", "ParallelType.mesh_y"),
]


@pytest.mark.parametrize("old,new,says", BAD, ids=[b[1] for b in BAD])
def test_the_parser_refuses_a_malformed_2d_schedule_with_its_line(two_d_text, old, new, says):
    text, line = _one_line(two_d_text, old, new)
    with pytest.raises(DumpError) as e:
        parse(text, "bad.py")
    assert str(e.value).startswith(f"bad.py:{line}: ") and says in str(e.value), str(e.value)


def test_mesh_y_on_a_1d_mesh_is_refused_with_its_line(tmp_path):
    fwd, _ = tiny_dump("bf16")
    out = tmp_path / "tp2.py"
    assert cli.main(["shard", str(fwd), "--plan", "megatron", "--devices", "2", "--out", str(out)]) == 0
    text, line = _one_line(out.read_text(), "ParallelType.mesh_x", "ParallelType.mesh_y")
    with pytest.raises(DumpError) as e:
        parse(text, "bad.py")
    assert str(e.value).startswith(f"bad.py:{line}: ") and "mesh_y needs a 2-D mesh" in str(e.value)


def _nvtp(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvtp", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_cli_shards_on_a_2x2_mesh_and_replays_the_file_on_4_ranks(tmp_path, capsys):
    """`nvtp shard --mesh 2x2 --fsdp` of the default (bf16) backward, then `nvtp replay FILE --check`
    as a subprocess: 4 gloo processes, collectives on both axes' groups, outputs against eager
    float64. (The shard runs in this process: each Python start costs ~5 s of CPU, torch and its
    DTensor imports, and this test starts five.)"""
    _, bwd = tiny_dump("bf16")
    out = tmp_path / "bwd_2x2.py"
    assert cli.main(["shard", str(bwd), "--plan", "megatron", "--mesh", "2x2", "--fsdp", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "for a 2x2 mesh (dp, tp)" in said and "reduce_scatter on dp" in said and "allreduce on tp" in said
    assert "(dp=2, tp=2, fsdp)" in out.read_text().splitlines()[0]
    replay = _nvtp("replay", str(out), "--check")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "ran on 4 processes (gloo, a 2x2 mesh (dp, tp))" in replay.stdout
    assert " on dp" in replay.stdout and " on tp" in replay.stdout  # both axes' process groups ran collectives
    assert "check of 4 ranks against a single-device run: passed" in replay.stdout
    assert "[Gloo]" not in replay.stdout + replay.stderr


@pytest.mark.slow
def test_cli_replays_an_unsharded_dump_on_a_2x2_mesh(tmp_path):
    fwd, _ = tiny_dump("bf16")
    replay = _nvtp("replay", str(fwd), "--plan", "megatron-sp", "--mesh", "2x2", "--fsdp", "--check")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "ran on 4 processes (gloo, a 2x2 mesh (dp, tp))" in replay.stdout
    assert "check of 4 ranks against a single-device run: passed" in replay.stdout


BAD_MESH = [
    (["--mesh", "2x"], "expected DPxTP"),
    (["--mesh", "4"], "a 1-D mesh is --devices N"),
    (["--mesh", "2x2x1"], "expected DPxTP"),
    (["--mesh", "0x4"], "at least 1 device"),
    (["--mesh", "2x2", "--devices", "4"], "not both"),
    (["--devices", "4", "--fsdp"], "give a mesh with a 'dp' axis, --mesh DPxTP, or leave --fsdp out"),
    (["--mesh", "3x2"], "cannot be split over the dp axis of size 3"),
]


@pytest.mark.parametrize("args,says", BAD_MESH, ids=[" ".join(a) for a, _ in BAD_MESH])
def test_bad_mesh_options_are_refused_before_any_work(tmp_path, capsys, args, says):
    fwd, _ = tiny_dump("bf16")
    out = tmp_path / "never.py"
    assert cli.main(["shard", str(fwd), "--plan", "megatron", *args, "--out", str(out)]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nvtp shard: ") and says in err[0], err
    assert not out.exists()


def test_a_bad_mesh_spelling_fails_as_a_subprocess_with_the_bad_input_code():
    result = _nvtp("replay", "any.py", "--plan", "megatron", "--mesh", "2by2", timeout=120)
    assert result.returncode == 3 and result.stdout == ""
    assert result.stderr.strip() == ("nvtp replay: --mesh '2by2': expected DPxTP, two positive integers joined by x "
                                     "(e.g. --mesh 2x2: dp=2, tp=2); a 1-D mesh is --devices N; axes by name: --mesh cp=4 "
                                     "or cp=2,tp=2 (context parallel)")
