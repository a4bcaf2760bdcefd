"""nvtp against PyTorch's FSDP2 + TP on a Llama-style model at (dp, tp) = (2, 2) (issue 25, item 4).

``benchmarks/fsdp_tp_worker.py`` trains ``tests/complex_rotary.py``'s model (dim 256, 2 layers, 16
heads, SwiGLU hidden 704, vocabulary 512, sequence 64, global batch 4, fp32) on 4 CPU gloo
processes: nvtp (``plan="megatron-sp"``, ``fsdp=True``, its schedule on) and the plan of
pytorch/examples' ``fsdp_tp_example.py`` (``parallelize_module`` + ``fully_shard``), a whole step
each (forward, cross-entropy, backward, ``clip_grad_norm_``, AdamW) in interleaved rounds. Both
must train like one process on the whole batch (every loss within 1e-4) before a time counts.
Also the compiled sides (issue 37 item 3): nvtp with ``compile="inductor"`` and PyTorch's plan
with each block under ``torch.compile`` as torchtitan compiles FSDP2 + TP, in the same rounds, with
the GEMM floor and the peak memory per rank beside each (``harness.against_plans``).
Targets: nvtp / PyTorch at most 0.8, compiled or not; memory per rank at or below PyTorch's.
"""

from __future__ import annotations


import pytest

from benchmarks.harness import Timing, against_plans, check_target, paired_ratio, record, run_ranks


@pytest.mark.slow
def test_fsdp_tp_step_against_pytorch(benchmark, tmp_path, request):
    from benchmarks.fsdp_tp_worker import Job, eager_losses, worker

    benchmark.group = "FSDP + TP: Llama-style training step on (dp, tp) = (2, 2), 4 CPU gloo processes"
    job = Job(out=str(tmp_path / "fsdp_tp.json"), compiled=True)

    result = benchmark.pedantic(run_ranks, args=(worker, job.dp * job.tp, job), rounds=1, iterations=1)
    want = eager_losses(job, len(result["losses"]["nvtp"]))  # every step each side took
    for name, losses in result["losses"].items():  # a wrong result is no benchmark
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        assert worst <= 1e-4, f"{name} does not train like one process: worst loss error {worst:.2e}"
    timings = {n: Timing.of(s) for n, s in result["seconds"].items()}
    ratio = paired_ratio(result["seconds"], "pytorch")
    state, held = result["state_bytes"], result["held_bytes"]
    plans = against_plans(result, ["pytorch", "pytorch_compiled"], 0.8)
    data = record("FSDP + TP vs PyTorch", nodeid=request.node.nodeid, kind="fsdp_tp", config=result["job"], timings=timings,
                  ratios={"nvtp/pytorch": round(ratio.value, 3)}, state_bytes=state, plans=plans,
                  comparison=f"FSDP2 + TP at (2, 2): Llama-style (dim {job.dim}, {job.layers} layers), whole AdamW step",
                  summary=", ".join(f"{n} {t.median_ms:.0f} ms" for n, t in timings.items())
                  + f"; parameters + AdamW state per rank nvtp {state['nvtp'] / 2**20:.2f} MiB, PyTorch {state['pytorch'] / 2**20:.2f} MiB")
    benchmark.extra_info.update(data)
    assert state["nvtp"] <= state["pytorch"] * 1.001, f"nvtp holds more parameter and AdamW state than FSDP2 + TP per rank: {state}"
    for side in held:  # what a side keeps, measured, holds at least its counted parameters and AdamW state
        assert held[side] >= state[side], (side, held, state)
    # No slower than before the schedule's work by a margin (1.47x in issue 25), and 0.8 where met.
    for side in ("nvtp", "nvtp_inductor"):
        check_target(f"{side} / FSDP2 + TP step time at (2, 2)", paired_ratio(result["seconds"], "pytorch", of=side), 1.25, "x",
                     own_threads=job.dp * job.tp * job.threads)
    if plans["misses"]:
        pytest.xfail(f"{'; '.join(plans['misses'])}: {KNOWN_MISS}")


# Profiled 2026-11-24 (torch.profiler, rank 0, one whole step each): nvtp's 255 ms of CPU time were 106 ms
# interpreting its fusions op by op, 53 ms of DTensor dispatch in clip_grad_norm_ and AdamW, 12 ms of
# matmul; PyTorch's 321 ms were 124 ms waiting in collectives and 50 ms of DTensor dispatch. Measured
# 2026-12-01 with the compiled sides (docs/benchmarks.md, "Against PyTorch's plans, compiled and not"):
# matrix products are 3-6 % of every side's step; torch.compile of the blocks takes FSDP2 + TP to about
# 0.75x, as compile="inductor" takes nvtp; what is left on every side is per-op Python, DTensor
# dispatch in clip_grad_norm_ and AdamW, and gloo. Memory: nvtp held every gathered parameter and every
# weight gradient's reduce-scatter buffers at once (one 25 MiB bucket); since 2026-12-02 it gathers and
# reduce-scatters one block at a time, as FSDP2 does: 14.3 MiB a rank against FSDP2's 14.8, compiled 13.3.
KNOWN_MISS = ("time: the step is 3-6 % matrix products; compiled, both sides are left with per-op Python, DTensor dispatch "
              "in clip_grad_norm_ and AdamW, and gloo; memory: nvtp holds one block of gathered weights and the next, as "
              "FSDP2 does, but computes every block's weight gradients at the backward's end (Thunder's order); compiled "
              "FSDP2 + TP keeps 1-1.5 MiB less (docs/benchmarks.md)")
