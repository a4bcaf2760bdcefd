"""nvtp.jit at depth: compile and first step of GPT-2 small's GPT at L layers on a simulated
mesh of 2 ranks (ranks as threads, real weights, fp32, CPU), and its all-reduces per step.

    .venv/bin/python tools/jit_depth.py 1        # then 12: issue 14's "within 1.5x of 1 layer"
    .venv/bin/python tools/jit_depth.py 12 --whole   # every block traced (nvtp.jit(..., regional=False))
    .venv/bin/python tools/jit_depth.py 12 --seq 128 # a shorter sequence (GPT-2's is 1024)
    .venv/bin/python tools/jit_depth.py 12 --three   # the splice of a 3-block trace (regional's fallback)
    .venv/bin/python tools/jit_depth.py 12 --steps 3 # and two more steps: is the first step's time the arithmetic?

Prints one line: compile (trace + sharding, on rank 0; rank 1 takes the programs), the first
forward+backward step of both ranks, the all-reduces of the sharded forward and backward, and
how the fusions were made (spliced from one traced block, or from a trace of 3, or traced whole and why);
with ``--steps N``, then the time of each later step.
"""

from __future__ import annotations

import copy
import sys
import time

import torch

import nvtp
from nvtp.execute import spmd
from nvtp.execute.collectives import ThreadComm, ThreadGroup
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh


def main(layers: int, regional: bool = True, seq: int | None = None, template: bool = True, steps: int = 1) -> None:
    cfg = gpt.config("gpt2", n_layer=layers, dropout=0.0, **({"seq_len": seq} if seq else {}))
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    idx, tgt = gpt.example_tokens(cfg)
    group = ThreadGroup(2, timeout=600)
    ranks = [nvtp.jit(model if r == 0 else copy.deepcopy(model), plan="megatron", mesh=DeviceMesh.of_size(2),
                      comm=ThreadComm(group, r), regional=regional) for r in range(2)]
    if not template:
        from nvtp.frontend import regional as splicing
        real = splicing.capture_regional
        splicing.capture_regional = lambda *a, **k: real(*a, template=False, **k)
    start = time.perf_counter()
    ranks[0].compile(idx, tgt)
    ranks[1].share_compiled(ranks[0])
    compiled = time.perf_counter()
    spmd.on_threads(lambda r: ranks[r](idx, tgt).backward(), group)
    stepped = time.perf_counter()
    c = ranks[0].last
    fwd, bwd = ([s.kind for s in f.communications].count("allreduce") for f in (c.forward, c.backward))
    print(f"layers {layers}: compile {compiled - start:.1f} s, first step {stepped - compiled:.1f} s, total {stepped - start:.1f} s; "
          f"all-reduces forward {fwd}, backward {bwd} (sequence {cfg.seq_len}, batch {cfg.batch}); "
          f"{c.traced.how}")
    for k in range(1, steps):
        start = time.perf_counter()
        spmd.on_threads(lambda r: ranks[r](idx, tgt).backward(), group)
        print(f"step {k + 1}: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    args = sys.argv[1:]
    seq = int(args[args.index("--seq") + 1]) if "--seq" in args else None
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 1
    numbers = [a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or args[i - 1] not in ("--seq", "--steps"))]
    main(int(numbers[0]) if numbers else 1, regional="--whole" not in args, seq=seq, template="--three" not in args, steps=steps)
