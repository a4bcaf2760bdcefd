"""One rank of tests/test_context.py's torchrun cases: nvtp's GPT on a ("cp",) mesh of gloo processes,
or (``dp,cp --fsdp``) on a ("dp", "cp") mesh with the weights split over dp x cp, each dp rank its
half of the batch.

    torchrun --nproc-per-node 2 tests/cp_worker.py OUT                 # ("cp",)
    torchrun --nproc-per-node 4 tests/cp_worker.py OUT dp,cp --fsdp    # ("dp", "cp") = (2, 2)
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import nvtp
from nvtp.dtensor import local
from nvtp.execute import ring
from nvtp.models import gpt


def main(out: str, names: tuple[str, ...] = ("cp",), fsdp: bool = False) -> int:
    dist.init_process_group("gloo")
    shape = (dist.get_world_size(),) if len(names) == 1 else (2, dist.get_world_size() // 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    cfg = gpt.config("tiny")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    eager = copy.deepcopy(model)
    sm = nvtp.jit(model, plan="megatron", mesh=mesh, fsdp=fsdp, verify=False)  # the check's ring steps are not the steps counted
    idx, tgt = gpt.example_tokens(cfg)
    mine = (idx, tgt)
    if "dp" in names:  # each dp rank passes its half of the batch
        d = mesh.get_local_rank("dp")
        mine = tuple(t[d * t.shape[0] // 2:(d + 1) * t.shape[0] // 2] for t in (idx, tgt))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (sm, eager)]
    losses, want = [], []
    with ring.recording() as sent:
        for _ in range(3):
            for m, opt, into, args in ((sm, opts[0], losses, mine), (eager, opts[1], want, (idx, tgt))):
                opt.zero_grad()
                loss = m(*args)
                loss.backward()
                opt.step()
                into.append(loss.item())
    err = max((nvtp.full_tensor(p).detach() - q.detach()).abs().max().item()
              for p, q in zip(sm.module.parameters(), eager.parameters()))
    if dist.get_rank() == 0:
        held = sum(local(p).numel() for p in sm.module.parameters()) / sum(p.numel() for p in eager.parameters())
        torch.save({"losses": losses, "eager": want, "weight_error": err, "sendrecv": len(sent), "held": held,
                    "planned": len([s for s in sm.last.steps() if s.kind == "sendrecv"])}, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("cp",), "--fsdp" in sys.argv))
