"""``compile="kernels"`` (nvtp/execute/kernels.py): each group of a rank's program that has a fused
torch kernel runs as it, with the values and gradients of the interpreter (``compile="none"``)
and of eager PyTorch on one process, computed independently of nvtp.

Each model is run three ways on one process: eager PyTorch (its own modules), nvtp with the
kernels, nvtp op by op. Each pattern must have fused (by name, so a pattern that stops matching
fails here), and the loss and every gradient must agree within float32 rounding."""

from __future__ import annotations

import copy

import pytest
import torch

import nvtp
from nvtp.errors import InputError
from nvtp.execute import reference
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh

# what each model's forward and backward must run as kernels
GPT_KERNELS = {"forward": {"log_softmax": 1, "nll_loss": 1, "layer_norm": 5, "gelu": 2, "flash_attention": 2,
                           "causal_attention_probs": 0, "softmax": 0},
               "backward": {"log_softmax_backward": 1, "nll_loss_backward": 1, "embedding_backward": 1,
                            "layer_norm_backward": 5, "gelu_backward": 2, "flash_attention_backward": 2, "softmax_backward": 0}}
LLAMA_KERNELS = {"forward": {"log_softmax": 1, "nll_loss": 1, "rms_norm": 5, "silu": 2, "flash_attention": 2, "softmax": 0},
                 "backward": {"log_softmax_backward": 1, "nll_loss_backward": 1, "embedding_backward": 1,
                              "rms_norm_backward": 5, "silu_backward": 2, "flash_attention_backward": 2, "softmax_backward": 0}}


def _fused(sm) -> dict[str, dict[str, int]]:
    return {phase: reference.fused_patterns(sharded.fusion) for phase, sharded in sm.last.phases()}


def _step(model, loss_of, *args, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = loss_of(model(*args, **kwargs))
    loss.backward()
    inner = getattr(model, "module", model)
    return loss.detach(), {n: p.grad.clone() for n, p in inner.named_parameters()}


def _close(got, want, what: str, tol: float = 2e-5) -> None:
    loss, grads = got
    want_loss, want_grads = want
    assert abs(loss.item() - want_loss.item()) <= tol * max(1.0, abs(want_loss.item())), f"{what}: loss {loss.item()} vs {want_loss.item()}"
    assert grads.keys() == want_grads.keys()
    for n, g in grads.items():
        scale = want_grads[n].abs().max().item() or 1.0
        err = (g - want_grads[n]).abs().max().item() / scale
        assert err <= tol, f"{what}: gradient of {n} differs by {err:.2e} of its largest entry"


def _three_ways(model, loss_of, *args, **kwargs):
    """(eager, kernels, interpreter) results of one step of copies of ``model``, and the kernels' fusion counts."""
    eager = _step(copy.deepcopy(model), loss_of, *args, **kwargs)
    sm = nvtp.jit(copy.deepcopy(model), mesh=DeviceMesh.of_size(1))
    kernels = _step(sm, loss_of, *args, **kwargs)
    fused = _fused(sm)
    interpreted = nvtp.jit(copy.deepcopy(model), mesh=DeviceMesh.of_size(1), compile="none").share_compiled(sm)  # one trace
    none = _step(interpreted, loss_of, *args, **kwargs)
    assert _fused(interpreted) == fused  # the op-by-op lowering fused nothing
    return eager, kernels, none, fused


def _expect(fused: dict[str, dict[str, int]], want: dict[str, dict[str, int]]) -> None:
    for phase, counts in want.items():
        for name, n in counts.items():
            assert fused[phase].get(name, 0) == n, f"{phase}: {name} fused {fused[phase].get(name, 0)} times, want {n}; {fused[phase]}"


def _on_simulated_ranks(model, mesh, loss_of, calls, **options):
    """One step of ``nvtp.jit(copy of model, mesh=mesh, **options)`` on each rank of ``mesh`` as
    threads, rank r called with ``calls[r]`` = (args, kwargs), one program shared: the ranks, and
    each rank's (loss, gradients)."""
    from nvtp.execute import spmd

    threads = spmd.ThreadMesh(mesh, timeout=120)
    ranks = [nvtp.jit(copy.deepcopy(model), mesh=mesh, comm=threads.comm(r), **options) for r in range(mesh.size)]
    ranks[0].compile(*calls[0][0], **calls[0][1])
    for m in ranks[1:]:
        m.share_compiled(ranks[0])
    return ranks, spmd.on_threads(lambda r: _step(ranks[r], loss_of, *calls[r][0], **calls[r][1]), threads)


def _tiny_llama(transformers):
    """A transformers Llama from a tiny config (GQA: 2 KV heads of 4; pad token 0)."""
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                   vocab_size=256, intermediate_size=128, use_cache=False, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def test_gpt_runs_its_loss_embedding_gradient_and_norms_as_kernels_with_the_interpreters_values():
    """nvtp's GPT (LayerNorm, tanh-GELU, cross-entropy with ignored targets, tied vocabulary of 512)."""
    torch.manual_seed(0)
    cfg = gpt.config("tiny", vocab_size=512)
    model = gpt.GPT(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=g)
    targets[0, :3] = -100  # F.cross_entropy's ignore_index: left out of the mean
    idx[1, :4] = idx[0, 4:8] = idx[0, :4]  # tokens seen three times: their embedding rows sum three gradients
    eager, kernels, none, fused = _three_ways(model, lambda loss: loss, idx, targets)
    _expect(fused, GPT_KERNELS)
    _close(kernels, eager, "kernels vs eager")
    _close(kernels, none, "kernels vs the interpreter")
    _close(none, eager, "the interpreter vs eager")


def test_a_transformers_llama_runs_its_rms_norms_and_silu_gates_as_kernels_with_eagers_values():
    """A transformers Llama from a tiny config (RMSNorm, SwiGLU, labels shifted with -100; GQA, 2
    KV heads of 4, which transformers repeats before its causal-masked attention: flash attention)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _tiny_llama(transformers)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    idx[0, 2] = idx[1, 5] = model.config.pad_token_id  # nn.Embedding(padding_idx=0): its row gets no gradient
    eager, kernels, none, fused = _three_ways(model, lambda out: out.loss, input_ids=idx, labels=idx)
    _expect(fused, LLAMA_KERNELS)
    _close(kernels, eager, "kernels vs eager")
    _close(kernels, none, "kernels vs the interpreter")


def test_pytorchs_example_llama_runs_every_rms_norm_as_a_kernel_with_eagers_values():
    """PyTorch's example Llama (``tests/complex_rotary.py``, written as pytorch/examples' llama2):
    its RMSNorm multiplies by the weight last (``xhat * w``, where transformers writes ``w * xhat``)
    and Thunder adds the residual gradient inside its backward (``(g + rd) + tail``); each of its
    five norms is torch's kernel forward and backward (one backward of five had fused, no forward)."""
    import torch.nn.functional as F

    from tests.complex_rotary import example

    model, idx, targets = example()
    loss_of = lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # noqa: E731  (outside the model)
    eager, kernels, none, fused = _three_ways(model, loss_of, idx)
    _expect(fused, {"forward": {"rms_norm": 5, "silu": 2, "flash_attention": 2},
                    "backward": {"rms_norm_backward": 5, "silu_backward": 2, "embedding_backward": 1, "flash_attention_backward": 2}})
    _close(kernels, eager, "kernels vs eager")
    _close(kernels, none, "kernels vs the interpreter")


def test_a_transformers_gpt2_runs_its_gelu_new_and_its_masked_attention_as_torchs_kernels_with_eagers_values():
    """transformers' GPT-2 (gelu_new: x ** 3, Conv1D, learned positions: two embedding gradients;
    attention with a causal mask tensor)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=256, n_positions=64, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    eager, kernels, none, fused = _three_ways(model, lambda out: out.loss, input_ids=idx, labels=idx)
    # its causal mask, a tensor computed from positions alone, is read as is_causal=True: flash attention
    _expect(fused, {"forward": {"gelu": 2, "layer_norm": 5, "log_softmax": 1, "nll_loss": 1, "flash_attention": 2, "softmax": 0},
                    "backward": {"gelu_backward": 2, "embedding_backward": 2, "layer_norm_backward": 5,
                                 "flash_attention_backward": 2, "softmax_backward": 0}})
    _close(kernels, eager, "kernels vs eager")
    _close(kernels, none, "kernels vs the interpreter")


def test_a_transformers_gpt_neox_runs_its_exact_gelu_as_torchs_kernel_with_eagers_values():
    """GPT-NeoX (Pythia's family): the exact GELU, ``x * (0.5 + 0.5 erf(x / sqrt 2))`` as Thunder
    writes it, forward and backward as ``aten.gelu`` / ``gelu_backward`` (they ran as erf, exp and
    products: ``Program.kernels()`` showed them left)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                                     vocab_size=256, max_position_embeddings=64, use_cache=False, hidden_dropout=0.0,
                                     attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPTNeoXForCausalLM(cfg)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    eager, kernels, none, fused = _three_ways(model, lambda out: out.loss, input_ids=idx, labels=idx)
    _expect(fused, {"forward": {"gelu_erf": 2, "log_softmax": 1, "nll_loss": 1}, "backward": {"gelu_erf_backward": 2}})
    _close(kernels, eager, "kernels vs eager")
    _close(kernels, none, "kernels vs the interpreter")


@pytest.mark.parametrize("bad", ["inductr", "Kernels", None, True])
def test_a_bad_compile_option_is_refused_before_tracing(bad):
    model = gpt.GPT(gpt.config("tiny"))
    with pytest.raises(InputError, match=r"compile=.* is not a way nvtp runs a rank's program; choose one of 'kernels': .*'none': "):
        nvtp.jit(model, compile=bad)


def _no_grad_three_ways(module, x):
    """(eager, kernels, interpreter) outputs of ``module(x)`` under torch.no_grad(), and the kernels' fusion counts."""
    with torch.no_grad():
        want = copy.deepcopy(module)(x)
        sm = nvtp.jit(copy.deepcopy(module), mesh=DeviceMesh.of_size(1))
        got = sm(x)
        none = nvtp.jit(copy.deepcopy(module), mesh=DeviceMesh.of_size(1), compile="none").share_compiled(sm)(x)
    return want, got, none, _fused(sm)["forward"]


def _same(got, want, what: str, tol: float = 2e-5) -> None:
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= tol, f"{what}: differs by {err:.2e} of the largest entry"


def test_causal_attention_under_no_grad_runs_as_torchs_flash_kernel():
    """A GPT block's causal attention, traced whole for the reference backend (``sdpfa_fwd``),
    runs as torch's CPU flash kernel under torch.no_grad() too (in training: the GPT test above)."""
    torch.manual_seed(0)
    cfg = gpt.config("tiny")
    want, got, none, fused = _no_grad_three_ways(gpt.Block(cfg), gpt.example_input(cfg, requires_grad=False))
    assert fused.get("flash_attention") == 1 and "softmax" not in fused and "causal_attention_probs" not in fused, fused
    _same(got, want, "kernels vs eager")
    _same(got, none, "kernels vs the interpreter")


class _MaskedAttention(torch.nn.Module):
    """Attention with the mask ``row + offset >= column``: causal at offset 0, not at 1."""

    def __init__(self, offset: int):
        super().__init__()
        self.qkv, self.offset = torch.nn.Linear(32, 96), offset

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 4, 8).permute(2, 0, 3, 1, 4)  # each (B, h, T, hs)
        i = torch.arange(T, device=x.device)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=i[:, None] + self.offset >= i[None, :])


@pytest.mark.parametrize("offset,kernel", [(0, "causal_attention"), (1, "softmax")])
def test_only_a_causal_mask_is_taken_for_causal_attention(offset, kernel):
    """The check reads the mask through the iotas it is built from: row >= column fuses as causal
    attention, row + 1 >= column (one more key per row) stays a masked softmax."""
    torch.manual_seed(0)
    want, got, none, fused = _no_grad_three_ways(_MaskedAttention(offset), torch.randn(2, 8, 32))
    assert fused == {kernel: 1}, fused
    _same(got, want, "kernels vs eager")
    _same(got, none, "kernels vs the interpreter")


# -- attention traced whole for the reference backend (sdpfa_fwd / sdpfa_bwd, torch's flash kernels) --------------


def _gpt(**overrides):
    torch.manual_seed(0)
    cfg = gpt.config("tiny", **overrides)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=g)
    return gpt.GPT(cfg), cfg, idx, torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=g)


def test_attention_dropout_keeps_the_decomposition_that_draws_like_eager():
    """Attention dropout is not claimed (torch's flash kernels draw their own mask): the GPT in
    training with dropout 0.1 keeps Thunder's decomposition; in eval mode (dropout_p 0) it is claimed."""
    from nvtp import driver

    cfg = gpt.config("tiny", dropout=0.1)
    with torch.device("meta"):
        block = gpt.Block(cfg)
    x = (gpt.example_input(cfg, device="meta"),)
    kinds = lambda t: [o.kind for o in t.forward.ops]  # noqa: E731
    assert "sdpfa_fwd" not in kinds(driver.trace(block.train(), x, regional=False, boundary=False, flash=True))
    assert "sdpfa_fwd" in kinds(driver.trace(block.eval(), x, regional=False, boundary=False, flash=True))


def test_megatron_at_tp2_saves_attentions_output_and_logsumexp_and_runs_flash_kernels_with_eagers_gradients():
    """Simulated ranks (threads): the heads split over tp=2, each rank's attention by torch's flash
    kernels, the loss and every gradient as eager's on the unsharded model. The forward hands the
    backward each attention's output and logsumexp ([B, h, T]), no [B, h, T, T] value (Thunder's
    decomposition saves the probabilities p)."""
    from nvtp.execute import spmd

    model, cfg, idx, tgt = _gpt(seq_len=32)  # T 32, head size 16: a [B, h, T, T] shape is no other value's
    want = _step(copy.deepcopy(model), lambda loss: loss, idx, tgt)
    mesh = DeviceMesh.of_size(2)
    ranks, got = _on_simulated_ranks(model, mesh, lambda loss: loss, [((idx, tgt), {})] * 2, plan="megatron")
    fused = _fused(ranks[0])  # summed over the two ranks' lowerings of the shared program: 2 blocks each
    assert fused["forward"].get("flash_attention") == 4 and fused["backward"].get("flash_attention_backward") == 4, fused
    assert "softmax" not in fused["forward"] and "causal_attention_probs" not in fused["forward"], fused
    backward = ranks[0].last.backward.fusion
    saved = [tuple(v.shape) for v in backward.inputs if backward.role(v.name) == "saved"]
    heads = (cfg.batch, cfg.n_head)
    assert saved.count(heads + (32,)) == cfg.n_layer and heads + (32, 32) not in saved, saved
    assert [o.kind for o in backward.ops].count("sdpfa_bwd") == cfg.n_layer
    for r, (loss, grads) in enumerate(got):
        whole = {n: spmd.assemble([g[1][n] for g in got], ranks[0].placement(n), want[1][n].shape, mesh) for n in grads}
        _close((loss, whole), want, f"rank {r} vs eager")


DP_KERNELS = {"forward": {"log_softmax": 2, "nll_loss_sum": 2, "layer_norm": 10, "gelu": 4, "flash_attention": 4},
              "backward": {"log_softmax_backward": 2, "nll_loss_backward": 2, "embedding_backward": 2, "layer_norm_backward": 10,
                           "gelu_backward": 4}}


@pytest.mark.parametrize("mesh", [DeviceMesh.of_shape((2, 1), ("dp", "tp")), DeviceMesh.of_shape((2,), ("dp",))], ids=["dp2xtp1", "dp2"])
def test_a_data_parallel_gpt_runs_its_loss_and_embedding_gradient_as_kernels_on_each_ranks_rows(mesh):
    """On a dp mesh each rank holds its rows of the logits: the log-softmax, the nll loss's sum (the
    division follows the all-reduces of the sum and the count, so it stays an op), their backward
    and the embedding's gradient (a partial sum over the rank's tokens, all-reduced after) run as
    torch's kernels on those rows; a tp axis of one rank shards nothing (they had run op by op:
    the one-hot embedding gradient as a [vocab, tokens] matmul). Simulated ranks (threads), each
    with its own batch and a different number of ignored targets; the loss and every gradient
    as eager's on both batches at once."""
    torch.manual_seed(0)
    cfg = gpt.config("tiny", vocab_size=512)
    model = gpt.GPT(cfg)
    batches = [gpt.example_tokens(cfg, seed=r) for r in range(2)]
    batches[0][1][0, :5] = -100  # rank 0 ignores 5 targets, rank 1 none: the mean is over the 59 + 64 counted
    want = _step(copy.deepcopy(model), lambda loss: loss, torch.cat([i for i, _ in batches]), torch.cat([t for _, t in batches]))
    ranks, got = _on_simulated_ranks(model, mesh, lambda loss: loss, [(b, {}) for b in batches])
    _expect(_fused(ranks[0]), DP_KERNELS)  # summed over the two ranks' lowerings
    for r, result in enumerate(got):
        _close(result, want, f"rank {r} vs eager on both batches")


def test_a_data_parallel_transformers_llama_runs_its_rms_norms_and_loss_as_kernels_with_eagers_values():
    """The same on a transformers Llama at dp=2 (RMSNorm and SiLU on each rank's rows, the shifted
    labels' cross-entropy): its kernels fuse as on one device, its loss and gradients eager's on
    both batches at once."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _tiny_llama(transformers)
    ids = [torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(r)) for r in range(2)]
    loss_of = lambda out: out.loss  # noqa: E731
    both = torch.cat(ids)
    want = _step(copy.deepcopy(model), loss_of, input_ids=both, labels=both)
    mesh = DeviceMesh.of_shape((2,), ("dp",))
    ranks, got = _on_simulated_ranks(model, mesh, loss_of, [((), {"input_ids": i, "labels": i}) for i in ids])
    twice = {phase: {k: 2 * n for k, n in counts.items() if k not in ("nll_loss", "softmax")} for phase, counts in LLAMA_KERNELS.items()}
    twice["forward"]["nll_loss_sum"] = 2
    _expect(_fused(ranks[0]), twice)
    for r, result in enumerate(got):
        _close(result, want, f"rank {r} vs eager on both batches")


class _TanhMLP(torch.nn.Module):
    """A LayerNorm, a tanh MLP and a cross-entropy: tanh has no kernel pattern (it is its own op)."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln = torch.nn.Embedding(64, 32), torch.nn.LayerNorm(32)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 64)

    def forward(self, idx, targets):
        logits = self.down(torch.tanh(self.up(self.ln(self.emb(idx)))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_the_program_says_which_groups_run_as_kernels_and_which_ops_of_norms_and_activations_are_left():
    """``Program.kernels()``: per phase the groups fused by name, and the ops a norm, loss or
    activation leaves to run one by one (what showed PyTorch's example Llama's RMSNorm and the dp
    cross-entropy running op by op); on nvtp's GPT at dp=2 nothing is left."""
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 8))
    got = nvtp.jit(_TanhMLP(), mesh=DeviceMesh.of_size(1)).lower(idx, idx).kernels()
    assert got["forward"]["fused"] == {"layer_norm": 1, "log_softmax": 1, "nll_loss": 1}, got
    assert got["forward"]["left"] == {"tanh": 1}, got  # the activation, run as its op
    assert got["backward"]["fused"].keys() >= {"layer_norm_backward", "log_softmax_backward", "nll_loss_backward", "embedding_backward"}
    cfg = gpt.config("tiny")
    model = gpt.GPT(cfg)
    mesh = DeviceMesh.of_shape((2,), ("dp",))
    from nvtp.execute import spmd

    program = nvtp.jit(model, mesh=mesh, comm=spmd.ThreadMesh(mesh).comm(0)).lower(*gpt.example_tokens(cfg))
    for rank in (0, 1):
        k = program.kernels(rank)
        assert k["forward"]["fused"]["nll_loss_sum"] == 1 and k["backward"]["fused"]["embedding_backward"] == 1, k
        assert k["forward"]["left"] == {} and k["backward"]["left"] == {}, k
