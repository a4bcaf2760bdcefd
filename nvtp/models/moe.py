"""A mixture-of-experts GPT in the nanoGPT style: ``nvtp.models.gpt`` with each block's MLP
replaced by top-k routed experts.

``Router``: a linear to E logits, softmax, the top k experts of each token, their weights
renormalised to sum to 1 (Mixtral's router). ``Experts``: E GELU MLPs held as 3-D weights
``[E, in, out]``; each token's k rows go through their experts with ``gather_mm`` (static shapes:
no data-dependent indexing, no host synchronisation). ``MoE`` adds the Switch Transformer's
load-balancing loss, ``E * sum_e f_e * P_e`` (f_e: the fraction of the routed rows expert e
received; P_e: its mean router probability). ``MoEGPT.forward(idx, targets)`` returns the
cross-entropy plus ``aux_loss_coef`` times the layers' load-balancing losses. As in ``gpt``,
nothing here knows about sharding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from nvtp.frontend.moe import gather_mm, torch_ops
from nvtp.models.gpt import CausalSelfAttention


@dataclass(frozen=True)
class MoEConfig:
    n_embd: int = 64  # e
    n_head: int = 4  # h
    seq_len: int = 16  # s
    batch: int = 2  # b, for tracing and examples
    n_layer: int = 2
    vocab_size: int = 256
    n_expert: int = 4  # E
    top_k: int = 2  # k
    expert_hidden: int = 128  # each expert's MLP width
    aux_loss_coef: float = 0.01
    dropout: float = 0.0
    bias: bool = True


CONFIGS: dict[str, MoEConfig] = {
    # Fast enough for CI: hidden 64, 4 experts, top-2, 2 layers, vocabulary 256.
    "tiny": MoEConfig(),
    # Mixtral 8x7B's layer shape (e = 4096, 8 experts of width 14336, top-2), for planning.
    "mixtral": MoEConfig(n_embd=4096, n_head=32, seq_len=4096, batch=1, n_layer=32, vocab_size=32000, n_expert=8, top_k=2,
                         expert_hidden=14336, bias=False),
}


def config(name: str, **overrides) -> MoEConfig:
    try:
        base = CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown config {name!r}; choose one of {', '.join(CONFIGS)}") from None
    cfg = replace(base, **overrides)
    if not 1 <= cfg.top_k <= cfg.n_expert:
        raise ValueError(f"top_k {cfg.top_k} must be between 1 and n_expert ({cfg.n_expert})")
    return cfg


class Router(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.top_k = cfg.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.gate(x).float(), dim=-1)  # (N, E)
        weights, index = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        return weights / weights.sum(dim=-1, keepdim=True), index, probs


class Experts(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        torch_ops()  # nvtp's gather_mm op, defined before any trace calls it
        self.w_fc = nn.Parameter(torch.empty(cfg.n_expert, cfg.n_embd, cfg.expert_hidden))  # (E, e, f)
        self.w_proj = nn.Parameter(torch.empty(cfg.n_expert, cfg.expert_hidden, cfg.n_embd))  # (E, f, e)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, e = x.shape
        k = index.shape[-1]
        rows = x.unsqueeze(1).expand(n, k, e).reshape(n * k, e)  # (N*k, e): each token once per chosen expert
        experts = index.reshape(n * k)
        h = F.gelu(gather_mm(rows, self.w_fc, experts), approximate="tanh")  # (N*k, f)
        y = gather_mm(h, self.w_proj, experts) * weights.reshape(n * k, 1).to(h.dtype)  # (N*k, e)
        return y.reshape(n, k, e).sum(dim=1)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.n_expert = cfg.n_expert

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        weights, index, probs = self.router(flat)
        y = self.experts(flat, index, weights).reshape(B, T, C)
        routed = F.one_hot(index, self.n_expert).float().mean(dim=(0, 1))  # f_e, (E,)
        aux = self.n_expert * (routed * probs.mean(dim=0)).sum()  # Switch Transformer's load-balancing loss
        return self.dropout(y), aux


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output and its load-balancing loss."""
        x = x + self.attn(self.ln_1(x))
        y, aux = self.moe(self.ln_2(x))
        return x + y, aux


class MoEGPT(nn.Module):
    """Embeddings, MoE blocks, final LayerNorm and LM head; ``forward(idx, targets)`` returns the
    cross-entropy plus ``aux_loss_coef`` times the summed load-balancing losses."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.ndim >= 2:  # GPT-2's init; residual projections scaled
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("c_proj.weight", "w_proj")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, e)
        aux = 0.0
        for block in self.h:
            x, layer_aux = block(x)
            aux = aux + layer_aux
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) + self.cfg.aux_loss_coef * aux


def example_tokens(cfg: MoEConfig, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def tiny() -> tuple[MoEGPT, tuple[torch.Tensor, torch.Tensor]]:
    """``nvtp explain --module nvtp.models.moe:tiny``: the tiny MoE GPT and an example batch."""
    torch.manual_seed(0)
    cfg = config("tiny")
    return MoEGPT(cfg), example_tokens(cfg)
