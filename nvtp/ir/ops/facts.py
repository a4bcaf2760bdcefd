"""What the passes read about each op (``OpSpec``'s fact fields), one place per fact.

Imported after every family has registered its ops (``nvtp/ir/ops/__init__.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from nvtp.ir.dtypes import DType
from nvtp.ir.graph import TensorValue, is_value
from nvtp.ir.ops.reductions import REDUCTION
from nvtp.ir.ops.table import OPS, IRError, spec


def _facts(names: str, **fields: Any) -> None:
    for name in names.split():
        s = spec(name)
        OPS[name] = replace(s, **{k: s.dtypes | {v} if k == "dtypes" else v for k, v in fields.items()})


# Operand dtypes nvFuser refuses when a fusion is defined, which result inference by promotion
# lets through: (what the operands must be, whether the op's tensor operands ``ds`` are).
_PLAIN_FLOATS = (DType.Half, DType.BFloat16, DType.Float, DType.Double)
DTYPE_RULES: dict[str, tuple[str, Callable[[list[DType], Any], bool]]] = {
    "no_complex": ("no complex", lambda ds, op: not any(d.is_complex for d in ds)),
    "no_bool": ("no Bool", lambda ds, op: DType.Bool not in ds),
    "numeric": ("numeric (not only Bool)", lambda ds, op: not (op.outputs and op.outputs[0].dtype is DType.Bool)),
    "float": ("floating-point (Half, BFloat16, Float or Double)", lambda ds, op: all(d in _PLAIN_FLOATS for d in ds)),
    "float_or_complex": ("floating-point or complex", lambda ds, op: all(d.is_float or d.is_complex for d in ds)),
    "integer": ("integer or Bool", lambda ds, op: all(d.is_int or d is DType.Bool for d in ds)),
    "same": ("same-typed", lambda ds, op: len(set(ds)) <= 1),
    # nvFuser's mod is C's `%` in the generated CUDA: integers only (nvrtc refuses a float `%`;
    # nvFuser itself does not check, and fails compiling the kernel: seen on an H100, 2026-11-22).
    "int_only": ("integer (Int, Int32 or UInt64)",
                 lambda ds, op: all(d.is_int for d in ds) and all(v.dtype.is_int for v in op.outputs)),
}
# What to do instead, said after a rule's refusal.
DTYPE_HINTS: dict[str, str] = {
    "int_only": "for floating point use fd.ops.fmod (the dividend's sign, as C's fmod and torch.fmod) "
                "or fd.ops.remainder (the divisor's sign, as Python's % and torch.remainder)",
}
# Rules of single operands (``OpSpec.typed``): the dtypes they take (None: any) and what they hold.
OPERAND_RULES: dict[str, tuple[tuple[DType, ...] | None, str]] = {
    "index": ((DType.Int, DType.Int32), "indices"),
    "int64": ((DType.Int,), "indices"),
    "bool": ((DType.Bool,), "values"),
    "any": (None, ""),
}
for _rule, _names in {
    "no_complex": "atan2 ceil floor round trunc frac clamp erf erfc erfcinv erfinv fmod mod remainder ge gt le lt isneginf isposinf "
                  "lgamma max min maximum minimum nextafter relu threshold sign signbit topk",
    "no_bool": "abs ceil floor round trunc frac neg relu threshold",
    "numeric": "sub neg",
    "float": "frac silu sdpfa_fwd sdpfa_bwd linear matmul gather_mm gather_mm_wgrad",
    "float_or_complex": "var var_mean welford",
    "integer": "bitwise_and bitwise_or bitwise_xor bitwise_not bitwise_left_shift bitwise_right_shift gcd",
    "same": "linear matmul scatter gather_mm gather_mm_wgrad",
    "int_only": "mod",
}.items():
    _facts(_names, dtypes=_rule)
_facts("gather index_select scatter gather_mm gather_mm_wgrad", typed=(("index", "index"),))
_facts("take_along_axis", typed=(("index", "int64"),))
_facts("embedding_fwd", typed=(("input", "index"),))
_facts("where", typed=(("condition", "bool"),))
_facts("sdpfa_bwd", typed=(("philox_seed", "any"), ("philox_offset", "any")))  # integers by design

_facts("add sub cat", linear="all")  # sums of partial sums
_facts("mul matmul gather_mm gather_mm_wgrad", linear="one")  # a product with one factor partial
_facts("div neg cast reshape permute broadcast_in_dim expand squeeze set segment_set stride_order sum slice", linear="first")
_facts("permute reshape cast squeeze stride_order set segment_set neg", layout="moves")
_facts("slice", layout="selects")
_facts("uniform normal sdpfa_fwd", random=True)
_facts(" ".join(sorted(REDUCTION)), loop_reduce=(0,))
_facts("var_mean", loop_reduce=(1,))  # the mean; the variance's loop domain drops the reduced axes
_facts("welford", loop_reduce=(0, 1, 2))
_facts("linear matmul", loop_contract=-1)
_facts("gather_mm_wgrad", loop_contract=0)  # not gather_mm: its nvFuser result is the rows put back (index_select)

RANDOM = frozenset(name for name, s in OPS.items() if s.random)


def check_operand_dtypes(op: Any) -> None:
    """Raise ``IRError`` for operand dtypes nvFuser refuses for ``op`` (``OpSpec.dtypes`` and
    ``typed``): e.g. a Bool ``neg``, a complex ``erf`` or an Int ``linear`` weight."""
    s = spec(op.kind)
    if not (s.dtypes or s.typed):
        return
    own = dict(s.typed)
    for name, rule in s.typed:
        want, noun = OPERAND_RULES[rule]
        v = op.arg(name)
        if want is not None and is_value(v) and v.dtype not in want:
            raise IRError(f"fd.ops.{op.kind} needs {' or '.join(str(w) for w in want)} {noun} ({name}), got {v.name} of type {v.dtype}")
    named = [v for name, v in op.args if isinstance(v, TensorValue) and name not in own]
    dtypes = [v.dtype for v in named]
    for rule, (what, ok) in DTYPE_RULES.items():
        if rule in s.dtypes and not ok(dtypes, op):
            got = ", ".join(f"{v.name} ({v.dtype})" for v in named)
            if rule == "int_only":  # a float number operand shows only in the result's dtype
                got = ", ".join(filter(None, [got, *(f"result {v.name} ({v.dtype})" for v in op.outputs)]))
            hint = f"; {DTYPE_HINTS[rule]}" if rule in DTYPE_HINTS else ""
            raise IRError(f"fd.ops.{op.kind} takes {what} operands, got {got}{hint}")
