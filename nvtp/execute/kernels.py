"""A rank's program lowered to torch's fused kernels: the ``compile="kernels"`` pass.

Thunder hands nvtp a model's loss, embedding and norms as nvFuser's primitives; on a GPU nvFuser
fuses them, on a CPU the reference backend would run them one by one. This pass runs over each
lowered fusion of a rank's program (``lower.lower``'s matching form, op kinds as fx targets)
before it runs, and replaces each group that has a fused aten kernel by one call of it:

=====================  ===================================================  ==================================
pattern                the group, as Thunder decomposes it                  kernel (what eager PyTorch calls)
=====================  ===================================================  ==================================
log_softmax            max, inf-guard, sub, exp, sum, log, add, sub         ``aten._log_softmax``
nll_loss               neg, ne(ignore), where, take_along_axis, sums, div   ``aten.nll_loss_forward`` (mean)
nll_loss_sum           the same up to the sum (dp: the division after         ``aten.nll_loss_forward`` (sum)
                       the all-reduces)
nll_loss_backward      iota, eq (one-hot), ne, logical_and, div, where      ``aten.nll_loss_backward``
log_softmax_backward   sum, exp, mul, sub                                   ``aten._log_softmax_backward_data``
embedding_backward     iota, eq (one-hot), [ne padding], cast, matmul       ``aten.embedding_dense_backward``
rms_norm               pow, sum, div, add eps, rsqrt, mul, mul weight       ``aten._fused_rms_norm``
rms_norm_backward      the twelve ops of its input gradient                 its arithmetic in five torch calls
silu                   neg, exp, add 1, reciprocal, mul                     ``aten.silu``
silu_backward          neg, exp, add, div, sub, mul, add, mul, mul          ``aten.silu_backward``
gelu                   tanh-GELU with ``pow(x, 3.0)`` (transformers'        ``aten.gelu(approximate="tanh")``
                       ``gelu_new``; patterns.py has ``x * x * x``)
gelu_backward          its backward, with ``pow(x, 2.0)``                   ``aten.gelu_backward``
gelu_erf               the exact GELU, ``x * (0.5 + 0.5 erf(x / sqrt 2))``   ``aten.gelu``
gelu_erf_backward      its backward (erf, exp(-u^2), products)              ``aten.gelu_backward``
causal_attention       √scale muls, matmul, iota ``ge`` mask, where,        ``F.scaled_dot_product_attention``
                       softmax, matmul (``attention_kernel.py``)             (is_causal), or its math when the
                                                                            backward keeps the probabilities
flash_attention        ``sdpfa_fwd`` without bias, mask or dropout (the     ``aten._scaled_dot_product_flash_``
                       reference backend's trace claims attention whole)    ``attention_for_cpu``
flash_attention_       ``sdpfa_bwd`` likewise, from (out, logsumexp)        its ``_backward``
backward
=====================  ===================================================  ==================================

together with the LayerNorm, tanh-GELU and softmax patterns of ``patterns.py`` (which also
holds the matching machinery: each pattern is an fx graph of op kinds, matched by fx's
``SubgraphMatcher``, then a *check* on shapes, reduced axes, constants and placements decides).
A pattern takes a group whose values are whole on this rank, or split over ranks only along rows
the kernel treats independently (``by_rows``: the batch over dp, the sequence), never along the
axis it reduces or indexes, and with no partial sum but the sums over those rows it makes from
this rank's rows as the ops do (the nll loss's sum on dp, ``nll_loss_sum``; the embedding's
gradient): there each rank runs the kernel on its rows. A group spread over ranks otherwise keeps
its ops and collectives. Placements on a mesh axis of one rank are whole. ``set`` ops that
move nothing (one rank, or the same placements on both sides) are taken out first, so a loss
that a mesh of one still brackets with ``set`` ops matches as on one device.

A pattern that does not match costs speed, never correctness: the ops then run one by one. The
interpreter (``compile="none"``) stays the independent reference the tests compare against.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.fx as fx

from nvtp.execute import patterns
from nvtp.execute.attention_kernel import ATTENTION
from nvtp.execute.lower import kind_target
from nvtp.execute.patterns import Builder, Match, Pattern, pattern, reduced, same_float
from nvtp.ir.graph import Op, TensorValue, Value
from nvtp.sharding.placements import axis_split, is_partial
from nvtp.errors import InputError

# The values of ``nvtp.jit(..., compile=...)``: what runs each rank's fusions on the reference backend.
MODES = {
    "kernels": "each group of ops that eager PyTorch runs as one kernel (cross-entropy, the embedding's gradient, layer and "
               "RMS norm, softmax, causal attention (torch's flash kernels), GELU, SiLU) runs as that kernel, the other ops one by one",
    "auto": "'inductor' where an earlier run compiled the program (its code read from nvtp's cache: a second or two), "
            "else 'kernels' while a background process compiles it for the next run; 'kernels' with NVTP_CACHE=0",
    "inductor": "the kernels, then each rank's compute between collectives and random draws compiled by torch's Inductor "
                "(faster steps; the first call compiles for tens of seconds, cached on disk by Inductor)",
    "none": "every op one by one, by its own implementation (the interpreter, slower)",
}
DEFAULT = "kernels"

KERNELS: list[Pattern] = []


def mode_problem(name: str, value: Any) -> str | None:
    """None if ``value`` is a value of ``compile=``, else what is wrong and the choices (the rule
    ``nvtp.options`` checks ``compile=`` by)."""
    if isinstance(value, str) and value in MODES:
        return None
    choices = "; ".join(f"{k!r}: {v}" for k, v in MODES.items())
    return f"{name}={value!r} is not a way nvtp runs a rank's program; choose one of {choices}"


def check_mode(mode: Any) -> str:
    """``mode`` if it is a value of ``compile=``; raises ``InputError`` saying the choices otherwise."""
    problem = mode_problem("compile", mode)
    if problem is not None:
        raise InputError(problem)
    return mode


def fuse(graph: fx.Graph, local_shape: Callable[[Value], tuple[int, ...]], sharding: Callable[[Value], Any],
         dtype: Callable[[Any], torch.dtype], local_set: Callable[[Op], bool], ranks: int,
         producer: Callable[[Value], Op | None], kept: Callable[[fx.Node], bool] = lambda n: False) -> dict[str, int]:
    """The pass: ``graph`` (``lower.lower``'s matching form) with its local ``set`` ops taken out
    (``local_set(op)``: the set moves nothing) and every group of ``patterns.PATTERNS`` and
    ``KERNELS`` (after ``ATTENTION``'s, which hold a softmax) replaced by its kernel.
    ``sharding(v)``: ``v``'s placements; on a mesh of one
    (``ranks`` 1) every placement holds the whole value, a partial sum of one part included.
    ``producer(v)``: the fusion's op that makes ``v`` (constants folded while lowering included).
    ``kept(node)``: an op node no kernel takes (an ep axis's expert rows, which run as their ops).
    Returns how many times each pattern fused (and ``"set"``: the sets taken out, when any)."""
    removed = 0
    target = kind_target("set")
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is target and local_set(node.meta["op"]):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            removed += 1
    if ranks == 1:
        sharding = _whole
    counts = patterns.fuse(graph, local_shape, sharding, dtype, ATTENTION + patterns.PATTERNS + KERNELS, producer, kept)
    return counts | ({"set": removed} if removed else {})


def _whole(v: Value) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# checks


def whole(m: Match) -> bool:
    """Every value ``m`` binds is whole on this rank: on every mesh axis, no split and no partial sum."""
    for v in m.values():
        for p in m.placements(v) or ():
            if p is not None and (is_partial(p) or axis_split(p) is not None):
                return False
    return True


def by_rows(m: Match, d: int, ndim: int, partial: tuple[str, ...] = (), only: dict[str, set[int]] | None = None) -> bool:
    """Every value ``m`` binds is, on every mesh axis, whole or split along its rows: a value of
    rank ``ndim`` never along axis ``d`` (the axis the kernel reduces or indexes), one named in
    ``only`` only along the axes given there; a partial sum only where ``partial`` names it (a sum
    over the rows, which the kernel makes from this rank's rows as the ops do). A group whose rows
    are spread over ranks (the batch over dp, the sequence) is the kernel on each rank's rows."""
    allowed = {m[k].name: axes for k, axes in (only or {}).items()}
    partial_ok = {m[k].name for k in partial}
    for v in m.values():
        for p in m.placements(v) or ():
            if p is None:
                continue
            if is_partial(p):
                if v.name in partial_ok:
                    continue
                return False
            split = axis_split(p)
            if split is None:
                continue
            if (split[0] not in allowed[v.name]) if v.name in allowed else (v.ndim == ndim and split[0] == d):
                return False
    return True


def _literal(m: Match, name: str) -> Any:
    """The literal ``name`` bound (a number), or None where a value is bound."""
    x = m[name]
    return None if isinstance(x, Value) else x


def _one_axis(m: Match, src: str, reduction: str, *broadcasts: str) -> int | None:
    """The one axis of ``src`` that ``reduction`` sums (or maxes) away, where each of
    ``broadcasts`` puts the result back on the other axes; None otherwise."""
    s = m[src]
    o = m.op_of(reduction)
    dims = reduced(o, s.ndim)
    if len(dims) != 1 or o.arg("keepdim"):
        return None
    (d,) = dims
    others = [i for i in range(s.ndim) if i != d]
    keep = tuple(1 if i == d else n for i, n in enumerate(s.shape))
    for b in broadcasts:
        shape = tuple(m[b].shape)
        if shape not in (keep, tuple(s.shape)) or m.chain(b, reduction) != others:
            return None
    return d


def _column_index(m: Match, name: str, shape: tuple[int, int]) -> bool:
    """``name`` (an op result, or a constant folded while lowering) is ``broadcast_in_dim(iota(v,
    start=0, step=1), shape, broadcast_dims=[1])``: each row of ``shape`` = (n, v) counts 0 .. v-1."""
    x = m[name]
    b = m.producer(x) if isinstance(x, Value) else None
    if b is None or b.kind != "broadcast_in_dim" or tuple(x.shape) != shape or list(b.arg("broadcast_dims")) != [1]:
        return False
    i = m.producer(b.operands[0])
    return i is not None and i.kind == "iota" and i.arg("length") == shape[1] and i.arg("start") in (0, None) and \
        i.arg("step") in (1, None)


# log-softmax, forward and backward ---------------------------------------------------------------

def _log_softmax_pattern() -> Builder:
    b = Builder()
    x = b.leaf("x")
    max_k = b.bcast(b.max(x, name="max"), name="max_k")
    shift = b.where(b.eq(b.abs(max_k), math.inf), 0.0, max_k, name="shift")  # a row of -inf shifts by 0
    e = b.exp(b.sub(x, b.bcast(shift, name="shift_full")))
    lse = b.add(b.log(b.bcast(b.sum(e, name="sum"), name="sum_k")), shift, name="lse")
    return b.done(b.sub(x, b.bcast(lse, name="lse_full"), name="y"))


@pattern("log_softmax", _log_softmax_pattern(), KERNELS)
def _log_softmax_check(m: Match):
    x = m["x"]
    d = _one_axis(m, "x", "max", "max_k")
    if d is None or _one_axis(m, "x", "sum", "sum_k") != d or not same_float(x, m["y"]) or not by_rows(m, d, x.ndim):
        return None
    for full, part in (("shift_full", "shift"), ("lse_full", "lse")):
        if tuple(m[full].shape) != tuple(x.shape) or m.chain(full, part) != list(range(x.ndim)):
            return None
    return ["x"], {"y": "y"}, lambda x: {"y": torch.log_softmax(x, d)}


def _log_softmax_backward_pattern() -> Builder:
    b = Builder()
    dy, y = b.leaf("grad"), b.leaf("y")
    total = b.bcast(b.sum(dy, name="sum"), 2, name="sum_full")
    return b.done(b.sub(dy, b.mul(b.exp(y), total), name="dx"))


@pattern("log_softmax_backward", _log_softmax_backward_pattern(), KERNELS)
def _log_softmax_backward_check(m: Match):
    dy, y = m["grad"], m["y"]
    d = _one_axis(m, "grad", "sum", "sum_full")
    if d is None or not same_float(dy, y, m["dx"]) or dy.shape != y.shape or not by_rows(m, d, dy.ndim):
        return None
    dtype = y.dtype.torch
    backward = torch.ops.aten._log_softmax_backward_data.default
    return ["grad", "y"], {"dx": "dx"}, lambda grad, y: {"dx": backward(grad, y, d, dtype)}


# nll-loss (mean over the targets not ignored), forward and backward ------------------------------

def _nll_loss_pattern() -> Builder:
    b = Builder()
    logp, target = b.leaf("logp"), b.leaf("target")
    t = b.bcast(target, name="target_k")
    valid = b.ne(t, b.leaf("ignore"), name="valid")
    picked = b.take_along_axis(b.neg(logp), b.where(valid, t, 0), name="picked")
    total = b.sum(b.where(valid, picked, 0.0), name="total")
    count = b.sum(b.cast(valid), name="count")
    return b.done(b.div(total, b.cast(count), name="loss"))


@pattern("nll_loss", _nll_loss_pattern(), KERNELS)
def _nll_loss_check(m: Match):
    logp, target, ignore = m["logp"], m["target"], _literal(m, "ignore")
    if not isinstance(ignore, int) or not same_float(logp, m["loss"]) or logp.ndim != 2 or not whole(m):
        return None
    n = logp.shape[0]
    if not isinstance(target, TensorValue) or target.dtype.is_float or tuple(target.shape) != (n,):
        return None
    if tuple(m["target_k"].shape) != (n, 1) or m.chain("target_k", "target") != [0] or m.op_of("picked").arg("dim") != 1:
        return None
    if any(reduced(m.op_of(s), 2) != {0, 1} for s in ("total", "count")) or m["count"].dtype.is_float:
        return None
    forward = torch.ops.aten.nll_loss_forward.default

    def kernel(logp, target):
        loss, _ = forward(logp, target, None, 1, ignore)  # 1: the mean over the targets not ignored
        return {"loss": loss, "count": (target != ignore).sum()}

    return ["logp", "target"], {"loss": "loss", "count": "count"}, kernel


def _nll_loss_sum_pattern() -> Builder:
    """The nll loss's sum alone: where the rows are spread over ranks (dp), each rank sums its
    rows and the sum and the count are all-reduced before the division, so no ``div`` follows."""
    b = Builder()
    logp, target = b.leaf("logp"), b.leaf("target")
    t = b.bcast(target, name="target_k")
    valid = b.ne(t, b.leaf("ignore"), name="valid")
    picked = b.take_along_axis(b.neg(logp), b.where(valid, t, 0), name="picked")
    return b.done(b.sum(b.where(valid, picked, 0.0), name="total"))


@pattern("nll_loss_sum", _nll_loss_sum_pattern(), KERNELS)
def _nll_loss_sum_check(m: Match):
    logp, target, ignore = m["logp"], m["target"], _literal(m, "ignore")
    if not isinstance(ignore, int) or not same_float(logp, m["total"]) or logp.ndim != 2:
        return None
    n = logp.shape[0]
    if not isinstance(target, TensorValue) or target.dtype.is_float or tuple(target.shape) != (n,):
        return None
    if tuple(m["target_k"].shape) != (n, 1) or m.chain("target_k", "target") != [0] or m.op_of("picked").arg("dim") != 1:
        return None
    if reduced(m.op_of("total"), 2) != {0, 1} or not by_rows(m, 1, 2, partial=("total",)):
        return None
    forward = torch.ops.aten.nll_loss_forward.default
    return ["logp", "target"], {"total": "total"}, lambda logp, target: {"total": forward(logp, target, None, 2, ignore)[0]}  # 2: the sum


def _nll_loss_backward_pattern() -> Builder:
    b = Builder()
    target = b.leaf("target")
    one_hot = b.eq(b.bcast(target, name="target_full"), b.leaf("columns"))
    valid = b.bcast(b.ne(target, b.leaf("ignore"), name="valid"), name="valid_full")
    scale = b.div(b.neg(b.leaf("grad")), b.leaf("count"), name="scale")
    return b.done(b.where(b.logical_and(one_hot, valid), b.bcast(scale, name="scale_full"), 0.0, name="dlogp"))


@pattern("nll_loss_backward", _nll_loss_backward_pattern(), KERNELS)
def _nll_loss_backward_check(m: Match):
    target, grad, count, ignore, dlogp = m["target"], m["grad"], m["count"], _literal(m, "ignore"), m["dlogp"]
    if not isinstance(ignore, int) or not same_float(dlogp) or dlogp.ndim != 2 or not by_rows(m, 1, 2):
        return None
    n, v = dlogp.shape
    if not isinstance(target, TensorValue) or target.dtype.is_float or tuple(target.shape) != (n,):
        return None
    if not all(isinstance(x, TensorValue) and x.ndim == 0 for x in (grad, count)) or count.dtype.is_float or not grad.dtype.is_float:
        return None
    if not _column_index(m, "columns", (n, v)) or m.chain("target_full", "target") != [0] or \
            m.chain("valid_full", "valid") != [0] or m.chain("scale_full", "scale") != []:
        return None
    backward = torch.ops.aten.nll_loss_backward.default
    dtype = dlogp.dtype.torch

    def kernel(target, grad, count):
        # Read for its shape only: a broadcast zero, made from grad so that a trace of this kernel
        # (compile="inductor") records it as ops, not as a constant of uninitialised memory.
        like = grad.new_zeros(()).expand(target.shape[0], v)
        return {"dlogp": backward(grad, like, target, None, 1, ignore, count.to(grad.dtype)).to(dtype)}

    return ["target", "grad", "count"], {"dlogp": "dlogp"}, kernel


# the embedding's gradient: a one-hot matrix times the output's gradient --------------------------

def _embedding_backward_pattern(padded: bool) -> Builder:
    """``padded``: ``nn.Embedding(padding_idx=p)``, whose row p gets no gradient (``ne(index, p)``)."""
    b = Builder()
    index = b.bcast(b.leaf("index"), name="index_full")
    one_hot = b.eq(index, b.leaf("columns"))
    if padded:
        one_hot = b.logical_and(one_hot, b.ne(index, b.leaf("padding")))
    t = b.permute(b.cast(one_hot, name="one_hot"), name="t")
    return b.done(b.matmul(t, b.leaf("grad"), name="dw"))


def _embedding_backward_check(m: Match, padded: bool):
    index, grad, dw = m["index"], m["grad"], m["dw"]
    if not isinstance(index, TensorValue) or index.dtype.is_float or index.ndim != 1 or not same_float(grad, dw, m["one_hot"]):
        return None
    (n,) = index.shape
    if grad.ndim != 2 or grad.shape[0] != n or dw.ndim != 2:
        return None
    v = dw.shape[0]
    if not _column_index(m, "columns", (n, v)) or m.chain("index_full", "index") != [0] or \
            tuple(m.op_of("t").arg("dims")) != (1, 0) or not by_rows(m, 1, 2, partial=("dw",), only={"t": {1}, "dw": set()}):
        return None
    pad = _literal(m, "padding") if padded else -1
    if not isinstance(pad, int) or isinstance(pad, bool):
        return None
    pad = pad if 0 <= pad < v else -1  # an index outside the table is dropped below anyway
    backward = torch.ops.aten.embedding_dense_backward.default

    def kernel(index, grad):
        # An index no row has matches no one-hot column: it adds nothing. Masked without reading the
        # data (no branch on it), so the kernel traces into a graph Inductor compiles.
        keep = (index >= 0) & (index < v)
        grad = torch.where(keep.unsqueeze(-1), grad, 0)
        return {"dw": backward(grad, torch.where(keep, index, 0), v, pad, False)}

    return ["index", "grad"], {"dw": "dw"}, kernel


for _padded in (False, True):
    pattern("embedding_backward", _embedding_backward_pattern(_padded), KERNELS)(
        lambda m, padded=_padded: _embedding_backward_check(m, padded))


# RMSNorm, forward and backward -------------------------------------------------------------------

def _rms_norm_pattern(weight_first: bool) -> Builder:
    """``weight_first``: ``w * xhat`` (transformers' Llama) or ``xhat * w`` (PyTorch's example Llama)."""
    b = Builder()
    x = b.leaf("x")
    mean = b.div(b.bcast(b.sum(b.pow(x, 2.0), name="sum"), name="sum_k"), b.leaf("n"))
    rstd = b.rsqrt(b.add(mean, b.leaf("eps")), name="rstd")
    xhat = b.mul(x, b.bcast(rstd, name="rstd_full"))
    w = b.bcast(b.leaf("w"), name="w_full")
    return b.done(b.mul(w, xhat, name="y") if weight_first else b.mul(xhat, w, name="y"))


def _norm_axis(m: Match, x: Value, w: Value) -> bool:
    """The last axis of ``x`` is the normalized one, ``w`` its weight."""
    return w.ndim == 1 and w.shape[0] == x.shape[-1] and m.chain("w_full", "w") == [x.ndim - 1] and \
        tuple(m["w_full"].shape) == tuple(x.shape)


def _rms_norm_check(m: Match):
    x, w, n, eps = m["x"], m["w"], _literal(m, "n"), _literal(m, "eps")
    if not same_float(x, w, m["y"], m["rstd"]) or not isinstance(eps, float) or not by_rows(m, x.ndim - 1, x.ndim, only={"w": set()}):
        return None
    if _one_axis(m, "x", "sum", "sum_k") != x.ndim - 1 or n is None or float(n) != float(x.shape[-1]) or not _norm_axis(m, x, w):
        return None
    if tuple(m["rstd_full"].shape) != tuple(x.shape) or m.chain("rstd_full", "rstd") != list(range(x.ndim)):
        return None
    norm = [x.shape[-1]]
    forward = torch.ops.aten._fused_rms_norm.default

    def kernel(x, w):
        y, rstd = forward(x, norm, w, eps)
        return {"y": y, "rstd": rstd}

    return ["x", "w"], {"y": "y", "rstd": "rstd"}, kernel


for _first in (True, False):
    pattern("rms_norm", _rms_norm_pattern(_first), KERNELS)(_rms_norm_check)


def _rms_norm_backward_pattern(residual: bool) -> Builder:
    """``residual``: the gradient arriving by the residual path added in between, ``(g + rd) + tail``
    (Thunder's order for PyTorch's example Llama), as the LayerNorm's backward has it."""
    b = Builder()
    x, dy, rstd = b.leaf("x"), b.leaf("dy"), b.leaf("rstd")
    dxhat = b.mul(b.bcast(b.leaf("w"), name="w_full"), dy)
    s1 = b.bcast(b.sum(b.mul(x, dxhat), name="s1"), name="s1_k")
    dmean = b.div(b.mul(b.mul(-0.5, s1), b.pow(rstd, 3.0)), b.leaf("n"))
    s2 = b.bcast(b.sum(dmean, name="s2"), 2, name="s2_full")
    dx_mean = b.mul(b.mul(s2, 2.0), b.pow(x, 1.0))
    rd = b.mul(b.bcast(rstd, name="rstd_full"), dxhat)
    if residual:
        return b.done(b.add(b.add(b.leaf("g"), rd), dx_mean, name="dx"))
    return b.done(b.add(rd, dx_mean, name="dx"))


def _rms_norm_backward_check(m: Match, residual: bool):
    x, dy, rstd, w, n = m["x"], m["dy"], m["rstd"], m["w"], _literal(m, "n")
    if not same_float(x, dy, rstd, w, m["dx"]) or x.shape != dy.shape or not _norm_axis(m, x, w) or \
            not by_rows(m, x.ndim - 1, x.ndim, only={"w": set()}):
        return None
    if residual and (not same_float(x, m["g"]) or tuple(m["g"].shape) != tuple(x.shape) or m.local_shape(m["g"]) != m.local_shape(x)):
        return None
    last = x.ndim - 1
    if tuple(rstd.shape) != tuple(x.shape[:-1]) + (1,) or n is None or float(n) != float(x.shape[-1]):
        return None
    if _one_axis(m, "x", "s1", "s1_k") != last or reduced(m.op_of("s2"), x.ndim) != {last} or m.op_of("s2").arg("keepdim"):
        return None
    if tuple(m["s2_full"].shape) != tuple(x.shape) or m.chain("s2_full", "s2") != list(range(last)):
        return None
    if tuple(m["rstd_full"].shape) != tuple(x.shape) or m.chain("rstd_full", "rstd") != list(range(x.ndim)):
        return None
    n = float(n)

    def kernel(x, dy, rstd, w, g=None):  # aten._fused_rms_norm_backward has no CPU kernel: its arithmetic, in five calls
        dxhat = w * dy
        s = (x * dxhat).sum(-1, keepdim=True)
        dx = rstd * dxhat - x * (s * rstd.pow(3) / n)
        return {"dx": dx if g is None else g + dx}

    return ["x", "dy", "rstd", "w"] + (["g"] if residual else []), {"dx": "dx"}, kernel


for _residual in (False, True):
    pattern("rms_norm_backward", _rms_norm_backward_pattern(_residual), KERNELS)(
        lambda m, residual=_residual: _rms_norm_backward_check(m, residual))


# SiLU, forward and backward (the gate of a SwiGLU MLP) -------------------------------------------

def _silu_pattern() -> Builder:
    b = Builder()
    x = b.leaf("x")
    return b.done(b.mul(x, b.reciprocal(b.add(1.0, b.exp(b.neg(x)))), name="y"))


def _silu_backward_pattern() -> Builder:
    b = Builder()
    x, g = b.leaf("x"), b.leaf("g")
    sig = b.div(1.0, b.add(1.0, b.exp(b.neg(x))))
    return b.done(b.mul(b.mul(g, sig), b.add(1.0, b.mul(x, b.sub(1.0, sig))), name="dx"))


def _pointwise(m: Match, *names: str) -> bool:
    vs = [m[n] for n in names]
    return same_float(*vs) and len({tuple(m.local_shape(v)) for v in vs}) == 1 and by_rows(m, -1, -1)  # split anyhow, no partial sum


def _pointwise_kernel(name: str, built: Builder, leaves: tuple[str, ...], out: str, fn: Callable[..., torch.Tensor]) -> None:
    """Register ``built`` as a pointwise group from ``leaves`` to ``out``, run as ``fn(*leaves)``."""

    def check(m: Match):
        if not _pointwise(m, *leaves, out):
            return None
        return list(leaves), {out: out}, lambda *xs: {out: fn(*xs)}

    pattern(name, built, KERNELS)(check)


_pointwise_kernel("silu", _silu_pattern(), ("x",), "y", torch.nn.functional.silu)
_pointwise_kernel("silu_backward", _silu_backward_pattern(), ("x", "g"), "dx", lambda x, g: torch.ops.aten.silu_backward.default(g, x))


# tanh-GELU as transformers' NewGELUActivation writes it: x ** 3 (patterns.py's: x * x * x) ------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def _gelu_pow_pattern() -> Builder:
    b = Builder()
    x = b.leaf("x")
    t = b.tanh(b.mul(_SQRT_2_OVER_PI, b.add(x, b.mul(_KAPPA, b.pow(x, 3.0)))))
    return b.done(b.mul(b.mul(0.5, x), b.add(1.0, t), name="y"))


def _gelu_pow_backward_pattern() -> Builder:
    b = Builder()
    x, g = b.leaf("x"), b.leaf("g")
    t = b.tanh(b.mul(_SQRT_2_OVER_PI, b.add(x, b.mul(_KAPPA, b.pow(x, 3.0)))))
    d_inner = b.mul(_SQRT_2_OVER_PI, b.mul(b.mul(b.mul(0.5, x), g), b.sub(1.0, b.mul(t, t))))
    cube = b.mul(b.mul(b.mul(_KAPPA, d_inner), 3.0), b.pow(x, 2.0))
    return b.done(b.add(b.add(d_inner, cube), b.mul(0.5, b.mul(b.add(1.0, t), g)), name="dx"))


_pointwise_kernel("gelu", _gelu_pow_pattern(), ("x",), "y", lambda x: torch.nn.functional.gelu(x, approximate="tanh"))
_pointwise_kernel("gelu_backward", _gelu_pow_backward_pattern(), ("x", "g"), "dx",
                  lambda x, g: torch.ops.aten.gelu_backward.default(g, x, approximate="tanh"))


# The exact GELU, erf's (``F.gelu(x)``: GPT-NeoX / Pythia, BERT), forward and backward -------------

_SQRT_2 = 1.4142135623730951
_TWO_OVER_SQRT_PI = 1.1283791670955126


def _gelu_erf_pattern() -> Builder:
    b = Builder()
    x = b.leaf("x")
    return b.done(b.mul(x, b.add(0.5, b.mul(0.5, b.erf(b.div(x, _SQRT_2)))), name="y"))


def _gelu_erf_backward_pattern() -> Builder:
    """``dx = g * (0.5 + 0.5 erf(u)) + (2 / sqrt(pi)) exp(-u^2) * 0.5 * x * g / sqrt 2``, u = x / sqrt 2."""
    b = Builder()
    x, g = b.leaf("x"), b.leaf("g")
    u = b.div(x, _SQRT_2)
    left = b.mul(b.add(0.5, b.mul(0.5, b.erf(u))), g)
    bell = b.mul(_TWO_OVER_SQRT_PI, b.exp(b.neg(b.pow(u, 2.0))))
    right = b.div(b.mul(bell, b.mul(0.5, b.mul(x, g))), _SQRT_2)
    return b.done(b.add(left, right, name="dx"))


_pointwise_kernel("gelu_erf", _gelu_erf_pattern(), ("x",), "y", torch.nn.functional.gelu)
_pointwise_kernel("gelu_erf_backward", _gelu_erf_backward_pattern(), ("x", "g"), "dx",
                  lambda x, g: torch.ops.aten.gelu_backward.default(g, x))
