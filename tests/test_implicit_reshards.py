"""A sharded file replays as nvFuser runs it, communications nvFuser inserts itself included
(nvtp/dump/resharding.py): ``y = linear(x, w)`` with ``x``'s rows split over the devices and ``y``'s
rows split over streams only, as nvFuser's overlap tests and nvtp's own collective-matmul files
write it, gathers ``x`` first. nvtp's collective-matmul files (``Program.write_nvfuser``,
megatron-sp on 4 ranks, collective matmul forced on) failed ``nvtp replay --check`` with a shape error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nvtp import driver
from nvtp.dump import random_inputs
from nvtp.dump.sharded import from_dump
from nvtp.execute.spmd import assemble_outputs, run_simulated
from nvtp.ir.parser import parse
from nvtp.models import gpt

ROOT = Path(__file__).resolve().parents[1]

# nvFuser's allgather-matmul overlap, as nvFuser's tests/python/multidevice/test_overlap.py writes
# it (x's rows over the devices, the product's rows over streams), on 2 devices.
OVERLAP = """
import torch
import nvfuser_direct
from nvfuser_direct import FusionDefinition, DataType, ParallelType

def allgather_matmul(fd : FusionDefinition) -> None :
    x = fd.define_tensor(shape=[2, 8, 16], contiguity=[True, True, True], dtype=DataType.Float, is_cpu=False)
    w = fd.define_tensor(shape=[12, 16], contiguity=[True, True], dtype=DataType.Float, is_cpu=False)
    y = fd.ops.linear(x, w)
    fd.add_output(y)
    mesh = nvfuser_direct.multidevice.DeviceMesh([0, 1])
    x.set_device_mesh(mesh)
    w.set_device_mesh(mesh)
    y.set_device_mesh(mesh)
    x.outer_split(1, 2)
    x.axis(1).parallelize(ParallelType.mesh_x)
    y.outer_split(1, 2)
    y.axis(1).parallelize(ParallelType.stream)

with FusionDefinition() as fd:
    allgather_matmul(fd)
"""


def test_a_product_of_rows_split_over_devices_gathers_them_first_as_nvfuser_does():
    sharded = from_dump(parse(OVERLAP, "overlap.py"))
    steps = list(sharded.set_steps.values())
    assert [(s.kind, s.value, str(s.src), str(s.dst)) for s in steps] == [("allgather", "x", "S(1)", "R")]
    x, w = random_inputs(sharded.source, seed=3)
    per_rank, logs = run_simulated(sharded, [x, w])
    (y,) = assemble_outputs(sharded, per_rank)
    torch.testing.assert_close(y, torch.einsum("btk,nk->btn", x.double(), w.double()).float(), rtol=1e-6, atol=1e-6)
    assert all([c.kind for c in log] == ["allgather"] for log in logs), logs


def test_a_file_with_its_communications_written_out_is_left_as_written():
    """nvtp shard's files have a set for every communication: nothing is added."""
    text = OVERLAP.replace("    y = fd.ops.linear(x, w)\n", "    g = fd.ops.set(x)\n    y = fd.ops.linear(g, w)\n")
    text = text.replace("    y.set_device_mesh(mesh)\n", "    y.set_device_mesh(mesh)\n    g.set_device_mesh(mesh)\n")
    sharded = from_dump(parse(text, "explicit.py"))
    assert sharded.fusion is sharded.source and [s.kind for s in sharded.set_steps.values()] == ["allgather"]


@pytest.mark.slow
def test_nvtps_own_collective_matmul_files_replay_with_check_on_their_mesh(tmp_path):
    idx, tgt = gpt.example_tokens(gpt.config("tiny"))
    torch.manual_seed(0)
    program = driver.compile(gpt.GPT(gpt.config("tiny")), idx, tgt, plan="megatron-sp", mesh=4, backend="nvfuser", collective_matmul=True)
    written = [p for p in program.write_nvfuser(tmp_path) if "collective_matmul" in p.name]
    assert len(written) == 3
    for path in written:
        run = subprocess.run([sys.executable, "-m", "nvtp", "replay", str(path), "--devices", "4", "--check"],
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert run.returncode == 0, (path.name, run.stdout[-2000:], run.stderr[-2000:])
        assert "check of 4 ranks against a single-device run: passed" in run.stdout, run.stdout
        kind = "allgather" if "allgather" in path.name else "reduce_scatter"
        assert f"1 collectives: {kind}" in run.stdout, run.stdout
