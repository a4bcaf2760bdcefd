"""The plan of nvtp's GPT on a cp axis of 1, 2, 4 and 8: activations per rank, the ring's steps,
the collectives (docs/context.md). One trace, sharded by the driver for each mesh; nothing runs.

    .venv/bin/python tools/cp_plan.py [--seq 256] [--layers 2]
"""

from __future__ import annotations

import argparse

from nvtp import driver
from nvtp.models.gpt import GPT, config, example_tokens
from nvtp.sharding.placements import DeviceMesh


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    cfg = config("tiny", seq_len=args.seq, n_layer=args.layers, batch=2)
    model = GPT(cfg)
    traced = driver.trace(model, example_tokens(cfg), ring=True)
    for cp in (1, 2, 4, 8):
        program = driver.shard(traced, "megatron", DeviceMesh.of_shape((cp,), ("cp",)))
        mem = program.report().memory_per_rank()
        ring = [s for s in program.steps() if s.kind == "sendrecv"]
        other = [s for s in program.steps() if s.is_communication and s.kind != "sendrecv"]
        print(f"cp={cp}: activations {mem['activations'] / 1024:.1f} KiB, peak {mem['peak_activations'] / 1024:.1f} KiB per rank; "
              f"ring {len(ring)} sendrecv ({sum(s.bytes for s in ring) / 1024:.1f} KiB per rank); "
              f"{len(other)} collectives ({sum(s.bytes for s in other) / 1024:.1f} KiB per rank: {', '.join(sorted({s.kind for s in other})) or 'none'})")


if __name__ == "__main__":
    main()
