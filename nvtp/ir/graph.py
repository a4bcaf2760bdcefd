"""The fusion IR: plain, immutable SSA data that mirrors an nvFuser ``FusionDefinition``.

A ``Fusion`` is an ordered tuple of ``Op``s. Every statement of an nvFuser definition is an op,
``define_tensor`` and ``define_scalar`` included, so the fusion's inputs are simply the values
those ops define (in order), exactly as nvFuser numbers its inputs. Op names and argument names
are nvFuser's (``fd.ops.broadcast_in_dim(arg, shape=..., broadcast_dims=...)``).

Arguments are stored by parameter name, in the order of the op's signature (see ``ops.py``),
each either a ``Value`` or a literal (int, float, bool, None, ``DType``, or a tuple of those).

Shardings are not stored here: they live beside the graph (``nvtp.sharding``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

from nvtp.ir.dtypes import DType


@dataclass(frozen=True)
class TensorValue:
    """A tensor in a fusion: its name, static shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: DType

    def __str__(self) -> str:
        return self.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        # Cached (the value is immutable): the propagation prices a reshard per operand per candidate.
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        """``T3: f32[2, 16, 64]``-style summary used in messages."""
        return f"{self.name}: {self.dtype.value}{list(self.shape)}"


@dataclass(frozen=True)
class ScalarValue:
    """A scalar in a fusion: a symbolic input, a constant defined with ``define_scalar``, or an op result."""

    name: str
    dtype: DType

    def __str__(self) -> str:
        return self.name

    shape: tuple[int, ...] = ()
    ndim = 0
    numel = 1

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize

    def describe(self) -> str:
        return f"{self.name}: {self.dtype.value} scalar"


Value = TensorValue | ScalarValue


def is_value(x: Any) -> bool:
    return isinstance(x, (TensorValue, ScalarValue))


def renamed_value(v: Value, name: str) -> Value:
    """``v`` named ``name`` (not ``dataclasses.replace``: a 96-layer splice renames ~10^5 values,
    and replace is 10x slower)."""
    return TensorValue(name, v.shape, v.dtype) if isinstance(v, TensorValue) else ScalarValue(name, v.dtype)


def _shape_of(a: Any) -> Any:
    if isinstance(a, TensorValue):
        return ("T", a.shape, a.dtype)
    if isinstance(a, ScalarValue):
        return ("S", a.dtype)
    if isinstance(a, tuple):
        return tuple(_shape_of(x) for x in a)
    return (type(a), a)


@dataclass(frozen=True)
class Op:
    """One statement: ``outputs = fd.ops.<kind>(**args)`` (or ``fd.define_tensor`` / ``fd.define_scalar``)."""

    kind: str
    args: tuple[tuple[str, Any], ...]
    outputs: tuple[Value, ...]
    # The op this one is a renamed copy of (``renamed``: a spliced block's op, from the traced
    # block's): same kind, literals, shapes and dtypes, so what depends on those alone (a sharding
    # rule's factors, the type check) is worked out once for all copies. Not an argument, so
    # ``dataclasses.replace`` and ``with_args``, which may change more than names, drop it.
    template: "Op | None" = field(default=None, init=False, repr=False, compare=False)

    def renamed(self, operand: Callable[[Value], str], output: Callable[[Value], str] | None = None) -> "Op":
        """This op reading each operand ``v`` as ``operand(v)`` (in argument order) and, with
        ``output``, naming each result ``output(v)``; only names change."""
        def one(v: Value) -> Value:
            name = operand(v)
            return v if name == v.name else renamed_value(v, name)

        args = tuple((k, one(a) if is_value(a) else tuple(one(x) if is_value(x) else x for x in a) if isinstance(a, tuple) else a)
                     for k, a in self.args)
        outputs = self.outputs if output is None else tuple(renamed_value(v, output(v)) for v in self.outputs)
        new = Op(self.kind, args, outputs)
        object.__setattr__(new, "template", self.template or self)
        return new

    @cached_property
    def structure(self) -> tuple:
        """The op without its value names: its kind, its literals (with their types: ``1`` is not
        ``1.0``), and each value's kind, shape and dtype. What an op's sharding rule and type check
        read is a function of this alone, so ops of one structure share that work where they are
        no renamed copies of one op (``template``): a parsed file's 10^5 ops of a few structures."""
        return (self.kind, tuple((k, _shape_of(a)) for k, a in self.args), tuple(_shape_of(v) for v in self.outputs))

    def arg(self, name: str) -> Any:
        for key, value in self.args:
            if key == name:
                return value
        raise KeyError(f"{self.kind} has no argument {name!r}")

    @property
    def arg_dict(self) -> dict[str, Any]:
        return dict(self.args)

    @cached_property
    def operands(self) -> tuple[Value, ...]:
        """Every value this op reads, in argument order (lists such as ``cat``'s are flattened)."""
        found: list[Value] = []
        for _, a in self.args:
            if is_value(a):
                found.append(a)
            elif isinstance(a, tuple):
                found.extend(x for x in a if is_value(x))
        return tuple(found)

    @cached_property
    def tensor_operands(self) -> tuple["TensorValue", ...]:
        """The tensor operands in argument order (the sharding rules' operand positions)."""
        return tuple(v for v in self.operands if isinstance(v, TensorValue))

    @property
    def output(self) -> Value:
        if len(self.outputs) != 1:
            raise ValueError(f"{self.kind} has {len(self.outputs)} outputs, not one")
        return self.outputs[0]

    def with_args(self, **changes: Any) -> "Op":
        args = tuple((k, changes.pop(k)) if k in changes else (k, v) for k, v in self.args)
        if changes:
            raise KeyError(f"{self.kind} has no argument(s) {sorted(changes)}")
        return replace(self, args=args)

    def __str__(self) -> str:
        return FORMAT["op"](self)


INPUT_KINDS = ("define_tensor", "define_scalar")


@dataclass
class ScheduleStep:
    """A device-schedule call on a tensor: ``("mesh", devices)`` (a flat tuple of device ids, or on
    a mesh of several axes the ids nested by its shape: ``((0, 1), (2, 3))``), ``("split", axis,
    factor, inner)`` or ``("parallelize", axis, parallel_type)`` (``mesh_x``, or ``mesh_y``: the mesh
    axis before the last)."""

    tensor: str
    kind: str
    args: tuple


# How ops and fusions print (``str(op)``, ``str(fusion)``): nvFuser's Python, as nvtp.ir.printer
# writes it; the printer registers itself here when nvtp.ir loads, so the graph does not import it.
FORMAT: dict[str, Callable[[Any], str]] = {"op": lambda op: f"{op.kind}{op.args}", "fusion": lambda f: f"Fusion {f.name}"}


def defines_input(op: Op) -> bool:
    """True for the ops that declare a fusion input (tensors, and scalars without a value)."""
    if op.kind == "define_tensor":
        return True
    return op.kind == "define_scalar" and op.arg("value") is None


@dataclass(frozen=True)
class ValueInfo:
    """What nvtp knows about a fusion input or output beyond nvFuser's definition.

    role: ``parameter`` | ``activation`` | ``saved`` (a forward value kept for backward) |
          ``grad`` (an incoming or outgoing gradient) | ``output``.
    label: the user's name for it (``attn.c_attn.weight``, ``x``, ``grad(x)``).
    source: for ``saved`` inputs of a backward fusion, the forward value they are (``T42``).
    grad_of: for a gradient output of a backward fusion, the label of the forward input it is
          the gradient of (``attn.c_attn.weight``; its label is ``grad(attn.c_attn.weight)``).
    """

    role: str
    label: str = ""
    source: str = ""
    grad_of: str = ""

    def __post_init__(self) -> None:
        # A dump's nvtp_info records grad_of only in the label it prints: read it back here, once.
        if self.role == "grad" and not (self.grad_of or self.source) and self.label.startswith("grad(") and self.label.endswith(")"):
            object.__setattr__(self, "grad_of", self.label[5:-1])


@dataclass(frozen=True)
class Fusion:
    """A fusion definition: ops in order, the outputs added with ``add_output``, and metadata."""

    ops: tuple[Op, ...]
    outputs: tuple[Value, ...]
    name: str = "nvfuser_fusion_id0"
    info: Mapping[str, ValueInfo] = field(default_factory=dict)
    attrs: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def inputs(self) -> tuple[Value, ...]:
        # Cached: ops never change, and runs ask for the inputs several times per call.
        return tuple(op.outputs[0] for op in self.ops if defines_input(op))

    @property
    def values(self) -> Mapping[str, Value]:
        """Every value by name, read-only (a view, not a copy: ``name in fusion.values`` in a loop
        over a fusion's communications was quadratic in its size)."""
        return MappingProxyType(self._by_name)

    @cached_property
    def _by_name(self) -> dict[str, Value]:
        # Cached like ``inputs``: passes look values up by name per op, so a scan would make them
        # quadratic in the fusion's size.
        return {v.name: v for op in self.ops for v in op.outputs}

    def value(self, name: str) -> Value:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"fusion {self.name} has no value named {name!r}") from None

    def producers(self) -> dict[str, Op]:
        return {v.name: op for op in self.ops for v in op.outputs}

    def consumers(self) -> dict[str, list[Op]]:
        users: dict[str, list[Op]] = {v.name: [] for op in self.ops for v in op.outputs}
        for op in self.ops:
            for v in op.operands:
                users.setdefault(v.name, []).append(op)
        return users

    def compute_ops(self) -> Iterator[Op]:
        """Ops other than input and constant definitions."""
        return (op for op in self.ops if op.kind not in INPUT_KINDS)

    def label(self, name: str) -> str:
        info = self.info.get(name)
        return info.label if info and info.label else name

    def role(self, name: str) -> str:
        info = self.info.get(name)
        return info.role if info else ""

    def grad_of(self, name: str) -> str:
        """The label of the forward input whose gradient output ``name`` is; "" for other values."""
        info = self.info.get(name)
        return info.grad_of if info else ""

    def with_ops(self, ops: tuple[Op, ...], outputs: tuple[Value, ...] | None = None) -> "Fusion":
        return replace(self, ops=tuple(ops), outputs=self.outputs if outputs is None else tuple(outputs))

    def __str__(self) -> str:
        return FORMAT["fusion"](self)


def fresh_names(fusion: Fusion) -> Iterator[str]:
    """Value names (``T<n>``) the fusion does not use yet, in order, for ops a pass adds."""
    taken = set(fusion.values)
    n = len(taken)
    while True:
        name = f"T{n}"
        n += 1
        if name not in taken:
            taken.add(name)
            yield name
