"""``thunder.jit(model, transforms=[nvtp.ShardingTransform(plan, mesh)])`` trains like eager PyTorch.

The transform shards the ThunderModule's parameters, rewrites the prologue's shape checks and
replaces Thunder's computation with the program nvtp's compile driver made (nvtp/transform.py).
Each test trains nvtp's tiny GPT with SGD and checks, against the same steps of the unsharded
model in eager PyTorch: every loss within 1e-5 (relative), the final weights within 1e-4, and
that Thunder hit its cache (a prologue that rejected the shards would retrace every call). On a
mesh of 2 (two gloo processes under torchrun, and in the slow tier ranks as threads) each rank holds half of
every split weight (bytes counted), the module's own whole weights are released, and the
collectives each step issues are the ones the Program plans.
"""

from __future__ import annotations

import copy

import pytest
import thunder
import torch

import nvtp
from nvtp.errors import InputError
from nvtp.execute import spmd
from nvtp.mesh import MeshError
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh
from nvtp.sharding.propagate import ShardingError
from tests.test_driver import Counting

LR = 0.1
STEPS = 3


def _eager(model: torch.nn.Module, batches, norms: list[float] | None = None,
           max_norm: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final weights of SGD on ``model`` in eager PyTorch, one step per batch; with
    ``max_norm``, gradients clipped by ``clip_grad_norm_`` (each step's norm appended to ``norms``)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for idx, targets in batches:
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _assert_like_eager(losses, weights, want_losses, want_weights):
    assert len(losses) == len(want_losses)
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    assert weights.keys() == want_weights.keys()
    for name, want in want_weights.items():
        err = (weights[name] - want).abs().max().item()
        assert weights[name].shape == want.shape and err <= 1e-4, (name, err)


def _batches(cfg, steps=STEPS):
    return [gpt.example_tokens(cfg, seed=s) for s in range(steps)]


@pytest.mark.slow  # 20 s: the two-rank test below trains through the transform against eager in the default tier
def test_one_process_trains_like_eager_through_thunders_autograd():
    """A mesh of 1: the computation is nvtp's program (``nvtp_forward_N`` in Thunder's forward
    trace, ``nvtp_backward_N`` in its backward trace), an optimizer made from the module's own
    parameters before ``thunder.jit`` steps the ThunderModule's, and Thunder hits its cache."""
    cfg = gpt.config("tiny")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    want = _eager(copy.deepcopy(model), _batches(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # the module's parameters: pointed at the shards' before its first step
    transform = nvtp.ShardingTransform(plan="megatron", mesh=1)
    jm = thunder.jit(model, transforms=[transform])
    losses, programs = [], []
    for step, (idx, targets) in enumerate(_batches(cfg)):
        # The last step passes targets by keyword: Thunder traces again (now with the module's
        # weights released to meta); nvtp binds it to its position, as nvtp.jit does: the same program.
        loss = jm(idx, targets) if step < STEPS - 1 else jm(idx, targets=targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        programs.append(transform.last)
    assert programs[0] is programs[-1] and programs[0].plan == "megatron"
    _assert_like_eager(losses, {n: p.detach() for n, p in jm.named_parameters()}, *want)
    assert thunder.cache_misses(jm) == 2 and thunder.cache_hits(jm) == STEPS - 2
    forward, backward = str(thunder.last_traces(jm)[-1]), str(thunder.last_backward_traces(jm)[-1])
    assert "nvtp_forward_1(" in forward and "nvtp_backward_1(" in backward  # the keyword call's trace: symbols of its own
    assert "ltorch" not in forward and "linear" not in forward  # Thunder's own ops are gone: the program computes
    assert all(p.device.type == "meta" for p in model.parameters())  # the whole weights released


def _simulated(cfg, batches, d: int = 2):
    """Train on ``d`` simulated ranks (threads): per rank its losses, the collectives of each step,
    the Program of each step, its parameters' shapes and bytes, and the whole weights gathered."""
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    threads = spmd.ThreadMesh(DeviceMesh.of_size(d), timeout=600)
    logs = [[] for _ in range(d)]
    # verify=False: the first call's check (nvtp/guard.py) gathers weights beside the program; counted is the program's step
    transforms = [nvtp.ShardingTransform(plan="megatron", mesh=d, comm=Counting(threads.comm(r), "tp", logs[r]), verify=False)
                  for r in range(d)]
    for t in transforms[1:]:
        t.share(transforms[0])  # compile once per call shape
    jms = [thunder.jit(copy.deepcopy(model), transforms=[t]) for t in transforms]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def train(r):
        jm, opt, out = jms[r], torch.optim.SGD(jms[r].parameters(), lr=LR), {"losses": [], "comms": [], "programs": []}
        for idx, targets in batches:
            mark = len(logs[r])
            loss = jm(idx, targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out["losses"].append(loss.item())
            out["comms"].append(logs[r][mark:])
            out["programs"].append(transforms[r].last)
        out["shapes"] = {n: tuple(p.shape) for n, p in jm.named_parameters()}
        out["bytes"] = sum(p.nbytes for p in jm.parameters())
        out["weights"] = jm.original_state_dict()  # a collective: the whole weights
        jm.load_original_state_dict(start)  # whole weights in: each rank keeps its parts of them
        out["loaded"] = jm.original_state_dict()
        return out

    return model, jms, spmd.on_threads(train, threads)


@pytest.mark.slow  # 45 s: the default tier trains two gloo processes through torchrun (below), a second length included
def test_two_simulated_ranks_train_like_eager_with_half_the_bytes_and_the_planned_collectives():
    """Two ranks as threads, SGD on the tiny GPT, then a call of another sequence length (Thunder
    retraces with the module's weights released and the shards in place; nvtp compiles again,
    keeping the placements)."""
    cfg = gpt.config("tiny")
    batches = _batches(cfg) + [tuple(t[:, :8].contiguous() for t in gpt.example_tokens(cfg, seed=STEPS))]
    model, jms, ranks = _simulated(cfg, batches)
    torch.manual_seed(0)
    want = _eager(gpt.GPT(cfg), batches)
    for r, got in enumerate(ranks):
        _assert_like_eager(got["losses"], got["weights"], *want)
        assert got["loaded"].keys() == want[1].keys() and all(torch.equal(got["loaded"][n], p) for n, p in model.named_parameters())
        assert thunder.cache_misses(jms[r]) == 2 and thunder.cache_hits(jms[r]) == STEPS - 1  # seq 16 once, seq 8 once
        for step, program in enumerate(got["programs"]):  # what is planned is what runs
            planned = [(c.kind, c.axis, c.bytes) for c in program.communications()]
            assert planned and got["comms"][step] == planned, (r, step)
    whole = {n: tuple(p.shape) for n, p in gpt.GPT(cfg).named_parameters()}
    first, last = ranks[0]["programs"][0], ranks[0]["programs"][-1]
    assert first is not last and all(last.parameters[n] == first.parameters[n] for n in whole)  # placements kept
    shapes = ranks[0]["shapes"]
    for name in ("wte.weight", "lm_head.weight", "h.0.attn.c_attn.weight", "h.1.mlp.c_fc.weight"):
        assert shapes[name][0] * 2 == whole[name][0], name
    assert shapes["h.0.attn.c_proj.weight"][1] * 2 == whole["h.0.attn.c_proj.weight"][1]
    assert shapes["h.0.ln_1.weight"] == whole["h.0.ln_1.weight"]
    whole_bytes = sum(p.nbytes for p in gpt.GPT(cfg).parameters())
    assert ranks[0]["bytes"] == first.parameter_bytes() < 0.55 * whole_bytes
    assert all(p.device.type == "meta" for jm in jms for p in jm._model.parameters())  # each rank's whole weights released


def test_bad_input_is_refused_before_anything_is_traced():
    cfg = gpt.config("tiny")
    with pytest.raises(MeshError, match="1-D tensor-parallel mesh.*nvtp.jit"):
        nvtp.ShardingTransform(mesh=(2, 2))
    with pytest.raises(MeshError, match="the mesh has 2 device"):
        nvtp.ShardingTransform(mesh=2)  # one process, no simulated comm
    with pytest.raises(ShardingError, match="megatorn"):
        nvtp.ShardingTransform(plan="megatorn")
    with pytest.raises(ShardingError, match="matches no parameter"):
        thunder.jit(gpt.GPT(cfg), transforms=[nvtp.ShardingTransform(plan={"*.nothing": "colwise"})])
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="backend='nvfuser'"):
            thunder.jit(gpt.GPT(cfg), transforms=[nvtp.ShardingTransform(backend="nvfuser")])


class _BatchNormed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.norm = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(self.proj(x)).sum()


class _ListArgument(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, xs):
        return self.proj(xs[0] + xs[1]).sum()


def test_a_module_nvtp_cannot_run_is_refused_with_the_reason_and_left_as_it_was():
    from nvtp.frontend.capture import CaptureError

    model = _BatchNormed()  # updates its running statistics in place
    jm = thunder.jit(model, transforms=[nvtp.ShardingTransform(mesh=1)])
    with pytest.raises(CaptureError, match=r"_BatchNormed.norm \(BatchNorm1d\) is in training mode, where it updates its running "
                                           r"statistics .* Call model.norm.eval\(\)"):
        jm(torch.randn(4, 8))
    assert all(p.device.type == "cpu" for p in model.parameters())
    jm = thunder.jit(_ListArgument(), transforms=[nvtp.ShardingTransform(mesh=1)])
    with pytest.raises(InputError, match="inside a list, tuple or dict argument"):
        jm([torch.randn(4, 8), torch.randn(4, 8)])


# -- two gloo processes ---------------------------------------------------------------------------


def test_torchrun_two_gloo_processes_train_like_eager(tmp_path):
    """``torchrun --nproc-per-node 2 tools/thunder_train.py`` (thunder.jit with
    ``nvtp.ShardingTransform(plan="megatron")`` after ``init_process_group``, gradients clipped by
    ``torch.nn.utils.clip_grad_norm_(jm.parameters(), 1.0)``): the parameters are DTensors, so
    each step's norm is the whole model's (eager's, not a rank's own: 2.89 / 3.00 against 3.50 when
    they were plain parts); eager's losses and weights on both ranks, half of every split weight
    each, one Thunder compile."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from torch.distributed.elastic.utils.distributed import get_free_port

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(get_free_port()),
           str(root / "tools/thunder_train.py"), "--steps", str(STEPS), "--lr", str(LR), "--max-norm", "1.0", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=root, env=dict(os.environ))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "on 2 process(es)" in result.stdout and ": PASSED" in result.stdout, result.stdout
    cfg = gpt.config("tiny")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    whole_bytes = sum(p.nbytes for p in model.parameters())
    want_norms: list[float] = []
    want = _eager(model, _batches(cfg), want_norms, max_norm=1.0)
    assert min(want_norms) > 1.0  # the clip changes the step: a wrong norm moves the weights
    for rank in range(2):
        got = torch.load(f"{out}.{rank}", weights_only=False)
        assert "DTensor" in got["types"], got["types"]
        assert got["norms"] == pytest.approx(want_norms, rel=1e-5)
        _assert_like_eager(got["losses"], got["weights"], *want)
        assert got["misses"] == 2  # the training steps, and the last call of half the length
        assert got["shapes"]["h.0.attn.c_attn.weight"] == (96, 64) and got["shapes"]["lm_head.weight"] == (128, 64)
        assert got["bytes"] < 0.55 * whole_bytes
