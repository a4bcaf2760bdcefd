"""Fused projections of parts of different widths on the ``thunder.jit`` route: one projection per part.

A fused q|k|v projection with grouped-query attention (q 64 | k 32 | v 32 rows) is one ``linear``
whose output is read only as ranges of its last axis of different widths; no placement of the
whole weight gives each rank whole heads of each part. The FX route rewrites such projections in
its graph (``nvtp.frontend.fused``); this module does the same for the ``thunder.jit`` route, in
two steps that together give the fusions the FX route gives:

1. ``SplitFusedLinears``, a Thunder transform run before autodiff, writes the ``linear`` as one
   ``linear`` per part on the part's rows of the weight (``W[a:b]``, ``bias[a:b]``), and the reads
   (slices ``y[..., a:b]``, one ``split``/``chunk`` of the last axis, either after one view that
   keeps the feature axis or splits it into ``[m, h]``) as the parts' outputs.
   Thunder then differentiates per-part projections: the weight's gradient is the parts'
   gradients padded into place and added.
2. ``lift_parts`` then makes each part its own fusion input (label ``<weight>[a:b]``, as
   ``fused.part_label`` names the FX route's parts): in the forward and backward, a parameter read
   only as row ranges that tile it becomes one input per range, and in the backward, its
   gradient, a sum of row-padded pieces that tile it, one output per range (``grad(W[a:b])``).

``nvtp.parallel`` feeds each part as rows of the rank's tensor of the weight and joins the
parts' gradients, as for the FX route (``parts_of`` reads the parts back from the labels).
Both steps run only inside ``splitting(True)`` (the derived plans on a 1-D mesh): elsewhere the
weight stays one input, as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from dataclasses import replace
from typing import Any, Iterator

import thunder
import thunder.torch as ltorch
from thunder.core.prims import PrimIDs
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx

from nvtp.frontend.fused import Part, index_range, part_label, split_ranges, tiles
from nvtp.ir.build import make_op
from nvtp.ir.graph import Fusion, Op, TensorValue, ValueInfo, fresh_names
from nvtp.ir.simplify import dead_code
from nvtp.ir.ops import pad_pairs

_SPLIT: contextvars.ContextVar[bool] = contextvars.ContextVar("nvtp_split_parts", default=False)


@contextlib.contextmanager
def splitting(enabled: bool) -> Iterator[None]:
    """Captures inside this block split fused projections of unequal parts (when ``enabled``)."""
    token = _SPLIT.set(enabled)
    try:
        yield
    finally:
        _SPLIT.reset(token)


def enabled() -> bool:
    return _SPLIT.get()


# -- 1. in Thunder's trace, before autodiff -----------------------------------------------------------


def _same(a: Any, b: TensorProxy) -> bool:
    return isinstance(a, TensorProxy) and a.name == b.name


def _range_reads(bsym: BoundSymbol, y: TensorProxy, axis: int) -> list[tuple[TensorProxy, int, int]] | None:
    """[(output, start, stop)] when ``bsym`` reads ``y`` only as ranges of its axis ``axis``."""
    n, ndim = y.shape[axis], y.ndim
    if bsym.sym.id == ltorch.getitem.id and _same(bsym.args[0], y):
        r = index_range(bsym.args[1], tuple(y.shape), axis)
        return [(bsym.output, *r)] if r is not None else None
    kinds = {ltorch.split.id: "split", ltorch.chunk.id: "chunk"}
    if bsym.sym.id in kinds and _same(bsym.args[0], y):
        size = bsym.args[1] if len(bsym.args) > 1 else next(iter(bsym.kwargs.values()), None)
        dim = bsym.args[2] if len(bsym.args) > 2 else bsym.kwargs.get("dim", 0)
        ranges = split_ranges(kinds[bsym.sym.id], size, n) if isinstance(dim, int) and dim % ndim == axis % ndim else None
        if ranges is not None and len(ranges) == len(bsym.output):
            return [(o, a, b) for o, (a, b) in zip(bsym.output, ranges)]
    return None


_VIEWS = {ltorch.view.id, ltorch.reshape.id}


def _reads(y: TensorProxy, readers: dict[str, list[BoundSymbol]]) -> tuple[list[BoundSymbol], list[tuple[TensorProxy, int, int]]] | None:
    """The bound symbols that read the projection's output ``y`` (last axis ``n``) and what they give:
    [(output, first row, end row)], when they read it only as ranges of its features, directly or
    through one view that keeps the feature axis (``view(B, T, 1, n)``, a query-group axis of one)
    or splits it into ``[m, h]`` (ranges of ``m``, each ``h`` rows)."""
    users = readers.get(y.name, [])
    direct = [_range_reads(r, y, -1) for r in users]
    if users and all(r is not None for r in direct):
        return users, [x for r in direct for x in r]
    if len(users) != 1 or users[0].sym.id not in _VIEWS or not isinstance(users[0].output, TensorProxy):
        return None
    view, n = users[0].output, y.shape[-1]
    if tuple(view.shape[-1:]) == (n,):
        axis, h = -1, 1
    elif view.ndim >= 2 and view.shape[-2] * view.shape[-1] == n and tuple(view.shape[:-2]) == tuple(y.shape[:-1]):
        axis, h = -2, view.shape[-1]
    else:
        return None
    through = [_range_reads(r, view, axis) for r in readers.get(view.name, [])]
    if not through or any(r is None for r in through):
        return None
    return [users[0], *readers[view.name]], [(o, a * h, b * h) for r in through for o, a, b in r]


def split_fused_linears(trace: TraceCtx) -> TraceCtx:
    """``trace`` with each ``linear`` of a weight (and bias) the computation takes and reads nowhere
    else, whose output is read only as ranges of its features of different widths (``_reads``),
    written as one ``linear`` per range, each read replaced by its part (viewed as the read's
    result); ``trace`` itself when there is none."""
    taken = {p.name for p in trace.args if isinstance(p, TensorProxy)}
    readers: dict[str, list[BoundSymbol]] = {}
    for bsym in trace.bound_symbols:
        if bsym.sym.id == PrimIDs.RETURN:  # it lists every argument ("flat_args"), read or not
            continue
        for p in bsym.flat_proxy_args:
            readers.setdefault(p.name, []).append(bsym)
    plans: dict[int, tuple[list[BoundSymbol], list[tuple[TensorProxy, int, int]]]] = {}
    for i, bsym in enumerate(trace.bound_symbols):
        if bsym.sym.id != ltorch.linear.id:
            continue
        x, w, *rest = bsym.args
        b = rest[0] if rest else bsym.kwargs.get("bias")
        if not all(isinstance(t, TensorProxy) and t.name in taken and len(readers.get(t.name, [])) == 1 for t in (w, b) if t is not None):
            continue
        y = bsym.output
        if not isinstance(y, TensorProxy) or w.ndim != 2 or y.shape[-1] != w.shape[0]:
            continue
        found = _reads(y, readers)
        if found is not None and tiles([(a, c) for _, a, c in found[1]], w.shape[0]):
            plans[i] = found
    if not plans:
        return trace
    dropped = {id(r) for users, _ in plans.values() for r in users}
    new = from_trace(trace)
    swap: dict[Any, Any] = {}
    with tracectx(new):
        for i, bsym in enumerate(trace.bound_symbols):
            if id(bsym) in dropped:
                continue
            if i not in plans:
                new.bound_symbols.append(bsym.from_bsym_swap_proxies(swap) if swap else bsym)
                continue
            x, w, *rest = bsym.args
            b = rest[0] if rest else bsym.kwargs.get("bias")
            new.push_scope([])
            part = {}
            for out, a, c in plans[i][1]:
                if (a, c) not in part:
                    wb = ltorch.getitem(b, slice(a, c)) if b is not None else None
                    part[(a, c)] = ltorch.linear(x, ltorch.getitem(w, slice(a, c)), wb)
                y = part[(a, c)]
                swap[variableify(out)] = y if tuple(y.shape) == tuple(out.shape) else ltorch.reshape(y, *out.shape)
            made = new.pop_scope()
            new.bound_symbols.extend(m.from_bsym(source_filename=bsym.source_filename, source_positions=bsym.source_positions)
                                     for m in made)
    new.set_provenance(TraceProvenance("nvtp: fused projections of unequal parts, one linear per part"))
    return new


class SplitFusedLinears(thunder.Transform):
    """Step 1, in ``nvtp.frontend.capture`` while ``splitting`` is on."""

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        return prologue_trace, split_fused_linears(computation_trace), epilogue_trace


# -- 2. in the fusions: parts become inputs (and gradient outputs) -----------------------------------


def _row_range(op: Op, v: TensorValue) -> tuple[int, int] | None:
    """(a, b) if ``op`` is ``slice(v)`` selecting rows a:b of axis 0 and every other axis whole."""
    if op.kind != "slice" or op.arg("arg").name != v.name:
        return None
    starts, ends, strides = op.arg("start_indices"), op.arg("end_indices"), op.arg("strides")
    if strides is not None and any(s != 1 for s in strides):
        return None
    if any(s != 0 or e != n for s, e, n in zip(starts[1:], ends[1:], v.shape[1:])):
        return None
    a, b = max(0, starts[0]), min(v.shape[0], ends[0])
    return (a, b) if a < b else None


def _sliced_inputs(fusion: Fusion) -> dict[str, list[tuple[int, int]]]:
    """Parameter label -> the row ranges its input is read as, when it is read only so and they tile it."""
    consumers = fusion.consumers()
    found = {}
    for v in fusion.inputs:
        if not isinstance(v, TensorValue) or fusion.role(v.name) != "parameter" or v.ndim < 1 or v.name in {o.name for o in fusion.outputs}:
            continue
        users = consumers.get(v.name, [])
        ranges = [_row_range(op, v) for op in users]
        if users and all(r is not None for r in ranges) and tiles(ranges, v.shape[0]):
            found[fusion.label(v.name)] = sorted(set(ranges))
    return found


def _pieces(fusion: Fusion, v: TensorValue, producers: dict[str, Op]) -> list[tuple[int, int, TensorValue]] | None:
    """[(a, b, piece)] when ``v`` is a sum (``add`` ops) of pieces each padded into rows a:b of axis
    0 with zeros (``pad``, every other axis unpadded), or a ``cat`` of pieces along axis 0."""
    op = producers.get(v.name)
    if op is None:
        return None
    if op.kind == "add" and all(isinstance(x, TensorValue) and x.shape == v.shape for x in op.operands) and len(op.operands) == 2:
        left, right = (_pieces(fusion, x, producers) for x in op.operands)
        return None if left is None or right is None else left + right
    if op.kind == "pad" and op.arg("value") in (0, 0.0, None):
        x = op.arg("arg")
        pairs = pad_pairs(x.ndim, op.arg("pad_widths"))
        if any(p != (0, 0) for p in pairs[1:]):
            return None
        lo, _ = pairs[0]
        return [(lo, lo + x.shape[0], x)]
    if op.kind == "cat" and op.arg("dim") % v.ndim == 0:
        out, at = [], 0
        for x in op.arg("tensors"):
            out.append((at, at + x.shape[0], x))
            at += x.shape[0]
        return out
    return None


def _summed_outputs(fusion: Fusion) -> dict[str, list[tuple[int, int, TensorValue]]]:
    """Parameter label -> the pieces its gradient output is made of, when they tile it."""
    producers = fusion.producers()
    found = {}
    for v in fusion.outputs:
        of = fusion.grad_of(v.name)
        if not of or not isinstance(v, TensorValue) or v.ndim < 1:
            continue
        pieces = _pieces(fusion, v, producers)
        if pieces and tiles([(a, b) for a, b, _ in pieces], v.shape[0]):
            found[of] = pieces
    return found


def _lift(fusion: Fusion, labels: set[str], with_grads: bool) -> Fusion:
    """``fusion`` with the inputs labelled ``labels`` (and, ``with_grads``, their gradient outputs)
    one per part."""
    names = fresh_names(fusion)
    ranges = _sliced_inputs(fusion)
    pieces = _summed_outputs(fusion) if with_grads else {}
    info = dict(fusion.info)
    sub: dict[str, Any] = {}
    ops: list[Op] = []
    for op in fusion.ops:
        v = op.outputs[0] if op.outputs else None
        if op.kind == "define_tensor" and fusion.label(v.name) in labels and fusion.role(v.name) == "parameter":
            label = fusion.label(v.name)
            for a, b in ranges[label]:
                part = TensorValue(next(names), (b - a, *v.shape[1:]), v.dtype)
                ops.append(Op("define_tensor", tuple((k, (b - a, *v.shape[1:]) if k == "shape" else x) for k, x in op.args), (part,)))
                info[part.name] = ValueInfo("parameter", part_label(label, a, b))
                sub[(v.name, a, b)] = part
            info.pop(v.name, None)
            continue
        if op.kind == "slice" and fusion.label(op.arg("arg").name) in labels and fusion.role(op.arg("arg").name) == "parameter":
            r = _row_range(op, op.arg("arg"))
            sub[op.outputs[0].name] = sub[(op.arg("arg").name, *r)]
            continue
        ops.append(Op(op.kind, tuple((k, _substituted(x, sub)) for k, x in op.args), op.outputs))
    outputs: list[Any] = []
    for v in fusion.outputs:
        of = fusion.grad_of(v.name)
        if of in labels and of in pieces:
            info.pop(v.name, None)
            for a, b in ranges.get(of) or sorted({(a, b) for a, b, _ in pieces[of]}):
                parts = [p for pa, pb, p in pieces[of] if (pa, pb) == (a, b)]
                total = _substituted(parts[0], sub)
                for more in parts[1:]:
                    add = make_op("add", (total, _substituted(more, sub)), {}, [next(names)])
                    ops.append(add)
                    total = add.outputs[0]
                outputs.append(total)
                info[total.name] = ValueInfo("grad", f"grad({part_label(of, a, b)})", grad_of=part_label(of, a, b))
            continue
        outputs.append(_substituted(v, sub))
    return dead_code(replace(fusion, ops=tuple(ops), outputs=tuple(outputs), info=info))


def _substituted(x: Any, sub: dict) -> Any:
    if isinstance(x, TensorValue):
        return sub.get(x.name, x)
    if isinstance(x, tuple):
        return tuple(_substituted(e, sub) for e in x)
    return x


def lift_parts(forward: Fusion, backward: Fusion | None) -> tuple[Fusion, Fusion | None]:
    """Step 2 (see the module docstring): the parameters read as row ranges in the forward, whose
    gradient the backward sums from row pieces of the same ranges, become one input per part in
    both fusions, and their gradient one output per part. Others stay as they are."""
    labels = set(_sliced_inputs(forward))
    if backward is not None:
        in_backward = _sliced_inputs(backward)
        summed = _summed_outputs(backward)
        labels = {label for label in labels
                  if label in summed and {(a, b) for a, b, _ in summed[label]} == set(_sliced_inputs(forward)[label])
                  and (label not in {backward.label(v.name) for v in backward.inputs} or label in in_backward)}
    if not labels:
        return forward, backward
    return _lift(forward, labels, False), _lift(backward, labels, True) if backward is not None else None


_PART = re.compile(r"^(?P<weight>.+)\[(?P<start>\d+):(?P<stop>\d+)\]$")


def owner(label: str) -> str:
    """The parameter a part's label (``w[0:64]``) is rows of; any other label itself."""
    m = _PART.match(label)
    return m.group("weight") if m else label


def parts_of(fusion: Fusion) -> dict[str, Part]:
    """The inputs of ``fusion`` that are parts of a parameter (label -> ``Part``), read from their labels."""
    found = {}
    for v in fusion.inputs:
        m = _PART.match(fusion.label(v.name)) if fusion.role(v.name) == "parameter" else None
        if m:
            found[m.group(0)] = Part(m.group("weight"), int(m.group("start")), int(m.group("stop")))
    return found
