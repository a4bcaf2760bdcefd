"""Measuring side by side: implementations run in turn, round after round, in one process, so
a slow patch of a noisy machine slows each of them alike and their ratios hold.

``interleave`` is the one timing loop of the suite; ``Timing`` summarises one implementation's
samples (median and spread, in milliseconds); ``record`` files a case's numbers for the session
summary (``.benchmarks/nvtp-latest.json``) that ``tools/bench_report.py`` turns into
docs/benchmarks.md and its plot.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

import torch

from nvtp.execute.launch import spawn

RESULTS: dict[str, dict] = {}  # case id -> what the case recorded, in the order the cases ran


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    q1_ms: float
    q3_ms: float
    rounds: int

    @staticmethod
    def of(seconds: list[float]) -> "Timing":
        ms = sorted(1000.0 * s for s in seconds)
        q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
        return Timing(round(statistics.median(ms), 3), round(ms[0], 3), round(q[0], 3), round(q[2], 3), len(ms))


def interleave(impls: Mapping[str, Callable[..., object]], rounds: int, warmup: int = 2,
               prepare: Mapping[str, Callable[[], object]] | None = None) -> dict[str, list[float]]:
    """Run every implementation once per round, starting each round with the next one in turn;
    the first ``warmup`` rounds are not kept. Returns seconds per call, per implementation.
    ``prepare``: an untimed call before each timed one, whose result the implementation takes."""
    names = list(impls)
    samples: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    for r in range(warmup + rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            args = (prepare[n](),) if prepare and n in prepare else ()
            start = time.perf_counter()
            impls[n](*args)
            seconds = time.perf_counter() - start
            if r >= warmup:
                samples[n].append(seconds)
    return samples


def ratios(timings: Mapping[str, Timing], of: str = "nvtp") -> dict[str, float]:
    """nvtp's median over each alternative's."""
    return {f"{of}/{n}": round(timings[of].median_ms / t.median_ms, 3) for n, t in timings.items() if n != of}


def record(case: str, **data) -> dict:
    """File ``data`` (JSON-able; Timings are converted) under ``case`` for the session summary."""
    def plain(x):
        if isinstance(x, Timing):
            return asdict(x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    RESULTS[case] = plain(data)
    return RESULTS[case]


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "cuda": torch.cuda.is_available(),
        "load_average_1min_at_start": load,
    }


# ---------------------------------------------------------------------------------------------
# targets: asserted, with the slack the measurement's own noise needs


@dataclass
class Estimate:
    """A median and the half-width of its ~95% confidence interval (1.57·IQR/√n, the notch of a
    box plot), from the rounds that measured it."""

    value: float
    noise: float
    rounds: int

    @staticmethod
    def of(values: list[float]) -> "Estimate":
        v = sorted(values)
        q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
        return Estimate(statistics.median(v), 1.57 * (q[2] - q[0]) / len(v) ** 0.5, len(v))


def paired_ratio(samples: Mapping[str, list[float]], other: str, of: str = "nvtp") -> Estimate:
    """``of``'s time over ``other``'s, round by round (the two ran back to back in each round of
    ``interleave``, so a slow patch of the machine slows both), summarised by its median."""
    return Estimate.of([a / b for a, b in zip(samples[of], samples[other])])


def check_target(what: str, measured: Estimate, target: float, unit: str = "", own_threads: int | None = None) -> None:
    """Fail when ``measured`` misses ``target`` by more than its own noise (the lower end of its
    confidence interval is above the target). When other jobs alone keep every core busy (the
    1-minute load average, less this case's own ``own_threads``, above the core count, at the
    case's start or end), a miss is reported as an expected failure naming the load instead:
    there the figure measures the other jobs."""
    import pytest

    if measured.value - measured.noise <= target:
        return
    message = (f"{what}: {measured.value:.3g}{unit} ± {measured.noise:.2g} (median of {measured.rounds} rounds ± its 95% "
               f"interval) misses the target {target:g}{unit}")
    cores = os.cpu_count() or 1
    own = torch.get_num_threads() if own_threads is None else own_threads
    others = max(os.getloadavg()[0], _LOAD_AT_START.get("load", 0.0)) - own
    if others > cores:
        pytest.xfail(f"{message}; other jobs loaded the machine ({others:.1f} runnable threads besides this case's {own} "
                     f"on {cores} cores): re-run on a quiet machine")
    pytest.fail(message, pytrace=False)


_LOAD_AT_START: dict[str, float] = {}


def note_load() -> None:
    """Remember the 1-minute load average when a case starts (``check_target`` reads it)."""
    _LOAD_AT_START["load"] = os.getloadavg()[0]


def run_ranks(worker: Callable[..., int], ranks: int, job) -> dict:
    """Run ``worker`` on ``ranks`` gloo processes (``nvtp.execute.launch.spawn``) and return the JSON
    its rank 0 wrote to ``job.out``; a rank that fails fails the benchmark."""
    codes = spawn(worker, ranks, job)
    assert codes == [0] * ranks, f"a rank failed: exit codes {codes}"
    with open(job.out) as f:
        return json.load(f)
