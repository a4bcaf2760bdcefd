"""The sharding passes on what nvtp.jit shards for a deep model: GPT-3 at L layers (bf16, meta
tensors), its forward and backward spliced from one traced block (nvtp/frontend/regional.py), then
``shard`` and ``shard_backward`` (nvFuser target, d = 8). Prints the capture's line and the passes'
wall time, forward and backward, with each pass's share.

    .venv/bin/python tools/passes_depth.py 96 megatron      # then megatron-sp; one plan a process
"""

from __future__ import annotations

import sys
import time

import torch

from nvtp import driver
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh


def main(layers: int, plan: str) -> None:
    cfg = gpt.config("gpt3", n_layer=layers, dropout=0.0)
    with torch.device("meta"):
        model = gpt.GPT(cfg).to(torch.bfloat16)
    idx, tgt = (t.to("meta") for t in gpt.example_tokens(cfg))
    traced = driver.trace(model, (idx, tgt))
    print(traced.how, len(traced.forward.ops), "+", len(traced.backward.ops), "ops")
    start = time.perf_counter()
    program = driver.shard(traced, plan, DeviceMesh.of_size(8), "nvfuser")
    end = time.perf_counter()
    print(plan, layers, "total", round(end - start, 2))
    for sharded in (program.forward, program.backward):
        print({k: round(v, 2) for k, v in sharded.seconds.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 96, sys.argv[2] if len(sys.argv) > 2 else "megatron")
