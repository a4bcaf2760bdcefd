"""Complex arithmetic written as real arithmetic, in Thunder's trace, before its autodiff.

Rotary embeddings are often written with complex numbers (Llama's reference code, PyTorch's
TP example ``llama2_model.py``)::

    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)      # freqs_cis = torch.polar(1, theta)

Neither nvtp's op table nor Thunder's fusion executors take ``view_as_complex``/``view_as_real``,
and Thunder 0.2.6 differentiates a complex ``mul`` without conjugating (``thunder.jit`` alone
gives ``xq``'s gradient wrong). ``ComplexAsReal`` is a ``thunder.Transform`` whose
``transform_traces_pre_prologue`` rewrites the computation trace before the autodiff sees it:
a complex tensor of shape ``[*s]`` becomes a real *pair* tensor ``[*s, 2]`` (real part, imaginary
part along a trailing axis, the layout of ``torch.view_as_real``), and each complex op becomes
real ops on pairs (``RULES``): multiply is ``(ac - bd, ad + bc)``, ``polar(r, t)`` is
``(r cos t, r sin t)``, ``view_as_complex``/``view_as_real`` are the identity, reshapes get the
pair axis appended. Thunder then differentiates real ops only, so the backward is exact too.

A complex tensor that enters the computation (a buffer such as ``freqs_cis``, or an argument)
is read through one ``view_as_real``; nvtp's executor translates that to nothing: the fusion's
input *is* the pair (``translate.complex_input``), and the backends feed a complex tensor to
such an input as its ``torch.view_as_real`` view (``nvtp.ir.dtypes.as_input``).

A complex op without a rule is refused here (``CaptureError``), naming the op, the model's
source line and what to write instead; nothing complex is left for other executors.
"""

from __future__ import annotations

from numbers import Number
from typing import Any, Callable

import thunder
import thunder.torch as ltorch
from thunder.core import dtypes as tdtypes
from thunder.core.prims import PrimIDs
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.pytree import tree_flatten, tree_map
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx

from nvtp.frontend.failures import CaptureError

Rule = Callable[["_Rewrite", BoundSymbol], Any]
RULES: dict[str, Rule] = {}


def _rule(*symbols: Any) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for s in symbols:
            key = s if isinstance(s, str) else s.id
            if key in RULES:
                raise ValueError(f"complex rule for {key} registered twice")
            RULES[key] = fn
        return fn

    return deco


def is_complex(x: Any) -> bool:
    """A complex tensor proxy or a Python complex number."""
    if isinstance(x, TensorProxy):
        return tdtypes.is_complex_dtype(x.dtype)
    return isinstance(x, complex)


def involves_complex(bsym: BoundSymbol) -> bool:
    flat_args, _ = tree_flatten((bsym.args, bsym.kwargs))
    outs, _ = tree_flatten(bsym.output)
    return any(is_complex(x) for x in (*flat_args, *outs))


def _source(bsym: BoundSymbol) -> str:
    if bsym.source_filename and bsym.source_positions is not None:
        return f"{bsym.source_filename}:{bsym.source_positions.lineno}"
    return bsym.source_filename or "(no source line)"


def _refuse(bsym: BoundSymbol, why: str) -> Exception:
    return CaptureError(
        f"{bsym.sym.name} at {_source(bsym)}: {why}. nvtp writes complex arithmetic as real arithmetic "
        "(nvtp/frontend/complex.py, RULES) and has no rule for this; write it on real tensors with the real and "
        "imaginary parts along a trailing axis of 2 (torch.view_as_real's layout), or add a rule"
    )


class _Rewrite:
    """The state of one rewrite: each old proxy's new value, and the pair each complex input got."""

    def __init__(self, trace: TraceCtx):
        self.trace = trace
        self.swap: dict[Any, Any] = {}  # variableify(old proxy) -> new proxy
        self.inputs_as_pairs: dict[str, TensorProxy] = {}
        self.split: dict[str, tuple[TensorProxy, TensorProxy]] = {}  # a pair's name -> its (real, imaginary) parts

    def value(self, x: Any) -> Any:
        """``x`` (an old proxy, number or structure of them) as the rewritten trace has it."""
        return tree_map(lambda p: self.swap.get(variableify(p), p) if isinstance(p, TensorProxy) else p, x)

    def pair(self, x: TensorProxy) -> TensorProxy:
        """The real pair tensor ``[*s, 2]`` of the old complex tensor ``x``."""
        new = self.value(x)
        if tdtypes.is_complex_dtype(new.dtype):  # a complex tensor the computation takes: read it once
            if new.name not in self.inputs_as_pairs:
                self.inputs_as_pairs[new.name] = ltorch.view_as_real(new)
            new = self.inputs_as_pairs[new.name]
        return new

    def parts(self, x: Any) -> tuple[Any, Any]:
        """(real part, imaginary part) of an operand: tensors or numbers; 0 for a real operand's imaginary part."""
        if isinstance(x, TensorProxy):
            if not tdtypes.is_complex_dtype(x.dtype):
                return self.value(x), 0
            p = self.pair(x)
            if p.name not in self.split:
                self.split[p.name] = ltorch.getitem(p, (..., 0)), ltorch.getitem(p, (..., 1))
            return self.split[p.name]
        if isinstance(x, complex):
            return x.real, x.imag
        return x, 0


def _join(re: Any, im: Any, out: TensorProxy) -> TensorProxy:
    """The pair ``[*out.shape, 2]`` of parts ``re`` and ``im`` (tensors or numbers, broadcast to
    ``out``, the complex result it stands for)."""
    return _stack(re, im, tuple(out.shape), tdtypes.corresponding_real_dtype(out.dtype), out.device)


def _stack(re: Any, im: Any, shape: tuple[int, ...], real: Any, device: Any) -> TensorProxy:

    def whole(t: Any) -> TensorProxy:
        if not isinstance(t, TensorProxy):
            return ltorch.full(shape, t, device=device, dtype=real)
        if tuple(t.shape) != shape:
            t = ltorch.expand(t, *shape)
        return t if t.dtype == real else ltorch.to(t, real)

    return ltorch.stack([whole(re), whole(im)], -1)


# Arithmetic on parts: numbers stay numbers, and a known zero drops its term (as a real operand's
# zero imaginary part), so complex * real is (a r, b r), as torch computes it.


def _is_zero(x: Any) -> bool:
    return isinstance(x, Number) and x == 0


def _mul(a: Any, b: Any) -> Any:
    if _is_zero(a) or _is_zero(b):
        return 0
    return ltorch.mul(a, b)


def _add(a: Any, b: Any) -> Any:
    if _is_zero(a):
        return b
    if _is_zero(b):
        return a
    return ltorch.add(a, b)


def _sub(a: Any, b: Any) -> Any:
    if _is_zero(b):
        return a
    if _is_zero(a):
        return ltorch.neg(b)
    return ltorch.sub(a, b)


def _scaled(x: Any, alpha: Any) -> Any:
    return x if alpha == 1 else _mul(x, alpha)


# -- complex from real, real from complex ------------------------------------------------------


@_rule(ltorch.view_as_complex)
def _view_as_complex(rw: _Rewrite, bsym: BoundSymbol):
    return rw.value(bsym.args[0])  # [*s, 2] real already is the pair


@_rule(ltorch.view_as_real)
def _view_as_real(rw: _Rewrite, bsym: BoundSymbol):
    return rw.pair(bsym.args[0])


@_rule(ltorch.polar)
def _polar(rw: _Rewrite, bsym: BoundSymbol):
    r, theta = (rw.value(a) for a in bsym.args[:2])
    return _join(_mul(r, ltorch.cos(theta)), _mul(r, ltorch.sin(theta)), bsym.output)


@_rule("torch.complex")
def _complex(rw: _Rewrite, bsym: BoundSymbol):
    re, im = (rw.value(a) for a in bsym.args[:2])
    return _join(re, im, bsym.output)


@_rule(ltorch.real)
def _real(rw: _Rewrite, bsym: BoundSymbol):
    return rw.parts(bsym.args[0])[0]


@_rule(ltorch.imag)
def _imag(rw: _Rewrite, bsym: BoundSymbol):
    return rw.parts(bsym.args[0])[1]


@_rule(ltorch.abs)
def _abs(rw: _Rewrite, bsym: BoundSymbol):
    re, im = rw.parts(bsym.args[0])
    return ltorch.sqrt(ltorch.add(ltorch.mul(re, re), ltorch.mul(im, im)))


@_rule(ltorch.angle)
def _angle(rw: _Rewrite, bsym: BoundSymbol):
    re, im = rw.parts(bsym.args[0])
    return ltorch.atan2(im, re)


# -- complex arithmetic ------------------------------------------------------------------------


@_rule(ltorch.mul)
def _complex_mul(rw: _Rewrite, bsym: BoundSymbol):
    (ar, ai), (br, bi) = rw.parts(bsym.args[0]), rw.parts(bsym.args[1])
    return _join(_sub(_mul(ar, br), _mul(ai, bi)), _add(_mul(ar, bi), _mul(ai, br)), bsym.output)


@_rule(ltorch.add, ltorch.sub)
def _complex_add(rw: _Rewrite, bsym: BoundSymbol):
    (ar, ai), (br, bi) = rw.parts(bsym.args[0]), rw.parts(bsym.args[1])
    alpha = bsym.kwargs.get("alpha", 1)
    if is_complex(alpha):
        raise _refuse(bsym, "a complex alpha")
    op = _add if bsym.sym.id == ltorch.add.id else _sub
    return _join(op(ar, _scaled(br, alpha)), op(ai, _scaled(bi, alpha)), bsym.output)


@_rule(ltorch.true_divide, ltorch.div)
def _complex_div(rw: _Rewrite, bsym: BoundSymbol):
    if bsym.kwargs.get("rounding_mode") is not None:
        raise _refuse(bsym, "a rounding mode on complex numbers")
    (ar, ai), (br, bi) = rw.parts(bsym.args[0]), rw.parts(bsym.args[1])
    if _is_zero(bi):  # by a real divisor: each part by it
        return _join(ltorch.true_divide(ar, br), _div_or_zero(ai, br), bsym.output)
    den = _add(_mul(br, br), _mul(bi, bi))
    re = _add(_mul(ar, br), _mul(ai, bi))
    im = _sub(_mul(ai, br), _mul(ar, bi))
    return _join(ltorch.true_divide(re, den), _div_or_zero(im, den), bsym.output)


def _div_or_zero(a: Any, b: Any) -> Any:
    return 0 if _is_zero(a) else ltorch.true_divide(a, b)


@_rule(ltorch.neg)
def _neg(rw: _Rewrite, bsym: BoundSymbol):
    return ltorch.neg(rw.pair(bsym.args[0]))


@_rule(ltorch.conj, "torch.conj_physical")
def _conj(rw: _Rewrite, bsym: BoundSymbol):
    re, im = rw.parts(bsym.args[0])
    return _join(re, ltorch.neg(im), bsym.output)


@_rule(ltorch.exp)
def _exp(rw: _Rewrite, bsym: BoundSymbol):
    re, im = rw.parts(bsym.args[0])
    r = ltorch.exp(re)
    return _join(_mul(r, ltorch.cos(im)), _mul(r, ltorch.sin(im)), bsym.output)


# -- layout: the pair axis rides along, last ----------------------------------------------------


def _same(rw: _Rewrite, bsym: BoundSymbol):
    return rw.value(bsym.args[0])  # a complex input stays itself (it may be returned: an attribute set in forward)


_rule(ltorch.contiguous, ltorch.clone, "torch.resolve_conj", "torch.resolve_neg")(_same)


@_rule(ltorch.reshape, ltorch.view, ltorch.flatten, ltorch.unsqueeze, ltorch.squeeze)
def _reshape(rw: _Rewrite, bsym: BoundSymbol):
    return ltorch.reshape(rw.pair(bsym.args[0]), *bsym.output.shape, 2)


@_rule(ltorch.expand, ltorch.expand_as)
def _expand(rw: _Rewrite, bsym: BoundSymbol):
    return ltorch.expand(rw.pair(bsym.args[0]), *bsym.output.shape, 2)


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


@_rule(ltorch.permute)
def _permute(rw: _Rewrite, bsym: BoundSymbol):
    a, *dims = bsym.args
    dims = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else tuple(dims)
    return ltorch.permute(rw.pair(a), *(_dim(d, a.ndim) for d in dims), a.ndim)


@_rule(ltorch.transpose)
def _transpose(rw: _Rewrite, bsym: BoundSymbol):
    a, d0, d1 = bsym.args
    return ltorch.transpose(rw.pair(a), _dim(d0, a.ndim), _dim(d1, a.ndim))


@_rule(ltorch.getitem)
def _getitem(rw: _Rewrite, bsym: BoundSymbol):
    a, key = bsym.args
    key = key if isinstance(key, tuple) else (key,)
    if any(is_complex(k) or (isinstance(k, TensorProxy) and k.dtype is not None and tdtypes.is_complex_dtype(k.dtype)) for k in key):
        raise _refuse(bsym, "indexing with a complex index")
    key = rw.value(key)
    if Ellipsis in key:  # indices after the ellipsis name the last complex axes, before the pair axis
        key = key + (slice(None),)
    return ltorch.getitem(rw.pair(a), key)


@_rule(ltorch.cat, ltorch.stack)
def _cat(rw: _Rewrite, bsym: BoundSymbol):
    tensors = bsym.args[0]
    dim = bsym.args[1] if len(bsym.args) > 1 else bsym.kwargs.get("dim", 0)
    out = bsym.output
    real = tdtypes.corresponding_real_dtype(out.dtype)
    pairs = [rw.pair(t) if is_complex(t) else _stack(rw.value(t), 0, tuple(t.shape), real, t.device) for t in tensors]
    fn = ltorch.cat if bsym.sym.id == ltorch.cat.id else ltorch.stack
    return fn(pairs, _dim(dim, out.ndim))


@_rule(ltorch.sum, ltorch.mean)
def _reduce(rw: _Rewrite, bsym: BoundSymbol):
    a = bsym.args[0]
    dim = bsym.args[1] if len(bsym.args) > 1 else bsym.kwargs.get("dim")
    keepdim = bsym.args[2] if len(bsym.args) > 2 else bsym.kwargs.get("keepdim", False)
    if bsym.kwargs.get("dtype") is not None:
        raise _refuse(bsym, "a dtype argument on a complex reduction")
    dims = list(range(a.ndim)) if dim is None else [dim] if isinstance(dim, int) else list(dim)
    return bsym.sym(rw.pair(a), [_dim(d, a.ndim) for d in dims], keepdim)


@_rule(ltorch.to, ltorch.type_as)
def _to(rw: _Rewrite, bsym: BoundSymbol):
    """A cast: complex to complex converts both parts, real to complex adds zeros, complex to real
    keeps the real part (as torch does, with its warning); moving between devices does nothing (one
    fusion runs on one device)."""
    a, out = bsym.args[0], bsym.output
    if not is_complex(a):  # real to complex: an imaginary part of zeros
        return _join(rw.value(a), 0, out)
    if is_complex(out):
        if out.dtype == a.dtype:
            return rw.value(a)  # as _same: `self.freqs_cis = self.freqs_cis.to(h.device)` returns the buffer itself
        return ltorch.to(rw.pair(a), tdtypes.corresponding_real_dtype(out.dtype))
    return ltorch.to(rw.parts(a)[0], out.dtype)


# -- the transform ----------------------------------------------------------------------------------

_KEEP = {PrimIDs.UNPACK_TRIVIAL, PrimIDs.UNPACK_SEQUENCE, PrimIDs.UNPACK_KEY, PrimIDs.UNPACK_EMPTY_DICT}


def complex_as_real(trace: TraceCtx) -> TraceCtx:
    """``trace`` with every complex op written as real ops on pairs (see the module docstring);
    ``trace`` itself when nothing in it is complex."""
    if not any(involves_complex(b) for b in trace.bound_symbols if b.sym.id not in _KEEP):
        return trace
    new = from_trace(trace)
    rw = _Rewrite(new)
    with tracectx(new):
        for bsym in trace.bound_symbols:
            if bsym.sym.id in _KEEP or not involves_complex(bsym):
                new.bound_symbols.append(bsym.from_bsym_swap_proxies(rw.swap) if rw.swap else bsym)
                continue
            if bsym.sym.id == PrimIDs.RETURN:  # a complex tensor returned must be one the computation took
                returned = bsym.from_bsym_swap_proxies(rw.swap)
                if any(is_complex(old) and not is_complex(new) for old, new in
                       zip(tree_flatten(bsym.args)[0], tree_flatten(returned.args)[0])):
                    raise _refuse(bsym, "the computation returns a complex tensor it computes; return torch.view_as_real of it")
                new.bound_symbols.append(returned)
                continue
            rule = RULES.get(bsym.sym.id)
            if rule is None:
                raise _refuse(bsym, f"a complex operation ({bsym.sym.id})")
            new.push_scope([])
            result = rule(rw, bsym)
            made = new.pop_scope()
            new.bound_symbols.extend(b.from_bsym(source_filename=bsym.source_filename, source_positions=bsym.source_positions)
                                     for b in made)
            if not isinstance(bsym.output, TensorProxy) or not isinstance(result, TensorProxy):
                raise _refuse(bsym, "an operation with other than one tensor result")
            if result is not bsym.output:
                rw.swap[variableify(bsym.output)] = result
    new.set_provenance(TraceProvenance("nvtp: complex arithmetic as real arithmetic"))
    return new


class ComplexAsReal(thunder.Transform):
    """The Thunder transform nvtp's capture runs: complex arithmetic as real, before autodiff."""

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        return prologue_trace, complex_as_real(computation_trace), epilogue_trace
