"""Indexing: ``embedding_fwd``, ``take_along_axis``, ``gather``, ``index_select``, ``scatter``."""

from __future__ import annotations

from nvtp.ir.ops.table import Out, Param, check, norm_dim, register, tensor_arg


def _infer_embedding(a):
    idx, w = tensor_arg(a, "input"), tensor_arg(a, "weight")
    check(w.ndim == 2, lambda: f"embedding weight must be 2-D, got {list(w.shape)}")
    check(idx.dtype.is_int, lambda: f"embedding indices must be integers, got {idx.dtype}")
    return [Out(idx.shape + (w.shape[1],), w.dtype)]


register(
    "embedding_fwd",
    [
        Param("input", "tensor"),
        Param("weight", "tensor"),
        Param("padding_idx", "scalar?", None),
        Param("max_norm", "scalar?", None),
        Param("norm_type", "scalar?", None),
        Param("scale_grad_by_freq", "scalar?", None),
        Param("sparse", "scalar?", None),
    ],
    _infer_embedding,
    "indexing",
    2,
)


def _infer_take_along_axis(a):
    x, idx = tensor_arg(a), tensor_arg(a, "index")
    dim = norm_dim(a["dim"], x.ndim)
    check(idx.ndim == x.ndim, lambda: f"take_along_axis index rank {idx.ndim} differs from {x.ndim}")
    for i in range(x.ndim):
        check(i == dim or idx.shape[i] == x.shape[i], lambda: f"take_along_axis: axis {i} of index ({idx.shape[i]}) and input ({x.shape[i]}) differ")
    return [Out(idx.shape, x.dtype)]


register("take_along_axis", [Param("arg", "tensor"), Param("index", "tensor"), Param("dim", "int")], _infer_take_along_axis, "indexing", 2)


def _infer_gather(a):
    x, idx = tensor_arg(a), tensor_arg(a, "index")
    check(idx.ndim == x.ndim, lambda: f"gather index rank {idx.ndim} differs from {x.ndim}")
    return [Out(idx.shape, x.dtype)]


register("gather", [Param("arg", "tensor"), Param("index", "tensor"), Param("dim", "int")], _infer_gather, "indexing", 2)


def _infer_index_select(a):
    x, idx = tensor_arg(a), tensor_arg(a, "index")
    dim = norm_dim(a["dim"], x.ndim)
    check(idx.ndim == 1, lambda: f"index_select needs a 1-D index, got {list(idx.shape)}")
    shape = list(x.shape)
    shape[dim] = idx.shape[0]
    return [Out(tuple(shape), x.dtype)]


register("index_select", [Param("arg", "tensor"), Param("index", "tensor"), Param("dim", "int")], _infer_index_select, "indexing", 2)


def _infer_scatter(a):
    x = tensor_arg(a)
    return [Out(x.shape, x.dtype)]


register("scatter", [Param("arg", "tensor"), Param("index", "tensor"), Param("src", "operand"), Param("dim", "int")], _infer_scatter, "indexing", 3)
