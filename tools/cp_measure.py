"""Context parallelism against one process: the largest loss and weight errors of a few cp meshes
(GPT with tp, transformers models), on simulated ranks, by tests/test_context.py's ``train``.

    .venv/bin/python tools/cp_measure.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_context import train, spmd, _placements
from nvtp.models import gpt, hf
from nvtp.sharding.placements import DeviceMesh
def errs(got, want, ranks, ref, mesh):
    l = max(abs(a-b) for a,b in zip(got,want))
    w = 0
    for name, p in ref.named_parameters():
        placement = _placements(ranks[0].placement(name))
        parts = [dict(m.module.named_parameters())[name].detach() for m in ranks]
        whole = spmd.assemble(parts, placement, p.shape, mesh)
        w = max(w, (whole - p.detach()).abs().max().item())
    return l, w
CFG = gpt.config("tiny")
for shape, names, plan in [((2,2),("cp","tp"),"megatron-sp"), ((4,2),("cp","tp"),"megatron-sp"), ((2,2,2),("dp","cp","tp"),"megatron-sp")]:
    torch.manual_seed(0)
    mesh = DeviceMesh.of_shape(shape, names)
    r = train(gpt.GPT(CFG), mesh, gpt.example_tokens(CFG), 5, plan=plan)
    print("gpt", shape, names, plan, "loss err %.2e weight err %.2e" % errs(*r[:4], mesh), flush=True)
for shape, names, plan in [((2, 2), ("dp", "cp"), "megatron"), ((2, 2, 2), ("dp", "cp", "tp"), "megatron-sp")]:
    torch.manual_seed(0)
    mesh = DeviceMesh.of_shape(shape, names)
    r = train(gpt.GPT(CFG), mesh, gpt.example_tokens(CFG), 4, plan=plan, fsdp=True)
    print("gpt fsdp", shape, names, plan, "loss err %.2e weight err %.2e" % errs(*r[:4], mesh), flush=True)
for fam, shape, names, plan in [("llama",(2,),("cp",),"megatron"), ("llama",(2,2),("cp","tp"),"megatron-sp"), ("gpt2",(2,),("cp",),"megatron"), ("qwen2",(4,),("cp",),"megatron")]:
    ids = hf.batch(0)
    mesh = DeviceMesh.of_shape(shape, names)
    r = train(hf.build(fam), mesh, (ids,), 3, plan=plan, loss_of=lambda o: o.loss, kwargs={"labels": ids})
    print(fam, shape, names, plan, "loss err %.2e weight err %.2e" % errs(*r[:4], mesh), "losses", [round(x,4) for x in r[0]], flush=True)
