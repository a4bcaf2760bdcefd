"""Dumps: the CLI writes forward and backward fusions in nvFuser's format, replays them with a
float64 check, and the checked-in dumps in fusions/ are what nvtp generates today."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nvtp import cli, dump
from nvtp.ir.parser import parse
from nvtp.ir.printer import format_file

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "fusions"


@pytest.fixture(scope="module")
def tiny_dumps(tmp_path_factory):
    out = tmp_path_factory.mktemp("dumps")
    assert cli.main(["dump", "--model", "nanogpt", "--config", "tiny", "--dtype", "fp32", "--out", str(out)]) == 0
    return out


def test_dump_writes_a_forward_and_a_backward_file(tiny_dumps):
    names = sorted(p.name for p in tiny_dumps.iterdir())
    assert names == ["nanogpt_tiny_fp32_bwd.py", "nanogpt_tiny_fp32_fwd.py"]
    text = (tiny_dumps / "nanogpt_tiny_fp32_fwd.py").read_text()
    assert "def nvfuser_fusion_id0(fd : FusionDefinition) -> None :" in text
    assert "with FusionDefinition() as fd:\n    nvfuser_fusion_id0(fd)" in text
    assert "fd.execute(inputs)" in text and "torch.testing.make_tensor((2, 16, 64)" in text


def test_printing_a_parsed_dump_gives_the_same_text(tiny_dumps):
    for path in [*tiny_dumps.iterdir(), *GOLDEN.glob("*.py")]:
        text = path.read_text()
        d = parse(text, str(path))
        assert format_file(d.fusion, header=d.header) == text, path.name


def test_replay_check_passes(tiny_dumps, capsys):
    for name in ["nanogpt_tiny_fp32_fwd.py", "nanogpt_tiny_fp32_bwd.py"]:
        assert cli.main(["replay", str(tiny_dumps / name), "--check"]) == cli.EXIT_OK
        assert "check against an independent evaluation (eager PyTorch, float64): passed" in capsys.readouterr().out


@pytest.mark.parametrize("op,instead", [("tanh", "sigmoid"), ("exp", "expm1"), ("rsqrt", "sqrt")])
def test_replay_check_fails_when_a_reference_op_is_wrong(tiny_dumps, monkeypatch, capsys, op, instead):
    """--check compares with an evaluation that shares no code with the reference backend
    (nvtp/dump/eager.py), so a wrong op there is caught. Against the reference backend itself
    in float64 (the check before), each of these wrong ops passed."""
    from nvtp.execute import reference

    monkeypatch.setitem(reference.IMPLS, op, reference.IMPLS[instead])
    path = tiny_dumps / "nanogpt_tiny_fp32_fwd.py"
    assert op in {o.kind for o in dump.load(path).fusion.ops}
    assert cli.main(["replay", str(path), "--check"]) == cli.EXIT_CHECK_FAILED
    out = capsys.readouterr().out
    assert "FAIL" in out and out.rstrip().endswith("(eager PyTorch, float64): FAILED")


def test_eager_evaluation_agrees_with_every_op_sample():
    """The independent evaluation computes each op sample's outputs as the samples' own expected
    values do (plain torch, written for the tests), within their tolerances."""
    from nvtp.dump import eager
    from tests.op_samples import SAMPLES

    checked = 0
    for s in SAMPLES:
        if s.expected is None:
            continue
        inputs = s.inputs(torch.Generator().manual_seed(0))
        got = eager.evaluate(s.build(), inputs)
        for g, want in zip(got, s.expected(*inputs), strict=True):
            want = torch.as_tensor(want)
            if want.dtype.is_floating_point or want.dtype.is_complex:
                torch.testing.assert_close(torch.as_tensor(g).to(want.dtype), want, rtol=max(s.tol, 1e-6), atol=max(s.tol, 1e-6), msg=s.name)
            else:
                assert torch.equal(torch.as_tensor(g).to(want.dtype), want), s.name
        checked += 1
    assert checked > 100


BAD_NUMERICS = """\
import torch
from nvfuser_direct import FusionDefinition, DataType

def nvfuser_fusion_id0(fd : FusionDefinition) -> None :
    T0 = fd.define_tensor(shape=[64], contiguity=[True], dtype=DataType.Float, is_cpu=False, stride_order=[0])
    T1 = fd.ops.add(T0, 100000000.0)
    T2 = fd.ops.sub(T1, 100000000.0)
    fd.add_output(T2)

with FusionDefinition() as fd:
    nvfuser_fusion_id0(fd)
"""


def test_replay_check_fails_when_float32_loses_the_result(tmp_path, capsys):
    """(x + 1e8) - 1e8 is x in float64 and mostly 0 in float32: the check must say so."""
    path = tmp_path / "cancel.py"
    path.write_text(BAD_NUMERICS)
    assert cli.main(["replay", str(path), "--check"]) == cli.EXIT_CHECK_FAILED
    assert "FAILED" in capsys.readouterr().out


def test_replay_check_says_an_output_with_no_finite_value_is_not_compared(tmp_path, capsys):
    """log(-(|x| + 1)) is NaN everywhere, in float32 and in float64: NaN against NaN counted as
    equal, so such an output "passed" having compared nothing (a whole backward made NaN by a random
    0 count passed test_sharding's check). It is reported as not compared, with why."""
    path = tmp_path / "nan.py"
    path.write_text(BAD_NUMERICS.replace("""    T1 = fd.ops.add(T0, 100000000.0)
    T2 = fd.ops.sub(T1, 100000000.0)
    fd.add_output(T2)""", """    T1 = fd.ops.abs(T0)
    T2 = fd.ops.add(T1, 1.0)
    T3 = fd.ops.neg(T2)
    T4 = fd.ops.log(T3)
    fd.add_output(T1)
    fd.add_output(T4)"""))
    assert cli.main(["replay", str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert out.count("not compared (no finite value in the evaluation)") == 1 and "T1     Float" in out, out
    assert "passed; 1 of 2 outputs compared, 1 not compared (1 with no finite value in the evaluation)" in out, out


def test_replay_on_nvfuser_says_it_needs_a_gpu(tiny_dumps, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code = cli.main(["replay", str(tiny_dumps / "nanogpt_tiny_fp32_fwd.py"), "--backend", "nvfuser"])
    assert code == cli.EXIT_RUNTIME
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bad_dump_is_refused_with_file_and_line(tmp_path, capsys):
    path = tmp_path / "evil.py"
    path.write_text(BAD_NUMERICS.replace("import torch\n", "import torch\nimport os\n"))
    assert cli.main(["replay", str(path)]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and "import of 'os' is not allowed" in err


def test_python_dash_m_nvtp_documents_exit_codes():
    out = subprocess.run([sys.executable, "-m", "nvtp", "--help"], capture_output=True, text=True, check=True).stdout
    assert "exit codes:" in out and "3  bad input" in out


@pytest.mark.parametrize("config", ["gpt2", "gpt3"])
def test_golden_dumps_are_current(config, tmp_path):
    """fusions/ holds what `nvtp dump` writes today; GPT-3 is traced on meta tensors, not run, in
    seconds of CPU (process time: other jobs on the machine do not count; the README measures
    ~12 s CPU for a fresh `nvtp dump` process, 9 s of it imports)."""
    start = time.process_time()
    dump.dump_model("nanogpt", config, tmp_path, dtype=torch.bfloat16)
    assert time.process_time() - start < 15
    for role in ["fwd", "bwd"]:
        name = f"nanogpt_{config}_bf16_{role}.py"
        fresh = (tmp_path / name).read_text().replace(f"--out {tmp_path}", "--out fusions")
        assert fresh == (GOLDEN / name).read_text(), f"{name} differs: regenerate with `nvtp dump --config {config} --out fusions`"


def test_backward_dump_links_saved_inputs_to_forward_values():
    fwd = parse((GOLDEN / "nanogpt_gpt3_bf16_fwd.py").read_text()).fusion
    bwd = parse((GOLDEN / "nanogpt_gpt3_bf16_bwd.py").read_text()).fusion
    assert bwd.attrs["forward"] == "nanogpt_gpt3_bf16_fwd.py"
    fwd_values, fwd_params = fwd.values, {fwd.label(v.name) for v in fwd.inputs if fwd.role(v.name) == "parameter"}
    roles = {"saved": 0, "parameter": 0, "grad": 0}
    for v in bwd.inputs:
        info = bwd.info[v.name]
        roles[info.role] += 1
        if info.role == "saved":
            assert (fwd_values[info.source].shape, fwd_values[info.source].dtype) == (v.shape, v.dtype)
        if info.role == "parameter":
            assert info.label in fwd_params
    assert roles["saved"] > 0 and roles["parameter"] > 0 and roles["grad"] == 1
    weight = next(v for v in fwd.inputs if fwd.label(v.name) == "attn.c_attn.weight")
    assert weight.shape == (3 * 12288, 12288)


def test_gpt2_forward_dump_replays_within_bf16_tolerance():
    fusion = dump.load(GOLDEN / "nanogpt_gpt2_bf16_fwd.py").fusion
    report = dump.replay(fusion, check=True)
    assert report.checks and report.ok, [(c.name, c.rel_error) for c in report.checks if not c.ok]
    masks = [c for c in report.checks if c.dtype.value == "Bool"]
    assert len(masks) == 2  # the two residual dropout masks agree exactly with the float64 run


def test_random_inputs_give_a_count_of_one():
    """A 0-d integer input is as often a count as an index (a loss's number of tokens, the divisor
    of its gradient), so random inputs make it 1. A random 0 made every output of the GPT's backward
    NaN, which compares equal to the NaN expected: the whole GPT's simulated backward checked nothing."""
    from nvtp.execute import reference
    from nvtp.ir.build import FusionBuilder
    from nvtp.ir.dtypes import DType

    b = FusionBuilder()
    grad, count = b.define_tensor((4, 8), DType.Float), b.define_tensor((), DType.Int)
    index = b.define_tensor((8,), DType.Int)
    b.add_output(b.op("div", grad, count))
    b.add_output(index)
    fusion = b.build()
    for seed in range(8):
        inputs = dump.random_inputs(fusion, seed=seed)
        assert inputs[1].item() == 1 and set(inputs[2].tolist()) <= {0, 1}
        assert torch.isfinite(reference.run(fusion, inputs)[0]).all()
