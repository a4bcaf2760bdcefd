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

@pytest.mark.parametrize("regional", [True, pytest.param(False, marks=pytest.mark.slow)])  # whole traces: test_logits_and_loss's (False, False)
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


# The default (spliced) trace in the default tier; the whole trace (regional=False, 9 s) in the slow tier
@pytest.mark.parametrize("regional", [True, pytest.param(False, marks=pytest.mark.slow)])
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


@pytest.mark.parametrize("plan", [pytest.param("megatron", marks=pytest.mark.slow), "megatron-sp"])
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



class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class _SharedBlocks(nn.Module):
    """One block applied three times (ALBERT's cross-layer sharing): ``h.1.fc.weight`` is
    ``h.0.fc.weight``, and its gradient the sum over the three uses."""

    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList([_Residual()] * 3)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return self.out(x).pow(2).mean()


def test_one_block_shared_by_every_layer_gets_the_sum_of_its_gradients():
    torch.manual_seed(0)
    model = _SharedBlocks()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, 16)
    jitted = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1))
    loss = jitted(x)
    loss.backward()
    want = ref(x)
    want.backward()
    assert relative_error(loss, want)[0] <= 1e-6
    assert jitted.last.traced.how.startswith("whole trace: the blocks of h are not each called once")  # one module, 3 calls
    assert [n for n, _ in model.named_parameters()] == ["h.0.ln.weight", "h.0.ln.bias", "h.0.fc.weight", "h.0.fc.bias", "out.weight", "out.bias"]
    _check_like_eager(_grads(model), _grads(ref))

# -- 3. any pytree of outputs ----------------------------------------------------------------------

@pytest.mark.parametrize("tie,regional", [pytest.param(False, True, marks=pytest.mark.slow), (True, True), (False, False)])
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


def _tiny_llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _dp_llama_worker(rank, world, init_method, out):
    """One rank of ``test_a_transformers_model_on_a_dp_mesh_of_processes_trains_as_eager``: its own rows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    inner = _tiny_llama()
    model = nvtp.jit(inner, plan="replicate", mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    mine = ids[rank * 2:(rank + 1) * 2]
    output = model(mine, labels=mine)
    output.loss.backward()  # torch gives the logits' gradient as None: the backward needs zeros of this rank's rows
    grads = _grads(inner)
    if rank == 0:
        torch.save({"logits": output.logits.detach(), "grads": grads}, out)
    dist.destroy_process_group()
    return 0


def test_a_transformers_model_on_a_dp_mesh_of_processes_trains_as_eager(tmp_path):
    """A transformers Llama on a dp mesh of 2 processes, each passing its own rows, the loss
    differentiated and not the logits: the gradients of the mean loss over the whole batch, as
    eager's. The logits' missing gradient was made for the whole batch (``The size of tensor a (4)
    must match the size of tensor b (2)`` in the backward, on FX-traced models)."""
    pytest.importorskip("transformers")
    from nvtp.execute.launch import spawn

    out = tmp_path / "r.pt"
    codes = spawn(_dp_llama_worker, 2, str(out))
    assert list(codes) == [0, 0], codes.summary()
    got = torch.load(out, weights_only=False)
    ref = _tiny_llama()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    want = ref(ids, labels=ids)
    want.loss.backward()
    assert relative_error(got["logits"], want.logits[:2])[0] <= 1e-5
    _check_like_eager(got["grads"], _grads(ref), tol=1e-4)


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



def test_the_thunder_transform_runs_a_tied_model_returning_logits_and_loss_as_eager():
    """``thunder.jit(model, transforms=[nvtp.ShardingTransform(...)])`` runs the same per-rank step
    (RankProgram): the tied head is one weight, each output gets its own gradient."""
    import thunder

    cfg = GPTConfig(tie=True, n_layer=2)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    idx, targets = tokens(cfg)
    jm = thunder.jit(model, transforms=[nvtp.ShardingTransform(plan="megatron", mesh=1)])
    logits, loss = jm(idx, targets)
    (3 * loss + logits.pow(2).mean()).backward()
    want_logits, want = ref(idx, targets)
    (3 * want + want_logits.pow(2).mean()).backward()
    assert relative_error(loss, want)[0] <= 1e-5 and relative_error(logits, want_logits)[0] <= 1e-5
    _check_like_eager({n: p.grad for n, p in jm.named_parameters()}, _grads(ref))


def test_a_call_without_targets_returns_logits_and_none_and_trains():
    """``model(idx)``: nanoGPT's ``(logits[:, [-1], :], None)``; the list index is a slice to nvtp,
    and a loss made outside from those logits trains as eager."""
    cfg = GPTConfig(tie=True, n_layer=1)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    idx, _ = tokens(cfg)
    logits, loss = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1))(idx)
    want, _ = ref(idx)
    assert loss is None and logits.shape == want.shape == (2, 1, cfg.vocab_size)
    assert relative_error(logits, want)[0] <= 1e-5
    logits.pow(2).mean().backward()
    want.pow(2).mean().backward()
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
from typing import NamedTuple  # noqa: E402


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
    with pytest.raises(CaptureError, match=r"_ReturnsItsInput.forward \(.*test_written.py:\d+\) returns y\[1\], a tensor nvtp's "
                                           r"forward fusion does not compute .*return a value the model computes from it"):
        nvtp.jit(_ReturnsItsInput(), plan="replicate", mesh=DeviceMesh.of_size(1))(torch.randn(4, 8))


class _ReturnsANamedTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return LogitsAndLoss(y, y.pow(2).mean())


class LogitsAndLoss(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor


def test_a_named_tuple_output_thunder_cannot_rebuild_is_named_with_what_to_return_instead():
    with pytest.raises(CaptureError, match=r"returns a NamedTuple \(LogitsAndLoss\), which Thunder cannot rebuild: return a tuple, "
                                           r"a dict or a dataclass instead"):
        nvtp.jit(_ReturnsANamedTuple(), plan="replicate", mesh=DeviceMesh.of_size(1))(torch.randn(4, 8))



def test_the_fx_route_takes_a_tied_head_logits_and_loss_and_equal_gradients():
    """The same constructs through TorchDynamo's graph (frontend="fx", the route transformers models
    take): a tied head, (logits, loss) with ignored targets, two biases with one gradient."""
    cfg = GPTConfig(tie=True, parallel_residual=True, n_layer=1)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    idx, targets = tokens(cfg, ignored=2)
    logits, loss = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1), frontend="fx")(idx, targets)
    loss.backward()
    want_logits, want = ref(idx, targets)
    want.backward()
    assert relative_error(loss, want)[0] <= 1e-5 and relative_error(logits, want_logits)[0] <= 1e-5
    _check_like_eager(_grads(model), _grads(ref))
    assert model.lm_head.weight is model.transformer.wte.weight

# -- 4. attributes reassigned in forward; cross entropy's ignore_index ------------------------------

@pytest.mark.slow  # 9 s: the sharded test below runs the same model on 2 ranks against eager
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


def _gpt_fast_like():
    from tests.written import LlamaArgs, TinyGptFast

    args = LlamaArgs()
    torch.manual_seed(0)
    model = TinyGptFast(args)
    model.setup_caches(args.max_seq_len)
    return model, args


def test_tensor_attributes_set_up_before_the_call_train_sharded_as_eager():
    """gpt-fast's ``self.freqs_cis`` and ``self.causal_mask``, plain attributes made by
    ``setup_caches`` and only read in forward (before: ``KeyError: 't_causal_mask'`` from
    nvtp/execute/step.py): module state, named by their paths, passed from the module."""
    model, args = _gpt_fast_like()
    idx, targets = tokens(args)
    ranks = _train_on_simulated_mesh(model, (idx,), 2, "megatron",
                                     loss_of=lambda logits: nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    f = ranks[0].last.traced.forward
    assert {"freqs_cis", "causal_mask"} <= {f.label(v.name) for v in f.inputs}
    assert ranks[0].placement("layers.0.attention.wq.weight") != ranks[0].placement("norm.weight")  # it did split


def _reassigns_its_state():
    """gpt-fast's tensor attributes, and a buffer that ``forward`` reassigns as CTRL does
    (``self.pos_encoding = self.pos_encoding.to(device, dtype)``: the same tensor)."""
    from tests.written import TinyGptFast

    class ReassignsItsState(TinyGptFast):
        def forward(self, tokens):
            self.scale = self.scale.to(device=tokens.device, dtype=torch.float32)
            return super().forward(tokens) * self.scale

    model, args = _gpt_fast_like()
    model.__class__ = ReassignsItsState
    model.register_buffer("scale", torch.linspace(0.5, 1.5, args.vocab_size), persistent=False)
    return model, args


class _Table(nn.Module):
    """A sinusoid table kept as a plain attribute and a scale buffer that forward reassigns (CTRL)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.table = torch.sin(torch.arange(32.0)).reshape(4, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8), persistent=False)

    def forward(self, x):
        self.scale = self.scale.to(device=x.device, dtype=x.dtype)
        return self.proj(x + self.table) * self.scale


def test_a_tensor_attribute_and_a_reassigned_buffer_through_the_fx_route_match_eager():
    torch.manual_seed(0)
    model = _Table()
    ref, scale = copy.deepcopy(model), model.scale
    x = torch.randn(4, 8)
    jitted = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1), frontend="fx")
    out = jitted(x)
    out.pow(2).sum().backward()
    want = ref(x)
    want.pow(2).sum().backward()
    assert relative_error(out, want)[0] <= 1e-6
    _check_like_eager(_grads(model), _grads(ref))
    f = jitted.last.traced.forward
    assert {"table", "scale"} <= {f.label(v.name) for v in f.inputs}
    assert model.scale is scale


class _MakesTensorsLikeItsInput(nn.Module):
    """``x.new_zeros`` and its kin, which Thunder runs only opaquely (DeepSeek-V4's compressor: an
    empty ``new_zeros((batch, 0, head_dim))`` concatenated to its keys)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        h = torch.cat([h, h.new_zeros((x.shape[0], 0, 8))], dim=1)
        return h * h.new_full((8,), 2.0) + h.new_ones(x.shape[-1]) - h.new_zeros(x.shape[0], 1, 8) + h.new_empty(0).sum()


def test_new_zeros_and_its_kin_through_the_fx_route_match_eager():
    torch.manual_seed(0)
    model = _MakesTensorsLikeItsInput()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, 8)
    out = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1), frontend="fx")(x)
    out.pow(2).sum().backward()
    want = ref(x)
    want.pow(2).sum().backward()
    assert relative_error(out, want)[0] <= 1e-6
    _check_like_eager(_grads(model), _grads(ref))


class _CausalConv(nn.Module):
    """A depthwise causal conv1d, as Mamba-like models (Bamba, Falcon-H1, Falcon-Mamba) mix tokens."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 4, groups=8, padding=3)

    def forward(self, x):
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


def test_a_convolution_on_the_fx_route_is_refused_before_thunder_traces_naming_its_line(monkeypatch):
    from nvtp.frontend import fx
    from nvtp.frontend.failures import MissingOpError

    def traced(*_, **__):
        raise AssertionError("Thunder traced the graph: the convolution was not refused first")

    monkeypatch.setattr(fx, "capture", traced)
    with pytest.raises(MissingOpError, match=r"convolution .*test_written.py:\d+ `return self.conv"):
        nvtp.jit(_CausalConv(), plan="replicate", mesh=DeviceMesh.of_size(1), frontend="fx")(torch.randn(2, 5, 8))


@pytest.mark.slow  # 56 s on the shared machine: the test above runs both through the FX route in seconds
def test_tensor_attributes_and_a_reassigned_buffer_train_sharded_as_eager_through_the_fx_route():
    """The same attributes through TorchDynamo's graph (the route transformers models take): dynamo
    reads them as attributes of the model, which nvtp names by their paths and passes whole (before:
    ``CaptureError ... neither a parameter nor a buffer of the model (L__self___freqs_cis, ...)``).
    A buffer reassigned in forward stays the module's (before: dynamo's export left a FakeTensor in
    its place, and CTRL failed with the same error)."""
    model, args = _reassigns_its_state()
    scale = model.scale
    idx, targets = tokens(args)
    ranks = _train_on_simulated_mesh(model, (idx,), 2, "megatron", frontend="fx",
                                     loss_of=lambda logits: nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    f = ranks[0].last.traced.forward
    assert {"freqs_cis", "causal_mask", "scale"} <= {f.label(v.name) for v in f.inputs}
    assert ranks[0].last.traced.route == "fx"
    assert all(type(m.module.scale) is torch.Tensor for m in ranks) and model.scale is scale


@pytest.mark.slow  # 20 s: nvtp.jit runs these attributes in the default tier, the transform runs a tied model there
def test_tensor_attributes_set_up_before_the_call_train_under_the_thunder_transform():
    import thunder

    model, args = _gpt_fast_like()
    ref = copy.deepcopy(model)
    idx, _ = tokens(args)
    jm = thunder.jit(model, transforms=[nvtp.ShardingTransform(plan="megatron", mesh=1)])
    out = jm(idx)
    out.pow(2).mean().backward()
    want = ref(idx)
    want.pow(2).mean().backward()
    assert relative_error(out, want)[0] <= 1e-5
    _check_like_eager({n: p.grad for n, p in jm.named_parameters()}, _grads(ref))


def test_a_tensor_attribute_the_program_reads_gone_from_the_module_is_named():
    from nvtp.errors import InputError

    model, args = _gpt_fast_like()
    idx, _ = tokens(args)
    jitted = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1))
    jitted(idx)
    model.causal_mask = None
    with pytest.raises(InputError, match=r"the program reads causal_mask \(.*\), which TinyGptFast holds neither as a parameter, "
                                         r"a buffer nor a tensor attribute"):
        jitted(idx)


@pytest.mark.parametrize("plan", [pytest.param("replicate", marks=pytest.mark.slow), "megatron"])  # megatron's is the sharded case
def test_cross_entropy_ignores_targets_of_minus_one_as_eager(plan):
    """nanoGPT's ``F.cross_entropy(..., ignore_index=-1)``: the mean over the other targets, and no
    gradient from the ignored ones; megatron splits the vocabulary (a parallel cross entropy)."""
    cfg = GPTConfig(tie=True)
    torch.manual_seed(0)
    idx, targets = tokens(cfg, ignored=5)
    assert (targets == -1).sum() == 10
    _train_on_simulated_mesh(TinyGPT(cfg), (idx, targets), 2, plan, loss_of=lambda out: out[1])


def test_a_function_attribute_closing_over_submodules_traces_the_models_own_weights():
    """minGPT keeps its MLP as ``self.mlpf = lambda x: m.c_proj(...)`` over ``m = self.mlp``: a
    deep copy (nvtp traces a meta copy) shares the function, so the copy called the original's
    real weights ("Expected a.device=meta and bias.device=cpu") until nvtp.driver.meta_copy
    rebinds such closures to the copy's modules."""
    cfg = GPTConfig(tie=False, mlp_closure=True)
    idx, targets = tokens(cfg)

    def build():
        torch.manual_seed(0)
        return TinyGPT(cfg)

    ref, jitted = build(), nvtp.jit(build(), plan="replicate", mesh=DeviceMesh.of_size(1))
    got, want = jitted(idx, targets)[1], ref(idx, targets)[1]
    got.backward()
    want.backward()
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    grads = {n: p.grad for n, p in jitted.module.named_parameters()}
    assert grads["transformer.h.0.mlp_parts.fc.weight"] is not None
    _check_like_eager(grads, _grads(ref))


def test_a_closure_over_a_module_the_model_does_not_hold_is_named_not_blamed_on_the_arguments():
    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            other = nn.Linear(8, 8)  # not registered: the model does not hold it
            self.f = lambda x: other(x)

        def forward(self, x):
            return self.f(self.fc(x)).sum()

    with pytest.raises(CaptureError, match=r"Hidden.forward reads a tensor in linear at .*test_written.py:\d+ .*that is not the "
                                           r"module's state .*keep it on a module"):
        nvtp.jit(Hidden(), plan="replicate", mesh=DeviceMesh.of_size(1))(torch.randn(2, 8))


# -- 5. the model's own interface on the object nvtp.jit returns ------------------------------------

def test_eval_inference_traces_no_backward_and_training_afterwards_gets_its_own_program():
    cfg = GPTConfig(tie=True, dropout=0.1)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    jitted = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1))
    idx, targets = tokens(cfg)
    jitted.eval()
    ref.eval()
    with torch.no_grad():
        logits, loss = jitted(idx)  # targets=None: the last position's logits, loss None
        want, _ = ref(idx)
    assert loss is None and logits.shape == (2, 1, cfg.vocab_size) and relative_error(logits, want)[0] <= 1e-5
    assert jitted.last.backward is None  # nothing traced for a backward nobody runs
    jitted.train()
    with torch.no_grad():  # training mode, no autograd: a forward-only program...
        jitted(idx, targets)
    assert jitted.last.backward is None
    _, loss = jitted(idx, targets)  # ...which the same call with autograd on does not reuse
    assert jitted.last.backward is not None
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_models_own_methods_run_on_the_sharded_model_generate_gives_eagers_tokens():
    """nanoGPT's ``model.generate(idx, n, top_k=1)`` calls ``self(idx_cond)`` on ever longer
    prompts: through the object nvtp.jit returns it runs the sharded program, a forward-only
    program per length (under no_grad new shapes need no dynamic=True)."""
    cfg = GPTConfig(tie=True, n_layer=1)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    jitted = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1))
    assert jitted.config is model.config and jitted.transformer is model.transformer  # the model's attributes
    with pytest.raises(AttributeError, match=r"'ShardedModule' object has no attribute 'no_such_thing', nor has the model it wraps \(TinyGPT\)"):
        jitted.no_such_thing
    prompt = tokens(cfg)[0][:, : cfg.block_size - 1]
    jitted.eval()
    ref.eval()
    got = jitted.generate(prompt, 3, top_k=1)  # lengths 15, 16, then cropped to 16
    assert torch.equal(got, ref.generate(prompt, 3, top_k=1))
    assert len(jitted._compiled) == 2 and all(c.backward_fusion is None for c in jitted._compiled.values())


def test_configure_optimizers_through_the_sharded_model_trains_as_eager():
    # No biases: the key projection's bias has a gradient of zero in exact arithmetic (softmax does
    # not see a constant added to every key), rounding noise there, and AdamW scales noise to lr.
    cfg = GPTConfig(tie=True, bias=False)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ref = copy.deepcopy(model)
    jitted = nvtp.jit(model, plan="replicate", mesh=DeviceMesh.of_size(1))
    opt = jitted.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    ref_opt = ref.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    idx, targets = tokens(cfg)
    for _ in range(2):
        for m, o in ((jitted, opt), (ref, ref_opt)):
            o.zero_grad()
            m(idx, targets)[1].backward()
            o.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert relative_error(p, q)[0] <= 1e-4, n


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_torchs_state_dict_helpers_take_the_object_nvtp_jit_returns(one_process_group):
    """``get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))`` gives the
    model's own keys, as on a DDP- or FSDP-wrapped model; ``set_model_state_dict`` loads them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict

    cfg = GPTConfig(tie=True, n_layer=1)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    fresh = copy.deepcopy(model)
    jitted = nvtp.jit(model, plan="megatron")
    opt = jitted.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    idx, targets = tokens(cfg)
    jitted(idx, targets)[1].backward()
    opt.step()
    full = StateDictOptions(full_state_dict=True)
    got = get_model_state_dict(jitted, options=full)
    assert list(got) == list(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], nvtp.full_tensor(v)), k
    _, optim = get_state_dict(jitted, opt, options=full)
    assert len(optim["state"]) == len(list(model.parameters()))
    set_model_state_dict(jitted, fresh.state_dict(), options=full)
    for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(nvtp.full_tensor(p), q), n
    assert model.lm_head.weight is model.transformer.wte.weight


def _nanogpt_like_worker(rank, world, init_method, out):
    """One rank of ``test_a_tied_gpt_trains_generates_and_checkpoints_on_two_processes``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    cfg = GPTConfig(tie=True, bias=False)
    torch.manual_seed(0)
    model = nvtp.jit(TinyGPT(cfg), plan="megatron")
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")  # before the first call, as nanoGPT's train.py does
    idx, targets = tokens(cfg, ignored=3)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        logits, loss = model(idx, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    inner = model.module
    split = isinstance(inner.lm_head.weight, DTensor) and inner.lm_head.weight.to_local().shape[0] == cfg.vocab_size // world
    model.eval()
    generated = model.generate(idx[:, : cfg.block_size - 1], 2, top_k=1)
    if rank == 0:
        torch.save({"losses": losses, "state": state, "split": split, "tied": inner.lm_head.weight is inner.transformer.wte.weight,
                    "generated": generated, "keys": list(state)}, out)
    dist.destroy_process_group()
    return 0


@pytest.mark.slow
def test_a_tied_gpt_trains_generates_and_checkpoints_on_two_processes(tmp_path):
    """On 2 processes with DTensor parameters: nanoGPT's way of training (configure_optimizers'
    AdamW, ``(logits, loss)``, ignore_index), the tied head split once, generate, and
    ``get_model_state_dict`` on the object nvtp.jit returns; all as one plain process."""
    from nvtp.execute.launch import spawn

    out = tmp_path / "r.pt"
    assert spawn(_nanogpt_like_worker, 2, str(out)) == [0, 0]
    got = torch.load(out, weights_only=False)
    cfg = GPTConfig(tie=True, bias=False)
    torch.manual_seed(0)
    ref = TinyGPT(cfg)
    opt = ref.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    idx, targets = tokens(cfg, ignored=3)
    for step in range(3):
        opt.zero_grad()
        _, loss = ref(idx, targets)
        loss.backward()
        opt.step()
        assert abs(got["losses"][step] - loss.item()) <= 1e-5 * loss.item(), (step, got["losses"][step], loss.item())
    assert got["split"] and got["tied"] and got["keys"] == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert relative_error(got["state"][k], v)[0] <= 1e-4, k
    ref.eval()
    assert torch.equal(got["generated"], ref.generate(idx[:, : cfg.block_size - 1], 2, top_k=1))
