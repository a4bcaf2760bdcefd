"""torch's own nn.MultiheadAttention and nn.TransformerEncoder through nvtp (nvtp/frontend/mha.py).

Thunder 0.2.6 cannot trace ``F.multi_head_attention_forward`` (an opaque torch call whose weights
need a gradient), so nvtp refused every model built on ``nn.MultiheadAttention``. nvtp now writes
it with the ops it fuses. Each test compares with the eager module on one process, computed
independently: the attention's options one by one (values and gradients), and a causal LM on
``nn.TransformerEncoder`` trained on a simulated mesh of 2 (ranks as threads; other variants and
megatron-sp in the slow tier).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nvtp
from nvtp.dump import relative_error
from tests.one_process import jit_and_eager
from nvtp.sharding.placements import axis_split


class Attention(nn.Module):
    """``nn.MultiheadAttention`` called with the options of one case; returns a scalar of its outputs."""

    def __init__(self, batch_first=True, bias=True, cross=False, need_weights=False, mask=None, padding=False, average=True):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, bias=bias, kdim=None, vdim=None)
        self.kv = nn.Linear(16, 16) if cross else None
        self.need_weights, self.mask, self.padding, self.average = need_weights, mask, padding, average

    def forward(self, x):                                    # x: [2, 6, 16] (batch first) or [6, 2, 16]
        seq = x.shape[1] if self.mha.batch_first else x.shape[0]
        kv = self.kv(x) if self.kv is not None else x
        mask = None
        if self.mask == "bool":
            mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        elif self.mask == "float":
            mask = torch.zeros(seq, seq).masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf")) + 0.1
        elif self.mask == "causal":
            mask = nn.Transformer.generate_square_subsequent_mask(seq)
        pad = (torch.arange(seq) == seq - 1).expand(2, seq) if self.padding else None  # the last key of each sequence
        out, weights = self.mha(x, kv, kv, attn_mask=mask, key_padding_mask=pad, need_weights=self.need_weights,
                                average_attn_weights=self.average, is_causal=self.mask == "causal")
        total = (out * out).sum()
        return total + (weights * weights).sum() if weights is not None else total


CASES = {
    "self": {}, "sequence first": dict(batch_first=False), "no bias": dict(bias=False), "cross": dict(cross=True),
    "bool mask": dict(mask="bool"), "float mask": dict(mask="float"), "is_causal": dict(mask="causal"),
    "padding": dict(mask="bool", padding=True), "weights": dict(need_weights=True, mask="float"),
    "weights per head": dict(need_weights=True, average=False),
}


FAST = ("self", "bool mask", "padding", "weights")  # the default tier; the other options in the slow one


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_multihead_attention_matches_eager_values_and_gradients(case):
    torch.manual_seed(0)
    model = Attention(**CASES[case])
    shape = (2, 6, 16) if model.mha.batch_first else (6, 2, 16)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    run = jit_and_eager(model, x)
    jitted = run.jitted
    assert relative_error(run.y, run.want)[0] <= 1e-5
    assert relative_error(run.x_grad, run.want_x_grad)[0] <= 1e-5
    for name, p in model.named_parameters():
        assert relative_error(dict(jitted.module.named_parameters())[name].grad, p.grad)[0] <= 1e-5, name


def test_an_option_nvtp_does_not_take_is_named():
    class BiasKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 4, add_bias_kv=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0].sum()

    with pytest.raises(Exception, match=r"nvtp takes nn.MultiheadAttention without add_bias_kv"):
        nvtp.jit(BiasKV(), plan="replicate")(torch.randn(6, 2, 16))


class EncoderLM(nn.Module):
    """A causal LM on ``nn.TransformerEncoder``: embedding, learned positions, the encoder with a
    causal mask (``is_causal=True`` with it, or the mask alone), a linear head."""

    def __init__(self, vocab=128, d=64, heads=4, layers=2, seq=16, batch_first=True, norm_first=False, hint=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=0.0, batch_first=batch_first,
                                           norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.batch_first, self.hint = batch_first, hint

    def forward(self, idx):                                  # idx: [B, T]
        t = idx.shape[1]
        x = self.emb(idx) + self.pos[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        x = x if self.batch_first else x.transpose(0, 1)
        x = self.encoder(x, mask=mask, is_causal=True) if self.hint else self.encoder(x, mask=mask)
        x = x if self.batch_first else x.transpose(0, 1)
        return self.head(x)                                  # [B, T, vocab]


@pytest.mark.parametrize("plan,options", [
    ("megatron", {}),
    pytest.param("megatron-sp", dict(batch_first=False, norm_first=True), marks=pytest.mark.slow),
    pytest.param("megatron", dict(hint=False), marks=pytest.mark.slow),
])
def test_a_causal_lm_on_transformer_encoder_trains_like_eager_on_2_ranks(plan, options):
    """Loss of every step and the final weights as eager's; the packed in_proj_weight split by heads
    (q, k and v parts each: ``_S(0, 3)``), out_proj and linear2 row-parallel, linear1 column-parallel."""
    from tests.test_complex import _check_training, _train_on_threads

    torch.manual_seed(0)
    model = EncoderLM(**options)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    got, want, ranks, ref = _train_on_threads(model, plan, 2, 3, tokens, targets)
    split = _check_training(got, want, ranks, ref, 2)
    m = ranks[0]
    for layer in (0, 1):
        at = f"encoder.layers.{layer}"
        assert str(m.placement(f"{at}.self_attn.in_proj_weight")) == "_S(0, 3)"
        assert str(m.placement(f"{at}.self_attn.out_proj.weight")) == "S(1)" and str(m.placement(f"{at}.linear2.weight")) == "S(1)"
        assert axis_split(m.placement(f"{at}.linear1.weight")) is not None
    assert {"emb.weight", "head.weight"} <= set(split), split
