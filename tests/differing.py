"""A tiny GPT whose blocks are instances of one class with the same parameter shapes, but do not
all compute the same thing: the family that regional compilation must not splice as if equal
(issue 33). Written here so nothing in nvtp knows it.

Each ``kind`` makes the blocks differ in one way (block ``i`` of ``n``):

* ``attribute``: a plain Python attribute, a residual scale ``1 / (i + 1)``;
* ``buffer``: the same scale held as a buffer (its value differs, the program does not);
* ``submodule``: the MLP's activation is a GELU on even blocks, a ReLU on odd ones;
* ``flag``: a config flag, a parallel residual on odd blocks (``x + attn(ln1 x) + mlp(ln2 x)``);
* ``window``: sliding-window attention (4 positions back) on odd blocks, causal elsewhere, as
  models that alternate local and global attention set it per block;
* ``same``: none (every block alike: the splice must still be taken).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

KINDS = ("attribute", "buffer", "submodule", "flag", "window")
VOCAB, EMBD, HEADS, SEQ = 64, 32, 4, 8


@dataclass(frozen=True)
class Flags:
    parallel_residual: bool = False


class Attention(nn.Module):
    def __init__(self, window: int | None):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(EMBD, EMBD) for _ in range(3))
        self.o = nn.Linear(EMBD, EMBD)
        self.window = window

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, HEADS, C // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))  # (B, h, T, hs)
        i = torch.arange(T, device=x.device)
        keep = i[None, :] <= i[:, None]  # causal
        if self.window is not None:
            keep = keep & (i[:, None] - i[None, :] < self.window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.up, self.down, self.act = nn.Linear(EMBD, 2 * EMBD), nn.Linear(2 * EMBD, EMBD), act

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    def __init__(self, i: int, kind: str):
        super().__init__()
        odd = i % 2 == 1
        self.ln1, self.ln2 = nn.LayerNorm(EMBD), nn.LayerNorm(EMBD)
        self.attn = Attention(4 if kind == "window" and odd else None)
        self.mlp = MLP(nn.ReLU() if kind == "submodule" and odd else nn.GELU())
        self.flags = Flags(parallel_residual=kind == "flag" and odd)
        self.scale = 1.0 / (i + 1) if kind == "attribute" else 1.0
        if kind == "buffer":
            self.register_buffer("gain", torch.tensor(1.0 / (i + 1)))
        else:
            self.gain = None

    def forward(self, x):
        a = self.attn(self.ln1(x)) * self.scale
        if self.gain is not None:
            a = a * self.gain
        if self.flags.parallel_residual:
            return x + a + self.mlp(self.ln2(x))
        x = x + a
        return x + self.mlp(self.ln2(x))


class DifferingGPT(nn.Module):
    """Embedding, ``layers`` blocks of ``kind``, final norm, head; ``forward(idx, targets)`` returns the loss."""

    def __init__(self, kind: str, layers: int = 4):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.h = nn.ModuleList(Block(i, kind) for i in range(layers))
        self.ln_f = nn.LayerNorm(EMBD)
        self.head = nn.Linear(EMBD, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def model(kind: str, layers: int = 4, seed: int = 0) -> DifferingGPT:
    torch.manual_seed(seed)
    return DifferingGPT(kind, layers)


def batches(steps: int, batch: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        t = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def train_eager(net: nn.Module, data, lr: float = 0.1) -> list[float]:
    """SGD steps of ``net`` on one process, eager: the reference."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for idx, tgt in data:
        opt.zero_grad()
        loss = net(idx, tgt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def window():
    """A factory for ``nvtp explain --module tests.differing:window``: (model, args, kwargs)."""
    return model("window"), batches(1)[0], {}
