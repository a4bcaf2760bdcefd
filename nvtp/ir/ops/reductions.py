"""Reductions: ``sum``, ``max``, ``min``, ``prod``, ``var``, ``var_mean``, ``welford``."""

from __future__ import annotations

from typing import Sequence

from nvtp.ir.dtypes import DType
from nvtp.ir.graph import TensorValue
from nvtp.ir.ops.elementwise import compute_dtype
from nvtp.ir.ops.table import Out, Param, check, norm_dim, register


REDUCTION = {"sum", "max", "min", "prod"}


def _reduced_shape(x: TensorValue, dims: Sequence[int], keepdim: bool) -> tuple[tuple[int, ...], set[int]]:
    rdims = {norm_dim(d, x.ndim) for d in dims}
    check(len(rdims) == len(dims), lambda: f"repeated reduction dims {list(dims)}")
    shape = tuple(1 if i in rdims else s for i, s in enumerate(x.shape) if keepdim or i not in rdims)
    return shape, rdims


def _infer_reduction(name):
    def infer(a):
        x = a["arg"]
        check(isinstance(x, TensorValue), lambda: f"{name} needs a tensor")
        dims = a["dims"] if a["dims"] is not None else tuple(range(x.ndim))
        shape, _ = _reduced_shape(x, dims, a["keepdim"])
        dtype = a["dtype"]
        if dtype in (None, DType.Null):
            dtype = x.dtype
            if name in ("sum", "prod") and (dtype.is_int or dtype is DType.Bool):
                dtype = DType.Int
        return [Out(shape, dtype)]

    return infer


for _name in sorted(REDUCTION):
    register(
        _name,
        [Param("arg", "tensor"), Param("dims", "ints?", None), Param("keepdim", "bool", False), Param("dtype", "dtype?", DType.Null)],
        _infer_reduction(_name),
        "reduction",
    )


def _infer_var(a, n_out):
    x = a["arg"]
    shape, _ = _reduced_shape(x, a["dims"], a["keepdim"])
    if x.dtype.is_float or x.dtype.is_complex:
        return [Out(shape, compute_dtype("var", x.dtype))] * n_out
    # nvFuser gives an integer tensor's variance in Double and its mean in the input's dtype.
    return [Out(shape, DType.Double), Out(shape, x.dtype)][:n_out]


register("var", [Param("arg", "tensor"), Param("dims", "ints"), Param("correction", "int", 1), Param("keepdim", "bool", False)], lambda a: _infer_var(a, 1), "reduction")
register("var_mean", [Param("arg", "tensor"), Param("dims", "ints"), Param("correction", "int", 1), Param("keepdim", "bool", False)], lambda a: _infer_var(a, 2), "reduction")


def _infer_welford(a):
    x = a["arg"]
    shape, _ = _reduced_shape(x, a["dims"], False)
    return [Out(shape, x.dtype), Out(shape, x.dtype), Out(shape, DType.Int)]


register("welford", [Param("arg", "tensor"), Param("dims", "ints")], _infer_welford, "reduction")
