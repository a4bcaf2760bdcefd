"""The op table: every op nvtp knows, with nvFuser's signature and its shape/dtype inference.

One ``OpSpec`` per op, registered from families (``UNARY``, ``BINARY``, ...). A spec's parameters
use nvFuser's Python names; the first ``positional`` of them print positionally, the rest as
keywords (omitted when equal to their default). ``infer`` returns one ``Out`` per result. The
spec also holds every fact a pass reads about the op (operand dtypes, linearity, layout,
randomness, loop domain: ``OpSpec``), each set in one place at the end of this file.

Other concerns keep their own tables keyed by the same op names: sharding rules
(``nvtp.sharding.rules``), torch implementations (``nvtp.execute.reference``), nvFuser emission
(``nvtp.execute.nvfuser``), Thunder translation (``nvtp.frontend.translate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from nvtp.ir.dtypes import DType, Scalar, promote
from nvtp.ir.graph import ScalarValue, TensorValue, is_value


class IRError(ValueError):
    """A fusion that is not well formed: bad arguments, shapes or names."""


REQUIRED = object()


@dataclass(frozen=True)
class Param:
    """A parameter: ``kind`` is one of

    tensor, tensor? (or None), tensors (a list), operand (a tensor, a scalar value or a number),
    scalar (a scalar value or a number), scalar?,
    int, int?, ints, ints?, bool, dtype, dtype?, shape, number.
    """

    name: str
    kind: str
    default: Any = REQUIRED


@dataclass(frozen=True)
class Out:
    """An inferred result: ``shape`` None means a scalar."""

    shape: tuple[int, ...] | None
    dtype: DType


@dataclass(frozen=True)
class OpSpec:
    """An op's signature and result inference, and the facts the passes read about it (set by
    ``_facts`` at the end of the table; ``tests/test_ops.py`` checks every op has each):

    dtypes       the operand dtype rules nvFuser applies (``DTYPE_RULES``) to every tensor
                 operand but those in ``typed``; ``verify`` and the parser check them.
    typed        operands with a rule of their own (``OPERAND_RULES``), e.g. integer indices.
    linear       a partial sum passes through unresolved in "all" operands together, "one" of
                 them, or the "first" (propagation; ``propagate.partial_passes``).
    layout       "moves": one operand's elements rearranged, retyped or negated one to one, so
                 a collective after the op equals the same collective before it (reshard hoists
                 all-gathers across it); "selects": some of them kept (slice). A partial sum
                 carried through either never grows.
    random       draws random numbers (never merged, never recomputed).
    loop_reduce  results whose nvFuser loop domain keeps the reduced axes (as reduction axes).
    loop_contract  the result's loop domain ends with the first operand's last (contracted) axis,
                 as a reduction axis (nvFuser's matmul and linear).
    """

    name: str
    params: tuple[Param, ...]
    infer: Callable[[Mapping[str, Any]], list[Out]]
    family: str
    positional: int = 1
    dtypes: frozenset[str] = frozenset()
    typed: tuple[tuple[str, str], ...] = ()
    linear: str = ""
    layout: str = ""
    random: bool = False
    loop_reduce: tuple[int, ...] = ()
    loop_contract: bool = False

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


OPS: dict[str, OpSpec] = {}


def spec(name: str) -> OpSpec:
    """The spec of op ``name``; a clear error if nvtp does not know it."""
    try:
        return OPS[name]
    except KeyError:
        raise IRError(
            f"unknown op fd.ops.{name}: nvtp knows {len(OPS)} ops; add it to the op table in nvtp/ir/ops.py"
        ) from None


def register(name: str, params: Sequence[Param], infer, family: str, positional: int = 1) -> None:
    if name in OPS:
        raise ValueError(f"op {name} registered twice")
    OPS[name] = OpSpec(name, tuple(params), infer, family, positional)


def _check(cond: bool, msg: Callable[[], str]) -> None:
    if not cond:
        raise IRError(msg())


# ---------------------------------------------------------------------------------------------
# helpers


def dtype_of(x: Any) -> DType | Scalar | bool | int | float | complex:
    """What ``promote`` takes: a tensor's dtype, a scalar value's ``Scalar(dtype)``, or the Python number."""
    if isinstance(x, TensorValue):
        return x.dtype
    if isinstance(x, ScalarValue):
        return Scalar(x.dtype)
    if isinstance(x, (bool, int, float, complex)):
        return x
    raise IRError(f"expected a tensor or a number, got {x!r}")


def norm_dim(d: int, ndim: int, what: str = "dim") -> int:
    _check(-ndim <= d < max(ndim, 1), lambda: f"{what} {d} out of range for a tensor of rank {ndim}")
    return d % ndim if ndim else 0


def broadcast_shapes(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Right-aligned broadcasting, as torch does; size-1 axes stretch."""
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(ndim):
        sizes = {s[len(s) - ndim + i] for s in shapes if len(s) - ndim + i >= 0} - {1}
        _check(len(sizes) <= 1, lambda: f"shapes {[list(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _elementwise(operands: Sequence[Any], dtype: DType) -> list[Out]:
    tensors = [x for x in operands if isinstance(x, TensorValue)]
    if not tensors:
        return [Out(None, dtype)]
    return [Out(broadcast_shapes([t.shape for t in tensors]), dtype)]


def _float_result(dt: DType) -> DType:
    return dt if (dt.is_float or dt.is_complex) else DType.Float


def _compute_dtype(name: str, dt: DType) -> DType:
    """``dt`` widened to Float if op ``name`` computes Half/BFloat16 in Float (see COMPUTE_IN_FLOAT)."""
    return DType.Float if name in COMPUTE_IN_FLOAT and dt in (DType.Half, DType.BFloat16) else dt


# ---------------------------------------------------------------------------------------------
# input definitions


def _infer_define_tensor(a):
    shape = a["shape"]
    _check(all(isinstance(s, int) and s >= 0 for s in shape), lambda: f"define_tensor needs a static shape, got {list(shape)}")
    contiguity = a["contiguity"]
    if contiguity is not None and not isinstance(contiguity, bool):
        _check(len(contiguity) == len(shape), lambda: f"contiguity {list(contiguity)} has {len(contiguity)} entries for a rank-{len(shape)} tensor")
        _check(
            all((c is None) == (n == 1) for c, n in zip(contiguity, shape)),
            lambda: f"define_tensor of shape {list(shape)} has contiguity {list(contiguity)}; nvFuser wants None exactly on the "
            "size-1 (broadcast) axes and True/False on the others",
        )
    order = a["stride_order"]
    if order:
        _check(sorted(order) == list(range(len(shape))), lambda: f"stride_order {list(order)} is not a permutation of 0..{len(shape) - 1}")
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
        _check(value is not None, lambda: "define_scalar needs a value or a dtype")
        dtype = promote(value)
    return [Out(None, dtype)]


register("define_scalar", [Param("value", "number?", None), Param("dtype", "dtype?", None)], _infer_define_scalar, "input")


# ---------------------------------------------------------------------------------------------
# elementwise families

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
            dt = _float_result(dt)
        elif name in UNARY_PREDICATE:
            dt = DType.Bool
        return _elementwise([x], _compute_dtype(name, dt))

    return infer


def _binary(name):
    def infer(a):
        lhs, rhs = a["lhs"], a["rhs"]
        if name in COMPARE:
            dt = DType.Bool
        else:
            dt = promote(dtype_of(lhs), dtype_of(rhs))
            if name in BINARY_FLOAT:
                dt = _float_result(dt)
        return _elementwise([lhs, rhs], _compute_dtype(name, dt))

    return infer


for _name in sorted(UNARY):
    register(_name, [Param("arg", "operand")], _unary(_name), "unary")
for _name in sorted(BINARY):
    register(_name, [Param("lhs", "operand"), Param("rhs", "operand")], _binary(_name), "binary", positional=2)


def _infer_where(a):
    c, x, y = a["condition"], a["x"], a["y"]
    return _elementwise([c, x, y], promote(dtype_of(x), dtype_of(y)))


register("where", [Param("condition", "operand"), Param("x", "operand"), Param("y", "operand")], _infer_where, "ternary", 3)


def _infer_ternary(name: str, names: tuple[str, ...]):
    def infer(a):
        operands = [a[n] for n in names]
        return _elementwise(operands, _compute_dtype(name, promote(*(dtype_of(x) for x in operands if x is not None))))

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
    return _elementwise([x], a["dtype"])


register("cast", [Param("arg", "operand"), Param("dtype", "dtype")], _infer_cast, "unary")


# ---------------------------------------------------------------------------------------------
# reductions

REDUCTION = {"sum", "max", "min", "prod"}


def _reduced_shape(x: TensorValue, dims: Sequence[int], keepdim: bool) -> tuple[tuple[int, ...], set[int]]:
    rdims = {norm_dim(d, x.ndim) for d in dims}
    _check(len(rdims) == len(dims), lambda: f"repeated reduction dims {list(dims)}")
    shape = tuple(1 if i in rdims else s for i, s in enumerate(x.shape) if keepdim or i not in rdims)
    return shape, rdims


def _infer_reduction(name):
    def infer(a):
        x = a["arg"]
        _check(isinstance(x, TensorValue), lambda: f"{name} needs a tensor")
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
        return [Out(shape, _compute_dtype("var", x.dtype))] * n_out
    # nvFuser gives an integer tensor's variance in Double and its mean in the input's dtype.
    return [Out(shape, DType.Double), Out(shape, x.dtype)][:n_out]


register("var", [Param("arg", "tensor"), Param("dims", "ints"), Param("correction", "int", 1), Param("keepdim", "bool", False)], lambda a: _infer_var(a, 1), "reduction")
register("var_mean", [Param("arg", "tensor"), Param("dims", "ints"), Param("correction", "int", 1), Param("keepdim", "bool", False)], lambda a: _infer_var(a, 2), "reduction")


def _infer_welford(a):
    x = a["arg"]
    shape, _ = _reduced_shape(x, a["dims"], False)
    return [Out(shape, x.dtype), Out(shape, x.dtype), Out(shape, DType.Int)]


register("welford", [Param("arg", "tensor"), Param("dims", "ints")], _infer_welford, "reduction")


# ---------------------------------------------------------------------------------------------
# shape ops


def _tensor(a, name="arg") -> TensorValue:
    x = a[name]
    _check(isinstance(x, TensorValue), lambda: f"argument {name} must be a tensor, got {x!r}")
    return x


def _infer_broadcast_in_dim(a):
    x, shape, bdims = _tensor(a), tuple(a["shape"]), tuple(a["broadcast_dims"])
    _check(len(bdims) == x.ndim, lambda: f"broadcast_dims {list(bdims)} has {len(bdims)} entries for a rank-{x.ndim} operand")
    _check(list(bdims) == sorted(set(bdims)), lambda: f"broadcast_dims {list(bdims)} must be strictly increasing")
    for i, d in enumerate(bdims):
        _check(0 <= d < len(shape), lambda: f"broadcast_dims entry {d} out of range for output rank {len(shape)}")
        _check(x.shape[i] in (1, shape[d]), lambda: f"operand axis {i} (size {x.shape[i]}) cannot broadcast to size {shape[d]}")
    return [Out(shape, x.dtype)]


register("broadcast_in_dim", [Param("arg", "tensor"), Param("shape", "shape"), Param("broadcast_dims", "ints")], _infer_broadcast_in_dim, "shape")


def _infer_broadcast(a):
    x, flags = _tensor(a), tuple(a["is_broadcast_dim"])
    _check(sum(not f for f in flags) == x.ndim, lambda: f"is_broadcast_dim {list(flags)} must have {x.ndim} False entries")
    it = iter(x.shape)
    return [Out(tuple(1 if f else next(it) for f in flags), x.dtype)]


register("broadcast", [Param("arg", "tensor"), Param("is_broadcast_dim", "bools")], _infer_broadcast, "shape")


def _infer_expand(a):
    x, shape = _tensor(a), tuple(a["shape"])
    _check(len(shape) == x.ndim, lambda: f"expand to rank {len(shape)} from rank {x.ndim}")
    out = tuple(x.shape[i] if s == -1 else s for i, s in enumerate(shape))
    for i, (s, t) in enumerate(zip(x.shape, out)):
        _check(s in (1, t), lambda: f"axis {i} of size {s} cannot expand to {t}")
    return [Out(out, x.dtype)]


register("expand", [Param("arg", "tensor"), Param("shape", "shape")], _infer_expand, "shape")


def _infer_reshape(a):
    x, shape = _tensor(a), list(a["new_shape"])
    _check(shape.count(-1) <= 1, lambda: f"new_shape {shape} has more than one -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        _check(known > 0 and x.numel % known == 0, lambda: f"cannot infer -1 in {shape} for {x.numel} elements")
        shape[shape.index(-1)] = x.numel // known
    _check(math.prod(shape) == x.numel, lambda: f"reshape of {list(x.shape)} ({x.numel} elements) to {shape} ({math.prod(shape)} elements)")
    return [Out(tuple(shape), x.dtype)]


register("reshape", [Param("arg", "tensor"), Param("new_shape", "shape")], _infer_reshape, "shape")


def _infer_permute(a):
    x, dims = _tensor(a), [norm_dim(d, _tensor(a).ndim) for d in a["dims"]]
    _check(sorted(dims) == list(range(x.ndim)), lambda: f"dims {list(a['dims'])} is not a permutation of 0..{x.ndim - 1}")
    return [Out(tuple(x.shape[d] for d in dims), x.dtype)]


register("permute", [Param("arg", "tensor"), Param("dims", "ints")], _infer_permute, "shape")


def slice_bounds(x: TensorValue, starts, ends, strides) -> list[tuple[int, int, int]]:
    _check(len(starts) == len(ends) == x.ndim, lambda: f"slice of a rank-{x.ndim} tensor needs {x.ndim} start and end indices")
    strides = strides if strides is not None else (1,) * x.ndim
    _check(len(strides) == x.ndim, lambda: f"slice needs {x.ndim} strides")
    bounds = []
    for i, (s, e, st, n) in enumerate(zip(starts, ends, strides, x.shape)):
        _check(st >= 1, lambda: f"slice stride {st} on axis {i} must be >= 1")
        s = max(0, min(n, s + n if s < 0 else s))
        e = max(s, min(n, e + n if e < 0 else e))
        bounds.append((s, e, st))
    return bounds


def _infer_slice(a):
    x = _tensor(a)
    bounds = slice_bounds(x, a["start_indices"], a["end_indices"], a["strides"])
    return [Out(tuple(-(-(e - s) // st) for s, e, st in bounds), x.dtype)]


register(
    "slice",
    [Param("arg", "tensor"), Param("start_indices", "ints"), Param("end_indices", "ints"), Param("strides", "ints?", None), Param("manual_normalization", "bool", False)],
    _infer_slice,
    "shape",
)


def _infer_squeeze(a):
    x = _tensor(a)
    dims = {norm_dim(d, x.ndim) for d in a["dims"]}
    for d in dims:
        _check(x.shape[d] == 1, lambda: f"cannot squeeze axis {d} of size {x.shape[d]}")
    return [Out(tuple(s for i, s in enumerate(x.shape) if i not in dims), x.dtype)]


register("squeeze", [Param("arg", "tensor"), Param("dims", "ints"), Param("squeeze_expanded", "bool", False)], _infer_squeeze, "shape")


def pad_pairs(ndim: int, pad_widths: Sequence[int]) -> list[tuple[int, int]]:
    """nvFuser's pad_widths (innermost axis first, like torch.nn.functional.pad) as per-axis (lo, hi)."""
    _check(len(pad_widths) % 2 == 0 and len(pad_widths) // 2 <= ndim, lambda: f"pad_widths {list(pad_widths)} must hold (lo, hi) pairs for at most {ndim} axes")
    pairs = [(0, 0)] * ndim
    for k in range(len(pad_widths) // 2):
        pairs[ndim - 1 - k] = (pad_widths[2 * k], pad_widths[2 * k + 1])
    return pairs


def _infer_pad(a):
    x = _tensor(a)
    pairs = pad_pairs(x.ndim, a["pad_widths"])
    shape = tuple(s + lo + hi for s, (lo, hi) in zip(x.shape, pairs))
    _check(all(s >= 0 for s in shape), lambda: f"pad gives a negative size {list(shape)}")
    return [Out(shape, x.dtype)]


register("pad", [Param("arg", "tensor"), Param("pad_widths", "ints"), Param("value", "scalar?", None)], _infer_pad, "shape")


def _infer_cat(a):
    ts = a["tensors"]
    _check(len(ts) > 0 and all(isinstance(t, TensorValue) for t in ts), lambda: "cat needs a non-empty list of tensors")
    dim = norm_dim(a["dim"], ts[0].ndim)
    for t in ts:
        _check(t.ndim == ts[0].ndim and all(t.shape[i] == ts[0].shape[i] for i in range(t.ndim) if i != dim), lambda: f"cat of shapes {[list(t.shape) for t in ts]} along {dim}")
    shape = list(ts[0].shape)
    shape[dim] = sum(t.shape[dim] for t in ts)
    return [Out(tuple(shape), promote(*(t.dtype for t in ts)))]


register("cat", [Param("tensors", "tensors"), Param("dim", "int", 0), Param("manual_padding", "bool", False)], _infer_cat, "shape")


def _infer_stride_order(a):
    x = _tensor(a)
    _check(sorted(a["stride_order"]) == list(range(x.ndim)), lambda: f"stride_order {list(a['stride_order'])} is not a permutation")
    return [Out(x.shape, x.dtype)]


register("stride_order", [Param("arg", "tensor"), Param("stride_order", "ints")], _infer_stride_order, "shape")


# ---------------------------------------------------------------------------------------------
# matmuls


def _infer_linear(a):
    x, w, b = _tensor(a, "arg1"), _tensor(a, "arg2"), a["bias"]
    _check(w.ndim in (1, 2), lambda: f"linear weight must be 1-D or 2-D, got shape {list(w.shape)}")
    k = w.shape[-1]
    _check(x.ndim >= 1 and x.shape[-1] == k, lambda: f"linear input {list(x.shape)} and weight {list(w.shape)} disagree on the contracted size")
    shape = x.shape[:-1] + ((w.shape[0],) if w.ndim == 2 else ())
    if b is not None:
        _check(isinstance(b, TensorValue) and b.shape in ((), (w.shape[0],) if w.ndim == 2 else ()), lambda: f"linear bias shape {list(getattr(b, 'shape', []))} does not match weight {list(w.shape)}")
    return [Out(shape, x.dtype)]


register("linear", [Param("arg1", "tensor"), Param("arg2", "tensor"), Param("bias", "tensor?", None)], _infer_linear, "matmul", 2)


def matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    _check(len(a) >= 1 and len(b) >= 1, lambda: "matmul needs tensors of rank >= 1")
    ka = a[-1]
    kb = b[-2] if len(b) >= 2 else b[0]
    _check(ka == kb, lambda: f"matmul of {list(a)} and {list(b)}: contracted sizes {ka} and {kb} differ")
    if len(a) == 1 and len(b) == 1:
        return ()
    if len(b) == 1:
        return a[:-1]
    if len(a) == 1:
        return b[:-2] + b[-1:]
    batch = broadcast_shapes([a[:-2], b[:-2]])
    return batch + (a[-2], b[-1])


def _infer_matmul(a):
    x, y = _tensor(a, "arg1"), _tensor(a, "arg2")
    return [Out(matmul_shape(x.shape, y.shape), promote(x.dtype, y.dtype))]


register("matmul", [Param("arg1", "tensor"), Param("arg2", "tensor")], _infer_matmul, "matmul", 2)


# ---------------------------------------------------------------------------------------------
# attention


def _infer_sdpfa_fwd(a):
    q, k, v = _tensor(a, "query"), _tensor(a, "key"), _tensor(a, "value")
    _check(q.ndim == k.ndim == v.ndim == 4, lambda: "sdpfa_fwd needs [batch, heads, seq, head_dim] query, key and value")
    b, h, s, _ = q.shape
    _check(k.shape[:2] == (b, h) and v.shape[:3] == k.shape[:3] and k.shape[3] == q.shape[3], lambda: f"sdpfa_fwd shapes q{list(q.shape)} k{list(k.shape)} v{list(v.shape)} disagree")
    return [
        Out((b, h, s, v.shape[3]), q.dtype),
        Out((b, h, s), DType.Float),
        Out((2,), DType.UInt64),
        Out((), DType.UInt64),
    ]


register(
    "sdpfa_fwd",
    [
        Param("query", "tensor"),
        Param("key", "tensor"),
        Param("value", "tensor"),
        Param("bias", "tensor?", None),
        Param("mask", "tensor?", None),
        Param("dropout_p", "scalar?", None),
        Param("is_causal", "scalar?", None),
        Param("scale", "scalar?", None),
    ],
    _infer_sdpfa_fwd,
    "attention",
    3,
)


def _infer_sdpfa_bwd(a):
    q, k, v = _tensor(a, "query"), _tensor(a, "key"), _tensor(a, "value")
    return [Out(q.shape, q.dtype), Out(k.shape, k.dtype), Out(v.shape, v.dtype)]


register(
    "sdpfa_bwd",
    [
        Param("grad_output", "tensor"),
        Param("query", "tensor"),
        Param("key", "tensor"),
        Param("value", "tensor"),
        Param("output", "tensor"),
        Param("logsumexp", "tensor"),
        Param("dropout_p", "scalar?"),
        Param("is_causal", "scalar?"),
        Param("philox_seed", "tensor"),
        Param("philox_offset", "tensor"),
        # Required, as in nvFuser (0.2.36): its sdpfa_bwd has no defaults, so a dump must always
        # write scale, None included; one that left it out would be refused by nvFuser.
        Param("scale", "scalar?"),
    ],
    _infer_sdpfa_bwd,
    "attention",
    6,
)


# ---------------------------------------------------------------------------------------------
# tensor factories (results made inside the fusion)


def _int_arg(x: Any, what: str) -> int:
    _check(isinstance(x, int) and not isinstance(x, bool), lambda: f"{what} must be a static integer, got {x!r}")
    return x


def _infer_iota(a):
    return [Out((_int_arg(a["length"], "iota length"),), a["dtype"])]


register("iota", [Param("length", "scalar"), Param("start", "scalar?", None), Param("step", "scalar?", None), Param("dtype", "dtype", DType.Int)], _infer_iota, "factory")


def _infer_full(a):
    shape = tuple(_int_arg(s, "full shape entry") for s in a["shape"])
    return [Out(shape, a["dtype"])]


register("full", [Param("shape", "shape"), Param("fill_value", "scalar"), Param("dtype", "dtype")], _infer_full, "factory")


def _infer_random(a):
    shape = tuple(_int_arg(s, "shape entry") for s in a["shape"])
    _check((a["rng_seed"] is None) == (a["rng_offset"] is None), lambda: "rng_seed and rng_offset must be given together")
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


# ---------------------------------------------------------------------------------------------
# indexing


def _infer_embedding(a):
    idx, w = _tensor(a, "input"), _tensor(a, "weight")
    _check(w.ndim == 2, lambda: f"embedding weight must be 2-D, got {list(w.shape)}")
    _check(idx.dtype.is_int, lambda: f"embedding indices must be integers, got {idx.dtype}")
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
    x, idx = _tensor(a), _tensor(a, "index")
    dim = norm_dim(a["dim"], x.ndim)
    _check(idx.ndim == x.ndim, lambda: f"take_along_axis index rank {idx.ndim} differs from {x.ndim}")
    for i in range(x.ndim):
        _check(i == dim or idx.shape[i] == x.shape[i], lambda: f"take_along_axis: axis {i} of index ({idx.shape[i]}) and input ({x.shape[i]}) differ")
    return [Out(idx.shape, x.dtype)]


register("take_along_axis", [Param("arg", "tensor"), Param("index", "tensor"), Param("dim", "int")], _infer_take_along_axis, "indexing", 2)


def _infer_gather(a):
    x, idx = _tensor(a), _tensor(a, "index")
    _check(idx.ndim == x.ndim, lambda: f"gather index rank {idx.ndim} differs from {x.ndim}")
    return [Out(idx.shape, x.dtype)]


register("gather", [Param("arg", "tensor"), Param("index", "tensor"), Param("dim", "int")], _infer_gather, "indexing", 2)


def _infer_index_select(a):
    x, idx = _tensor(a), _tensor(a, "index")
    dim = norm_dim(a["dim"], x.ndim)
    _check(idx.ndim == 1, lambda: f"index_select needs a 1-D index, got {list(idx.shape)}")
    shape = list(x.shape)
    shape[dim] = idx.shape[0]
    return [Out(tuple(shape), x.dtype)]


register("index_select", [Param("arg", "tensor"), Param("index", "tensor"), Param("dim", "int")], _infer_index_select, "indexing", 2)


def _infer_scatter(a):
    x = _tensor(a)
    return [Out(x.shape, x.dtype)]


register("scatter", [Param("arg", "tensor"), Param("index", "tensor"), Param("src", "operand"), Param("dim", "int")], _infer_scatter, "indexing", 3)


# ---------------------------------------------------------------------------------------------
# what the passes read about each op (``OpSpec``'s fact fields), one place per fact


def _facts(names: str, **fields: Any) -> None:
    for name in names.split():
        s = spec(name)
        OPS[name] = replace(s, **{k: s.dtypes | {v} if k == "dtypes" else v for k, v in fields.items()})


# Operand dtypes nvFuser refuses when a fusion is defined, which result inference by promotion
# lets through: (what the operands must be, whether the op's tensor operands ``ds`` are).
_PLAIN_FLOATS = (DType.Half, DType.BFloat16, DType.Float, DType.Double)
DTYPE_RULES: dict[str, tuple[str, Callable[[list[DType], Any], bool]]] = {
    "no_complex": ("no complex", lambda ds, op: not any(d.is_complex for d in ds)),
    "no_bool": ("no Bool", lambda ds, op: DType.Bool not in ds),
    "numeric": ("numeric (not only Bool)", lambda ds, op: not (op.outputs and op.outputs[0].dtype is DType.Bool)),
    "float": ("floating-point (Half, BFloat16, Float or Double)", lambda ds, op: all(d in _PLAIN_FLOATS for d in ds)),
    "float_or_complex": ("floating-point or complex", lambda ds, op: all(d.is_float or d.is_complex for d in ds)),
    "integer": ("integer or Bool", lambda ds, op: all(d.is_int or d is DType.Bool for d in ds)),
    "same": ("same-typed", lambda ds, op: len(set(ds)) <= 1),
    # nvFuser's mod is C's `%` in the generated CUDA: integers only (nvrtc refuses a float `%`;
    # nvFuser itself does not check, and fails compiling the kernel: seen on an H100, 2026-11-22).
    "int_only": ("integer (Int, Int32 or UInt64)",
                 lambda ds, op: all(d.is_int for d in ds) and all(v.dtype.is_int for v in op.outputs)),
}
# What to do instead, said after a rule's refusal.
DTYPE_HINTS: dict[str, str] = {
    "int_only": "for floating point use fd.ops.fmod (the dividend's sign, as C's fmod and torch.fmod) "
                "or fd.ops.remainder (the divisor's sign, as Python's % and torch.remainder)",
}
# Rules of single operands (``OpSpec.typed``): the dtypes they take (None: any) and what they hold.
OPERAND_RULES: dict[str, tuple[tuple[DType, ...] | None, str]] = {
    "index": ((DType.Int, DType.Int32), "indices"),
    "int64": ((DType.Int,), "indices"),
    "bool": ((DType.Bool,), "values"),
    "any": (None, ""),
}
for _rule, _names in {
    "no_complex": "atan2 ceil floor round trunc frac clamp erf erfc erfcinv erfinv fmod mod remainder ge gt le lt isneginf isposinf "
                  "lgamma max min maximum minimum nextafter relu threshold sign signbit",
    "no_bool": "abs ceil floor round trunc frac neg relu threshold",
    "numeric": "sub neg",
    "float": "frac silu sdpfa_fwd sdpfa_bwd linear matmul",
    "float_or_complex": "var var_mean welford",
    "integer": "bitwise_and bitwise_or bitwise_xor bitwise_not bitwise_left_shift bitwise_right_shift gcd",
    "same": "linear matmul scatter",
    "int_only": "mod",
}.items():
    _facts(_names, dtypes=_rule)
_facts("gather index_select scatter", typed=(("index", "index"),))
_facts("take_along_axis", typed=(("index", "int64"),))
_facts("embedding_fwd", typed=(("input", "index"),))
_facts("where", typed=(("condition", "bool"),))
_facts("sdpfa_bwd", typed=(("philox_seed", "any"), ("philox_offset", "any")))  # integers by design

_facts("add sub cat", linear="all")  # sums of partial sums
_facts("mul matmul", linear="one")  # a product with one factor partial
_facts("div neg cast reshape permute broadcast_in_dim expand squeeze set segment_set stride_order sum slice", linear="first")
_facts("permute reshape cast squeeze stride_order set segment_set neg", layout="moves")
_facts("slice", layout="selects")
_facts("uniform normal sdpfa_fwd", random=True)
_facts(" ".join(sorted(REDUCTION)), loop_reduce=(0,))
_facts("var_mean", loop_reduce=(1,))  # the mean; the variance's loop domain drops the reduced axes
_facts("welford", loop_reduce=(0, 1, 2))
_facts("linear matmul", loop_contract=True)

RANDOM = frozenset(name for name, s in OPS.items() if s.random)


def check_operand_dtypes(op: Any) -> None:
    """Raise ``IRError`` for operand dtypes nvFuser refuses for ``op`` (``OpSpec.dtypes`` and
    ``typed``): e.g. a Bool ``neg``, a complex ``erf`` or an Int ``linear`` weight."""
    s = spec(op.kind)
    if not (s.dtypes or s.typed):
        return
    own = dict(s.typed)
    for name, rule in s.typed:
        want, noun = OPERAND_RULES[rule]
        v = op.arg(name)
        if want is not None and is_value(v) and v.dtype not in want:
            raise IRError(f"fd.ops.{op.kind} needs {' or '.join(str(w) for w in want)} {noun} ({name}), got {v.name} of type {v.dtype}")
    named = [v for name, v in op.args if isinstance(v, TensorValue) and name not in own]
    dtypes = [v.dtype for v in named]
    for rule, (what, ok) in DTYPE_RULES.items():
        if rule in s.dtypes and not ok(dtypes, op):
            got = ", ".join(f"{v.name} ({v.dtype})" for v in named)
            if rule == "int_only":  # a float number operand shows only in the result's dtype
                got = ", ".join(filter(None, [got, *(f"result {v.name} ({v.dtype})" for v in op.outputs)]))
            hint = f"; {DTYPE_HINTS[rule]}" if rule in DTYPE_HINTS else ""
            raise IRError(f"fd.ops.{op.kind} takes {what} operands, got {got}{hint}")


# ---------------------------------------------------------------------------------------------
# binding and inference


def bind(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Bind a call's arguments to ``name``'s signature: (param, value) pairs in signature order."""
    s = spec(name)
    _check(len(args) <= len(s.params), lambda: f"fd.ops.{name} takes at most {len(s.params)} positional arguments ({_signature(s)}), got {len(args)}")
    bound: dict[str, Any] = {}
    for p, v in zip(s.params, args):
        bound[p.name] = v
    for k, v in kwargs.items():
        _check(any(p.name == k for p in s.params), lambda: f"fd.ops.{name} has no argument {k!r}; its signature is ({_signature(s)})")
        _check(k not in bound, lambda: f"fd.ops.{name} got argument {k!r} twice")
        bound[k] = v
    out = []
    for p in s.params:
        if p.name in bound:
            out.append((p.name, bound[p.name]))
        elif p.default is REQUIRED:
            raise IRError(f"fd.ops.{name} is missing argument {p.name!r}; its signature is ({_signature(s)})")
        else:
            out.append((p.name, p.default))
    return tuple(out)


def _signature(s: OpSpec) -> str:
    return ", ".join(p.name if p.default is REQUIRED else f"{p.name}={p.default!r}" for p in s.params)


def infer(name: str, args: tuple[tuple[str, Any], ...]) -> list[Out]:
    """Result shapes and dtypes of op ``name`` with bound ``args``."""
    s = spec(name)
    a = dict(args)
    for p in s.params:
        _check_kind(name, p, a[p.name])
    return s.infer(a)


def _ints(v: Any) -> bool:
    return isinstance(v, tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


# What each parameter kind accepts (built once: a dict of closures per argument was a third of
# parsing a 10^5-op file).
_KINDS: dict[str, Callable[[Any], bool]] = {
    "tensor": lambda v: isinstance(v, TensorValue),
    "tensors": lambda v: isinstance(v, tuple) and all(isinstance(t, TensorValue) for t in v),
    "operand": lambda v: is_value(v) or isinstance(v, (bool, int, float, complex)),
    "scalar": lambda v: isinstance(v, ScalarValue) or isinstance(v, (bool, int, float, complex)),
    "number": lambda v: isinstance(v, (bool, int, float, complex)),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "ints": _ints,
    "bools": lambda v: isinstance(v, tuple) and all(isinstance(x, bool) for x in v),
    "shape": _ints,
    "bool": lambda v: isinstance(v, bool),
    "dtype": lambda v: isinstance(v, DType),
    "contiguity": lambda v: isinstance(v, bool) or (isinstance(v, tuple) and all(x is None or isinstance(x, bool) for x in v)),
}


def _check_kind(op: str, p: Param, v: Any) -> None:
    kind = p.kind
    optional = kind.endswith("?")
    if optional and v is None:
        return
    _check(_KINDS[kind.rstrip("?")](v), lambda: f"fd.ops.{op}: argument {p.name} must be {p.kind}, got {v!r}")
