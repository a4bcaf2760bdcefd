"""The figures of docs/moe.md: each MoE family and experts implementation on simulated meshes,
against the unsharded eager model (one process, transformers' own experts implementation).

    .venv/bin/python tools/moe_measure.py                 # every family, both implementations
    .venv/bin/python tools/moe_measure.py mixtral eager   # one

For each: tp=2 (megatron), one step on a batch after which an expert of some layer gets no token:
the worst relative error of the loss, the logits and any gradient (every expert's); and
(dp, tp) = (2, 1) with the load-balancing loss, 2 SGD steps: the worst relative error of a loss
and of a final weight. Simulated ranks (threads of one process), fp32, tiny configs
(tests/test_moe.py ``build``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_hf import Mesh, check_parity  # noqa: E402
from tests.test_moe import FAMILIES, build, routed, tokens_leaving_an_expert_idle, train_simulated  # noqa: E402


def measure(family: str, implementation: str | None) -> str:
    start = time.perf_counter()
    model = build(family, implementation)
    ids = tokens_leaving_an_expert_idle(model, (2, 4))
    idle = sum(int((c == 0).sum()) for c in routed(model, ids))
    tp = check_parity(model, Mesh(model, 2, "megatron", ids, labels=ids), ids)
    model = build(family, implementation, output_router_logits=True)
    batch = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))
    got, want, worst, _ = train_simulated(model, (2, 1), ("dp", "tp"), (batch,))
    loss = max(abs(a - b) / abs(b) for losses in got for a, b in zip(losses, want))
    return (f"| {family} | {implementation or 'grouped_mm (default)'} | {tp['loss']:.1e} | {tp['logits']:.1e} | {tp['grad']:.1e} "
            f"| {idle} | {loss:.1e} | {worst:.1e} | {time.perf_counter() - start:.0f} s |")


def main(argv: list[str]) -> None:
    families = argv[:1] or list(FAMILIES)
    implementations = [None if argv[1] == "default" else argv[1]] if len(argv) > 1 else [None, "eager"]
    print("| family | experts implementation | tp=2 loss | tp=2 logits | tp=2 worst gradient | idle (layer, expert) pairs "
          "| (2, 1) worst loss | (2, 1) worst weight | time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for family in families:
        for implementation in implementations:
            print(measure(family, implementation), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
