"""One rank of tests/test_context.py's torchrun case: nvtp's GPT on a ("cp",) mesh of gloo processes."""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import nvtp
from nvtp.execute import ring
from nvtp.models import gpt


def main(out: str) -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    cfg = gpt.config("tiny")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    eager = copy.deepcopy(model)
    sm = nvtp.jit(model, plan="megatron", mesh=mesh)
    idx, tgt = gpt.example_tokens(cfg)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (sm, eager)]
    losses, want = [], []
    with ring.recording() as sent:
        for _ in range(3):
            for m, opt, into in ((sm, opts[0], losses), (eager, opts[1], want)):
                opt.zero_grad()
                loss = m(idx, tgt)
                loss.backward()
                opt.step()
                into.append(loss.item())
    err = max((nvtp.full_tensor(p).detach() - q.detach()).abs().max().item()
              for p, q in zip(sm.module.parameters(), eager.parameters()))
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "eager": want, "weight_error": err, "sendrecv": len(sent), "planned": len([s for s in sm.last.steps() if s.kind == "sendrecv"])}, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
