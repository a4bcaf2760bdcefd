"""Compile time. ``nvtp.jit`` against ``thunder.jit``: the first call of each on a fresh GPT-2
block (the call that traces, and for nvtp also shards, then runs); and nvtp's sharding passes
alone (plan derivation, propagation, reshard planning and insertion, verification) on the GPT-3
layer's forward and backward fusions (``fusions/nanogpt_gpt3_bf16_*.py``, 102 + 248 ops).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from benchmarks.harness import Estimate, Timing, check_target, interleave, ratios, record
from nvtp.models import gpt

ROOT = Path(__file__).resolve().parents[1]
SEQ = 256
TARGET_MS = 100  # the sharding passes on the gpt3 forward+backward fusions (the first call has no target)


def test_first_call(benchmark, request):
    import thunder

    import nvtp
    from nvtp.sharding.placements import DeviceMesh

    benchmark.group = "compile: first call on a fresh gpt2 block"
    cfg = gpt.config("gpt2", seq_len=SEQ)
    x = gpt.example_input(cfg)

    def fresh():
        torch.manual_seed(0)
        return gpt.Block(cfg)

    impls = {"nvtp": lambda: nvtp.jit(fresh(), mesh=DeviceMesh.of_size(1))(x), "thunder": lambda: thunder.jit(fresh())(x)}
    samples = {}
    benchmark.pedantic(lambda: samples.update(interleave(impls, rounds=2, warmup=0)), rounds=1, iterations=1)
    timings = {n: Timing.of(s) for n, s in samples.items()}
    data = record("compile: first call", nodeid=request.node.nodeid, kind="compile", config={"n_embd": cfg.n_embd, "seq": SEQ, "dtype": "fp32"},
                  timings=timings, ratios=ratios(timings))
    benchmark.extra_info.update(data)


@pytest.fixture(scope="module")
def gpt3():
    from nvtp import dump

    return (dump.load(ROOT / "fusions/nanogpt_gpt3_bf16_fwd.py").fusion, dump.load(ROOT / "fusions/nanogpt_gpt3_bf16_bwd.py").fusion)


@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
def test_sharding_passes(benchmark, gpt3, plan, request):
    from nvtp import driver
    from nvtp.sharding.placements import DeviceMesh

    benchmark.group = "compile: sharding passes, gpt3 forward+backward fusions, 4 devices"
    fwd, bwd = gpt3
    start = time.perf_counter()
    traced = driver.of_fusions(fwd, bwd)
    driver.shard(traced, plan, DeviceMesh.of_size(4), "nvfuser")  # the first, cold call of this process
    cold = time.perf_counter() - start
    result = benchmark.pedantic(driver.shard, args=(traced, plan, DeviceMesh.of_size(4), "nvfuser"), rounds=15, warmup_rounds=1,
                                iterations=1)
    sf, sb = result.forward, result.backward
    stats = benchmark.stats.stats
    passes = {f"forward {k}": round(1000 * v, 2) for k, v in sf.seconds.items()}
    passes.update({f"backward {k}": round(1000 * v, 2) for k, v in sb.seconds.items()})
    data = record(f"sharding passes, {plan}", nodeid=request.node.nodeid, kind="passes", plan=plan, median_ms=round(1000 * stats.median, 2),
                  min_ms=round(1000 * stats.min, 2), cold_ms=round(1000 * cold, 2), passes_ms_last_round=passes,
                  target_ms=TARGET_MS, summary=f"{1000 * stats.median:.1f} ms median (cold {1000 * cold:.0f} ms), target {TARGET_MS} ms")
    benchmark.extra_info.update(data)
    check_target(f"sharding passes, {plan}, gpt3 forward+backward on 4 devices", Estimate.of([1000 * t for t in stats.sorted_data]),
                 TARGET_MS, " ms", own_threads=1)
