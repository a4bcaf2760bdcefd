"""Generation: a model's own ``generate`` (greedy, 32 new tokens after a prompt of 8) sharded by nvtp
on a CPU gloo mesh of 2 processes, against the unsharded model's ``generate`` in eager PyTorch
(``benchmarks/generate_worker.py``): transformers' ``model.generate`` of a small Llama (hidden 64,
4 heads, 2 layers, vocabulary 256, fp32), and karpathy's nanoGPT (as Thunder ships it) of the same
size with its ``generate(idx, 32, top_k=1)``.

Reported: tokens per second of the whole call (tracing included: what a user waits for) and of
the tokens after the first three lengths (each further length derived, not traced:
``nvtp.frontend.lengths``), and eager's. No target: on CPU the reference backend runs each new
length's program once, so it is far slower than eager at this size; the figure says how far, and
that a token costs a fraction of a second rather than a trace."""

from __future__ import annotations

import os

import pytest

from benchmarks.harness import record, run_ranks


@pytest.mark.parametrize("model", ["llama", "nanogpt"])
def test_generate_tokens_per_second(benchmark, tmp_path, request, model):
    from benchmarks.generate_worker import Job, worker

    if model == "llama":
        pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")
    benchmark.group = f"generate: {model}, 32 new tokens, CPU gloo mesh of 2"
    job = Job(d=2, out=str(tmp_path / "generate.json"), threads=max(1, (os.cpu_count() or 1) // 2), model=model)

    result = benchmark.pedantic(run_ranks, args=(worker, job.d, job), rounds=1, iterations=1)
    assert result["same_tokens"], "nvtp's generate gave other tokens than eager's"
    later = result["steps"][result["traced"]:]
    data = record(f"generate {model} d=2", nodeid=request.node.nodeid, kind="generate", d=job.d, config=result["job"],
                  tokens_per_second={"nvtp_whole_call": round(job.tokens / result["nvtp_seconds"], 3),
                                     "nvtp_derived_lengths": round(len(later) / sum(later), 3) if later else None,
                                     "eager": round(job.tokens / result["eager_seconds"], 3)},
                  seconds={"nvtp": round(result["nvtp_seconds"], 2), "eager": round(result["eager_seconds"], 3),
                           "traced_steps": [round(s, 2) for s in result["steps"][:result["traced"]]]},
                  lengths={"traced": result["traced"], "derived": result["derived"]})
    benchmark.extra_info.update(data)
    print(data)
