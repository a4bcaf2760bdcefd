"""An attention block with one fused q/k/v projection, in each layout libraries store it.

Written here, for nvtp's tests, so that nothing in nvtp knows it. ``H`` query heads, ``G`` KV
heads (query groups), ``r = H / G`` queries per group, head size ``hd``; the projection's output
features (the weight's rows) are laid out:

* ``blocks``: all queries, then all keys, then all values ``[q (H hd) | k (G hd) | v (G hd)]``,
  read with ``split`` (Phi-3, litgpt, most hand-written GQA code);
* ``heads``: per head its query, key and value ``[h0: q k v | h1: q k v | ...]`` (GPT-NeoX,
  BLOOM; multi-head attention, G = H), read as ``view(B, T, H, 3 hd)`` and slices;
* ``heads3``: as ``heads``, read as ``view(B, T, H, 3, hd)`` and ``[..., 0, :]`` (BLOOM's form);
* ``groups``: per query group its r queries, then its key and value
  ``[g0: q.. k v | g1: q.. k v | ...]`` (Megatron-LM's GQA layout), read as
  ``view(B, T, G, (r + 2) hd)`` and ``split``.

``rows_of(layout, heads, groups)`` says which rows hold given query heads and groups: what a rank
holding those heads must hold, Megatron's way.
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

LAYOUTS = ("blocks", "heads", "heads3", "groups")


class FusedQKVBlock(nn.Module):
    def __init__(self, layout: str, dim: int = 64, heads: int = 8, kv_heads: int = 4, bias: bool = True):
        super().__init__()
        if layout in ("heads", "heads3") and kv_heads != heads:
            raise ValueError(f"layout {layout} is multi-head attention: kv_heads must equal heads")
        self.layout, self.H, self.G, self.hd = layout, heads, kv_heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.hd, bias=bias)
        self.proj = nn.Linear(heads * self.hd, dim, bias=bias)

    def forward(self, x):
        B, T, C = x.shape
        H, G, hd = self.H, self.G, self.hd
        r = H // G
        y = self.qkv(self.norm(x))
        if self.layout == "blocks":
            q, k, v = y.split([H * hd, G * hd, G * hd], dim=-1)
            q, k, v = q.view(B, T, H, hd), k.view(B, T, G, hd), v.view(B, T, G, hd)
        elif self.layout == "heads":
            y = y.view(B, T, H, 3 * hd)
            q, k, v = y[..., :hd], y[..., hd:2 * hd], y[..., 2 * hd:]
        elif self.layout == "heads3":
            y = y.view(B, T, H, 3, hd)
            q, k, v = y[..., 0, :], y[..., 1, :], y[..., 2, :]
        else:
            y = y.view(B, T, G, (r + 2) * hd)
            q, k, v = y.split([r * hd, hd, hd], dim=-1)
            q = q.reshape(B, T, H, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        if k.shape[1] != H:  # each KV head serves r query heads
            k = k[:, :, None].expand(B, G, r, T, hd).reshape(B, H, T, hd)
            v = v[:, :, None].expand(B, G, r, T, hd).reshape(B, H, T, hd)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(B, T, C))


def rows_of(layout: str, H: int, G: int, hd: int, heads: range, groups: range) -> list[int]:
    """The weight rows of query heads ``heads`` and KV heads ``groups``, in the order a rank holding
    them keeps them: per part (q, then k, then v) for ``blocks``, in layout order otherwise."""
    r = H // G
    if layout == "blocks":
        q = [h * hd + i for h in heads for i in range(hd)]
        k = [H * hd + g * hd + i for g in groups for i in range(hd)]
        v = [(H + G) * hd + g * hd + i for g in groups for i in range(hd)]
        return q + k + v
    if layout in ("heads", "heads3"):
        return [h * 3 * hd + i for h in heads for i in range(3 * hd)]
    width = (r + 2) * hd
    return [g * width + i for g in groups for i in range(width)]
