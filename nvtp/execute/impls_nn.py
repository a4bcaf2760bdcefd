"""The reference backend's matmuls, attention, factories, random draws and indexing (registered
in ``IMPLS``); a vocabulary-split lookup asks the ``Context`` which rows this rank holds."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nvtp.execute import ring as ring_attention  # the cp axis's attention
from nvtp.execute.collectives import take
from nvtp.execute.impls import IMPLS, Context, ExecutionError, Impl, as_number, impl
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Op, Value
from nvtp.sharding.placements import is_partial


# ---------------------------------------------------------------------------------------------
# matmuls and attention


@impl("linear")
def _linear(ctx, op, a):
    return F.linear(a["arg1"], a["arg2"], a["bias"] if bias_applies(ctx, op) else None)


def bias_applies(ctx: Context, op: Op) -> bool:
    """False on every mesh position but 0 when a ``linear``'s result is a partial sum: the bias
    is added once."""
    s = ctx.sharding(op.outputs[0])
    return not (s is not None and any(is_partial(p) and ctx.coord(a) != 0 for a, p in enumerate(s)))


@impl("matmul")
def _matmul(ctx, op, a):
    return torch.matmul(a["arg1"], a["arg2"])


def attention(q, k, v, dropout_p, is_causal, scale, keep):
    """Attention in float32 (or wider) with an explicit dropout keep-mask; returns (out, lse)."""
    work = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = q.to(work), k.to(work), v.to(work)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if is_causal:
        s_q, s_k = scores.shape[-2:]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).tril(diagonal=s_k - s_q)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if keep is not None:
        probs = probs * keep.to(work) / (1.0 - dropout_p)
    return torch.matmul(probs, vf).to(q.dtype), lse.to(torch.float32 if ctx_is_low(q) else lse.dtype)


def ctx_is_low(q: torch.Tensor) -> bool:
    return q.dtype in (torch.bfloat16, torch.float16, torch.float32)


def _attention_keep(ctx: Context, seed: torch.Tensor, offset: torch.Tensor, query: Value, q: torch.Tensor, k: torch.Tensor, p: float):
    """The dropout keep-mask for attention probabilities, drawn whole from (seed, offset) and
    sliced to the heads this rank holds."""
    if not p:
        return None
    b, h, s_q, _ = query.shape
    s_k = k.shape[-2]
    g = torch.Generator()
    g.manual_seed(int(seed.reshape(-1)[0].item()) ^ (int(offset.item()) * 0x9E3779B97F4A7C15 & ((1 << 63) - 1)))
    keep = torch.rand((b, h, s_q, s_k), generator=g) >= p
    held = ctx.indices(query)
    for axis in (0, 1):
        keep = take(keep, axis, held[axis])
    return keep


def _float_arg(x) -> float | None:
    x = as_number(x)
    return None if x is None else float(x)




@impl("sdpfa_fwd")
def _sdpfa_fwd(ctx, op, a):
    if a["bias"] is not None or a["mask"] is not None:
        raise ExecutionError("sdpfa_fwd with bias or mask is not supported by the reference backend")
    q, k, v = a["query"], a["key"], a["value"]
    p = _float_arg(a["dropout_p"]) or 0.0
    ring = ctx.rings.get(op.outputs[0].name)
    if ring is not None:  # the program runs it by ring (a cp axis splits the sequence): nvtp/execute/ring.py
        out, lse = ring_attention.forward(ctx, op, ring, q, k, v, bool(as_number(a["is_causal"])), _float_arg(a["scale"]))
        return out, lse.to(ctx.dtype(DType.Float)), torch.zeros(2, dtype=torch.uint64), torch.tensor(0, dtype=torch.uint64)
    g = ctx.generator("sdpfa")
    seed = torch.randint(0, 2**62, (2,), generator=g).to(torch.uint64)
    offset = torch.tensor(ctx.rng_count, dtype=torch.uint64)
    keep = _attention_keep(ctx, seed, offset, op.operands[0], q, k, p)
    out, lse = attention(q, k, v, p, bool(as_number(a["is_causal"])), _float_arg(a["scale"]), keep)
    return out, lse.to(ctx.dtype(DType.Float)), seed, offset


@impl("sdpfa_bwd")
def _sdpfa_bwd(ctx, op, a):
    """Flash attention's backward as nvFuser (flash / cuDNN) computes it: FROM the given
    logsumexp and output, never by re-running the forward (so an lse or out that q, k, v did
    not produce gives other gradients, as on the GPU)::

        P  = exp(scale·Q Kᵀ (causal-masked) − lse)      Pd = P · keep / (1 − p)   (dropout)
        dV = Pdᵀ dO      dPd = dO Vᵀ      dP = dPd · keep / (1 − p)
        D  = rowsum(dO ∘ out)      dS = P ∘ (dP − D)      dQ = scale · dS K      dK = scale · dSᵀ Q

    With out and lse from the forward of the same q, k, v this is autograd's gradient. Computed
    in float32 (or wider), as the flash kernels do."""
    q, k, v, go = a["query"], a["key"], a["value"], a["grad_output"]
    p = _float_arg(a["dropout_p"]) or 0.0
    ring = ctx.rings.get(op.outputs[0].name)
    if ring is not None:  # the program runs it by ring (a cp axis splits the sequence): nvtp/execute/ring.py
        return ring_attention.backward(ctx, op, ring, go, q, k, v, a["output"], a["logsumexp"], bool(as_number(a["is_causal"])),
                                       _float_arg(a["scale"]))
    keep = _attention_keep(ctx, a["philox_seed"], a["philox_offset"], op.operands[1], q, k, p)
    return attention_backward(go, q, k, v, a["output"], a["logsumexp"], bool(as_number(a["is_causal"])), _float_arg(a["scale"]),
                              p, keep)


def attention_backward(go, q, k, v, out, lse, is_causal: bool, scale: float | None, p: float = 0.0, keep=None):
    """(dQ, dK, dV) of attention from its output and logsumexp (``_sdpfa_bwd``'s formula), in
    float32 or wider; ``keep``: the dropout keep-mask drawn with probability ``p`` (None: none)."""
    work = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf, gof, outf, lse = (t.to(work) for t in (q, k, v, go, out, lse))
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    probs = torch.exp(torch.matmul(qf, kf.transpose(-2, -1)) * scale - lse.unsqueeze(-1))  # (B, H, Sq, Sk)
    if is_causal:
        s_q, s_k = probs.shape[-2:]
        probs = probs.masked_fill(~torch.ones(s_q, s_k, dtype=torch.bool, device=probs.device).tril(diagonal=s_k - s_q), 0.0)
    drop = keep.to(work) / (1.0 - p) if keep is not None else None
    dropped = probs if drop is None else probs * drop
    gv = torch.matmul(dropped.transpose(-2, -1), gof)
    gp = torch.matmul(gof, vf.transpose(-2, -1))
    if drop is not None:
        gp = gp * drop
    gs = probs * (gp - (gof * outf).sum(-1, keepdim=True))
    gq = torch.matmul(gs, kf) * scale
    gk = torch.matmul(gs.transpose(-2, -1), qf) * scale
    return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# factories


@impl("iota")
def _iota(ctx, op, a):
    n = a["length"]
    start = as_number(a["start"]) if a["start"] is not None else 0
    step = as_number(a["step"]) if a["step"] is not None else 1
    full = start + torch.arange(n, dtype=torch.float64 if isinstance(step, float) or isinstance(start, float) else torch.int64) * step
    return ctx.take_local(full.to(ctx.dtype(a["dtype"])), op.outputs[0])


@impl("full")
def _full(ctx, op, a):
    return torch.full(ctx.local_shape(op.outputs[0]), as_number(a["fill_value"]), dtype=ctx.dtype(a["dtype"]))


def _random(kind: str) -> Impl:
    def run(ctx: Context, op: Op, a):
        v = op.outputs[0]
        keys = (kind,)
        if a["rng_seed"] is not None:
            keys += (int(as_number(a["rng_seed"])), int(as_number(a["rng_offset"])))
        g = ctx.generator(*keys)
        declared = a["dtype"].torch
        if kind == "uniform":
            lo, hi = as_number(a["minval"]), as_number(a["maxval"])
            full = torch.rand(v.shape, generator=g, dtype=declared)
            if (lo, hi) != (0, 1):  # x * 1.0 + 0.0 is x: dropout's uniform(0, 1) skips two passes
                full = full * (hi - lo) + lo
        else:
            mean, std = as_number(a["mean"]), as_number(a["std"])
            full = torch.randn(v.shape, generator=g, dtype=declared) * std + mean
        return ctx.take_local(full.to(declared).to(ctx.dtype(a["dtype"])), v)

    return run


IMPLS["uniform"] = _random("uniform")
IMPLS["normal"] = _random("normal")


# ---------------------------------------------------------------------------------------------
# indexing


def _masked_lookup(ctx: Context, table_value: Value, axis: int, index: torch.Tensor):
    """Local positions of global ``index`` entries along ``axis`` of a sharded table, and which
    entries this rank holds (the others contribute zero to a Partial result)."""
    held = ctx.indices(table_value)[axis]
    if held is None:
        return index, None
    inverse = torch.full((table_value.shape[axis],), -1, dtype=torch.int64)
    inverse[held] = torch.arange(held.numel())
    pos = inverse[index]
    present = pos >= 0
    return pos.clamp(min=0), present


@impl("embedding_fwd")
def _embedding_fwd(ctx, op, a):
    idx, w = a["input"], a["weight"]
    pos, present = _masked_lookup(ctx, op.operands[1], 0, idx)
    # padding_idx changes only the gradient (torch and nvFuser look its row up like any other;
    # nn.Embedding initialises that row to zeros), so the forward ignores it.
    out = F.embedding(pos, w)
    if present is not None:
        out = out * present.unsqueeze(-1).to(out.dtype)
    return out


@impl("take_along_axis")
def _take_along_axis(ctx, op, a):
    x, idx, dim = a["arg"], a["index"], a["dim"] % a["arg"].dim()
    pos, present = _masked_lookup(ctx, op.operands[0], dim, idx)
    out = torch.take_along_dim(x, pos, dim)
    if present is not None:
        out = out * present.to(out.dtype)
    return out


@impl("gather")
def _gather(ctx, op, a):
    return torch.gather(a["arg"], a["dim"], a["index"])


@impl("index_select")
def _index_select(ctx, op, a):
    x, idx = a["arg"], a["index"]
    dim = a["dim"] % x.dim()
    pos, present = _masked_lookup(ctx, op.operands[0], dim, idx)
    out = torch.index_select(x, dim, pos)
    if present is not None:  # a table split along dim: rows this rank lacks contribute zero
        shape = [1] * out.dim()
        shape[dim] = present.numel()
        out = out * present.reshape(shape).to(out.dtype)
    return out


@impl("scatter")
def _scatter(ctx, op, a):
    return torch.scatter(a["arg"], a["dim"], a["index"], a["src"])
