"""Shape ops: broadcasts, reshape, permute, slice, squeeze, pad, cat, stride_order (and the
helpers their rules share: ``slice_bounds``, ``pad_pairs``)."""

from __future__ import annotations

import math
from typing import Sequence

from nvtp.ir.dtypes import promote
from nvtp.ir.graph import TensorValue
from nvtp.ir.ops.table import Out, Param, check, norm_dim, register, tensor_arg


def _infer_broadcast_in_dim(a):
    x, shape, bdims = tensor_arg(a), tuple(a["shape"]), tuple(a["broadcast_dims"])
    check(len(bdims) == x.ndim, lambda: f"broadcast_dims {list(bdims)} has {len(bdims)} entries for a rank-{x.ndim} operand")
    check(list(bdims) == sorted(set(bdims)), lambda: f"broadcast_dims {list(bdims)} must be strictly increasing")
    for i, d in enumerate(bdims):
        check(0 <= d < len(shape), lambda: f"broadcast_dims entry {d} out of range for output rank {len(shape)}")
        check(x.shape[i] in (1, shape[d]), lambda: f"operand axis {i} (size {x.shape[i]}) cannot broadcast to size {shape[d]}")
    return [Out(shape, x.dtype)]


register("broadcast_in_dim", [Param("arg", "tensor"), Param("shape", "shape"), Param("broadcast_dims", "ints")], _infer_broadcast_in_dim, "shape")


def _infer_broadcast(a):
    x, flags = tensor_arg(a), tuple(a["is_broadcast_dim"])
    check(sum(not f for f in flags) == x.ndim, lambda: f"is_broadcast_dim {list(flags)} must have {x.ndim} False entries")
    it = iter(x.shape)
    return [Out(tuple(1 if f else next(it) for f in flags), x.dtype)]


register("broadcast", [Param("arg", "tensor"), Param("is_broadcast_dim", "bools")], _infer_broadcast, "shape")


def _infer_expand(a):
    x, shape = tensor_arg(a), tuple(a["shape"])
    check(len(shape) == x.ndim, lambda: f"expand to rank {len(shape)} from rank {x.ndim}")
    out = tuple(x.shape[i] if s == -1 else s for i, s in enumerate(shape))
    for i, (s, t) in enumerate(zip(x.shape, out)):
        check(s in (1, t), lambda: f"axis {i} of size {s} cannot expand to {t}")
    return [Out(out, x.dtype)]


register("expand", [Param("arg", "tensor"), Param("shape", "shape")], _infer_expand, "shape")


def _infer_reshape(a):
    x, shape = tensor_arg(a), list(a["new_shape"])
    check(shape.count(-1) <= 1, lambda: f"new_shape {shape} has more than one -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        check(known > 0 and x.numel % known == 0, lambda: f"cannot infer -1 in {shape} for {x.numel} elements")
        shape[shape.index(-1)] = x.numel // known
    check(math.prod(shape) == x.numel, lambda: f"reshape of {list(x.shape)} ({x.numel} elements) to {shape} ({math.prod(shape)} elements)")
    return [Out(tuple(shape), x.dtype)]


register("reshape", [Param("arg", "tensor"), Param("new_shape", "shape")], _infer_reshape, "shape")


def _infer_permute(a):
    x, dims = tensor_arg(a), [norm_dim(d, tensor_arg(a).ndim) for d in a["dims"]]
    check(sorted(dims) == list(range(x.ndim)), lambda: f"dims {list(a['dims'])} is not a permutation of 0..{x.ndim - 1}")
    return [Out(tuple(x.shape[d] for d in dims), x.dtype)]


register("permute", [Param("arg", "tensor"), Param("dims", "ints")], _infer_permute, "shape")


def slice_bounds(x: TensorValue, starts, ends, strides) -> list[tuple[int, int, int]]:
    check(len(starts) == len(ends) == x.ndim, lambda: f"slice of a rank-{x.ndim} tensor needs {x.ndim} start and end indices")
    strides = strides if strides is not None else (1,) * x.ndim
    check(len(strides) == x.ndim, lambda: f"slice needs {x.ndim} strides")
    bounds = []
    for i, (s, e, st, n) in enumerate(zip(starts, ends, strides, x.shape)):
        check(st >= 1, lambda: f"slice stride {st} on axis {i} must be >= 1")
        s = max(0, min(n, s + n if s < 0 else s))
        e = max(s, min(n, e + n if e < 0 else e))
        bounds.append((s, e, st))
    return bounds


def _infer_slice(a):
    x = tensor_arg(a)
    bounds = slice_bounds(x, a["start_indices"], a["end_indices"], a["strides"])
    return [Out(tuple(-(-(e - s) // st) for s, e, st in bounds), x.dtype)]


register(
    "slice",
    [Param("arg", "tensor"), Param("start_indices", "ints"), Param("end_indices", "ints"), Param("strides", "ints?", None), Param("manual_normalization", "bool", False)],
    _infer_slice,
    "shape",
)


def _infer_squeeze(a):
    x = tensor_arg(a)
    dims = {norm_dim(d, x.ndim) for d in a["dims"]}
    for d in dims:
        check(x.shape[d] == 1, lambda: f"cannot squeeze axis {d} of size {x.shape[d]}")
    return [Out(tuple(s for i, s in enumerate(x.shape) if i not in dims), x.dtype)]


register("squeeze", [Param("arg", "tensor"), Param("dims", "ints"), Param("squeeze_expanded", "bool", False)], _infer_squeeze, "shape")


def pad_pairs(ndim: int, pad_widths: Sequence[int]) -> list[tuple[int, int]]:
    """nvFuser's pad_widths (innermost axis first, like torch.nn.functional.pad) as per-axis (lo, hi)."""
    check(len(pad_widths) % 2 == 0 and len(pad_widths) // 2 <= ndim, lambda: f"pad_widths {list(pad_widths)} must hold (lo, hi) pairs for at most {ndim} axes")
    pairs = [(0, 0)] * ndim
    for k in range(len(pad_widths) // 2):
        pairs[ndim - 1 - k] = (pad_widths[2 * k], pad_widths[2 * k + 1])
    return pairs


def _infer_pad(a):
    x = tensor_arg(a)
    pairs = pad_pairs(x.ndim, a["pad_widths"])
    shape = tuple(s + lo + hi for s, (lo, hi) in zip(x.shape, pairs))
    check(all(s >= 0 for s in shape), lambda: f"pad gives a negative size {list(shape)}")
    return [Out(shape, x.dtype)]


register("pad", [Param("arg", "tensor"), Param("pad_widths", "ints"), Param("value", "scalar?", None)], _infer_pad, "shape")


def _infer_cat(a):
    ts = a["tensors"]
    check(len(ts) > 0 and all(isinstance(t, TensorValue) for t in ts), lambda: "cat needs a non-empty list of tensors")
    dim = norm_dim(a["dim"], ts[0].ndim)
    for t in ts:
        check(t.ndim == ts[0].ndim and all(t.shape[i] == ts[0].shape[i] for i in range(t.ndim) if i != dim), lambda: f"cat of shapes {[list(t.shape) for t in ts]} along {dim}")
    shape = list(ts[0].shape)
    shape[dim] = sum(t.shape[dim] for t in ts)
    return [Out(tuple(shape), promote(*(t.dtype for t in ts)))]


register("cat", [Param("tensors", "tensors"), Param("dim", "int", 0), Param("manual_padding", "bool", False)], _infer_cat, "shape")


def _infer_stride_order(a):
    x = tensor_arg(a)
    check(sorted(a["stride_order"]) == list(range(x.ndim)), lambda: f"stride_order {list(a['stride_order'])} is not a permutation")
    return [Out(x.shape, x.dtype)]


register("stride_order", [Param("arg", "tensor"), Param("stride_order", "ints")], _infer_stride_order, "shape")
