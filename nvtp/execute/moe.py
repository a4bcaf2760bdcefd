"""The reference backend's implementations of the mixture-of-experts ops (``nvtp/ir/ops/moe.py``):
``topk``, and ``gather_mm`` / ``gather_mm_wgrad`` by the grouped products of ``grouped.py``.
Where an "ep" axis splits the experts, ``nvtp.execute.ep`` runs them (and the row-wise ops between
them) on the rows it holds on the experts' ranks: ``reference.execute_op`` hands them over."""

from __future__ import annotations

from typing import Any

import torch

from nvtp.execute.grouped import gather_mm, gather_mm_wgrad


def _topk(ctx: Any, op: Any, a: dict[str, Any]):
    return torch.topk(a["arg"], int(a["k"]), dim=a["dim"], largest=a["largest"], sorted=a["sorted"])


def _gather_mm(ctx: Any, op: Any, a: dict[str, Any]):
    return gather_mm(a["arg1"], a["arg2"], a["index"])


def _gather_mm_wgrad(ctx: Any, op: Any, a: dict[str, Any]):
    return gather_mm_wgrad(a["arg1"], a["arg2"], a["index"], a["groups"])


# The reference backend's implementations (``nvtp.execute.reference.IMPLS`` takes them in).
IMPLS = {"topk": _topk, "gather_mm": _gather_mm, "gather_mm_wgrad": _gather_mm_wgrad}
