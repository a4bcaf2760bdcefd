"""Thunder prims to nvtp ops: one translator per prim, registered in ``TRANSLATORS``.

A translator gets the fusion builder and the bound symbol's arguments with Thunder proxies
already replaced by nvtp values (numbers stay numbers) and returns the result value(s). The
op names and arguments follow what Thunder's own nvFuser executor emits
(``thunder/executors/nvfuserex_impl.py``), so nvtp's fusions are the ones nvFuser would get.
"""

from __future__ import annotations

from typing import Any, Callable

from thunder.core import dtypes as tdtypes
from thunder.core.prims import PrimIDs

from nvtp.frontend import setitem
from nvtp.frontend.strided import interior_pad, strided_slice
from nvtp.ir.build import FusionBuilder
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import TensorValue
from nvtp.registry import registrar

Translator = Callable[..., Any]
TRANSLATORS: dict[Any, Translator] = {}


translates = registrar(TRANSLATORS, "translator")


_PYTHON_TYPES = {float: DType.Double, int: DType.Int, bool: DType.Bool, complex: DType.ComplexDouble}


def to_dtype(dtype: Any) -> DType:
    """A Thunder (or Python) dtype as an nvFuser DataType."""
    if dtype in _PYTHON_TYPES:
        return _PYTHON_TYPES[dtype]
    try:
        return DType.from_torch(tdtypes.to_torch_dtype(dtype))  # weak and strong variants alike
    except (ValueError, KeyError, TypeError):
        raise TypeError(f"no nvFuser DataType for {dtype}") from None


def input_type(p: Any) -> tuple[tuple[int, ...], DType]:
    """The shape and dtype of a fusion input for tensor proxy ``p``: a complex tensor enters as its
    real pair ``[*s, 2]`` (``torch.view_as_real``'s layout; the backends feed it so,
    ``nvtp.ir.dtypes.as_input``), since nvtp writes complex arithmetic as real arithmetic
    (``nvtp.frontend.complex``)."""
    if tdtypes.is_complex_dtype(p.dtype):
        return (*p.shape, 2), to_dtype(tdtypes.corresponding_real_dtype(p.dtype))
    return tuple(p.shape), to_dtype(p.dtype)


def supports_dtype(dtype: Any) -> bool:
    try:
        to_dtype(dtype)
        return True
    except TypeError:
        return False


# -- elementwise -----------------------------------------------------------------------------

_UNARY = {
    PrimIDs.ABS: "abs", PrimIDs.ACOS: "acos", PrimIDs.ACOSH: "acosh", PrimIDs.ASIN: "asin", PrimIDs.ASINH: "asinh",
    PrimIDs.ATAN: "atan", PrimIDs.ATANH: "atanh", PrimIDs.BITWISE_NOT: "bitwise_not", PrimIDs.CEIL: "ceil",
    PrimIDs.COS: "cos", PrimIDs.COSH: "cosh", PrimIDs.ERF: "erf", PrimIDs.ERFC: "erfc", PrimIDs.ERFCINV: "erfcinv",
    PrimIDs.ERFINV: "erfinv", PrimIDs.EXP: "exp", PrimIDs.EXP2: "exp2", PrimIDs.EXPM1: "expm1",
    PrimIDs.FLOOR: "floor", PrimIDs.ISFINITE: "isfinite", PrimIDs.LGAMMA: "lgamma", PrimIDs.LOG: "log",
    PrimIDs.LOG10: "log10", PrimIDs.LOG1P: "log1p", PrimIDs.LOG2: "log2", PrimIDs.NEG: "neg",
    PrimIDs.RECIPROCAL: "reciprocal", PrimIDs.ROUND: "round", PrimIDs.RSQRT: "rsqrt", PrimIDs.SIGN: "sign",
    PrimIDs.SIGNBIT: "signbit", PrimIDs.SIN: "sin", PrimIDs.SINH: "sinh", PrimIDs.SQRT: "sqrt", PrimIDs.TAN: "tan",
    PrimIDs.TANH: "tanh", PrimIDs.TRUNC: "trunc",
}
_BINARY = {
    PrimIDs.ADD: "add", PrimIDs.SUB: "sub", PrimIDs.MUL: "mul", PrimIDs.DIV: "div", PrimIDs.POW: "pow",
    PrimIDs.FMOD: "fmod", PrimIDs.REMAINDER: "remainder", PrimIDs.MAXIMUM: "maximum", PrimIDs.MINIMUM: "minimum",
    PrimIDs.NEXTAFTER: "nextafter", PrimIDs.ATAN2: "atan2", PrimIDs.BITWISE_AND: "bitwise_and",
    PrimIDs.BITWISE_OR: "bitwise_or", PrimIDs.BITWISE_XOR: "bitwise_xor",
    PrimIDs.BITWISE_LEFT_SHIFT: "bitwise_left_shift", PrimIDs.BITWISE_RIGHT_SHIFT: "bitwise_right_shift",
    PrimIDs.EQ: "eq", PrimIDs.NE: "ne", PrimIDs.LT: "lt", PrimIDs.LE: "le", PrimIDs.GT: "gt", PrimIDs.GE: "ge",
}


def _unary(kind: str) -> Translator:
    return lambda b, a: b.op(kind, a)


def _binary(kind: str) -> Translator:
    return lambda b, lhs, rhs: b.op(kind, lhs, rhs)


for _id, _kind in _UNARY.items():
    TRANSLATORS[_id] = _unary(_kind)
for _id, _kind in _BINARY.items():
    TRANSLATORS[_id] = _binary(_kind)


@translates(PrimIDs.WHERE)
def _where(b: FusionBuilder, pred, a, c):
    return b.op("where", pred, a, c)


@translates(PrimIDs.LERP)
def _lerp(b, start, end, weight):
    return b.op("lerp", start, end, weight)


@translates(PrimIDs.CONVERT_ELEMENT_TYPE)
def _convert(b, a, dtype):
    if not isinstance(a, TensorValue) and not hasattr(a, "name"):
        return dtype(a) if dtype in (int, float, bool, complex) else a
    target = to_dtype(dtype)
    if isinstance(a, TensorValue) and a.dtype == target:
        return a
    return b.op("cast", a, dtype=target)


@translates(PrimIDs.SHALLOW_COPY)
def _shallow_copy(b, a):
    return a  # an alias; the executor adds a `set` if an output would be an input


@translates("bool")  # torch's executor's Tensor.bool, which Thunder's functionalization binds directly
def _to_bool(b, a):
    return b.op("cast", a, dtype=DType.Bool) if isinstance(a, TensorValue) and a.dtype != DType.Bool else a


@translates(PrimIDs.CLONE)
def _clone(b, a, **kwargs):
    return b.op("set", a)


# -- shape ops -------------------------------------------------------------------------------


@translates(PrimIDs.BROADCAST_IN_DIM)
def _broadcast_in_dim(b, a, shape, broadcast_dimensions):
    return b.op("broadcast_in_dim", a, shape=list(shape), broadcast_dims=list(broadcast_dimensions))


@translates(PrimIDs.RESHAPE)
def _reshape(b, a, shape):
    return b.op("reshape", a, new_shape=list(shape))


@translates(PrimIDs.TRANSPOSE)
def _transpose(b, a, permutation):
    return b.op("permute", a, dims=list(permutation))


@translates(PrimIDs.SLICE)
def _slice(b, a, start_indices, end_indices, strides=None):
    if strides is not None and any(st != 1 for st in strides):  # x[..., ::2]: stride-1 ops (nvtp/frontend/strided.py)
        return strided_slice(b, a, start_indices, end_indices, strides)
    return b.op("slice", a, start_indices=list(start_indices), end_indices=list(end_indices), strides=[1] * len(start_indices))


@translates(PrimIDs.SQUEEZE)
def _squeeze(b, a, dims):
    return b.op("squeeze", a, dims=list(dims))


@translates(PrimIDs.CAT)
def _cat(b, tensors, dim):
    return b.op("cat", list(tensors), dim=dim)


@translates(PrimIDs.PAD)
def _pad(b, a, padding_value, padding_config):
    if any(d for _, _, d in padding_config):  # a strided slice's gradient (nvtp/frontend/strided.py)
        return interior_pad(b, a, padding_value, padding_config)
    widths: list[int] = []
    for lo, hi, _ in reversed(padding_config):
        widths += [lo, hi]
    return b.op("pad", a, widths, padding_value)


@translates(PrimIDs.STRIDE_ORDER)
def _stride_order(b, a, order):
    return b.op("stride_order", a, stride_order=list(order))


# -- reductions ------------------------------------------------------------------------------


@translates(PrimIDs.SUM)
def _sum(b, a, dims, **kwargs):
    if len(dims) == 0:
        return a
    return b.op("sum", a, dims=list(dims))


@translates(PrimIDs.AMAX)
def _amax(b, a, dims):
    return b.op("max", a, dims=list(dims))


@translates(PrimIDs.AMIN)
def _amin(b, a, dims):
    return b.op("min", a, dims=list(dims))


@translates(PrimIDs.PROD)
def _prod(b, a, dims):
    return b.op("prod", a, dims=list(dims))


@translates(PrimIDs.VAR)
def _var(b, a, dims, *, correction):
    return b.op("var", a, dims=list(dims), correction=int(correction))


@translates(PrimIDs.VAR_MEAN)
def _var_mean(b, a, dims, *, correction):
    return b.op("var_mean", a, dims=list(dims), correction=int(correction))


# -- matmuls ---------------------------------------------------------------------------------


@translates(PrimIDs.LINEAR)
def _linear(b, a, w, bias):
    return b.op("linear", a, w, bias)


@translates(PrimIDs.MATMUL)
def _matmul(b, a, c):
    return b.op("matmul", a, c)


# -- factories -------------------------------------------------------------------------------


@translates(PrimIDs.IOTA)
def _iota(b, length, *, start, step, device, dtype):
    return b.op("iota", length, start, step, to_dtype(dtype))


@translates(PrimIDs.FULL)
def _full(b, shape, fill_value, *, device, dtype):
    return b.op("full", list(shape), fill_value, to_dtype(dtype))


@translates(PrimIDs.UNIFORM)
def _uniform(b, shape, minval, maxval, *, device, dtype):
    return b.op("uniform", minval, maxval, shape=list(shape), dtype=to_dtype(dtype))


@translates(PrimIDs.RANDN)
def _randn(b, shape, *, device, dtype):  # torch.randn, torch.randn_like: normal(0, 1), fresh at every call
    return b.op("normal", 0.0, 1.0, shape=list(shape), dtype=to_dtype(dtype))


@translates(PrimIDs.UNIFORM_PHILOX)
def _uniform_philox(b, shape, minval, maxval, *, device, dtype, seed, offset):
    return b.op("uniform", minval, maxval, shape=list(shape), rng_seed=seed, rng_offset=offset, dtype=to_dtype(dtype))


# -- indexing --------------------------------------------------------------------------------


@translates(PrimIDs.TAKE)
def _take(b, a, index, dim):
    return b.op("index_select", a, index, dim)


@translates(PrimIDs.TAKE_ALONG_AXIS)
def _take_along_axis(b, a, index, dim):
    return b.op("take_along_axis", a, index, dim)


@translates(PrimIDs.GATHER)
def _gather(b, a, index, dim):
    return b.op("gather", a, index, dim)


@translates(PrimIDs.EMBEDDING)
def _embedding(b, a, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    if max_norm is not None:
        raise NotImplementedError("embedding with max_norm")
    return b.op("embedding_fwd", a, weight, padding_idx=padding_idx if padding_idx is not None and padding_idx >= 0 else None)


# -- complex inputs ----------------------------------------------------------------------------
#
# After nvtp.frontend.complex, the one complex op left is `view_as_real` of a complex tensor the
# computation takes (a rotary table buffer); the fusion defines that input as the pair already.

# Thunder's autodiff swaps the torch symbol ("torch.view_as_real") for the torch executor's
# operator of the same function ("view_as_real"); both are claimed.
COMPLEX_OK = {"torch.view_as_real", "view_as_real"}  # the translators that take a complex tensor (a fusion input)


@translates(*COMPLEX_OK)
def _view_as_real(b, a):
    if not (isinstance(a, TensorValue) and a.shape[-1:] == (2,) and not a.dtype.is_complex):
        raise AssertionError(f"view_as_real of {a}: nvtp takes it only of a fusion input, defined as its real pair")
    return a  # the input is defined as its pair (input_type)


# -- backward ops Thunder leaves as library calls ---------------------------------------------
#
# Thunder computes these two gradients with ATen kernels (scatter-adds). nvtp writes them as a
# one-hot matmul and a one-hot select, from ops nvFuser has; with the vocabulary split over
# devices, the one-hot (built from an iota) splits with it and needs no communication.

CHECKS: dict[Any, Callable[..., bool]] = {}


def _one_hot(b: FusionBuilder, index: TensorValue, classes: int) -> TensorValue:
    """[N] integer indices -> [N, classes] bool one-hot."""
    n = index.shape[0]
    ids = b.op("iota", classes, 0, 1, DType.Int)
    wide = b.op("broadcast_in_dim", index, shape=[n, classes], broadcast_dims=[0])
    cls = b.op("broadcast_in_dim", ids, shape=[n, classes], broadcast_dims=[1])
    return b.op("eq", wide, cls)


@translates(PrimIDs.EMBEDDING_BACKWARD)
def _embedding_backward(b, grad, indices, num_weights, padding_idx, scale_grad_by_freq, sparse):
    n = 1
    for s in indices.shape:
        n *= s
    e = grad.shape[-1]
    flat_idx = b.op("reshape", indices, new_shape=[n]) if indices.ndim != 1 else indices
    flat_grad = b.op("reshape", grad, new_shape=[n, e]) if grad.ndim != 2 else grad
    hit = _one_hot(b, flat_idx, num_weights)
    if padding_idx is not None and padding_idx >= 0:
        hit = b.op("logical_and", hit, b.op("ne", b.op("broadcast_in_dim", flat_idx, shape=[n, num_weights], broadcast_dims=[0]), padding_idx))
    onehot = b.op("cast", hit, dtype=flat_grad.dtype)
    return b.op("matmul", b.op("permute", onehot, dims=[1, 0]), flat_grad)  # [V, e]


for _id in COMPLEX_OK:
    CHECKS[_id] = lambda a: tdtypes.is_complex_dtype(getattr(a, "dtype", None))
CHECKS[PrimIDs.EMBEDDING_BACKWARD] = lambda grad, indices, num_weights, padding_idx, scale_grad_by_freq, sparse: not scale_grad_by_freq and not sparse


@translates("nll_loss_backward")
def _nll_loss_backward(b, g, a, target, weight, reduction, ignore_index, total_weight):
    n, classes = a.shape
    hit = _one_hot(b, target, classes)
    valid = b.op("ne", target, ignore_index)
    hit = b.op("logical_and", hit, b.op("broadcast_in_dim", valid, shape=[n, classes], broadcast_dims=[0]))
    if reduction == "mean":
        scale = b.op("div", b.op("neg", g), total_weight)
    else:
        scale = b.op("neg", g)
    if isinstance(scale, TensorValue) and scale.ndim == 1:  # reduction "none": one gradient per row
        scale = b.op("broadcast_in_dim", scale, shape=[n, classes], broadcast_dims=[0])
    elif isinstance(scale, TensorValue):
        scale = b.op("broadcast_in_dim", scale, shape=[n, classes], broadcast_dims=[])
    out = b.op("where", hit, scale, 0.0)
    return b.op("cast", out, dtype=a.dtype) if out.dtype != a.dtype else out


CHECKS["nll_loss_backward"] = lambda g, a, target, weight, reduction, ignore_index, total_weight: (
    weight is None and isinstance(a, object) and getattr(a, "ndim", 0) == 2 and reduction in ("mean", "sum", "none")
)


@translates("torch.nn.functional.nll_loss")
def _nll_loss(b, a, target, weight=None, ignore_index=None, reduction="mean"):
    """Thunder pads the class axis with a zero column for ignored targets; nvtp picks with a
    masked take_along_axis instead, so a class axis split over devices stays split (Megatron's
    parallel cross-entropy: each rank picks the logits it holds, one small all-reduce adds them)."""
    ignore = -1 if ignore_index is None else ignore_index
    n, _ = a.shape
    valid = b.op("ne", target, ignore)
    safe = b.op("where", valid, target, 0)
    picked = b.op("take_along_axis", a, b.op("broadcast_in_dim", safe, shape=[n, 1], broadcast_dims=[0]), 1)
    picked = b.op("where", valid, b.op("reshape", picked, new_shape=[n]), 0.0)
    total = b.op("neg", b.op("sum", picked, dims=[0]))
    if reduction == "sum":
        return total
    count = b.op("cast", b.op("sum", b.op("cast", valid, dtype=DType.Int), dims=[0]), dtype=a.dtype)
    return b.op("div", total, count)


CHECKS["torch.nn.functional.nll_loss"] = lambda a, target, weight=None, ignore_index=None, reduction="mean": (
    getattr(a, "ndim", 0) == 2 and getattr(target, "ndim", 0) == 1 and weight is None and reduction in ("mean", "sum")
)


# -- in-place updates of tensors the model makes (nvtp/frontend/setitem.py) ---------------------


@translates(PrimIDs.COPY_WITH_SETITEM)
def _copy_with_setitem(b, a, key, value):
    return setitem.copy_with_setitem(b, a, key, value)


@translates(PrimIDs.COPY_, *setitem.COPY_IDS)
def _copy_(b, copy_from, copy_to, *, grad_enabled=True):
    return copy_from  # the target's new value; claimed only where no one else sees its memory (setitem.copy_claimed)


@translates(PrimIDs.UPDATE_ALIASES)
def _update_aliases(b, aliases):
    return tuple(aliases)  # new names of the same values: a copy_ that would change one is not claimed (setitem.fresh_targets)


CHECKS[PrimIDs.COPY_WITH_SETITEM] = setitem.supported
for _id in (PrimIDs.COPY_, *setitem.COPY_IDS):
    CHECKS[_id] = setitem.copy_claimed

