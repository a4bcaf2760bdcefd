"""Causal attention, as Thunder decomposes ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``
on a CPU, run as one torch call: a pattern of the ``compile="kernels"`` pass (``kernels.py``).

Thunder writes the attention as SDPA's math does: q and kᵀ each scaled by √scale, their product,
a causal mask built from two iotas (``ge(row, column)``), ``where(mask, s, -inf)``, a softmax and
the product with v::

    s = (q·√scale) @ (kᵀ·√scale)      p = softmax(where(row ≥ column, s, -inf))      y = p @ v

The check reads the mask through the fusion's producers (folded constants and ``set`` ops
included): it must be ``broadcast_in_dim(ge(i + c, j + c))`` of a row iota and a column iota on a
square [T, T], i.e. the lower triangle SDPA's ``is_causal=True`` keeps (a mask that is a fusion
input, as transformers' models pass theirs, is not matched). Two table entries, by what the
program reads:

* ``causal_attention``: p read only by ``p @ v`` (a forward whose backward does not keep p, e.g.
  under ``torch.no_grad()``): ``F.scaled_dot_product_attention(q, k, v, is_causal=True,
  scale=scale)``, torch's flash kernel on a CPU, which never writes p out and skips the masked half;
* ``causal_attention_probs``: p read elsewhere too (the backward keeps the probabilities, as
  Thunder's decomposition saves them): p must be written whole, so the kernel is SDPA's math in
  three calls (one product with the scale folded in, the mask applied in place, softmax) and
  y = p @ v: the same arithmetic as the decomposition up to rounding, without its scaled copies of
  q and kᵀ and its broadcast mask. A training step measured no faster with it than without
  (docs/benchmarks.md): flash's gain needs a program that hands the backward (out, logsumexp).

Where the trace claimed the attention whole (``sdpfa_fwd`` / ``sdpfa_bwd``: the reference
backend's trace, ``nvtp.frontend.attention.claim_flash``), two one-op entries run it as eager does:

* ``flash_attention``: ``sdpfa_fwd`` without bias, mask or dropout on a CPU:
  ``aten._scaled_dot_product_flash_attention_for_cpu``, which gives (out, logsumexp), the two
  tensors the backward reads (the philox seed and offset are zeros: no dropout draws);
* ``flash_attention_backward``: ``sdpfa_bwd`` likewise: its ``_backward`` from (out, logsumexp).
  Both logsumexps are natural-log ones of the scaled, masked scores, so either entry pairs with the
  other's op run by its implementation (``impls_nn``, the interpreter's formula).

The group is fused only where the sequence and head axes of every value are whole on this rank
(batch and heads may be split: attention is per head) and nothing is a partial sum.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from nvtp.execute.impls_nn import attention, attention_backward
from nvtp.execute.patterns import Builder, Match, Pattern, pattern, reduced, same_float
from nvtp.ir.graph import Value
from nvtp.sharding.placements import axis_split, is_partial

# Patterns that enclose a group of patterns.PATTERNS (attention holds a softmax): matched first.
ATTENTION: list[Pattern] = []


def _attention_pattern() -> Builder:
    b = Builder()
    q, k, v, mask = b.leaf("q"), b.leaf("k"), b.leaf("v"), b.leaf("mask")
    s = b.matmul(b.mul(q, b.leaf("q_scale")), b.mul(b.permute(k, name="kt"), b.leaf("k_scale")), name="s")
    w = b.where(mask, s, b.leaf("fill"), name="w")
    e = b.exp(b.sub(w, b.bcast(b.max(w, name="max"), 2, name="max_full")))
    p = b.div(e, b.bcast(b.sum(e, name="sum"), 2, name="sum_full"), name="p")
    return b.done(b.matmul(p, v, name="y"))


def _made_by(m: Match, v: Any):
    """The op that makes ``v``'s global value: its producer, read through ``set`` ops (a reshard
    moves parts, it changes no entry); None for a literal or an input."""
    o = m.producer(v) if isinstance(v, Value) else None
    while o is not None and o.kind == "set":
        o = m.producer(o.operands[0])
    return o


def _index(m: Match, v: Any) -> tuple[int, int] | None:
    """(axis, offset) where ``v``'s entry at index (i₀, i₁, ...) is i_axis + offset, read through
    iota, broadcast_in_dim and the addition of a whole number; None otherwise."""
    o = _made_by(m, v)
    if o is None:
        return None
    if o.kind == "iota" and o.arg("step") in (1, None) and isinstance(o.arg("start") or 0, int):
        return 0, o.arg("start") or 0
    if o.kind == "broadcast_in_dim":
        inner = _index(m, o.operands[0])
        return None if inner is None else (list(o.arg("broadcast_dims"))[inner[0]], inner[1])
    if o.kind == "add":
        lhs, rhs = o.arg("lhs"), o.arg("rhs")
        value, number = (lhs, rhs) if isinstance(rhs, int) and not isinstance(rhs, bool) else (rhs, lhs)
        inner = _index(m, value) if isinstance(number, int) and not isinstance(number, bool) else None
        return None if inner is None else (inner[0], inner[1] + number)
    return None


def _causal(m: Match, t: int) -> bool:
    """``mask`` keeps entry (.., i, j) of the [.., T, T] scores iff j <= i (``is_causal=True``)."""
    mask = m["mask"]
    b = _made_by(m, mask)
    if b is None or b.kind != "broadcast_in_dim" or list(b.arg("broadcast_dims")) != [mask.ndim - 2, mask.ndim - 1]:
        return False
    ge = _made_by(m, b.operands[0])
    if ge is None or ge.kind != "ge" or tuple(ge.outputs[0].shape) != (t, t):
        return False
    row, column = _index(m, ge.arg("lhs")), _index(m, ge.arg("rhs"))
    return row is not None and column is not None and row[0] == 0 and column[0] == 1 and row[1] == column[1]


def _heads_only_split(m: Match) -> bool:
    """No value is a partial sum, and a split is only along batch or heads (the first two axes of
    the [B, h, ...] values; the [T, T] mask and its iotas whole)."""
    for v in m.values():
        for p in m.placements(v) or ():
            if p is None:
                continue
            split = axis_split(p)
            if is_partial(p) or (split is not None and (split[0] >= 2 or v.ndim < 3)):
                return False
    return True


def _attention_check(m: Match, probs_read: bool):
    """The group as a kernel when it is causal attention and p is read elsewhere (``probs_read``) or not."""
    q, k, v, s, p, y = (m[n] for n in ("q", "k", "v", "s", "p", "y"))
    q_scale, k_scale, fill = (m[n] for n in ("q_scale", "k_scale", "fill"))
    if not same_float(q, k, v, s, p, y) or q.ndim != 4 or q.shape != k.shape or k.shape[:3] != v.shape[:3]:
        return None
    t = q.shape[2]
    if tuple(s.shape) != tuple(q.shape[:3]) + (t,) or tuple(m.op_of("kt").arg("dims")) != (0, 1, 3, 2):
        return None
    if not all(isinstance(x, float) for x in (q_scale, k_scale, fill)) or q_scale != k_scale or fill != -math.inf:
        return None
    for red, full in (("max", "max_full"), ("sum", "sum_full")):  # both reduce the key axis and broadcast back
        o = m.op_of(red)
        if reduced(o, 4) != {3} or o.arg("keepdim") or tuple(m[full].shape) != tuple(s.shape) or m.chain(full, red) != [0, 1, 2]:
            return None
    inside = set(m.nodes.values())
    if any(u not in inside for u in m.node("p").users) != probs_read or not _causal(m, t) or not _heads_only_split(m):
        return None
    scale = q_scale * k_scale
    if not probs_read:
        return ["q", "k", "v"], {"y": "y"}, lambda q, k, v: {"y": F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)}
    masks: dict[tuple[int, torch.device], torch.Tensor] = {}

    def kernel(q, k, v):
        key = (q.shape[2], q.device)
        if key not in masks:
            masks[key] = torch.ones(key[0], key[0], dtype=torch.bool, device=q.device).triu(1)  # the entries masked out
        w = torch.matmul(q, k.transpose(-2, -1)).mul_(scale).masked_fill_(masks[key], -math.inf)
        probs = torch.softmax(w, -1)
        return {"p": probs, "y": torch.matmul(probs, v)}

    return ["q", "k", "v"], {"p": "p", "y": "y"}, kernel


pattern("causal_attention", _attention_pattern(), ATTENTION)(lambda m: _attention_check(m, probs_read=False))
pattern("causal_attention_probs", _attention_pattern(), ATTENTION)(lambda m: _attention_check(m, probs_read=True))


def _flash_pattern() -> Builder:
    b = Builder()
    fwd = b.sdpfa_fwd(b.leaf("q"), b.leaf("k"), b.leaf("v"), name="fwd")
    b.graph.output(tuple(b.get(fwd, i, name) for i, name in enumerate(("out", "lse", "seed", "offset"))))
    return b


def _flash_backward_pattern() -> Builder:
    b = Builder()
    args = [b.leaf(n) for n in ("g", "q", "k", "v", "out", "lse", "seed", "offset")]
    bwd = b.sdpfa_bwd(*args, name="bwd")
    b.graph.output(tuple(b.get(bwd, i, name) for i, name in enumerate(("gq", "gk", "gv"))))
    return b


def _flash_args(m: Match, name: str) -> tuple[bool, float | None] | None:
    """(is_causal, scale) of the attention op ``name`` when torch's CPU flash kernel computes it
    as the op says: float q, k, v of one dtype, [B, h, S, D], no bias, mask or dropout, each value
    split (if at all) along batch or heads only; None otherwise."""
    op = m.op_of(name)
    q, k, v = m["q"], m["k"], m["v"]
    causal, scale, p = op.arg("is_causal"), op.arg("scale"), op.arg("dropout_p")
    if any(op.arg(a) is not None for a in ("bias", "mask") if a in dict(op.args)) or p not in (None, 0, 0.0):
        return None
    if not (isinstance(causal, bool) or causal is None) or not (scale is None or isinstance(scale, float)):
        return None
    if not same_float(q, k, v) or q.ndim != 4 or q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        return None
    return (bool(causal), scale) if _heads_only_split(m) else None


def _flash_check(m: Match):
    found = _flash_args(m, "fwd")
    if found is None:
        return None
    causal, scale = found
    nothing = {}

    def kernel(q, k, v):
        if q.is_cpu:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        else:  # torch's flash kernel of this name is the CPU one: elsewhere the op's own formula
            out, lse = attention(q, k, v, 0.0, causal, scale, None)
        if not nothing:
            nothing.update(seed=torch.zeros(2, dtype=torch.uint64), offset=torch.tensor(0, dtype=torch.uint64))
        return {"out": out, "lse": lse, **nothing}

    return ["q", "k", "v"], {n: n for n in ("out", "lse", "seed", "offset")}, kernel


def _flash_backward_check(m: Match):
    found = _flash_args(m, "bwd")
    if found is None or not same_float(m["g"], m["out"], m["q"]):
        return None
    causal, scale = found

    def kernel(g, q, k, v, out, lse):
        if q.is_cpu:  # torch's kernel takes the logsumexp in its accumulation type: float64 inputs, float64 (nvFuser's is float32)
            lse = lse.to(torch.promote_types(q.dtype, torch.float32))
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, causal,
                                                                                            scale=scale)
        else:
            gq, gk, gv = attention_backward(g, q, k, v, out, lse, causal, scale)
        return {"gq": gq, "gk": gk, "gv": gv}

    return ["g", "q", "k", "v", "out", "lse"], {n: n for n in ("gq", "gk", "gv")}, kernel


pattern("flash_attention", _flash_pattern(), ATTENTION)(_flash_check)
pattern("flash_attention_backward", _flash_backward_pattern(), ATTENTION)(_flash_backward_check)
