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


# ---------------------------------------------------------------------------------------------
# what a step is made of: its matrix products (the GEMM floor) and its peak memory, from one profiled step

# Matrix products and CPU flash attention: the kernels no framework can make cheaper on this CPU.
GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
         "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}


def _allocations(result) -> list:
    """The CPU allocator's allocations and frees a profiler result recorded, in time order, as
    (extra fields, the name of the op that made it)."""
    from torch._C._profiler import _EventType

    events, todo = [], list(result.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append(e)
        todo.extend(e.children)
    return [(e.extra_fields, e.parent.name if e.parent is not None else "(no op)")
            for e in sorted(events, key=lambda e: e.start_time_ns)]


def _by_op(live: dict[int, tuple[int, str]]) -> dict[str, int]:
    """Live bytes by the op that allocated them, the largest 8."""
    by_op: dict[str, int] = {}
    for size, op in live.values():
        by_op[op] = by_op.get(op, 0) + size
    return dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:8])


MARK_BYTES = 1_234_567  # an allocation of this size marks a point in a window of allocation events (``mark``)


def mark() -> None:
    """Mark this moment in ``held_after``'s window: what is allocated after it and still live at
    the end does not count as kept."""
    torch.empty(MARK_BYTES, dtype=torch.uint8)


def _live(events, after_mark: bool = False) -> tuple[int, int, dict[str, int], dict[str, int]]:
    """(peak, end, at peak, at end): the most bytes allocated in the window and not yet freed at
    any moment, the bytes at its end, and what was live at the peak and at the end, by the op that
    allocated it (the largest 8). Frees of memory allocated before the window are left out: the
    window's own memory. The profiler records allocations and frees on the thread that runs it
    (and autograd's, which it follows), not on others: a tensor freed in one of gloo's threads
    counts as live until the allocator hands its address out again, so the figures can be high by
    such buffers. Measured on the TP block at d = 2 (2026-12-01): what either side keeps is its
    parameters' 14,184,960 bytes within 3 KB (up to 2.4 MB over before the reuse correction), and
    a step's peak varied between runs by one [256, 768] activation (0.8 MB of 19-24).
    ``after_mark``: allocations after ``mark()``'s are not counted (``held_after``)."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    marked = False
    for f, op in events:
        if f.alloc_size == MARK_BYTES and after_mark:
            marked = True
        if f.alloc_size > 0 and marked:  # after the mark: an allocation that stays live is not kept
            if f.ptr in live:
                now -= live.pop(f.ptr)[0]
            continue
        if f.alloc_size > 0:
            if f.ptr in live:  # its free went unrecorded (in another thread: gloo's), as the allocator reuses it
                now -= live[f.ptr][0]
            live[f.ptr] = (f.alloc_size, op)
            now += f.alloc_size
            if now > peak:
                peak, at_peak = now, dict(live)
        elif f.ptr in live:
            now -= live.pop(f.ptr)[0]
    return peak, now, _by_op(at_peak), _by_op(live)


def held_after(build: Callable[[], object], ops: bool = False) -> tuple[object, int, dict[str, int]]:
    """``build()`` (make an implementation and run its first steps) with the CPU allocator's events
    recorded: its result, the bytes of tensor memory it allocated and still holds at the end (and
    those bytes by the op that allocated them, the largest 8),
    i.e. what the implementation keeps between steps: its parameters, gradients and optimizer
    state, and whatever else it made and kept (DDP's gradient buckets, compiled constants, index
    caches). ``build`` takes three steps and calls ``mark()`` before the last: what that step
    allocates and has not freed at the end was freed unseen (below), as a side keeps nothing new
    after its second step (DDP rebuilds its buckets in its second iteration: one step before the
    mark was too few). Only torch's CPU allocator is seen (not gloo's buffers, oneDNN's scratch or Python
    objects). Ops are not recorded unless ``ops`` (``_enable_record_function(False)``: a compile
    under a recording profiler took 2.5x as long), only allocations, so the bytes by op are all
    "(no op)" unless ``ops``. Every rank must call this together when ``build`` communicates."""
    from torch.autograd import _disable_profiler, _enable_profiler, _prepare_profiler
    from torch.autograd.profiler import ProfilerConfig, ProfilerState
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity

    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    _prepare_profiler(config, {ProfilerActivity.CPU})
    _enable_profiler(config, {ProfilerActivity.CPU})
    torch._C._autograd._enable_record_function(ops)
    try:
        out = build()
    finally:
        torch._C._autograd._enable_record_function(True)
        result = _disable_profiler()
    _, end, _, kept = _live(_allocations(result), after_mark=True)
    return out, end, kept


def profile_step(step: Callable[[], object], calls: int = 3) -> dict:
    """``calls`` calls of ``step``, each under torch.profiler (CPU ops and CPU allocations), as
    ``{"gemm_ms": ..., "gemm_share": ..., "peak_bytes": ..., "at_peak": ...}``:

    * ``gemm_ms``: the self CPU time of the matrix products (``GEMMS``) in a call, the median over
      the calls; ``gemm_share``: that over the call's own wall time (the median over the calls),
      the GEMM floor: the least share of its step a step that runs the same products can leave to
      anything else on this CPU. Both from the same call, so a load that slows the machine
      between the timed rounds and these calls does not move it (the profiler's own overhead,
      on every op, makes it a little low).
    * ``peak_bytes``: the most bytes of tensor memory a call had allocated and not yet freed at
      any moment (the largest over the calls), from the CPU allocator's events (torch's CPU
      allocator keeps no statistics; the profiler records each allocation and free with its
      address). Only what the call allocates counts (memory held before it: ``held_after``).
      ``at_peak``: what was live at that peak, bytes by the op that allocated it (the largest 8).
    Every rank of a mesh must call this together when ``step`` communicates."""
    from torch.profiler import ProfilerActivity, profile

    gemms, shares, peaks, at_peak = [], [], [], {}
    for _ in range(calls):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            start = time.perf_counter()
            step()
            wall = time.perf_counter() - start
        gemms.append(sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMMS) / 1000.0)
        shares.append(gemms[-1] / (1000.0 * wall))
        peak, _, by_op, _ = _live(_allocations(prof.profiler.kineto_results))
        if not peaks or peak > max(peaks):
            at_peak = by_op
        peaks.append(peak)
    return {"gemm_ms": round(statistics.median(gemms), 3), "gemm_share": round(statistics.median(shares), 3),
            "peak_bytes": max(peaks), "at_peak": at_peak}


def run_ranks(worker: Callable[..., int], ranks: int, job) -> dict:
    """Run ``worker`` on ``ranks`` gloo processes (``nvtp.execute.launch.spawn``) and return the JSON
    its rank 0 wrote to ``job.out``; a rank that fails fails the benchmark."""
    codes = spawn(worker, ranks, job)
    assert codes == [0] * ranks, f"a rank failed: exit codes {codes}"
    with open(job.out) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# nvtp against PyTorch's plans, compiled and not (issue 37 item 3): one report per comparison

SIDES = {  # a side's name in a worker's result -> what it is
    "nvtp": "nvtp", "nvtp_inductor": "nvtp, compile=\"inductor\"", "nvtp_blocking": "nvtp, overlap=False",
    "dtensor": "DTensor TP", "dtensor_compiled": "DTensor TP + torch.compile",
    "pytorch": "FSDP2 + TP", "pytorch_compiled": "FSDP2 + TP + torch.compile",
    "ddp": "DDP", "ddp_compiled": "DDP + torch.compile",
}


def against_plans(result: dict, plans: list[str], time_target: float) -> dict:
    """Each side of a worker's ``result`` (its ``seconds``, ``first_call_seconds``, ``gemm_ms``,
    ``held_bytes``, ``step_peak_bytes``, ``peak_bytes``) beside PyTorch's ``plans``: its timing,
    its paired ratio over each plan (median of the per-round ratios and its ~95% interval), its
    GEMM floor (rank 0's share of a profiled step in matrix products) and its peak memory per rank.
    ``misses``: every nvtp side's miss of ``time_target`` against a plan (by more than the noise),
    and of the memory target (peak per rank at or below the plan's)."""
    seconds = result["seconds"]
    sides, misses = {}, []
    for n in seconds:
        t = Timing.of(seconds[n])
        side = {"label": SIDES[n], "timing": asdict(t), "first_call_s": round(result["first_call_seconds"][n], 2),
                "gemm_ms": result["gemm_ms"][n], "gemm_floor": result["gemm_share"][n],
                "held_bytes": result["held_bytes"][n], "step_peak_bytes": result["step_peak_bytes"][n],
                "peak_bytes": result["peak_bytes"][n], "vs": {},
                "step_at_peak": result.get("step_at_peak", {}).get(n)}
        for p in plans:
            if p == n or p not in seconds:
                continue
            r = paired_ratio(seconds, p, of=n)
            side["vs"][p] = {"value": round(r.value, 3), "noise": round(r.noise, 3), "rounds": r.rounds}
            if n.startswith("nvtp") and n != "nvtp_blocking":
                if r.value - r.noise > time_target:
                    misses.append(f"{SIDES[n]} / {SIDES[p]} {r.value:.2f} ± {r.noise:.2f} > {time_target:g}")
                if result["peak_bytes"][n] > result["peak_bytes"][p]:
                    misses.append(f"peak per rank {SIDES[n]} {result['peak_bytes'][n] / 2**20:.1f} MiB > "
                                  f"{SIDES[p]} {result['peak_bytes'][p] / 2**20:.1f} MiB")
        sides[n] = side
    return {"plans": plans, "time_target": time_target, "sides": sides, "misses": misses}
