"""New sequence lengths without a new trace (nvtp/frontend/lengths.py), and generation.

A forward at a new sequence length used to trace the model again (19-63 s per length for a
2-layer model on this machine), so ``generate`` of a few tokens took minutes. Now two traces of a
call structure give every later length by derivation, each derived program checked against eager
by nvtp.guard (with ``verify=False``, a third trace checks the first derived program instead).
Each test compares with the eager model on one process, computed independently.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nvtp
from nvtp import driver
from nvtp.dump import relative_error
from nvtp.errors import InputError
from nvtp.execute import spmd
from nvtp.execute.collectives import ThreadComm, ThreadGroup
from nvtp.frontend.lengths import Lengths, NotDerivable, _constant, _Fit
from nvtp.sharding.placements import DeviceMesh


class TinyLM(nn.Module):
    """A GPT written for this test: learned positions sliced to the length, causal SDPA, logits of every position."""

    def __init__(self, vocab=64, d=32, heads=4, block=32, halves=False):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.heads, self.halves = heads, halves

    def forward(self, idx):                                  # idx: [B, T]
        B, T = idx.shape
        x = self.emb(idx) + self.pos(torch.arange(T))
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.proj(y)
        x = x + self.down(F.gelu(self.up(x)))
        if self.halves:  # a size that is no whole multiple of T: T // 2 pairs of positions
            x = x[:, : 2 * (T // 2)].reshape(B, T // 2, -1).sum(-1, keepdim=True) + x[:, : T // 2]
        return self.head(x)


def _ranks(model: nn.Module, d: int = 2):
    group = ThreadGroup(d, timeout=300)
    return group, [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=DeviceMesh.of_size(d), comm=ThreadComm(group, r))
                   for r in range(d)]


def _infer(module, *args):
    with torch.no_grad():  # per thread: no_grad is thread-local
        return module(*args)


def _greedy(step, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """Greedy generation as nanoGPT's ``generate`` with ``top_k=1``: the model on the whole sequence, one token longer each step."""
    for _ in range(tokens):
        ids = torch.cat([ids, step(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@torch.no_grad()
def test_generation_traces_two_lengths_derives_the_rest_and_gives_eagers_tokens_on_2_ranks(monkeypatch):
    """Greedy generation of 6 tokens from a prompt of 8 on 2 simulated ranks gives the tokens eager
    generation gives, with 2 traces a rank for its 6 lengths (the two to derive from; the first-call
    check against eager stands behind each derived program: before 2026-11-27 a third length was
    traced to confirm the first derived one), counted at the driver; a later jump to length 31 is
    derived too, and every output is eager's within 1e-5."""
    torch.manual_seed(0)
    model = TinyLM().eval()
    group, ranks = _ranks(model)
    traces = []
    real = driver.trace
    monkeypatch.setattr(driver, "trace", lambda *a, **k: traces.append(a[1][0].shape[1]) or real(*a, **k))
    prompt = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(8))
    want = _greedy(model, prompt, 6)
    hows = []

    def step(ids):
        outs = spmd.on_threads(lambda r: _infer(ranks[r], ids), group)
        for out in outs:
            assert relative_error(out, model(ids))[0] <= 1e-5, ids.shape
        hows.append(ranks[0].last.traced.how)
        return outs[0]

    got = _greedy(step, prompt, 6)
    assert torch.equal(got, want), (got, want)
    idx = torch.randint(0, 64, (2, 31), generator=torch.Generator().manual_seed(31))
    assert relative_error(step(idx), model(idx))[0] <= 1e-5
    assert sorted(traces) == [8, 8, 9, 9], traces  # each rank (a thread here, a process in use) traces its own
    family = next(iter(ranks[0]._lengths.families.values()))
    assert family.checked and not family.why and family.derived == 5, (family.checked, family.why, family.derived)
    assert [h.startswith("derived at length") for h in hows] == [False] * 2 + [True] * 5, hows


def test_without_an_eager_check_the_first_derived_program_is_confirmed_by_a_trace(monkeypatch):
    """The decision alone (derivation and comparison stubbed): a length past the two traced ones is
    derived outright when an eager check will stand behind its program, and traced to confirm the
    derivation when none will (``verify=False``, dropout in training mode)."""
    from nvtp.frontend import lengths as lengths_module

    monkeypatch.setattr(lengths_module, "derive", lambda ta, tb, a, b, n: Traced("derived"))
    monkeypatch.setattr(lengths_module, "same_program", lambda x, y: "")
    for checked_by_eager, want, traced in ((True, "derived at length 10", [8, 9]), (False, "traced at 10", [8, 9, 10])):
        calls, lengths = [], Lengths()

        def at(n):
            return lengths.trace((torch.zeros(1, n, dtype=torch.long),), {}, "eval", lambda: calls.append(n) or Traced(f"traced at {n}"),
                                 eager=lambda t: checked_by_eager)

        assert [at(8).how, at(9).how] == ["traced at 8", "traced at 9"] and at(10).how.startswith(want) and calls == traced, calls
        assert at(11).how.startswith("derived at length 11") and calls == traced  # confirmed (by the trace, or the passing check below)
        if checked_by_eager:
            assert lengths.settle((torch.zeros(1, 10, dtype=torch.long),), {}, "eval") == ""


@dataclasses.dataclass
class Traced:
    how: str
    seconds: float = 0.0


@torch.no_grad()
def test_a_derived_program_that_differs_from_eager_is_traced_instead(monkeypatch):
    """A derivation gone wrong (here on purpose: the position ids' iota made to start at 1) is
    caught by the first-call check against eager, and that length is traced instead, with a
    warning; the outputs are eager's, and the family derives no more (its ``why`` says why)."""
    from nvtp.frontend import lengths as lengths_module

    real = lengths_module.derive

    def shifted(*a):  # the derived forward's iota (the positions) starts at 1: a wrong program of the right shapes
        d = real(*a)
        ops = tuple(dataclasses.replace(op, args=tuple((k, 1 if k == "start" else v) for k, v in op.args)) if op.kind == "iota" else op
                    for op in d.forward.ops)
        return dataclasses.replace(d, forward=dataclasses.replace(d.forward, ops=ops))

    monkeypatch.setattr(lengths_module, "derive", shifted)
    traces = []
    monkeypatch.setattr(driver, "trace", lambda *a, real=driver.trace, **k: traces.append(a[1][0].shape[1]) or real(*a, **k))
    torch.manual_seed(0)
    model = TinyLM().eval()
    jitted = nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=1)
    for T in (8, 9):
        jitted(torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(T)))
    idx = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(10))
    with pytest.warns(UserWarning, match="derived at length 10 differs from the model run eagerly: .*traced instead"):
        out = jitted(idx)
    assert relative_error(out, model(idx))[0] <= 1e-5 and traces == [8, 9, 10], traces
    assert jitted.last.traced.how.startswith("whole trace"), jitted.last.traced.how
    family = next(iter(jitted._lengths.families.values()))
    assert family.derived == 0 and "differs from the model run eagerly" in family.why, family.why


@pytest.mark.slow
@torch.no_grad()
def test_a_size_that_does_not_follow_the_length_is_traced_at_every_length():
    torch.manual_seed(0)
    model = TinyLM(halves=True).eval()
    jitted = nvtp.jit(copy.deepcopy(model), plan="megatron")
    for T in (8, 10, 12):
        idx = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(T))
        assert relative_error(jitted(idx), model(idx))[0] <= 1e-5, T
    family = next(iter(jitted._lengths.families.values()))
    assert family.derived == 0 and "no whole multiple of the length" in family.why, family.why


def test_folded_constants_are_regenerated_only_when_they_follow_a_known_pattern():
    """Position ids, causal masks and sliding-window masks (Mistral, Qwen2's sliding layers) are
    regenerated at a new length; anything else is not."""
    fit = _Fit(8, 9, 12)
    positions = [torch.arange(n, dtype=torch.float32).reshape(1, n, 1) for n in (8, 9)]
    assert torch.equal(_constant("pos", *positions, fit), torch.arange(12, dtype=torch.float32).reshape(1, 12, 1))
    masks = [torch.ones(n, n, dtype=torch.bool).tril().expand(1, 1, n, n) for n in (8, 9)]
    assert torch.equal(_constant("mask", *masks, fit), torch.ones(12, 12, dtype=torch.bool).tril().expand(1, 1, 12, 12))
    def sliding(n, window):  # transformers' sliding-window mask: key j within `window` positions before query i
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return ((j <= i) & (j > i - window)).expand(1, 1, n, n)

    assert torch.equal(_constant("sliding", sliding(8, 4), sliding(9, 4), fit), sliding(12, 4))
    with pytest.raises(NotDerivable, match="constant sliding .* no pattern"):  # a window that follows the length is no band
        _constant("sliding", sliding(8, 4), sliding(9, 5), fit)
    noise = [torch.rand(1, n, generator=torch.Generator().manual_seed(n)) for n in (8, 9)]
    with pytest.raises(NotDerivable, match="constant noise .* no pattern nvtp regenerates"):
        _constant("noise", *noise, fit)


def test_no_length_past_the_models_window_is_derived_from_traces_within_it():
    """Within a sliding window its mask equals a causal one, so traces at 2 and 3 of a model with a
    window of 4 cannot tell it: a derived length 6 got a causal mask, and with verify=False a
    Mistral generated other tokens than eager past the window, silently. A length past the window
    the config declares is traced, and the family starts again from it."""
    calls = []
    lengths = Lengths(horizon=4)

    def at(n):
        return lengths.trace((torch.zeros(1, n, dtype=torch.long),), {}, "eval", lambda: calls.append(n) or f"traced at {n}")

    assert [at(2), at(3), at(6)] == ["traced at 2", "traced at 3", "traced at 6"] and calls == [2, 3, 6]
    family = next(iter(lengths.families.values()))
    assert family.first == [(1, 6)] and len(family.traces) == 1  # the next trace past the window makes two


_FAKE_AFTER_THREADS = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from nvtp.execute import spmd
from nvtp.execute.collectives import ThreadGroup

def rank(r):
    with FakeTensorMode():  # as a rank's trace enters fake mode (dynamo's export, nvtp.frontend.variants)
        return tuple(torch.empty(2, 3).shape)

assert spmd.on_threads(rank, ThreadGroup(2, timeout=60)) == [(2, 3), (2, 3)]
with FakeTensorMode():  # the next trace, on the main thread, after the ranks' threads exited
    pass
print("alive")
"""


def test_fake_mode_after_ranks_traced_on_threads_exit_does_not_crash_the_process():
    """torch 2.10 keeps the fake CUDA device guard of the first thread that entered fake mode; once
    that thread exits, the next ``FakeTensorMode`` segfaults (nvtp/fakeguard.py). A generation on 2
    simulated ranks followed by any FX-route trace crashed the process so. Run in a fresh process:
    a segfault would take pytest with it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FAKE_AFTER_THREADS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "alive" in done.stdout, (done.returncode, done.stderr[-2000:])


transformers = pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")


@pytest.mark.slow
def test_transformers_generate_on_2_ranks_gives_eagers_tokens():
    """``model.generate`` (greedy, 6 new tokens) on every rank of a simulated mesh of 2: the
    tokens eager generation gives; the later lengths derived, not traced."""
    from nvtp.models.hf import build

    model = build("llama").eval()
    ids = torch.randint(1, 256, (1, 8), generator=torch.Generator().manual_seed(5))
    want = copy.deepcopy(model).generate(ids, max_new_tokens=6, do_sample=False)
    group, ranks = _ranks(model)
    outs = spmd.on_threads(lambda r: ranks[r].generate(ids, max_new_tokens=6, do_sample=False), group)
    for out in outs:
        assert torch.equal(out, want), (out, want)
    family = next(iter(ranks[0]._lengths.families.values()))
    assert family.checked and family.derived == 4, (family.why, family.derived)


def test_transformers_generate_on_a_sharded_model_runs_the_models_own_loop():
    """transformers' generate looks its loop up on the model's class (``type(self)._sample``),
    which the ShardedModule wrapper lacks; nvtp runs it on a view of the model whose forward is
    the sharded one. Checked without tracing: the view's class, attributes and forward."""
    from nvtp.generation import view
    from nvtp.models.hf import build

    model = build("llama")
    sharded = nvtp.jit(model, plan="megatron")
    v = view(sharded)
    assert isinstance(v, type(model)) and hasattr(type(v), "_sample") and v.config is model.config
    assert v.model is model.model and v.lm_head.weight is model.lm_head.weight
    calls = []
    sharded.forward = lambda *a, **k: calls.append((a, k)) or "sharded"
    assert v(torch.zeros(1, 3, dtype=torch.long), use_cache=False) == "sharded" and len(calls) == 1
    with pytest.raises(InputError, match=r"returns no KV cache.*leave use_cache out"):
        nvtp.jit(build("llama"), plan="megatron").generate(torch.zeros(1, 3, dtype=torch.long), use_cache=True)


def test_the_window_a_transformers_config_declares_bounds_derivation():
    from nvtp.frontend.lengths import horizon

    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    assert horizon(transformers.MistralForCausalLM(transformers.MistralConfig(**small, sliding_window=4))) == 4
    assert horizon(transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))) is None


@pytest.mark.slow
def test_a_mistral_generating_past_its_window_gives_eagers_tokens_without_the_guard():
    """verify=False: nothing but the derivation stands between the program and eager's tokens."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=128, sliding_window=4, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8)  # sharp attention: the window decides the next tokens (a causal mask gave others from the 8th)
    ids = torch.randint(1, 64, (1, 2), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = copy.deepcopy(model).generate(ids, max_new_tokens=10, do_sample=False)
        got = nvtp.jit(model, mesh=1, verify=False).generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want), (got, want)
