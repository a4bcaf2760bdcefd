"""The benchmark suite: nvtp against what a user would pick instead, on this machine, in one run.

    .venv/bin/python -m pytest benchmarks/                 # CPU cases, a few minutes
    .venv/bin/python tools/bench_report.py                  # the table and plot of docs/benchmarks.md
    mpirun -np N .venv/bin/python -m pytest benchmarks/test_gpu.py   # the GPU cases, one process per GPU

Each comparison runs its implementations in turn, round after round (``harness.interleave``);
pytest-benchmark times the rounds, and each case's per-implementation medians and ratios go into
``extra_info`` (``--benchmark-json=FILE`` keeps them) and into ``.benchmarks/nvtp-latest.json``,
written at the end of the session.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import pytest

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
LATEST = ROOT / ".benchmarks" / "nvtp-latest.json"
_STARTED = {}


def pytest_sessionstart(session):
    _STARTED["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    _STARTED["t0"] = time.perf_counter()
    _STARTED["machine"] = harness.machine()


def pytest_sessionfinish(session, exitstatus):
    if not harness.RESULTS:
        return
    out = {"date": _STARTED.get("date"), "seconds": round(time.perf_counter() - _STARTED.get("t0", time.perf_counter()), 1),
           "machine": _STARTED.get("machine"), "command": " ".join(["python -m pytest", *session.config.invocation_params.args]),
           "load_average_1min_at_end": round(os.getloadavg()[0], 2), "cases": harness.RESULTS}
    LATEST.parent.mkdir(exist_ok=True)
    LATEST.write_text(json.dumps(out, indent=1) + "\n")


def pytest_terminal_summary(terminalreporter):
    lines = []
    for case, data in harness.RESULTS.items():
        if data.get("ratios"):
            text = ", ".join(f"{k} {v:.3f}" for k, v in data["ratios"].items())
            lines.append(f"{case}: {text}")
        elif data.get("summary"):
            lines.append(f"{case}: {data['summary']}")
    if lines:
        terminalreporter.section("nvtp against the alternatives (ratio of medians; below 1: nvtp faster)")
        for line in lines:
            terminalreporter.write_line(line)
        terminalreporter.write_line(f"written to {LATEST.relative_to(ROOT)}; tools/bench_report.py turns it into docs/benchmarks.md")


@pytest.fixture(scope="session", autouse=True)
def _thunder_warm():
    """Thunder's first trace in a process pays its one-time set-up (about 5 s); pay it before
    anything is timed, so no case is charged for it."""
    import thunder
    import torch

    thunder.jit(lambda a: (a * 2).sum())(torch.ones(2))


@pytest.fixture(autouse=True)
def _load_at_start():
    """The machine's load when each case starts, for ``harness.check_target``."""
    harness.note_load()
