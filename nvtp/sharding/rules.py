"""Per-op sharding rules as factor mappings, one registry entry per op (families from sets).

As in Shardy and DTensor's einsum strategies, a rule describes an op by *factors*: named
dimensions of its iteration space, each with a size and a kind, and for every tensor operand and
result, which factors make up each axis (outermost first; an axis can be a compound of several
factors, which is how reshapes that split or merge axes are expressed):

    linear(x[b, s, k], w[n, k], bias[n]) -> out[b, s, n]      factors b, s, n: pass; k: reduce(sum)

A factor's kind says what sharding it does:
  pass     - appears in a result; sharding it shards the operands and results that hold it.
  reduce   - appears only in operands; sharding it leaves each rank a partial result
             (``Partial(op)``); an operand without it (a linear's bias) stays whole and is
             added on one rank only.
  blocked  - must not be sharded by this op (e.g. attention's key sequence, a slice that cuts
             across shards); operands are re-placed whole along it.
A factor that appears only in results (``iota``, ``uniform``, the new axis of a broadcast)
shards results computed locally, without communication.

The propagation algorithm (``propagate.py``) is written once against this description.
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass, field
from typing import Callable

from nvtp.ir import ops as opstable
from nvtp.ir.graph import Op, TensorValue
from nvtp.ir.ops import norm_dim, pad_pairs, slice_bounds
from nvtp.registry import registrar

Axis = tuple[int, ...]  # factor ids, outermost first; () for a size-1 axis with no factor


@dataclass
class OpFactors:
    """The factor description of one op."""

    sizes: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    reduce_ops: dict[int, str] = field(default_factory=dict)
    operands: list[list[Axis] | None] = field(default_factory=list)  # aligned with tensor_operands(op)
    results: list[list[Axis] | None] = field(default_factory=list)  # aligned with op.outputs

    def factor(self, size: int, kind: str = "pass", reduce_op: str | None = None) -> int:
        self.sizes.append(size)
        self.kinds.append(kind)
        if reduce_op:
            self.reduce_ops[len(self.sizes) - 1] = reduce_op
        return len(self.sizes) - 1


Rule = Callable[[Op], OpFactors]
RULES: dict[str, Rule] = {}


class RuleError(LookupError):
    """An op the op table knows with no entry in ``RULES`` (a gap in nvtp, not bad input)."""


rule = registrar(RULES, "sharding rule")


def tensor_operands(op: Op) -> tuple[TensorValue, ...]:
    """The tensor operands of ``op`` in argument order (the rules' operand positions)."""
    return op.tensor_operands


# Factor descriptions by op identity (an ``Op`` is immutable and nothing writes to an ``OpFactors``
# once its rule returns): the plans probe a deep model one projection at a time, and every probe
# asked again for the factors of the same ops. A renamed copy (``Op.template``) shares its
# template's entry: factors hold no names. Held weakly: an entry goes when its op does.
_FACTORS: dict[int, tuple[weakref.ref, "OpFactors"]] = {}


# Ops that are no renamed copy by their ``Op.structure`` (a parsed file's ops repeat a few
# structures): the most recent ones, so a process sharding many models does not keep them all.
_BY_STRUCTURE: dict[tuple, "OpFactors"] = {}
_STRUCTURES_KEPT = 4096


def factors_of(op: Op) -> OpFactors:
    """The factor description of ``op``; a clear error if no rule is registered."""
    op = op.template or op
    ring = RING.get() and op.kind in ("sdpfa_fwd", "sdpfa_bwd")
    key = id(op) if not ring else (id(op), "ring")
    hit = _FACTORS.get(key)
    if hit is not None and hit[0]() is op:
        return hit[1]
    shape = (op.structure, ring)
    f = _BY_STRUCTURE.get(shape)
    if f is None:
        f = _factors_of(op)
        if len(_BY_STRUCTURE) >= _STRUCTURES_KEPT:
            _BY_STRUCTURE.pop(next(iter(_BY_STRUCTURE)))
        _BY_STRUCTURE[shape] = f
    _FACTORS[key] = (weakref.ref(op, lambda _, key=key: _FACTORS.pop(key, None)), f)
    return f


def _factors_of(op: Op) -> OpFactors:
    fn = RULES.get(op.kind)
    if fn is None:
        raise RuleError(f"op {op.kind} has no sharding rule in nvtp/sharding/rules.py RULES; add one")
    f = fn(op)
    n_ops = len(tensor_operands(op))
    if len(f.operands) != n_ops or len(f.results) != len(op.outputs):
        raise AssertionError(f"rule for {op.kind} describes {len(f.operands)} operands / {len(f.results)} results, op has {n_ops} / {len(op.outputs)}")
    return f


# ---------------------------------------------------------------------------------------------
# elementwise


def _align(f: OpFactors, result_axes: list[int], shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[Axis]:
    """Right-aligned broadcasting: an operand axis shares the result axis' factor unless it is size 1."""
    offset = len(out_shape) - len(shape)
    return [(result_axes[offset + j],) if shape[j] == out_shape[offset + j] else () for j in range(len(shape))]


def _pointwise(op: Op) -> OpFactors:
    f = OpFactors()
    outs = [v for v in op.outputs]
    shape = outs[0].shape
    axes = [f.factor(n) for n in shape]
    f.results = [[(a,) for a in axes] for _ in outs]
    f.operands = [_align(f, axes, t.shape, shape) for t in tensor_operands(op)]
    return f


rule(*sorted(opstable.POINTWISE | {"stride_order"}))(_pointwise)


# ---------------------------------------------------------------------------------------------
# reductions


def _reduction(reduce_op: str | None):
    def build(op: Op) -> OpFactors:
        x = tensor_operands(op)[0]
        dims = op.arg("dims")
        dims = range(x.ndim) if dims is None else dims
        rdims = {norm_dim(d, x.ndim) for d in dims}
        keepdim = op.arg_dict.get("keepdim", False)
        f = OpFactors()
        axes = []
        for i, n in enumerate(x.shape):
            if i in rdims:
                axes.append(f.factor(n, "reduce", reduce_op) if reduce_op else f.factor(n, "blocked"))
            else:
                axes.append(f.factor(n))
        f.operands = [[(a,) for a in axes]]
        result = [(axes[i],) if i not in rdims else () for i in range(x.ndim) if keepdim or i not in rdims]
        f.results = [list(result) for _ in op.outputs]
        return f

    return build


rule("sum")(_reduction("sum"))
rule("max")(_reduction("max"))
rule("min")(_reduction("min"))
rule("prod", "var", "var_mean", "welford")(_reduction(None))


# ---------------------------------------------------------------------------------------------
# shape ops


@rule("broadcast_in_dim")
def _broadcast_in_dim(op: Op) -> OpFactors:
    x, out = tensor_operands(op)[0], op.outputs[0]
    f = OpFactors()
    axes = [f.factor(n) for n in out.shape]
    f.results = [[(a,) for a in axes]]
    bdims = op.arg("broadcast_dims")
    f.operands = [[(axes[d],) if x.shape[j] == out.shape[d] else () for j, d in enumerate(bdims)]]
    return f


@rule("expand")
def _expand(op: Op) -> OpFactors:
    x, out = tensor_operands(op)[0], op.outputs[0]
    f = OpFactors()
    axes = [f.factor(n) for n in out.shape]
    f.results = [[(a,) for a in axes]]
    f.operands = [[(axes[j],) if x.shape[j] == out.shape[j] else () for j in range(x.ndim)]]
    return f


@rule("broadcast")
def _broadcast(op: Op) -> OpFactors:
    out = op.outputs[0]
    f = OpFactors()
    axes = [f.factor(n) for n in out.shape]
    f.results = [[(a,) for a in axes]]
    f.operands = [[(axes[i],) for i, flag in enumerate(op.arg("is_broadcast_dim")) if not flag]]
    return f


@rule("squeeze")
def _squeeze(op: Op) -> OpFactors:
    x = tensor_operands(op)[0]
    dims = {norm_dim(d, x.ndim) for d in op.arg("dims")}
    f = OpFactors()
    axes = [f.factor(n) for n in x.shape]
    f.operands = [[(a,) if i not in dims else () for i, a in enumerate(axes)]]
    f.results = [[(a,) for i, a in enumerate(axes) if i not in dims]]
    return f


@rule("permute")
def _permute(op: Op) -> OpFactors:
    x = tensor_operands(op)[0]
    f = OpFactors()
    axes = [f.factor(n) for n in x.shape]
    f.operands = [[(a,) for a in axes]]
    f.results = [[(axes[norm_dim(d, x.ndim)],) for d in op.arg("dims")]]
    return f


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of source and destination axes with equal products (size-1 axes alone)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and not (j < len(dst) and dst[j] == 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and not (i < len(src) and src[i] == 1):
            groups.append(([], [j]))
            j += 1
            continue
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= src[i]
                gi.append(i)
                i += 1
            else:
                pj *= dst[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    return groups


def _refine(a: list[int], b: list[int]) -> list[int] | None:
    """The common refinement of two factorisations of one size, or None if there is none
    (e.g. [6, 4] and [4, 6]): the merged cut points must split both into integers."""
    def cuts(sizes):
        out, p = set(), 1
        for s in sizes[:-1]:
            p *= s
            out.add(p)
        return out

    total = 1
    for s in a:
        total *= s
    points = sorted(cuts(a) | cuts(b) | {total})
    sizes, prev = [], 1
    for p in points:
        if p % prev:
            return None
        sizes.append(p // prev)
        prev = p
    return sizes


@rule("reshape")
def _reshape(op: Op) -> OpFactors:
    x, out = tensor_operands(op)[0], op.outputs[0]
    f = OpFactors()
    src_axes: list[Axis] = [()] * x.ndim
    dst_axes: list[Axis] = [()] * out.ndim
    for gi, gj in reshape_groups(x.shape, out.shape):
        if not gi or not gj:
            continue  # a size-1 axis appears or disappears
        a, b = [x.shape[i] for i in gi], [out.shape[j] for j in gj]
        sizes = _refine(a, b) if all(s > 1 for s in a + b) else None
        if sizes is None or not _nested(a, sizes) or not _nested(b, sizes):
            # No common refinement: each side keeps one blocked factor per axis.
            for i in gi:
                src_axes[i] = (f.factor(x.shape[i], "blocked"),)
            for j in gj:
                dst_axes[j] = (f.factor(out.shape[j]),)
            continue
        ids = [f.factor(s) for s in sizes]
        _assign(src_axes, gi, a, ids, sizes)
        _assign(dst_axes, gj, b, ids, sizes)
    f.operands = [src_axes]
    f.results = [dst_axes]
    return f


def _nested(axes: list[int], sizes: list[int]) -> bool:
    """Each axis size is a product of consecutive refinement sizes."""
    k = 0
    for a in axes:
        p = 1
        while p < a and k < len(sizes):
            p *= sizes[k]
            k += 1
        if p != a:
            return False
    return k == len(sizes)


def _assign(target: list[Axis], positions: list[int], axes: list[int], ids: list[int], sizes: list[int]) -> None:
    k = 0
    for pos, a in zip(positions, axes):
        p, group = 1, []
        while p < a:
            p *= sizes[k]
            group.append(ids[k])
            k += 1
        target[pos] = tuple(group)


@rule("slice")
def _slice(op: Op) -> OpFactors:
    x, out = tensor_operands(op)[0], op.outputs[0]
    bounds = slice_bounds(x, op.arg("start_indices"), op.arg("end_indices"), op.arg("strides"))
    f = OpFactors()
    src, dst = [], []
    for n, m, (start, end, step) in zip(x.shape, out.shape, bounds):
        if (start, end, step) == (0, n, 1):
            a = f.factor(n)
            src.append((a,))
            dst.append((a,))
        elif step == 1 and m > 0 and n % m == 0 and start % m == 0:
            # One whole chunk of an axis seen as [n/m, m]: the chunk's factor passes through.
            sel, chunk = f.factor(n // m, "blocked"), f.factor(m)
            src.append((sel, chunk))
            dst.append((chunk,))
        else:
            src.append((f.factor(n, "blocked"),))
            dst.append((f.factor(m),))
    f.operands = [src]
    f.results = [dst]
    return f


@rule("pad")
def _pad(op: Op) -> OpFactors:
    x, out = tensor_operands(op)[0], op.outputs[0]
    pairs = pad_pairs(x.ndim, op.arg("pad_widths"))
    f = OpFactors()
    src, dst = [], []
    for n, m, pair in zip(x.shape, out.shape, pairs):
        if pair == (0, 0):
            a = f.factor(n)
            src.append((a,))
            dst.append((a,))
        else:
            src.append((f.factor(n, "blocked"),))
            dst.append((f.factor(m),))
    f.operands = [src]
    f.results = [dst]
    return f


@rule("cat")
def _cat(op: Op) -> OpFactors:
    ts, out = op.arg("tensors"), op.outputs[0]
    dim = norm_dim(op.arg("dim"), out.ndim)
    f = OpFactors()
    shared = [f.factor(n) if i != dim else None for i, n in enumerate(out.shape)]
    sizes = {t.shape[dim] for t in ts}
    if len(sizes) == 1 and sizes.pop() > 0:
        # Equal parts: the output axis is [k, part] and each input holds one part.
        sel, part = f.factor(len(ts), "blocked"), f.factor(ts[0].shape[dim])
        f.results = [[(sel, part) if i == dim else (a,) for i, a in enumerate(shared)]]
        f.operands = [[(part,) if i == dim else (a,) for i, a in enumerate(shared)] for _ in ts]
    else:
        f.results = [[(f.factor(n),) if i == dim else (a,) for i, (a, n) in enumerate(zip(shared, out.shape))]]
        f.operands = [[(f.factor(t.shape[dim], "blocked"),) if i == dim else (a,) for i, a in enumerate(shared)] for t in ts]
    return f


# ---------------------------------------------------------------------------------------------
# matmuls


@rule("linear")
def _linear(op: Op) -> OpFactors:
    x, w = op.arg("arg1"), op.arg("arg2")
    bias = op.arg("bias")
    f = OpFactors()
    batch = [f.factor(n) for n in x.shape[:-1]]
    k = f.factor(x.shape[-1], "reduce", "sum")
    f.operands = [[(b,) for b in batch] + [(k,)]]
    if w.ndim == 2:
        n = f.factor(w.shape[0])
        f.operands.append([(n,), (k,)])
        result = [(b,) for b in batch] + [(n,)]
        if bias is not None:
            f.operands.append([(n,)] if bias.ndim == 1 else [])
    else:
        f.operands.append([(k,)])
        result = [(b,) for b in batch]
        if bias is not None:
            f.operands.append([])
    f.results = [result]
    return f


@rule("matmul")
def _matmul(op: Op) -> OpFactors:
    a, b, out = op.arg("arg1"), op.arg("arg2"), op.outputs[0]
    f = OpFactors()
    k = f.factor(a.shape[-1], "reduce", "sum")
    if a.ndim == 1 and b.ndim == 1:
        f.operands, f.results = [[(k,)], [(k,)]], [[]]
        return f
    if b.ndim == 1:
        rows = [f.factor(n) for n in a.shape[:-1]]
        f.operands = [[(r,) for r in rows] + [(k,)], [(k,)]]
        f.results = [[(r,) for r in rows]]
        return f
    if a.ndim == 1:
        cols = [f.factor(n) for n in b.shape[:-2]] + [f.factor(b.shape[-1])]
        f.operands = [[(k,)], [(c,) for c in cols[:-1]] + [(k,), (cols[-1],)]]
        f.results = [[(c,) for c in cols]]
        return f
    batch_shape = out.shape[:-2]
    batch = [f.factor(n) for n in batch_shape]
    m, n = f.factor(a.shape[-2]), f.factor(b.shape[-1])
    f.operands = [
        _align(f, batch, a.shape[:-2], batch_shape) + [(m,), (k,)],
        _align(f, batch, b.shape[:-2], batch_shape) + [(k,), (n,)],
    ]
    f.results = [[(x,) for x in batch] + [(m,), (n,)]]
    return f


# ---------------------------------------------------------------------------------------------
# attention: batch and heads pass through; sequences and the head dim stay whole

# True while a context-parallel ("cp") axis is sharded (nvtp.sharding.axes.cp): there a
# self-attention's query and key/value sequences are one factor that may split, every rank
# keeping its queries while the K/V blocks travel the ring (nvtp.execute.ring).
RING: contextvars.ContextVar[bool] = contextvars.ContextVar("nvtp_ring_attention", default=False)


def _attention(op: Op, value_dim: str) -> tuple[OpFactors, list, list, list, list]:
    """The factors both attention ops share: batch and heads free; the sequences and the
    query/key head dim blocked (``value_dim``: how the value head dim may split). Returns them
    with the query, key, value and output layouts."""
    q, k, v = (op.arg(n) for n in ("query", "key", "value"))
    f = OpFactors()
    b, h = f.factor(q.shape[0]), f.factor(q.shape[1])
    sq = f.factor(q.shape[2], "pass" if RING.get() and q.shape[2] == k.shape[2] else "blocked")
    skv = sq if RING.get() and q.shape[2] == k.shape[2] else f.factor(k.shape[2], "blocked")
    e, ev = f.factor(q.shape[3], "blocked"), f.factor(v.shape[3], value_dim)
    return f, [(b,), (h,), (sq,), (e,)], [(b,), (h,), (skv,), (e,)], [(b,), (h,), (skv,), (ev,)], [(b,), (h,), (sq,), (ev,)]


@rule("sdpfa_fwd")
def _sdpfa_fwd(op: Op) -> OpFactors:
    f, qa, ka, va, out = _attention(op, "pass")
    f.operands = [qa, ka, va]
    f.results = [out, out[:3], [(f.factor(2, "blocked"),)], []]
    return f


@rule("sdpfa_bwd")
def _sdpfa_bwd(op: Op) -> OpFactors:
    f, qa, ka, va, out = _attention(op, "blocked")
    seed = f.factor(2, "blocked")
    # operands: grad_output, query, key, value, output, logsumexp, philox_seed, philox_offset
    f.operands = [out, qa, ka, va, out, out[:3], [(seed,)], []]
    f.results = [qa, ka, va]
    return f


# ---------------------------------------------------------------------------------------------
# factories: results computed in place, any axis may be sharded


@rule("iota", "full", "uniform", "normal")
def _factory(op: Op) -> OpFactors:
    out = op.outputs[0]
    f = OpFactors()
    f.results = [[(f.factor(n),) for n in out.shape]]
    f.operands = [[] for _ in tensor_operands(op)]
    return f


# ---------------------------------------------------------------------------------------------
# indexing


@rule("embedding_fwd")
def _embedding(op: Op) -> OpFactors:
    idx, w = op.arg("input"), op.arg("weight")
    f = OpFactors()
    batch = [f.factor(n) for n in idx.shape]
    vocab = f.factor(w.shape[0], "reduce", "sum")  # vocab-parallel: each rank looks up the rows it holds
    e = f.factor(w.shape[1])
    f.operands = [[(b,) for b in batch], [(vocab,), (e,)]]
    f.results = [[(b,) for b in batch] + [(e,)]]
    return f


@rule("take_along_axis")
def _take_along_axis(op: Op) -> OpFactors:
    x, idx = op.arg("arg"), op.arg("index")
    dim = norm_dim(op.arg("dim"), x.ndim)
    f = OpFactors()
    shared = [f.factor(n) if i != dim else None for i, n in enumerate(x.shape)]
    table = f.factor(x.shape[dim], "reduce", "sum")  # a sharded table gives each rank the entries it holds
    picked = f.factor(idx.shape[dim])
    f.operands = [
        [(table,) if i == dim else (a,) for i, a in enumerate(shared)],
        [(picked,) if i == dim else (a,) for i, a in enumerate(shared)],
    ]
    f.results = [[(picked,) if i == dim else (a,) for i, a in enumerate(shared)]]
    return f


@rule("index_select")
def _index_select(op: Op) -> OpFactors:
    """A table lookup: with the table split along ``dim`` each rank looks up the rows it holds
    (zero elsewhere), so the result is a partial sum (vocab-parallel embedding)."""
    x, idx = op.arg("arg"), op.arg("index")
    dim = norm_dim(op.arg("dim"), x.ndim)
    f = OpFactors()
    shared = [f.factor(n) if i != dim else None for i, n in enumerate(x.shape)]
    table = f.factor(x.shape[dim], "reduce", "sum")
    picked = f.factor(idx.shape[0])
    f.operands = [[(table,) if i == dim else (a,) for i, a in enumerate(shared)], [(picked,)]]
    f.results = [[(picked,) if i == dim else (a,) for i, a in enumerate(shared)]]
    return f


@rule("gather", "scatter")
def _indexing(op: Op) -> OpFactors:
    """Conservative: only axes other than ``dim`` that all tensors share pass through."""
    ts = tensor_operands(op)
    out = op.outputs[0]
    dim = norm_dim(op.arg("dim"), out.ndim)
    f = OpFactors()
    axes = []
    for i, n in enumerate(out.shape):
        same = all(t.ndim == out.ndim and t.shape[i] == n for t in ts) and i != dim
        axes.append(f.factor(n) if same else None)
    f.operands = [[(axes[i],) if axes[i] is not None else (f.factor(t.shape[i], "blocked"),) for i in range(t.ndim)] if t.ndim == out.ndim
                  else [(f.factor(n, "blocked"),) for n in t.shape] for t in ts]
    f.results = [[(a,) if a is not None else (f.factor(n),) for a, n in zip(axes, out.shape)]]
    return f
