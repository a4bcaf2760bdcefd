"""``nvtp demo --mesh DPxTP [--fsdp]`` as a user runs it: the demo's GPT trained on a local 2-D
(dp, tp) gloo mesh, each dp rank on its part of every batch, checked against one process on the
whole batch; and its bad arguments refused at once, with one line and exit code 3."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvtp import cli
from nvtp.errors import EXIT_BAD_INPUT

ROOT = Path(__file__).resolve().parents[1]


def _nvtp(*argv: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "nvtp", *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return result, time.perf_counter() - start


BAD = [
    (["--mesh", "2x2", "--devices", "4"], r"give either --devices N \(a 1-D mesh\) or --mesh DPxTP \(a 2-D mesh\), not both"),
    (["--mesh", "2by2"], r"--mesh '2by2': expected DPxTP, two positive integers joined by x"),
    (["--fsdp"], r"--fsdp is an option of the 'dp' mesh axis \(data parallel: .*\), and this mesh has the axis tp: give a mesh "
                 r"with a 'dp' axis, --mesh DPxTP, or leave --fsdp out"),
    (["--mesh", "4x1"], r"--mesh 4x1: dp=4 does not divide the demo's batch of 2 sequences .*; choose dp 1 or 2"),
    (["--mesh", "1x8"], r"plan megatron cannot split the demo's GPT over tp=8 \(--mesh 1x8\): 8 does not divide its 4 heads; "
                        r"choose tp 1, 2 or 4"),
]


def test_demo_refuses_bad_mesh_arguments_with_one_line_before_any_process_starts(capsys, monkeypatch):
    # As typed, in a subprocess: exit code 3, nothing on stdout, one line on stderr.
    result, seconds = _nvtp("demo", "--mesh", "2x2", "--devices", "4", timeout=120)
    assert result.returncode == EXIT_BAD_INPUT and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.splitlines() == ["nvtp demo: give either --devices N (a 1-D mesh) or --mesh DPxTP (a 2-D mesh), not both "
                                          "(got --devices 4 --mesh 2x2)"], result.stderr
    from nvtp.execute import launch

    def no_spawn(*args, **kwargs):
        raise AssertionError("nvtp demo started processes before refusing its arguments")

    monkeypatch.setattr(launch, "spawn", no_spawn)
    for argv, message in BAD:
        code = cli.main(["demo", *argv])
        out, err = capsys.readouterr()
        assert code == EXIT_BAD_INPUT and out == "" and len(err.splitlines()) == 1, (argv, code, out, err)
        assert err.startswith("nvtp demo: ") and re.search(message, err), (argv, err)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_demo_on_a_2x2_mesh_trains_like_one_process_on_the_whole_batch(fsdp):
    """4 gloo processes, 3 steps (about 80 s at load 6): PASSED, the per-rank parameter bytes 1/tp
    (DDP) or 1/(dp*tp) (FSDP; the biases tp splits stay whole on dp, and say so), and the
    communication split by axis: tp's all-reduces, dp's all-reduces (DDP) or all-gathers and
    reduce-scatters (FSDP)."""
    result, _ = _nvtp("demo", "--mesh", "2x2", "--steps", "3", *(["--fsdp"] if fsdp else []))
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert result.stderr == "", result.stderr
    assert (f"over a local CPU mesh of 2x2 = 4 processes (dp=2 data parallel{' with FSDP' if fsdp else ''}, tp=2 tensor parallel; "
            "each dp rank trains on its 1 of the batch's 2 sequences), and check it against one process on the whole batch") in out
    m = re.search(r"^4\. check against the same training on one process \(plain PyTorch\): loss of every step within (\S+) "
                  r"\(relative\), final parameters within (\S+); tolerance 1e-4: PASSED$", out, re.M)
    assert m and float(m.group(1)) <= 1e-4 and float(m.group(2)) <= 1e-4, out
    assert len(re.findall(r"^   step +\d/3  loss \d", out, re.M)) == 3, out
    held = re.search(r"each rank holds ([\d.]+) KiB of the ([\d.]+) KiB of parameters \(1/(\d) of each weight split", out)
    assert held, out
    share = int(held.group(3))
    assert share == (4 if fsdp else 2), out
    # The split weights are 1/share on each rank; only small tensors (biases, LayerNorms, positions: under 1/60 of the bytes) more.
    assert 1 / share <= float(held.group(1)) / float(held.group(2)) <= 1 / share + 1 / 60, held.groups()
    assert ("stays whole on dp: its only dimension is split by tp" in out) == fsdp, out
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^   ((?:forward|backward) on (?:tp|dp)): (.*); [\d.]+ (?:B|KiB|MiB) sent", out, re.M)}
    assert set(lines) == {"forward on tp", "forward on dp", "backward on tp", "backward on dp"}, out
    assert "allreduce" in lines["forward on tp"] and "allreduce" in lines["backward on tp"], lines
    if fsdp:
        assert "allgather" in lines["forward on dp"] and "reduce_scatter" in lines["backward on dp"], lines
    else:
        assert "allgather" not in lines["forward on dp"] + lines["backward on dp"], lines
        assert "allreduce" in lines["backward on dp"], lines
