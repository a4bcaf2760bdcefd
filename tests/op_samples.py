"""Small fusions, one or more per op of ``nvtp.ir.ops.OPS``, with example inputs.

The table ``SAMPLES`` drives the op tests (reference backend, printer/parser round trip, nvFuser
emission) and, later, the sharding-rule tests. Each ``Sample`` is data: a name, a function
that builds the fusion, a function that draws example inputs (CPU tensors, index tensors in
range), and optionally the expected outputs computed independently in plain torch (float64
where it matters), or a property check for random outputs.

Shapes are small and, where natural, divisible by 4 (``[2, 8, 16]``), so shardings over 2 or 4
devices have something to split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from nvtp.ir import DType, Fusion, FusionBuilder
from nvtp.ir import ops as opstable

F32, F64, F16, BF16 = DType.Float, DType.Double, DType.Half, DType.BFloat16
I64, I32, BOOL, U64 = DType.Int, DType.Int32, DType.Bool, DType.UInt64


@dataclass(frozen=True)
class Sample:
    """One small fusion and how to feed and check it.

    expected: inputs -> the outputs in plain torch (any dtype; compared after casting).
    check: (inputs, outputs) -> raises if a property of random outputs does not hold.
    tol: rtol = atol for floating-point comparisons.
    nvfuser_error: nvFuser cannot build this fusion; build_definition must fail saying this.
    """

    name: str
    build: Callable[[], Fusion]
    inputs: Callable[[torch.Generator], list]
    expected: Callable[..., list] | None = None
    check: Callable[[list, list], None] | None = None
    tol: float = 1e-5
    nvfuser_error: str | None = None

    def __str__(self) -> str:
        return self.name

    @property
    def kinds(self) -> set[str]:
        return {op.kind for op in self.build().ops}


SAMPLES: list[Sample] = []


def sample(name: str, inputs: Callable[[torch.Generator], list], expected=None, *, check=None, tol=1e-5, nvfuser_error=None):
    """Register the decorated ``fn(builder)`` as a sample's fusion."""

    def deco(fn: Callable[[FusionBuilder], None]):
        def build() -> Fusion:
            b = FusionBuilder(f"sample_{name}")
            fn(b)
            return b.build()

        if any(s.name == name for s in SAMPLES):
            raise ValueError(f"sample {name} defined twice")
        SAMPLES.append(Sample(name, build, inputs, expected, check, tol, nvfuser_error))
        return fn

    return deco


# ---------------------------------------------------------------------------------------------
# input helpers


def randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype)


def rand(g: torch.Generator, lo: float, hi: float, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)


def randint(g: torch.Generator, lo: int, hi: int, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def special(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Normal numbers with inf, -inf, nan and -0.0 mixed in."""
    x = randn(g, *shape).reshape(-1)
    x[::7] = math.inf
    x[3::11] = -math.inf
    x[5::13] = math.nan
    x[2::17] = -0.0
    return x.reshape(shape)


def d(x: Any) -> Any:
    """float64 of a floating-point tensor (numbers and other tensors unchanged)."""
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


# ---------------------------------------------------------------------------------------------
# elementwise: one sample per unary and binary op

SHAPE = (2, 8, 16)

# Inputs in each op's domain (default: standard normal float32).
_UNARY_INPUT: dict[str, Callable[[torch.Generator], torch.Tensor]] = {
    **{k: (lambda g: rand(g, -0.9, 0.9, *SHAPE)) for k in ("acos", "asin", "atanh", "erfinv")},
    "acosh": lambda g: rand(g, 1.1, 4.0, *SHAPE),
    "erfcinv": lambda g: rand(g, 0.1, 1.9, *SHAPE),
    **{k: (lambda g: rand(g, 0.1, 4.0, *SHAPE)) for k in ("log", "log10", "log2", "rsqrt", "sqrt", "reciprocal", "lgamma")},
    "log1p": lambda g: rand(g, -0.9, 4.0, *SHAPE),
    "tan": lambda g: rand(g, -1.2, 1.2, *SHAPE),
    "round": lambda g: randn(g, *SHAPE) * 4,
    **{k: (lambda g: special(g, *SHAPE)) for k in ("isfinite", "isinf", "isnan", "isneginf", "isposinf", "isreal", "signbit")},
    "bitwise_not": lambda g: randint(g, -100, 100, *SHAPE),
    "logical_not": lambda g: randint(g, 0, 2, *SHAPE).bool(),
}
_UNARY_DTYPE = {"bitwise_not": I64, "logical_not": BOOL}

# Independent torch expressions, float64, for a representative subset.
_UNARY_EXPECTED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "abs": lambda x: x.abs(), "neg": lambda x: -x, "exp": lambda x: x.exp(), "log": lambda x: x.log(),
    "sqrt": lambda x: x.sqrt(), "rsqrt": lambda x: 1 / x.sqrt(), "reciprocal": lambda x: 1 / x,
    "tanh": lambda x: x.tanh(), "sigmoid": lambda x: 1 / (1 + (-x).exp()), "silu": lambda x: x / (1 + (-x).exp()),
    "relu": lambda x: x.clamp(min=0), "erf": lambda x: x.erf(), "erfcinv": lambda x: torch.special.erfinv(1 - x),
    "exp2": lambda x: 2**x, "log2": lambda x: x.log() / math.log(2), "log10": lambda x: x.log() / math.log(10),
    "sin": lambda x: x.sin(), "cos": lambda x: x.cos(), "floor": lambda x: x.floor(), "ceil": lambda x: x.ceil(),
    "round": lambda x: x.round(), "trunc": lambda x: x.trunc(), "frac": lambda x: x - x.trunc(),
    "sign": lambda x: x.sign(), "lgamma": lambda x: torch.lgamma(x), "set": lambda x: x, "segment_set": lambda x: x,
    "isnan": lambda x: x != x, "isinf": lambda x: x.abs() == math.inf, "isposinf": lambda x: x == math.inf,
    "isneginf": lambda x: x == -math.inf, "isfinite": lambda x: (x == x) & (x.abs() != math.inf),
    "signbit": lambda x: torch.signbit(x), "isreal": lambda x: torch.ones_like(x, dtype=torch.bool),
    "bitwise_not": lambda x: -x - 1, "logical_not": lambda x: ~x,
}


def _unary_sample(name: str) -> None:
    make = _UNARY_INPUT.get(name, lambda g: randn(g, *SHAPE))
    dtype = _UNARY_DTYPE.get(name, F32)
    fn = _UNARY_EXPECTED.get(name)
    expected = (lambda x: [fn(d(x))]) if fn else None

    @sample(name, lambda g: [make(g)], expected, tol=1e-4)
    def _(b: FusionBuilder) -> None:
        x = b.define_tensor(SHAPE, dtype)
        b.add_output(b.op(name, x))


for _name in sorted(opstable.UNARY):
    _unary_sample(_name)

_INT_BINARY = {"bitwise_and", "bitwise_or", "bitwise_xor", "gcd", "bitwise_left_shift", "bitwise_right_shift"}
_BINARY_INPUTS: dict[str, Callable[[torch.Generator], list]] = {
    "pow": lambda g: [rand(g, 0.5, 2.0, *SHAPE), randn(g, *SHAPE)],
    **{k: (lambda g: [randn(g, *SHAPE) * 4, rand(g, 0.5, 2.0, *SHAPE)]) for k in ("fmod", "remainder", "div", "truediv")},
    # nvFuser's mod is C's % on integers (a float mod fails compiling its kernel); signs mixed on
    # both sides, where C's truncation and Python's floor differ.
    "mod": lambda g: [randint(g, -50, 50, *SHAPE), randint(g, 1, 8, *SHAPE) * (randint(g, 0, 2, *SHAPE) * 2 - 1)],
    **{k: (lambda g: [randint(g, -64, 64, *SHAPE), randint(g, -64, 64, *SHAPE)]) for k in ("bitwise_and", "bitwise_or", "bitwise_xor", "gcd")},
    **{k: (lambda g: [randint(g, 0, 1024, *SHAPE), randint(g, 0, 8, *SHAPE)]) for k in ("bitwise_left_shift", "bitwise_right_shift")},
    **{k: (lambda g: [randint(g, 0, 2, *SHAPE).bool(), randint(g, 0, 2, *SHAPE).bool()]) for k in ("logical_and", "logical_or")},
    # Half the entries equal, so eq/le/ge see ties.
    **{k: (lambda g: _with_ties(randn(g, *SHAPE), randn(g, *SHAPE))) for k in ("eq", "ne", "lt", "le", "gt", "ge")},
}
_BINARY_DTYPE = {**{k: I64 for k in _INT_BINARY | {"mod"}}, "logical_and": BOOL, "logical_or": BOOL}
_BINARY_EXPECTED: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y, "div": lambda x, y: x / y,
    "truediv": lambda x, y: x / y, "pow": lambda x, y: x**y, "maximum": lambda x, y: torch.where(x > y, x, y),
    "minimum": lambda x, y: torch.where(x < y, x, y), "fmod": lambda x, y: x - y * (x / y).trunc(),
    "remainder": lambda x, y: x - y * (x / y).floor(), "mod": lambda x, y: x - y * torch.div(x, y, rounding_mode="trunc"),
    "atan2": lambda x, y: torch.atan2(x, y),
    "bitwise_and": lambda x, y: x & y, "bitwise_or": lambda x, y: x | y, "bitwise_xor": lambda x, y: x ^ y,
    "bitwise_left_shift": lambda x, y: x * 2**y, "bitwise_right_shift": lambda x, y: x // 2**y,
    "gcd": lambda x, y: torch.tensor([math.gcd(a, b) for a, b in zip(x.reshape(-1).tolist(), y.reshape(-1).tolist())]).reshape(x.shape),
    "eq": lambda x, y: x == y, "ne": lambda x, y: x != y, "lt": lambda x, y: x < y, "le": lambda x, y: x <= y,
    "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y, "logical_and": lambda x, y: x & y, "logical_or": lambda x, y: x | y,
}


def _with_ties(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    y = torch.where(torch.arange(x.numel()).reshape(x.shape) % 2 == 0, x, y)
    return [x, y]


def _binary_sample(name: str) -> None:
    make = _BINARY_INPUTS.get(name, lambda g: [randn(g, *SHAPE), randn(g, *SHAPE)])
    dtype = _BINARY_DTYPE.get(name, F32)
    fn = _BINARY_EXPECTED.get(name)
    expected = (lambda x, y: [fn(d(x), d(y))]) if fn else None

    @sample(name, make, expected, tol=1e-4)
    def _(b: FusionBuilder) -> None:
        x, y = b.define_tensor(SHAPE, dtype), b.define_tensor(SHAPE, dtype)
        b.add_output(b.op(name, x, y))


for _name in sorted(opstable.BINARY):
    _binary_sample(_name)


# ---------------------------------------------------------------------------------------------
# elementwise: broadcasting, numbers, scalars and promotion


@sample("add_number", lambda g: [randn(g, 2, 8)], lambda x: [d(x) + 2.5])
def _(b):
    b.add_output(b.op("add", b.define_tensor([2, 8], F32), 2.5))


@sample("mul_broadcast_rank", lambda g: [randn(g, 2, 8, 16), randn(g, 16)], lambda x, y: [d(x) * d(y)])
def _(b):
    x, y = b.define_tensor([2, 8, 16], F32), b.define_tensor([16], F32)
    b.add_output(b.op("mul", x, y))


@sample("scalar_input_ops", lambda g: [randn(g, 2, 8), 1.5], lambda x, s: [d(x) * (s * 2.0 + 0.25)])
def _(b):
    """Scalar-only ops (``fd.ops.mul(S1, 2.0)``) feeding a tensor op; nvFuser has no scalar outputs."""
    x = b.define_tensor([2, 8], F32)
    s = b.define_scalar(None, F64)
    c = b.define_scalar(0.25, F64)
    s2 = b.op("add", b.op("mul", s, 2.0), c)
    b.add_output(b.op("mul", x, s2))


@sample("div_int", lambda g: [randint(g, -50, 50, 2, 8), randint(g, 1, 7, 2, 8)], lambda x, y: [torch.div(x, y, rounding_mode="trunc")])
def _(b):
    """Integer division truncates toward zero, as C and nvFuser do."""
    x, y = b.define_tensor([2, 8], I64), b.define_tensor([2, 8], I64)
    b.add_output(b.op("div", x, y))


@sample("add_half_float", lambda g: [randn(g, 2, 8, dtype=torch.float16), randn(g, 2, 8)], lambda x, y: [d(x) + d(y)])
def _(b):
    """Half + Float promotes to Float."""
    b.add_output(b.op("add", b.define_tensor([2, 8], F16), b.define_tensor([2, 8], F32)))


@sample("exp_int", lambda g: [randint(g, -3, 4, 2, 8)], lambda x: [d(x.double()).exp()], tol=1e-4)
def _(b):
    """A floating-point op on integers gives Float."""
    b.add_output(b.op("exp", b.define_tensor([2, 8], I64)))


@sample("mul_bf16_number", lambda g: [randn(g, 2, 8, dtype=torch.bfloat16)], lambda x: [d(x) * 3.0], tol=1e-2)
def _(b):
    """A Python number does not widen a BFloat16 tensor."""
    b.add_output(b.op("mul", b.define_tensor([2, 8], BF16), 3.0))


@sample("where", lambda g: [randint(g, 0, 2, 2, 8).bool(), randn(g, 2, 8), randn(g, 2, 8)], lambda c, x, y: [torch.where(c, x, y)])
def _(b):
    c, x, y = b.define_tensor([2, 8], BOOL), b.define_tensor([2, 8], F32), b.define_tensor([2, 8], F32)
    b.add_output(b.op("where", c, x, y))


@sample("where_number", lambda g: [randn(g, 2, 8)], lambda x: [torch.where(x > 0, x, torch.zeros_like(x))])
def _(b):
    x = b.define_tensor([2, 8], F32)
    b.add_output(b.op("where", b.op("gt", x, 0.0), x, 0.0))


@sample("lerp", lambda g: [randn(g, 2, 8), randn(g, 2, 8)], lambda x, y: [d(x) + 0.25 * (d(y) - d(x))])
def _(b):
    b.add_output(b.op("lerp", b.define_tensor([2, 8], F32), b.define_tensor([2, 8], F32), 0.25))


@sample("lerp_tensor_weight", lambda g: [randn(g, 2, 8), randn(g, 2, 8), rand(g, 0, 1, 2, 8)], lambda x, y, w: [d(x) + d(w) * (d(y) - d(x))])
def _(b):
    b.add_output(b.op("lerp", b.define_tensor([2, 8], F32), b.define_tensor([2, 8], F32), b.define_tensor([2, 8], F32)))


@sample("clamp", lambda g: [randn(g, 2, 8)], lambda x: [d(x).clamp(-0.5, 0.5)])
def _(b):
    b.add_output(b.op("clamp", b.define_tensor([2, 8], F32), -0.5, 0.5))


@sample("threshold", lambda g: [randn(g, 2, 8)], lambda x: [torch.where(d(x) > 0.1, d(x), 20.0)])
def _(b):
    b.add_output(b.op("threshold", b.define_tensor([2, 8], F32), 0.1, 20.0))


@sample("addcmul", lambda g: [randn(g, 2, 8), randn(g, 2, 8), randn(g, 2, 8)], lambda x, y, z: [d(x) + 0.5 * d(y) * d(z)])
def _(b):
    x, y, z = (b.define_tensor([2, 8], F32) for _ in range(3))
    b.add_output(b.op("addcmul", x, y, z, 0.5))


@sample("cast_bf16", lambda g: [randn(g, 2, 8)], lambda x: [x.to(torch.bfloat16)], tol=0)
def _(b):
    b.add_output(b.op("cast", b.define_tensor([2, 8], F32), dtype=BF16))


@sample("cast_bool_float", lambda g: [randint(g, 0, 2, 2, 8).bool()], lambda x: [x.double()], tol=0)
def _(b):
    b.add_output(b.op("cast", b.define_tensor([2, 8], BOOL), dtype=F32))


# ---------------------------------------------------------------------------------------------
# reductions


@sample("sum", lambda g: [randn(g, 2, 8, 16)], lambda x: [d(x).sum(1)])
def _(b):
    b.add_output(b.op("sum", b.define_tensor([2, 8, 16], F32), dims=[1]))


@sample("sum_keepdim", lambda g: [randn(g, 2, 8, 16)], lambda x: [d(x).sum((0, 2), keepdim=True)])
def _(b):
    b.add_output(b.op("sum", b.define_tensor([2, 8, 16], F32), dims=[0, 2], keepdim=True))


@sample("sum_all", lambda g: [randn(g, 2, 8, 16)], lambda x: [d(x).sum()])
def _(b):
    """No dims: every axis, down to a 0-d tensor."""
    b.add_output(b.op("sum", b.define_tensor([2, 8, 16], F32)))


@sample("sum_dtype", lambda g: [randn(g, 2, 8, 16, dtype=torch.bfloat16)], lambda x: [d(x).sum(-1)], tol=1e-6)
def _(b):
    b.add_output(b.op("sum", b.define_tensor([2, 8, 16], BF16), dims=[-1], dtype=F64))


@sample("sum_int", lambda g: [randint(g, -9, 9, 2, 8, dtype=torch.int32)], lambda x: [x.long().sum(1)])
def _(b):
    """Integer sums widen to Int (int64), as torch's do."""
    b.add_output(b.op("sum", b.define_tensor([2, 8], I32), dims=[1]))


@sample("max", lambda g: [randn(g, 2, 8, 16)], lambda x: [x.amax(2)])
def _(b):
    b.add_output(b.op("max", b.define_tensor([2, 8, 16], F32), dims=[2]))


@sample("min_keepdim", lambda g: [randn(g, 2, 8, 16)], lambda x: [x.amin((0, 1), keepdim=True)])
def _(b):
    b.add_output(b.op("min", b.define_tensor([2, 8, 16], F32), dims=[0, 1], keepdim=True))


@sample("prod", lambda g: [rand(g, 0.5, 1.5, 2, 8, 4)], lambda x: [d(x).prod(-1)])
def _(b):
    b.add_output(b.op("prod", b.define_tensor([2, 8, 4], F32), dims=[-1]))


@sample("var", lambda g: [randn(g, 2, 8, 16)], lambda x: [_var(d(x), (2,), 1, False)])
def _(b):
    b.add_output(b.op("var", b.define_tensor([2, 8, 16], F32), dims=[2]))


@sample("var_keepdim", lambda g: [randn(g, 2, 8, 16)], lambda x: [_var(d(x), (1, 2), 0, True)])
def _(b):
    b.add_output(b.op("var", b.define_tensor([2, 8, 16], F32), dims=[1, 2], correction=0, keepdim=True))


@sample("var_mean", lambda g: [randn(g, 2, 8, 16)], lambda x: [_var(d(x), (2,), 0, False), d(x).mean(2)])
def _(b):
    v, m = b.op("var_mean", b.define_tensor([2, 8, 16], F32), dims=[2], correction=0)
    b.add_output(v)
    b.add_output(m)


@sample("welford", lambda g: [randn(g, 2, 8, 16)], lambda x: [d(x).mean(1), _var(d(x), (1,), 0, False) * 8, torch.full((2, 16), 8)])
def _(b):
    """welford gives (mean, sum of squared deviations, count)."""
    for v in b.op("welford", b.define_tensor([2, 8, 16], F32), dims=[1]):
        b.add_output(v)


def _var(x: torch.Tensor, dims: tuple[int, ...], correction: int, keepdim: bool) -> torch.Tensor:
    n = math.prod(x.shape[i] for i in dims)
    dev = x - x.mean(dims, keepdim=True)
    return (dev * dev).sum(dims, keepdim=keepdim) / (n - correction)


# ---------------------------------------------------------------------------------------------
# shape ops


@sample("broadcast_in_dim", lambda g: [randn(g, 8)], lambda x: [x.reshape(1, 8, 1).expand(2, 8, 16)], tol=0)
def _(b):
    b.add_output(b.op("broadcast_in_dim", b.define_tensor([8], F32), shape=[2, 8, 16], broadcast_dims=[1]))


@sample("broadcast_in_dim_size1", lambda g: [randn(g, 2, 1)], lambda x: [x.reshape(2, 1, 1).expand(2, 8, 16)], tol=0)
def _(b):
    """A size-1 operand axis stretches to the result's size."""
    b.add_output(b.op("broadcast_in_dim", b.define_tensor([2, 1], F32), shape=[2, 8, 16], broadcast_dims=[0, 2]))


@sample("broadcast", lambda g: [randn(g, 2, 16)], lambda x: [x.unsqueeze(1)], tol=0)
def _(b):
    b.add_output(b.op("broadcast", b.define_tensor([2, 16], F32), is_broadcast_dim=[False, True, False]))


@sample("expand", lambda g: [randn(g, 2, 16)], lambda x: [x.unsqueeze(1).expand(2, 8, 16)], tol=0)
def _(b):
    x = b.op("broadcast", b.define_tensor([2, 16], F32), is_broadcast_dim=[False, True, False])
    b.add_output(b.op("expand", x, shape=[2, 8, 16]))


@sample("reshape", lambda g: [randn(g, 2, 8, 16)], lambda x: [x.reshape(16, 16)], tol=0)
def _(b):
    b.add_output(b.op("reshape", b.define_tensor([2, 8, 16], F32), new_shape=[16, 16]))


@sample("reshape_split", lambda g: [randn(g, 2, 8, 16)], lambda x: [x.reshape(2, 8, 4, 4)], tol=0)
def _(b):
    """Split the last axis into heads, as attention does."""
    b.add_output(b.op("reshape", b.define_tensor([2, 8, 16], F32), new_shape=[2, 8, 4, 4]))


@sample("permute", lambda g: [randn(g, 2, 8, 16)], lambda x: [x.permute(2, 0, 1)], tol=0)
def _(b):
    b.add_output(b.op("permute", b.define_tensor([2, 8, 16], F32), dims=[2, 0, 1]))


@sample("slice", lambda g: [randn(g, 2, 8, 16)], lambda x: [x[:, 2:6, 4:12]], tol=0)
def _(b):
    b.add_output(b.op("slice", b.define_tensor([2, 8, 16], F32), start_indices=[0, 2, 4], end_indices=[2, 6, 12]))


@sample("slice_strided", lambda g: [randn(g, 2, 8, 16)], lambda x: [x[:, 1:8:2, ::4]], tol=0,
        nvfuser_error="nvFuser supports only slices with stride 1")
def _(b):
    b.add_output(b.op("slice", b.define_tensor([2, 8, 16], F32), start_indices=[0, 1, 0], end_indices=[2, 8, 16], strides=[1, 2, 4]))


@sample("squeeze", lambda g: [randn(g, 2, 1, 16)], lambda x: [x[:, 0]], tol=0)
def _(b):
    b.add_output(b.op("squeeze", b.define_tensor([2, 1, 16], F32), dims=[1]))


@sample("pad", lambda g: [randn(g, 2, 8)], lambda x: [F.pad(x, [1, 3], value=0.5)], tol=0)
def _(b):
    """pad_widths run innermost axis first, like torch.nn.functional.pad."""
    b.add_output(b.op("pad", b.define_tensor([2, 8], F32), pad_widths=[1, 3], value=0.5))


@sample("pad_two_axes", lambda g: [randn(g, 2, 8)], lambda x: [F.pad(x, [0, 4, 2, 0])], tol=0)
def _(b):
    b.add_output(b.op("pad", b.define_tensor([2, 8], F32), pad_widths=[0, 4, 2, 0]))


@sample("cat", lambda g: [randn(g, 2, 8, 4), randn(g, 2, 8, 12)], lambda x, y: [torch.cat([x, y], -1)], tol=0)
def _(b):
    b.add_output(b.op("cat", [b.define_tensor([2, 8, 4], F32), b.define_tensor([2, 8, 12], F32)], dim=-1))


@sample("cat_three", lambda g: [randn(g, 2, 16), randn(g, 4, 16), randn(g, 2, 16)], lambda x, y, z: [torch.cat([x, y, z])], tol=0)
def _(b):
    b.add_output(b.op("cat", [b.define_tensor([n, 16], F32) for n in (2, 4, 2)], dim=0))


@sample("stride_order", lambda g: [randn(g, 2, 8, 16)], lambda x: [x], tol=0)
def _(b):
    b.add_output(b.op("stride_order", b.define_tensor([2, 8, 16], F32), stride_order=[0, 1, 2]))


@sample("input_stride_order", lambda g: [randn(g, 16, 8).t()], lambda x: [d(x).exp()], tol=1e-5)
def _(b):
    """A column-major input (nvFuser's stride_order: axis 0 innermost)."""
    b.add_output(b.op("exp", b.define_tensor([8, 16], F32, stride_order=[0, 1])))


# ---------------------------------------------------------------------------------------------
# matmuls


@sample("linear", lambda g: [randn(g, 2, 8, 16), randn(g, 32, 16), randn(g, 32)], lambda x, w, bias: [d(x) @ d(w).T + d(bias)])
def _(b):
    x, w, bias = b.define_tensor([2, 8, 16], F32), b.define_tensor([32, 16], F32), b.define_tensor([32], F32)
    b.add_output(b.op("linear", x, w, bias))


@sample("linear_no_bias", lambda g: [randn(g, 8, 16, dtype=torch.bfloat16), randn(g, 32, 16, dtype=torch.bfloat16)],
        lambda x, w: [d(x) @ d(w).T], tol=2e-2)
def _(b):
    b.add_output(b.op("linear", b.define_tensor([8, 16], BF16), b.define_tensor([32, 16], BF16)))


@sample("matmul", lambda g: [randn(g, 8, 16), randn(g, 16, 4)], lambda x, y: [d(x) @ d(y)])
def _(b):
    b.add_output(b.op("matmul", b.define_tensor([8, 16], F32), b.define_tensor([16, 4], F32)))


@sample("matmul_batched", lambda g: [randn(g, 2, 4, 8, 16), randn(g, 2, 4, 16, 8)], lambda x, y: [d(x) @ d(y)])
def _(b):
    b.add_output(b.op("matmul", b.define_tensor([2, 4, 8, 16], F32), b.define_tensor([2, 4, 16, 8], F32)))


# ---------------------------------------------------------------------------------------------
# attention: [batch, heads, seq, head_dim], BFloat16 as flash attention wants

QKV = (1, 2, 16, 16)


def _qkv(g: torch.Generator) -> list[torch.Tensor]:
    return [randn(g, *QKV, dtype=torch.bfloat16) for _ in range(3)]


def _sdpa(q, k, v, causal: bool = True, scale: float | None = None):
    """Attention in float64: (output, logsumexp)."""
    q, k, v = d(q), d(k), d(v)
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


@sample("sdpfa_fwd", _qkv, lambda q, k, v: list(_sdpa(q, k, v)), tol=2e-2)
def _(b):
    q, k, v = (b.define_tensor(QKV, BF16) for _ in range(3))
    out, lse, _seed, _offset = b.op("sdpfa_fwd", q, k, v, dropout_p=b.define_scalar(0.0, F64), is_causal=b.define_scalar(True, BOOL))
    b.add_output(out)
    b.add_output(lse)


def _sdpa_bwd_inputs(g: torch.Generator) -> list[torch.Tensor]:
    q, k, v = _qkv(g)
    out, lse = _sdpa(q, k, v)  # consistent forward results, as a flash backward needs
    return [randn(g, *QKV, dtype=torch.bfloat16), q, k, v, out.to(torch.bfloat16), lse.float(),
            torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)]


def _sdpa_grads(go, q, k, v, *_):
    q, k, v = (d(t).requires_grad_(True) for t in (q, k, v))
    with torch.enable_grad():
        out, _ = _sdpa(q, k, v)
        return list(torch.autograd.grad(out, (q, k, v), d(go)))


@sample("sdpfa_bwd", _sdpa_bwd_inputs, _sdpa_grads, tol=3e-2)
def _(b):
    go, q, k, v, out = (b.define_tensor(QKV, BF16) for _ in range(5))
    lse = b.define_tensor(QKV[:3], F32)
    seed, offset = b.define_tensor([2], U64), b.define_tensor([], U64)
    grads = b.op("sdpfa_bwd", go, q, k, v, out, lse, dropout_p=b.define_scalar(0.0, F64), is_causal=b.define_scalar(True, BOOL),
                 philox_seed=seed, philox_offset=offset, scale=None)
    for t in grads:
        b.add_output(t)


def _check_dropout_attention(inputs, outputs):
    q, k, v, go = inputs
    out, lse, gq, gk, gv = outputs
    assert torch.isfinite(out.float()).all() and torch.isfinite(gq.float()).all()
    # logsumexp does not see dropout: it matches attention without it.
    torch.testing.assert_close(lse.double(), _sdpa(q, k, v, scale=0.125)[1], rtol=2e-2, atol=2e-2)


@sample("sdpfa_fwd_bwd_dropout", lambda g: _qkv(g) + [randn(g, *QKV, dtype=torch.bfloat16)], check=_check_dropout_attention)
def _(b):
    """Forward and backward in one fusion: the backward reuses the forward's RNG seed and offset."""
    q, k, v, go = (b.define_tensor(QKV, BF16) for _ in range(4))
    p, causal = b.define_scalar(0.25, F64), b.define_scalar(True, BOOL)
    out, lse, seed, offset = b.op("sdpfa_fwd", q, k, v, dropout_p=p, is_causal=causal, scale=0.125)
    gq, gk, gv = b.op("sdpfa_bwd", go, q, k, v, out, lse, dropout_p=p, is_causal=causal, philox_seed=seed, philox_offset=offset, scale=0.125)
    for t in (out, lse, gq, gk, gv):
        b.add_output(t)


# ---------------------------------------------------------------------------------------------
# factories


@sample("iota", lambda g: [], lambda: [torch.arange(8) * 3 + 2], tol=0)
def _(b):
    b.add_output(b.op("iota", 8, 2, 3, dtype=I64))


@sample("iota_plus_input", lambda g: [randn(g, 2, 8)], lambda x: [d(x) + torch.arange(8)])
def _(b):
    """An Int iota broadcast against a Float tensor."""
    x = b.define_tensor([2, 8], F32)
    i = b.op("broadcast_in_dim", b.op("iota", 8, dtype=I64), shape=[2, 8], broadcast_dims=[1])
    b.add_output(b.op("add", x, i))


@sample("full", lambda g: [randn(g, 2, 8)], lambda x: [d(x) * 1.5], tol=1e-6)
def _(b):
    x = b.define_tensor([2, 8], F32)
    b.add_output(b.op("mul", x, b.op("full", [2, 8], 1.5, F32)))


def _check_uniform(inputs, outputs):
    (u,) = outputs
    assert u.shape == (2, 8, 16) and bool(((u >= -1.0) & (u < 3.0)).all()), "uniform(-1, 3) out of range"
    assert abs(u.mean().item() - 1.0) < 0.4, f"uniform(-1, 3) mean {u.mean().item():.2f}, expected about 1"


@sample("uniform", lambda g: [], check=_check_uniform)
def _(b):
    b.add_output(b.op("uniform", -1.0, 3.0, shape=[2, 8, 16], dtype=F32))


def _check_normal(inputs, outputs):
    (n,) = outputs
    assert n.shape == (2, 8, 16) and n.dtype == torch.bfloat16
    assert abs(n.float().mean().item() - 2.0) < 0.3 and 0.3 < n.float().std().item() < 0.7, "normal(2, 0.5) statistics are off"


@sample("normal", lambda g: [], check=_check_normal)
def _(b):
    b.add_output(b.op("normal", 2.0, 0.5, shape=[2, 8, 16], dtype=BF16))


@sample("uniform_seeded", lambda g: [17, 3], check=lambda inputs, outputs: _check_uniform(inputs, outputs))
def _(b):
    """An explicit RNG seed and offset (symbolic Int inputs)."""
    seed, offset = b.define_scalar(None, I64), b.define_scalar(None, I64)
    b.add_output(b.op("uniform", -1.0, 3.0, shape=[2, 8, 16], rng_seed=seed, rng_offset=offset, dtype=F32))


# ---------------------------------------------------------------------------------------------
# indexing


@sample("embedding_fwd", lambda g: [randint(g, 0, 32, 2, 8), randn(g, 32, 16)], lambda i, w: [w[i]], tol=0)
def _(b):
    b.add_output(b.op("embedding_fwd", b.define_tensor([2, 8], I64), b.define_tensor([32, 16], F32)))


@sample("embedding_fwd_padding", lambda g: [torch.arange(16).reshape(2, 8) % 5, randn(g, 32, 16)],
        lambda i, w: [F.embedding(i, w, padding_idx=3)], tol=0)
def _(b):
    """padding_idx masks only the gradient: row 3 (non-zero here) is looked up like any other."""
    b.add_output(b.op("embedding_fwd", b.define_tensor([2, 8], I64), b.define_tensor([32, 16], F32), padding_idx=3))


@sample("take_along_axis", lambda g: [randn(g, 2, 8, 16), randint(g, 0, 16, 2, 8, 4)],
        lambda x, i: [torch.gather(x, 2, i)], tol=0)
def _(b):
    b.add_output(b.op("take_along_axis", b.define_tensor([2, 8, 16], F32), b.define_tensor([2, 8, 4], I64), dim=2))


@sample("gather", lambda g: [randn(g, 4, 8), randint(g, 0, 8, 2, 4)],
        lambda x, i: [torch.stack([x[r, i[r]] for r in range(2)])], tol=0)
def _(b):
    """Unlike take_along_axis, the index may be smaller than the input off the gathered axis."""
    b.add_output(b.op("gather", b.define_tensor([4, 8], F32), b.define_tensor([2, 4], I64), dim=1))


@sample("index_select", lambda g: [randn(g, 8, 16), randint(g, 0, 8, 4)], lambda x, i: [x[i]], tol=0)
def _(b):
    b.add_output(b.op("index_select", b.define_tensor([8, 16], F32), b.define_tensor([4], I64), dim=0))


def _scatter_inputs(g: torch.Generator) -> list[torch.Tensor]:
    index = torch.stack([torch.randperm(8, generator=g) for _ in range(4)])  # each row a permutation: no collisions
    return [randn(g, 4, 8), index, randn(g, 4, 8)]


def _scatter_expected(x, index, src):
    out = x.clone()
    for r in range(4):
        for c in range(8):
            out[r, index[r, c]] = src[r, c]
    return [out]


@sample("scatter", _scatter_inputs, _scatter_expected, tol=0)
def _(b):
    x, index, src = b.define_tensor([4, 8], F32), b.define_tensor([4, 8], I64), b.define_tensor([4, 8], F32)
    b.add_output(b.op("scatter", x, index, src, dim=1))


@sample("scatter_number", lambda g: _scatter_inputs(g)[:2], lambda x, index: [x.scatter(1, index[:, :3], 7.0)], tol=0)
def _(b):
    """Scatter a number: index [4, 3] writes 7.0 in three places of each row."""
    x, index = b.define_tensor([4, 8], F32), b.define_tensor([4, 8], I64)
    index = b.op("slice", index, start_indices=[0, 0], end_indices=[4, 3])
    b.add_output(b.op("scatter", x, index, 7.0, dim=1))



# ---------------------------------------------------------------------------------------------
# mixture of experts


@sample("topk", lambda g: [randn(g, 8, 6)], lambda x: list(torch.topk(x, 2, dim=1)), tol=0)
def _(b):
    values, indices = b.op("topk", b.define_tensor([8, 6], F32), 2, dim=1, sorted=True)
    b.add_output(values)
    b.add_output(indices)


def _expert_index(g: torch.Generator) -> torch.Tensor:
    """12 rows over 4 experts, expert 2 chosen by none (its weight gradient is zero)."""
    return torch.tensor([0, 3, 1, 0, 3, 3, 1, 0, 0, 1, 3, 0])


@sample("gather_mm", lambda g: [randn(g, 12, 8), randn(g, 4, 8, 16), _expert_index(g)],
        lambda x, w, i: [torch.stack([x[s].double() @ w[i[s]].double() for s in range(12)])])
def _(b):
    x, w, index = b.define_tensor([12, 8], F32), b.define_tensor([4, 8, 16], F32), b.define_tensor([12], I64)
    b.add_output(b.op("gather_mm", x, w, index))


@sample("gather_mm_wgrad", lambda g: [randn(g, 12, 8), randn(g, 12, 16), _expert_index(g)],
        lambda x, dy, i: [torch.stack([sum((torch.outer(x[s].double(), dy[s].double()) for s in range(12) if i[s] == e),
                                           torch.zeros(8, 16, dtype=torch.float64)) for e in range(4)])])
def _(b):
    x, dy, index = b.define_tensor([12, 8], F32), b.define_tensor([12, 16], F32), b.define_tensor([12], I64)
    b.add_output(b.op("gather_mm_wgrad", x, dy, index, 4))

SAMPLES_BY_NAME: dict[str, Sample] = {s.name: s for s in SAMPLES}
