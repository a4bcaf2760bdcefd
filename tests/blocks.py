"""Transformer blocks that are not nvtp's GPT block, written here so nothing in nvtp knows them.

nvtp must shard each with ``plan="megatron"`` and match a single device, with no change to nvtp.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class LlamaBlock(nn.Module):
    """RMSNorm, separate q/k/v projections with grouped-query attention, rotary embeddings,
    a SwiGLU MLP; biases optional."""

    def __init__(self, n_embd=64, n_head=8, n_kv_head=4, hidden=128, seq_len=16, bias=False):
        super().__init__()
        hd = n_embd // n_head
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, hd
        self.norm1, self.norm2 = RMSNorm(n_embd), RMSNorm(n_embd)
        self.q = nn.Linear(n_embd, n_head * hd, bias=bias)
        self.k = nn.Linear(n_embd, n_kv_head * hd, bias=bias)
        self.v = nn.Linear(n_embd, n_kv_head * hd, bias=bias)
        self.o = nn.Linear(n_head * hd, n_embd, bias=bias)
        self.gate = nn.Linear(n_embd, hidden, bias=bias)
        self.up = nn.Linear(n_embd, hidden, bias=bias)
        self.down = nn.Linear(hidden, n_embd, bias=bias)
        pos = torch.arange(seq_len)[:, None] / (10000 ** (torch.arange(0, hd, 2) / hd))[None, :]
        angles = torch.cat([pos, pos], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        h = self.norm1(x)
        q = self.q(h).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k = self.k(h).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
        v = self.v(h).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
        q = q * self.cos + rotate_half(q) * self.sin
        k = k * self.cos + rotate_half(k) * self.sin
        groups = self.n_head // self.n_kv_head
        k = k[:, :, None].expand(B, self.n_kv_head, groups, T, self.hd).reshape(B, self.n_head, T, self.hd)
        v = v[:, :, None].expand(B, self.n_kv_head, groups, T, self.hd).reshape(B, self.n_head, T, self.hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class SeparateQKVBlock(nn.Module):
    """GPT-2's block with q, k and v as three linears (the layout PyTorch's TP plans need)."""

    def __init__(self, n_embd=64, n_head=4, bias=True):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.q, self.k, self.v = (nn.Linear(n_embd, n_embd, bias=bias) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        B, T, C = x.shape
        h = self.ln_1(x)
        q, k, v = (lin(h).view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class ParallelBlock(nn.Module):
    """GPT-J style: attention and MLP read the same LayerNorm output and add in parallel, with
    hand-written attention (softmax of masked scores) and a ReLU MLP."""

    def __init__(self, n_embd=64, n_head=4, seq_len=16):
        super().__init__()
        self.n_head = n_head
        self.ln = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.out = nn.Linear(n_embd, n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.register_buffer("mask", torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        h = self.ln(x)
        q, k, v = self.qkv(h).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.n_head)
        scores = scores.masked_fill(~self.mask[:T, :T], float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        return x + self.out(y) + self.proj(F.relu(self.fc(h)))


BLOCKS = {
    "llama_gqa": lambda: LlamaBlock(),
    "llama_gqa_bias": lambda: LlamaBlock(bias=True),
    "separate_qkv": lambda: SeparateQKVBlock(),
    "parallel_residual": lambda: ParallelBlock(),
}


class TiedGPT(nn.Module):
    """A tiny language model whose output head is tied to its embedding the usual way
    (``self.head.weight = self.wte.weight``, as GPT-2 and nanoGPT write it), or untied."""

    def __init__(self, vocab: int = 64, dim: int = 32, tie: bool = True):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)  # (B, T, C)
        x = x + torch.tanh(self.fc(x))
        return self.head(x).float().logsumexp(-1).mean()
