"""The reference backend's implementations of the mixture-of-experts ops (``nvtp/ir/ops/moe.py``):
``topk``, and ``gather_mm`` / ``gather_mm_wgrad`` by the grouped products of ``grouped.py``, or,
where an "ep" axis splits the experts, by dispatch and combine (``nvtp.execute.ep``: the
program lists those ops' all-to-alls among its steps)."""

from __future__ import annotations

from typing import Any

import torch

from nvtp.execute import ep
from nvtp.execute.grouped import gather_mm, gather_mm_wgrad


def _topk(ctx: Any, op: Any, a: dict[str, Any]):
    return torch.topk(a["arg"], int(a["k"]), dim=a["dim"], largest=a["largest"], sorted=a["sorted"])


def _gather_mm(ctx: Any, op: Any, a: dict[str, Any]):
    axis = ctx.rings.get(op.outputs[0].name)
    if axis is not None:  # the program dispatches its rows to their experts' ranks (an ep axis): nvtp/execute/ep.py
        return ep.dispatched_gather_mm(ctx, op, axis, a["arg1"], a["arg2"], a["index"])
    return gather_mm(a["arg1"], a["arg2"], a["index"])


def _gather_mm_wgrad(ctx: Any, op: Any, a: dict[str, Any]):
    axis = ctx.rings.get(op.outputs[0].name)
    if axis is not None:
        return ep.dispatched_wgrad(ctx, op, axis, a["arg1"], a["arg2"], a["index"], a["groups"])
    return gather_mm_wgrad(a["arg1"], a["arg2"], a["index"], a["groups"])


# The reference backend's implementations (``nvtp.execute.reference.IMPLS`` takes them in).
IMPLS = {"topk": _topk, "gather_mm": _gather_mm, "gather_mm_wgrad": _gather_mm_wgrad}
