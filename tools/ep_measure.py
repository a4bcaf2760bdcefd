"""The expert-parallel figures of docs/moe.md: nvtp's MoE GPT and transformers' Mixtral on meshes
with an "ep" axis, simulated ranks (threads of one process), against the unsharded model in eager
PyTorch on one process.

    .venv/bin/python tools/ep_measure.py            # every mesh, both models
    .venv/bin/python tools/ep_measure.py mixtral    # one model

For each mesh: one forward and backward (every rank passes the whole batch of 4; dp ranks their
halves): the worst relative error of the loss, the logits and any gradient (every expert's); then
the all-to-all bytes a rank sent in a second step against its Program's steps. The MoE GPT's layer 0
routes every token to the same two experts (both on ep rank 0); its reference runs its experts
by gathering each row's weight (``tests/test_ep.py: naive_experts``); Mixtral's is transformers'
own experts implementation (with the load-balancing loss).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nvtp  # noqa: E402
from nvtp.dump import relative_error  # noqa: E402
from nvtp.execute import ep as ep_run  # noqa: E402
from nvtp.execute import spmd  # noqa: E402
from nvtp.sharding.placements import DeviceMesh  # noqa: E402
from tests.test_ep import eager, moe_gpt  # noqa: E402
from tests.test_moe import build  # noqa: E402

MESHES = [((2,), ("ep",)), ((4,), ("ep",)), ((2, 2), ("dp", "ep")), ((2, 2), ("ep", "tp"))]


def _part(t: torch.Tensor, mesh: DeviceMesh, pos: int) -> torch.Tensor:
    if "dp" not in mesh.names:
        return t
    dp, k = mesh.shape[mesh.names.index("dp")], mesh.coords(pos)[mesh.names.index("dp")]
    n = t.shape[0] // dp
    return t[k * n:(k + 1) * n]


def measure(name: str, shape, names) -> str:
    start = time.perf_counter()
    mesh = DeviceMesh.of_shape(shape, names)
    if name == "moe_gpt":
        model, (idx, targets) = moe_gpt()
        ref, args, kwargs = eager(model), lambda p: (_part(idx, mesh, p), _part(targets, mesh, p)), lambda p: {}
        outputs = lambda out: (out[1], out[0])  # noqa: E731 - (loss, logits)
    else:
        model = build("mixtral", output_router_logits=True)
        ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))
        ref, args, kwargs = copy.deepcopy(model), lambda p: (_part(ids, mesh, p),), lambda p: {"labels": _part(ids, mesh, p)}
        outputs = lambda out: (out.loss, out.logits)  # noqa: E731
    threads = spmd.ThreadMesh(mesh, timeout=300)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=mesh, comm=threads.comm(r)) for r in range(mesh.size)]
    ranks[0].compile(*args(0), **kwargs(0))
    for m in ranks[1:]:
        m.share_compiled(ranks[0])

    def step(p):
        loss, logits = outputs(ranks[p](*args(p), **kwargs(p)))
        loss.backward()
        return loss.detach(), logits.detach()

    got = spmd.on_threads(step, threads)
    grads = [{n: p.grad.clone() for n, p in m.module.named_parameters()} for m in ranks]
    with ep_run.recording() as sent:  # a second step: the first call also runs nvtp.jit's first-call check (nvtp.guard)
        spmd.on_threads(step, threads)
    whole = (idx, targets) if name == "moe_gpt" else (ids,)
    want_loss, want_logits = outputs(ref(*whole, **({} if name == "moe_gpt" else {"labels": ids})))
    want_loss.backward()
    loss = max(relative_error(g[0], want_loss.detach())[0] for g in got)  # every rank the whole batch's loss (dp's: nvtp.jit's)
    logits = max(relative_error(g[1], _part(want_logits.detach(), mesh, p))[0] for p, g in enumerate(got))
    grad = 0.0
    for n, p in ref.named_parameters():
        grad = max(grad, relative_error(spmd.assemble([g[n] for g in grads], ranks[0].placement(n), p.shape, mesh), p.grad)[0])
    planned = [(s.tensor, s.bytes) for s in ranks[0].last.steps() if s.kind == "alltoall"] * mesh.size
    same = "equal" if sorted(sent) == sorted(planned) else f"DIFFER ({sum(b for _, b in sent)} sent, {sum(b for _, b in planned)} planned)"
    per_rank = sum(b for _, b in sent) // mesh.size
    label = ", ".join(f"{n} {k}" for n, k in zip(names, shape))
    return (f"| {name} | ({label}) | {loss:.1e} | {logits:.1e} | {grad:.1e} | {per_rank} B, {same} | "
            f"{time.perf_counter() - start:.0f} s |")


def main(argv: list[str]) -> None:
    models = argv or ["moe_gpt", "mixtral"]
    print("| model | mesh | loss | logits | worst gradient | all-to-all bytes a rank sent (vs Program.steps()) | time |")
    print("|---|---|---|---|---|---|---|")
    for name in models:
        for shape, names in MESHES:
            print(measure(name, shape, names), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
