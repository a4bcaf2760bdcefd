"""Communication scheduling (nvtp/sharding/overlap.py) against PyTorch's hand-placed plans.

Data parallelism: nvtp's GPT (hidden 256, 4 heads, 4 layers, sequence 128, vocabulary 4096,
fp32, 2 sequences a rank) on 2 CPU gloo processes, a (dp, tp) = (2, 1) mesh, a training step
(forward, backward, SGD) timed in interleaved rounds in the same processes: nvtp with its schedule
(the default: gradient all-reduces bucketed and started during the backward), nvtp blocking
(``overlap=False``: one all-reduce per gradient where it is needed), and PyTorch's
``DistributedDataParallel`` (25 MiB buckets, reduced during the backward). Also the compiled
sides (issue 37 item 3): nvtp with ``compile="inductor"`` and DDP over ``model.compile()`` (what
PyTorch's docs recommend), in the same rounds, with the GEMM floor and the peak memory per rank
beside each (``harness.against_plans``). Every side's weights after one step are checked against
one process's step on all ranks' batches. Target: nvtp / DDP at most 1.0, compiled or not (issue
25, 37); memory per rank at or below DDP's.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.harness import Timing, against_plans, check_target, paired_ratio, record
from benchmarks.dp_worker import Job, worker


@pytest.mark.slow
def test_data_parallel_step_against_ddp(benchmark, tmp_path, request):
    from nvtp.execute.launch import spawn

    benchmark.group = "data parallel: GPT training step on 2 CPU gloo processes"
    job = Job(out=str(tmp_path / "dp.json"), compiled=True)

    def run():
        assert spawn(worker, 2, job) == [0, 0]
        with open(job.out) as f:
            return json.load(f)

    result = benchmark.pedantic(run, rounds=1, iterations=1)
    assert max(result["weights_vs_unsharded"].values()) <= 1e-5, result["weights_vs_unsharded"]  # the same step, every way
    timings = {n: Timing.of(s) for n, s in result["seconds"].items()}
    ratios = {"nvtp/ddp": paired_ratio(result["seconds"], "ddp"), "nvtp_blocking/ddp": paired_ratio(result["seconds"], "ddp", "nvtp_blocking"),
              "nvtp/nvtp_blocking": paired_ratio(result["seconds"], "nvtp_blocking")}
    plans = against_plans(result, ["ddp", "ddp_compiled"], 1.0)
    data = record("data parallel vs DDP", nodeid=request.node.nodeid, kind="overlap", config=result["job"], timings=timings,
                  ratios={k: round(v.value, 3) for k, v in ratios.items()},
                  collectives={"scheduled": result["nvtp_collectives"], "tensors": result["nvtp_tensors"],
                               "blocking": result["blocking_collectives"]},
                  plans=plans, comparison=f"DDP at dp = 2: nvtp's GPT (hidden {job.n_embd}, {job.n_layer} layers, "
                  f"vocabulary {job.vocab}), SGD step",
                  summary=", ".join(f"{n} {t.median_ms:.0f} ms" for n, t in timings.items()))
    benchmark.extra_info.update(data)
    assert result["nvtp_collectives"] < result["blocking_collectives"]
    for side in result["held_bytes"]:  # the memory a side keeps holds at least its parameters
        assert result["held_bytes"][side] >= result["param_bytes"][side], (side, result["held_bytes"], result["param_bytes"])
    # The schedule pays: nvtp's default no slower than its blocking program (0.75 measured, 2026-11-24).
    check_target("nvtp scheduled / nvtp blocking step time at dp = 2", ratios["nvtp/nvtp_blocking"], 1.0, "x",
                 own_threads=2 * job.threads)
    if plans["misses"]:  # known misses, profiled: see KNOWN_MISS
        pytest.xfail(f"{'; '.join(plans['misses'])}: {KNOWN_MISS}")


# Measured 2026-11-24 (docs/benchmarks.md): the schedule cuts the step's 55 gradient all-reduces to
# 4 collectives; one process, the same GPT, no mesh: nvtp 188 ms against eager 139 ms (1.35x), the
# difference in the reference backend's compute. Measured 2026-12-01 with the compiled sides
# (docs/benchmarks.md, "Against PyTorch's plans, compiled and not"): compile="inductor" leaves nvtp at
# 1.3x DDP, and DDP + torch.compile is level with DDP. Memory: the schedule's gradient buckets were
# concatenated copies made in every step (at the peak aten::cat 16.2 MiB and 17.4 MiB of
# empty_strided, 67 MiB in all against 39 MiB with overlap=False), where DDP keeps one set of
# buckets between steps (what it keeps: parameters + buckets, 40 MiB). Since 2026-12-02 nvtp keeps
# them too, the gradients views of them (nvtp/execute/buckets.py): kept 41.5 + step 39.2 MiB, the
# step's peak the blocking program's, with the same live at it (aten::mm 16 MiB, aten::sub 8,
# aten::addmm 7): the weight gradients as the backward makes them, alive until their bucket starts
# after its last member (DDP copies each into its bucket as autograd makes it), and the
# activations the backward holds to its end.
# Since 2026-12-02 (a62940f) the dp program runs its cross-entropy and embedding gradient as kernels on
# each rank's rows: nvtp / DDP 1.10 +- 0.08, compile="inductor" 1.06 +- 0.06 (the plans table).
KNOWN_MISS = ("time: one rank's compute (nvtp's kernels 1.09x eager on one process of this GPT: per-op Python, which "
              "compile='inductor' removes, to 1.06x DDP); memory: what the profiler counts as kept varies by run "
              "(40.7-49.4 MiB against DDP's 40.4; a step's peak is below DDP's) (docs/benchmarks.md)")
