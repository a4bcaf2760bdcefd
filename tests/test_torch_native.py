"""nvtp.jit on torch's own types: torch's DeviceMesh is accepted; the module's state dict is the
wrapped module's own (no meta copies, no wrapper prefix); on a mesh of processes every parameter is
a DTensor, so clip_grad_norm_, torch.optim and torch.distributed.checkpoint work as on any DTensor
model. Every check compares with the unsharded block run by eager PyTorch in the test process."""

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
        torch.save({"y": y.detach(), "gx": x.grad, "local": tuple(w.to_local().shape), "whole": whole}, out)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


@pytest.mark.slow  # the default tier's DTensor test below runs on torch's DeviceMesh too
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
    odd = init_device_mesh("cpu", (1, 1), mesh_dim_names=("rows", "cols"))
    with pytest.raises(ShardingError, match=r"\['rows', 'cols'\] mean nothing to nvtp \(a 2-D mesh of shape \(1, 1\) named \('rows', 'cols'\)\).*mesh_dim_names=\('dp', 'tp'\)"):
        nvtp.jit(gpt.Block(CFG), mesh=odd)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    nvtp.jit(gpt.Block(CFG), mesh=mesh)  # a (dp, tp) mesh is taken (tests/test_mesh2d.py trains on one)
    nvtp.jit(gpt.Block(CFG), mesh=mesh["tp"])  # and so is one dimension of it
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def test_a_torch_mesh_needs_axis_names_nvtp_knows():
    assert spawn(_two_dim_worker, 1) == [0]


# -- DTensor parameters, clip_grad_norm_, torch.optim, torch.distributed.checkpoint -------------------

MAX_NORM = 0.05  # below the block's gradient norm (~0.1-0.2), so clipping changes every step
LR = 1e-2


def _batch(step: int) -> torch.Tensor:
    return torch.randn(CFG.batch, CFG.seq_len, CFG.n_embd, generator=torch.Generator().manual_seed(100 + step))


def _step(model, opt, step: int) -> tuple[float, float]:
    """One training step with clipping: (loss, the norm clip_grad_norm_ returned)."""
    loss = model(_batch(step)).square().mean()
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    return loss.item(), float(norm)


def _eager(steps: int, optimizer: str) -> dict:
    """The unsharded block trained by eager PyTorch: losses, norms, first gradients, final weights."""
    torch.manual_seed(0)
    block = gpt.Block(CFG)
    opt = _optimizer(optimizer, block.parameters())
    losses, norms = [], []
    for step in range(steps):
        loss, norm = _step(block, opt, step)
        losses.append(loss)
        norms.append(norm)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in block.named_parameters()}  # after clipping
    return {"losses": losses, "norms": norms, "grads": grads, "params": {n: p.detach().clone() for n, p in block.named_parameters()}}


def _optimizer(name: str, params):
    return torch.optim.AdamW(params, lr=LR) if name == "adamw" else torch.optim.SGD(params, lr=LR * 10, momentum=0.9)


def _dtensor_worker(rank, world, init_method, out, ckpt, optimizer, steps, save_at, torch_mesh, rewind=False):
    """Train ``steps`` steps from scratch with DCP saving at ``save_at`` (with ``rewind``: then load
    that checkpoint into the same model and optimizer and train the last steps again); or, when
    ``save_at`` is None, load ``ckpt`` into a fresh model and optimizer and train from step 3."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    torch.manual_seed(0)
    block = gpt.Block(CFG)
    model = nvtp.jit(block, plan="megatron", mesh=init_device_mesh("cpu", (world,)) if torch_mesh else None)
    opt = _optimizer(optimizer, model.parameters())  # made before the first call: nvtp points it at the DTensor parameters
    got = {"losses": [], "norms": []}
    first = 0
    if save_at is None:  # resume
        model.compile(_batch(0))
        state = {"model": get_model_state_dict(block), "optim": get_optimizer_state_dict(block, opt)}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(block, state["model"])
        set_optimizer_state_dict(block, opt, state["optim"])
        first = 3
    for step in range(first, steps):
        loss, norm = _step(model, opt, step)
        got["losses"].append(loss)
        got["norms"].append(norm)
        if step == 0:
            got["types"] = {n: type(p).__name__ for n, p in block.named_parameters()}
            got["placements"] = {n: str(p.placements[0]) for n, p in block.named_parameters()}
            got["grads"] = {n: p.grad.full_tensor() for n, p in block.named_parameters()}  # after clipping
            got["state_types"] = sorted({type(v).__name__ for s in opt.state.values() for v in s.values() if v.dim()})
            got["keys"] = list(model.state_dict())
            got["key_types"] = sorted({type(v).__name__ for v in model.state_dict().values()})
        if save_at is not None and step + 1 == save_at:
            dcp.save({"model": get_model_state_dict(block), "optim": get_optimizer_state_dict(block, opt)}, checkpoint_id=ckpt)
    if save_at is not None and rewind:  # load the checkpoint into this model and optimizer and run the last steps again
        state = {"model": get_model_state_dict(block), "optim": get_optimizer_state_dict(block, opt)}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(block, state["model"])
        set_optimizer_state_dict(block, opt, state["optim"])
        got["rewound"] = [_step(model, opt, step)[0] for step in range(save_at, steps)]
    got["params"] = {n: p.full_tensor() for n, p in block.named_parameters()}
    got["nvtp_full"] = {n: nvtp.full_tensor(p) for n, p in block.named_parameters()}  # delegates to DTensor's
    got["full_state"] = get_model_state_dict(block, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save(got, out)
    dist.destroy_process_group()
    return 0


def _comparable(name: str, t: torch.Tensor, optimizer: str) -> torch.Tensor:
    """``t`` without what AdamW makes noise of: the key bias's true gradient is zero (softmax ignores a
    bias added to every key), and AdamW scales the rounding noise left there into full steps."""
    if optimizer == "adamw" and name == "attn.c_attn.bias":
        e = CFG.n_embd
        return torch.cat([t[:e], t[2 * e:]])
    return t


def _check_training(got: dict, ref: dict, optimizer: str, first: int = 0) -> None:
    from nvtp.dump import relative_error

    n = len(got["losses"])
    assert n == len(ref["losses"]) - first
    for a, b in zip(got["losses"], ref["losses"][first:]):
        assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], ref["losses"])
    for a, b in zip(got["norms"], ref["norms"][first:]):  # the unsharded norm, not this rank's part of it
        assert abs(a - b) <= 1e-5 * b and b > MAX_NORM, (got["norms"], ref["norms"])
    for name, p in ref["params"].items():
        err = relative_error(_comparable(name, got["params"][name], optimizer), _comparable(name, p, optimizer))[0]
        assert err <= 1e-5, (name, err)
    for name, g in ref["grads"].items() if first == 0 else ():  # p.grad.full_tensor(): the whole clipped gradient
        assert relative_error(got["grads"][name], g)[0] <= 1e-5, name
        assert torch.equal(got["nvtp_full"][name], got["params"][name]), name
    plain = gpt.Block(CFG)
    plain.load_state_dict(got["full_state"])  # the full state dict loads into the plain module
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), got["params"][name]), name


def test_dtensor_parameters_clip_adamw_and_dcp_resume_on_two_processes(tmp_path):
    """2 gloo ranks, torch's DeviceMesh: every parameter is a DTensor (the fused QKV a FusedShard);
    clip_grad_norm_ returns the unsharded norm; AdamW with clipping trains as eager PyTorch does
    (losses, norms, weights within 1e-5); DCP saves model and AdamW state at step 3, and loading it
    after step 5 and training on repeats the uninterrupted run's losses exactly; the full state
    dict loads into the plain block."""
    ckpt, full = tmp_path / "ckpt", tmp_path / "full.pt"
    assert spawn(_dtensor_worker, 2, str(full), str(ckpt), "adamw", 5, 3, True, True) == [0, 0]
    got = torch.load(full, weights_only=False)
    ref = _eager(5, "adamw")
    assert set(got["types"].values()) == {"DTensor", "FusedShard"} and got["types"]["attn.c_attn.weight"] == "FusedShard"
    assert got["placements"]["attn.c_attn.weight"] == "_S(0, 3)" and got["placements"]["attn.c_proj.weight"] == "S(1)"
    assert got["placements"]["ln_1.weight"] == "R"
    assert got["state_types"] == ["DTensor", "FusedShard"]  # AdamW's moments are placed like their parameters
    assert got["keys"] == list(gpt.Block(CFG).state_dict()) and got["key_types"] == ["DTensor", "FusedShard"]
    _check_training(got, ref, "adamw")
    assert got["rewound"] == got["losses"][3:]  # loaded model and optimizer state: exactly the uninterrupted run


@pytest.mark.slow
def test_dcp_checkpoint_of_two_ranks_resumes_on_four_with_sgd(tmp_path):
    """SGD with momentum, the default group (no mesh given): saved by 2 ranks at step 3, loaded by 4 (DCP
    reshards every parameter and momentum buffer, the fused QKV's 3 boxes per rank included);
    the resumed losses and weights are eager PyTorch's."""
    ckpt, full, resumed = tmp_path / "ckpt", tmp_path / "full.pt", tmp_path / "resumed.pt"
    assert spawn(_dtensor_worker, 2, str(full), str(ckpt), "sgd", 5, 3, False) == [0, 0]
    assert spawn(_dtensor_worker, 4, str(resumed), str(ckpt), "sgd", 5, None, False) == [0, 0, 0, 0]
    ref = _eager(5, "sgd")
    _check_training(torch.load(full, weights_only=False), ref, "sgd")
    _check_training(torch.load(resumed, weights_only=False), ref, "sgd", first=3)


class _TwoThreads:
    """A stand-in for a simulated mesh's comm (no process group): two ranks, no collectives used."""
    size, rank = 2, 0


def test_checkpoints_refuse_a_simulated_mesh_and_an_old_format(tmp_path):
    model = nvtp.jit(gpt.Block(CFG), mesh=DeviceMesh.of_size(2), comm=_TwoThreads())
    with pytest.raises(ValueError, match="need the parameters as DTensors.*simulated mesh"):
        nvtp.save_checkpoint(tmp_path / "a", model)
    old = tmp_path / "old"
    old.mkdir()
    (old / "meta.json").write_text('{"format": 1}')
    with pytest.raises(ValueError, match="format 1, this nvtp reads format 2 .*nvtp's own per-rank .pt files"):
        nvtp.load_checkpoint(old, nvtp.jit(gpt.Block(CFG), mesh=DeviceMesh.of_size(1)))
