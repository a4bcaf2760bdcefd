"""The reference backend's elementwise, reduction and shape ops (registered in ``IMPLS``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from nvtp.execute.collectives import take
from nvtp.execute.impls import IMPLS, Context, ExecutionError, Impl, as_number, as_tensor, impl, positional
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Op, TensorValue, Value, is_value
from nvtp.ir.ops import pad_pairs, slice_bounds


# ---------------------------------------------------------------------------------------------
# elementwise

_UNARY_TORCH = {
    "abs": torch.abs, "acos": torch.acos, "acosh": torch.acosh, "asin": torch.asin, "asinh": torch.asinh,
    "atan": torch.atan, "atanh": torch.atanh, "ceil": torch.ceil, "cos": torch.cos, "cosh": torch.cosh,
    "erf": torch.erf, "erfc": torch.erfc, "erfcinv": lambda x: torch.erfinv(1 - x), "erfinv": torch.erfinv,
    "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1, "floor": torch.floor, "frac": torch.frac,
    "lgamma": torch.lgamma, "log": torch.log, "log10": torch.log10, "log1p": torch.log1p, "log2": torch.log2,
    "neg": torch.neg, "reciprocal": torch.reciprocal, "relu": torch.relu, "round": torch.round,
    "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid, "sign": torch.sign, "silu": F.silu, "sin": torch.sin,
    "sinh": torch.sinh, "sqrt": torch.sqrt, "tan": torch.tan, "tanh": torch.tanh, "trunc": torch.trunc,
    "bitwise_not": torch.bitwise_not, "set": lambda x: x, "segment_set": lambda x: x,
    "isfinite": torch.isfinite, "isinf": torch.isinf, "isnan": torch.isnan, "isneginf": torch.isneginf,
    "isposinf": torch.isposinf, "isreal": torch.isreal, "signbit": torch.signbit, "logical_not": torch.logical_not,
}


def _unary_impl(name: str) -> Impl:
    fn = _UNARY_TORCH[name]

    def run(ctx: Context, op: Op, a: dict[str, Any]):
        x = as_tensor(a["arg"])
        out = op.outputs[0].dtype
        if (out.is_float or out.is_complex) and x.dtype != ctx.dtype(out):
            x = x.to(ctx.dtype(out))  # integers, and Half/BFloat16 where nvFuser computes in Float
        return fn(x)

    return run


for _n in _UNARY_TORCH:
    if _n != "set":
        IMPLS[_n] = _unary_impl(_n)


def _div(a, b):
    if isinstance(a, torch.Tensor) and not a.is_floating_point() and not a.is_complex() and \
            not (isinstance(b, float) or (isinstance(b, torch.Tensor) and (b.is_floating_point() or b.is_complex()))):
        return torch.div(a, b, rounding_mode="trunc")
    return torch.div(a, b)


_BINARY_TORCH = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": _div, "truediv": torch.true_divide,
    "pow": torch.pow, "fmod": torch.fmod, "remainder": torch.remainder,
    "mod": torch.fmod,  # nvFuser's mod is C's % on integers: truncated, the dividend's sign
    "maximum": torch.maximum, "minimum": torch.minimum, "nextafter": torch.nextafter, "atan2": torch.atan2,
    "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor,
    "bitwise_left_shift": torch.bitwise_left_shift, "bitwise_right_shift": torch.bitwise_right_shift,
    "gcd": torch.gcd, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
    "ge": torch.ge, "logical_and": torch.logical_and, "logical_or": torch.logical_or,
}


_COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge"}


# Binary ops whose torch function takes only tensors: both operands become tensors of the result type.
NEEDS_TENSORS = frozenset({"maximum", "minimum", "nextafter", "atan2", "gcd", "logical_and", "logical_or", "bitwise_left_shift",
                           "bitwise_right_shift"})


def _binary_impl(name: str) -> Impl:
    fn = _BINARY_TORCH[name]
    needs_tensors = name in NEEDS_TENSORS

    def run(ctx: Context, op: Op, a: dict[str, Any]):
        lhs, rhs = a["lhs"], a["rhs"]
        if name in _COMPARISONS and ctx.compute_dtype is not None:
            # A widened evaluation compares at the fusion's declared precision, so it takes the
            # same branches (e.g. the same dropout masks) as the run it checks.
            lhs, rhs = (_declared(ctx, x, v) for x, v in ((lhs, op.arg("lhs")), (rhs, op.arg("rhs"))))
        if not isinstance(lhs, torch.Tensor) or needs_tensors:
            lhs, rhs = _promote_pair(lhs, rhs, ctx, op)
        elif name not in _COMPARISONS and name not in ("logical_and", "logical_or"):
            # nvFuser casts operands to the result type first (Int * 0.5 is Double, BFloat16 + BFloat16 is Float).
            out = ctx.dtype(op.outputs[0].dtype)
            lhs = lhs.to(out) if lhs.dtype != out else lhs
            rhs = rhs.to(out) if isinstance(rhs, torch.Tensor) and rhs.dtype != out else rhs
        if name in ("truediv", "atan2") and not lhs.is_floating_point():
            lhs = lhs.to(ctx.dtype(DType.Float))
        return fn(lhs, rhs)

    return run


def _declared(ctx: Context, x: Any, v: Any) -> Any:
    if isinstance(x, torch.Tensor) and is_value(v) and x.is_floating_point():
        return x.to(v.dtype.torch)
    return x


def _promote_pair(lhs, rhs, ctx: Context, op: Op):
    """Both operands as tensors of the op's result type (torch needs tensors for some ops)."""
    dt = ctx.dtype(op.outputs[0].dtype) if op.outputs[0].dtype is not DType.Bool else None
    out = []
    for x in (lhs, rhs):
        x = as_tensor(x)
        if dt is not None and x.dtype != dt and op.kind not in ("eq", "ne", "lt", "le", "gt", "ge"):
            x = x.to(dt)
        out.append(x)
    return out


for _n in _BINARY_TORCH:
    IMPLS[_n] = _binary_impl(_n)



@impl("where")
def _where(ctx, op, a):
    c, x, y = a["condition"], a["x"], a["y"]
    dt = ctx.dtype(op.outputs[0].dtype)
    x = x.to(dt) if isinstance(x, torch.Tensor) and x.dtype != dt else x
    y = y.to(dt) if isinstance(y, torch.Tensor) and y.dtype != dt else y
    if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
        x = torch.tensor(x, dtype=dt)
    return torch.where(as_tensor(c), x, y)


@impl("lerp")
def _lerp(ctx, op, a):
    dt = ctx.dtype(op.outputs[0].dtype)
    start, end = as_tensor(a["start"]).to(dt), as_tensor(a["end"]).to(dt)
    w = a["weight"]
    return torch.lerp(start, end, w.to(dt) if isinstance(w, torch.Tensor) else w)


@impl("clamp")
def _clamp(ctx, op, a):
    return torch.clamp(a["arg"], as_number(a["min"]), as_number(a["max"]))


@impl("threshold")
def _threshold(ctx, op, a):
    return F.threshold(a["arg"], as_number(a["threshold"]), as_number(a["value"]))


@impl("addcmul")
def _addcmul(ctx, op, a):
    dt = ctx.dtype(op.outputs[0].dtype)
    arg, t1, t2 = (as_tensor(a[k]).to(dt) for k in ("arg", "tensor1", "tensor2"))
    return torch.addcmul(arg, t1, t2, value=as_number(a["value"]))


@impl("cast")
def _cast(ctx, op, a):
    x = a["arg"]
    dt = ctx.dtype(a["dtype"])
    if not isinstance(x, torch.Tensor):
        return torch.tensor(x, dtype=dt)
    return x.to(dt)



# ---------------------------------------------------------------------------------------------
# reductions


def _dims(a, x):
    return tuple(range(x.dim())) if a.get("dims") is None else tuple(a["dims"])


@impl("sum")
def _sum(ctx, op, a):
    x = a["arg"]
    dt = op.outputs[0].dtype
    return torch.sum(x, _dims(a, x), keepdim=a["keepdim"], dtype=ctx.dtype(dt) if a["dtype"] not in (None, DType.Null) else None).to(ctx.dtype(dt))


@impl("max")
def _max(ctx, op, a):
    x = a["arg"]
    return torch.amax(x, _dims(a, x), keepdim=a["keepdim"])


@impl("min")
def _min(ctx, op, a):
    x = a["arg"]
    return torch.amin(x, _dims(a, x), keepdim=a["keepdim"])


@impl("prod")
def _prod(ctx, op, a):
    x = a["arg"]
    dims = sorted(_dims(a, x), reverse=True)
    for d in dims:
        x = torch.prod(x, d, keepdim=True)
    if not a["keepdim"]:
        x = x.squeeze(tuple(dims)) if dims else x
    return x.to(ctx.dtype(op.outputs[0].dtype))


@impl("var")
def _var(ctx, op, a):
    x = a["arg"].to(ctx.dtype(op.outputs[0].dtype))  # integers in Double, Half/BFloat16 in Float, as nvFuser
    return torch.var(x, tuple(a["dims"]), correction=a["correction"], keepdim=a["keepdim"])


@impl("var_mean")
def _var_mean(ctx, op, a):
    x = a["arg"].to(ctx.dtype(op.outputs[0].dtype))
    var, mean = torch.var_mean(x, tuple(a["dims"]), correction=a["correction"], keepdim=a["keepdim"])
    return var, mean.to(ctx.dtype(op.outputs[1].dtype))


@impl("welford")
def _welford(ctx, op, a):
    x, dims = a["arg"], tuple(a["dims"])
    var, mean = torch.var_mean(x, dims, correction=0)
    n = math.prod(x.shape[d] for d in dims)
    return mean, var * n, torch.full(mean.shape, n, dtype=torch.int64)



# ---------------------------------------------------------------------------------------------
# shape ops


@impl("broadcast_in_dim")
def _broadcast_in_dim(ctx, op, a):
    x, bdims = a["arg"], a["broadcast_dims"]
    out_shape = ctx.local_shape(op.outputs[0])
    view = [1] * len(out_shape)
    for i, d in enumerate(bdims):
        view[d] = x.shape[i]
    return x.reshape(view).expand(out_shape)


@impl("broadcast")
def _broadcast(ctx, op, a):
    x = a["arg"]
    for i, flag in enumerate(a["is_broadcast_dim"]):
        if flag:
            x = x.unsqueeze(i)
    return x


@impl("expand")
def _expand(ctx, op, a):
    return a["arg"].expand(ctx.local_shape(op.outputs[0]))


def reshapes_whole(in_numel: int, out: TensorValue, local: tuple[int, ...]) -> bool:
    """A reshape of a whole operand to a split result (no common refinement, e.g. [6, 4] -> [4, 6])."""
    return in_numel == out.numel != math.prod(local)


@impl("reshape")
def _reshape(ctx, op, a):
    x, out = a["arg"], op.outputs[0]
    local = ctx.local_shape(out)
    if reshapes_whole(x.numel(), out, local):
        # A whole operand and a split result (a reshape without a common refinement, e.g.
        # [6, 4] -> [4, 6]): reshape all of it; run() keeps this rank's part (_local_part).
        return x.reshape(out.shape)
    return x.reshape(local)


@impl("permute")
def _permute(ctx, op, a):
    return a["arg"].permute(tuple(a["dims"]))


@impl("squeeze")
def _squeeze(ctx, op, a):
    x = a["arg"]
    dims = tuple(d % x.dim() for d in a["dims"]) if x.dim() else ()
    return x.squeeze(dims) if dims else x


@impl("stride_order")
def _stride_order(ctx, op, a):
    return a["arg"]  # a layout request; values are unchanged


def _local_positions(ctx: Context, v: Value, axis: int, wanted: torch.Tensor) -> torch.Tensor:
    """Positions in this rank's part of ``v`` of the global indices ``wanted`` along ``axis``."""
    held = ctx.indices(v)[axis]
    if held is None:
        return wanted
    inverse = torch.full((v.shape[axis],), -1, dtype=torch.int64)
    inverse[held] = torch.arange(held.numel())
    pos = inverse[wanted]
    if bool((pos < 0).any()):
        raise ExecutionError(f"rank {ctx.comm.rank} lacks entries of {v.name} along axis {axis} that {ctx.op} needs")
    return pos


@impl("slice")
def _slice(ctx, op, a):
    x, v_in, v_out = a["arg"], op.operands[0], op.outputs[0]
    bounds = slice_bounds(v_in, a["start_indices"], a["end_indices"], a["strides"])
    out_held = ctx.indices(v_out)
    for axis, (start, end, step) in enumerate(bounds):
        n_out = v_out.shape[axis]
        if out_held[axis] is None and ctx.indices(v_in)[axis] is None:
            if (start, end, step) != (0, v_in.shape[axis], 1):
                x = x[(slice(None),) * axis + (slice(start, end, step),)]
            continue
        with positional():  # which of this rank's entries: fixed by the mesh position
            wanted_out = out_held[axis] if out_held[axis] is not None else torch.arange(n_out)
            positions = _local_positions(ctx, v_in, axis, start + wanted_out * step)
        x = take(x, axis, positions)
    return x


@impl("pad")
def _pad(ctx, op, a):
    x, v_in, v_out = a["arg"], op.operands[0], op.outputs[0]
    pairs = pad_pairs(v_in.ndim, a["pad_widths"])
    value = as_number(a["value"]) if a["value"] is not None else 0
    widths = []
    for lo, hi in reversed(pairs):
        widths += [lo, hi]
    out = F.pad(x, widths, value=value)
    for axis, (lo, hi) in enumerate(pairs):
        if (lo, hi) != (0, 0) and ctx.indices(v_out)[axis] is not None:
            out = take(out, axis, ctx.indices(v_out)[axis])
    return out


@impl("cat")
def _cat(ctx, op, a):
    return torch.cat(list(a["tensors"]), a["dim"])
