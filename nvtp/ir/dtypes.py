"""Data types, named as nvFuser names them (``DataType.BFloat16``), with their torch twins."""

from __future__ import annotations

import enum

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
        return self.torch.itemsize

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
_FLOATS = {DType.Double, DType.Float, DType.Half, DType.BFloat16, DType.Float8_e4m3fn, DType.Float8_e5m2}


def promote(*operands: "DType | bool | int | float | complex") -> DType:
    """Result type of an elementwise op, by torch's rules (a Python number joins only by category).

    Operands are tensor dtypes (``DType``) or Python scalar *examples* (a ``float`` stands for
    any scalar of category float).
    """
    examples = []
    for x in operands:
        if isinstance(x, DType):
            examples.append(torch.empty((1,), dtype=x.torch))
        else:
            examples.append(x)
    if not any(isinstance(e, torch.Tensor) for e in examples):
        # Only scalars: nvFuser computes scalars in Double / Int / Bool.
        kinds = [type(e) for e in examples]
        if complex in kinds:
            return DType.ComplexDouble
        if float in kinds:
            return DType.Double
        if int in kinds:
            return DType.Int
        return DType.Bool
    result = examples[0]
    for e in examples[1:]:
        result = torch.empty((1,), dtype=torch.result_type(result, e))
    if not isinstance(result, torch.Tensor):  # pragma: no cover - guarded above
        raise AssertionError(result)
    return DType.from_torch(result.dtype)


def scalar_example(dtype: DType) -> bool | int | float | complex:
    """A Python number standing for a scalar of ``dtype`` in ``promote``."""
    if dtype is DType.Bool:
        return True
    if dtype.is_int:
        return 1
    if dtype.is_complex:
        return 1j
    return 1.0
