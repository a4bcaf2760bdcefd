"""The op table's data types and its one registry: ``OpSpec``, ``OPS``, ``spec``, ``register``,
the shape helpers the families share, and the binding of a call's arguments (``bind``, ``infer``).

The families (``inputs``, ``elementwise``, ``reductions``, ``shapes``, ``matmul``, ``factories``,
``indexing``, ``moe``) register their ops here when ``nvtp.ir.ops`` is imported; ``facts`` then sets what
the passes read about each op.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    ``nvtp/ir/ops/facts.py`` after every family registered; ``tests/test_ops.py`` checks every op has each):

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
    loop_contract  the first operand's contracted axis (negative: from the end), with which the
                 result's loop domain ends, as a reduction axis (nvFuser's matmul and linear: -1,
                 the last; gather_mm_wgrad, written as nvFuser's grouped_mm: 0, its rows).
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
    loop_contract: int | None = None

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
            f"unknown op fd.ops.{name}: nvtp knows {len(OPS)} ops; add it to its family in the op table, nvtp/ir/ops/"
        ) from None


def register(name: str, params: Sequence[Param], infer, family: str, positional: int = 1) -> None:
    if name in OPS:
        raise ValueError(f"op {name} registered twice")
    OPS[name] = OpSpec(name, tuple(params), infer, family, positional)


def check(cond: bool, msg: Callable[[], str]) -> None:
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
    check(-ndim <= d < max(ndim, 1), lambda: f"{what} {d} out of range for a tensor of rank {ndim}")
    return d % ndim if ndim else 0


def broadcast_shapes(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Right-aligned broadcasting, as torch does; size-1 axes stretch."""
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(ndim):
        sizes = {s[len(s) - ndim + i] for s in shapes if len(s) - ndim + i >= 0} - {1}
        check(len(sizes) <= 1, lambda: f"shapes {[list(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def elementwise_result(operands: Sequence[Any], dtype: DType) -> list[Out]:
    tensors = [x for x in operands if isinstance(x, TensorValue)]
    if not tensors:
        return [Out(None, dtype)]
    return [Out(broadcast_shapes([t.shape for t in tensors]), dtype)]


def float_result(dt: DType) -> DType:
    return dt if (dt.is_float or dt.is_complex) else DType.Float


def tensor_arg(a, name="arg") -> TensorValue:
    """The bound argument ``name``, which must be a tensor."""
    x = a[name]
    check(isinstance(x, TensorValue), lambda: f"argument {name} must be a tensor, got {x!r}")
    return x


def int_arg(x: Any, what: str) -> int:
    check(isinstance(x, int) and not isinstance(x, bool), lambda: f"{what} must be a static integer, got {x!r}")
    return x


# ---------------------------------------------------------------------------------------------
# binding and inference


def bind(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Bind a call's arguments to ``name``'s signature: (param, value) pairs in signature order."""
    s = spec(name)
    check(len(args) <= len(s.params), lambda: f"fd.ops.{name} takes at most {len(s.params)} positional arguments ({_signature(s)}), got {len(args)}")
    bound: dict[str, Any] = {}
    for p, v in zip(s.params, args):
        bound[p.name] = v
    for k, v in kwargs.items():
        check(any(p.name == k for p in s.params), lambda: f"fd.ops.{name} has no argument {k!r}; its signature is ({_signature(s)})")
        check(k not in bound, lambda: f"fd.ops.{name} got argument {k!r} twice")
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
    check(_KINDS[kind.rstrip("?")](v), lambda: f"fd.ops.{op}: argument {p.name} must be {p.kind}, got {v!r}")
