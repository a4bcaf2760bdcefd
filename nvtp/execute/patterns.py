"""Op patterns the reference backend runs as one torch kernel: LayerNorm, tanh-GELU and softmax,
forward and backward, as Thunder decomposes them into nvFuser's primitive ops.

Eager PyTorch calls ``F.layer_norm``; Thunder hands nvtp ``var_mean``, eight broadcasts and
five pointwise ops, and for the backward some thirty more. Each pattern here is a *template*
(the op graph Thunder emits, written with the helpers below), a *check* (shapes, reduced axes,
constants, placements: the fused kernel must compute what the ops compute, on this rank's
parts), and a *kernel* (the torch call eager PyTorch itself makes). ``find`` matches the
templates against a program's ops and says which ops a fused step replaces.

A template matches structurally: ``mul`` and ``add`` in either operand order, ``bcast(x)`` one
or more ``broadcast_in_dim`` ops, a node used twice must bind the same value twice. A fused
step reads only the template's leaves and writes the values its kernel gives (``exports``);
a matched op whose value something else still reads, and which the kernel cannot give, stays.
A template that no longer matches (another Thunder version, another decomposition) costs speed,
never correctness: the ops then run one by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn.functional as F

from nvtp.ir.graph import Op, TensorValue, Value, is_value
from nvtp.sharding.placements import Placement, axis_split, is_partial

# ---------------------------------------------------------------------------------------------
# templates

_LEAF, _CONST, _BCAST = "<leaf>", "<const>", "<bcast>"
_OPERAND_ARGS = {"add": ("lhs", "rhs"), "sub": ("lhs", "rhs"), "mul": ("lhs", "rhs"), "div": ("lhs", "rhs"),
                 "pow": ("lhs", "rhs"), "where": ("condition", "x", "y")}
_COMMUTATIVE = {"add", "mul"}


class Node:
    """A template node: an op (with operand nodes), a leaf, a constant or a broadcast chain."""

    __slots__ = ("kind", "operands", "name", "out", "value")

    def __init__(self, kind: str, operands: tuple = (), name: str | None = None, out: int = 0, value: Any = None):
        self.kind, self.operands, self.name, self.out, self.value = kind, operands, name, out, value


def leaf(name: str) -> Node:
    return Node(_LEAF, name=name)


def const(value: float | None = None, name: str | None = None) -> Node:
    """A literal number in the op's arguments (any number when ``value`` is None)."""
    return Node(_CONST, name=name, value=value)


def bcast(x: Node, name: str | None = None) -> Node:
    """One or more ``broadcast_in_dim`` ops applied to ``x``."""
    return Node(_BCAST, (x,), name)


def op(kind: str, *operands: Node | float, name: str | None = None, out: int = 0) -> Node:
    return Node(kind, tuple(o if isinstance(o, Node) else const(o) for o in operands), name, out)


def add(a, b, name=None): return op("add", a, b, name=name)  # noqa: E704 - a table of one-liners
def sub(a, b, name=None): return op("sub", a, b, name=name)  # noqa: E704
def mul(a, b, name=None): return op("mul", a, b, name=name)  # noqa: E704
def div(a, b, name=None): return op("div", a, b, name=name)  # noqa: E704
def reduce(kind, a, name): return op(kind, a, name=name)  # noqa: E704


# ---------------------------------------------------------------------------------------------
# matching


class _Graph:
    """What the matcher may look through: the ops still in the program, by the values they make."""

    def __init__(self, live: Mapping[int, Op]):
        self.producer: dict[str, tuple[int, Op]] = {v.name: (i, o) for i, o in live.items() for v in o.outputs}


_OPS = "<ops>"


def _match(node: Node, x: Any, b: dict, g: _Graph) -> Iterator[dict]:
    k = node.kind
    key = id(node)
    if k == _CONST:
        if is_value(x) or isinstance(x, bool) or not isinstance(x, (int, float)):
            return
        if node.value is not None and not math.isclose(x, node.value, rel_tol=1e-12, abs_tol=0.0):
            return
        yield {**b, key: x}
        return
    if not is_value(x):
        return
    if key in b:  # a node used twice binds one value
        if b[key].name == x.name:
            yield b
        return
    if k == _LEAF:
        yield {**b, key: x}
        return
    found = g.producer.get(x.name)
    if found is None:
        return
    index, o = found
    if k == _BCAST:
        if o.kind != "broadcast_in_dim":
            return
        b = {**b, key: x, _OPS: b[_OPS] + (index,)}
        inner = o.arg("arg")
        yield from _match(node.operands[0], inner, b, g)
        if is_value(inner) and inner.name in g.producer and g.producer[inner.name][1].kind == "broadcast_in_dim":
            yield from _match(Node(_BCAST, node.operands), inner, b, g)  # a longer chain
        return
    if o.kind != k or node.out >= len(o.outputs) or o.outputs[node.out].name != x.name:
        return
    b = {**b, key: x, _OPS: b[_OPS] + (index,)}
    args = [o.arg(n) for n in _OPERAND_ARGS.get(k, ("arg",))]
    orders = [args, args[::-1]] if k in _COMMUTATIVE else [args]
    for a in orders:
        yield from _match_all(node.operands, a, b, g)


def _match_all(nodes: tuple, xs: list, b: dict, g: _Graph) -> Iterator[dict]:
    if len(nodes) != len(xs):
        return
    if not nodes:
        yield b
        return
    for b1 in _match(nodes[0], xs[0], b, g):
        yield from _match_all(nodes[1:], xs[1:], b1, g)


def _named(root: Node) -> dict[str, Node]:
    out: dict[str, Node] = {}
    stack = [root]
    while stack:
        n = stack.pop()
        if n.name and n.name not in out:
            out[n.name] = n
        stack.extend(o for o in n.operands if isinstance(o, Node))
    return out


def _leaves(root: Node) -> list[Node]:
    seen, out, stack = set(), [], [root]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.kind == _LEAF:
            out.append(n)
        stack.extend(o for o in n.operands if isinstance(o, Node))
    return out


@dataclass
class Match:
    """A template bound to a program's values: ``m["x"]`` is the value (or literal) node x bound."""

    pattern: "Pattern"
    bindings: dict
    ops: dict[int, Op]
    local_shape: Callable[[Value], tuple[int, ...]]
    sharding: Callable[[Value], Placement | None]

    def __getitem__(self, name: str) -> Any:
        return self.bindings[id(self.pattern.named[name])]

    def op_of(self, name: str) -> Op:
        v = self[name]
        for o in self.ops.values():
            if any(out.name == v.name for out in o.outputs):
                return o
        raise KeyError(name)

    def values(self) -> list[Value]:
        """Every value the match binds (leaves and op results)."""
        return [x for k, x in self.bindings.items() if k != _OPS and is_value(x)]


# ---------------------------------------------------------------------------------------------
# checks shared by the patterns


def _bcast_map(m: Match, top: Value, bottom: Value) -> list[int] | None:
    """Which axis of ``top`` each axis of ``bottom`` becomes through the broadcast chain between them."""
    producer = {o.outputs[0].name: o for o in m.ops.values()}
    dims: list[int] | None = None
    v = top
    while v.name != bottom.name:
        o = producer.get(v.name)
        if o is None or o.kind != "broadcast_in_dim":
            return None
        here = list(o.arg("broadcast_dims"))
        dims = here if dims is None else [dims[d] for d in here]
        v = o.arg("arg")
    return dims if dims is not None else list(range(len(top.shape)))


def _chain(m: Match, top_name: str, bottom_name: str) -> list[int] | None:
    return _bcast_map(m, m[top_name], m[bottom_name])


def _no_partial(m: Match) -> bool:
    return not any(p is not None and is_partial(p) for p in map(m.sharding, m.values()))


def _unsplit(m: Match, v: Value, axes) -> bool:
    p = m.sharding(v)
    if p is None:
        return True
    if is_partial(p):
        return False
    split = axis_split(p)
    return split is None or split[0] not in axes


def _float(*vs: Value) -> bool:
    return all(isinstance(v, TensorValue) and v.dtype.is_float for v in vs) and len({v.dtype for v in vs}) == 1


def _reduced(o: Op, ndim: int) -> set[int]:
    dims = o.arg("dims")
    return set(range(ndim)) if dims is None else {d % ndim for d in dims}


# ---------------------------------------------------------------------------------------------
# the patterns


@dataclass
class Pattern:
    name: str
    root: Node
    kernel: Callable[[Match], tuple[list[str], Callable[..., dict[str, torch.Tensor]]]]
    exports: tuple[str, ...]
    in_place: dict[str, str]  # export -> the leaf the kernel may overwrite with it (kernel(..., out=leaf))
    named: dict[str, Node] = field(init=False)
    leaves: list[Node] = field(init=False)

    def __post_init__(self):
        self.named = _named(self.root)
        self.leaves = _leaves(self.root)


PATTERNS: list[Pattern] = []


def pattern(name: str, root: Node, exports: tuple[str, ...], in_place: dict[str, str] | None = None):
    """Register a pattern; the decorated function checks a match and returns (leaves, kernel)."""

    def deco(fn):
        PATTERNS.append(Pattern(name, root, fn, exports, in_place or {}))
        return fn

    return deco


# LayerNorm forward: var_mean, rsqrt(var + eps), (x - mean) * rstd * w + b ----------------------

def _layer_norm_template(bias: bool) -> Node:
    x, w = leaf("x"), leaf("w")
    var = op("var_mean", x, name="var", out=0)
    mean = op("var_mean", x, name="mean", out=1)
    rstd = op("rsqrt", add(bcast(var, name="var_k"), const(name="eps")), name="rstd")
    mean_k = bcast(mean, name="mean_k")
    xhat = mul(sub(x, bcast(mean_k, name="mean_full")), bcast(rstd, name="rstd_full"))
    y = mul(xhat, bcast(w, name="w_full"), name="y" if not bias else None)
    return add(y, bcast(leaf("b"), name="b_full"), name="y") if bias else y


def _layer_norm_check(m: Match, bias: bool):
    x, w = m["x"], m["w"]
    vm = m.op_of("mean")
    if not _float(x, w, m["mean"]) or (bias and not _float(x, m["b"])) or not _no_partial(m):
        return None
    if m.op_of("var").outputs[0].name != vm.outputs[0].name or vm.arg("correction") != 0 or vm.arg("keepdim"):
        return None
    axes = sorted(_reduced(vm, x.ndim))
    k = x.ndim - len(axes)
    if not axes or axes != list(range(k, x.ndim)) or not _unsplit(m, x, axes):
        return None
    norm = tuple(x.shape[k:])
    lead = list(range(k))
    trail = list(range(k, x.ndim))
    if w.shape != norm or _chain(m, "w_full", "w") != trail or (bias and (m["b"].shape != norm or _chain(m, "b_full", "b") != trail)):
        return None
    if _chain(m, "var_k", "var") != lead or tuple(m["var_k"].shape) != tuple(x.shape[:k]) + (1,) * len(norm):
        return None
    if _chain(m, "mean_full", "mean") != lead or tuple(m["mean_full"].shape) != tuple(x.shape):
        return None
    if tuple(m["rstd_full"].shape) != tuple(x.shape) or tuple(m["rstd"].shape) != tuple(x.shape[:k]) + (1,) * len(norm):
        return None
    eps = float(m["eps"])
    mean_shape = m.local_shape(m["mean"])
    mean_k_shape = m.local_shape(m["mean_k"])

    def kernel(x, w, b=None):
        y, mean, rstd = torch.native_layer_norm(x, norm, w, b, eps)
        return {"y": y, "rstd": rstd, "mean": mean.reshape(mean_shape), "mean_k": mean.reshape(mean_k_shape)}

    return (["x", "w", "b"] if bias else ["x", "w"]), kernel


pattern("layer_norm", _layer_norm_template(bias=True), ("y", "rstd", "mean", "mean_k"))(lambda m: _layer_norm_check(m, True))
pattern("layer_norm", _layer_norm_template(bias=False), ("y", "rstd", "mean", "mean_k"))(lambda m: _layer_norm_check(m, False))


# LayerNorm backward (input gradient), from the saved mean and rstd ----------------------------

def _layer_norm_backward_template(residual: bool) -> Node:
    x, dy, mean, rstd, w = leaf("x"), leaf("dy"), leaf("mean"), leaf("rstd"), leaf("w")
    xmu = sub(x, bcast(mean, name="mean_full"), name="xmu")
    dxhat = mul(bcast(w, name="w_full"), dy)
    rd = mul(bcast(rstd, name="rstd_full"), dxhat)
    s1 = reduce("sum", mul(xmu, dxhat), "s1")
    dvar = mul(mul(-0.5, bcast(s1, name="s1_top")), op("pow", rstd, 3.0))
    s3 = reduce("sum", dvar, "s3")
    var_term = div(mul(mul(2.0, bcast(s3, name="s3_top")), xmu), const(name="n"))
    s2 = reduce("sum", op("neg", rd), "s2")
    s4 = reduce("sum", bcast(s2, name="s2_top"), "s4")
    mean_term = mul(const(name="inv_n"), bcast(s4, name="s4_top"))
    tail = add(mean_term, var_term)
    if residual:
        return add(add(leaf("g"), rd), tail, name="dx")
    return add(rd, tail, name="dx")


def _layer_norm_backward_check(m: Match, residual: bool):
    x, dy, mean, rstd, w = (m[n] for n in ("x", "dy", "mean", "rstd", "w"))
    if not _float(x, dy, mean, rstd, w) or (residual and not _float(x, m["g"])) or not _no_partial(m):
        return None
    if x.shape != dy.shape or m.local_shape(x) != m.local_shape(dy) or (residual and m.local_shape(m["g"]) != m.local_shape(x)):
        return None
    ndim = x.ndim
    k = mean.ndim
    if k >= ndim or tuple(mean.shape) != tuple(x.shape[:k]) or tuple(rstd.shape) != tuple(x.shape[:k]) + (1,) * (ndim - k):
        return None
    norm = tuple(x.shape[k:])
    axes = list(range(k, ndim))
    if w.shape != norm or _chain(m, "w_full", "w") != axes or _chain(m, "mean_full", "mean") != list(range(k)):
        return None
    if _chain(m, "rstd_full", "rstd") != list(range(ndim)) or tuple(m["mean_full"].shape) != tuple(x.shape):
        return None
    n = math.prod(norm)
    if float(m["n"]) != float(n) or not math.isclose(float(m["inv_n"]), 1.0 / n, rel_tol=1e-12):
        return None
    for s, whole in (("s1", True), ("s2", True), ("s3", False), ("s4", False)):
        if not _row_sum(m, s, k, whole):
            return None
    if not all(_unsplit(m, v, axes) for v in (x, dy, w)):
        return None
    rows = m.local_shape(mean)
    backward = torch.ops.aten.native_layer_norm_backward.default

    def kernel(x, dy, mean, rstd, w, g=None):
        mean = mean.reshape(rows + (1,) * len(norm))
        dx = backward(dy, x, norm, mean, rstd, w, None, [True, False, False])[0]
        return {"dx": dx if g is None else g + dx}

    return ["x", "dy", "mean", "rstd", "w"] + (["g"] if residual else []), kernel


def _row_sum(m: Match, name: str, k: int, whole: bool) -> bool:
    """``name`` sums an [rows..., normalized...] operand to per-row numbers, and its broadcast
    (``<name>_top``) puts them back on the rows: the operand is whole along the normalized axes
    (``whole``) or has size 1 there, every other summed axis has size 1."""
    o = m.op_of(name)
    arg = o.arg("arg")
    ndim = m["x"].ndim
    if arg.ndim != ndim or o.arg("keepdim"):
        return False
    red = _reduced(o, ndim)
    norm = set(range(k, ndim))
    if whole and (not norm <= red or tuple(arg.shape[k:]) != tuple(m["x"].shape[k:])):
        return False
    if not whole and any(arg.shape[d] != 1 for d in norm):
        return False
    if any(arg.shape[d] != 1 for d in red - norm):
        return False
    kept = [d for d in range(ndim) if d not in red]
    top = m[f"{name}_top"]
    return top.ndim == ndim and _chain(m, f"{name}_top", name) == kept and all(top.shape[d] == m["x"].shape[d] for d in range(k))


pattern("layer_norm_backward", _layer_norm_backward_template(True), ("dx",))(lambda m: _layer_norm_backward_check(m, True))
pattern("layer_norm_backward", _layer_norm_backward_template(False), ("dx",))(lambda m: _layer_norm_backward_check(m, False))


# tanh-GELU, forward and backward ---------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def _gelu_inner(x: Node, x2: Node) -> Node:
    return op("tanh", mul(_SQRT_2_OVER_PI, add(x, mul(_KAPPA, mul(x2, x)))), name="t")


def _gelu_template() -> Node:
    x = leaf("x")
    return mul(mul(0.5, x), add(1.0, _gelu_inner(x, mul(x, x))), name="y")


def _gelu_backward_template() -> Node:
    x, g = leaf("x"), leaf("g")
    x2 = mul(x, x)
    t = _gelu_inner(x, x2)
    d_inner = mul(_SQRT_2_OVER_PI, mul(mul(mul(0.5, x), g), sub(1.0, mul(t, t))))
    outer = mul(0.5, mul(add(1.0, t), g))
    c = mul(_KAPPA, d_inner)
    h = mul(x, mul(x, c))
    return add(add(add(add(d_inner, outer), mul(x2, c)), h), h, name="dx")


@pattern("gelu", _gelu_template(), ("y",), in_place={"y": "x"})
def _gelu_check(m: Match):
    if not _float(m["x"]) or not _no_partial(m) or m.local_shape(m["x"]) != m.local_shape(m["y"]):
        return None

    def kernel(x, out=None):
        return {"y": F.gelu(x, approximate="tanh") if out is None else torch._C._nn.gelu(x, approximate="tanh", out=out)}

    return ["x"], kernel


@pattern("gelu_backward", _gelu_backward_template(), ("dx",), in_place={"dx": "g"})
def _gelu_backward_check(m: Match):
    x, g = m["x"], m["g"]
    if not _float(x, g) or not _no_partial(m) or m.local_shape(x) != m.local_shape(g) or m.local_shape(x) != m.local_shape(m["dx"]):
        return None
    backward, backward_into = torch.ops.aten.gelu_backward.default, torch.ops.aten.gelu_backward.grad_input

    def kernel(x, g, out=None):
        if out is None:
            return {"dx": backward(g, x, approximate="tanh")}
        return {"dx": backward_into(g, x, approximate="tanh", grad_input=out)}

    return ["x", "g"], kernel


# softmax, forward and backward -----------------------------------------------------------------

def _softmax_template() -> Node:
    s = leaf("s")
    e = op("exp", sub(s, bcast(reduce("max", s, "max"), name="max_full")), name="e")
    return div(e, bcast(reduce("sum", e, "sum"), name="sum_full"), name="p")


def _softmax_backward_template() -> Node:
    p, dp = leaf("p"), leaf("dp")
    s = reduce("sum", mul(p, dp), "sum")
    return mul(p, sub(dp, bcast(s, name="sum_full")), name="dx")


def _softmax_axis(m: Match, src: str, full_of: Mapping[str, str]) -> int | None:
    s = m[src]
    axis = None
    for red, full in full_of.items():
        o = m.op_of(red)
        dims = _reduced(o, s.ndim)
        if len(dims) != 1 or o.arg("keepdim") or tuple(m[full].shape) != tuple(s.shape):
            return None
        (d,) = dims
        if axis not in (None, d) or _chain(m, full, red) != [i for i in range(s.ndim) if i != d]:
            return None
        axis = d
    return axis


@pattern("softmax", _softmax_template(), ("p",), in_place={"p": "s"})
def _softmax_check(m: Match):
    s = m["s"]
    axis = _softmax_axis(m, "s", {"max": "max_full", "sum": "sum_full"})
    if axis is None or not _float(s, m["p"]) or not _no_partial(m) or not _unsplit(m, s, [axis]):
        return None

    def kernel(s, out=None):
        # The softmax kernel reads each row before writing it, so it may overwrite its input.
        return {"p": torch.softmax(s, axis) if out is None else torch._softmax(s, axis, False, out=out)}

    return ["s"], kernel


@pattern("softmax_backward", _softmax_backward_template(), ("dx",), in_place={"dx": "dp"})
def _softmax_backward_check(m: Match):
    p, dp = m["p"], m["dp"]
    axis = _softmax_axis(m, "p", {"sum": "sum_full"})
    if axis is None or not _float(p, dp) or not _no_partial(m) or not _unsplit(m, p, [axis]):
        return None
    if p.shape != dp.shape or m.local_shape(p) != m.local_shape(dp):
        return None
    dtype = p.dtype.torch

    def kernel(p, dp, out=None):
        if out is None:
            return {"dx": torch._softmax_backward_data(dp, p, axis, dtype)}
        return {"dx": torch._softmax_backward_data(dp, p, axis, dtype, grad_input=out)}  # row by row: may overwrite dp

    return ["p", "dp"], kernel


# ---------------------------------------------------------------------------------------------
# finding matches in a program


@dataclass
class Fused:
    """One fused step: reads ``leaves`` (value names), writes ``exports`` (value name -> kernel key)."""

    name: str
    position: tuple[int, int]
    leaves: list[str]
    exports: dict[str, str]
    removed: list[int]
    kernel: Callable[..., dict[str, torch.Tensor]]
    root: Op
    leaf_names: dict[str, str]  # leaf value -> its template name
    in_place: dict[str, str]  # as Pattern.in_place


def find(live: dict[int, Op], outputs: set[str], local_shape: Callable[[Value], tuple[int, ...]],
         sharding: Callable[[Value], Placement | None], patterns: list[Pattern] | None = None) -> list[Fused]:
    """Match ``patterns`` against the ops ``live`` (index -> op; removed from it as they are
    fused) and return the fused steps, each placed after the last op its leaves need."""
    consumers: dict[str, set[int]] = {}
    for i, o in live.items():
        for v in o.operands:
            consumers.setdefault(v.name, set()).add(i)
    ready: dict[str, tuple[int, int]] = {v.name: (i, 0) for i, o in live.items() for v in o.outputs}
    gone: set[str] = set()  # values of removed ops no fused step writes
    fused: list[Fused] = []
    g = _Graph(live)
    for pat in patterns if patterns is not None else PATTERNS:
        for index in sorted(live):
            o = live.get(index)
            if o is None or o.kind != pat.root.kind or len(o.outputs) <= pat.root.out:
                continue
            for b in _match(pat.root, o.outputs[pat.root.out], {_OPS: ()}, g):
                m = Match(pat, b, {i: live[i] for i in b[_OPS]}, local_shape, sharding)
                step = _accept(m, live, consumers, ready, gone, outputs, len(fused) + 1)
                if step is not None:
                    fused.append(step)
                    g = _Graph(live)
                    break
    return fused


def _accept(m: Match, live, consumers, ready, gone, outputs, seq) -> Fused | None:
    pat = m.pattern
    try:
        made = pat.kernel(m)
    except (KeyError, TypeError, ValueError, AttributeError):
        made = None
    if made is None:
        return None
    leaf_names, kernel = made
    leaves = [m[n] for n in leaf_names]
    if any(v.name in gone for v in leaves):
        return None
    position = (max([ready.get(v.name, (-1, 0))[0] for v in leaves] + [-1]), seq)
    covered = set(m.ops)
    export_of = {m[n].name: n for n in pat.exports if id(pat.named[n]) in m.bindings}
    keep: set[int] = set()

    def outside(name: str) -> set[int]:
        return consumers.get(name, set()) - covered

    for i in covered:
        for v in live[i].outputs:
            users = outside(v.name)
            if v.name in outputs or users:
                if v.name not in export_of or any(u <= position[0] for u in users):
                    keep.add(i)
    todo = list(keep)
    producer = {v.name: i for i in covered for v in live[i].outputs}
    while todo:
        i = todo.pop()
        for v in live[i].operands:
            j = producer.get(v.name)
            if j is not None and j not in keep:
                keep.add(j)
                todo.append(j)
    removed = covered - keep
    root_index = producer[m[pat.root.name].name] if pat.root.name else None
    if not removed or root_index not in removed:
        return None
    exports = {}
    for i in removed:
        for v in live[i].outputs:
            if v.name in outputs or outside(v.name):
                exports[v.name] = export_of[v.name]
    root = live[root_index]
    for i in sorted(removed):
        for v in live[i].operands:
            consumers.get(v.name, set()).discard(i)
        for v in live[i].outputs:
            if v.name in exports:
                ready[v.name] = position
            else:
                gone.add(v.name)
        del live[i]
    return Fused(pat.name, position, [v.name for v in leaves], exports, sorted(removed), kernel, root,
                 {v.name: n for v, n in zip(leaves, leaf_names)}, pat.in_place)
