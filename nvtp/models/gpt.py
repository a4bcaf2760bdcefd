"""A GPT in the nanoGPT style, small enough to hold in your head.

``Block``: LayerNorm, one fused QKV linear, causal attention, attention and residual dropout,
a tanh-GELU MLP, biases. ``GPT``: token and position embeddings, ``n_layer`` blocks, a final
LayerNorm, the LM head and the cross-entropy loss. Nothing here knows about sharding: nvtp
shards what Thunder traces from this code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_embd: int = 64  # e
    n_head: int = 4  # h
    seq_len: int = 16  # s (the block size)
    batch: int = 2  # b, for tracing and examples
    n_layer: int = 2
    vocab_size: int = 256
    dropout: float = 0.0
    bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


CONFIGS: dict[str, GPTConfig] = {
    # Fast enough for CI; heads, hidden and sequence divide by 1, 2 and 4.
    "tiny": GPTConfig(n_embd=64, n_head=4, seq_len=16, batch=2, n_layer=2, vocab_size=256),
    # GPT-2 small's layer.
    "gpt2": GPTConfig(n_embd=768, n_head=12, seq_len=1024, batch=1, n_layer=12, vocab_size=50304, dropout=0.1),
    # The GPT-3 175B layer of the Megatron papers (e = 12288, 96 heads, s = 2048).
    "gpt3": GPTConfig(n_embd=12288, n_head=96, seq_len=2048, batch=1, n_layer=96, vocab_size=51200, dropout=0.1),
}


def config(name: str, **overrides) -> GPTConfig:
    try:
        base = CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown config {name!r}; choose one of {', '.join(CONFIGS)}") from None
    return replace(base, **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # fused q, k, v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, e)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, h, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, h, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Embeddings, blocks, final LayerNorm and LM head; ``forward(idx, targets)`` returns the loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, e)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def example_input(cfg: GPTConfig, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", requires_grad: bool = True, seed: int = 0) -> torch.Tensor:
    """A (batch, seq_len, n_embd) activation for a block."""
    if torch.device(device).type == "meta":
        return torch.empty(cfg.batch, cfg.seq_len, cfg.n_embd, dtype=dtype, device=device, requires_grad=requires_grad)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.batch, cfg.seq_len, cfg.n_embd, generator=g).to(dtype=dtype, device=device)
    return x.requires_grad_(requires_grad)


def example_tokens(cfg: GPTConfig, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
