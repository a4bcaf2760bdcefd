"""Real multi-process meshes: torch.distributed over gloo on this CPU, ranks holding only their
shards, results reassembled and compared with the unsharded single-device run."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nvtp import cli, dump


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    dump.dump_model("nanogpt", "tiny", out, dtype=torch.float32, dropout=0.1)
    return out


@pytest.mark.parametrize("role,plan,d", [("fwd", "megatron", 2), pytest.param("fwd", "megatron", 4, marks=pytest.mark.slow),
                                           ("bwd", "megatron-sp", 2), ("bwd", "megatron", 1)])  # 4 processes: 13 s
def test_replay_on_a_process_mesh_matches_single_device(files, role, plan, d, capfd):
    code = cli.main(["replay", str(files / f"nanogpt_tiny_fp32_{role}.py"), "--plan", plan, "--devices", str(d), "--check"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert f"ran on {d} processes (gloo)" in out and "against a single-device run: passed" in out
    if d > 1:
        assert "collectives: allreduce" in out or "collectives: allgather" in out


def test_a_sharded_file_runs_on_its_own_schedule(files, tmp_path, capfd):
    out = tmp_path / "bwd_sp2.py"
    assert cli.main(["shard", str(files / "nanogpt_tiny_fp32_bwd.py"), "--plan", "megatron-sp", "--devices", "2", "--out", str(out)]) == 0
    assert cli.main(["replay", str(out), "--check"]) == 0
    assert "2 processes" in capfd.readouterr().out


def test_replay_works_under_torchrun(files):
    """The same command, launched by torchrun instead of starting its own processes."""
    from torch.distributed.elastic.utils.distributed import get_free_port as free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "nvtp",
           "replay", str(files / "nanogpt_tiny_fp32_fwd.py"), "--plan", "megatron", "--devices", "2", "--check"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "against a single-device run: passed" in result.stdout
