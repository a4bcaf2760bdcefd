"""Sharded: a forward+backward step of GPT-2's block on a CPU gloo mesh of d = 1, 2, 4 processes,
nvtp (plan "megatron", derived from the graph) against PyTorch's DTensor tensor parallelism
(``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``) on the same block and mesh.

The block is GPT-2 small's (hidden 768, 12 heads, batch 1, fp32) at sequence length 256 on CPU,
with q, k and v as separate linears so that PyTorch's plan is correct (``benchmarks/blocks.py``).
Each process gets max(1, cores // d) threads (both frameworks alike); on a 2-core machine the
4 ranks of d = 4 share 2 cores, so d = 4 measures contention as well as sharding.

At d = 2 and 4 also the compiled sides (issue 37 item 3): nvtp with ``compile="inductor"`` and
PyTorch's plan under ``torch.compile`` as torchtitan compiles a tensor-parallel model (each block,
after ``parallelize_module``; here the model is one block), each checked like the others, timed
in the same rounds, with the GEMM floor and the peak memory per rank beside each
(``harness.against_plans``).
"""

from __future__ import annotations

import os
import statistics

import pytest

from benchmarks.harness import Timing, against_plans, check_target, paired_ratio, record, run_ranks
from benchmarks.tp_worker import Job, worker

MESHES = [1, 2, 4]


def _run(job: Job) -> dict:
    return run_ranks(worker, job.d, job)


@pytest.mark.parametrize("d", MESHES, ids=lambda d: f"d{d}")
def test_tensor_parallel_step(benchmark, d, tmp_path, request):
    benchmark.group = "sharded gpt2 block, forward+backward step, CPU gloo mesh"
    job = Job(d=d, out=str(tmp_path / f"tp{d}.json"), threads=max(1, (os.cpu_count() or 1) // d), compiled=d >= 2)
    result = benchmark.pedantic(_run, args=(job,), rounds=1, iterations=1)
    timings = {n: Timing.of(s) for n, s in result["seconds"].items()}
    ratio = round(timings["nvtp"].median_ms / timings["dtensor"].median_ms, 3)
    plans = against_plans(result, ["dtensor", "dtensor_compiled"], 0.8) if job.compiled else None
    sent = {k: sum(c["sent_per_rank"] for c in result["nvtp_collectives"] if c["kind"] == k) for k in ("allreduce", "allgather", "reduce_scatter")}
    n = job.batch * job.seq * job.n_embd * 4  # one [b, s, e] fp32 activation
    data = record(
        f"sharded d={d}", nodeid=request.node.nodeid,
        kind="sharded", d=d, config={"n_embd": job.n_embd, "n_head": job.n_head, "seq": job.seq, "batch": job.batch, "dtype": "fp32",
                                     "threads_per_rank": job.threads, "rounds": job.rounds},
        timings=timings, ratios={"nvtp/dtensor": ratio},
        errors_vs_unsharded=result["errors"], first_call_seconds=result["first_call_seconds"],
        nvtp_collectives_per_step=[c["kind"] for c in result["nvtp_collectives"]],
        nvtp_bytes_sent_per_rank_per_step=round(sum(sent.values())),
        megatron_formula_bytes_per_rank_per_step=round(2 * 2 * 2 * (d - 1) / d * n),  # 2 all-reduces forward, 2 backward
        dtensor_collectives_per_step=result["dtensor_collectives"],
        # every collective DTensor runs on this block is an all-reduce of a [b, s, e] activation
        dtensor_bytes_sent_per_rank_per_step=round(result["dtensor_collectives"].get("all_reduce", 0) * 2 * (d - 1) / d * n),
        plans=plans, comparison=f"DTensor TP at d = {d}: TP block (hidden {job.n_embd}, seq {job.seq}), forward + backward",
    )
    benchmark.extra_info.update(data)
    # Every side must compute the unsharded block's numbers; a wrong result is no benchmark.
    assert all(e <= 1e-5 for e in result["errors"].values()), result["errors"]
    # At d = 2 and 4 (at d = 1 DTensor is plain eager: no target): neither nvtp mode slower than
    # DTensor, and issue 37's targets where they are met (0.8 against DTensor TP, compiled or not;
    # peak memory per rank at or below it); a miss is the known one (KNOWN_MISS).
    if d >= 2:
        for side in ("nvtp", "nvtp_inductor"):
            check_target(f"sharded d={d}: {side} / DTensor step time", paired_ratio(result["seconds"], "dtensor", of=side),
                         1.0, "x", own_threads=d * job.threads)
        for side in result["held_bytes"]:  # the memory a side keeps holds at least its parameters
            assert result["held_bytes"][side] >= result["param_bytes"][side], (side, result["held_bytes"], result["param_bytes"])
        if plans["misses"]:
            pytest.xfail(f"at d = {d}: {'; '.join(plans['misses'])}: {KNOWN_MISS}")


# Profiled 2026-11-24 (torch.profiler, rank 0, 3 steps at d = 2): both run the same matmuls (aten::mm +
# addmm 188 ms of nvtp's 311 ms and of DTensor's 310 ms); DTensor waited 53 ms in collectives, nvtp
# spent 86 ms interpreting its fusions op by op. Measured 2026-12-01 with the compiled sides
# (docs/benchmarks.md, "Against PyTorch's plans, compiled and not"): torch.compile of DTensor's block
# takes its step to 0.84-0.89x, level with nvtp's, so nvtp / compiled DTensor is about 1.0 for both
# nvtp modes. Memory: at the step's peak both hold the weight gradients (13.5-14.3 MiB at d = 2);
# nvtp's backward is one program, so every activation it saved stays live until it ends (aten::addmm
# 2.6 MiB: the q/k/v and MLP pre-activations, aten::gelu 1.5 MiB: the GELU recomputed, aten::add
# 2.3 MiB), where eager autograd frees each as its node runs.
KNOWN_MISS = ("time: with both compiled the step is the same matmuls and little else (see the GEMM floor), so 0.8 of "
              "compiled DTensor is below what the products leave; memory: nvtp's backward is one program holding every "
              "saved activation until it ends, where autograd frees each as its node runs (docs/benchmarks.md)")
