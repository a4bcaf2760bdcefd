"""Communication: bytes each rank sends per GPT-3 layer, forward and backward, for plans
megatron and megatron-sp, next to the Megatron papers' formula (ring algorithm: an all-reduce
sends 2(d-1)/d N, an all-gather or a reduce-scatter (d-1)/d N, N the whole tensor's bytes).

Megatron-LM (Shoeybi et al. 2019; Korthikanti et al. 2022, arXiv 2205.05198), per layer with
A = b·s·h activation bytes:
  megatron    forward 2 all-reduces of A, backward 2 all-reduces of A
  megatron-sp forward 2 all-gathers + 2 reduce-scatters of A; backward 2 reduce-scatters of the
              input gradients, 2 all-gathers of the output gradients and 2 all-gathers re-gathering
              the LayerNorm outputs the weight gradients need (Megatron-LM saves them sharded),
              plus all-reduces of the sequence-parallel parameters' gradients (2 LayerNorms'
              weight and bias, the 2 row-parallel biases: 6 of h elements, in float32: the
              fusion reduces the float32 sums before casting to bf16, as Megatron-LM reduces
              fp32 main gradients).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness import record

ROOT = Path(__file__).resolve().parents[1]


def megatron_formula(plan: str, d: int, b: int, s: int, h: int, itemsize: int) -> dict[str, float]:
    a = b * s * h * itemsize
    ring = (d - 1) / d
    if plan == "megatron":
        return {"forward": 2 * 2 * ring * a, "backward": 2 * 2 * ring * a}
    return {"forward": (2 + 2) * ring * a, "backward": (2 + 2 + 2) * ring * a + 6 * 2 * ring * h * 4}


@pytest.fixture(scope="module")
def gpt3():
    from nvtp import dump

    return (dump.load(ROOT / "fusions/nanogpt_gpt3_bf16_fwd.py").fusion, dump.load(ROOT / "fusions/nanogpt_gpt3_bf16_bwd.py").fusion)


@pytest.mark.parametrize("d", [2, 4, 8], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
def test_bytes_per_rank_per_layer(benchmark, gpt3, plan, d, request):
    from nvtp import driver
    from nvtp.sharding.placements import DeviceMesh

    benchmark.group = "communication: gpt3 layer, bytes per rank"
    fwd, bwd = gpt3
    program = benchmark.pedantic(driver.shard, args=(driver.of_fusions(fwd, bwd), plan, DeviceMesh.of_size(d), "nvfuser"),
                                 rounds=1, iterations=1)
    sf, sb = program.forward, program.backward
    x = fwd.inputs[0]  # the [b, s, h] activation
    b, s, h = x.shape
    want = megatron_formula(plan, d, b, s, h, x.dtype.itemsize)
    got = {name: sum(c.bytes for c in sh.communications) for name, sh in (("forward", sf), ("backward", sb))}
    kinds = {name: sorted(c.kind for c in sh.communications) for name, sh in (("forward", sf), ("backward", sb))}
    data = record(f"communication {plan} d={d}", nodeid=request.node.nodeid, kind="communication", plan=plan, d=d, shape=[b, s, h], dtype=str(x.dtype),
                  bytes_per_rank=got, megatron_formula=want, collectives=kinds,
                  summary=f"forward {got['forward'] / 2**20:.1f} MiB (formula {want['forward'] / 2**20:.1f}), "
                          f"backward {got['backward'] / 2**20:.1f} MiB (formula {want['backward'] / 2**20:.1f})")
    benchmark.extra_info.update(data)
    assert got == {k: round(v) for k, v in want.items()}, (got, want)
