"""Elementwise families: unary, binary, comparisons, ternaries and ``cast``, with the dtype rules
of their results (which ops compute in Float: ``COMPUTE_IN_FLOAT``)."""

from __future__ import annotations

from nvtp.ir.dtypes import DType, promote
from nvtp.ir.graph import ScalarValue, TensorValue
from nvtp.ir.ops.table import Param, dtype_of, elementwise_result, float_result, register


# Ops that compute in floating point: integer inputs give a Float result.
UNARY_FLOAT = {
    "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "erf", "erfc", "erfcinv",
    "erfinv", "exp", "exp2", "expm1", "lgamma", "log", "log10", "log1p", "log2", "reciprocal",
    "rsqrt", "sigmoid", "sin", "sinh", "sqrt", "tan", "tanh",
}
# Ops whose result has the input's dtype.
# (nvFuser computes silu in the input's dtype, integers and Half included.)
UNARY_SAME = {"abs", "ceil", "floor", "frac", "neg", "relu", "round", "sign", "trunc", "bitwise_not", "set", "segment_set", "silu"}
UNARY_PREDICATE = {"isfinite", "isinf", "isnan", "isneginf", "isposinf", "isreal", "signbit", "logical_not"}
UNARY = UNARY_FLOAT | UNARY_SAME | UNARY_PREDICATE

BINARY_ARITH = {
    "add", "sub", "mul", "div", "pow", "fmod", "remainder", "mod", "maximum", "minimum", "nextafter",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift", "gcd",
}
BINARY_FLOAT = {"truediv", "atan2"}
COMPARE = {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or"}
BINARY = BINARY_ARITH | BINARY_FLOAT | COMPARE

# Ops nvFuser computes in at least single precision: a Half or BFloat16 result is Float
# (``cast_half_to_float`` in nvFuser's csrc/ops/arith.cpp). Thunder casts to Float before
# such ops anyway; abs, relu, where, clamp and the like keep Half/BFloat16.
COMPUTE_IN_FLOAT = UNARY_FLOAT | BINARY_FLOAT | {
    "neg", "add", "sub", "mul", "div", "pow", "fmod", "remainder", "mod", "maximum", "minimum", "lerp", "addcmul", "var", "var_mean",
}

# Every op whose result is computed position by position from its operands.
POINTWISE = UNARY | BINARY | {"where", "lerp", "clamp", "threshold", "addcmul", "cast"}


def _unary(name):
    def infer(a):
        x = a["arg"]
        dt = x.dtype if isinstance(x, (TensorValue, ScalarValue)) else promote(x)
        if name in UNARY_FLOAT:
            dt = float_result(dt)
        elif name in UNARY_PREDICATE:
            dt = DType.Bool
        return elementwise_result([x], compute_dtype(name, dt))

    return infer


def _binary(name):
    def infer(a):
        lhs, rhs = a["lhs"], a["rhs"]
        if name in COMPARE:
            dt = DType.Bool
        else:
            dt = promote(dtype_of(lhs), dtype_of(rhs))
            if name in BINARY_FLOAT:
                dt = float_result(dt)
        return elementwise_result([lhs, rhs], compute_dtype(name, dt))

    return infer


for _name in sorted(UNARY):
    register(_name, [Param("arg", "operand")], _unary(_name), "unary")
for _name in sorted(BINARY):
    register(_name, [Param("lhs", "operand"), Param("rhs", "operand")], _binary(_name), "binary", positional=2)


def _infer_where(a):
    c, x, y = a["condition"], a["x"], a["y"]
    return elementwise_result([c, x, y], promote(dtype_of(x), dtype_of(y)))


register("where", [Param("condition", "operand"), Param("x", "operand"), Param("y", "operand")], _infer_where, "ternary", 3)


def _infer_ternary(name: str, names: tuple[str, ...]):
    def infer(a):
        operands = [a[n] for n in names]
        return elementwise_result(operands, compute_dtype(name, promote(*(dtype_of(x) for x in operands if x is not None))))

    return infer


register("lerp", [Param("start", "operand"), Param("end", "operand"), Param("weight", "operand")], _infer_ternary("lerp", ("start", "end", "weight")), "ternary", 3)
register("clamp", [Param("arg", "operand"), Param("min", "operand"), Param("max", "operand")], _infer_ternary("clamp", ("arg",)), "ternary", 3)
register("threshold", [Param("arg", "operand"), Param("threshold", "operand"), Param("value", "operand")], _infer_ternary("threshold", ("arg",)), "ternary", 3)
register(
    "addcmul",
    [Param("arg", "operand"), Param("tensor1", "operand"), Param("tensor2", "operand"), Param("value", "operand")],
    _infer_ternary("addcmul", ("arg", "tensor1", "tensor2")),
    "ternary",
    4,
)


def _infer_cast(a):
    x = a["arg"]
    return elementwise_result([x], a["dtype"])


register("cast", [Param("arg", "operand"), Param("dtype", "dtype")], _infer_cast, "unary")


def compute_dtype(name: str, dt: DType) -> DType:
    """``dt`` widened to Float if op ``name`` computes Half/BFloat16 in Float (see COMPUTE_IN_FLOAT)."""
    return DType.Float if name in COMPUTE_IN_FLOAT and dt in (DType.Half, DType.BFloat16) else dt
