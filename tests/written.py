"""Small models written the way people write them, so nvtp meets their constructs in its own tests.

Not copies of anyone's code: each is written here, in the manner of the models users actually
train (karpathy's nanoGPT ``model.py``, PyTorch's example ``llama2_model.py``), with the
constructs those bring and nvtp must take unchanged:

* ``TinyGPT``: one config dataclass; the output head tied to the token embedding
  (``self.transformer.wte.weight = self.lm_head.weight``); ``forward(idx, targets=None)``
  returning ``(logits, loss)``, the loss by ``F.cross_entropy(..., ignore_index=-1)``, and only
  the last position's logits with ``loss=None`` when there are no targets; dropout; attention by
  ``F.scaled_dot_product_attention(is_causal=True)``; ``generate()`` calling ``self(idx_cond)``
  on ever longer prompts; ``configure_optimizers``. ``parallel_residual=True`` makes each block
  GPT-J's: attention and MLP read one LayerNorm and add into the residual together, so the
  two output projections' biases get the same gradient.
* ``TinyLlama``: RMSNorm, rotary embeddings from a plain tensor attribute that ``forward``
  reassigns (``self.freqs = self.freqs.to(h.device)``), SwiGLU, no biases, ``forward(tokens)``
  returning logits, ``init_weights()``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True
    tie: bool = True
    parallel_residual: bool = False
    mlp_closure: bool = False  # the MLP as a function attribute closing over a ModuleDict (minGPT's way)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.parallel = config.parallel_residual
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = None if self.parallel else nn.LayerNorm(config.n_embd, bias=config.bias)
        if config.mlp_closure:
            m = self.mlp_parts = nn.ModuleDict(dict(fc=nn.Linear(config.n_embd, 4 * config.n_embd),
                                                    proj=nn.Linear(4 * config.n_embd, config.n_embd)))
            self.mlp = lambda x: m.proj(F.gelu(m.fc(x)))  # a plain attribute: the function holds the modules
        else:
            self.mlp = MLP(config)

    def forward(self, x):
        if self.parallel:  # GPT-J: one norm, both branches into the residual at once
            h = self.ln_1(x)
            return x + self.attn(h) + self.mlp(h)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie:
            self.transformer.wte.weight = self.lm_head.weight  # one parameter, two uses
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.normal_(module.bias, std=0.02)  # not zeros: a bias gradient mapped wrongly shows
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:  # inference: only the last position is needed
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if fused else {}))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


@dataclass
class LlamaArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 64
    multiple_of: int = 16
    norm_eps: float = 1e-5
    max_seq_len: int = 16


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """cos and sin of each position's rotation angles, (end, dim // 2, 2): real numbers."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of ``x`` (B, T, H, D) by the angles of ``freqs`` (T, D//2, 2)."""
    xr = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = freqs[None, :, None, :, 0], freqs[None, :, None, :, 1]
    out = torch.stack([xr[..., 0] * cos - xr[..., 1] * sin, xr[..., 0] * sin + xr[..., 1] * cos], dim=-1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x, freqs, mask=None):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xq, xk = apply_rotary(xq, freqs), apply_rotary(xk, freqs)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)  # (B, nh, T, hs)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True) if mask is None else \
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, multiple_of: int):
        super().__init__()
        hidden = multiple_of * ((int(2 * 4 * dim / 3) + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.multiple_of)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, freqs, mask=None):
        h = x + self.attention(self.attention_norm(x), freqs, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.freqs = precompute_freqs(args.dim // args.n_heads, args.max_seq_len * 2)  # an attribute, not a buffer
        self.init_weights()

    def init_weights(self):
        with torch.device(self.freqs.device):
            self.freqs = precompute_freqs(self.args.dim // self.args.n_heads, self.args.max_seq_len * 2)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.attention.wo,
                        layer.feed_forward.w1, layer.feed_forward.w2, layer.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, std=0.02)
        nn.init.trunc_normal_(self.output.weight, std=self.args.dim ** -0.5)

    def forward(self, tokens):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        self.freqs = self.freqs.to(h.device)  # reassigned in forward, as the llama2 example does
        freqs = self.freqs[0:seqlen]
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h)).float()


class TinyGptFast(TinyLlama):
    """gpt-fast's way (``model.py``): the rotary table and the causal mask are made by
    ``setup_caches`` and kept as plain tensor attributes (neither parameters nor buffers), read in
    ``forward`` and never reassigned there."""

    def __init__(self, args: LlamaArgs):
        super().__init__(args)
        self.freqs_cis: torch.Tensor | None = None
        self.causal_mask: torch.Tensor | None = None

    def setup_caches(self, max_seq_length: int) -> None:
        self.freqs_cis = precompute_freqs(self.args.dim // self.args.n_heads, max_seq_length)
        self.causal_mask = torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool))

    def forward(self, tokens):
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs = self.freqs_cis[:seqlen]
        mask = self.causal_mask[None, None, :seqlen, :seqlen]
        for layer in self.layers:
            h = layer(h, freqs, mask)
        return self.output(self.norm(h)).float()


def tokens(config, batch: int = 2, seed: int = 1, ignored: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of token ids and next-token targets; the first ``ignored`` targets of each row -1."""
    vocab = getattr(config, "vocab_size")
    t = getattr(config, "block_size", getattr(config, "max_seq_len", 16))
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (batch, t + 1), generator=g)
    idx, targets = data[:, :-1].clone(), data[:, 1:].clone()
    targets[:, :ignored] = -1
    return idx, targets

