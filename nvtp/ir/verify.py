"""The verifier: a fusion is SSA, every op is known and well typed (operand dtypes nvFuser takes:
``OpSpec.dtypes``), and its results are what the op table infers. Failures name the op in IR
syntax and print the fusion around it."""

from __future__ import annotations

import weakref

from nvtp.ir import ops as opstable
from nvtp.ir.graph import Fusion, Op, ScalarValue, TensorValue, is_value
from nvtp.ir.ops import IRError
from nvtp.ir.dtypes import DType


def _context(fusion: Fusion, index: int, radius: int = 3) -> str:
    lo, hi = max(0, index - radius), min(len(fusion.ops), index + radius + 1)
    lines = []
    for i in range(lo, hi):
        mark = ">>" if i == index else "  "
        lines.append(f"  {mark} {fusion.ops[i]}")
    return "\n".join(lines)


def verify(fusion: Fusion, *, typed: bool = False) -> Fusion:
    """Check ``fusion``; return it unchanged, or raise ``IRError`` saying what is wrong and where.
    ``typed``: every op was built by ``nvtp.ir.build.make_op`` from the op table and its operand
    dtypes checked (the parser's ops), so only the SSA structure is left to check."""
    defined: dict[str, object] = {}
    for i, op in enumerate(fusion.ops):
        where = lambda: f"in {fusion.name}, op {i}:\n{_context(fusion, i)}"  # noqa: E731
        try:
            _verify_op(op, defined, typed)
        except IRError as e:
            raise IRError(f"{e}\n{where()}") from None
        for v in op.outputs:
            if v.name in defined:
                raise IRError(f"value {v.name} is defined twice\n{where()}")
            defined[v.name] = v
    for v in fusion.outputs:
        if defined.get(v.name) != v:
            raise IRError(f"{fusion.name}: output {v.name} is not a value of the fusion (or its type differs)")
    for name in fusion.info:
        if name not in defined:
            raise IRError(f"{fusion.name}: nvtp_info names {name!r}, which the fusion does not define")
    return fusion


# Ops already found well typed, by identity (an ``Op`` is immutable, and what ``_typed`` checks reads
# only the op; a renamed copy is checked through its template): the sharding passes copy most ops
# of a verified fusion unchanged, and re-inferring them was a fifth of sharding a deep model. Held
# weakly: an entry goes when its op does.
_TYPED: "weakref.WeakValueDictionary[int, Op]" = weakref.WeakValueDictionary()
# And by ``Op.structure`` (what ``_typed`` reads is a function of it alone), the most recent ones:
# the ops a pass rebuilds (``with_args``) repeat a few structures in a long fusion.
_TYPED_STRUCTURES: dict[tuple, None] = {}
_STRUCTURES_KEPT = 4096


def _verify_op(op: Op, defined: dict[str, object], typed: bool = False) -> None:
    for v in op.operands:
        if v.name not in defined:
            raise IRError(f"{v.name} is used before it is defined")
        if defined[v.name] != v:
            raise IRError(f"{v.name} is used as {v.describe()} but defined as {defined[v.name].describe()}")  # type: ignore[attr-defined]
    if typed:
        return
    op = op.template or op  # a renamed copy is typed as its template is
    if _TYPED.get(id(op)) is op:
        return
    if op.structure not in _TYPED_STRUCTURES:
        _typed(op)
        if len(_TYPED_STRUCTURES) >= _STRUCTURES_KEPT:
            _TYPED_STRUCTURES.pop(next(iter(_TYPED_STRUCTURES)))
        _TYPED_STRUCTURES[op.structure] = None
    _TYPED[id(op)] = op


def _typed(op: Op) -> None:
    """``op``'s arguments, result types and operand dtypes are what the op table says."""
    s = opstable.spec(op.kind)
    names = [name for name, _ in op.args]
    expected = [p.name for p in s.params]
    if names != expected:
        raise IRError(f"fd.ops.{op.kind} has arguments {names}, expected {expected}")
    outs = opstable.infer(op.kind, op.args)
    if len(outs) != len(op.outputs):
        raise IRError(f"fd.ops.{op.kind} gives {len(outs)} results, the op lists {len(op.outputs)}")
    for out, v in zip(outs, op.outputs):
        if out.shape is None:
            ok = isinstance(v, ScalarValue) and v.dtype == out.dtype
            want = f"{out.dtype.value} scalar"
        else:
            ok = isinstance(v, TensorValue) and v.shape == out.shape and v.dtype == out.dtype
            want = f"{out.dtype.value}{list(out.shape)}"
        if not ok:
            raise IRError(f"result {v.describe()} should be {want}")
    opstable.check_operand_dtypes(op)
    for _, a in op.args:
        if not (is_value(a) or _is_literal(a)):
            raise IRError(f"argument {a!r} is neither a value nor a literal")


def _is_literal(a: object) -> bool:
    if a is None or isinstance(a, (bool, int, float, complex, DType)):
        return True
    if isinstance(a, tuple):
        return all(is_value(x) or _is_literal(x) for x in a)
    return False
