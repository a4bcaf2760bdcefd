"""The sharding passes on what nvtp.jit shards for a deep model: GPT-3 at L layers (bf16, meta
tensors), its forward and backward spliced from one traced block (nvtp/frontend/regional.py), then
``shard`` and ``shard_backward`` (nvFuser target, d = 8). Prints the capture's line and the passes'
wall time, forward and backward, with each pass's share.

    .venv/bin/python tools/passes_depth.py 96 megatron      # then megatron-sp; one plan a process
"""

from __future__ import annotations

import sys, time, torch
from nvtp.models import gpt
from nvtp.frontend import regional
from nvtp.sharding.pipeline import shard, shard_backward
from nvtp.sharding.placements import DeviceMesh
L, plan = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "megatron"
cfg = gpt.config("gpt3", n_layer=L, dropout=0.0)
with torch.device("meta"):
    m = gpt.GPT(cfg).to(torch.bfloat16)
idx, tgt = (t.to("meta") for t in gpt.example_tokens(cfg))
c = regional.capture_regional(m, idx, tgt)
print(c.regional, len(c.forward.ops), "+", len(c.backward.ops), "ops")
import gc, os
if os.environ.get("NOGC"): gc.disable()
t = time.perf_counter()
f = shard(c.forward, plan, DeviceMesh.of_size(8))
t1 = time.perf_counter()
b = shard_backward(c.backward, f, "nvfuser")
t2 = time.perf_counter()
print(plan, L, "fwd", round(t1 - t, 2), "bwd", round(t2 - t1, 2), "total", round(t2 - t, 2))
for s in (f, b):
    print({k: round(v, 2) for k, v in getattr(s, "pass_seconds", getattr(s, "seconds", {})).items()})
