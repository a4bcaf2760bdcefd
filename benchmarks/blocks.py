"""The block the sharded benchmarks run: GPT-2's block with q, k and v as three linears.

PyTorch's tensor parallelism shards modules, so its plan needs q, k and v as separate linears
(``ColwiseParallel`` on a fused QKV weight would cut across q, k and v), and the attention must
be told how many heads each rank holds: ``attn.n_head = n_head // d``, a change to the model
that DTensor needs and nvtp does not (nvtp shards this block, and the fused one, unchanged).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.q, self.k, self.v = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (lin(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))  # (B, h, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class TPBlock(nn.Module):
    """LayerNorm, attention with separate q/k/v, LayerNorm, tanh-GELU MLP, residuals, biases."""

    def __init__(self, n_embd: int = 768, n_head: int = 12):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn, self.mlp = Attention(n_embd, n_head), MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def dtensor_plan() -> dict:
    """PyTorch's tensor-parallel plan for ``TPBlock`` (as in its TP tutorial)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
