"""Models for tests/test_fx_asserts.py, in a module of their own: pytest rewrites the ``assert``
statements of test files (into code TorchDynamo cannot capture whole), and these models' asserts
must reach dynamo as the model's author wrote them."""

from __future__ import annotations

import torch
import torch.nn as nn


class Lengths(nn.Module):
    """XLM's pattern: lengths counted from the tokens, asserted, made a padding mask; the attention
    mask compared with 0 as XLM compares it (``mask == 0``), keys concatenated onto an empty cache."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb, self.q, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, ids):
        B, T = ids.shape
        lengths = (ids != 0).sum(dim=1).long()
        assert lengths.max().item() <= T  # always true: dynamo keeps it as a runtime check
        mask = torch.arange(T, device=ids.device)[None, :] < lengths[:, None]  # [B, T]
        x = self.emb(ids)
        keys = torch.cat([torch.tensor([], device=ids.device), x.transpose(1, 2)], dim=-2).transpose(1, 2)  # onto an empty cache, as DynamicCache
        scores = self.q(x) @ keys.transpose(1, 2)  # [B, T, T]
        scores = scores.masked_fill((mask == 0)[:, None, :].expand_as(scores), -1e9)
        return self.head(scores.softmax(-1) @ x).sum()


class Unproven(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        assert (y > 0).sum().item() > 0  # at least one positive: a count the data decides
        return y.sum()
