"""A small decoder written the way Llama's reference code writes rotary embeddings: complex numbers.

The rotary table is a complex64 buffer made by ``torch.polar``; attention views q and k as
complex pairs (``torch.view_as_complex``), multiplies by the table and views the product as real
again (``torch.view_as_real``), and the model moves the table to the activations' device inside
``forward`` (``self.freqs = self.freqs.to(h.device)``). RMSNorm, a SwiGLU MLP and grouped-query
attention (KV heads repeated by expand + reshape) complete it. Written here, for nvtp's tests, so
that nothing in nvtp knows it; the project keeps no copy of anyone else's model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 128
    hidden: int = 96
    max_seq: int = 32
    tables_in_forward: bool = False  # build the rotary table with torch.polar inside forward, not as a buffer


def rotary_table(head_dim: int, length: int, theta: float = 10000.0) -> torch.Tensor:
    """[length, head_dim / 2] complex64: e^(i * position * frequency)."""
    freqs = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, head_dim] real; table: [T, head_dim / 2] complex."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [B, T, heads, head_dim / 2]
    turned = pairs * table[None, :, None, :]
    return torch.view_as_real(turned).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads, self.kv_heads, self.hd = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(cfg.heads * self.hd, cfg.dim, bias=False)

    def forward(self, x, table):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.hd)
        k = self.wk(x).view(B, T, self.kv_heads, self.hd)
        v = self.wv(x).view(B, T, self.kv_heads, self.hd)
        q, k = rotate(q, table), rotate(k, table)
        rep = self.heads // self.kv_heads
        k = k[:, :, :, None, :].expand(B, T, self.kv_heads, rep, self.hd).reshape(B, T, self.heads, self.hd)
        v = v[:, :, :, None, :].expand(B, T, self.kv_heads, rep, self.hd).reshape(B, T, self.heads, self.hd)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x, table):
        h = x + self.attn(self.attn_norm(x), table)
        m = self.mlp_norm(h)
        return h + self.w2(F.silu(self.w1(m)) * self.w3(m))


class ComplexRotaryLM(nn.Module):
    """tokens [B, T] -> logits [B, T, vocab] (float32)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.register_buffer("freqs", rotary_table(cfg.dim // cfg.heads, cfg.max_seq))

    def forward(self, tokens):
        T = tokens.shape[1]
        h = self.embed(tokens)
        if self.cfg.tables_in_forward:
            hd = self.cfg.dim // self.cfg.heads
            freqs = 10000.0 ** (-torch.arange(0, hd, 2, device=h.device).float() / hd)
            angles = torch.outer(torch.arange(T, device=h.device).float(), freqs)
            table = torch.polar(torch.ones_like(angles), angles)
        else:
            self.freqs = self.freqs.to(h.device)  # as llama2_model.py does: an attribute set in forward
            table = self.freqs[0:T]
        for block in self.blocks:
            h = block(h, table)
        return self.head(self.norm(h)).float()


def example() -> tuple[ComplexRotaryLM, torch.Tensor, torch.Tensor]:
    """The model of the default ``Config`` (seed 0) with tokens and targets [2, 16] (seed 1)."""
    torch.manual_seed(0)
    cfg = Config()
    model = ComplexRotaryLM(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab, (2, 16), generator=g)
    return model, idx, torch.randint(0, cfg.vocab, (2, 16), generator=g)
