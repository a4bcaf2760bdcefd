"""Data types, named as nvFuser names them (``DataType.BFloat16``), with their torch twins."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class DType(enum.Enum):
    """An nvFuser ``DataType``; ``str(dt)`` is how a dump spells it (``DataType.Float``)."""

    Double = "Double"
    Float = "Float"
    Half = "Half"
    BFloat16 = "BFloat16"
    Float8_e4m3fn = "Float8_e4m3fn"
    Float8_e5m2 = "Float8_e5m2"
    Int = "Int"
    Int32 = "Int32"
    UInt64 = "UInt64"
    Bool = "Bool"
    ComplexFloat = "ComplexFloat"
    ComplexDouble = "ComplexDouble"
    Null = "Null"

    def __str__(self) -> str:
        return f"DataType.{self.value}"

    __repr__ = __str__

    @property
    def torch(self) -> torch.dtype:
        if self is DType.Null:
            raise ValueError("DataType.Null has no torch dtype")
        return _TO_TORCH[self]

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in (DType.Int, DType.Int32, DType.UInt64)

    @property
    def is_complex(self) -> bool:
        return self in (DType.ComplexFloat, DType.ComplexDouble)

    @staticmethod
    def from_torch(dtype: torch.dtype) -> "DType":
        try:
            return _FROM_TORCH[dtype]
        except KeyError:
            raise ValueError(f"torch dtype {dtype} has no nvFuser DataType") from None


_TO_TORCH = {
    DType.Double: torch.float64,
    DType.Float: torch.float32,
    DType.Half: torch.float16,
    DType.BFloat16: torch.bfloat16,
    DType.Float8_e4m3fn: torch.float8_e4m3fn,
    DType.Float8_e5m2: torch.float8_e5m2,
    DType.Int: torch.int64,
    DType.Int32: torch.int32,
    DType.UInt64: torch.uint64,
    DType.Bool: torch.bool,
    DType.ComplexFloat: torch.complex64,
    DType.ComplexDouble: torch.complex128,
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_ITEMSIZE = {k: v.itemsize for k, v in _TO_TORCH.items()}  # asked per value by the passes' byte counts
_FLOATS = {DType.Double, DType.Float, DType.Half, DType.BFloat16, DType.Float8_e4m3fn, DType.Float8_e5m2}


@dataclass(frozen=True)
class Scalar:
    """A scalar value's dtype as an operand of ``promote`` (a tensor's is a bare ``DType``)."""

    dtype: DType


def promote(*operands: "DType | Scalar | bool | int | float | complex") -> DType:
    """Result type of an elementwise op, as nvFuser computes it (``csrc/type_promotion.cpp``).

    Operands are tensor dtypes (``DType``) or scalars: ``Scalar(dtype)`` for a scalar value, or a
    Python number, which nvFuser makes a constant of dtype Double, Int, Bool or ComplexDouble.
    The rule is torch's ``result_type`` (scalars join by category) with one difference: a scalar
    of a higher category than every tensor gives its own dtype, not torch's default Float, so
    ``Int tensor * 0.5`` is Double. Computing Half/BFloat16 in Float is a per-op rule (ops.py).
    """
    tensors = [x for x in operands if isinstance(x, DType)]
    scalars = [_scalar_dtype(x) for x in operands if not isinstance(x, DType)]
    if len(set(tensors + scalars)) == 1:
        return (tensors + scalars)[0]
    # nvFuser, like torch, lets a Half/BFloat16 scalar join as the default float dtype.
    scalars = [DType.Float if s in (DType.Half, DType.BFloat16) else s for s in scalars]
    if not tensors:
        return _promote_types(scalars)
    dim = _promote_types(tensors)
    if not scalars:
        return dim
    return _combine_categories(dim, _promote_types(scalars))


def _scalar_dtype(x: "Scalar | bool | int | float | complex") -> DType:
    if isinstance(x, Scalar):
        return x.dtype
    if isinstance(x, bool):
        return DType.Bool
    if isinstance(x, int):
        return DType.Int
    if isinstance(x, float):
        return DType.Double
    if isinstance(x, complex):
        return DType.ComplexDouble
    raise TypeError(f"promote: expected a DType, a Scalar or a Python number, got {x!r}")


def _promote_types(dtypes: "list[DType]") -> DType:
    result = dtypes[0].torch
    for dt in dtypes[1:]:
        result = torch.promote_types(result, dt.torch)
    return DType.from_torch(result)


def _combine_categories(higher: DType, lower: DType) -> DType:
    """torch's ``combine_categories``: tensors win within a category, a scalar lifts the category."""
    if higher.is_complex:
        return higher
    if lower.is_complex:
        return (DType.ComplexDouble if higher is DType.Double else DType.ComplexFloat) if higher.is_float else lower
    if higher.is_float:
        return higher
    if higher is DType.Bool or lower.is_float:
        return _promote_types([higher, lower])
    return higher


def scalar_example(dtype: DType) -> bool | int | float | complex:
    """A Python number standing for a scalar of ``dtype`` in ``promote``."""
    if dtype is DType.Bool:
        return True
    if dtype.is_int:
        return 1
    if dtype.is_complex:
        return 1j
    return 1.0


def as_input(x: object, shape: tuple[int, ...], dtype: DType) -> object:
    """``x`` as a fusion input declared ``dtype[*shape]`` takes it: a complex tensor fed to a real
    input with a trailing axis of 2 is its ``torch.view_as_real`` (no copy). nvtp writes complex
    arithmetic as real arithmetic on such pairs (``nvtp.frontend.complex``), so a complex buffer
    (a rotary table) enters a fusion as its pair; anything else is returned as it is. Only the
    rank and the pair axis are compared: a sharded run feeds this rank's part."""
    if (isinstance(x, torch.Tensor) and x.is_complex() and len(shape) == x.dim() + 1 and shape[-1] == 2
            and x.dtype == _COMPLEX_OF.get(dtype)):
        return torch.view_as_real(x.resolve_conj())
    return x


_COMPLEX_OF = {DType.Float: torch.complex64, DType.Double: torch.complex128, DType.Half: torch.complex32}
