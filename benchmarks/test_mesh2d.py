"""2-D meshes: nvtp's GPT (hidden 256, 4 heads, 2 layers, sequence 128, vocabulary 256, fp32,
global batch 4) trained with plan megatron on 4 CPU gloo processes under the meshes (dp, tp) =
(2, 2), (1, 4) and (4, 1), side by side in one process group (``benchmarks/mesh2d_worker.py``):
step time (median over the steps after warm-up) and the bytes each rank sends per step on each
mesh axis, measured on the collectives. Ratios are against (1, 4), pure tensor parallelism;
(4, 1) is pure data parallelism (a tp axis of extent 1). Every mesh must train like one process
on the whole batch (losses within 1e-4), else its timing means nothing.

Expected bytes (ring algorithm; A = b·s·e·4 the rank's activation bytes, W the bytes of the
weights this rank holds): tp carries Megatron's 2 all-reduces a layer each way (plus the
vocabulary-parallel embedding's and the loss's); dp all-reduces every weight gradient,
2·W·(dp−1)/dp (DDP).
"""

from __future__ import annotations


import pytest

from benchmarks.harness import Estimate, Timing, record, run_ranks


def test_2d_mesh_step_time_and_bytes(benchmark, tmp_path, request, fsdp=False):
    from benchmarks.mesh2d_worker import Job, eager_losses, worker

    benchmark.group = "2-D meshes, GPT training step on 4 CPU gloo processes"
    job = Job(out=str(tmp_path / "mesh2d.json"), fsdp=fsdp)

    result = benchmark.pedantic(run_ranks, args=(worker, 4, job), rounds=1, iterations=1)
    want = eager_losses(job, job.warmup + job.rounds)
    for name, losses in result["losses"].items():  # a wrong result is no benchmark
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        assert worst <= 1e-4, (name, losses, want)
    base = "(1,4)"
    timings = {n: Timing.of(s) for n, s in result["seconds"].items()}
    ratios = {f"{n}/{base}": round(Estimate.of([a / b for a, b in zip(s, result["seconds"][base])]).value, 3)
              for n, s in result["seconds"].items() if n != base}
    sent = result["bytes_per_rank_per_step"]
    data = record("mesh2d " + ("fsdp" if fsdp else "ddp"), nodeid=request.node.nodeid, kind="mesh2d",
                  config={k: v for k, v in result["job"].items() if k != "out"}, timings=timings, ratios=ratios,
                  bytes_per_rank_per_step=sent, param_bytes_per_rank=result["param_bytes_per_rank"],
                  param_bytes_whole=result["param_bytes_whole"], compile_seconds=result["compile_seconds"],
                  summary=", ".join(f"{n}: {t.median_ms:.0f} ms, dp {sent[n]['dp'] / 2**10:.0f} KiB, tp {sent[n]['tp'] / 2**10:.0f} KiB"
                                    for n, t in timings.items()))
    benchmark.extra_info.update(data)
    # The bytes each axis carries, as the formulas say: no dp traffic on (1,4), no tp traffic on (4,1),
    # and DDP's dp all-reduce of every gradient: 2·W·(dp−1)/dp with W this rank's weight bytes.
    assert sent["(1,4)"]["dp"] == 0 and sent["(4,1)"]["tp"] == 0, sent
    for name, dp in (("(2,2)", 2), ("(4,1)", 4)):
        assert sent[name]["dp"] == pytest.approx(2 * result["param_bytes_per_rank"][name] * (dp - 1) / dp, rel=1e-3), (name, sent)
