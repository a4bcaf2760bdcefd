"""Build fusions op by op, with nvFuser-style names (T0, T1, S2, ...) and inferred result types."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from nvtp.ir import ops as opstable
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Fusion, Op, ScalarValue, TensorValue, Value, ValueInfo
from nvtp.ir.ops import IRError


def make_op(kind: str, args: Sequence[Any], kwargs: Mapping[str, Any], names: Sequence[str]) -> Op:
    """An op with its results typed by the op table. ``names`` must match the number of results."""
    bound = opstable.bind(kind, tuple(args), kwargs)
    outs = opstable.infer(kind, bound)
    if len(names) != len(outs):
        raise IRError(f"fd.ops.{kind} gives {len(outs)} result(s), but {len(names)} name(s) receive them")
    values: list[Value] = []
    for name, out in zip(names, outs):
        values.append(ScalarValue(name, out.dtype) if out.shape is None else TensorValue(name, out.shape, out.dtype))
    return Op(kind, bound, tuple(values))


def normalize(x: Any) -> Any:
    """Lists become tuples so ops stay hashable and comparable."""
    if isinstance(x, list):
        return tuple(normalize(e) for e in x)
    if isinstance(x, tuple):
        return tuple(normalize(e) for e in x)
    return x


class FusionBuilder:
    """Appends ops, naming results ``T<n>`` (tensors) and ``S<n>`` (scalars) from one counter."""

    def __init__(self, name: str = "nvfuser_fusion_id0"):
        self.name = name
        self.ops: list[Op] = []
        self.outputs: list[Value] = []
        self.info: dict[str, ValueInfo] = {}
        self.attrs: dict[str, str] = {}
        self._count = 0
        self._taken: set[str] = set()

    def _fresh(self, scalar: bool) -> str:
        while True:
            name = f"{'S' if scalar else 'T'}{self._count}"
            self._count += 1
            if name not in self._taken:
                return name

    def add(self, kind: str, *args: Any, names: Sequence[str] | None = None, **kwargs: Any) -> Op:
        args = tuple(normalize(a) for a in args)
        kwargs = {k: normalize(v) for k, v in kwargs.items()}
        if names is None:
            bound = opstable.bind(kind, args, kwargs)
            outs = opstable.infer(kind, bound)
            names = [self._fresh(o.shape is None) for o in outs]
        op = make_op(kind, args, kwargs, names)
        for v in op.outputs:
            if v.name in self._taken:
                raise IRError(f"value name {v.name} is defined twice")
            self._taken.add(v.name)
        self.ops.append(op)
        return op

    def define_tensor(self, shape, dtype: DType, *, contiguity=None, stride_order=None, name: str | None = None, info: ValueInfo | None = None) -> TensorValue:
        shape = tuple(shape)
        if contiguity is None:
            contiguity = tuple(None if n == 1 else True for n in shape)  # nvFuser: None on broadcast axes
        if stride_order is None:
            stride_order = tuple(range(len(shape) - 1, -1, -1))
        op = self.add(
            "define_tensor",
            shape=shape,
            contiguity=tuple(contiguity),
            dtype=dtype,
            is_cpu=False,
            stride_order=tuple(stride_order),
            names=None if name is None else [name],
        )
        v = op.outputs[0]
        if info is not None:
            self.info[v.name] = info
        return v  # type: ignore[return-value]

    def define_scalar(self, value=None, dtype: DType | None = None, *, name: str | None = None) -> ScalarValue:
        op = self.add("define_scalar", value, dtype=dtype, names=None if name is None else [name])
        return op.outputs[0]  # type: ignore[return-value]

    def op(self, kind: str, *args: Any, **kwargs: Any):
        """Append ``fd.ops.<kind>(*args, **kwargs)``; returns the result, or a tuple of results."""
        op = self.add(kind, *args, **kwargs)
        return op.outputs[0] if len(op.outputs) == 1 else op.outputs

    def add_output(self, value: Value, info: ValueInfo | None = None) -> None:
        self.outputs.append(value)
        if info is not None:
            self.info[value.name] = info

    def build(self) -> Fusion:
        return Fusion(tuple(self.ops), tuple(self.outputs), self.name, dict(self.info), dict(self.attrs))
