"""The ops that bring values into a fusion: ``define_tensor`` and ``define_scalar``."""

from __future__ import annotations

from nvtp.ir.dtypes import DType, promote
from nvtp.ir.ops.table import Out, Param, check, register


def _infer_define_tensor(a):
    shape = a["shape"]
    check(all(isinstance(s, int) and s >= 0 for s in shape), lambda: f"define_tensor needs a static shape, got {list(shape)}")
    contiguity = a["contiguity"]
    if contiguity is not None and not isinstance(contiguity, bool):
        check(len(contiguity) == len(shape), lambda: f"contiguity {list(contiguity)} has {len(contiguity)} entries for a rank-{len(shape)} tensor")
        check(
            all((c is None) == (n == 1) for c, n in zip(contiguity, shape)),
            lambda: f"define_tensor of shape {list(shape)} has contiguity {list(contiguity)}; nvFuser wants None exactly on the "
            "size-1 (broadcast) axes and True/False on the others",
        )
    order = a["stride_order"]
    if order:
        check(sorted(order) == list(range(len(shape))), lambda: f"stride_order {list(order)} is not a permutation of 0..{len(shape) - 1}")
    return [Out(tuple(shape), a["dtype"])]


register(
    "define_tensor",
    [
        Param("shape", "shape"),
        Param("contiguity", "contiguity", None),
        Param("dtype", "dtype", DType.Float),
        Param("is_cpu", "bool", False),
        Param("stride_order", "ints?", None),
    ],
    _infer_define_tensor,
    "input",
    positional=0,
)


def _infer_define_scalar(a):
    value, dtype = a["value"], a["dtype"]
    if dtype is None:
        check(value is not None, lambda: "define_scalar needs a value or a dtype")
        dtype = promote(value)
    return [Out(None, dtype)]


register("define_scalar", [Param("value", "number?", None), Param("dtype", "dtype?", None)], _infer_define_scalar, "input")
