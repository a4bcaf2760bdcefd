"""The command line as a user runs it: ``nvtp`` in a subprocess, its exit code and its output.

The README's commands are read out of README.md's code blocks, so the documentation and the
program cannot drift apart: every one parses (default tier), and the slow tier runs them all in
order, as a newcomer would, in a scratch directory holding a copy of fusions/.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvtp import cli
from tests.dumps import tiny_dump

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NVTP = [str(BIN / "nvtp")] if (BIN / "nvtp").exists() else [sys.executable, "-m", "nvtp"]
GPT3_BWD = ROOT / "fusions" / "nanogpt_gpt3_bf16_bwd.py"


def run(argv: list[str], cwd: Path | None = None, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``argv`` with ``nvtp``/``torchrun`` as the user's shell finds them (this environment's)."""
    head = NVTP if argv[0] == "nvtp" else [str(BIN / argv[0])] if (BIN / argv[0]).exists() else [argv[0]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if "stdout" not in kw:
        kw["capture_output"] = True
    return subprocess.run(head + argv[1:], cwd=cwd or ROOT, text=True, timeout=timeout, env=env, **kw)


def first_line(text: str) -> str:
    return text.splitlines()[0] if text.strip() else ""


# ---------------------------------------------------------------------------------------------
# the README's commands


def _readme_blocks() -> list[list[str]]:
    return [b.splitlines() for b in re.findall(r"```[a-z]*\n(.*?)```", (ROOT / "README.md").read_text(), re.S)]


def readme_commands() -> list[str]:
    """Command lines of README.md's code blocks that start with ``nvtp`` or ``torchrun``, comments
    cut (output lines such as ``nvtp demo: ...`` and ``$ `` examples of failures are not commands)."""
    commands = []
    for block in _readme_blocks():
        for line in block:
            line = line.split("  #", 1)[0].strip()
            if re.match(r"(nvtp [a-z]+|torchrun) ", line) and not re.match(r"nvtp [a-z]+:", line):
                commands.append(line)
    return commands


def readme_failures() -> list[tuple[str, str]]:
    """The README's ``$ nvtp ...`` examples and the one line of stderr each documents."""
    return [(line[2:], block[i + 1]) for block in _readme_blocks() for i, line in enumerate(block[:-1]) if line.startswith("$ nvtp ")]


def test_readme_has_dump_shard_explain_and_replay_commands():
    words = [shlex.split(c) for c in readme_commands()]
    subcommands = {w[1] if w[0] == "nvtp" else w[w.index("nvtp") + 1] for w in words}
    assert {"dump", "replay", "shard", "explain"} <= subcommands, subcommands


def test_readme_failure_example_is_what_nvtp_prints():
    """The README's example of a plan that does not fit: the exit code (3) and the very line."""
    examples = {command: line for command, line in readme_failures() if "--devices 8" in command}
    assert len(examples) == 1
    (command, line), = examples.items()
    proc = run(shlex.split(command))
    assert (proc.returncode, proc.stdout, proc.stderr.rstrip("\n")) == (cli.EXIT_BAD_INPUT, "", line)


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_parses(command):
    """Each README command is one `nvtp` accepts (options, choices, types); files it reads are in
    the repository or written by a README command before it."""
    words = shlex.split(command)
    argv = words[1:] if words[0] == "nvtp" else words[words.index("nvtp") + 1:]
    args = cli.build_parser().parse_args(argv)
    made = set()
    for earlier in readme_commands()[: readme_commands().index(command)]:
        w = shlex.split(earlier)
        if "--out" in w:
            made.add(w[w.index("--out") + 1])
    if getattr(args, "file", None):
        f = args.file
        assert (ROOT / f).exists() or f in made or any(f.startswith(m.rstrip("/") + "/") for m in made), f"{command}: {f} is neither in the repository nor written by an earlier README command"


# What each README command prints first (or, for checks, last), by subcommand.
def _expect(command: str, proc: subprocess.CompletedProcess) -> None:
    out = proc.stdout
    words = shlex.split(command)
    if "dump" in words:
        assert re.fullmatch(r"wrote \S+_fwd\.py and \S+_bwd\.py in [\d.]+ s", first_line(out)), out
    elif "explain" in words and "--model" in words:
        layers = words[words.index("--layers") + 1] if "--layers" in words else "96"
        if "--json" in words:
            report = json.loads(out)
            assert report["plan"] == words[words.index("--plan") + 1] and report["communications"], out[:200]
        else:
            assert first_line(out).startswith(f"GPT ({layers} layers, "), out
    elif "explain" in words:
        file, plan = words[words.index("explain") + 1], words[words.index("--plan") + 1]
        if "--json" in words:
            report = json.loads(out)
            assert (report["file"], report["plan"]) == (file, plan)
        else:
            assert first_line(out).startswith(f"{file}: plan {plan} on a mesh of"), out
    elif "shard" in words:
        assert first_line(out).startswith(f"wrote {words[words.index('--out') + 1]}: "), out
    elif "replay" in words and "--check" in words:
        assert out.rstrip().splitlines()[-1].endswith("passed"), out
    elif "demo" in words:
        assert "PASSED" in out, out


@pytest.mark.slow
def test_readme_commands_run_as_a_user_runs_them(tmp_path):
    """Every README command, in order, in a scratch directory with a copy of fusions/ (the GPT-3
    dump writes there): exit 0 and the documented first (or verdict) line. `FILE` stands for the
    tiny bf16 forward dump; `nvtp demo` is left to `make demo`."""
    shutil.copytree(ROOT / "fusions", tmp_path / "fusions")
    ran = 0
    for command in readme_commands():
        words = shlex.split(command)
        if "demo" in words:
            continue
        if "FILE" in words:
            if not (tmp_path / "dumps").exists():
                assert run(["nvtp", "dump", "--out", "dumps"], cwd=tmp_path).returncode == 0
            words = ["dumps/nanogpt_tiny_bf16_fwd.py" if w == "FILE" else w for w in words]
        proc = run(words, cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
        _expect(command, proc)
        ran += 1
    assert ran >= 6


# ---------------------------------------------------------------------------------------------
# nvtp dump, default options and others


@pytest.fixture(scope="module")
def cli_dump(tmp_path_factory):
    """`nvtp dump --out DIR`: every default (tiny block, bf16), as a user types it."""
    out = tmp_path_factory.mktemp("cli_dump")
    proc = run(["nvtp", "dump", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_dump_with_default_options_writes_bf16_files(cli_dump):
    out, proc = cli_dump
    assert re.fullmatch(rf"wrote {re.escape(str(out))}/nanogpt_tiny_bf16_fwd\.py and {re.escape(str(out))}/nanogpt_tiny_bf16_bwd\.py in [\d.]+ s", first_line(proc.stdout))
    assert proc.stderr == ""
    assert "dtype=DataType.BFloat16" in (out / "nanogpt_tiny_bf16_fwd.py").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("options,name", [(["--dtype", "fp16"], "nanogpt_tiny_fp16"), (["--dropout", "0.1"], "nanogpt_tiny_bf16"),
                                          (["--config", "gpt2"], "nanogpt_gpt2_bf16"), (["--config", "gpt3"], "nanogpt_gpt3_bf16")])
def test_dump_options(tmp_path, options, name):
    proc = run(["nvtp", "dump", "--out", str(tmp_path), *options])
    assert proc.returncode == 0, proc.stderr
    assert first_line(proc.stdout).startswith(f"wrote {tmp_path}/{name}_fwd.py and {tmp_path}/{name}_bwd.py in ")
    text = (tmp_path / f"{name}_fwd.py").read_text()
    if "--dropout" in options:
        assert "fd.ops.uniform(" in text and '"dropout": "0.1"' in text
    if "--config" in options:  # what fusions/ holds, regenerated
        assert text == (ROOT / "fusions" / f"{name}_fwd.py").read_text().replace("--out fusions", f"--out {tmp_path}")


def test_replay_check_of_the_default_bf16_dump(cli_dump):
    out, _ = cli_dump
    path = out / "nanogpt_tiny_bf16_bwd.py"
    proc = run(["nvtp", "replay", str(path), "--check"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert first_line(proc.stdout).startswith(f"{path}: ")
    assert proc.stdout.rstrip().splitlines()[-1].endswith(": passed")


# ---------------------------------------------------------------------------------------------
# nvtp explain and shard on the checked-in GPT-3 layer


def test_explain_of_a_backward_names_the_plan_asked_for(capsys):
    """The backward is sharded from its forward under the user's plan: the report says that plan
    (it said `replicate`, the internal plan of the backward's own inputs)."""
    text = run(["nvtp", "explain", str(GPT3_BWD), "--plan", "megatron-sp", "--devices", "4"])
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"{GPT3_BWD}: plan megatron-sp on a mesh of 4 device(s), for the reference backend"
    assert "sharded to match its forward (nanogpt_gpt3_bf16_fwd.py)" in lines[1]
    assert cli.main(["explain", str(GPT3_BWD), "--plan", "megatron", "--devices", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["plan"], report["sharded_from"], report["devices"]) == ("megatron", "nanogpt_gpt3_bf16_fwd.py", 4)


def test_explain_finds_a_module_factory_in_the_current_directory(tmp_path):
    """``nvtp explain --module mine:make`` typed beside the user's own mine.py: the console script's
    sys.path holds its bin directory, not the current one, and said "No module named 'mine'";
    now the module is found (its factory here returns no model, refused as such, exit 2)."""
    (tmp_path / "nvtp_user_factory.py").write_text("def make():\n    return 1\n")
    proc = run(["nvtp", "explain", "--module", "nvtp_user_factory:make", "--plan", "megatron", "--mesh", "ep=2"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "--module nvtp_user_factory:make: the factory must return (model, example_args)" in proc.stderr, proc.stderr


def test_explain_into_a_closed_pipe_stops_quietly():
    """`nvtp explain ... | head -1`: a reader that goes away is no failure of nvtp's. It stops
    without a message, with the status of a command SIGPIPE stopped (141); it printed
    `failed: BrokenPipeError` and exited 4. The pipe is closed before nvtp writes, so the
    outcome does not depend on how much a pipe buffers."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = run(["nvtp", "explain", str(GPT3_BWD), "--plan", "megatron", "--devices", "4"], stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (cli.EXIT_BROKEN_PIPE, "")


@pytest.mark.slow  # the README scenario shards it too; nvtp explain on it stays in the default tier
def test_shard_writes_the_gpt3_layer_for_4_devices(tmp_path):
    out = tmp_path / "fwd_tp4.py"
    proc = run(["nvtp", "shard", str(ROOT / "fusions" / "nanogpt_gpt3_bf16_fwd.py"), "--plan", "megatron", "--devices", "4", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(rf"wrote {re.escape(str(out))}: \d+ ops for 4 devices, 2 communication\(s\): allreduce, allreduce", first_line(proc.stdout))
    assert '"plan": "megatron", "devices": "4"' in out.read_text()


# ---------------------------------------------------------------------------------------------
# sharded replay: every dtype nvtp emits (bf16, fp16, fp32; the attention's UInt64 RNG seed and
# offset in the half types), both plans, 2 and 4 processes. It crashed for every bf16 forward:
# torch 2.10 cannot unpickle a uint64 tensor in gather_object.

REPLAYS = [(dt, plan, d) for dt in ("bf16", "fp16", "fp32") for plan in ("megatron", "megatron-sp") for d in (2, 4)]


def check_sharded_replay(path: Path, dtype: str, devices: int, plan: str | None) -> None:
    proc = run(["nvtp", "replay", str(path), *(["--plan", plan] if plan else []), "--devices", str(devices), "--check"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert f"ran on {devices} processes (gloo)" in lines[0]
    if dtype in ("bf16", "fp16"):  # flash attention's RNG seed and offset, gathered and compared exactly
        assert sum(" UInt64 " in line and line.rstrip().endswith("ok") for line in lines) == 2, proc.stdout
    assert lines[-1] == f"check of {devices} ranks against a single-device run: passed"


def test_sharded_replay_of_the_default_bf16_dump(cli_dump):
    """The case that crashed: any bf16 forward, sharded, --check (the default tier's one; each
    mesh replay takes 15-50 s on 2 shared cores, so the others are slow-tier)."""
    out, _ = cli_dump
    check_sharded_replay(out / "nanogpt_tiny_bf16_fwd.py", "bf16", 2, "megatron")


@pytest.mark.slow
@pytest.mark.parametrize("dtype,plan,devices", REPLAYS, ids=[f"{dt}-{plan}-{d}" for dt, plan, d in REPLAYS])
def test_sharded_replay_checks_against_one_device(dtype, plan, devices):
    check_sharded_replay(tiny_dump(dtype, 0.1)[0], dtype, devices, plan)


@pytest.mark.slow
def test_sharded_replay_into_a_closed_pipe_finishes_its_check_quietly(cli_dump):
    """Rank 0 failed with BrokenPipeError (exit 4, a 'rank 0 failed' message); now the rest of
    its report goes nowhere and the exit status is the check's verdict."""
    out, _ = cli_dump
    read, write = os.pipe()
    os.close(read)
    try:
        proc = run(["nvtp", "replay", str(out / "nanogpt_tiny_bf16_fwd.py"), "--plan", "megatron", "--devices", "2", "--check"],
                   stdout=write, stderr=subprocess.PIPE, timeout=600)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.slow
def test_sharded_replay_of_a_backward():
    """A backward dump is sharded from its forward (the file next to it) under the plan."""
    check_sharded_replay(tiny_dump("bf16", 0.1)[1], "bf16-backward", 2, "megatron-sp")


@pytest.mark.slow
def test_sharded_replay_under_torchrun():
    fwd, _ = tiny_dump("bf16", None)
    proc = run(["torchrun", "--nproc-per-node", "2", "-m", "nvtp", "replay", str(fwd), "--plan", "megatron", "--devices", "2", "--check"],
               timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check of 2 ranks against a single-device run: passed" in proc.stdout
