"""Sharding rules of the mixture-of-experts ops (``nvtp/ir/ops/moe.py``): the router's ``topk``,
``gather_mm`` and ``gather_mm_wgrad``, and their expert-parallel form.

Outside an ep pass an expert's weight is a weight like any other: its expert axis stays whole,
its in-features may reduce (row-parallel experts) and its out-features pass (column-parallel).
While the "ep" axis shards (``EXPERTS``, set by ``nvtp.sharding.axes.ep``), a ``gather_mm``'s
routed rows and its weight's expert axis are one factor, as a ring attention's query and key
sequences are one factor on cp: splitting it leaves each rank its own rows and its own block of
experts, and the op runs by all-to-all (each row dispatched to the rank holding its expert and
its result combined back: ``nvtp.execute.ep``). ``gather_mm_wgrad``'s rows and the gradient's
expert axis are one factor the same way: each rank gets its experts' whole gradient (the rows of
every rank dispatched to it), not a partial sum. The factor's size is the rows'; the experts'
divisibility by the axis is checked before any work (``nvtp.sharding.axes.ep``).
"""

from __future__ import annotations

import contextvars

from nvtp.ir.graph import Op
from nvtp.ir.ops import norm_dim
from nvtp.sharding.rules import SWITCHED, OpFactors, rule

# True while an expert-parallel ("ep") axis is sharded (nvtp.sharding.axes.ep).
EXPERTS: contextvars.ContextVar[bool] = contextvars.ContextVar("nvtp_expert_parallel", default=False)
SWITCHED.update(gather_mm=EXPERTS, gather_mm_wgrad=EXPERTS)


@rule("topk")
def _topk(op: Op) -> OpFactors:
    """Axes other than ``dim`` pass; ``dim`` is whole (a top-k of a split axis is no local top-k)."""
    x = op.arg("arg")
    dim = norm_dim(op.arg("dim"), x.ndim)
    f = OpFactors()
    axes = [f.factor(n, "blocked" if i == dim else "pass") for i, n in enumerate(x.shape)]
    picked = f.factor(op.outputs[0].shape[dim], "blocked")
    f.operands = [[(a,) for a in axes]]
    f.results = [[(picked,) if i == dim else (a,) for i, a in enumerate(axes)] for _ in op.outputs]
    return f


@rule("gather_mm")
def _gather_mm(op: Op) -> OpFactors:
    """``y[s, n] = sum_k x[s, k] w[index[s], k, n]``: rows s and outputs n pass, k reduces (a
    row-parallel expert leaves partial sums); the expert axis stays whole here, and is the rows'
    factor on an ep axis (dispatch and combine)."""
    x, w = op.arg("arg1"), op.arg("arg2")
    f = OpFactors()
    s, k, n = f.factor(x.shape[0]), f.factor(x.shape[1], "reduce", "sum"), f.factor(w.shape[2])
    e = s if EXPERTS.get() else f.factor(w.shape[0], "blocked")
    f.operands = [[(s,), (k,)], [(e,), (k,), (n,)], [(s,)]]
    f.results = [[(s,), (n,)]]
    return f


@rule("gather_mm_wgrad")
def _gather_mm_wgrad(op: Op) -> OpFactors:
    """``dw[e, k, n] = sum over rows s of expert e of x[s, k] g[s, n]``: rows reduce (split tokens
    leave each rank a partial gradient, as a linear's weight gradient), k and n pass; on an ep
    axis the rows are the experts' factor (each rank its experts' gradients, rows dispatched)."""
    x, g = op.arg("arg1"), op.arg("arg2")
    f = OpFactors()
    s = f.factor(x.shape[0], "pass" if EXPERTS.get() else "reduce", None if EXPERTS.get() else "sum")
    k, n = f.factor(x.shape[1]), f.factor(g.shape[1])
    e = s if EXPERTS.get() else f.factor(op.arg("groups"), "blocked")
    f.operands = [[(s,), (k,)], [(s,), (n,)], [(s,)]]
    f.results = [[(e,), (k,), (n,)]]
    return f
