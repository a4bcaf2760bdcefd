"""Every option checked in one place before any work, and refusals known at the call made before tracing (issue 36, items 1 and 6).

* ``nvtp.jit`` and ``nvtp.plan`` refuse the same bad options with the same message (plan and run
  accept the same inputs), before anything is traced: a wrong type or value, an option of a mesh
  axis the mesh lacks (``schedule=`` without "pp"), one the mesh's path does not honour
  (``dynamic=True`` on a pipeline);
* the command line's flags are checked as the options they set, by subprocess as typed;
* the tables cover every keyword of every entry point, and name only axes nvtp knows;
* a ``cut=`` outside the model's blocks, a sequence cp cannot split and one longer than the
  model's table of positions are refused at the call, before the trace.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import nvtp
from nvtp.models import gpt

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_trace(monkeypatch):
    from nvtp import driver

    def must_not_trace(*a, **k):
        raise AssertionError("traced before refusing bad input")

    monkeypatch.setattr(driver, "trace", must_not_trace)


def _gpt(layers: int = 4):
    torch.manual_seed(0)
    cfg = gpt.config("tiny", n_layer=layers, batch=4)
    return gpt.GPT(cfg), gpt.example_tokens(cfg)


# (mesh, options, what the message says): each refused alike by nvtp.jit and nvtp.plan
BAD = [
    ("2x1x1", {"microbatches": 0}, r"microbatches=0: give a positive whole number \(e.g. microbatches=2\)"),
    ("2x1x1", {"microbatches": 2.5}, r"microbatches=2.5: give a positive whole number"),
    ("2x1x1", {"schedule": "zigzag"}, r"schedule='zigzag': choose one of 'gpipe', '1f1b'"),
    ("2x1x1", {"cut": 1}, r"cut=1: give the first block of each stage after the first, a list of whole numbers \(cut=\[1\]\)"),
    ("2x1x1", {"cut": (1.7,)}, r"cut=\(1.7,\): give the first block of each stage after the first, a list of whole numbers"),
    ("2x1x1", {"cut": [5]}, r"cut=\[5\]: the model has 4 blocks \(h.0 .. h.3\) and the mesh 2 pipeline stages: .* 1 increasing "
                            r"number\(s\) in 1..3 \(e.g. cut=\[2\]\)"),
    ("2x1x1", {"cut": [2, 3]}, r"cut=\[2, 3\]: the model has 4 blocks .* 2 pipeline stages"),
    ("2x1x1", {"collective_matmul": True}, r"collective_matmul=True is not honoured on a mesh with a 'pp' axis: a pipeline's "
                                           r"stages plan collective matmuls where the cost model says they pay"),
    ("2x1x1", {"regional": False}, r"regional=False is not honoured on a mesh with a 'pp' axis"),
    ("2x1x1", {"fsdp": True}, r"fsdp=True is not honoured on a mesh with a 'pp' axis: a pipeline's dp axis is DDP-style"),
    ((2, 2), {"schedule": "gpipe"}, r"schedule='gpipe' is an option of the 'pp' mesh axis \(pipeline parallel: .*\), and this mesh has "
                                    r"axes dp, tp: give a mesh with a 'pp' axis, init_device_mesh"),
    (2, {"microbatches": 4}, r"microbatches=4 is an option of the 'pp' mesh axis .* this mesh has the axis tp"),
    (2, {"cut": [1]}, r"cut=\[1\] is an option of the 'pp' mesh axis"),
    (2, {"fsdp": True}, r"fsdp=True is an option of the 'dp' mesh axis \(data parallel: .*\), and this mesh has the axis tp"),
    ("cp=2", {"fsdp": True}, r"fsdp=True is an option of the 'dp' mesh axis .* the axis cp"),
    (2, {"collective_matmul": "yes"}, r"collective_matmul='yes': pass True \(wherever it applies\), False \(never\) or 'auto'"),
    (2, {"collective_matmul": 1}, r"collective_matmul=1: pass True"),
    (2, {"regional": "no"}, r"regional='no': pass True or False"),
    (2, {"backend": "cuda"}, r"unknown backend 'cuda'; choose one of 'auto', 'reference', 'nvfuser'"),
    (2, {"compile": "inductr"}, r"compile='inductr' is not a way nvtp runs a rank's program; choose one of 'kernels': "),
]
JIT_ONLY = [
    ("2x1x1", {"dynamic": True}, r"dynamic=True is not honoured on a mesh with a 'pp' axis: a pipeline is compiled for one batch "
                                 r"shape"),
    ("2x1x1", {"overlap": False}, r"overlap=False is not honoured on a mesh with a 'pp' axis"),
    ("2x1x1", {"check_replicas": True}, r"check_replicas=True is not honoured on a mesh with a 'pp' axis"),
    (2, {"overlap": "maybe"}, r"overlap='maybe': pass True or False"),
    (2, {"dynamic": 1}, r"dynamic=1: pass True or False"),
    (2, {"timeout": 0}, r"timeout=0: give the seconds a rank waits for a silent peer, a number more than 0"),
    (2, {"timeout": float("inf")}, r"timeout=inf: give the seconds"),
    (2, {"frontend": "dynamo"}, r"frontend='dynamo': choose one of 'auto', 'thunder', 'fx'"),
]
PLAN_ONLY = [
    ("2x1x1", {"machine": "h100-nvlink"}, r"machine='h100-nvlink' is not honoured on a mesh with a 'pp' axis"),
    ("2x1x1", {"devices": 2}, r"devices=2 and mesh='2x1x1' both say which mesh: give one of them"),
    (2, {"machine": "tpu"}, r"machine='tpu': give a machine's name \('h100-nvlink', 'h100-ib', 'cpu-gloo'\)"),
]


@pytest.mark.parametrize("mesh,options,message", BAD + JIT_ONLY, ids=lambda x: repr(x)[:40])
def test_nvtp_jit_refuses_a_bad_or_unused_option_before_any_work(no_trace, mesh, options, message):
    model, _ = _gpt()
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        nvtp.jit(model, plan="megatron", mesh=mesh, **options)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("mesh,options,message", BAD + PLAN_ONLY, ids=lambda x: repr(x)[:40])
def test_nvtp_plan_refuses_the_same_options_with_the_same_words(no_trace, mesh, options, message):
    model, tokens = _gpt()
    with pytest.raises(ValueError, match=message):
        nvtp.plan(model, *tokens, plan="megatron", mesh=mesh, **options)


def test_nvtp_plan_takes_compile_as_nvtp_jit_does(no_trace, monkeypatch):
    """compile= is an option of nvtp.plan, as of nvtp.jit (it was handed to the model's forward:
    "GPT.forward: got an unexpected keyword argument 'compile'"); it says how a rank runs its
    fusions, not what they compute or send, so the driver plans what it plans by default."""
    from nvtp import driver

    model, tokens = _gpt(layers=1)
    seen = []

    def planned(module, *args, **kwargs):
        seen.append(kwargs)
        raise RuntimeError("planned")

    monkeypatch.setattr(driver, "compile", planned)
    for mode in ("none", "kernels"):
        with pytest.raises(RuntimeError, match="planned"):
            nvtp.plan(model, *tokens, plan="megatron", mesh=2, compile=mode)
    assert seen[0] == seen[1] and "compile" not in seen[0]  # the model's forward is not given it
    with pytest.raises(ValueError, match=r"compile='inductr' is not a way nvtp runs a rank's program"):
        nvtp.plan(model, *tokens, plan="auto", mesh=2, compile="inductr")


def test_the_thunder_transform_checks_its_options_too():
    with pytest.raises(ValueError, match=r"timeout=-1: give the seconds a rank waits"):
        nvtp.ShardingTransform(plan="megatron", mesh=1, timeout=-1)
    with pytest.raises(ValueError, match=r"regional=None: pass True or False"):
        nvtp.ShardingTransform(plan="megatron", mesh=1, regional=None)


def test_the_option_tables_cover_every_keyword_of_every_entry_point():
    """A new keyword of nvtp.jit, nvtp.plan or the transform, or a new flag of a command, cannot skip
    the check: each has a rule; the options the axes' strategies take or refuse have rules too."""
    from nvtp import options
    from nvtp.sharding.axes import AXES

    def keywords(fn, skip):
        return {n for n, p in inspect.signature(fn).parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - skip

    for fn, skip in [(nvtp.jit, {"module"}), (nvtp.plan, {"model"}), (nvtp.ShardingTransform.__init__, {"self"})]:
        assert keywords(fn, skip) <= set(options.RULES), fn
    for flags in options.COMMANDS.values():
        assert {f[2:].replace("-", "_") for f in flags} <= set(options.RULES), flags
    for s in AXES.values():
        assert set(s.options) | set(s.refuses) <= set(options.RULES) - options.MESH_FREE, s.name
    assert options.axis_options() == {n: s.options for n, s in AXES.items()}
    for name, (rule, default) in options.RULES.items():  # every default passes its own rule
        assert rule(name, default) is None, name


def test_defaults_and_good_options_pass():
    from nvtp import options

    options.check("jit", mesh="2x1x2", microbatches=4, schedule="GPipe", cut=[1], timeout=5, overlap=True, collective_matmul="auto")
    options.check("jit", mesh=(2, 2), fsdp=True, overlap=False, collective_matmul=False, timeout=None, dynamic=True)
    options.check("plan", mesh="cp=2", collective_matmul=True, machine="h100-nvlink")


# -- the command line: flags are options --------------------------------------------------------

def _nvtp(*args: str, timeout: float = 120):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "nvtp", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    return done, time.perf_counter() - start


@pytest.mark.parametrize("argv,message", [
    (["explain", "--model", "nanogpt", "--config", "tiny", "--devices", "2", "--plan", "megatron", "--microbatches", "2"],
     r"--microbatches 2 is an option of the 'pp' mesh axis \(pipeline parallel: .*\), and this mesh has the axis tp: give a mesh with a 'pp' "
     r"axis, --mesh PPxDPxTP, or leave --microbatches out"),
    (["explain", "--model", "nanogpt", "--config", "tiny", "--mesh", "2x1x2", "--plan", "megatron", "--collective-matmul", "on"],
     r"--collective-matmul on is not honoured on a mesh with a 'pp' axis"),
    (["demo", "--devices", "2", "--schedule", "gpipe"], r"--schedule gpipe is an option of the 'pp' mesh axis"),
    (["demo", "--mesh", "2x1x2", "--fsdp"], r"--fsdp is not honoured on a mesh with a 'pp' axis"),
])
def test_the_command_line_refuses_a_flag_its_mesh_does_not_use(argv, message):
    import re

    done, _ = _nvtp(*argv)  # no bound on the time: importing torch alone took 50 s on a loaded machine
    assert done.returncode == 3 and done.stdout == "", done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"nvtp {argv[0]}: "), done.stderr
    assert re.search(message, done.stderr), done.stderr
    assert "rank" not in done.stderr.lower() and "trac" not in done.stderr.lower()  # refused before any rank starts or any trace


# -- refusals known at the call, before the trace -----------------------------------------------

def test_a_sequence_longer_than_the_models_positions_is_refused_before_the_retrace():
    """``dynamic=True`` compiles each new shape: a sequence past the table of positions is refused
    before its trace (it failed inside index_select after the trace)."""
    from nvtp import driver

    model, (idx, targets) = _gpt()
    sharded = nvtp.jit(model, plan="replicate", mesh=1, dynamic=True)
    sharded(idx, targets)  # the first shape traces and runs
    traced = []
    real = driver.trace
    driver.trace = lambda *a, **k: traced.append(1) or real(*a, **k)
    try:
        long = torch.randint(0, 256, (4, 20))
        with pytest.raises(ValueError, match=r"argument idx \[4, 20\] is a sequence of 20 tokens, but GPT's table of positions wpe "
                                             r"\(nn.Embedding\(16, 64\)\) holds 16: pass at most 16 tokens \(e.g. the last 16, "
                                             r"idx\[:, -16:\]"):
            sharded(long, long)
    finally:
        driver.trace = real
    assert traced == []


def test_a_sequence_the_cp_axis_cannot_split_is_refused_before_tracing(no_trace):
    model, (idx, targets) = _gpt()
    with pytest.raises(ValueError, match=r"argument idx \[4, 15\]: its sequence \(dimension 1\) of length 15 cannot be split over "
                                         r"the cp axis of size 2: the balanced layout cuts it into 4 pieces \(2 ranks x 2\); pass a "
                                         r"sequence length that is a multiple of 4 \(e.g. pad to 16\)"):
        nvtp.plan(model, idx[:, :15], targets[:, :15], plan="replicate", mesh="cp=2")


def test_a_cut_outside_the_blocks_is_refused_at_nvtp_jit_before_the_first_call(no_trace):
    model, _ = _gpt()
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"cut=\[4\]: the model has 4 blocks"):
        nvtp.jit(model, mesh="2x1x1", microbatches=2, cut=[4])
    assert time.perf_counter() - start < 5


def test_a_replay_in_one_process_refuses_a_timeout_it_would_not_use(capsys):
    from nvtp import cli

    code = cli.main(["replay", "any_file.py", "--timeout", "5"])
    err = capsys.readouterr().err
    assert code == 3 and err.startswith("nvtp replay: --timeout 5 bounds the wait for a silent rank of a mesh of processes, and "
                                        "this replay runs in one process: add --devices N"), err


def test_a_flag_a_command_does_not_use_is_refused_not_ignored(capsys):
    from nvtp import cli

    code = cli.main(["shard", "any_file.py", "--plan", "megatron", "--devices", "2", "--out", "x.py", "--microbatches", "2"])
    err = capsys.readouterr().err
    assert code == 3 and err.startswith("nvtp shard: --microbatches 2 does not apply to nvtp shard; it takes --devices, --fsdp, "
                                        "--mesh, --plan"), err
