"""Compiled reference programs: a fusion turned, once, into straight-line steps.

``reference.run`` interprets a fusion op by op: each op looks up its implementation, builds an
argument dict, and checks each result's placement and dtype, tens of microseconds per op, and a
GPT block's forward and backward have some 300 ops. A ``Program`` does that work once per
(fusion, placements, mesh position):

* values live in numbered slots; each op's arguments are resolved to slots or literals;
* common ops get a step that makes the interpreter's torch call directly, with the casts the
  interpreter would make decided from the static dtypes (``_FAST``); every other op runs its
  implementation in ``reference.IMPLS`` through ``reference.execute_op``, as interpreted;
* ops that read only constants (the causal mask's iota, broadcasts and compare) run once, here;
* LayerNorm, tanh-GELU and softmax, forward and backward, run as the fused torch kernels eager
  PyTorch uses (``patterns.py``);
* a value is dropped after its last use.

Results equal the interpreter's bit for bit, except the fused patterns, which round as eager
PyTorch's kernels do (within 1e-6 relative in float32). A sharded run compiles its own program
per mesh position from the same fusion, so sharded and single-device runs fuse the same
patterns (a pattern applies only where the rank holds whole rows of it).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from nvtp.execute import patterns as patterns_mod
from nvtp.execute.reference import (
    _BINARY_TORCH, _COMPARISONS, _UNARY_TORCH, NEEDS_TENSORS, Communication, Context, ExecutionError, _as_tensor, bias_applies,
    constant_value, execute_op, reshapes_whole, set_is_local,
)
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Fusion, Op, TensorValue, Value, is_value
from nvtp.sharding.placements import DeviceMesh, Placement

Step = Callable[[Context, list], None]

# Ops never evaluated ahead of time: random numbers (drawn per run) and collectives.
_RUNTIME_ONLY = {"uniform", "normal", "sdpfa_fwd", "sdpfa_bwd", "set", "segment_set"}
_FOLD_LIMIT = 4 << 20  # bytes a folded constant may keep alive


class _Position:
    """The mesh position a program is built for; building never communicates."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def __getattr__(self, name):
        raise ExecutionError(f"building a program tried to communicate ({name})")


@dataclass
class Program:
    """A fusion compiled for one mesh position; ``run`` takes this rank's inputs."""

    fusion: Fusion
    shardings: Mapping[str, tuple[Placement, ...]] | None
    mesh: DeviceMesh | None
    n_slots: int
    inputs: list[tuple[int, Value, tuple[int, ...], torch.dtype]]
    constants: list[tuple[int, Any]]
    steps: list[tuple[Step, tuple[int, ...]]]
    step_ops: list[str]
    outputs: list[tuple[int, bool]]
    fused: dict[str, int] = field(default_factory=dict)  # pattern name -> times fused
    folded: int = 0  # ops evaluated while building
    in_place: int = 0  # steps that overwrite a dying operand

    def accepts(self, inputs: Sequence[Any]) -> bool:
        """True when ``inputs`` have the shapes and dtypes the program was built for."""
        for (_, v, shape, dtype), x in zip(self.inputs, inputs):
            if isinstance(v, TensorValue):
                if not isinstance(x, torch.Tensor) or x.dtype != dtype or tuple(x.shape) != shape:
                    return False
        return len(inputs) == len(self.inputs)

    def run(self, inputs: Sequence[Any], comm, seed: int = 0, log: list[Communication] | None = None) -> list[Any]:
        ctx = Context(self.fusion, self.shardings, self.mesh, comm, seed)
        if log is not None:
            ctx.log = log
        env: list[Any] = [None] * self.n_slots
        for slot, value in self.constants:
            env[slot] = value
        for (slot, v, _, dtype), x in zip(self.inputs, inputs):
            env[slot] = x if isinstance(v, TensorValue) else _as_tensor(x).to(dtype)
        i = 0
        try:
            for i, (step, frees) in enumerate(self.steps):
                step(ctx, env)
                for s in frees:
                    env[s] = None
        except ExecutionError:
            raise
        except Exception as e:  # name the op, keep the cause
            raise ExecutionError(f"while executing {self.step_ops[i]}: {type(e).__name__}: {e}") from e
        return [env[s] if is_tensor else env[s].item() for s, is_tensor in self.outputs]


# ---------------------------------------------------------------------------------------------
# building


class _Builder:
    def __init__(self, fusion: Fusion, shardings, mesh, rank: int, size: int):
        self.fusion = fusion
        self.values = fusion.values
        self.ctx = Context(fusion, shardings, mesh, _Position(rank, size))
        self.rank = rank
        self.slots: dict[str, int] = {}
        self.constants: dict[str, Any] = {}

    def slot(self, v: Value) -> int:
        s = self.slots.get(v.name)
        if s is None:
            s = self.slots[v.name] = len(self.slots)
        return s

    def dtype(self, v: Value) -> torch.dtype:
        """The torch dtype ``v`` has at run time (inputs are checked, results cast to it)."""
        return self.ctx.dtype(v.dtype)

    def local(self, v: Value) -> tuple[int, ...]:
        return self.ctx.local_shape(v) if isinstance(v, TensorValue) else ()

    def sharding(self, v: Value) -> Placement | None:
        s = self.ctx.sharding(v)
        return s[0] if s else None

    def resolve_constant(self, x: Any) -> Any:
        if is_value(x):
            return self.constants[x.name]
        if isinstance(x, tuple) and any(is_value(e) for e in x):
            return tuple(self.resolve_constant(e) for e in x)
        return x

    def is_constant(self, x: Any) -> bool:
        if is_value(x):
            return x.name in self.constants
        if isinstance(x, tuple):
            return all(self.is_constant(e) for e in x)
        return True

    def getter(self, x: Any) -> tuple[int, Any]:
        """(1, slot) for a value, (2, [getters]) for a list holding values, (0, literal) otherwise."""
        if is_value(x):
            return 1, self.slot(x)
        if isinstance(x, tuple) and any(is_value(e) for e in x):
            return 2, [self.getter(e) for e in x]
        return 0, x


def _get(g: tuple[int, Any], env: list) -> Any:
    kind, payload = g
    if kind == 1:
        return env[payload]
    if kind == 2:
        return tuple(_get(e, env) for e in payload)
    return payload


def compile_program(fusion: Fusion, shardings: Mapping[str, tuple[Placement, ...]] | None = None, mesh: DeviceMesh | None = None,
                    rank: int = 0, size: int = 1, *, fuse: bool = True) -> Program:
    """Build the program that runs ``fusion`` at mesh position ``rank`` of ``size``."""
    b = _Builder(fusion, shardings, mesh, rank, size)
    inputs = []
    for v in fusion.inputs:
        inputs.append((b.slot(v), v, b.local(v), b.dtype(v)))
    live: dict[int, Op] = {}
    folded = 0
    for index, o in enumerate(fusion.ops):
        if o.kind == "define_tensor":
            continue
        if o.kind == "define_scalar":
            c = constant_value(b.ctx, o)
            if c is not None:
                b.constants[o.outputs[0].name] = c
            continue
        if o.kind not in _RUNTIME_ONLY and all(b.is_constant(a) for _, a in o.args) and _fold(b, o):
            folded += 1
            continue
        live[index] = o
    outputs = {v.name for v in fusion.outputs}
    fused_steps = patterns_mod.find(live, outputs, b.local, b.sharding) if fuse else []

    items = [_Item((index, 0), o, None) for index, o in live.items()]
    items += [_Item(f.position, None, f) for f in fused_steps]
    items.sort(key=lambda it: it.position)
    for it in items:
        if it.op is not None:
            it.reads = [v.name for v in it.op.operands if v.name not in b.constants]
            it.writes = [v.name for v in it.op.outputs]
        else:
            it.reads = [n for n in it.fused.leaves if n not in b.constants]
            it.writes = list(it.fused.exports)
    pinned = {v.name for v in fusion.inputs} | set(b.constants) | outputs
    into = _plan_in_place(b, items, pinned)

    steps: list[tuple[Step, tuple[int, ...]]] = []
    for i, it in enumerate(items):
        step = _step(b, it.op, into.get(i)) if it.op is not None else _fused_step(b, it.fused, into.get(i))
        steps.append((step, ()))
    last: dict[str, int] = {}
    for i, it in enumerate(items):
        for n in it.writes:
            last.setdefault(n, i)
        for n in it.reads:
            last[n] = i
    frees: list[list[int]] = [[] for _ in items]
    pre_free = []
    for v in fusion.inputs:
        if v.name not in last and v.name not in outputs:
            pre_free.append(b.slot(v))
    for n, i in last.items():
        if n not in outputs:
            frees[i].append(b.slot(b.values[n]))
    steps = [(step, tuple(fr)) for (step, _), fr in zip(steps, frees)]
    what = [str(it.op) if it.op is not None else f"fused {it.fused.name} ending in {it.fused.root}" for it in items]
    if pre_free:  # inputs nothing reads
        steps.insert(0, (_nothing, tuple(pre_free)))
        what.insert(0, "(unused inputs)")
    constants = [(b.slot(b.values[n]), t) for n, t in b.constants.items()]
    outs = [(b.slot(v), isinstance(v, TensorValue)) for v in fusion.outputs]
    counts: dict[str, int] = {}
    for f in fused_steps:
        counts[f.name] = counts.get(f.name, 0) + 1
    return Program(fusion, shardings, mesh, len(b.slots), inputs, constants, steps, what, outs, counts, folded,
                   len(into))


@dataclass
class _Item:
    position: tuple[int, int]
    op: Op | None
    fused: patterns_mod.Fused | None
    reads: list[str] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)


# Ops whose results are new tensors (never views of an operand), when run by their fast step.
_UNARY_FAST = [n for n in _UNARY_TORCH if n not in ("set", "segment_set")]  # set and segment_set run as _alias
_FRESH = {*_UNARY_FAST, *_BINARY_TORCH, "where", "matmul", "linear",
          "sum", "max", "min", "var_mean"}
# Unary torch functions that take out= (the in-place candidates).
_UNARY_OUT = {"abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "exp2", "expm1", "floor", "log",
              "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "tan",
              "tanh", "trunc"}


def _plan_in_place(b: _Builder, items: list[_Item], pinned: set[str]) -> dict[int, str]:
    """Which steps write their result into an operand whose storage dies there: item index ->
    the operand's value name.

    Values that may share storage form a group (views, identity ops, anything not known to
    allocate). A group dies at the last step that reads any of its values; groups holding an
    input, a constant or an output never die. A pointwise step (or a fused softmax / GELU,
    forward or backward) whose operand's group dies at that step, with the result's shape and
    dtype, overwrites it: no new allocation, which matters for large tensors (glibc hands out
    fresh, zeroed pages for each allocation above 32 MiB)."""
    last: dict[str, int] = {}
    for i, it in enumerate(items):
        for n in it.reads:
            last[n] = i
    parent: dict[str, str] = {}
    glast: dict[str, int] = {}
    gpinned: dict[str, bool] = {}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def make(x: str, i: int) -> None:
        if x not in parent:
            parent[x] = x
            glast[x] = last.get(x, i)
            gpinned[x] = x in pinned

    def union(x: str, y: str) -> None:
        rx, ry = find(x), find(y)
        if rx != ry:
            parent[ry] = rx
            glast[rx] = max(glast[rx], glast[ry])
            gpinned[rx] = gpinned[rx] or gpinned[ry]

    for n in pinned:
        make(n, -1)
    into: dict[int, str] = {}
    for i, it in enumerate(items):
        operands = [v.name for v in it.op.operands] if it.op is not None else list(it.reads)
        for n in operands:
            make(n, i)
        chosen = None
        for a in _in_place_candidates(b, it):
            ra = find(a)
            if gpinned[ra] or glast[ra] != i:
                continue
            out = b.values[it.writes[0]] if it.op is not None else b.values[_export_name(it, a)]
            av = b.values[a]
            if b.local(av) != b.local(out) or b.dtype(av) != b.dtype(out):
                continue
            if any(find(n) == ra and n != a for n in it.reads):
                continue  # another operand shares the storage (a view of it): no overwriting
            chosen = (a, out.name)
            break
        for n in it.writes:
            make(n, i)
        if chosen is not None:
            into[i] = chosen[0]
            union(chosen[0], chosen[1])
        if it.op is not None:
            if it.op.kind not in _FRESH:  # the result may be (a view of) an operand
                for n in it.writes:
                    for r in operands:
                        union(r, n)
                for n in it.writes[1:]:
                    union(it.writes[0], n)
        else:
            for n in it.writes[1:]:  # exports of one kernel may share storage (mean and its keepdim view)
                union(it.writes[0], n)
    return into


def _export_name(it: _Item, leaf: str) -> str:
    f = it.fused
    key = next(k for k, node in f.in_place.items() if f.leaf_names.get(leaf) == node)
    return next(n for n, k in f.exports.items() if k == key)


def _in_place_candidates(b: _Builder, it: _Item) -> list[str]:
    if it.op is None:
        f = it.fused
        by_node = {node: value for value, node in f.leaf_names.items()}
        return [by_node[node] for key, node in f.in_place.items() if node in by_node and key in f.exports.values()]
    o = it.op
    if o.kind in _ARITHMETIC:
        return [v.name for v in (o.arg("lhs"), o.arg("rhs")) if is_value(v) and v.name not in b.constants]
    if o.kind in _UNARY_OUT:
        x = o.arg("arg")
        return [x.name] if is_value(x) and x.name not in b.constants else []
    if o.kind == "where":
        return [v.name for v in (o.arg("x"), o.arg("y")) if is_value(v) and v.name not in b.constants]
    return []


def _nothing(ctx, env) -> None:
    return None


def _fold(b: _Builder, o: Op) -> bool:
    """Evaluate an op whose operands are all constants, if its results are small."""
    args = {name: b.resolve_constant(a) for name, a in o.args}
    try:
        results = execute_op(b.ctx, o, args)
    except ExecutionError:
        return False  # let the run raise it, in its place
    if any(r.untyped_storage().nbytes() > _FOLD_LIMIT for r in results):
        return False
    for v, r in zip(o.outputs, results):
        b.constants[v.name] = r
    return True


def _fused_step(b: _Builder, f: patterns_mod.Fused, into: str | None = None) -> Step:
    values = b.values
    leaves = [(b.constants[n], None) if n in b.constants else (None, b.slot(values[n])) for n in f.leaves]
    writes = [(b.slot(values[n]), key, b.dtype(values[n])) for n, key in f.exports.items()]
    kernel = f.kernel
    target = b.slot(values[into]) if into is not None else None

    def step(ctx, env):
        args = [c if s is None else env[s] for c, s in leaves]
        if target is not None and env[target].is_contiguous():
            out = kernel(*args, out=env[target])
        else:
            out = kernel(*args)
        for s, key, want in writes:
            r = out[key]
            env[s] = r if r.dtype == want else r.to(want)

    return step


# ---------------------------------------------------------------------------------------------
# steps: the interpreter's torch call, decided ahead of time


def _step(b: _Builder, o: Op, into: str | None = None) -> Step:
    make = _FAST.get(o.kind)
    if make is not None:
        step = make(b, o, into) if o.kind in _IN_PLACE_MAKERS else make(b, o)
        if step is not None:
            return step
    return _generic(b, o)


def _overwriting(slot: int, compute: Callable[[list], torch.Tensor], compute_into: Callable[[list, torch.Tensor], torch.Tensor]):
    """``compute_into(env, target)`` writes into the dying operand in ``slot`` when it is dense."""
    def run(env):
        target = env[slot]
        if target.is_contiguous():
            return compute_into(env, target)
        return compute(env)

    return run


def _generic(b: _Builder, o: Op) -> Step:
    spec = [(name, b.getter(a)) for name, a in o.args]
    outs = [b.slot(v) for v in o.outputs]

    def step(ctx, env):
        args = {name: _get(g, env) for name, g in spec}
        for s, r in zip(outs, execute_op(ctx, o, args)):
            env[s] = r

    return step


def _unary(b: _Builder, o: Op, into: str | None = None) -> Step | None:
    x = o.arg("arg")
    if not is_value(x) or x.name in b.constants:
        return None
    fn = _UNARY_TORCH[o.kind]
    out_v = o.outputs[0]
    want = b.dtype(out_v)
    cast = want if (out_v.dtype.is_float or out_v.dtype.is_complex) and b.dtype(x) != want else None
    a, r = b.slot(x), b.slot(out_v)
    if into == x.name and cast is None and o.kind in _UNARY_OUT:
        return _store(r, want, _overwriting(a, lambda env: fn(env[a]), lambda env, t: fn(t, out=t)))
    if cast is None:
        def step(ctx, env):
            t = fn(env[a])
            env[r] = t if t.dtype == want else t.to(want)
    else:
        def step(ctx, env):
            t = fn(env[a].to(cast))
            env[r] = t if t.dtype == want else t.to(want)
    return step


_ARITHMETIC = {"add", "sub", "mul", "div", "truediv", "pow", "maximum", "minimum", "fmod", "remainder", "mod"}


def _binary(b: _Builder, o: Op, into: str | None = None) -> Step | None:
    name = o.kind
    lhs, rhs = o.arg("lhs"), o.arg("rhs")
    out_v = o.outputs[0]
    want = b.dtype(out_v)
    r = b.slot(out_v)
    if name in _COMPARISONS:
        if not is_value(lhs) or lhs.name in b.constants:
            return None
        fn = _BINARY_TORCH[name]
        a = b.slot(lhs)
        if is_value(rhs):
            if rhs.name in b.constants:
                c = b.constants[rhs.name]
                return _store(r, want, lambda env: fn(env[a], c))
            s = b.slot(rhs)
            return _store(r, want, lambda env: fn(env[a], env[s]))
        return _store(r, want, lambda env: fn(env[a], rhs))
    if name not in _ARITHMETIC or not want.is_floating_point:
        return None
    fn = torch.div if name == "div" else _BINARY_TORCH[name]  # float operands: _div is torch.div
    left = _tensor_operand(b, lhs, want)
    # as _promote_pair: both operands tensors of the result type, unless only rhs is a literal
    right = _tensor_operand(b, rhs, want) if is_value(rhs) or not is_value(lhs) or name in NEEDS_TENSORS else (0, rhs)
    compute = _apply2(fn, left, right)
    for g, x in ((left, lhs), (right, rhs)):
        if into is not None and is_value(x) and x.name == into and g[0] == 1 and left[0] != 3 and right[0] != 3:
            get_l, get_r = _caster(left), _caster(right)
            return _store(r, want, _overwriting(g[1], compute, lambda env, t: fn(get_l(env), get_r(env), out=t)))
    return _store(r, want, compute)


def _tensor_operand(b: _Builder, x: Any, want: torch.dtype) -> tuple[int, Any]:
    """(0, constant tensor) or (1, slot) or (3, (slot, cast dtype)) for an operand converted to ``want``."""
    if is_value(x) and x.name not in b.constants:
        return (1, b.slot(x)) if b.dtype(x) == want else (3, (b.slot(x), want))
    t = b.constants[x.name] if is_value(x) else _as_tensor(x)
    return 0, (t.to(want) if t.dtype != want else t)


def _apply2(fn, left, right) -> Callable[[list], torch.Tensor]:
    (lk, lp), (rk, rp) = left, right
    if lk == 1 and rk == 1:
        return lambda env: fn(env[lp], env[rp])
    if lk == 1 and rk == 0:
        return lambda env: fn(env[lp], rp)
    if lk == 0 and rk == 1:
        return lambda env: fn(lp, env[rp])
    get_l = _caster(left)
    get_r = _caster(right)
    return lambda env: fn(get_l(env), get_r(env))


def _caster(g) -> Callable[[list], Any]:
    kind, p = g
    if kind == 0:
        return lambda env: p
    if kind == 1:
        return lambda env: env[p]
    slot, dt = p
    return lambda env: env[slot].to(dt)


def _store(r: int, want: torch.dtype, compute: Callable[[list], torch.Tensor]) -> Step:
    def step(ctx, env):
        t = compute(env)
        env[r] = t if t.dtype == want else t.to(want)

    return step


def _where(b: _Builder, o: Op, into: str | None = None) -> Step | None:
    c, x, y = o.arg("condition"), o.arg("x"), o.arg("y")
    if not is_value(c) or not (is_value(x) or is_value(y)):
        return None
    out_v = o.outputs[0]
    want = b.dtype(out_v)
    cond = (1, b.slot(c)) if c.name not in b.constants else (0, b.constants[c.name])
    if cond[0] == 1 and b.dtype(c) != torch.bool:
        return None
    branches = []
    for z in (x, y):
        if is_value(z):
            branches.append(_tensor_operand(b, z, want))
        else:
            branches.append((0, z))
    get_c, get_x, get_y = _caster(cond), _caster(branches[0]), _caster(branches[1])
    compute = lambda env: torch.where(get_c(env), get_x(env), get_y(env))  # noqa: E731
    for g, z in zip(branches, (x, y)):
        if into is not None and is_value(z) and z.name == into and g[0] == 1 and all(k != 3 for k, _ in branches):
            # out= needs tensor branches: a literal becomes a 0-d tensor of the result type (same values)
            tx, ty = (_caster(br) if br[0] != 0 or isinstance(br[1], torch.Tensor) else _literal(br[1], want) for br in branches)
            return _store(b.slot(out_v), want, _overwriting(g[1], compute, lambda env, t: torch.where(get_c(env), tx(env), ty(env), out=t)))
    return _store(b.slot(out_v), want, compute)


def _literal(x: Any, dtype: torch.dtype) -> Callable[[list], torch.Tensor]:
    t = torch.tensor(x, dtype=dtype)
    return lambda env: t


def _cast(b: _Builder, o: Op) -> Step | None:
    x = o.arg("arg")
    if not is_value(x) or x.name in b.constants:
        return None
    dt = b.ctx.dtype(o.arg("dtype"))
    want = b.dtype(o.outputs[0])
    a = b.slot(x)
    return _store(b.slot(o.outputs[0]), want, lambda env: env[a].to(dt))


def _broadcast_in_dim(b: _Builder, o: Op) -> Step | None:
    x = o.arg("arg")
    if not is_value(x) or x.name in b.constants:
        return None
    out_shape = b.local(o.outputs[0])
    view = [1] * len(out_shape)
    for i, d in enumerate(o.arg("broadcast_dims")):
        view[d] = b.local(x)[i]
    view = tuple(view)
    a, r = b.slot(x), b.slot(o.outputs[0])

    def step(ctx, env):
        env[r] = env[a].reshape(view).expand(out_shape)

    return step


def _reshape(b: _Builder, o: Op) -> Step | None:
    x, out = o.arg("arg"), o.outputs[0]
    if not is_value(x) or x.name in b.constants:
        return None
    local = b.local(out)
    if reshapes_whole(math.prod(b.local(x)), out, local):
        return None  # the whole-operand case: run() keeps this rank's part
    a, r = b.slot(x), b.slot(out)

    def step(ctx, env):
        env[r] = env[a].reshape(local)

    return step


def _permute(b: _Builder, o: Op) -> Step | None:
    x = o.arg("arg")
    if not is_value(x) or x.name in b.constants:
        return None
    dims = tuple(o.arg("dims"))
    a, r = b.slot(x), b.slot(o.outputs[0])

    def step(ctx, env):
        env[r] = env[a].permute(dims)

    return step


def _alias(b: _Builder, o: Op) -> Step | None:
    x = o.arg("arg")
    if not is_value(x) or x.name in b.constants:
        return None
    if o.kind == "set" and not set_is_local(b.ctx, o):
        return None  # a collective: the generic step runs it
    if b.dtype(x) != b.dtype(o.outputs[0]):
        return None
    a, r = b.slot(x), b.slot(o.outputs[0])

    def step(ctx, env):
        env[r] = env[a]

    return step


def _slice(b: _Builder, o: Op) -> Step | None:
    from nvtp.ir.ops import slice_bounds

    x, out = o.arg("arg"), o.outputs[0]
    if not is_value(x) or x.name in b.constants or b.local(x) != tuple(x.shape) or b.local(out) != tuple(out.shape):
        return None
    index = tuple(slice(s, e, st) for s, e, st in slice_bounds(x, o.arg("start_indices"), o.arg("end_indices"), o.arg("strides")))
    a, r = b.slot(x), b.slot(out)

    def step(ctx, env):
        env[r] = env[a][index]

    return step


def _linear(b: _Builder, o: Op) -> Step | None:
    x, w, bias = o.arg("arg1"), o.arg("arg2"), o.arg("bias")
    if not is_value(x) or not is_value(w) or x.name in b.constants or w.name in b.constants:
        return None
    if not bias_applies(b.ctx, o):
        bias = None  # a partial sum: the bias is added once, on mesh position 0
    if bias is not None and (not is_value(bias) or bias.name in b.constants):
        return None
    want = b.dtype(o.outputs[0])
    a, wv, r = b.slot(x), b.slot(w), b.slot(o.outputs[0])
    if bias is None:
        return _store(r, want, lambda env: F.linear(env[a], env[wv]))
    bv = b.slot(bias)
    return _store(r, want, lambda env: F.linear(env[a], env[wv], env[bv]))


def _matmul(b: _Builder, o: Op) -> Step | None:
    x, y = o.arg("arg1"), o.arg("arg2")
    if not (is_value(x) and is_value(y)) or x.name in b.constants or y.name in b.constants:
        return None
    want = b.dtype(o.outputs[0])
    a, c, r = b.slot(x), b.slot(y), b.slot(o.outputs[0])
    return _store(r, want, lambda env: torch.matmul(env[a], env[c]))


def _sum(b: _Builder, o: Op) -> Step | None:
    x = o.arg("arg")
    if not is_value(x) or x.name in b.constants:
        return None
    ndim = len(b.local(x))
    dims = tuple(range(ndim)) if o.arg("dims") is None else tuple(o.arg("dims"))
    keepdim = o.arg("keepdim")
    want = b.dtype(o.outputs[0])
    acc = want if o.arg("dtype") not in (None, DType.Null) else None
    a, r = b.slot(x), b.slot(o.outputs[0])
    return _store(r, want, lambda env: torch.sum(env[a], dims, keepdim=keepdim, dtype=acc))


def _amax(b: _Builder, o: Op) -> Step | None:
    x = o.arg("arg")
    if not is_value(x) or x.name in b.constants:
        return None
    ndim = len(b.local(x))
    dims = tuple(range(ndim)) if o.arg("dims") is None else tuple(o.arg("dims"))
    keepdim = o.arg("keepdim")
    fn = torch.amax if o.kind == "max" else torch.amin
    want = b.dtype(o.outputs[0])
    a, r = b.slot(x), b.slot(o.outputs[0])
    return _store(r, want, lambda env: fn(env[a], dims, keepdim=keepdim))


def _var_mean(b: _Builder, o: Op) -> Step | None:
    x = o.arg("arg")
    if not is_value(x) or x.name in b.constants:
        return None
    dims, correction, keepdim = tuple(o.arg("dims")), o.arg("correction"), o.arg("keepdim")
    want_var, want_mean = b.dtype(o.outputs[0]), b.dtype(o.outputs[1])
    a, rv, rm = b.slot(x), b.slot(o.outputs[0]), b.slot(o.outputs[1])

    def step(ctx, env):
        t = env[a]
        if t.dtype != want_var:
            t = t.to(want_var)
        var, mean = torch.var_mean(t, dims, correction=correction, keepdim=keepdim)
        mean = mean.to(want_mean)
        env[rv] = var if var.dtype == want_var else var.to(want_var)
        env[rm] = mean

    return step


_IN_PLACE_MAKERS = {*_UNARY_FAST, *_BINARY_TORCH, "where"}
_FAST: dict[str, Callable[..., Step | None]] = {
    **{n: _unary for n in _UNARY_FAST},
    **{n: _binary for n in _BINARY_TORCH},
    "where": _where, "cast": _cast, "broadcast_in_dim": _broadcast_in_dim, "reshape": _reshape, "permute": _permute,
    "set": _alias, "stride_order": _alias, "slice": _slice, "linear": _linear, "matmul": _matmul, "sum": _sum,
    "max": _amax, "min": _amax, "var_mean": _var_mean,
}


# ---------------------------------------------------------------------------------------------
# the cache: one program per (fusion, placements, mesh position)


@dataclass
class _Entry:
    fusion: "weakref.ref[Fusion]"
    shardings: Any
    mesh: DeviceMesh | None
    rank: int
    size: int
    program: Program


_CACHE: dict[int, list[_Entry]] = {}
_PER_FUSION = 8


def program_for(fusion: Fusion, shardings: Mapping[str, tuple[Placement, ...]] | None, mesh: DeviceMesh | None,
                rank: int, size: int) -> Program:
    """The compiled program of ``fusion`` for this mesh position (built on first use)."""
    key = id(fusion)
    entries = _CACHE.get(key)
    if entries:
        for e in entries:
            if e.fusion() is fusion and e.shardings is shardings and e.mesh == mesh and e.rank == rank and e.size == size:
                return e.program
    program = compile_program(fusion, shardings, mesh, rank, size)
    if entries is None or not entries or entries[0].fusion() is not fusion:
        entries = _CACHE[key] = []
        weakref.finalize(fusion, _CACHE.pop, key, None)
    entries.append(_Entry(weakref.ref(fusion), shardings, mesh, rank, size, program))
    del entries[:-_PER_FUSION]
    return program
