"""A Hugging Face Llama (transformers, built from a config: hidden 512, 8 heads, 2 layers,
vocabulary 4096, batch 2 × 128 tokens, fp32) on a CPU gloo mesh of d = 2 and 4 processes:
a forward+backward step of ``nvtp.jit(model, plan="megatron")`` against the same model under
PyTorch's DTensor TP with torchtitan's per-module Llama plan (``benchmarks/hf_worker.py``).
The target: nvtp's step time at most DTensor's (ratio ≤ 1.0)."""

from __future__ import annotations

import os

import pytest

from benchmarks.harness import Timing, check_target, paired_ratio, record, run_ranks

pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")


@pytest.mark.parametrize("d", [2, 4], ids=lambda d: f"d{d}")
def test_llama_tensor_parallel_step(benchmark, d, tmp_path, request):
    from benchmarks.hf_worker import Job, worker

    benchmark.group = "sharded transformers Llama, forward+backward step, CPU gloo mesh"
    job = Job(d=d, out=str(tmp_path / f"llama{d}.json"), threads=max(1, (os.cpu_count() or 1) // d))

    result = benchmark.pedantic(run_ranks, args=(worker, d, job), rounds=1, iterations=1)
    timings = {n: Timing.of(s) for n, s in result["seconds"].items()}
    data = record(f"hf llama d={d}", nodeid=request.node.nodeid, kind="hf", d=d,
                  config={k: v for k, v in result["job"].items() if k not in ("d", "out")},
                  timings=timings, ratios={"nvtp/dtensor": round(timings["nvtp"].median_ms / timings["dtensor"].median_ms, 3)},
                  errors_vs_unsharded=result["errors"], first_call_seconds=result["first_call_seconds"])
    benchmark.extra_info.update(data)
    # Both must compute the unsharded model's loss and gradients; a wrong result is no benchmark.
    assert result["errors"]["nvtp"] <= 1e-4 and result["errors"]["dtensor"] <= 1e-4, result["errors"]
    check_target(f"hf llama d={d}: nvtp / DTensor step time", paired_ratio(result["seconds"], "dtensor"), 1.0, "x",
                 own_threads=d * job.threads)
