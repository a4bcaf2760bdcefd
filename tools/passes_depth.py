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

from nvtp.frontend import regional
from nvtp.models import gpt
from nvtp.sharding.pipeline import shard, shard_backward
from nvtp.sharding.placements import DeviceMesh


def main(layers: int, plan: str) -> None:
    cfg = gpt.config("gpt3", n_layer=layers, dropout=0.0)
    with torch.device("meta"):
        model = gpt.GPT(cfg).to(torch.bfloat16)
    idx, tgt = (t.to("meta") for t in gpt.example_tokens(cfg))
    captured = regional.capture_regional(model, idx, tgt)
    print(captured.regional, len(captured.forward.ops), "+", len(captured.backward.ops), "ops")
    start = time.perf_counter()
    fwd = shard(captured.forward, plan, DeviceMesh.of_size(8))
    middle = time.perf_counter()
    bwd = shard_backward(captured.backward, fwd, "nvfuser")
    end = time.perf_counter()
    print(plan, layers, "fwd", round(middle - start, 2), "bwd", round(end - middle, 2), "total", round(end - start, 2))
    for sharded in (fwd, bwd):
        print({k: round(v, 2) for k, v in sharded.seconds.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 96, sys.argv[2] if len(sys.argv) > 2 else "megatron")
