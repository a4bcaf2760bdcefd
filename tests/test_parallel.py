"""nvtp.jit: train a sharded GPT on a mesh of processes and get single-process training's numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import nvtp
from nvtp.demo import TrainJob, compare, run, train_worker
from nvtp.execute.launch import spawn
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh
from nvtp.sharding.propagate import ShardingError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("d,plan", [(2, "megatron"), (4, "megatron"), (2, "megatron-sp")])
def test_training_on_a_mesh_matches_one_process(d, plan, tmp_path):
    """20 SGD steps of a 2-layer GPT: every loss within 1e-4 of single-process PyTorch; a wrong
    gradient anywhere would move the losses and the final parameters."""
    job = TrainJob("tiny", plan, 20, 0.1, str(tmp_path / "r.pt"), verbose=False)
    sharded, single = run(job, d)
    loss_diff, param_err = compare(sharded, single)
    assert len(sharded["losses"]) == 20
    assert loss_diff <= 1e-4 and param_err <= 1e-4, (loss_diff, param_err)
    # Each rank holds 1/d of every split weight (and the split weights are the big ones).
    split = {n: (local, whole) for n, (local, whole, placement) in sharded["local"].items() if placement != "R"}
    assert "h.0.attn.c_attn.weight" in split and "lm_head.weight" in split and "wte.weight" in split
    for n, (local, whole) in split.items():
        assert torch.Size(local).numel() * d == torch.Size(whole).numel(), n
    assert sharded["held"] < sharded["whole"]


def _block_worker(rank, world, init_method, out):
    from nvtp.execute.launch import init_group
    from tests.blocks import LlamaBlock

    init_group(rank, world, init_method)
    torch.manual_seed(0)
    block = nvtp.jit(LlamaBlock(), plan="megatron")
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = block(x)
    (y * y).sum().backward()
    grads = {n: nvtp.full_tensor(p.grad) for n, p in block.module.named_parameters()}
    if rank == 0:
        torch.save({"y": y.detach(), "gx": x.grad, "grads": grads, "comms": [c.kind for c in block.last.backward.communications]}, out)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def test_a_llama_block_through_nvtp_jit_matches_one_device(tmp_path):
    """RMSNorm, separate q/k/v with grouped-query attention, RoPE, SwiGLU: nothing in nvtp knows it."""
    from nvtp.dump import relative_error
    from tests.blocks import LlamaBlock

    out = tmp_path / "llama.pt"
    assert spawn(_block_worker, 2, str(out)) == [0, 0]
    got = torch.load(out, weights_only=False)
    torch.manual_seed(0)
    ref = LlamaBlock()
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = ref(x)
    (y * y).sum().backward()
    assert relative_error(got["y"], y)[0] <= 1e-5 and relative_error(got["gx"], x.grad)[0] <= 1e-5
    for n, p in ref.named_parameters():
        assert relative_error(got["grads"][n], p.grad)[0] <= 1e-5, n
    assert got["comms"] == ["allreduce", "allreduce"]


def test_checkpoint_resumes_exactly_and_on_another_mesh(tmp_path):
    ckpt = tmp_path / "ckpt"
    full = TrainJob("tiny", "megatron", 8, 0.1, str(tmp_path / "full.pt"), verbose=False, save_at=4, save_dir=str(ckpt))
    assert spawn(train_worker, 2, full) == [0, 0]
    reference = torch.load(full.out, weights_only=False)["losses"]
    assert (ckpt / "meta.json").exists() and (ckpt / "rank1-of-2.pt").exists()
    same = TrainJob("tiny", "megatron", 8, 0.1, str(tmp_path / "same.pt"), verbose=False, load_dir=str(ckpt))
    assert spawn(train_worker, 2, same) == [0, 0]
    resumed = torch.load(same.out, weights_only=False)
    assert resumed["first"] == 4 and resumed["losses"] == reference[4:]  # exactly: same mesh, same state
    other = TrainJob("tiny", "megatron", 8, 0.1, str(tmp_path / "other.pt"), verbose=False, load_dir=str(ckpt))
    assert spawn(train_worker, 4, other) == [0, 0, 0, 0]
    moved = torch.load(other.out, weights_only=False)["losses"]
    assert len(moved) == len(reference) - 4
    assert max(abs(a - b) / b for a, b in zip(moved, reference[4:])) <= 1e-5  # 4 ranks add partial sums in another order


def test_torchrun_launches_training():
    from nvtp.execute.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "tools/train.py"), "--steps", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step   3/3" in result.stdout and "on 2 processes" in result.stdout


def test_demo_command_trains_and_checks(capfd):
    from nvtp import cli

    assert cli.main(["demo", "--devices", "2", "--steps", "3"]) == 0
    out = capfd.readouterr().out  # rank 0 prints from its own process
    assert "vocab-parallel wte.weight" in out and "step   3/3" in out and "PASSED" in out


# -- errors before any work -------------------------------------------------------------------------


class _NoCollectives:
    """A comm that fails the test if nvtp communicates."""

    rank, size = 0, 3

    def __getattr__(self, name):
        raise AssertionError(f"nvtp called {name} before refusing the plan")


def test_a_plan_that_does_not_divide_is_refused_before_any_collective():
    cfg = gpt.config("tiny", vocab_size=255)  # the vocabulary divides by 3 (its own error is tested in test_faults.py)
    model = nvtp.jit(gpt.GPT(cfg), plan="megatron", mesh=DeviceMesh.of_size(3), comm=_NoCollectives())
    idx, tgt = gpt.example_tokens(cfg)
    with pytest.raises(ShardingError, match=r"h.0.attn.c_attn.weight .*axis 0 .*cannot be split over 3 devices"):
        model(idx, tgt)
    assert all(p.shape == model.global_shape(n) for n, p in model.module.named_parameters())  # nothing was sharded


def test_an_op_nvtp_cannot_fuse_is_named_with_its_line():
    from nvtp.frontend.capture import CaptureError

    class Sorter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.sort(self.lin(x), dim=-1)[0].sum()

    with pytest.raises(CaptureError, match=r"sort .*test_parallel.py:\d+"):
        nvtp.jit(Sorter(), mesh=DeviceMesh.of_size(1))(torch.randn(4, 8))


def test_arguments_unlike_the_compiled_ones_are_refused():
    from nvtp.parallel import InputError

    cfg = gpt.config("tiny")
    model = nvtp.jit(gpt.GPT(cfg), mesh=DeviceMesh.of_size(1))
    idx, tgt = gpt.example_tokens(cfg)
    model(idx, tgt)
    with pytest.raises(InputError, match=r"argument idx: the module was compiled for int64\[2, 16\] on cpu, got int64\[2, 8\]"):
        model(idx[:, :8], tgt[:, :8])
    with pytest.raises(InputError, match="argument targets"):
        model(idx, tgt.to(torch.int32))


def test_full_tensor_gives_whole_values_on_one_device():
    cfg = gpt.config("tiny")
    torch.manual_seed(0)
    model = nvtp.jit(gpt.GPT(cfg), mesh=DeviceMesh.of_size(1))
    idx, tgt = gpt.example_tokens(cfg)
    model(idx, tgt).backward()
    p = dict(model.module.named_parameters())["h.0.attn.c_attn.weight"]
    assert nvtp.full_tensor(p).shape == (192, 64) and nvtp.full_tensor(p.grad).shape == (192, 64)


class _IgnoresAnArgument(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, unused):
        return self.down(torch.relu(self.up(x))).sum()


def test_an_argument_the_model_ignores_gets_no_gradient_and_breaks_nothing():
    from nvtp.dump import relative_error

    torch.manual_seed(0)
    model, ref = _IgnoresAnArgument(), _IgnoresAnArgument()
    ref.load_state_dict(model.state_dict())
    jitted = nvtp.jit(model, mesh=DeviceMesh.of_size(1))
    x, unused = torch.randn(4, 8, requires_grad=True), torch.randn(3, requires_grad=True)
    jitted(x, unused).backward()
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref, unused).backward()
    assert relative_error(x.grad, x_ref.grad)[0] <= 1e-6 and unused.grad is None
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert relative_error(p.grad, q.grad)[0] <= 1e-6, n


def test_a_jitted_module_is_freed_with_its_parameters():
    import gc
    import weakref

    model = nvtp.jit(_IgnoresAnArgument(), mesh=DeviceMesh.of_size(1))
    model(torch.randn(4, 8), torch.randn(3))
    alive = [weakref.ref(model), weakref.ref(model.module.up.weight)]
    del model
    gc.collect()
    assert [r() for r in alive] == [None, None]


def test_a_model_with_every_parameter_frozen_returns_its_output():
    """No parameter needs a gradient: Thunder traces no backward and returns the output itself."""
    from nvtp.dump import relative_error

    cfg = gpt.config("tiny")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    want = model(*gpt.example_tokens(cfg)).detach()
    for p in model.parameters():
        p.requires_grad_(False)
    got = nvtp.jit(model, mesh=DeviceMesh.of_size(1))(*gpt.example_tokens(cfg))
    assert isinstance(got, torch.Tensor) and relative_error(got, want)[0] <= 1e-5
