"""nvtp.jit on torch's own types: torch's DeviceMesh is accepted, and the module's state dict is
the wrapped module's own (no meta copies, no wrapper prefix)."""

from __future__ import annotations

import pytest
import torch

import nvtp
from nvtp.execute.launch import spawn
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh
from nvtp.sharding.propagate import ShardingError

CFG = gpt.config("tiny")


def test_state_dict_holds_the_modules_own_keys_and_real_tensors():
    torch.manual_seed(0)
    block = gpt.Block(CFG)
    jitted = nvtp.jit(block, mesh=DeviceMesh.of_size(1))
    jitted(gpt.example_input(CFG)).sum().backward()
    state = jitted.state_dict()
    assert list(state) == list(gpt.Block(CFG).state_dict())
    assert all(t.device.type == "cpu" for t in state.values())
    plain = gpt.Block(CFG)
    plain.load_state_dict(state)  # a one-device jit's state is the whole model's
    for (n, p), q in zip(block.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n


def _torch_mesh_worker(rank, world, init_method, out):
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    jitted = nvtp.jit(gpt.Block(CFG), plan="megatron", mesh=mesh)
    x = gpt.example_input(CFG)
    y = jitted(x)
    y.sum().backward()
    w = jitted.module.attn.c_proj.weight
    whole = nvtp.full_tensor(w)  # a collective: every rank calls it
    if rank == 0:
        torch.save({"y": y.detach(), "gx": x.grad, "local": tuple(w.shape), "whole": whole}, out)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def test_torch_device_mesh_is_accepted(tmp_path):
    """``nvtp.jit(model, mesh=init_device_mesh("cpu", (2,)))`` shards over it, and computes what
    the unsharded block computes (eager PyTorch)."""
    out = tmp_path / "mesh.pt"
    assert spawn(_torch_mesh_worker, 2, str(out)) == [0, 0]
    got = torch.load(out, weights_only=False)
    torch.manual_seed(0)
    ref = gpt.Block(CFG)
    x = gpt.example_input(CFG)
    y = ref(x)
    y.sum().backward()
    assert got["local"] == (CFG.n_embd, CFG.n_embd // 2)  # row-parallel: half the input features per rank
    assert torch.equal(got["whole"], ref.attn.c_proj.weight.detach())
    assert torch.allclose(got["y"], y.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(got["gx"], x.grad, rtol=1e-5, atol=1e-6)


def _two_dim_worker(rank, world, init_method):
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ShardingError, match=r"1-D mesh; got a 2-D mesh of shape \(1, 1\).*mesh\['tp'\]"):
        nvtp.jit(gpt.Block(CFG), mesh=mesh)
    nvtp.jit(gpt.Block(CFG), mesh=mesh["tp"])  # one dimension of it is taken
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def test_a_2d_torch_mesh_is_refused_with_what_to_pass():
    assert spawn(_two_dim_worker, 1) == [0]
