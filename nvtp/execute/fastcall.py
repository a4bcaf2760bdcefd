"""Op calls settled for one mesh position: what a fused lowered module calls for the ops most
programs are made of, instead of ``reference.execute_op``.

``execute_op`` runs any op on any rank: it looks the implementation up, builds its argument dict,
asks the context for local shapes and dtypes on every call, and checks each result. A lowered
module with its kernels fused (``compile="kernels"``, the default, and the pieces
``compile="inductor"`` traces) is made for one mesh position, one set of placements and inputs of
the declared shapes and dtypes (``reference.lowered_for``, ``Lowered.accepts``), so all of that is
known when it is lowered. ``specialised(ctx, op)`` settles it there and gives a call that does
the torch work and the two result checks that can still matter: the result's dtype (cast to the
one the op table infers, as ``execute_op`` casts) and, where this rank holds a part of the value,
a result computed whole (kept to this rank's part, as ``execute_op``'s ``_local_part`` does).

Each form computes what its implementation in ``impls_tensor.py`` / ``impls_nn.py`` computes, by
the same torch calls on the same operands; an op of any other form (another kind, an operand
that is a Python number where the implementation promotes it, a slice or reshape whose rank holds
indices that are not a plain range, an op an ep axis runs on its experts' rows) gets None and
runs through ``execute_op``. The interpreter (``compile="none"``, ``strict``, ``values=``,
``compute_dtype``) never uses these: it stays the reference the tests compare against.

On nvtp's GPT (hidden 256, 4 layers) a step runs about 400 op calls; ``execute_op``'s own Python
was a few milliseconds of a 70 ms step on one CPU thread (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from nvtp.execute.impls import Context, ExecutionError
from nvtp.execute.impls_nn import bias_applies
from nvtp.execute.impls_tensor import reshapes_whole
from nvtp.execute.lower import value_args
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Op, TensorValue, is_value
from nvtp.ir.ops import slice_bounds

Form = Callable[..., torch.Tensor]  # the op's torch work on its value operands, in value_args order


def specialised(ctx: Context, op: Op) -> Callable[..., Any] | None:
    """A call ``call(ctx, *values)`` giving what ``execute_op(ctx, op, args)[0]`` gives on this
    mesh position (``ctx``: the lowering's context), or None where ``op`` has no settled form."""
    if ctx.compute_dtype is not None or len(op.outputs) != 1 or not isinstance(op.outputs[0], TensorValue):
        return None
    make = _FORMS.get(op.kind)
    form = make(ctx, op) if make is not None else None
    if form is None:
        return None
    v = op.outputs[0]
    want = ctx.dtype(v.dtype)
    whole, local = tuple(v.shape), ctx.local_shape(v)

    if whole == local:
        def call(ctx: Context, *values: Any) -> Any:
            try:
                r = form(*values)
            except Exception as e:  # name the op, keep the cause (as execute_op does)
                raise ExecutionError(f"while executing {op}: {type(e).__name__}: {e}") from e
            return r if r.dtype == want else r.to(want)
    else:
        def call(ctx: Context, *values: Any) -> Any:
            try:
                r = form(*values)
            except Exception as e:
                raise ExecutionError(f"while executing {op}: {type(e).__name__}: {e}") from e
            if tuple(r.shape) == whole:  # computed whole from whole operands: this rank's part
                r = ctx.take_local(r, v)
            return r if r.dtype == want else r.to(want)

    call.__name__ = call.__qualname__ = f"fd_ops_{op.kind}"
    return call


def _tensor_operand(op: Op, name: str) -> TensorValue | None:
    a = op.arg(name)
    return a if isinstance(a, TensorValue) else None


def _reshape(ctx: Context, op: Op) -> Form | None:
    x = _tensor_operand(op, "arg")
    if x is None:
        return None
    local = ctx.local_shape(op.outputs[0])
    if reshapes_whole(math.prod(ctx.local_shape(x)), op.outputs[0], local):
        return None  # the whole operand reshaped, then this rank's part kept: execute_op's way
    return lambda x: x.reshape(local)


def _permute(ctx: Context, op: Op) -> Form | None:
    if _tensor_operand(op, "arg") is None:
        return None
    dims = tuple(op.arg("dims"))
    return lambda x: x.permute(dims)


def _broadcast_in_dim(ctx: Context, op: Op) -> Form | None:
    x = _tensor_operand(op, "arg")
    if x is None:
        return None
    shape = ctx.local_shape(op.outputs[0])
    view = [1] * len(shape)
    for i, d in enumerate(op.arg("broadcast_dims")):
        view[d] = ctx.local_shape(x)[i]
    view = tuple(view)
    return lambda x: x.reshape(view).expand(shape)


def _stride_order(ctx: Context, op: Op) -> Form | None:
    return (lambda x: x) if _tensor_operand(op, "arg") is not None else None  # a layout request: values unchanged


def _slice(ctx: Context, op: Op) -> Form | None:
    x, out = _tensor_operand(op, "arg"), op.outputs[0]
    if x is None:
        return None
    if any(i is not None for i in ctx.indices(x)) or any(i is not None for i in ctx.indices(out)):
        return None  # this rank holds a part along some axis: execute_op finds its positions
    bounds = slice_bounds(x, op.arg("start_indices"), op.arg("end_indices"), op.arg("strides"))
    if all(b == (0, n, 1) for b, n in zip(bounds, x.shape)):
        return lambda x: x
    index = tuple(slice(s, e, st) for s, e, st in bounds)
    return lambda x: x[index]


def _matmul(ctx: Context, op: Op) -> Form | None:
    return torch.matmul if value_args(op) == ["arg1", "arg2"] else None


def _linear(ctx: Context, op: Op) -> Form | None:
    names = value_args(op)
    if names == ["arg1", "arg2"]:
        return F.linear
    if names != ["arg1", "arg2", "bias"]:
        return None
    if bias_applies(ctx, op):
        return F.linear
    return lambda x, w, b: F.linear(x, w)  # a partial sum: the bias is added on position 0 only


def _sum(ctx: Context, op: Op) -> Form | None:
    x = _tensor_operand(op, "arg")
    if x is None or value_args(op) != ["arg"]:
        return None
    dims = tuple(range(x.ndim)) if op.arg("dims") is None else tuple(op.arg("dims"))
    keepdim = op.arg("keepdim")
    dtype = ctx.dtype(op.outputs[0].dtype) if op.arg("dtype") not in (None, DType.Null) else None
    if dims and all(ctx.local_shape(x)[d] == 1 for d in dims):
        # A sum over axes of one entry (Thunder's backward of an unsqueeze or a broadcast): each
        # result is its one operand entry plus 0, as the reduction's is (-0.0 becomes 0.0), in an
        # elementwise op a quarter of the reduction's cost here. A strided operand takes the
        # reduction, whose result's layout may follow it.
        shape = ctx.local_shape(op.outputs[0])
        return lambda x: torch.add(x.reshape(shape), 0.0) if x.is_contiguous() else torch.sum(x, dims, keepdim=keepdim, dtype=dtype)
    return lambda x: torch.sum(x, dims, keepdim=keepdim, dtype=dtype)


_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


def _binary(ctx: Context, op: Op) -> Form | None:
    """``impls_tensor._binary_impl`` for a tensor ``lhs`` and a floating-point result: both
    operands cast to the result's dtype first (nvFuser's rule), then the torch op."""
    out = op.outputs[0].dtype
    if not out.is_float or not is_value(op.arg("lhs")):
        return None
    fn, want = _BINARY[op.kind], ctx.dtype(out)
    rhs = op.arg("rhs")
    if is_value(rhs):
        def both(lhs, rhs):
            return fn(lhs if lhs.dtype == want else lhs.to(want), rhs if rhs.dtype == want else rhs.to(want))
        return both
    if type(rhs) not in (int, float):
        return None
    return lambda lhs: fn(lhs if lhs.dtype == want else lhs.to(want), rhs)


_UNARY = {"neg": torch.neg, "exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "rsqrt": torch.rsqrt,
          "sqrt": torch.sqrt, "abs": torch.abs, "sigmoid": torch.sigmoid, "reciprocal": torch.reciprocal, "erf": torch.erf}


def _unary(ctx: Context, op: Op) -> Form | None:
    """``impls_tensor._unary_impl`` for a floating-point result: the operand in its dtype first."""
    out = op.outputs[0].dtype
    if not out.is_float or _tensor_operand(op, "arg") is None:
        return None
    fn, want = _UNARY[op.kind], ctx.dtype(out)
    return lambda x: fn(x if x.dtype == want else x.to(want))


def _cast(ctx: Context, op: Op) -> Form | None:
    if _tensor_operand(op, "arg") is None:
        return None
    dtype = ctx.dtype(op.arg("dtype"))
    return lambda x: x.to(dtype)


_FORMS: dict[str, Callable[[Context, Op], Form | None]] = {
    "reshape": _reshape, "permute": _permute, "broadcast_in_dim": _broadcast_in_dim, "stride_order": _stride_order,
    "slice": _slice, "matmul": _matmul, "linear": _linear, "sum": _sum, "cast": _cast,
    **{kind: _binary for kind in _BINARY}, **{kind: _unary for kind in _UNARY},
}
