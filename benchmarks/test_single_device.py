"""Single device: GPT-2's block, forward and forward+backward, nvtp (``nvtp.jit`` on a mesh of
one, the reference backend) against eager PyTorch and ``thunder.jit`` with its default executors.

GPT-2 small's block (``nvtp.models.gpt.Block``: hidden 768, 12 heads, fused QKV, tanh-GELU,
biases, batch 1, fp32, training mode), at sequence length 256 (CPU-sized) and at GPT-2's own
1024 (forward+backward only), each with the GPT-2 config's dropout 0.1 and without dropout
(where eager attention takes PyTorch's fused flash kernel, which has no dropout on CPU).
"forward" is a training forward (the input requires grad); "forward+backward" adds
``y.backward(g)``; gradients are dropped after each step (``set_to_none``), as ``zero_grad`` does.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import Timing, check_target, interleave, paired_ratio, ratios, record
from nvtp.models import gpt

# (sequence length, dropout, mode, rounds): forward alone at the CPU size only, to keep the suite short
CASES = [(256, 0.1, "forward", 15), (256, 0.1, "forward+backward", 10), (256, 0.0, "forward", 15), (256, 0.0, "forward+backward", 10),
         (1024, 0.1, "forward+backward", 6), (1024, 0.0, "forward+backward", 6)]


@pytest.fixture(scope="module")
def implementations(request):
    import thunder

    import nvtp
    from nvtp.sharding.placements import DeviceMesh

    seq, dropout = request.param
    cfg = gpt.config("gpt2", seq_len=seq, dropout=dropout)
    torch.manual_seed(0)
    block = gpt.Block(cfg).train()
    x = gpt.example_input(cfg, requires_grad=False)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    impls = {"eager": block, "nvtp": nvtp.jit(block, mesh=DeviceMesh.of_size(1)), "thunder": thunder.jit(block)}
    if dropout == 0.0:  # eager on the attention algorithm nvtp's fp32 fusion has: probabilities materialised
        impls["eager-math"] = _MathAttention(block)
    for m in impls.values():  # compile (timed in test_compile.py)
        m(x.clone().requires_grad_()).backward(g)
        block.zero_grad(set_to_none=True)
    yield cfg, block, impls, x, g
    impls.clear()


class _MathAttention(torch.nn.Module):
    """Eager PyTorch with scaled_dot_product_attention held to its math backend, the [s, s]
    probabilities materialised as in nvtp's fp32 fusion (nvFuser's sdpfa ops take only half and
    bf16, so an fp32 fusion spells attention out); without dropout eager's default is the fused
    flash kernel, which never materialises them."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return self.block(x)


def _steps(block, impls, x, g, backward: bool):
    def make(m):
        def step():
            y = m(x.detach().requires_grad_())
            if backward:
                y.backward(g)
                block.zero_grad(set_to_none=True)
            return y

        return step

    return {n: make(m) for n, m in impls.items()}


# The target: nvtp's reference backend within 1.05x eager PyTorch's time on one rank (paired
# rounds, less their noise). Knowingly missed without dropout at sequence 1024, where eager takes
# the fused flash-attention kernel and nvtp's fp32 fusion materialises the [s, s] probabilities
# (docs/benchmarks.md, "Why nvtp trails eager"): 1.31x measured 2026-11-21.
TARGET = 1.05
MISSED = {(1024, 0.0): "eager's flash attention saves no [s, s] probabilities; nvtp's fp32 fusion must (1.31x eager, measured "
                       "2026-11-21; docs/benchmarks.md)"}


def _case(s, p, m, r):
    marks = [pytest.mark.xfail(strict=False, reason=MISSED[s, p])] if (s, p) in MISSED else []
    return pytest.param((s, p), m, r, marks=marks, id=f"seq{s}-dropout{p}-{m}")


@pytest.mark.parametrize("implementations,mode,rounds", [_case(*c) for c in CASES], indirect=["implementations"])
def test_gpt2_block(benchmark, implementations, mode, rounds, request):
    cfg, block, impls, x, g = implementations
    benchmark.group = f"gpt2 block {mode}, one device, seq {cfg.seq_len}"
    steps = _steps(block, impls, x, g, backward=mode != "forward")
    samples = {}
    benchmark.pedantic(lambda: samples.update(interleave(steps, rounds, warmup=2)), rounds=1, iterations=1)
    timings = {n: Timing.of(s) for n, s in samples.items()}
    case = f"one device {mode}, seq {cfg.seq_len}, dropout {cfg.dropout}"
    data = record(case, nodeid=request.node.nodeid, kind="single", mode=mode,
                  config={"n_embd": cfg.n_embd, "n_head": cfg.n_head, "seq": cfg.seq_len, "batch": cfg.batch, "dropout": cfg.dropout,
                          "dtype": "fp32", "threads": torch.get_num_threads()},
                  timings=timings, ratios=ratios(timings), paired_nvtp_over_eager=round(paired_ratio(samples, "eager").value, 3),
                  target=f"nvtp/eager <= {TARGET}")
    benchmark.extra_info.update(data)
    check_target(f"{case}: nvtp / eager", paired_ratio(samples, "eager"), TARGET, "x")


def test_reference_backend_compiled_against_interpreted(benchmark, request):
    """What the fused patterns buy: the same forward and backward fusions lowered to torch.fx
    modules with LayerNorm, GELU and softmax as torch's kernels (the default) and every op by
    its own implementation (``compiled=False``), GPT-2 block, sequence 256, dropout 0.1."""
    from nvtp.execute import reference
    from nvtp import driver
    from nvtp.frontend.capture import run_pair

    cfg = gpt.config("gpt2", seq_len=256, dropout=0.1)
    torch.manual_seed(0)
    block = gpt.Block(cfg).train()
    x = gpt.example_input(cfg)
    c = driver.trace(block, (x,), regional=False, boundary=False)
    named = {n: p.detach() for n, p in block.named_parameters()} | {"x": x.detach()}
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))

    def pair(compiled: bool):
        return lambda: run_pair(c.forward, c.backward, named, g, lambda f, i: reference.run(f, i, seed=1, compiled=compiled))

    benchmark.group = "reference backend: fused patterns against every op by its implementation"
    samples = {}
    benchmark.pedantic(lambda: samples.update(interleave({"nvtp": pair(True), "interpreted": pair(False)}, 8)), rounds=1, iterations=1)
    timings = {n: Timing.of(s) for n, s in samples.items()}
    data = record("reference backend forward+backward, seq 256, dropout 0.1", nodeid=request.node.nodeid, kind="backend",
                  timings=timings, ratios=ratios(timings))
    benchmark.extra_info.update(data)
