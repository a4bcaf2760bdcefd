"""Mixture-of-experts ops: a router's ``topk`` (nvFuser's), and the experts' matmuls with the
weight of each row chosen by an index, ``gather_mm`` and its weight gradient ``gather_mm_wgrad``
(nvtp's: nvFuser has ``grouped_mm``, which takes rows already grouped by expert and the groups'
offsets; docs/moe.md says how the two relate)."""

from __future__ import annotations

from nvtp.ir.dtypes import DType, promote
from nvtp.ir.ops.table import Out, Param, check, int_arg, norm_dim, register, tensor_arg


def _infer_topk(a):
    x = tensor_arg(a)
    dim = norm_dim(a["dim"], x.ndim)
    k = int_arg(a["k"], "topk's k")
    check(0 < k <= x.shape[dim], lambda: f"topk of {k} along axis {dim} of size {x.shape[dim]}: k must be in 1..{x.shape[dim]}")
    shape = x.shape[:dim] + (k,) + x.shape[dim + 1:]
    return [Out(shape, x.dtype), Out(shape, DType.Int)]


register("topk", [Param("arg", "tensor"), Param("k", "scalar"), Param("dim", "int", -1), Param("largest", "bool", True),
                  Param("sorted", "bool", False)], _infer_topk, "moe", 2)


def _rows_and_index(a, what: str):
    x, index = tensor_arg(a, "arg1"), tensor_arg(a, "index")
    check(x.ndim == 2, lambda: f"{what} needs 2-D rows [S, K], got {list(x.shape)}")
    check(index.shape == (x.shape[0],), lambda: f"{what}: index {list(index.shape)} must hold one expert per row of {list(x.shape)}")
    return x, index


def _infer_gather_mm(a):
    x, _ = _rows_and_index(a, "gather_mm")
    w = tensor_arg(a, "arg2")
    check(w.ndim == 3 and w.shape[1] == x.shape[1],
          lambda: f"gather_mm of rows {list(x.shape)} needs weights [experts, {x.shape[1]}, N], got {list(w.shape)}")
    return [Out((x.shape[0], w.shape[2]), promote(x.dtype, w.dtype))]


register("gather_mm", [Param("arg1", "tensor"), Param("arg2", "tensor"), Param("index", "tensor")], _infer_gather_mm, "moe", 3)


def _infer_gather_mm_wgrad(a):
    x, _ = _rows_and_index(a, "gather_mm_wgrad")
    g = tensor_arg(a, "arg2")
    groups = int_arg(a["groups"], "gather_mm_wgrad's groups")
    check(g.ndim == 2 and g.shape[0] == x.shape[0], lambda: f"gather_mm_wgrad of rows {list(x.shape)} needs gradients [{x.shape[0]}, N], got {list(g.shape)}")
    check(groups >= 1, lambda: f"gather_mm_wgrad needs at least one group (expert), got {groups}")
    return [Out((groups, x.shape[1], g.shape[1]), promote(x.dtype, g.dtype))]


register("gather_mm_wgrad", [Param("arg1", "tensor"), Param("arg2", "tensor"), Param("index", "tensor"), Param("groups", "int")],
         _infer_gather_mm_wgrad, "moe", 4)
