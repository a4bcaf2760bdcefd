"""Op patterns the reference backend runs as one torch kernel: LayerNorm, tanh-GELU and softmax,
forward and backward, as Thunder decomposes them into nvFuser's primitive ops.

Eager PyTorch calls ``F.layer_norm``; Thunder hands nvtp ``var_mean``, eight broadcasts and
five pointwise ops, and for the backward some thirty more. Each pattern is a small fx graph of op
kinds (written below with ``Builder``, in the order Thunder emits the ops), matched by fx's own
``SubgraphMatcher`` against a lowered fusion (``lower.py``); a *check* (shapes, reduced axes,
constants, placements: the kernel must compute what the ops compute, on this rank's parts); and
a *kernel*, the torch call eager PyTorch itself makes.

A matched op whose value is read outside the match stays, and so do the ops it needs; every
other matched op goes (``fuse`` adds the kernel and removes what nothing reads any more). A
pattern that no longer matches (another Thunder version, another decomposition) costs speed,
never correctness: the ops then run one by one.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher

from nvtp.execute.lower import kind_target
from nvtp.ir.graph import Op, TensorValue, Value
from nvtp.sharding.placements import Placement, axis_split, is_partial

# ---------------------------------------------------------------------------------------------
# writing patterns


class Builder:
    """Writes a pattern graph: ``b.add(x, 1.0)`` is an ``add`` op node, ``b.leaf("x")`` an input;
    ``name=`` names a node for the check (``m["name"]``)."""

    def __init__(self):
        self.graph = fx.Graph()
        self.named: dict[str, fx.Node] = {}

    def leaf(self, name: str) -> fx.Node:
        return self._name(self.graph.placeholder(name), name)

    def op(self, kind: str, *args: Any, name: str | None = None) -> fx.Node:
        return self._name(self.graph.call_function(kind_target(kind), args), name)

    def get(self, node: fx.Node, i: int, name: str) -> fx.Node:
        """Result ``i`` of a multi-result op."""
        return self._name(self.graph.call_function(operator.getitem, (node, i)), name)

    def bcast(self, x: fx.Node, depth: int = 1, name: str | None = None) -> fx.Node:
        """``depth`` chained ``broadcast_in_dim`` ops."""
        for _ in range(depth):
            x = self.op("broadcast_in_dim", x)
        return self._name(x, name)

    def __getattr__(self, kind: str) -> Callable[..., fx.Node]:
        return lambda *args, name=None: self.op(kind, *args, name=name)

    def _name(self, node: fx.Node, name: str | None) -> fx.Node:
        if name:
            self.named[name] = node
        return node

    def done(self, root: fx.Node) -> "Builder":
        self.graph.output(root)
        return self


@dataclass
class Match:
    """A pattern bound to a lowered fusion: ``m["x"]`` is the value (or literal) node x bound."""

    nodes: dict[fx.Node, Any]  # pattern node -> graph node (or literal)
    named: dict[str, fx.Node]
    local_shape: Callable[[Value], tuple[int, ...]]
    placements: Callable[[Value], tuple[Placement, ...] | None] = lambda v: None  # on every mesh axis (None: whole)
    producer: Callable[[Value], Op | None] = lambda v: None  # the fusion's op that makes a value (folded ones too)

    def node(self, name: str) -> Any:
        return self.nodes[self.named[name]]

    def __getitem__(self, name: str) -> Any:
        n = self.node(name)
        return n.meta["value"] if isinstance(n, fx.Node) else n

    def op_of(self, name: str) -> Op:
        n = self.node(name)
        return n.args[0].meta["op"] if n.target is operator.getitem else n.meta["op"]

    def values(self) -> list[Value]:
        """Every value the match binds (leaves and op results)."""
        return [n.meta["value"] for n in self.nodes.values() if isinstance(n, fx.Node) and "value" in n.meta]

    def chain(self, top: str, bottom: str) -> list[int] | None:
        """Which axis of ``top`` each axis of ``bottom`` becomes through the broadcasts between them."""
        n, stop, dims = self.node(top), self.node(bottom), None
        while n is not stop:
            op = n.meta.get("op")
            if op is None or op.kind != "broadcast_in_dim":
                return None
            here = list(op.arg("broadcast_dims"))
            dims = here if dims is None else [dims[d] for d in here]
            n = n.args[0]
        return dims if dims is not None else list(range(len(self[top].shape)))


# ---------------------------------------------------------------------------------------------
# checks shared by the patterns


def no_partial(m: Match) -> bool:
    """No value ``m`` binds is a partial sum on any mesh axis."""
    return not any(p is not None and is_partial(p) for v in m.values() for p in m.placements(v) or ())


def unsplit(m: Match, v: Value, axes) -> bool:
    """``v`` is no partial sum and is split along none of ``axes``, on every mesh axis."""
    for p in m.placements(v) or ():
        if p is None:
            continue
        if is_partial(p):
            return False
        split = axis_split(p)
        if split is not None and split[0] in axes:
            return False
    return True


def same_float(*vs: Value) -> bool:
    return all(isinstance(v, TensorValue) and v.dtype.is_float for v in vs) and len({v.dtype for v in vs}) == 1


def reduced(o: Op, ndim: int) -> set[int]:
    dims = o.arg("dims")
    return set(range(ndim)) if dims is None else {d % ndim for d in dims}


# ---------------------------------------------------------------------------------------------
# the patterns


@dataclass
class Pattern:
    name: str
    built: Builder
    check: Callable[[Match], tuple[list[str], dict[str, str], Callable[..., dict[str, torch.Tensor]]] | None]
    # check -> (leaf names, {exported node name: kernel result key}, kernel), or None: no fusing

    @functools.cached_property
    def matcher(self) -> "_Matcher":
        return _Matcher(self.built.graph, remove_overlapping_matches=True)


PATTERNS: list[Pattern] = []


def pattern(name: str, built: Builder, table: list[Pattern] = PATTERNS):
    def deco(check):
        table.append(Pattern(name, built, check))
        return check

    return deco


# LayerNorm forward: var_mean, rsqrt(var + eps), (x - mean) * rstd * w + b ----------------------

def _layer_norm_pattern(bias: bool) -> Builder:
    b = Builder()
    x, w = b.leaf("x"), b.leaf("w")
    vm = b.var_mean(x)
    var, mean = b.get(vm, 0, "var"), b.get(vm, 1, "mean")
    b.bcast(var, name="var_k")
    rstd = b.rsqrt(b.add(b.named["var_k"], b.leaf("eps")), name="rstd")
    mean_k = b.bcast(mean, name="mean_k")
    xhat = b.mul(b.sub(x, b.bcast(mean_k, name="mean_full")), b.bcast(rstd, name="rstd_full"))
    y = b.mul(xhat, b.bcast(w, name="w_full"), name="y" if not bias else None)
    return b.done(b.add(y, b.bcast(b.leaf("b"), name="b_full"), name="y") if bias else y)


def _layer_norm_check(m: Match, bias: bool):
    x, w = m["x"], m["w"]
    vm = m.op_of("mean")
    if not same_float(x, w, m["mean"]) or (bias and not same_float(x, m["b"])) or not no_partial(m) or isinstance(m["eps"], Value):
        return None
    if vm.arg("correction") != 0 or vm.arg("keepdim"):
        return None
    axes = sorted(reduced(vm, x.ndim))
    k = x.ndim - len(axes)
    if not axes or axes != list(range(k, x.ndim)) or not unsplit(m, x, axes):
        return None
    norm = tuple(x.shape[k:])
    lead, trail = list(range(k)), list(range(k, x.ndim))
    if w.shape != norm or m.chain("w_full", "w") != trail or (bias and (m["b"].shape != norm or m.chain("b_full", "b") != trail)):
        return None
    if m.chain("var_k", "var") != lead or tuple(m["var_k"].shape) != tuple(x.shape[:k]) + (1,) * len(norm):
        return None
    if m.chain("mean_full", "mean") != lead or tuple(m["mean_full"].shape) != tuple(x.shape):
        return None
    if tuple(m["rstd_full"].shape) != tuple(x.shape) or m.chain("rstd_full", "rstd") != list(range(x.ndim)):
        return None
    eps = float(m["eps"])
    mean_shape, mean_k_shape = m.local_shape(m["mean"]), m.local_shape(m["mean_k"])

    def kernel(x, w, b=None):
        y, mean, rstd = torch.native_layer_norm(x, norm, w, b, eps)
        return {"y": y, "rstd": rstd, "mean": mean.reshape(mean_shape), "mean_k": mean.reshape(mean_k_shape)}

    exports = {"y": "y", "rstd": "rstd", "mean": "mean", "mean_k": "mean_k"}
    return (["x", "w", "b"] if bias else ["x", "w"]), exports, kernel


pattern("layer_norm", _layer_norm_pattern(bias=True))(lambda m: _layer_norm_check(m, True))
pattern("layer_norm", _layer_norm_pattern(bias=False))(lambda m: _layer_norm_check(m, False))


# LayerNorm backward (input gradient), from the saved mean and rstd ----------------------------

def _layer_norm_backward_pattern(residual: bool, depth: int) -> Builder:
    """``depth``: the broadcasts that put the per-row sums s3 and s4 back on the rows (2, or 3
    where a size-1 leading axis was summed away too)."""
    b = Builder()
    x, dy, mean, rstd, w = (b.leaf(n) for n in ("x", "dy", "mean", "rstd", "w"))
    b.bcast(mean, 2, name="mean_full")
    b.bcast(w, name="w_full")
    dxhat = b.mul(b.named["w_full"], dy)
    xmu = b.sub(x, b.named["mean_full"], name="xmu")
    s1 = b.sum(b.mul(xmu, dxhat), name="s1")
    rd = b.mul(b.bcast(rstd, name="rstd_full"), dxhat)
    dvar = b.mul(b.mul(-0.5, b.bcast(s1, name="s1_top")), b.pow(rstd, 3.0))
    s2 = b.sum(b.neg(rd), name="s2")
    s3 = b.sum(dvar, name="s3")
    s4 = b.sum(b.bcast(s2, name="s2_top"), name="s4")
    var_term = b.div(b.mul(b.mul(2.0, b.bcast(s3, depth, name="s3_top")), xmu), b.leaf("n"))
    mean_term = b.mul(b.leaf("inv_n"), b.bcast(s4, depth, name="s4_top"))
    tail = b.add(mean_term, var_term)
    if residual:
        return b.done(b.add(b.add(b.leaf("g"), rd), tail, name="dx"))
    return b.done(b.add(rd, tail, name="dx"))


def _layer_norm_backward_check(m: Match, residual: bool):
    x, dy, mean, rstd, w = (m[n] for n in ("x", "dy", "mean", "rstd", "w"))
    if not same_float(x, dy, mean, rstd, w) or (residual and not same_float(x, m["g"])) or not no_partial(m):
        return None
    if x.shape != dy.shape or m.local_shape(x) != m.local_shape(dy) or (residual and m.local_shape(m["g"]) != m.local_shape(x)):
        return None
    ndim, k = x.ndim, mean.ndim
    if k >= ndim or tuple(mean.shape) != tuple(x.shape[:k]) or tuple(rstd.shape) != tuple(x.shape[:k]) + (1,) * (ndim - k):
        return None
    norm = tuple(x.shape[k:])
    axes = list(range(k, ndim))
    if w.shape != norm or m.chain("w_full", "w") != axes or m.chain("mean_full", "mean") != list(range(k)):
        return None
    if m.chain("rstd_full", "rstd") != list(range(ndim)) or tuple(m["mean_full"].shape) != tuple(x.shape):
        return None
    n = math.prod(norm)
    if isinstance(m["n"], Value) or isinstance(m["inv_n"], Value) or float(m["n"]) != float(n) or \
            not math.isclose(float(m["inv_n"]), 1.0 / n, rel_tol=1e-12):
        return None
    for s, whole in (("s1", True), ("s2", True), ("s3", False), ("s4", False)):
        if not _row_sum(m, s, k, whole):
            return None
    if not all(unsplit(m, v, axes) for v in (x, dy, w)):
        return None
    rows = m.local_shape(mean)
    backward = torch.ops.aten.native_layer_norm_backward.default

    def kernel(x, dy, mean, rstd, w, g=None):
        mean = mean.reshape(rows + (1,) * len(norm))
        dx = backward(dy, x, norm, mean, rstd, w, None, [True, False, False])[0]
        return {"dx": dx if g is None else g + dx}

    return ["x", "dy", "mean", "rstd", "w"] + (["g"] if residual else []), {"dx": "dx"}, kernel


def _row_sum(m: Match, name: str, k: int, whole: bool) -> bool:
    """``name`` sums an [rows..., normalized...] operand to per-row numbers, and its broadcast
    (``<name>_top``) puts them back on the rows: the operand is whole along the normalized axes
    (``whole``) or has size 1 there, every other summed axis has size 1."""
    o = m.op_of(name)
    arg = o.arg("arg")
    ndim = m["x"].ndim
    if arg.ndim != ndim or o.arg("keepdim"):
        return False
    red = reduced(o, ndim)
    norm = set(range(k, ndim))
    if whole and (not norm <= red or tuple(arg.shape[k:]) != tuple(m["x"].shape[k:])):
        return False
    if not whole and any(arg.shape[d] != 1 for d in norm):
        return False
    if any(arg.shape[d] != 1 for d in red - norm):
        return False
    kept = [d for d in range(ndim) if d not in red]
    top = m[f"{name}_top"]
    return top.ndim == ndim and m.chain(f"{name}_top", name) == kept and all(top.shape[d] == m["x"].shape[d] for d in range(k))


for _depth in (2, 3):
    pattern("layer_norm_backward", _layer_norm_backward_pattern(True, _depth))(lambda m: _layer_norm_backward_check(m, True))
    pattern("layer_norm_backward", _layer_norm_backward_pattern(False, _depth))(lambda m: _layer_norm_backward_check(m, False))


# tanh-GELU, forward and backward ---------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def _gelu_inner(b: Builder, x: fx.Node, x2: fx.Node) -> fx.Node:
    return b.tanh(b.mul(_SQRT_2_OVER_PI, b.add(x, b.mul(_KAPPA, b.mul(x2, x)))))


def _gelu_pattern() -> Builder:
    b = Builder()
    x = b.leaf("x")
    t = _gelu_inner(b, x, b.mul(x, x))
    return b.done(b.mul(b.mul(0.5, x), b.add(1.0, t), name="y"))


def _gelu_backward_pattern() -> Builder:
    b = Builder()
    x, g = b.leaf("x"), b.leaf("g")
    x2 = b.mul(x, x)
    t = _gelu_inner(b, x, x2)
    d_inner = b.mul(_SQRT_2_OVER_PI, b.mul(b.mul(b.mul(0.5, x), g), b.sub(1.0, b.mul(t, t))))
    outer = b.mul(0.5, b.mul(b.add(1.0, t), g))
    c = b.mul(_KAPPA, d_inner)
    h = b.mul(x, b.mul(x, c))
    return b.done(b.add(b.add(b.add(b.add(d_inner, outer), b.mul(x2, c)), h), h, name="dx"))


@pattern("gelu", _gelu_pattern())
def _gelu_check(m: Match):
    if not same_float(m["x"]) or not no_partial(m) or m.local_shape(m["x"]) != m.local_shape(m["y"]):
        return None
    return ["x"], {"y": "y"}, lambda x: {"y": F.gelu(x, approximate="tanh")}


@pattern("gelu_backward", _gelu_backward_pattern())
def _gelu_backward_check(m: Match):
    x, g = m["x"], m["g"]
    if not same_float(x, g) or not no_partial(m) or m.local_shape(x) != m.local_shape(g) or m.local_shape(x) != m.local_shape(m["dx"]):
        return None
    backward = torch.ops.aten.gelu_backward.default
    return ["x", "g"], {"dx": "dx"}, lambda x, g: {"dx": backward(g, x, approximate="tanh")}


# softmax, forward and backward -----------------------------------------------------------------

def _softmax_pattern() -> Builder:
    b = Builder()
    s = b.leaf("s")
    e = b.exp(b.sub(s, b.bcast(b.max(s, name="max"), 2, name="max_full")), name="e")
    return b.done(b.div(e, b.bcast(b.sum(e, name="sum"), 2, name="sum_full"), name="p"))


def _softmax_backward_pattern() -> Builder:
    b = Builder()
    p, dp = b.leaf("p"), b.leaf("grad_p")
    s = b.sum(b.mul(p, dp), name="sum")
    return b.done(b.mul(p, b.sub(dp, b.bcast(s, 2, name="sum_full")), name="dx"))


def _softmax_axis(m: Match, src: str, full_of: Mapping[str, str]) -> int | None:
    s = m[src]
    axis = None
    for red, full in full_of.items():
        o = m.op_of(red)
        dims = reduced(o, s.ndim)
        if len(dims) != 1 or o.arg("keepdim") or tuple(m[full].shape) != tuple(s.shape):
            return None
        (d,) = dims
        if axis not in (None, d) or m.chain(full, red) != [i for i in range(s.ndim) if i != d]:
            return None
        axis = d
    return axis


@pattern("softmax", _softmax_pattern())
def _softmax_check(m: Match):
    s = m["s"]
    axis = _softmax_axis(m, "s", {"max": "max_full", "sum": "sum_full"})
    if axis is None or not same_float(s, m["p"]) or not no_partial(m) or not unsplit(m, s, [axis]):
        return None
    return ["s"], {"p": "p"}, lambda s: {"p": torch.softmax(s, axis)}


@pattern("softmax_backward", _softmax_backward_pattern())
def _softmax_backward_check(m: Match):
    p, dp = m["p"], m["grad_p"]
    axis = _softmax_axis(m, "p", {"sum": "sum_full"})
    if axis is None or not same_float(p, dp) or not no_partial(m) or not unsplit(m, p, [axis]):
        return None
    if p.shape != dp.shape or m.local_shape(p) != m.local_shape(dp):
        return None
    dtype = p.dtype.torch
    return ["p", "grad_p"], {"dx": "dx"}, lambda p, grad_p: {"dx": torch._softmax_backward_data(grad_p, p, axis, dtype)}


# ---------------------------------------------------------------------------------------------
# fusing a lowered graph


class _Matcher(SubgraphMatcher):
    """fx's matcher, also finding matches whose inner values are read elsewhere (``fuse`` keeps
    the ops that make those)."""

    def _is_contained(self, nodes_map) -> bool:
        return True


def fuse(graph: fx.Graph, local_shape: Callable[[Value], tuple[int, ...]], sharding: Callable[[Value], Any],
         dtype: Callable[[Any], torch.dtype], patterns: list[Pattern] | None = None,
         producer: Callable[[Value], Op | None] = lambda v: None,
         kept: Callable[[fx.Node], bool] = lambda n: False) -> dict[str, int]:
    """Replace each match of ``patterns`` in ``graph`` (the matching form of ``lower.lower``) by
    one call of its kernel; returns how many times each pattern fused. ``sharding(v)``: the
    placements of ``v`` (None: whole); ``dtype``: the run's torch dtype of a declared dtype;
    ``producer(v)``: the op that makes ``v`` (a check may read how a folded constant was made);
    ``kept(node)``: an op node no kernel may take (it must run as its own op: an ep axis's expert rows)."""
    counts: dict[str, int] = {}
    for pat in patterns if patterns is not None else PATTERNS:
        matcher = pat.matcher
        stale = True
        while stale:  # again while a match read a value an earlier one replaced
            stale = False
            for found in matcher.match(graph):
                if any(getattr(n, "_erased", False) for n in found.nodes_map.values() if isinstance(n, fx.Node)):
                    stale = True
                    continue
                if any(kept(n) for p, n in found.nodes_map.items() if p.op not in ("placeholder", "output") and isinstance(n, fx.Node)):
                    continue
                m = Match(found.nodes_map, pat.built.named, local_shape, sharding, producer)
                try:
                    made = pat.check(m)
                except (KeyError, TypeError, ValueError, AttributeError):
                    made = None
                if made is not None and _replace(graph, pat.name, m, found, made, dtype):
                    counts[pat.name] = counts.get(pat.name, 0) + 1
    return counts


def _replace(graph: fx.Graph, name: str, m: Match, found: InternalMatch, made, dtype) -> bool:
    leaves, exports, kernel = made
    order = {n: i for i, n in enumerate(graph.nodes)}
    leaf_nodes = [m.node(n) for n in leaves]
    if not all(isinstance(n, fx.Node) for n in leaf_nodes):
        return False
    last = max(leaf_nodes, key=order.__getitem__)
    replaced = {m.node(n): key for n, key in exports.items()}
    inner = {n for p, n in found.nodes_map.items() if p.op not in ("placeholder", "output") and isinstance(n, fx.Node)}
    if any(order[u] <= order[last] for n in replaced for u in n.users if u not in inner):
        return False  # a reader of a result comes before the kernel's operands are ready
    want = {key: dtype(n.meta["value"].dtype) for n, key in replaced.items()}

    def fused(*args):
        out = kernel(*args)
        return {k: r if r.dtype == want[k] else r.to(want[k]) for k, r in out.items() if k in want}

    fused.__name__ = fused.__qualname__ = f"torch_{name}"
    with graph.inserting_after(last):
        call = graph.call_function(fused, tuple(leaf_nodes))
    anchor = call
    for n, key in replaced.items():
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (call, key), name=f"{n.name}_")
        anchor.meta["value"] = n.meta["value"]
        # The match's own ops before the kernel (a cast of the count the loss divides by, made
        # where the targets are) keep reading the old value; they are erased below with the rest.
        n.replace_all_uses_with(anchor, delete_user_cb=lambda user: user not in inner or order[user] > order[last])
    for n in sorted(inner, key=order.__getitem__, reverse=True):  # the matched ops nothing reads any more
        if not n.users:
            graph.erase_node(n)
    return True
