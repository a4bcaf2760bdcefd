"""2-D meshes: data parallel (DDP) and FSDP over "dp" combined with Megatron tensor parallelism
over "tp", on a (2, 2) gloo mesh of four processes. Every run is compared with one process
training the unsharded model eagerly on the concatenated batch (independent of nvtp)."""

from __future__ import annotations

import pytest
import torch

import nvtp
from nvtp.execute.launch import spawn
from nvtp.models import gpt
from tests.blocks import LlamaBlock

CFG = gpt.config("tiny", n_layer=1)
DP, TP = 2, 2
STEPS = 2
LR = 1e-2


def _tokens(step: int, dp_rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: the whole one (dp_rank None), or dp rank ``dp_rank``'s half."""
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, CFG.vocab_size, (DP * CFG.batch, CFG.seq_len), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (DP * CFG.batch, CFG.seq_len), generator=g)
    if dp_rank is None:
        return idx, targets
    rows = slice(dp_rank * CFG.batch, (dp_rank + 1) * CFG.batch)
    return idx[rows], targets[rows]


def _activations(step: int, dp_rank: int | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(DP * CFG.batch, CFG.seq_len, CFG.n_embd, generator=g)
    return x if dp_rank is None else x[dp_rank * CFG.batch:(dp_rank + 1) * CFG.batch]


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(CFG) if kind == "gpt" else LlamaBlock()


def _loss(model, kind: str, step: int, dp_rank: int | None) -> torch.Tensor:
    if kind == "gpt":
        return model(*_tokens(step, dp_rank))
    return model(_activations(step, dp_rank)).square().mean()


def _eager(kind: str) -> dict:
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR * 10, momentum=0.9)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, kind, step, None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _worker(rank, world, init_method, out, kind, plan, fsdp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model = nvtp.jit(_model(kind), plan=plan, mesh=mesh, fsdp=fsdp)
    opt = torch.optim.SGD(model.parameters(), lr=LR * 10, momentum=0.9)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, kind, step, dp_rank)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()  # each dp rank's loss is over its own batch: log their mean, as DDP users do
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        losses.append(mean.item() / DP)
    plain = [n for n, p in model.module.named_parameters() if not isinstance(p, torch.distributed.tensor.DTensor)]
    assert not plain, f"parameters left plain tensors: {plain}"
    held = {n: (p.to_local().numel(), p.numel(), [type(q).__name__ for q in p.placements]) for n, p in model.module.named_parameters()}
    whole = {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}  # collectives: every rank
    if rank == 0:
        torch.save({"losses": losses, "params": whole, "held": held, "notes": model.notes}, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("kind,plan,fsdp", [
    ("gpt", "megatron", False), ("gpt", "megatron-sp", True), ("llama", "megatron", True), ("llama", "megatron-sp", False)])
def test_2d_mesh_trains_like_one_process_on_the_whole_batch(tmp_path, kind, plan, fsdp):
    out = tmp_path / "got.pt"
    assert spawn(_worker, DP * TP, str(out), kind, plan, fsdp) == [0] * (DP * TP)
    got, ref = torch.load(out), _eager(kind)
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    for name, want in ref["params"].items():
        assert _close(got["params"][name], want) <= 1e-5, name
    # Per-rank parameter bytes: a weight tp splits is 1/tp (dp) or 1/(dp*tp) (fsdp) on each rank.
    for name, (local, whole, placements) in got["held"].items():
        tp_split = placements[1] != "Replicate"
        dp_split = placements[0] != "Replicate"
        assert dp_split == (fsdp and not any(name in note for note in got["notes"])), (name, placements, got["notes"])
        assert local * (TP if tp_split else 1) * (DP if dp_split else 1) == whole, (name, placements, local, whole)
