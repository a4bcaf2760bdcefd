"""What the first run of nvtp's fusions on a real GPU found (H100, nvfuser_direct 0.2.36,
2026-11-22), each fixed on the CPU side and tested here without a GPU:

1. nvFuser's ``mod`` is C's ``%``, integers only: a float ``mod`` is refused naming fmod and
   remainder, and Thunder's translation never emits ``mod``.
2. welford's count comes out in nvFuser's index type (int32): ``execute`` widens it to the Int
   nvtp declares.
3. ``embedding_fwd``'s padding_idx changes only the gradient (as torch's F.embedding).
4./6. ``--check`` on nvFuser leaves out what no CPU can recompute: the Philox RNG state and every
   output downstream of a random op (nvFuser's Philox stream is not torch's generator).
5. ``sdpfa_bwd`` computes the gradients FROM the given logsumexp and output, as flash / cuDNN do.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nvtp import cli, dump
from nvtp.dump import eager
from nvtp.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_OK
from nvtp.execute import nvfuser, reference
from nvtp.ir import DType, FusionBuilder
from tests.dumps import tiny_dump

F64, BOOL, U64 = DType.Double, DType.Bool, DType.UInt64

# ---------------------------------------------------------------------------------------------
# 1. mod

FLOAT_MOD = """\
import torch
from nvfuser_direct import FusionDefinition, DataType

def nvfuser_fusion_id0(fd : FusionDefinition) -> None :
    T0 = fd.define_tensor(shape=[8], contiguity=[True], dtype=DataType.Float, is_cpu=False, stride_order=[0])
    T1 = fd.ops.mod(T0, 3.0)
    fd.add_output(T1)

with FusionDefinition() as fd:
    nvfuser_fusion_id0(fd)
"""


def test_a_float_mod_is_refused_naming_fmod_and_remainder(tmp_path, capsys):
    path = tmp_path / "float_mod.py"
    path.write_text(FLOAT_MOD)
    assert cli.main(["replay", str(path), "--check"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"{path}:6:" in err and "fd.ops.mod takes integer" in err
    assert "fd.ops.fmod" in err and "fd.ops.remainder" in err and "Traceback" not in err
    # An integer mod with an integer number is C's %: the sign of the dividend.
    path.write_text(FLOAT_MOD.replace("DataType.Float", "DataType.Int").replace("3.0", "3"))
    report = dump.replay(dump.load(path).fusion, inputs=[torch.tensor([-7, -5, -3, -1, 0, 1, 5, 7])], check=True)
    assert report.outputs[0].tolist() == [-1, -2, 0, -1, 0, 1, 2, 1] and report.ok


def test_thunder_translates_torch_remainder_and_fmod_never_to_mod():
    """torch.remainder (what Python's % computes) and torch.fmod on floats become nvFuser's
    remainder and fmod, which it runs on floats; nothing nvtp traces is a float mod."""
    from nvtp.frontend.capture import capture

    class Mods(torch.nn.Module):
        def forward(self, x, y, i):
            return torch.remainder(x, y), torch.fmod(x, 2.5), torch.remainder(i, 3), torch.fmod(i, 3)

    x, y, i = torch.randn(4, 8), torch.rand(4, 8) + 0.5, torch.randint(-9, 9, (4, 8))
    fusion = capture(Mods(), x, y, i, backward=False).forward
    kinds = [op.kind for op in fusion.compute_ops()]
    assert kinds == ["remainder", "fmod", "remainder", "fmod"]
    outputs = reference.run(fusion, [x, y, i])
    for got, want in zip(outputs, Mods()(x, y, i)):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# 2. welford's count


def test_welford_count_comes_back_as_the_declared_int64():
    b = FusionBuilder("welford")
    mean, m2, n = b.op("welford", b.define_tensor([2, 8, 16], DType.Float), dims=[1])
    for v in (mean, m2, n):
        b.add_output(v)
    f = b.build()
    assert n.dtype is DType.Int
    index_typed = [torch.zeros(2, 16), torch.zeros(2, 16), torch.full((2, 16), 8, dtype=torch.int32)]  # as nvFuser gives them
    out = nvfuser.as_declared(f, index_typed)
    assert [o.dtype for o in out] == [torch.float32, torch.float32, torch.int64]
    assert torch.equal(out[2], torch.full((2, 16), 8)) and out[0] is index_typed[0]


# ---------------------------------------------------------------------------------------------
# 3. embedding's padding_idx


def test_embedding_padding_idx_changes_only_the_gradient():
    b = FusionBuilder("embedding")
    b.add_output(b.op("embedding_fwd", b.define_tensor([2, 8], DType.Int), b.define_tensor([32, 16], DType.Float), padding_idx=3))
    f = b.build()
    idx, w = torch.arange(16).reshape(2, 8) % 5, torch.randn(32, 16)
    want = F.embedding(idx, w, padding_idx=3)
    assert want[0, 3].abs().sum() > 0  # the padding row is looked up, not zeroed
    assert torch.equal(reference.run(f, [idx, w])[0], want)
    assert torch.equal(eager.evaluate(f, [idx, w])[0].float(), want)


# ---------------------------------------------------------------------------------------------
# 5. sdpfa_bwd from the given logsumexp and output

B, H, S, D = 1, 2, 8, 4


def _bwd_fusion(causal: bool, scale: float | None):
    b = FusionBuilder("sdpfa_bwd")
    go, q, k, v, out = (b.define_tensor([B, H, S, D], F64) for _ in range(5))
    lse = b.define_tensor([B, H, S], DType.Float)
    seed, offset = b.define_tensor([2], U64), b.define_tensor([], U64)
    for g in b.op("sdpfa_bwd", go, q, k, v, out, lse, dropout_p=0.0, is_causal=causal, philox_seed=seed,
                  philox_offset=offset, scale=scale):
        b.add_output(g)
    return b.build()


def _attention(q, k, v, causal, scale, keep=None, p=0.0):
    scores = q @ k.transpose(-1, -2) * (D**-0.5 if scale is None else scale)
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), -math.inf)
    weights = torch.softmax(scores, -1)
    if keep is not None:
        weights = weights * keep / (1 - p)
    return weights @ v, torch.logsumexp(scores, -1)


def _flash_formula(go, q, k, v, out, lse, causal, scale):
    """The backward as flash / cuDNN define it, written out plainly in float64."""
    scale = D**-0.5 if scale is None else scale
    p = torch.exp(q @ k.transpose(-1, -2) * scale - lse.double()[..., None])
    if causal:
        p = p * torch.ones(S, S).tril()
    dp = go @ v.transpose(-1, -2)
    ds = p * (dp - (go * out).sum(-1, keepdim=True))
    return [scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ go]


def _qkv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(4)]


def _run_both(f, inputs):
    return {"reference": reference.run(f, inputs), "eager": eager.evaluate(f, inputs)}


@pytest.mark.parametrize("causal,scale", [(True, None), (False, 0.3)])
def test_sdpfa_bwd_with_a_consistent_forward_is_autograds_gradient(causal, scale):
    go, q, k, v = _qkv(0)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = _attention(*leaves, causal, scale)
    want = torch.autograd.grad(out, leaves, go)
    inputs = [go, q, k, v, out.detach(), lse.detach().float(), torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)]
    for name, got in _run_both(_bwd_fusion(causal, scale), inputs).items():
        for g, w in zip(got, want):  # lse rounded to float32 as nvFuser keeps it: ~1e-7 relative
            torch.testing.assert_close(g.double(), w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_sdpfa_bwd_uses_the_given_logsumexp_and_output():
    """An lse and out that q, k, v did not produce change the gradients as nvFuser's kernel has
    them (an implementation that re-runs the forward ignores both): lse + 1 scales every
    attention weight, hence every gradient, by e^-1; out enters through rowsum(dO ∘ out)."""
    go, q, k, v = _qkv(1)
    out, lse = _qkv(2)[0], torch.randn(B, H, S, dtype=torch.float64).float()
    seeds = [torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)]
    f = _bwd_fusion(True, None)
    want = _flash_formula(go, q, k, v, out, lse, True, None)
    base = _run_both(f, [go, q, k, v, out, lse, *seeds])
    shifted = _run_both(f, [go, q, k, v, out, lse + 1, *seeds])
    for name in base:
        for g, g1, w in zip(base[name], shifted[name], want):
            torch.testing.assert_close(g.double(), w, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(g1.double(), g.double() * math.exp(-1), rtol=1e-6, atol=1e-6)
    consistent = _attention(q, k, v, True, None)[0]
    recomputed = reference.run(f, [go, q, k, v, consistent, lse, *seeds])[0]
    assert (recomputed - base["reference"][0]).abs().max() > 0.1  # out matters


def test_sdpfa_bwd_with_dropout_is_autograds_gradient_through_the_same_mask():
    """With dropout (p = 0.25) the reference and the eager evaluation draw the mask from the
    forward's seed and offset (their shared, documented stream); the backward in one fusion with
    that forward is autograd's gradient through softmax · keep / (1 - p)."""
    b = FusionBuilder("attention")
    q, k, v, go = (b.define_tensor([B, H, S, D], F64) for _ in range(4))
    out, lse, seed, offset = b.op("sdpfa_fwd", q, k, v, dropout_p=0.25, is_causal=True, scale=None)
    for t in (out, *b.op("sdpfa_bwd", go, q, k, v, out, lse, dropout_p=0.25, is_causal=True, philox_seed=seed,
                          philox_offset=offset, scale=None)):
        b.add_output(t)
    f = b.build()
    go_, q_, k_, v_ = _qkv(3)
    for name, (out_, gq, gk, gv) in _run_both(f, [q_, k_, v_, go_]).items():
        # the mask drawn from the forward's seed and offset, by the stream both implementations restate
        keep = eager._keep_mask(*_seed_and_offset(f, [q_, k_, v_, go_]), (B, H, S, S), 0.25)
        assert 0 < keep.sum() < keep.numel()
        leaves = [t.clone().requires_grad_(True) for t in (q_, k_, v_)]
        ref_out, _ = _attention(*leaves, True, None, keep.double(), 0.25)
        torch.testing.assert_close(out_.double(), ref_out.detach(), rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for g, w in zip((gq, gk, gv), torch.autograd.grad(ref_out, leaves, go_)):
            torch.testing.assert_close(g.double(), w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _seed_and_offset(f, inputs):
    """The RNG seed and offset the forward draws (the same fusion, returning them)."""
    op = next(op for op in f.ops if op.kind == "sdpfa_fwd")
    seed, offset = reference.run(f.with_ops(f.ops, (op.outputs[2], op.outputs[3])), inputs)
    return seed, offset


def _other(x: torch.Tensor) -> torch.Tensor:
    """Other values of ``x``'s dtype: a flipped mask, a shifted seed, x + 1."""
    if x.dtype == torch.bool:
        return ~x
    if x.dtype == torch.uint64:  # torch has no add for UInt64
        return (x.view(torch.int64) + 1).view(torch.uint64)
    return x + 1


# ---------------------------------------------------------------------------------------------
# 4. and 6. what --check compares on nvFuser


def _random_outputs(fusion, inputs_a, inputs_b, seed_b: int = 0) -> set[str]:
    """Outputs that differ between two reference runs (another RNG seed, or other philox inputs):
    exactly the outputs that depend on random numbers, found without nvtp's dataflow walk."""
    a = reference.run(fusion, inputs_a, seed=0)
    b = reference.run(fusion, inputs_b, seed=seed_b)
    return {v.name for v, x, y in zip(fusion.outputs, a, b) if not torch.equal(x, y)}


def test_the_nvfuser_check_leaves_out_rng_state_and_what_depends_on_random_ops():
    fwd, bwd = (dump.load(p).fusion for p in tiny_dump("bf16", 0.1))
    # forward: dropout masks, and attention with dropout_p 0.1
    inputs = dump.random_inputs(fwd)
    rng_state = {v.name for v in fwd.outputs if v.dtype is U64}  # the seed (differs) and the offset (need not)
    differ = _random_outputs(fwd, inputs, inputs, seed_b=1) | rng_state
    assert len(rng_state) == 2 and len(differ) >= 6 and len(differ) < len(fwd.outputs)
    fake_nvfuser = [_other(x) if v.name in differ else x for v, x in zip(fwd.outputs, reference.run(fwd, inputs))]
    expected = eager.evaluate(fwd, inputs)
    checks = dump.check_outputs(fwd, fake_nvfuser, expected, backend="nvfuser")
    left = {c.name: c.not_compared for c in checks if not c.compared}
    assert left == {n: dump.RNG_STATE if n in rng_state else dump.RANDOM for n in differ}
    assert all(c.ok for c in checks) and sum(c.compared for c in checks) == len(fwd.outputs) - len(differ)
    # the reference reproduces the random numbers: there the check compares everything, as before
    ref_checks = dump.check_outputs(fwd, fake_nvfuser, expected)
    assert all(c.compared for c in ref_checks) and {c.name for c in ref_checks if not c.ok} == differ
    # a wrong value nvFuser computes from no random number still fails
    lse = next(v.name for v in fwd.outputs if v.name not in differ and v.dtype is DType.Float and v.ndim == 3)
    wrong = [x + 1 if v.name == lse else x for v, x in zip(fwd.outputs, fake_nvfuser)]
    assert [c.name for c in dump.check_outputs(fwd, wrong, expected, backend="nvfuser") if not c.ok] == [lse]

    # backward: its masks are inputs (compared), but sdpfa_bwd regenerates attention dropout from
    # the philox seed and offset it is given, so every gradient upstream of attention is random.
    inputs = dump.random_inputs(bwd)
    other = [_other(x) if isinstance(x, torch.Tensor) and x.dtype == torch.uint64 else x for x in inputs]
    differ = _random_outputs(bwd, inputs, other)
    assert 0 < len(differ) < len(bwd.outputs)
    checks = dump.check_outputs(bwd, reference.run(bwd, inputs), eager.evaluate(bwd, inputs), backend="nvfuser")
    assert {c.name for c in checks if not c.compared} == differ
    assert {c.not_compared for c in checks if not c.compared} == {dump.RANDOM}


def _fake_gpu(monkeypatch, perturb):
    """`--backend nvfuser` on this CPU: nvFuser's run stood in for by the reference's outputs
    with ``perturb`` applied (nvFuser's random numbers are other numbers)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(nvfuser, "execute", lambda f, inputs: [perturb(v, x) for v, x in zip(f.outputs, reference.run(f, inputs))])


def test_replay_on_nvfuser_reports_what_it_did_not_compare(monkeypatch, capsys):
    fwd_path = tiny_dump("bf16", 0.1)[0]
    fwd = dump.load(fwd_path).fusion
    inputs = dump.random_inputs(fwd)
    differ = _random_outputs(fwd, inputs, inputs, seed_b=1) | {v.name for v in fwd.outputs if v.dtype is U64}
    _fake_gpu(monkeypatch, lambda v, x: _other(x) if v.name in differ else x)
    assert cli.main(["replay", str(fwd_path), "--backend", "nvfuser", "--check"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.count("not compared (RNG state)") == 2
    assert out.count("not compared (depends on nvFuser's random numbers)") == len(differ) - 2
    assert "FAIL" not in out
    n = len(fwd.outputs)
    assert (f"(eager PyTorch, float64): passed; {n - len(differ)} of {n} outputs compared, {len(differ)} not compared "
            f"(2 RNG state, {len(differ) - 2} depend on nvFuser's random numbers)") in out
    assert "--config tiny --dtype bf16 --dropout 0" in out.splitlines()[-1]

    # without dropout only the RNG state is left out, and nothing asks for another dump
    plain_path = tiny_dump("bf16", None)[0]
    _fake_gpu(monkeypatch, lambda v, x: x)
    assert cli.main(["replay", str(plain_path), "--backend", "nvfuser", "--check"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.count("not compared (RNG state)") == 2 and "random numbers" not in out and "--dropout" not in out

    # a compared output nvFuser gets wrong fails the replay, with the rest still left out
    _fake_gpu(monkeypatch, lambda v, x: x * 2 if v.dtype is DType.BFloat16 and v.name not in differ else x)
    assert cli.main(["replay", str(fwd_path), "--backend", "nvfuser", "--check"]) == EXIT_CHECK_FAILED
    out = capsys.readouterr().out
    assert "FAIL" in out and "(eager PyTorch, float64): FAILED;" in out and "not compared (RNG state)" in out
