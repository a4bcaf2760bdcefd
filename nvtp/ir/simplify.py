"""Exact simplifications of a fusion: folding round-trip casts and removing dead ops.

Thunder's decompositions of half-precision code cast to float and back around every op;
Thunder's nvFuser executor removes the redundant ones (``remove_redundant_casts``). These
passes do the same on nvtp's IR and never change a result bit.
"""

from __future__ import annotations

from dataclasses import replace

from nvtp.ir.build import make_op
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Fusion, Op, Value, defines_input, fresh_names, is_value
from nvtp.ir.ops import RANDOM, norm_dim, pad_pairs

# (from, to) casts that are exact: every value of `from` is a value of `to`.
_WIDENS = {
    (DType.BFloat16, DType.Float), (DType.BFloat16, DType.Double), (DType.Half, DType.Float),
    (DType.Half, DType.Double), (DType.Float, DType.Double), (DType.Int32, DType.Int), (DType.Bool, DType.Int),
    (DType.Bool, DType.Int32), (DType.Bool, DType.Float), (DType.Bool, DType.Double),
}


def _substitute(x, sub: dict[str, Value]):
    if is_value(x):
        return sub.get(x.name, x)
    if isinstance(x, tuple):
        return tuple(_substitute(e, sub) for e in x)
    return x


def fold_casts(fusion: Fusion) -> Fusion:
    """Replace ``cast(cast(x, A), B)`` by ``cast(x, B)`` (or ``x``) when the inner cast is exact.

    Requires: a verified fusion. Ensures: the same outputs, bit for bit; fewer or equal ops.
    """
    producer: dict[str, Op] = {}
    sub: dict[str, Value] = {}
    ops: list[Op] = []
    for op in fusion.ops:
        op = Op(op.kind, tuple((k, _substitute(v, sub)) for k, v in op.args), op.outputs)
        if op.kind == "cast" and is_value(op.arg("arg")) and op.arg("arg").shape:
            src = op.arg("arg")
            inner = producer.get(src.name)
            if inner is not None and inner.kind == "cast" and is_value(inner.arg("arg")):
                origin = inner.arg("arg")
                if (origin.dtype, src.dtype) in _WIDENS:
                    if origin.dtype == op.arg("dtype"):
                        sub[op.outputs[0].name] = origin
                        continue
                    op = make_op("cast", (origin,), {"dtype": op.arg("dtype")}, [op.outputs[0].name])
        for v in op.outputs:
            producer[v.name] = op
        ops.append(op)
    outputs = tuple(_substitute(v, sub) for v in fusion.outputs)
    return dead_code(fusion.with_ops(tuple(ops), outputs))


def dead_code(fusion: Fusion) -> Fusion:
    """Drop ops none of whose results reach an output, and the info of the values they defined.
    Inputs and their order stay.

    Requires: a verified fusion. Ensures: the same inputs and outputs.
    """
    live = {v.name for v in fusion.outputs}
    keep: list[Op] = []
    for op in reversed(fusion.ops):
        if defines_input(op) or any(v.name in live for v in op.outputs):
            keep.append(op)
            live.update(v.name for v in op.operands)
    dropped = {v.name for op in fusion.ops for v in op.outputs} - {v.name for op in keep for v in op.outputs}
    out = fusion.with_ops(tuple(reversed(keep)))
    return replace(out, info={n: i for n, i in fusion.info.items() if n not in dropped}) if dropped & set(fusion.info) else out


def _key(x):
    if is_value(x):
        return ("value", x.name)
    if isinstance(x, tuple):
        return tuple(_key(e) for e in x)
    if isinstance(x, float) and x != x:
        return ("nan",)
    return (type(x).__name__, x)


def common_subexpressions(fusion: Fusion) -> Fusion:
    """Reuse the result of an op already computed with the same arguments (random ops excepted).

    Requires: a verified fusion. Ensures: the same outputs, bit for bit.
    """
    seen: dict[tuple, tuple[Value, ...]] = {}
    sub: dict[str, Value] = {}
    ops: list[Op] = []
    for op in fusion.ops:
        op = Op(op.kind, tuple((k, _substitute(v, sub)) for k, v in op.args), op.outputs)
        if defines_input(op) or op.kind in RANDOM:
            ops.append(op)
            continue
        key = (op.kind, _key(op.args))
        if key in seen:
            for old, new in zip(op.outputs, seen[key]):
                sub[old.name] = new
            continue
        seen[key] = op.outputs
        ops.append(op)
    return fusion.with_ops(tuple(ops), tuple(_substitute(v, sub) for v in fusion.outputs))


def unpad_gathers(fusion: Fusion) -> Fusion:
    """Rewrite Thunder's ``nll_loss`` trick for ignored targets into a masked pick:

        p = pad(x, one zero column after axis d)        g = take_along_axis(x, where(c, t, 0), d)
        i = where(c, t, C)            (C = x.shape[d])   ->   r = where(c, g, 0)
        r = take_along_axis(p, i, d)

    Exact (an index C picks the zero column), and a class axis split over devices then stays
    split: each rank picks what it holds (Megatron's parallel cross-entropy).

    Requires: a verified fusion. Ensures: the same outputs, bit for bit.
    """
    producers = fusion.producers()
    names = fresh_names(fusion)
    ops: list[Op] = []
    for op in fusion.ops:
        if op.kind == "take_along_axis":
            padded, index = op.arg("arg"), op.arg("index")
            dim = norm_dim(op.arg("dim"), padded.ndim)
            pad_op, where_op = producers.get(padded.name), producers.get(index.name)
            if pad_op is not None and pad_op.kind == "pad" and where_op is not None and where_op.kind == "where":
                x = pad_op.arg("arg")
                pairs = pad_pairs(x.ndim, pad_op.arg("pad_widths"))
                value = pad_op.arg("value")
                only_last = all(p == ((0, 1) if i == dim else (0, 0)) for i, p in enumerate(pairs))
                cond, t, c = where_op.arg("condition"), where_op.arg("x"), where_op.arg("y")
                if only_last and value in (0, 0.0, None) and c == x.shape[dim] and is_value(t) and is_value(cond):
                    out = op.outputs[0]
                    new = [make_op("where", (cond, t, 0), {}, [next(names)])]
                    if new[-1].outputs[0].dtype != t.dtype:
                        new.append(make_op("cast", (new[-1].outputs[0],), {"dtype": t.dtype}, [next(names)]))
                    picked = make_op("take_along_axis", (x, new[-1].outputs[0], dim), {}, [next(names)])
                    masked = make_op("where", (cond, picked.outputs[0], 0.0), {}, [out.name])
                    if masked.outputs[0].dtype == out.dtype:
                        ops.extend([*new, picked, masked])
                    else:
                        masked = make_op("where", (cond, picked.outputs[0], 0.0), {}, [next(names)])
                        ops.extend([*new, picked, masked, make_op("cast", (masked.outputs[0],), {"dtype": out.dtype}, [out.name])])
                    continue
        ops.append(op)
    return dead_code(fusion.with_ops(tuple(ops), fusion.outputs))
