"""Expert parallelism (issue 35, item 4): nvtp's MoE GPT (hidden 64, 4 experts, top-2, expert width
128, 2 layers, vocabulary 256, fp32, global batch 8 x 32 tokens, SGD) at ep = 2 on 2 CPU gloo
processes, against a hand-written all-to-all expert parallelism in plain PyTorch (the torchtitan
recipe: split sizes read by the host, ``all_to_all_single`` with autograd) and the unsharded model,
interleaved in the same processes (``benchmarks/ep_worker.py``): step time (median over the steps
after warm-up) and the all-to-all bytes a rank sends per step, against the analytical volume of
the routed rows. Every implementation must train like the unsharded model (losses within 1e-5).
"""

from __future__ import annotations


from benchmarks.harness import Estimate, Timing, record, run_ranks


def test_ep_step_time_and_alltoall_bytes_against_a_hand_written_ep(benchmark, tmp_path, request):
    from benchmarks.ep_worker import IMPLS, Job, worker

    benchmark.group = "expert parallelism, MoE GPT training step at ep=2 on 2 CPU gloo processes"
    job = Job(out=str(tmp_path / "ep.json"))

    result = benchmark.pedantic(run_ranks, args=(worker, 2, job), rounds=1, iterations=1)
    want = result["losses"]["unsharded"]
    for name in IMPLS:  # a wrong result is no benchmark
        got = result["losses"][name]
        assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5, (name, got, want)
    timings = {n: Timing.of(s) for n, s in result["seconds"].items()}
    base = "hand-written"
    ratios = {f"{n}/{base}": round(Estimate.of([a / b for a, b in zip(s, result["seconds"][base])]).value, 3)
              for n, s in result["seconds"].items() if n != base}
    sent = result["alltoall_bytes_per_rank_per_step"]
    assert sent["nvtp"] == sent["nvtp planned"], sent  # what a step sends is what the program plans
    data = record("ep alltoall", nodeid=request.node.nodeid, kind="ep", config={k: v for k, v in result["job"].items() if k != "out"},
                  timings=timings, ratios=ratios, alltoall_bytes_per_rank_per_step=sent, compile_seconds=result["compile_seconds"],
                  summary=", ".join(f"{n}: {t.median_ms:.0f} ms" for n, t in timings.items()) + "; " +
                  ", ".join(f"{k} {v / 2**10:.0f} KiB" for k, v in sent.items()))
    benchmark.extra_info.update(data)
    print(data["summary"], ratios)
