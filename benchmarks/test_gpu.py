"""GPU: the GPT-3 layer (``fusions/nanogpt_gpt3_bf16_{fwd,bwd}.py``: hidden 12288, 96 heads,
sequence 2048, bf16) through nvtp's nvFuser backend, forward and backward, on one GPU and
sharded by nvtp (plan megatron) over every GPU of the job, in the form of NVIDIA/Fuser's
tests/python/multidevice/test_transformer.py benchmarks (definition built once, one warm-up
run, then ``benchmark.pedantic`` over synchronised executions).

    mpirun -np N .venv/bin/python -m pytest benchmarks/test_gpu.py    # one process per GPU

nvFuser's Communicator reads the rank and world size mpirun (or torchrun) sets. Without a CUDA
GPU every case skips, saying so; this project has no GPU yet, so these have not run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="nvFuser executes only on CUDA GPUs and torch sees none here; run `mpirun -np N pytest "
                              "benchmarks/test_gpu.py` on a machine with N GPUs"),
]


def _world() -> tuple[int, int, int]:
    """(size, rank, local rank) of the job nvFuser's Communicator sees (1, 0, 0 without mpirun)."""
    import nvfuser_direct

    comm = nvfuser_direct.multidevice.Communicator.instance()
    return comm.size(), comm.rank(), comm.local_rank()


def _program(direction: str, layout: str, d: int, rank: int):
    """The fusion to run on this rank, its nvFuser definition, this rank's inputs (on its GPU)
    and the (shape, dtype) each output must have on this rank (its shard when sharded)."""
    from nvtp import dump
    from nvtp.dump.sharded import format_sharded
    from nvtp.execute import spmd
    from nvtp.execute.nvfuser import build_definition, prepare_inputs
    from nvtp.ir.parser import parse
    from nvtp import driver
    from nvtp.sharding.placements import DeviceMesh, local_shape

    fwd = dump.load(ROOT / "fusions/nanogpt_gpt3_bf16_fwd.py").fusion
    bwd = dump.load(ROOT / "fusions/nanogpt_gpt3_bf16_bwd.py").fusion
    device = torch.device("cuda", torch.cuda.current_device())
    if layout == "single":
        fusion = fwd if direction == "forward" else bwd
        whole = dump.random_inputs(fusion, seed=0)
        expected = [(tuple(v.shape), v.dtype.torch) for v in fusion.outputs]
        return fusion, build_definition(fusion), prepare_inputs(fusion, whole, device), expected
    program = driver.shard(driver.of_fusions(fwd, bwd), "megatron", DeviceMesh.of_size(d), "nvfuser")  # partial sums resolved where made
    sf, sb = program.forward, program.backward
    sharded = sf if direction == "forward" else sb
    dumped = parse(format_sharded(sharded, []))
    whole = dump.random_inputs(sharded.source, seed=0)  # the same on every rank; each keeps its shards
    local = [x.to(device).contiguous() if isinstance(x, torch.Tensor) else x for x in spmd.local_inputs(sharded, whole, rank)]
    expected = [(tuple(local_shape(v.shape, sharded.shardings[v.name], sharded.mesh)), v.dtype.torch) for v in sharded.fusion.outputs]
    return sharded.fusion, build_definition(dumped.fusion, dumped.schedule), local, expected


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_gpt3_layer(benchmark, direction, layout):
    d, rank, local_rank = _world()
    if layout == "sharded" and d < 2:
        pytest.skip("the sharded case needs 2+ processes, one per GPU: mpirun -np N pytest benchmarks/test_gpu.py")
    torch.cuda.set_device(local_rank)
    fusion, fd, inputs, expected = _program(direction, layout, d, rank)

    def run():
        outs = fd.execute(inputs)
        torch.cuda.synchronize()
        return outs

    outs = run()  # compiles the kernels; validate shapes and dtypes as Fuser's benchmarks do
    assert len(outs) == len(fusion.outputs) == len(expected)
    for v, out, (shape, dtype) in zip(fusion.outputs, outs, expected):
        assert (tuple(out.shape), out.dtype) == (shape, dtype), f"{v.name}: {out.dtype}{list(out.shape)}, expected {dtype}{list(shape)}"
    benchmark.group = f"gpt3 layer {direction} on GPU ({layout}, {d if layout == 'sharded' else 1} device(s))"
    benchmark.extra_info.update({"direction": direction, "layout": layout, "devices": d if layout == "sharded" else 1, "rank": rank,
                                 "gpu": torch.cuda.get_device_name(), "mpi_world": os.environ.get("OMPI_COMM_WORLD_SIZE")})
    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
