"""Models written the way people write them (tests/written.py) under nvtp.jit: every parameter gets
its own gradient, tied weights, a pytree of outputs, attributes reassigned in forward, cross
entropy's ignore_index, and the model's own interface on the object nvtp.jit returns. Each is
compared with eager PyTorch on an unsharded copy of the model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import nvtp
from nvtp.dump import relative_error
from nvtp.frontend.capture import CaptureError, check_gradients
from nvtp.sharding.placements import DeviceMesh
from tests.written import GPTConfig, TinyGPT, tokens


class LossOnly(nn.Module):
    """``model(idx, targets)[1]``: the loss alone (for the tests before tuples of outputs)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        return self.model(idx, targets)[1]


def _grads(model) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else nvtp.full_tensor(p.grad) for n, p in model.named_parameters()}


def _check_like_eager(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        assert (got[name] is None) == (g is None), f"{name}: nvtp gives {got[name] is not None and 'a' or 'no'} gradient, eager the opposite"
        if g is not None:
            assert relative_error(got[name], g)[0] <= tol, name


# -- 1. every parameter its own gradient ------------------------------------------------------------

@pytest.mark.parametrize("regional", [True, False])
def test_two_biases_with_one_gradient_each_get_it(regional):
    """GPT-J's parallel residual: both output projections' biases add into the residual, so Thunder
    returns one gradient for both; each must get it (one got None before, silently)."""
    cfg = GPTConfig(tie=False, parallel_residual=True, n_layer=2)
    torch.manual_seed(0)
    model = LossOnly(TinyGPT(cfg))
    ref = copy.deepcopy(model)
    jitted = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1), regional=regional)
    idx, targets = tokens(cfg)
    loss = jitted(idx, targets)
    loss.backward()
    want = ref(idx, targets)
    want.backward()
    assert relative_error(loss, want)[0] <= 1e-5
    assert jitted.last.traced.how.startswith("spliced") == regional, jitted.last.traced.how
    _check_like_eager(_grads(model), _grads(ref))
    assert relative_error(model.model.transformer.h[1].attn.c_proj.bias.grad, model.model.transformer.h[1].mlp.c_proj.bias.grad)[0] == 0


class _PassThrough(nn.Module):
    """Two parameters as large as the output, added to it: each one's gradient is the incoming
    gradient itself, which Thunder returns as it is (no computation gives it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.shift = nn.Parameter(torch.randn(4, 8))
        self.tilt = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return self.lin(x) + self.shift + self.tilt


class _OnlyPassThrough(nn.Module):
    """No computation in the backward at all: Thunder's backward fuses nothing."""

    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return torch.tanh(x) * 2 + self.shift


@pytest.mark.parametrize("make", [_PassThrough, _OnlyPassThrough])
def test_gradients_that_are_the_incoming_gradient_itself_reach_their_parameters(make):
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    out = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1))(x)
    (out * out).sum().backward()
    want = ref(x)
    (want * want).sum().backward()
    assert relative_error(out, want)[0] <= 1e-6
    _check_like_eager(_grads(model), _grads(ref), 1e-6)


def test_a_backward_missing_a_parameters_gradient_is_an_error_naming_it():
    """The check after every trace (and every splice): a gradient Thunder's backward gives that
    nvtp's backward fusion lacks is an error naming the parameter, never a silent None."""
    from nvtp.frontend.capture import capture

    torch.manual_seed(0)
    captured = capture(_PassThrough().to("meta"), torch.empty(4, 8, device="meta"))
    assert set(captured.differentiable) == {"lin.weight", "lin.bias", "shift", "tilt"}
    check_gradients(captured.backward, captured.differentiable)  # as traced: fine
    b = captured.backward
    dropped = b.with_ops(b.ops, tuple(v for v in b.outputs if b.grad_of(v.name) != "tilt"))
    with pytest.raises(CaptureError, match=r"no gradient output for tilt"):
        check_gradients(dropped, captured.differentiable, "spliced")
    twice = b.with_ops(b.ops, b.outputs + tuple(v for v in b.outputs if b.grad_of(v.name) == "shift"))
    with pytest.raises(CaptureError, match=r"two gradient outputs for shift"):
        check_gradients(twice, captured.differentiable)


# -- 2. tied parameters ------------------------------------------------------------------------------

def _train_on_simulated_mesh(model: nn.Module, batch: tuple, d: int, plan, steps: int = 2, loss_of=lambda out: out, **jit):
    """``steps`` SGD steps of ``model`` under nvtp.jit on ``d`` simulated ranks (threads) and of an
    eager copy; asserts every loss within 1e-5 and every final weight within 1e-4 of eager's.
    Returns the ranks' modules (after training)."""
    from nvtp.execute import spmd
    from nvtp.execute.collectives import ThreadComm, ThreadGroup

    group = ThreadGroup(d, timeout=120)
    ranks = [nvtp.jit(copy.deepcopy(model), plan=plan, mesh=DeviceMesh.of_size(d), comm=ThreadComm(group, r), **jit) for r in range(d)]
    ranks[0].compile(*batch)
    for r in ranks[1:]:
        r.share_compiled(ranks[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in ranks]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(steps):
        def step(r):
            opts[r].zero_grad()
            loss = loss_of(ranks[r](*batch))
            loss.backward()
            opts[r].step()
            return loss.detach()
        losses = spmd.on_threads(step, group)
        ref_opt.zero_grad()
        want = loss_of(ref(*batch))
        want.backward()
        ref_opt.step()
        for loss in losses:
            assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item()), (loss.item(), want.item())
    for name, p in ref.named_parameters():
        parts = [dict(m.module.named_parameters())[name].detach() for m in ranks]
        got = spmd.assemble(parts, ranks[0].placement(name), p.shape)
        assert relative_error(got, p)[0] <= 1e-4, name
    return ranks


@pytest.mark.parametrize("regional", [True, False])
def test_a_head_tied_to_the_embedding_gets_the_sum_of_both_gradients_and_stays_tied(regional):
    cfg = GPTConfig(tie=True)
    torch.manual_seed(0)
    model = LossOnly(TinyGPT(cfg))
    ref = copy.deepcopy(model)
    jitted = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1), regional=regional)
    opt = torch.optim.SGD(jitted.parameters(), lr=0.5)
    idx, targets = tokens(cfg)
    loss = jitted(idx, targets)
    loss.backward()
    want = ref(idx, targets)
    want.backward()
    assert relative_error(loss, want)[0] <= 1e-5
    assert jitted.last.traced.how.startswith("spliced") == regional, jitted.last.traced.how
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]  # one parameter, one name
    _check_like_eager(_grads(model), _grads(ref))
    labels = [jitted.last.traced.forward.label(v.name) for v in jitted.last.traced.forward.inputs]
    assert "model.transformer.wte.weight" in labels and "model.lm_head.weight" not in labels  # one input for both uses
    opt.step()
    inner = model.model
    assert inner.lm_head.weight is inner.transformer.wte.weight


@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
def test_a_tied_head_trains_sharded_as_eager_and_is_placed_once(plan):
    cfg = GPTConfig(tie=True, n_layer=2)
    torch.manual_seed(0)
    ranks = _train_on_simulated_mesh(LossOnly(TinyGPT(cfg)), tokens(cfg), 2, plan)
    for m in ranks:
        inner = m.module.model
        assert inner.lm_head.weight is inner.transformer.wte.weight  # one tensor, this rank's half of it
        assert tuple(inner.lm_head.weight.shape) == (cfg.vocab_size // 2, cfg.n_embd)
    assert ranks[0].placement("model.transformer.wte.weight") == ranks[0].placement("model.lm_head.weight")


def test_an_explicit_plan_may_name_a_tied_weight_by_either_name_and_one_placement_is_kept_and_said():
    from nvtp.sharding.placements import Shard

    cfg = GPTConfig(tie=True, n_layer=2)
    torch.manual_seed(0)
    plan = {"model.lm_head": "colwise", "model.transformer.wte": Shard(1)}  # the head wants rows split, the embedding columns
    ranks = _train_on_simulated_mesh(LossOnly(TinyGPT(cfg)), tokens(cfg), 2, plan)
    assert ranks[0].placement("model.transformer.wte.weight") == ranks[1].placement("model.lm_head.weight") == Shard(0)
    notes = ranks[0].last.forward.annotations.notes
    assert any("tied weight model.transformer.wte.weight (also model.lm_head.weight)" in n and "kept S(0)" in n for n in notes), notes


# -- 3. any pytree of outputs ----------------------------------------------------------------------

@pytest.mark.parametrize("tie,regional", [(False, True), (True, True), (False, False)])
def test_logits_and_loss_returned_together_train_as_eager(tie, regional):
    """nanoGPT's ``(logits, loss)``: the loss's gradient goes to the loss, none to the logits (torch
    passes None for an output the loss does not use), on the spliced and the whole trace."""
    cfg = GPTConfig(tie=tie)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    jitted = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1), regional=regional)
    idx, targets = tokens(cfg)
    logits, loss = jitted(idx, targets)
    loss.backward()
    want_logits, want = ref(idx, targets)
    want.backward()
    assert logits.shape == want_logits.shape and relative_error(logits, want_logits)[0] <= 1e-5
    assert relative_error(loss, want)[0] <= 1e-5
    _check_like_eager(_grads(model), _grads(ref))
    f = jitted.last.traced.forward
    assert sorted(f.label(v.name) for v in f.outputs if f.role(v.name) == "output") == ["y[0]", "y[1]"]


def test_a_loss_of_both_outputs_sends_each_its_own_gradient():
    cfg = GPTConfig(tie=False, n_layer=1)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    idx, targets = tokens(cfg)
    logits, loss = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1))(idx, targets)
    (3 * loss + logits.pow(2).mean()).backward()
    want_logits, want = ref(idx, targets)
    (3 * want + want_logits.pow(2).mean()).backward()
    _check_like_eager(_grads(model), _grads(ref))


class _Outputs(nn.Module):
    """One linear, its output returned in the container ``kind`` with None and a number beside it."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        loss = (y * y).mean()
        if self.kind == "dict":
            return {"logits": y, "loss": loss, "cache": None, "steps": 3}
        if self.kind == "dataclass":
            return Prediction(y, loss)
        return [y, (None, loss)]


from dataclasses import dataclass  # noqa: E402


@dataclass
class Prediction:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    note: str = "from the model"


@pytest.mark.parametrize("kind", ["dict", "dataclass", "nested"])
def test_outputs_in_any_container_come_back_in_it_and_train(kind):
    """(A NamedTuple is not among them: Thunder 0.2.6 cannot trace a forward returning one.)"""
    torch.manual_seed(0)
    model = _Outputs(kind)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    got, want = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1))(x), ref(x)
    assert type(got) is type(want)
    from nvtp.frontend.outputs import tensors

    places = [(p, t) for p, t in tensors(got)]
    assert [p for p, _ in places] == [p for p, _ in tensors(want)]
    for (_, a), (_, b) in zip(places, tensors(want)):
        assert relative_error(a, b)[0] <= 1e-6
    if kind == "dict":
        assert got["cache"] is None and got["steps"] == 3
        got["loss"].backward(), want["loss"].backward()
    elif kind == "nested":
        assert got[1][0] is None
        got[1][1].backward(), want[1][1].backward()
    else:
        assert kind != "dataclass" or got.note == "from the model"
        got.loss.backward(), want.loss.backward()
    _check_like_eager(_grads(model), _grads(ref), 1e-6)


class _ReturnsItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x), x


def test_an_output_the_fusion_does_not_compute_is_named_with_its_place():
    with pytest.raises(CaptureError, match=r"_ReturnsItsInput.forward returns y\[1\], a tensor nvtp's forward fusion does not compute"):
        nvtp.jit(_ReturnsItsInput(), plan="replicate", mesh=DeviceMesh.of_size(1))(torch.randn(4, 8))


# -- 4. attributes reassigned in forward; cross entropy's ignore_index ------------------------------

def test_a_llama_reassigning_its_rotary_table_in_forward_matches_eager():
    """``self.freqs = self.freqs.to(h.device)`` in forward: a plain tensor attribute, not a buffer.
    nvtp traces it as module state and passes the module's tensor at each call."""
    from tests.written import LlamaArgs, TinyLlama

    args = LlamaArgs()
    torch.manual_seed(0)
    model = TinyLlama(args)
    ref = copy.deepcopy(model)
    idx, _ = tokens(args)
    jitted = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1))
    out = jitted(idx)
    out.pow(2).mean().backward()
    want = ref(idx)
    want.pow(2).mean().backward()
    assert relative_error(out, want)[0] <= 1e-5
    _check_like_eager(_grads(model), _grads(ref))
    f = jitted.last.traced.forward
    assert "freqs" in {f.label(v.name) for v in f.inputs}


def test_a_llama_reassigning_its_rotary_table_trains_sharded_as_eager():
    from tests.written import LlamaArgs, TinyLlama

    args = LlamaArgs()
    torch.manual_seed(0)
    idx, targets = tokens(args)
    ranks = _train_on_simulated_mesh(TinyLlama(args), (idx,), 2, "megatron",
                                     loss_of=lambda logits: nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    assert ranks[0].placement("layers.0.attention.wq.weight") != ranks[0].placement("norm.weight")  # it did split


@pytest.mark.parametrize("plan", ["replicate", "megatron"])
def test_cross_entropy_ignores_targets_of_minus_one_as_eager(plan):
    """nanoGPT's ``F.cross_entropy(..., ignore_index=-1)``: the mean over the other targets, and no
    gradient from the ignored ones; megatron splits the vocabulary (a parallel cross entropy)."""
    cfg = GPTConfig(tie=True)
    torch.manual_seed(0)
    idx, targets = tokens(cfg, ignored=5)
    assert (targets == -1).sum() == 10
    _train_on_simulated_mesh(TinyGPT(cfg), (idx, targets), 2, plan, loss_of=lambda out: out[1])
