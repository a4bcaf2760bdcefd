"""The reference backend: runs a fusion with torch ops, on one device or as one rank of a mesh.

Every op has a torch implementation in ``IMPLS``. On a mesh, each rank holds only its part of
each value (its placement says which global indices), ops run on those local parts, and ``set``
ops whose operand and result placements differ reshard through collectives. Ops whose result
depends on where an element sits (``iota``, random numbers, vocab-sharded lookups) ask the
``Context`` for the global indices this rank holds, so a sharded run computes the same numbers
as a single-device run: random tensors are drawn whole from a seeded generator and sliced.

``compute_dtype=torch.float64`` evaluates the fusion in double precision (the check of
``nvtp replay --check``): inputs and every floating-point result are float64, while random
numbers are drawn in the declared dtype first, so both runs see the same dropout masks.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from nvtp.execute import kernels
from nvtp.execute import ring as ring_attention  # the cp axis's attention
from nvtp.execute.collectives import Comm, Communication, SoloComm, on_axis, reshard, start_reshards, take
from nvtp.execute.lower import lower, value_args
from nvtp.ir.dtypes import DType, as_input
from nvtp.ir.graph import Fusion, Op, ScalarValue, TensorValue, Value, is_value
from nvtp.ir.ops import RANDOM, pad_pairs, slice_bounds
from nvtp.sharding.placements import DeviceMesh, Placement, axis_split, held, induced, is_partial, local_indices, local_shape
from nvtp.sharding.reshard import reshard_kind
from nvtp.registry import registrar


class ExecutionError(RuntimeError):
    """An op failed while running; names the op."""


Impl = Callable[["Context", Op, dict[str, Any]], Any]
IMPLS: dict[str, Impl] = {}


impl = registrar(IMPLS, "reference impl")


@dataclass
class Context:
    """What an implementation may know beyond its arguments: placements, rank and randomness."""

    fusion: Fusion
    shardings: Mapping[str, tuple[Placement, ...]] | None = None
    mesh: DeviceMesh | None = None
    comm: Comm = field(default_factory=SoloComm)
    seed: int = 0
    compute_dtype: torch.dtype | None = None
    op: Op | None = None
    rng_count: int = 0
    log: list[Communication] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # local shapes by value name, as asked
    held: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)  # indices(v) by value name, as asked
    steps: Mapping[str, Any] | None = None  # a set's result -> its ReshardStep (nvtp.sharding.reshard), as planned
    rings: Mapping[str, int] = field(default_factory=dict)  # an attention run by ring (its first result) -> its mesh axis, as planned

    # -- placements -----------------------------------------------------------------------
    def sharding(self, v: Value) -> tuple[Placement, ...] | None:
        if self.shardings is None or not isinstance(v, TensorValue):
            return None
        return self.shardings.get(v.name)

    def indices(self, v: Value) -> list[torch.Tensor | None]:
        """Per axis, the global indices this rank holds of ``v`` (None: all of them); worked out
        once per value and mesh position (``held``), the list not to be changed."""
        got = self.held.get(v.name)
        if got is None:
            sharding = self.sharding(v)
            if sharding is None or self.mesh is None:
                got = [None] * len(v.shape)
            else:
                got = held(v.shape, sharding, self.mesh, [self.coord(a) for a in range(self.mesh.ndim)])
                got = [None if i is not None and i.numel() == n and bool((i == torch.arange(n)).all()) else i  # all, in order
                       for i, n in zip(got, v.shape)]
            self.held[v.name] = got
        return got

    def coord(self, axis: int) -> int:
        """This rank's coordinate on mesh axis ``axis``."""
        if self.mesh is None or self.mesh.ndim == 1:
            return self.comm.rank
        return self.mesh.coords(self.mesh.devices[self.comm.rank])[axis]

    def local_shape(self, v: Value) -> tuple[int, ...]:
        shape = self.shapes.get(v.name)
        if shape is None:
            sharding = self.sharding(v)
            shape = tuple(v.shape) if sharding is None or self.mesh is None else local_shape(v.shape, sharding, self.mesh)
            self.shapes[v.name] = shape
        return shape

    def take_local(self, full: torch.Tensor, v: Value) -> torch.Tensor:
        """This rank's part of ``full``, a whole (global) value of ``v``."""
        for axis, index in enumerate(self.indices(v)):
            full = take(full, axis, index)
        return full

    def dtype(self, dt: DType) -> torch.dtype:
        t = dt.torch
        if self.compute_dtype is not None and t.is_floating_point:
            return self.compute_dtype
        return t

    def generator(self, *keys: Any) -> torch.Generator:
        """A generator for the next random op, the same on every rank and in every run with ``seed``."""
        self.rng_count += 1
        text = repr((self.seed, self.rng_count) + tuple(keys)).encode()
        g = torch.Generator()
        g.manual_seed(int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1))
        return g


def _scalar(x: Any) -> Any:
    """Python numbers stay numbers; 0-dim tensors (scalar values) become numbers for torch APIs that need them."""
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        return x.item()
    return x


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, bool):
        return torch.tensor(x)
    if isinstance(x, int):
        return torch.tensor(x, dtype=torch.int64)
    if isinstance(x, complex):
        return torch.tensor(x, dtype=torch.complex128)
    return torch.tensor(x, dtype=torch.float64)


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
        x = _as_tensor(a["arg"])
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
        x = _as_tensor(x)
        if dt is not None and x.dtype != dt and op.kind not in ("eq", "ne", "lt", "le", "gt", "ge"):
            x = x.to(dt)
        out.append(x)
    return out


for _n in _BINARY_TORCH:
    IMPLS[_n] = _binary_impl(_n)


@impl("set")
def _set(ctx: Context, op: Op, a):
    """A reshard: the step the program planned for this ``set`` (``ctx.steps``: its kind and mesh
    axis), run as given. A fusion run without its steps (a bare sharded fusion) takes each axis
    whose placement changes, by ``reshard_kind``, the one place a step's kind is decided."""
    out = a["arg"]
    if set_is_local(ctx, op):
        return out
    for axis, kind, s, d, size in _reshards(ctx, op):
        out = reshard(out, kind, s, d, size, on_axis(ctx.comm, axis))
        ctx.log.append(Communication(kind, op.outputs[0].name, op.outputs[0].nbytes, axis))
    return out


def _reshards(ctx: Context, op: Op) -> list[tuple[int, str, Placement, Placement, list[int]]]:
    """(mesh axis, kind, src, dst, size as that axis's group sees the value) of each axis a ``set`` changes."""
    v = op.outputs[0]
    src, dst = ctx.sharding(op.operands[0]), ctx.sharding(v)
    step = ctx.steps.get(v.name) if ctx.steps is not None else None
    axes = [step.axis] if step is not None else [axis for axis, (s, d) in enumerate(zip(src, dst)) if s != d]
    out = []
    for axis in axes:
        s, d = src[axis], dst[axis]
        kind = step.kind if step is not None else reshard_kind(s, d)
        size = list(v.shape)
        if len(src) > 1:  # as this axis's process group sees the value: other axes' splits of a shared axis taken out
            others = held(v.shape, src, ctx.mesh, [ctx.coord(a) for a in range(ctx.mesh.ndim)], skip=axis)
            n = ctx.mesh.shape[axis]
            for dim, o in enumerate(others):
                if o is not None and any(axis_split(q) and axis_split(q)[0] == dim for q in (s, d)):
                    s, size[dim] = induced(s, v.shape[dim], o, n)
                    d, _ = induced(d, v.shape[dim], o, n)
        out.append((axis, kind, s, d, size))
    return out


def _start_for(issue: Any, ops: list[Op]) -> Callable[..., list[Any]]:
    """How a scheduled program starts the ``set`` ops of one ``Issue`` (nvtp.sharding.overlap): one
    collective on their concatenated buffers, begun now, waited for where each ``set`` stood."""

    def start(ctx: Context, *xs: Any) -> list[Any]:
        items = []
        for op, x in zip(ops, xs):
            (axis, kind, s, d, size), = _reshards(ctx, op)  # a scheduled set changes one mesh axis
            items.append((x, kind, s, d, size))
            ctx.log.append(Communication(kind, op.outputs[0].name, op.outputs[0].nbytes, axis))
        return start_reshards(items, on_axis(ctx.comm, issue.axis))

    start.__name__ = start.__qualname__ = f"start_{issue.kind}"
    return start


def _ring_for(ring: Any, op: Op, products: list[Op]) -> Callable[..., Any]:
    """How a scheduled program runs one collective matmul (``nvtp.sharding.overlap.Ring``):
    ``nvtp.execute.ring_matmul``, each ``linear``'s bias added where its op would add it."""
    from nvtp.execute import ring_matmul

    name = op.outputs[0].name

    def run(ctx: Context, x: Any, *weights: Any) -> Any:
        uses = [(p.kind, weights[2 * k], weights[2 * k + 1] if p.kind == "linear" and bias_applies(ctx, p) else None)
                for k, p in enumerate(products)]
        if ring.kind == "allgather-linear":
            return ring_matmul.allgather_linear(ctx, ring.axis, ring.dim, name, x, uses)
        (use,) = uses
        return ring_matmul.linear_reducescatter(ctx, ring.axis, ring.dim, name, x, use)

    run.__name__ = run.__qualname__ = ring.kind.replace("-", "_")
    return run


def set_is_local(ctx: Context, op: Op) -> bool:
    """True when a ``set`` moves nothing: no placements, the same ones, or one device (on which
    every placement is the whole tensor)."""
    src, dst = ctx.sharding(op.operands[0]), ctx.sharding(op.outputs[0])
    return src is None or dst is None or src == dst or ctx.comm.size == 1


@impl("where")
def _where(ctx, op, a):
    c, x, y = a["condition"], a["x"], a["y"]
    dt = ctx.dtype(op.outputs[0].dtype)
    x = x.to(dt) if isinstance(x, torch.Tensor) and x.dtype != dt else x
    y = y.to(dt) if isinstance(y, torch.Tensor) and y.dtype != dt else y
    if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
        x = torch.tensor(x, dtype=dt)
    return torch.where(_as_tensor(c), x, y)


@impl("lerp")
def _lerp(ctx, op, a):
    dt = ctx.dtype(op.outputs[0].dtype)
    start, end = _as_tensor(a["start"]).to(dt), _as_tensor(a["end"]).to(dt)
    w = a["weight"]
    return torch.lerp(start, end, w.to(dt) if isinstance(w, torch.Tensor) else w)


@impl("clamp")
def _clamp(ctx, op, a):
    return torch.clamp(a["arg"], _scalar(a["min"]), _scalar(a["max"]))


@impl("threshold")
def _threshold(ctx, op, a):
    return F.threshold(a["arg"], _scalar(a["threshold"]), _scalar(a["value"]))


@impl("addcmul")
def _addcmul(ctx, op, a):
    dt = ctx.dtype(op.outputs[0].dtype)
    arg, t1, t2 = (_as_tensor(a[k]).to(dt) for k in ("arg", "tensor1", "tensor2"))
    return torch.addcmul(arg, t1, t2, value=_scalar(a["value"]))


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
        wanted_out = out_held[axis] if out_held[axis] is not None else torch.arange(n_out)
        x = take(x, axis, _local_positions(ctx, v_in, axis, start + wanted_out * step))
    return x


@impl("pad")
def _pad(ctx, op, a):
    x, v_in, v_out = a["arg"], op.operands[0], op.outputs[0]
    pairs = pad_pairs(v_in.ndim, a["pad_widths"])
    value = _scalar(a["value"]) if a["value"] is not None else 0
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


# ---------------------------------------------------------------------------------------------
# matmuls and attention


@impl("linear")
def _linear(ctx, op, a):
    return F.linear(a["arg1"], a["arg2"], a["bias"] if bias_applies(ctx, op) else None)


def bias_applies(ctx: Context, op: Op) -> bool:
    """False on every mesh position but 0 when a ``linear``'s result is a partial sum: the bias
    is added once."""
    s = ctx.sharding(op.outputs[0])
    return not (s is not None and any(is_partial(p) and ctx.coord(a) != 0 for a, p in enumerate(s)))


@impl("matmul")
def _matmul(ctx, op, a):
    return torch.matmul(a["arg1"], a["arg2"])


def _attention(q, k, v, dropout_p, is_causal, scale, keep):
    """Attention in float32 (or wider) with an explicit dropout keep-mask; returns (out, lse)."""
    work = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = q.to(work), k.to(work), v.to(work)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if is_causal:
        s_q, s_k = scores.shape[-2:]
        mask = torch.ones(s_q, s_k, dtype=torch.bool).tril(diagonal=s_k - s_q)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if keep is not None:
        probs = probs * keep.to(work) / (1.0 - dropout_p)
    return torch.matmul(probs, vf).to(q.dtype), lse.to(torch.float32 if ctx_is_low(q) else lse.dtype)


def ctx_is_low(q: torch.Tensor) -> bool:
    return q.dtype in (torch.bfloat16, torch.float16, torch.float32)


def _attention_keep(ctx: Context, seed: torch.Tensor, offset: torch.Tensor, query: Value, q: torch.Tensor, k: torch.Tensor, p: float):
    """The dropout keep-mask for attention probabilities, drawn whole from (seed, offset) and
    sliced to the heads this rank holds."""
    if not p:
        return None
    b, h, s_q, _ = query.shape
    s_k = k.shape[-2]
    g = torch.Generator()
    g.manual_seed(int(seed.reshape(-1)[0].item()) ^ (int(offset.item()) * 0x9E3779B97F4A7C15 & ((1 << 63) - 1)))
    keep = torch.rand((b, h, s_q, s_k), generator=g) >= p
    held = ctx.indices(query)
    for axis in (0, 1):
        keep = take(keep, axis, held[axis])
    return keep


def _float_arg(x) -> float | None:
    x = _scalar(x)
    return None if x is None else float(x)




@impl("sdpfa_fwd")
def _sdpfa_fwd(ctx, op, a):
    if a["bias"] is not None or a["mask"] is not None:
        raise ExecutionError("sdpfa_fwd with bias or mask is not supported by the reference backend")
    q, k, v = a["query"], a["key"], a["value"]
    p = _float_arg(a["dropout_p"]) or 0.0
    ring = ctx.rings.get(op.outputs[0].name)
    if ring is not None:  # the program runs it by ring (a cp axis splits the sequence): nvtp/execute/ring.py
        out, lse = ring_attention.forward(ctx, op, ring, q, k, v, bool(_scalar(a["is_causal"])), _float_arg(a["scale"]))
        return out, lse.to(ctx.dtype(DType.Float)), torch.zeros(2, dtype=torch.uint64), torch.tensor(0, dtype=torch.uint64)
    g = ctx.generator("sdpfa")
    seed = torch.randint(0, 2**62, (2,), generator=g).to(torch.uint64)
    offset = torch.tensor(ctx.rng_count, dtype=torch.uint64)
    keep = _attention_keep(ctx, seed, offset, op.operands[0], q, k, p)
    out, lse = _attention(q, k, v, p, bool(_scalar(a["is_causal"])), _float_arg(a["scale"]), keep)
    return out, lse.to(ctx.dtype(DType.Float)), seed, offset


@impl("sdpfa_bwd")
def _sdpfa_bwd(ctx, op, a):
    """Flash attention's backward as nvFuser (flash / cuDNN) computes it: FROM the given
    logsumexp and output, never by re-running the forward (so an lse or out that q, k, v did
    not produce gives other gradients, as on the GPU)::

        P  = exp(scale·Q Kᵀ (causal-masked) − lse)      Pd = P · keep / (1 − p)   (dropout)
        dV = Pdᵀ dO      dPd = dO Vᵀ      dP = dPd · keep / (1 − p)
        D  = rowsum(dO ∘ out)      dS = P ∘ (dP − D)      dQ = scale · dS K      dK = scale · dSᵀ Q

    With out and lse from the forward of the same q, k, v this is autograd's gradient. Computed
    in float32 (or wider), as the flash kernels do."""
    q, k, v, go = a["query"], a["key"], a["value"], a["grad_output"]
    p = _float_arg(a["dropout_p"]) or 0.0
    ring = ctx.rings.get(op.outputs[0].name)
    if ring is not None:  # the program runs it by ring (a cp axis splits the sequence): nvtp/execute/ring.py
        return ring_attention.backward(ctx, op, ring, go, q, k, v, a["output"], a["logsumexp"], bool(_scalar(a["is_causal"])),
                                       _float_arg(a["scale"]))
    keep = _attention_keep(ctx, a["philox_seed"], a["philox_offset"], op.operands[1], q, k, p)
    work = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf, gof, outf, lse = (t.to(work) for t in (q, k, v, go, a["output"], a["logsumexp"]))
    scale = _float_arg(a["scale"])
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    probs = torch.exp(torch.matmul(qf, kf.transpose(-2, -1)) * scale - lse.unsqueeze(-1))  # (B, H, Sq, Sk)
    if bool(_scalar(a["is_causal"])):
        s_q, s_k = probs.shape[-2:]
        probs = probs.masked_fill(~torch.ones(s_q, s_k, dtype=torch.bool).tril(diagonal=s_k - s_q), 0.0)
    drop = keep.to(work) / (1.0 - p) if keep is not None else None
    dropped = probs if drop is None else probs * drop
    gv = torch.matmul(dropped.transpose(-2, -1), gof)
    gp = torch.matmul(gof, vf.transpose(-2, -1))
    if drop is not None:
        gp = gp * drop
    gs = probs * (gp - (gof * outf).sum(-1, keepdim=True))
    gq = torch.matmul(gs, kf) * scale
    gk = torch.matmul(gs.transpose(-2, -1), qf) * scale
    return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# factories


@impl("iota")
def _iota(ctx, op, a):
    n = a["length"]
    start = _scalar(a["start"]) if a["start"] is not None else 0
    step = _scalar(a["step"]) if a["step"] is not None else 1
    full = start + torch.arange(n, dtype=torch.float64 if isinstance(step, float) or isinstance(start, float) else torch.int64) * step
    return ctx.take_local(full.to(ctx.dtype(a["dtype"])), op.outputs[0])


@impl("full")
def _full(ctx, op, a):
    return torch.full(ctx.local_shape(op.outputs[0]), _scalar(a["fill_value"]), dtype=ctx.dtype(a["dtype"]))


def _random(kind: str) -> Impl:
    def run(ctx: Context, op: Op, a):
        v = op.outputs[0]
        keys = (kind,)
        if a["rng_seed"] is not None:
            keys += (int(_scalar(a["rng_seed"])), int(_scalar(a["rng_offset"])))
        g = ctx.generator(*keys)
        declared = a["dtype"].torch
        if kind == "uniform":
            lo, hi = _scalar(a["minval"]), _scalar(a["maxval"])
            full = torch.rand(v.shape, generator=g, dtype=declared)
            if (lo, hi) != (0, 1):  # x * 1.0 + 0.0 is x: dropout's uniform(0, 1) skips two passes
                full = full * (hi - lo) + lo
        else:
            mean, std = _scalar(a["mean"]), _scalar(a["std"])
            full = torch.randn(v.shape, generator=g, dtype=declared) * std + mean
        return ctx.take_local(full.to(declared).to(ctx.dtype(a["dtype"])), v)

    return run


IMPLS["uniform"] = _random("uniform")
IMPLS["normal"] = _random("normal")


# ---------------------------------------------------------------------------------------------
# indexing


def _masked_lookup(ctx: Context, table_value: Value, axis: int, index: torch.Tensor):
    """Local positions of global ``index`` entries along ``axis`` of a sharded table, and which
    entries this rank holds (the others contribute zero to a Partial result)."""
    held = ctx.indices(table_value)[axis]
    if held is None:
        return index, None
    inverse = torch.full((table_value.shape[axis],), -1, dtype=torch.int64)
    inverse[held] = torch.arange(held.numel())
    pos = inverse[index]
    present = pos >= 0
    return pos.clamp(min=0), present


@impl("embedding_fwd")
def _embedding_fwd(ctx, op, a):
    idx, w = a["input"], a["weight"]
    pos, present = _masked_lookup(ctx, op.operands[1], 0, idx)
    # padding_idx changes only the gradient (torch and nvFuser look its row up like any other;
    # nn.Embedding initialises that row to zeros), so the forward ignores it.
    out = F.embedding(pos, w)
    if present is not None:
        out = out * present.unsqueeze(-1).to(out.dtype)
    return out


@impl("take_along_axis")
def _take_along_axis(ctx, op, a):
    x, idx, dim = a["arg"], a["index"], a["dim"] % a["arg"].dim()
    pos, present = _masked_lookup(ctx, op.operands[0], dim, idx)
    out = torch.take_along_dim(x, pos, dim)
    if present is not None:
        out = out * present.to(out.dtype)
    return out


@impl("gather")
def _gather(ctx, op, a):
    return torch.gather(a["arg"], a["dim"], a["index"])


@impl("index_select")
def _index_select(ctx, op, a):
    x, idx = a["arg"], a["index"]
    dim = a["dim"] % x.dim()
    pos, present = _masked_lookup(ctx, op.operands[0], dim, idx)
    out = torch.index_select(x, dim, pos)
    if present is not None:  # a table split along dim: rows this rank lacks contribute zero
        shape = [1] * out.dim()
        shape[dim] = present.numel()
        out = out * present.reshape(shape).to(out.dtype)
    return out


@impl("scatter")
def _scatter(ctx, op, a):
    return torch.scatter(a["arg"], a["dim"], a["index"], a["src"])


# ---------------------------------------------------------------------------------------------
# running a fusion: lowered once to a torch.fx GraphModule (nvtp/execute/lower.py), then called


def _local_part(ctx: Context, v: Value, r: torch.Tensor) -> torch.Tensor:
    """This rank's part of result ``v`` when the implementation computed all of it.

    A factor that appears only in an op's results may be split with the operands whole (the
    rules' "results computed locally": a ``cat`` of unequal parts, ``gather``, ``index_select``,
    ``scatter`` or a ``reshape`` without a common refinement whose output axis is split); the
    torch implementation then computes the whole result from the whole operands and each rank
    keeps its slice."""
    if isinstance(v, TensorValue) and tuple(r.shape) == tuple(v.shape) != ctx.local_shape(v):
        return ctx.take_local(r, v)
    return r


def execute_op(ctx: Context, op: Op, args: dict[str, Any], strict: bool = False) -> tuple[torch.Tensor, ...]:
    """Run one op's implementation on resolved ``args``: its results as this rank holds them, in
    the dtypes the op table infers (``strict``: raise instead of casting). Errors name the op."""
    ctx.op = op
    fn = IMPLS.get(op.kind)
    if fn is None:
        raise ExecutionError(f"the reference backend has no implementation of fd.ops.{op.kind}; add one to nvtp/execute/reference.py")
    try:
        result = fn(ctx, op, args)
    except ExecutionError:
        raise
    except Exception as e:  # name the op, keep the cause
        raise ExecutionError(f"while executing {op}: {type(e).__name__}: {e}") from e
    results = result if isinstance(result, tuple) else (result,)
    if len(results) != len(op.outputs):
        raise ExecutionError(f"{op.kind} implementation returned {len(results)} results, expected {len(op.outputs)}")
    out = []
    for v, r in zip(op.outputs, results):
        r = _local_part(ctx, v, _as_tensor(r))
        want = ctx.dtype(v.dtype)
        if strict and (r.dtype != want or tuple(r.shape) != ctx.local_shape(v)):
            raise ExecutionError(f"while executing {op}: the implementation gave {v.name} as {r.dtype}{list(r.shape)}, "
                                 f"the op table infers {want}{list(ctx.local_shape(v))}")
        if r.dtype != want:
            r = r.to(want)
        out.append(r)
    return tuple(out)


def input_value(ctx: Context, v: Value, x: Any) -> Any:
    """A fusion input as the run holds it (scalars as 0-d tensors of their dtype); checks tensors."""
    if isinstance(v, TensorValue):
        if not isinstance(x, torch.Tensor):
            raise ExecutionError(f"input {v.name} must be a tensor, got {type(x).__name__}")
        if ctx.compute_dtype is not None and x.is_floating_point():
            x = x.to(ctx.compute_dtype)
        return x
    return _as_tensor(x).to(ctx.dtype(v.dtype))


def constant_value(ctx: Context, op: Op) -> torch.Tensor | None:
    """The 0-d tensor a ``define_scalar`` with a value defines (None for a scalar input)."""
    if op.arg("value") is None:
        return None
    return _as_tensor(op.arg("value")).to(ctx.dtype(op.outputs[0].dtype))


def _call_for(strict: bool) -> Callable[[Op], Callable[..., Any]]:
    """How a lowered module calls ``op``: its implementation through ``execute_op``, the values
    it reads passed positionally (the node's arguments), every other argument bound here."""

    def call_for(op: Op) -> Callable[..., Any]:
        names = value_args(op)
        static = {name: a for name, a in op.args if name not in names}
        single = len(op.outputs) == 1

        def call(ctx: Context, *values: Any) -> Any:
            args = dict(static)
            args.update(zip(names, values))
            results = execute_op(ctx, op, args, strict)
            return results[0] if single else results

        call.__name__ = call.__qualname__ = f"fd_ops_{op.kind}"
        return call

    return call_for


_FOLD_LIMIT = 4 << 20  # bytes a folded constant may keep alive


class _Position(SoloComm):
    """The mesh position a module is lowered for; lowering never communicates."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def _constants(ctx: Context, fold: bool) -> dict[str, Any]:
    """Every ``define_scalar`` value, and (``fold``) the results of ops that read only
    constants, are not random and are small (e.g. the causal mask's iota, broadcasts, compare):
    computed once, by their implementations, while lowering."""
    constants: dict[str, Any] = {}
    for op in ctx.fusion.ops:
        if op.kind == "define_scalar":
            c = constant_value(ctx, op)
            if c is not None:
                constants[op.outputs[0].name] = c
        elif fold and op.kind not in RANDOM and op.kind not in ("set", "segment_set", "define_tensor") and \
                all(v.name in constants for v in op.operands):
            args = {name: _resolve(a, constants) for name, a in op.args}
            try:
                results = execute_op(ctx, op, args)
            except ExecutionError:
                continue  # the run raises it, in its place
            if all(r.untyped_storage().nbytes() <= _FOLD_LIMIT for r in results):
                constants.update((v.name, r) for v, r in zip(op.outputs, results))
    return constants


def _resolve(x: Any, env: Mapping[str, Any]) -> Any:
    if is_value(x):
        return env[x.name]
    if isinstance(x, tuple) and any(is_value(e) for e in x):
        return tuple(_resolve(e, env) for e in x)
    return x


@dataclass
class Lowered:
    """A fusion lowered for one mesh position: ``module(ctx, *inputs)`` runs it."""

    module: Callable[..., Any]  # a torch.fx GraphModule (with all_values: the graph run by fx's Interpreter)
    inputs: list[tuple[Value, tuple[int, ...], torch.dtype]]  # declared local shape and dtype of each input
    shapes: dict[str, tuple[int, ...]]  # local shapes, filled as the runs ask (Context.local_shape)
    fused: dict[str, int]  # pattern name -> times fused
    folded: int  # ops computed while lowering
    held: dict[str, list[Any]] = field(default_factory=dict)  # the global indices held, filled as the runs ask (Context.indices)

    def accepts(self, inputs: Sequence[Any]) -> bool:
        """True when ``inputs`` have the local shapes and dtypes the module was lowered for."""
        return len(inputs) == len(self.inputs) and all(
            not isinstance(v, TensorValue) or (isinstance(x, torch.Tensor) and x.dtype == dtype and tuple(x.shape) == shape)
            for (v, shape, dtype), x in zip(self.inputs, inputs))


def lower_fusion(fusion: Fusion, shardings: Mapping[str, tuple[Placement, ...]] | None = None, mesh: DeviceMesh | None = None,
                 rank: int = 0, size: int = 1, *, compute_dtype: torch.dtype | None = None, strict: bool = False,
                 fuse: bool = True, all_values: bool = False, schedule: Any = None) -> Lowered:
    """Lower ``fusion`` for mesh position ``rank`` of ``size``: constants folded, and with ``fuse``
    every group with a fused torch kernel replaced by it (``kernels.py``: cross-entropy, the
    embedding's gradient, LayerNorm, RMSNorm, softmax, GELU, SiLU).
    ``schedule`` (``nvtp.sharding.overlap.Schedule``): collectives start where it says, each waited
    for where its ``set`` stands."""
    ctx = Context(fusion, shardings, mesh, _Position(rank, size), 0, compute_dtype)
    constants = _constants(ctx, fold=not all_values)
    folded = sum(1 for op in fusion.ops if op.kind != "define_scalar" and op.outputs and all(v.name in constants for v in op.outputs))
    fused: dict[str, int] = {}

    producers = fusion.producers()

    def rewrite(graph):
        fused.update(kernels.fuse(graph, ctx.local_shape, ctx.sharding, ctx.dtype, lambda op: set_is_local(ctx, op), size,
                                  lambda v: producers.get(v.name)))

    starts = schedule.by_position() if schedule is not None and size > 1 else None
    rings = getattr(schedule, "rings", ()) if starts is not None else ()
    module = lower(fusion, _call_for(strict), constants, rewrite=rewrite if fuse else None, all_values=all_values,
                   starts=starts, start_for=_start_for, rings=rings, ring_for=_ring_for)
    inputs = [(v, ctx.local_shape(v) if isinstance(v, TensorValue) else (), ctx.dtype(v.dtype)) for v in fusion.inputs]
    return Lowered(module, inputs, ctx.shapes, fused, folded)


@dataclass
class _Entry:
    fusion: "weakref.ref[Fusion]"
    key: tuple
    lowered: Lowered


_CACHE: dict[int, list[_Entry]] = {}
_PER_FUSION = 8


def lowered_for(fusion: Fusion, shardings: Mapping[str, tuple[Placement, ...]] | None, mesh: DeviceMesh | None,
                rank: int, size: int, **options: Any) -> Lowered:
    """The lowered module of ``fusion`` for this mesh position and options (lowered on first use)."""
    key = (id(shardings), mesh, rank, size, tuple(sorted((k, id(v) if k == "schedule" else v) for k, v in options.items())))
    entries = _CACHE.get(id(fusion))
    for e in entries or ():
        if e.fusion() is fusion and e.key == key:
            return e.lowered
    lowered = lower_fusion(fusion, shardings, mesh, rank, size, **options)
    if not entries or entries[0].fusion() is not fusion:
        entries = _CACHE[id(fusion)] = []
        weakref.finalize(fusion, _CACHE.pop, id(fusion), None)
    entries.append(_Entry(weakref.ref(fusion), key, lowered))
    del entries[:-_PER_FUSION]
    return lowered


def fused_patterns(fusion: Fusion) -> dict[str, int]:
    """How many groups of each pattern ``fusion``'s lowered modules run as one kernel (summed over
    the mesh positions and options it was lowered for so far; ``"set"``: the sets taken out)."""
    counts: dict[str, int] = {}
    for e in _CACHE.get(id(fusion), ()):
        if e.fusion() is fusion:
            for name, n in e.lowered.fused.items():
                counts[name] = counts.get(name, 0) + n
    return counts


# Fused kernels stand in for the patterns' ops only while those ops run their own implementations:
# a changed table (a test's monkeypatch, an implementation registered at run time) runs unfused.
_PRISTINE_IMPLS: dict[str, Impl] = {}


def run(
    fusion: Fusion,
    inputs: Sequence[Any],
    *,
    shardings: Mapping[str, tuple[Placement, ...]] | None = None,
    mesh: DeviceMesh | None = None,
    comm: Comm | None = None,
    seed: int = 0,
    compute_dtype: torch.dtype | None = None,
    log: list[Communication] | None = None,
    strict: bool = False,
    values: dict[str, Any] | None = None,
    compiled: bool = True,
    steps: Mapping[str, Any] | None = None,
    schedule: Any = None,
    rings: Mapping[str, int] | None = None,
) -> list[Any]:
    """Run ``fusion`` on ``inputs`` (this rank's parts when ``shardings`` are given) and return its outputs.

    The fusion is lowered once per mesh position and options to a torch.fx GraphModule
    (``lower_fusion``): one call per op, each op exactly as its implementation here says, each
    value dropped after its last use. Results are cast to the dtype the op table infers; with
    ``strict`` an implementation whose result has another dtype or shape raises instead (the op
    tests use it to keep the table and the implementations in agreement). ``values``, if given,
    receives every value of the run by name (inputs, constants and op results, as this rank holds
    them; scalars as 0-d tensors), e.g. for the rule tests, which re-run each op on its own.

    By default the groups with a fused torch kernel (``kernels.py``) run as that kernel (rounding
    as eager PyTorch does); ``compiled=False``, ``strict``, ``values`` and ``compute_dtype`` run every op
    by its own implementation, and so do inputs of other shapes or dtypes than declared.
    ``steps`` (a ``ShardedFusion``'s ``set_steps``) say what each ``set`` does: run as planned.
    ``schedule`` (``nvtp.sharding.overlap.Schedule``): when collectives start and which go together.
    ``rings``: the attentions the program runs by ring (first result -> mesh axis; its steps).
    """
    comm = comm or SoloComm()
    if len(inputs) != len(fusion.inputs):
        raise ExecutionError(f"{fusion.name} takes {len(fusion.inputs)} inputs, got {len(inputs)}")
    inputs = [as_input(x, v.shape, v.dtype) if isinstance(v, TensorValue) else x for v, x in zip(fusion.inputs, inputs)]
    options = dict(compute_dtype=compute_dtype, strict=strict, all_values=values is not None, schedule=schedule)
    fuse = compiled and not strict and values is None and compute_dtype is None and IMPLS == _PRISTINE_IMPLS
    lowered = lowered_for(fusion, shardings, mesh, comm.rank, comm.size, fuse=fuse, **options)
    if fuse and lowered.fused and not lowered.accepts(inputs):
        lowered = lowered_for(fusion, shardings, mesh, comm.rank, comm.size, fuse=False, **options)
    ctx = Context(fusion, shardings, mesh, comm, seed, compute_dtype, shapes=lowered.shapes, held=lowered.held, steps=steps, rings=dict(rings or {}))
    if log is not None:
        ctx.log = log
    try:
        # The GraphModule's forward, not its __call__: a fusion is no module of the user's, so module
        # hooks (torch's CommDebugMode / ModTracker track every module called) must not see it.
        run = getattr(lowered.module, "forward", lowered.module)
        out = run(ctx, *(input_value(ctx, v, x) for v, x in zip(fusion.inputs, inputs)))
    except ExecutionError:
        raise
    except Exception as e:  # a fused kernel: name the fusion, keep the cause
        raise ExecutionError(f"while running {fusion.name}: {type(e).__name__}: {e}") from e
    if values is not None:
        values.update(out)
        out = [out[v.name] for v in fusion.outputs]
    return [x if isinstance(v, TensorValue) else x.item() for v, x in zip(fusion.outputs, out)]


_PRISTINE_IMPLS.update(IMPLS)
