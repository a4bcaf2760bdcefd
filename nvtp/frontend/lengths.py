"""New sequence lengths without a new trace: a program derived from two traced ones.

A model called at a new sequence length (``generate`` calls it on one more token each step) gets
a new program. Tracing it (Thunder, and TorchDynamo on the FX route) takes seconds to a minute;
the sharding passes take a tenth of a second. When two calls of the same structure differ only in
one size ``n`` (every dimension that differs holds the same ``n``), the traced fusions differ only
in the numbers that follow ``n``: shapes ``[B, n, C]``, ``[B*n, C]``, a slice ``pos[0:n]``, an
iota of length ``n``. ``Lengths`` keeps the traces of each call structure and, from two of them
(at ``a`` and ``b``), derives the fusions at a new ``c`` (``derive``):

* the two fusions must be the same program but for sizes: the same ops, values, dtypes and every
  argument equal, except the sizes (``shape``, slice bounds, pad widths, iota lengths);
* each size that differs is ``p*n + q`` with integers ``p`` and ``q`` (from ``a`` and ``b``), and is
  that at ``c``; every other number (a scalar, a scale) must be equal in both;
* each op is rebuilt at ``c`` by the op table, which infers its results' shapes; each must be the
  same affine function of ``n`` as in the two traces, or nothing is derived;
* the FX route's folded constants (position ids, causal masks) are regenerated at ``c`` when both
  traces' are the same known pattern (``_PATTERNS``: unchanged, an arange along one axis, a causal
  comparison, within a sliding window or not), else nothing is derived.

Nothing derived is used unchecked. By default every compiled program's first call is checked
against the model run eagerly on the same inputs (``nvtp.guard``), so a derived program is too:
the caller says so (``trace(..., eager=...)``) and reports each check's outcome (``settle``); a
derived program that differs from eager (or that the check could not compare) is traced instead,
and its family is traced at every length from then on (``Family.why`` says why). Where no eager
check stands behind the program (``verify=False``; a program that draws random numbers), the first
new length after the two is traced too and must equal what was derived, op for op and constant
for constant. So generation costs two traces with the check on (the default), three without it;
every later length costs the derivation and the sharding passes (``tests/test_lengths.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from nvtp.ir import ops as opstable
from nvtp.ir.build import make_op
from nvtp.ir.graph import Fusion, Op, is_value
from nvtp.ir.verify import verify

# Arguments that hold sizes (besides every parameter of kind "shape"): these may follow n.
_SIZES = {("slice", "start_indices"), ("slice", "end_indices"), ("pad", "pad_widths"), ("iota", "length")}


class NotDerivable(ValueError):
    """Two traces are not one program at two lengths (says where they differ)."""


@dataclass
class Family:
    """The traces of one call structure at different lengths (the first two derive the rest)."""

    first: list[tuple[int, ...]] | None = None  # the first call's tensor shapes
    moved: frozenset = frozenset()  # (leaf, dimension) of the sizes that follow n, from the first two traces
    traces: list[tuple[int, Any]] = field(default_factory=list)  # (n, Traced) of each length traced
    checked: bool = False  # a derived program equalled a real trace, or the model run eagerly
    why: str = ""  # why this family is traced at every length ("" while it may be derived)
    derived: int = 0
    lengths: set[int] = field(default_factory=set)  # the lengths whose program was derived

    def length_of(self, shapes: list[tuple[int, ...]]) -> int | None:
        """The one size ``n`` a call of these shapes has where the first call had another: every
        dimension that differs from the first call's holds it (and, once two lengths are known,
        the same dimensions differ); None for the first call or any other difference."""
        if self.first is None:
            return None
        moved = _moved(self.first, shapes)
        if not moved or (self.moved and moved != self.moved):
            return None
        new, old = {shapes[i][d] for i, d in moved}, {self.first[i][d] for i, d in moved}
        return new.pop() if len(new) == 1 and len(old) == 1 else None

    def add(self, shapes: list[tuple[int, ...]], traced: Any) -> None:
        """Keep a real trace: the first call's, then the first at another length."""
        if self.first is None:
            self.first = shapes
            self.traces.append((-1, traced))  # its n is known once a second length says which sizes move
        elif len(self.traces) == 1 and (n := self.length_of(shapes)) is not None:
            self.moved = _moved(self.first, shapes)
            i, d = next(iter(self.moved))
            self.traces = [(self.first[i][d], self.traces[0][1]), (n, traced)]


def _moved(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> frozenset:
    return frozenset((i, d) for i, (s, t) in enumerate(zip(a, b)) for d, (x, y) in enumerate(zip(s, t)) if x != y)


def horizon(module: torch.nn.Module) -> int | None:
    """The shortest attention window ``module``'s config declares (transformers' ``sliding_window``,
    ``attention_chunk_size``), None if it declares none. Within it a sliding-window or chunked mask
    equals a causal one, so two traces within it cannot tell them apart: no length past it is
    derived from them (``Lengths.trace``)."""
    config = getattr(module, "config", None)
    found = [v for k in ("sliding_window", "attention_chunk_size") if isinstance(v := getattr(config, k, None), int) and v > 0]
    return min(found) if found else None


class Lengths:
    """Traces of a module's calls by structure; a new length derived from two (see the module docstring).
    ``horizon``: the model's shortest attention window (``horizon(module)``), if any."""

    def __init__(self, horizon: int | None = None):
        self.families: dict[tuple, Family] = {}
        self.horizon = horizon

    def trace(self, args: tuple, kwargs: dict, mode: Any, trace: Callable[[], Any],
              eager: Callable[[Any], bool] = lambda traced: False) -> Any:
        """The ``Traced`` of this call: derived when its family allows, else ``trace()``.
        ``eager(traced)``: whether the program made from ``traced`` will be checked against the
        model run eagerly before it runs, with the outcome reported to ``settle``; then the first
        derived program needs no confirming trace."""
        key, shapes = _structure(args, kwargs, mode)
        family = self.families.setdefault(key, Family())
        n = family.length_of(shapes)
        if family.why or n is None or len(family.traces) < 2:
            traced = trace()
            family.add(shapes, traced)
            return traced
        (a, ta), (b, tb) = family.traces
        if self.horizon is not None and n > self.horizon >= max(a, b):
            # both traces are within the window, where its mask looks causal: past it they differ. This
            # length is traced and the family starts again from it (two traces past the window show it)
            traced = trace()
            self.families[key] = Family()
            self.families[key].add(shapes, traced)
            return traced
        start = time.perf_counter()
        try:
            derived = derive(ta, tb, a, b, n)
        except NotDerivable as e:
            family.why = str(e)
            return trace()
        seconds = time.perf_counter() - start
        derived = replace(derived, seconds=seconds, how=f"derived at length {n} from the traces at {a} and {b} ({seconds:.2f} s)")
        if not family.checked and not eager(derived):  # no eager check stands behind it: a real trace does
            traced = trace()
            diff = same_program(derived, traced)
            if diff:
                family.why = f"the program derived at length {n} differs from its trace: {diff}"
            family.checked = not diff
            return traced
        family.derived += 1
        family.lengths.add(n)
        return derived

    def settle(self, args: tuple, kwargs: dict, mode: Any, failure: str = "") -> str:
        """The outcome of the eager check of this call's program (``failure``: what differed, or
        what kept it from comparing; "" when it passed). Returns why the program must be traced
        instead when it was derived and failed (its family derives no more), else ""."""
        key, shapes = _structure(args, kwargs, mode)
        family = self.families.get(key)
        n = family.length_of(shapes) if family is not None else None
        if n is None or n not in family.lengths:
            return ""  # a traced program: its check's failure is the caller's to raise
        if not failure:
            family.checked = True
            return ""
        family.lengths.discard(n)
        family.derived -= 1
        family.why = f"the program derived at length {n} differs from the model run eagerly: {failure}"
        return family.why


def _structure(args: tuple, kwargs: dict, mode: Any) -> tuple[tuple, list[tuple[int, ...]]]:
    """(a call's structure without its sizes, each tensor leaf's shape)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    kinds, shapes = [], []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            kinds.append((x.ndim, x.dtype, x.device.type))
            shapes.append(tuple(x.shape))
        else:
            kinds.append(("value", repr(x)))
    return (mode, str(spec), tuple(kinds)), shapes


def derive(ta: Any, tb: Any, a: int, b: int, c: int) -> Any:
    """The ``Traced`` at length ``c`` from the ones at ``a`` and ``b`` (``nvtp.driver.Traced``);
    raises ``NotDerivable`` naming the first difference that is not a size following n."""
    if a == b:
        raise NotDerivable(f"two traces at the same length {a}")
    fit = _Fit(a, b, c)
    forward = fit.fusion(ta.forward, tb.forward)
    backward = None
    if (ta.backward is None) != (tb.backward is None):
        raise NotDerivable("one trace has a backward, the other not")
    if ta.backward is not None:
        backward = fit.fusion(ta.backward, tb.backward)
    call = ta.call
    if call is not None:
        constants = {k: _constant(k, v, tb.call.constants[k], fit) for k, v in call.constants.items()}
        if set(constants) != set(tb.call.constants):
            raise NotDerivable("the folded constants differ")
        call = replace(call, constants=constants)
    return replace(ta, forward=forward, backward=backward, call=call)


class _Fit:
    """Sizes at ``c`` from sizes at ``a`` and ``b``: ``p*n + q`` with integers p and q."""

    def __init__(self, a: int, b: int, c: int):
        self.a, self.b, self.c = a, b, c

    def size(self, x: int, y: int, where: str) -> int:
        if x == y:
            return x
        p, r = divmod(y - x, self.b - self.a)
        if r:
            raise NotDerivable(f"{where}: {x} at length {self.a} and {y} at {self.b} is no whole multiple of the length plus a constant")
        return x + p * (self.c - self.a)

    def literal(self, x: Any, y: Any, where: str, sizes: bool) -> Any:
        """The argument at ``c`` (``sizes``: the argument holds sizes, which may follow n)."""
        if isinstance(x, tuple) and isinstance(y, tuple) and len(x) == len(y):
            return tuple(self.literal(u, v, f"{where}[{i}]", sizes) for i, (u, v) in enumerate(zip(x, y)))
        if x == y and type(x) is type(y):
            return x
        if sizes and type(x) is int and type(y) is int:
            return self.size(x, y, where)
        raise NotDerivable(f"{where}: {x!r} at length {self.a}, {y!r} at {self.b}")

    def fusion(self, fa: Fusion, fb: Fusion) -> Fusion:
        if len(fa.ops) != len(fb.ops) or [v.name for v in fa.outputs] != [v.name for v in fb.outputs]:
            raise NotDerivable(f"{fa.name}: {len(fa.ops)} ops at length {self.a}, {len(fb.ops)} at {self.b}")
        values: dict[str, Any] = {}
        ops = []
        for x, y in zip(fa.ops, fb.ops):
            ops.append(self.op(x, y, values))
        outputs = tuple(values[v.name] for v in fa.outputs)
        return verify(replace(fa, ops=tuple(ops), outputs=outputs))

    def op(self, x: Op, y: Op, values: dict[str, Any]) -> Op:
        where = f"{x.outputs[0].name if x.outputs else ''} = {x.kind}"
        if x.kind != y.kind or [k for k, _ in x.args] != [k for k, _ in y.args] or \
                [(v.name, v.dtype) for v in x.outputs] != [(v.name, v.dtype) for v in y.outputs]:
            raise NotDerivable(f"{where} at length {self.a} is {y.kind} at {self.b}")
        params = {p.name: p for p in opstable.spec(x.kind).params}
        kwargs = {}
        for (k, u), (_, v) in zip(x.args, y.args):
            if is_value(u) or (isinstance(u, tuple) and any(is_value(e) for e in u)):
                kwargs[k] = self.operands(u, v, values, f"{where} {k}")
            else:
                sizes = params[k].kind == "shape" or (x.kind, k) in _SIZES or (x.kind == "define_tensor" and k == "shape")
                kwargs[k] = self.literal(u, v, f"{where} {k}", sizes)
        op = make_op(x.kind, (), kwargs, [o.name for o in x.outputs])
        for o, oa, ob in zip(op.outputs, x.outputs, y.outputs):
            if len(oa.shape) != len(ob.shape) or len(o.shape) != len(oa.shape):
                raise NotDerivable(f"{where}: results of different ranks")
            want = tuple(self.size(p, q, f"{where} result {o.name}") for p, q in zip(oa.shape, ob.shape))
            if tuple(o.shape) != want:
                raise NotDerivable(f"{where}: result {o.name} is {list(o.shape)} at length {self.c}, its traces say {list(want)}")
            values[o.name] = o
        return op

    def operands(self, u: Any, v: Any, values: dict[str, Any], where: str) -> Any:
        if isinstance(u, tuple):
            if not isinstance(v, tuple) or len(u) != len(v):
                raise NotDerivable(f"{where}: operand lists differ")
            return tuple(self.operands(p, q, values, where) for p, q in zip(u, v))
        if not is_value(u) or not is_value(v) or u.name != v.name:
            raise NotDerivable(f"{where}: operand {u} at length {self.a}, {v} at {self.b}")
        return values[u.name]


# -- the FX route's folded constants --------------------------------------------------------------


def _constant(label: str, x: torch.Tensor, y: torch.Tensor, fit: _Fit) -> torch.Tensor:
    """The constant ``label`` at length ``c``, from its values at ``a`` (``x``) and ``b`` (``y``)."""
    if x.dtype != y.dtype or x.ndim != y.ndim:
        raise NotDerivable(f"constant {label}: {x.dtype}{list(x.shape)} and {y.dtype}{list(y.shape)}")
    shape = tuple(fit.size(p, q, f"constant {label}") for p, q in zip(x.shape, y.shape))
    if x.shape == y.shape and torch.equal(x, y):
        return x
    for pattern in _PATTERNS:
        px, py = pattern(x), pattern(y)
        if px is not None and px == py:
            return _make(pattern, px, shape, x.dtype)
    raise NotDerivable(f"constant {label} ({x.dtype}{list(x.shape)}) is no pattern nvtp regenerates at a new length")


def _arange(t: torch.Tensor) -> tuple | None:
    """("arange", axis, start, step, fill of the other axes) when ``t`` counts along one axis."""
    if t.ndim == 0 or t.dtype == torch.bool:
        return None
    axes = [d for d in range(t.ndim) if t.shape[d] > 1]
    if len(axes) != 1:
        return None
    d = axes[0]
    line = t.reshape(-1)
    start, step = line[0].item(), (line[1] - line[0]).item()
    want = start + step * torch.arange(line.numel(), dtype=torch.float64)
    return ("arange", d, start, step) if torch.equal(line.double(), want) else None


def _band(L: int, S: int, window: int | None) -> torch.Tensor:
    """Where query i (of L, the last L of S positions) reads key j: j <= i + (S - L), and within
    ``window`` positions of it when one is given (a sliding-window mask)."""
    j, i = torch.arange(S)[None, :], torch.arange(L)[:, None] + (S - L)
    return (j <= i) & (j > i - window) if window is not None else j <= i


def _causal(t: torch.Tensor) -> tuple | None:
    """("causal", kept, masked, window) when ``t``'s last two axes hold ``kept`` where ``_band``
    keeps a key and ``masked`` elsewhere: window None for a causal mask, else the sliding window
    (the keys the last query reads, fewer than S). A window as long as the traced sequences or
    longer looks causal at those lengths: a window the model's config declares is known
    (``horizon``) and no length past it is derived from traces within it; for one only the code
    knows, the check of the first derived program against a trace and nvtp.guard's check of each
    program against eager stand behind it."""
    if t.ndim < 2:
        return None
    L, S = t.shape[-2:]
    flat = t.reshape(-1, L, S)
    if not (flat == flat[0]).all():
        return None
    m = flat[0]
    kept_value = m[-1, -1]
    width = int((m[-1] == kept_value).sum())
    window = width if width < S else None
    keep = _band(L, S, window)
    kept, masked = m[keep], m[~keep]
    if kept.numel() == 0 or masked.numel() == 0 or not (kept == kept[0]).all() or not (masked == masked[0]).all():
        return None
    return ("causal", kept[0].item(), masked[0].item(), window)


_PATTERNS = (_arange, _causal)


def _make(pattern: Callable, p: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if p[0] == "arange":
        _, d, start, step = p
        n = shape[d]
        line = (start + step * torch.arange(n, dtype=torch.float64)).to(dtype)
        view = [1] * len(shape)
        view[d] = n
        return line.reshape(view).expand(shape).contiguous()
    _, kept, masked, window = p
    L, S = shape[-2:]
    out = torch.where(_band(L, S, window), torch.tensor(kept, dtype=dtype), torch.tensor(masked, dtype=dtype))
    return out.expand(shape).contiguous()


def same_program(x: Any, y: Any) -> str:
    """"" when two ``Traced`` hold the same fusions (and constants), else the first difference."""
    for what, f, g in (("forward", x.forward, y.forward), ("backward", x.backward, y.backward)):
        if (f is None) != (g is None):
            return f"{what}: one is missing"
        if f is None:
            continue
        if len(f.ops) != len(g.ops):
            return f"{what}: {len(f.ops)} ops against {len(g.ops)}"
        for p, q in zip(f.ops, g.ops):
            if p != q:
                return f"{what}: {p} against {q}"
        if [v.name for v in f.outputs] != [v.name for v in g.outputs]:
            return f"{what}: outputs differ"
    if x.call is not None:
        for k, v in x.call.constants.items():
            w = y.call.constants.get(k)
            if w is None or v.shape != w.shape or v.dtype != w.dtype or not torch.equal(v, w):
                return f"constant {k} differs"
    return ""
