"""Fused projections whose parts differ in size (nvtp/frontend/fused.py, FusedParts, PartsShard).

The FX rewrite is checked on small modules against eager PyTorch (values unchanged, one linear per
part, weights read by anything else left alone); the parameter's layout ``FusedParts`` against
the rows each part's placement gives; its DTensor form on 2 gloo processes: ``full_tensor``,
``clip_grad_norm_``, AdamW and a DCP save and load, each against the whole tensor in one process.
The Hugging Face models that have such projections (Phi-3, Falcon multi-query) are in test_hf.py.
"""

from __future__ import annotations

import pytest
import torch

from nvtp.execute import spmd
from nvtp.execute.launch import spawn
from nvtp.frontend.fx import export_program
from nvtp.sharding.placements import REPLICATE, DeviceMesh, FusedParts, Shard


class _Qkv(torch.nn.Module):
    """Phi-3's attention input: one linear read as q | k | v slices of 16, 8, 8 features."""

    def __init__(self, bias: bool = False, view: bool = False, extra_read: bool = False):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 32, bias=bias)
        self.view, self.extra_read = view, extra_read

    def forward(self, x):
        y = self.qkv(x)
        if self.view:  # Falcon multi-query: [..., heads + 2, head_dim], then q heads, k, v
            h = y.view(x.shape[0], x.shape[1], 4, 8)
            q, k, v = h[..., :-2, :], h[..., [-2], :], h[..., [-1], :]
        else:
            q, k, v = y[..., :16], y[..., 16:24], y[..., 24:]
        out = (q.sum(-1, keepdim=True) * k.sum(-1, keepdim=True) + v.sum(-1, keepdim=True)).sum()
        return out + self.qkv.weight.sum() if self.extra_read else out


@pytest.mark.parametrize("bias,view", [(False, False), (True, False), (False, True)])
def test_a_fused_linear_read_as_unequal_parts_becomes_one_linear_per_part(bias, view):
    torch.manual_seed(0)
    model, x = _Qkv(bias, view), torch.randn(2, 3, 8)
    program = export_program(model, (x,), {})
    names = [n.target for n in program.graph_module.graph.nodes if n.op == "get_attr"]
    rows = ["[0:16]", "[16:24]", "[24:32]"]
    assert sorted(program.parts) == sorted(f"qkv.{w}{r}" for w in ["weight"] + ["bias"] * bias for r in rows)
    assert "qkv.weight" not in names and all(p in names for p in program.parts)
    linears = [n for n in program.graph_module.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert len(linears) == 3
    state = {k: v for k, v in model.state_dict().items()}
    gm = program.graph_module
    for label, part in program.parts.items():  # the graph module reads each part's rows of the parameter
        gm.get_parameter(label).data = state[part.weight][part.start:part.stop].clone()
    assert torch.allclose(gm(x)[0], model(x), atol=1e-5)


def test_a_fused_weight_read_elsewhere_or_in_equal_parts_stays_whole():
    x = torch.randn(2, 3, 8)
    assert export_program(_Qkv(extra_read=True), (x,), {}).parts == {}

    class Equal(torch.nn.Module):  # GPT-2 / gate_up: equal parts are the plans' _StridedShard
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 16)

        def forward(self, x):
            y = self.lin(x)
            return (y[..., :8] * y[..., 8:]).sum()

    assert export_program(Equal(), (x,), {}).parts == {}


def test_fused_parts_rows_are_each_parts_own_placement_one_after_the_other():
    falcon = FusedParts(0, ((0, 64, Shard(0)), (64, 80, REPLICATE), (80, 96, REPLICATE)))
    w = torch.arange(96.0)[:, None].expand(96, 3)
    mesh = DeviceMesh.of_size(2)
    local = [spmd.shard_tensor(w, falcon, mesh, r) for r in range(2)]
    assert local[1][:, 0].tolist() == list(range(32, 64)) + list(range(64, 96))
    assert torch.equal(spmd.assemble(local, falcon, w.shape, mesh), w)
    assert str(falcon) == "parts([0:64] S(0), [64:80] R, [80:96] R)"


# -- the DTensor form on 2 processes ----------------------------------------------------------------

PHI3 = ((0, 64, True), (64, 96, True), (96, 128, True))
FALCON = ((0, 64, True), (64, 80, False), (80, 96, False))


def _dtensor_worker(rank, world, init_method, out, ckpt, layout):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp import dtensor as dt
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    tmesh = init_device_mesh("cpu", (world,))
    placement = FusedParts(0, tuple((a, b, Shard(0) if split else REPLICATE) for a, b, split in layout))
    torch.manual_seed(0)
    n = layout[-1][1]
    w, g = torch.randn(n, 8), torch.randn(n, 8)
    mesh = DeviceMesh.of_size(world)
    p = torch.nn.Parameter(dt.as_dtensor(spmd.shard_tensor(w, placement, mesh, rank), placement, tmesh, w.shape))
    got = {"type": type(p).__name__, "placement": str(p.placements[0]), "full": p.full_tensor()}
    p.grad = dt.grad_like(p, spmd.shard_tensor(g, placement, mesh, rank))
    got["norm"] = float(torch.nn.utils.clip_grad_norm_([p], 1.0))
    opt = torch.optim.AdamW([p], lr=0.1)
    opt.step()
    got["stepped"] = p.full_tensor()
    got["state_types"] = sorted({type(v).__name__ for s in opt.state.values() for v in s.values() if v.dim()})
    got["exp_avg"] = opt.state[p]["exp_avg"].full_tensor()
    dcp.save({"w": p, "m": opt.state[p]["exp_avg"]}, checkpoint_id=ckpt)
    fresh = dt.as_dtensor(torch.zeros_like(p._local_tensor), placement, tmesh, w.shape)
    whole = {"w": torch.zeros(n, 8), "m": torch.zeros(n, 8)}  # DCP reshards into plain whole tensors too
    dcp.load({"w": fresh}, checkpoint_id=ckpt)
    dcp.load(whole, checkpoint_id=ckpt)
    got["loaded"], got["loaded_whole"], got["loaded_m"] = fresh.full_tensor(), whole["w"], whole["m"]
    if rank == 0:
        torch.save(got, out)
    dist.destroy_process_group()
    return 0


@pytest.mark.parametrize("layout", [PHI3, FALCON], ids=["phi3", "falcon-multi-query"])
def test_dtensor_of_unequal_parts_gathers_clips_steps_adamw_and_round_trips_dcp(tmp_path, layout):
    out, ckpt = tmp_path / "got.pt", tmp_path / "ckpt"
    assert spawn(_dtensor_worker, 2, str(out), str(ckpt), layout) == [0, 0]
    got = torch.load(out, weights_only=False)
    torch.manual_seed(0)
    n = layout[-1][1]
    w, g = torch.randn(n, 8), torch.randn(n, 8)
    assert got["type"] == "FusedShard" and got["placement"].startswith("parts([0:64] S")
    assert torch.equal(got["full"], w)
    assert abs(got["norm"] - float(g.norm())) <= 1e-5 * float(g.norm())  # whole parts counted once
    ref = torch.nn.Parameter(w.clone())
    ref.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([ref], 1.0)
    opt = torch.optim.AdamW([ref], lr=0.1)
    opt.step()
    assert torch.allclose(got["stepped"], ref.detach(), atol=1e-6)
    assert got["state_types"] == ["FusedShard"]  # AdamW's moments are placed like the weight
    assert torch.allclose(got["exp_avg"], opt.state[ref]["exp_avg"], atol=1e-7)
    assert torch.equal(got["loaded"], got["stepped"]) and torch.equal(got["loaded_whole"], got["stepped"])
    assert torch.equal(got["loaded_m"], got["exp_avg"])
