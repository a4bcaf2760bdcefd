"""transformers families on a pipeline of gloo processes, against eager on one process:

    torchrun --nproc-per-node 2 tools/pp_families.py gemma2 gpt2 opt     # pp=2, one line each
    torchrun --nproc-per-node 4 tools/pp_families.py --mesh 2x2 cohere   # (pp, tp) = (2, 2)

Each family is built as ``tools/hf_families.py`` builds it (a tiny config, seeded, nothing
downloaded), wrapped unmodified with ``nvtp.jit(model, mesh=<(pp[, tp]) mesh>, microbatches=2)``
and called as transformers users call it, ``model(ids, labels=ids).loss``; 2 SGD steps. Rank 0
trains the same model in eager PyTorch and prints one JSON line per family: every loss's relative
difference and every final weight's difference against the weight scale of the whole model (a
gradient that is zero in exact arithmetic, a key projection's bias, moves a zero-initialised bias by
rounding noise, whose difference relative to that bias means nothing). PASS: losses within 1e-5,
weights within 1e-5 of the largest weight.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).parent))
from hf_families import build, families  # noqa: E402 - the sweep's own builder, beside this tool

import nvtp  # noqa: E402


def _batches(steps: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 16), generator=g) for _ in range(steps)]


def _train(model, params) -> list[float]:
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    for ids in _batches():
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check(family: str, mesh) -> dict:
    record = {"family": family, "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape))}
    try:
        classes = dict(families())
        model = build(family, classes[family])
        record["tied"] = len(dict(model.named_parameters(remove_duplicate=False))) != len(dict(model.named_parameters()))
        sharded = nvtp.jit(model, mesh=mesh, microbatches=2)
        got = _train(sharded, sharded.parameters())
        whole = sharded.full_parameters()
        eager = build(family, classes[family])
        want = _train(eager, eager.parameters())
        scale = max(float(p.detach().abs().max()) for p in eager.parameters())
        loss = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        weight = max(float((whole[n] - p.detach()).abs().max()) for n, p in eager.named_parameters()) / scale
        record |= {"result": "PASS" if loss <= 1e-5 and weight <= 1e-5 else "DIFF", "loss": loss, "weight": weight}
    except Exception as e:  # noqa: BLE001 - the record says what failed
        record |= {"result": "FAIL", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return record


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("families", nargs="+")
    p.add_argument("--mesh", default="2", help="pp, or PPxTP")
    args = p.parse_args()
    dist.init_process_group("gloo")
    sizes = tuple(int(k) for k in args.mesh.split("x"))
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("pp", "tp")[:len(sizes)])
    failed = False
    for family in args.families:
        record = check(family, mesh)
        failed |= record["result"] != "PASS"
        if dist.get_rank() == 0:
            print(json.dumps(record), flush=True)
    dist.destroy_process_group()
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
