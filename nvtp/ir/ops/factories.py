"""Tensor factories (results made inside the fusion): ``iota``, ``full``, ``uniform``, ``normal``."""

from __future__ import annotations

from nvtp.ir.dtypes import DType
from nvtp.ir.ops.table import Out, Param, check, int_arg, register


def _infer_iota(a):
    return [Out((int_arg(a["length"], "iota length"),), a["dtype"])]


register("iota", [Param("length", "scalar"), Param("start", "scalar?", None), Param("step", "scalar?", None), Param("dtype", "dtype", DType.Int)], _infer_iota, "factory")


def _infer_full(a):
    shape = tuple(int_arg(s, "full shape entry") for s in a["shape"])
    return [Out(shape, a["dtype"])]


register("full", [Param("shape", "shape"), Param("fill_value", "scalar"), Param("dtype", "dtype")], _infer_full, "factory")


def _infer_random(a):
    shape = tuple(int_arg(s, "shape entry") for s in a["shape"])
    check((a["rng_seed"] is None) == (a["rng_offset"] is None), lambda: "rng_seed and rng_offset must be given together")
    return [Out(shape, a["dtype"])]


register(
    "uniform",
    [Param("minval", "scalar"), Param("maxval", "scalar"), Param("shape", "shape"), Param("rng_seed", "scalar?", None), Param("rng_offset", "scalar?", None), Param("dtype", "dtype", DType.Float)],
    _infer_random,
    "factory",
    2,
)
register(
    "normal",
    [Param("mean", "scalar"), Param("std", "scalar"), Param("shape", "shape"), Param("rng_seed", "scalar?", None), Param("rng_offset", "scalar?", None), Param("dtype", "dtype", DType.Float)],
    _infer_random,
    "factory",
    2,
)
