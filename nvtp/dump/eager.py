"""An independent evaluation of a fusion in eager PyTorch, float64: the check of ``nvtp replay --check``.

Written from the op table's semantics (``nvtp/ir/ops/``: signatures, result dtypes, nvFuser's
conventions such as innermost-first ``pad_widths``), one small torch evaluation per op kind, and
sharing no code with the reference backend (``nvtp/execute/reference.py``), so a wrong op there
(``exp`` for ``log``, a transposed weight, a missing scale) shows as an O(1) error rather than being
computed the same wrong way twice. Every floating-point value is float64 (complex: complex128),
except that comparisons and predicates read their operands at the declared precision, so a
widened evaluation takes the same branches (dropout masks) as the run it checks.

Random numbers cannot be recomputed independently: they are what the replay's seed draws. They
follow the stream the reference backend documents (one generator per random op, in program order,
seeded from ``sha256(repr((seed, count) + keys))``; attention dropout keep-masks drawn whole from the
op's (seed, offset)), restated here; a reference that drew differently would fail the check.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from nvtp.ir import ops as opstable
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Fusion, Op, ScalarValue, TensorValue, is_value


class EagerError(RuntimeError):
    """The eager evaluation cannot run an op (names it and what to add)."""


def wide(dt: DType) -> torch.dtype:
    """The dtype a value of ``dt`` is held in here: float64 / complex128 for floats, else its own."""
    if dt.is_complex:
        return torch.complex128
    if dt.is_float:
        return torch.float64
    return dt.torch


class _State:
    def __init__(self, seed: int):
        self.seed, self.count = seed, 0

    def generator(self, *keys: Any) -> torch.Generator:
        self.count += 1
        digest = hashlib.sha256(repr((self.seed, self.count) + tuple(keys)).encode()).digest()
        g = torch.Generator()
        g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        return g


Eval = Callable[[_State, Op, dict[str, Any]], Any]
EVALS: dict[str, Eval] = {}


def _num(x: Any) -> Any:
    return x.item() if isinstance(x, torch.Tensor) and x.dim() == 0 else x


def _t(x: Any, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)


def _declared(x: Any, v: Any) -> Any:
    """``x`` (the value of IR argument ``v``) at ``v``'s declared precision."""
    return x.to(v.dtype.torch) if isinstance(x, torch.Tensor) and is_value(v) else x


# -- elementwise ------------------------------------------------------------------------------

_UNARY = {
    **{n: getattr(torch, n) for n in ("abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cos", "cosh", "erf",
                                      "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "frac", "lgamma", "log", "log10",
                                      "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign", "sin", "sinh",
                                      "sqrt", "tan", "tanh", "trunc", "relu", "bitwise_not")},
    "silu": F.silu, "erfcinv": lambda x: torch.erfinv(1 - x), "set": lambda x: x, "segment_set": lambda x: x,
}
_PREDICATE = {n: getattr(torch, n) for n in ("isfinite", "isinf", "isnan", "isneginf", "isposinf", "isreal", "signbit", "logical_not")}


def _int_div(a, b):
    return torch.div(a, b, rounding_mode="trunc") if not (a.is_floating_point() or a.is_complex()) else a / b


_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": _int_div, "truediv": torch.true_divide, "pow": torch.pow,
    "fmod": torch.fmod, "remainder": torch.remainder, "mod": lambda a, b: a - b * torch.div(a, b, rounding_mode="trunc"),  # C's %
    "maximum": torch.maximum, "minimum": torch.minimum,
    "nextafter": torch.nextafter, "atan2": torch.atan2, "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
    "bitwise_xor": torch.bitwise_xor, "bitwise_left_shift": torch.bitwise_left_shift,
    "bitwise_right_shift": torch.bitwise_right_shift, "gcd": torch.gcd,
}
_COMPARE = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
            "logical_and": torch.logical_and, "logical_or": torch.logical_or}


def _unary(fn):
    return lambda st, op, a: fn(_t(a["arg"], wide(op.outputs[0].dtype)))


def _predicate(fn):
    def run(st, op, a):
        x = _declared(a["arg"], op.arg("arg"))
        return fn(x if isinstance(x, torch.Tensor) else torch.tensor(x))

    return run


def _binary(fn):
    def run(st, op, a):
        out = wide(op.outputs[0].dtype)
        return fn(_t(a["lhs"], out), _t(a["rhs"], out))

    return run


def _compare(fn):
    def run(st, op, a):
        lhs, rhs = _declared(a["lhs"], op.arg("lhs")), _declared(a["rhs"], op.arg("rhs"))
        # A number, or a 0-d tensor, does not set the precision against a tensor (torch's rule).
        return fn(lhs if isinstance(lhs, torch.Tensor) else torch.tensor(lhs), rhs)

    return run


EVALS.update({n: _unary(f) for n, f in _UNARY.items()})
EVALS.update({n: _predicate(f) for n, f in _PREDICATE.items()})
EVALS.update({n: _binary(f) for n, f in _BINARY.items()})
EVALS.update({n: _compare(f) for n, f in _COMPARE.items()})


def _ternary(names: Sequence[str], fn):
    def run(st, op, a):
        out = wide(op.outputs[0].dtype)
        return fn(*(_t(a[n], out) for n in names))

    return run


EVALS["where"] = lambda st, op, a: torch.where(_t(a["condition"], torch.bool), _t(a["x"], wide(op.outputs[0].dtype)),
                                               _t(a["y"], wide(op.outputs[0].dtype)))
EVALS["lerp"] = _ternary(("start", "end", "weight"), lambda s, e, w: s + w * (e - s))
EVALS["clamp"] = _ternary(("arg", "min", "max"), lambda x, lo, hi: torch.minimum(torch.maximum(x, lo), hi))
EVALS["threshold"] = _ternary(("arg", "threshold", "value"), lambda x, th, v: torch.where(x > th, x, v))
EVALS["addcmul"] = _ternary(("arg", "tensor1", "tensor2", "value"), lambda x, t1, t2, v: x + v * t1 * t2)
EVALS["cast"] = lambda st, op, a: _t(a["arg"], wide(op.outputs[0].dtype))


# -- reductions -------------------------------------------------------------------------------

def _reduction(kind: str):
    def run(st, op, a):
        x = _t(a["arg"], wide(op.outputs[0].dtype))
        dims = tuple(range(x.dim())) if a["dims"] is None else tuple(a["dims"])
        if kind == "sum":
            return torch.sum(x, dims, keepdim=a["keepdim"])
        if kind == "prod":
            for d in sorted((d % x.dim() for d in dims), reverse=True):
                x = torch.prod(x, d, keepdim=True)
            return x if a["keepdim"] else x.squeeze(dims) if dims else x
        return (torch.amax if kind == "max" else torch.amin)(x, dims, keepdim=a["keepdim"])

    return run


EVALS.update({n: _reduction(n) for n in ("sum", "prod", "max", "min")})
EVALS["var"] = lambda st, op, a: torch.var(a["arg"], tuple(a["dims"]), correction=a["correction"], keepdim=a["keepdim"])
EVALS["var_mean"] = lambda st, op, a: torch.var_mean(a["arg"], tuple(a["dims"]), correction=a["correction"], keepdim=a["keepdim"])


def _welford(st, op, a):  # (mean, sum of squared deviations, count)
    x, dims = a["arg"], tuple(a["dims"])
    mean = x.mean(dims)
    m2 = ((x - x.mean(dims, keepdim=True)) ** 2).sum(dims)
    return mean, m2, torch.full(mean.shape, math.prod(x.shape[d] for d in dims), dtype=torch.int64)


EVALS["welford"] = _welford


# -- shape ops --------------------------------------------------------------------------------

def _broadcast_in_dim(st, op, a):
    x, shape, bdims = a["arg"], tuple(a["shape"]), tuple(a["broadcast_dims"])
    view = [1] * len(shape)
    for i, d in enumerate(bdims):
        view[d] = x.shape[i]
    return x.reshape(view).expand(shape)


def _broadcast(st, op, a):
    x = a["arg"]
    for i, flag in enumerate(a["is_broadcast_dim"]):
        if flag:
            x = x.unsqueeze(i)
    return x


def _slice(st, op, a):
    x = a["arg"]
    for axis, (s, e, step) in enumerate(opstable.slice_bounds(op.arg("arg"), a["start_indices"], a["end_indices"], a["strides"])):
        x = x.narrow(axis, s, e - s)[(slice(None),) * axis + (slice(None, None, step),)]
    return x


def _pad(st, op, a):
    x = a["arg"]
    value = 0 if a["value"] is None else _num(a["value"])
    return F.pad(x, tuple(a["pad_widths"]), value=value) if x.dtype != torch.bool else F.pad(x.to(torch.uint8), tuple(a["pad_widths"]), value=int(value)).bool()


def _squeeze(st, op, a):
    x = a["arg"]
    for d in sorted((d % x.dim() for d in a["dims"]), reverse=True):
        x = x.squeeze(d)
    return x


EVALS.update({
    "broadcast_in_dim": _broadcast_in_dim,
    "broadcast": _broadcast,
    "expand": lambda st, op, a: a["arg"].expand(tuple(a["shape"])),
    "reshape": lambda st, op, a: a["arg"].reshape(op.outputs[0].shape),
    "permute": lambda st, op, a: a["arg"].permute(tuple(a["dims"])),
    "slice": _slice,
    "squeeze": _squeeze,
    "pad": _pad,
    "cat": lambda st, op, a: torch.cat([_t(t, wide(op.outputs[0].dtype)) for t in a["tensors"]], a["dim"]),
    "stride_order": lambda st, op, a: a["arg"],  # a memory layout; the values are the operand's
})


# -- matmuls and attention --------------------------------------------------------------------

def _linear(st, op, a):
    y = torch.matmul(a["arg1"], a["arg2"].transpose(-1, -2) if a["arg2"].dim() == 2 else a["arg2"])
    return y if a["bias"] is None else y + a["bias"]


EVALS["linear"] = _linear
EVALS["matmul"] = lambda st, op, a: torch.matmul(a["arg1"], a["arg2"])


def _keep_mask(seed: torch.Tensor, offset: torch.Tensor, shape: Sequence[int], p: float) -> torch.Tensor | None:
    """Attention dropout: the keep-mask the replay draws from an sdpfa_fwd's (seed, offset)."""
    if not p:
        return None
    g = torch.Generator()
    g.manual_seed(int(seed.reshape(-1)[0].item()) ^ (int(offset.item()) * 0x9E3779B97F4A7C15 & ((1 << 63) - 1)))
    return torch.rand(tuple(shape), generator=g) >= p


def _attend(q, k, v, p: float, causal: bool, scale: float | None, keep):
    """softmax(q kᵀ · scale, causal) with dropout, @ v; and the row-wise logsumexp of the scores."""
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        n_q, n_k = scores.shape[-2:]
        allowed = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
        scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, -1)
    weights = torch.exp(scores - lse[..., None])
    if keep is not None:
        weights = weights * keep / (1 - p)
    return weights @ v, lse


def _sdpfa_fwd(st, op, a):
    if a["bias"] is not None or a["mask"] is not None:
        raise EagerError("sdpfa_fwd with bias or mask has no eager evaluation in nvtp/dump/eager.py")
    q, k, v = a["query"], a["key"], a["value"]
    p = float(_num(a["dropout_p"]) or 0.0)
    g = st.generator("sdpfa")
    seed = torch.randint(0, 2**62, (2,), generator=g).to(torch.uint64)
    offset = torch.tensor(st.count, dtype=torch.uint64)
    keep = _keep_mask(seed, offset, (*q.shape[:3], k.shape[-2]), p)
    out, lse = _attend(q, k, v, p, bool(_num(a["is_causal"])), _num(a["scale"]), keep)
    return out, lse, seed, offset


def _sdpfa_bwd(st, op, a):
    """The op as nvFuser defines it (flash / cuDNN): gradients FROM the given logsumexp and output
    (attention weights exp(s − lse), D = rowsum(dO ∘ out)), not from a re-run forward."""
    q, k, v, go, out, lse = (a[n] for n in ("query", "key", "value", "grad_output", "output", "logsumexp"))
    p = float(_num(a["dropout_p"]) or 0.0)
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = _num(a["scale"])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    weights = torch.exp(torch.einsum("bhqd,bhkd->bhqk", q, k) * scale - lse[..., None])
    if bool(_num(a["is_causal"])):
        allowed = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
        weights = torch.where(allowed, weights, torch.zeros((), dtype=weights.dtype))
    keep = _keep_mask(a["philox_seed"], a["philox_offset"], (*q.shape[:3], n_k), p)
    mask = torch.ones((), dtype=weights.dtype) if keep is None else keep.to(weights.dtype) / (1 - p)
    grad_v = torch.einsum("bhqk,bhqd->bhkd", weights * mask, go)
    grad_weights = torch.einsum("bhqd,bhkd->bhqk", go, v) * mask
    grad_scores = weights * (grad_weights - torch.einsum("bhqd,bhqd->bhq", go, out)[..., None])
    return (scale * torch.einsum("bhqk,bhkd->bhqd", grad_scores, k),
            scale * torch.einsum("bhqk,bhqd->bhkd", grad_scores, q), grad_v)


EVALS["sdpfa_fwd"] = _sdpfa_fwd
EVALS["sdpfa_bwd"] = _sdpfa_bwd


# -- factories and indexing -------------------------------------------------------------------

def _iota(st, op, a):
    start = _num(a["start"]) if a["start"] is not None else 0
    step = _num(a["step"]) if a["step"] is not None else 1
    return (start + torch.arange(a["length"], dtype=torch.float64) * step).to(wide(op.outputs[0].dtype))


def _random(kind: str):
    def run(st, op, a):
        keys = (kind,) if a["rng_seed"] is None else (kind, int(_num(a["rng_seed"])), int(_num(a["rng_offset"])))
        g = st.generator(*keys)
        declared, shape = a["dtype"].torch, op.outputs[0].shape
        if kind == "uniform":
            lo, hi = _num(a["minval"]), _num(a["maxval"])
            x = torch.rand(shape, generator=g, dtype=declared)
            x = x if (lo, hi) == (0, 1) else x * (hi - lo) + lo
        else:
            x = torch.randn(shape, generator=g, dtype=declared) * _num(a["std"]) + _num(a["mean"])
        return x.to(declared)

    return run


def _embedding(st, op, a):
    # Rows of padding_idx are looked up like any other: padding_idx only masks the gradient
    # (torch's F.embedding, and nvFuser on an H100).
    return a["weight"][a["input"]]


def _scatter(st, op, a):
    x, src = a["arg"], a["src"]
    if isinstance(src, torch.Tensor) and src.dim() > 0:
        return x.scatter(a["dim"], a["index"], src.to(x.dtype))
    return x.scatter(a["dim"], a["index"], _num(src))


EVALS.update({
    "iota": _iota,
    "full": lambda st, op, a: torch.full(op.outputs[0].shape, _num(a["fill_value"]), dtype=wide(op.outputs[0].dtype)),
    "uniform": _random("uniform"),
    "normal": _random("normal"),
    "embedding_fwd": _embedding,
    "take_along_axis": lambda st, op, a: torch.take_along_dim(a["arg"], a["index"], a["dim"]),
    "gather": lambda st, op, a: torch.gather(a["arg"], a["dim"], a["index"]),
    "index_select": lambda st, op, a: torch.index_select(a["arg"], a["dim"], a["index"]),
    "scatter": _scatter,
})


# Mixture of experts, written differently from the reference backend's grouping by expert: each
# row's weight gathered ([S, K, N]) for the forward, an index_add of outer products for wgrad.
EVALS.update({
    "topk": lambda st, op, a: torch.topk(a["arg"], int(a["k"]), dim=a["dim"], largest=a["largest"], sorted=a["sorted"]),
    "gather_mm": lambda st, op, a: torch.einsum("sk,skn->sn", a["arg1"], a["arg2"][a["index"]]),
    "gather_mm_wgrad": lambda st, op, a: torch.zeros(a["groups"], a["arg1"].shape[1], a["arg2"].shape[1], dtype=a["arg1"].dtype)
    .index_add_(0, a["index"], a["arg1"][:, :, None] * a["arg2"][:, None, :]),
})


# -- the evaluation ---------------------------------------------------------------------------

def _resolve(x: Any, env: dict[str, Any]) -> Any:
    if is_value(x):
        return env[x.name]
    if isinstance(x, tuple):
        return tuple(_resolve(e, env) for e in x)
    return x


def evaluate(fusion: Fusion, inputs: Sequence[Any], *, seed: int = 0) -> list[Any]:
    """``fusion``'s outputs on ``inputs``, evaluated op by op in eager PyTorch (float64)."""
    st = _State(seed)
    env: dict[str, Any] = {}
    for v, x in zip(fusion.inputs, inputs):
        env[v.name] = _t(x, wide(v.dtype))
    for op in fusion.ops:
        if op.kind == "define_tensor" or (op.kind == "define_scalar" and op.arg("value") is None):
            continue
        if op.kind == "define_scalar":
            env[op.outputs[0].name] = _t(op.arg("value"), wide(op.outputs[0].dtype))
            continue
        fn = EVALS.get(op.kind)
        if fn is None:
            raise EagerError(f"`{op}`: fd.ops.{op.kind} has no eager evaluation; add one to EVALS in nvtp/dump/eager.py")
        args = {name: _resolve(value, env) for name, value in op.args}
        result = fn(st, op, args)
        results = result if isinstance(result, (tuple, list)) else (result,)
        for v, r in zip(op.outputs, results):
            r = _t(r, wide(v.dtype))
            if isinstance(v, TensorValue) and tuple(r.shape) != tuple(v.shape):
                raise EagerError(f"`{op}`: the eager evaluation of {v.name} has shape {list(r.shape)}, the op table says {list(v.shape)}")
            env[v.name] = r
    return [env[v.name] if not isinstance(v, ScalarValue) else env[v.name].item() for v in fusion.outputs]
