"""Scaled dot-product attention as nvFuser's ``sdpfa_fwd`` / ``sdpfa_bwd`` (flash attention).

Claimed, as Thunder's nvFuser executor does with ``nv_enable_sdpa``, for half-precision
causal or full attention without a mask; other attention Thunder decomposes into matmuls and
softmax, which nvtp fuses like any other ops. Two traces claim more (any float dtype, float32
included, without mask, GQA or dropout): one for a cp axis (``claim_for_ring``: the axis runs the
attention by ring) and one for the reference backend (``claim_flash``: torch's CPU flash kernels
run it, ``nvtp.execute.attention_kernel``), so the forward hands the backward the output and
logsumexp instead of the [B, h, T, T] probabilities Thunder's decomposition saves.
"""

from __future__ import annotations

import contextlib
import contextvars

from thunder.core import dtypes, prims
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.torch import scaled_dot_product_attention as _ltorch_sdpa

from nvtp.frontend.translate import TRANSLATORS

_SYMBOLS: dict[str, object] = {}
CHECKED = {_ltorch_sdpa.id}  # claimed only when ``_check`` says so

# Set while tracing for a mesh with a context-parallel axis (nvtp.driver.trace(ring=True)): every
# causal or full attention is claimed whole, float32 too, so the cp axis can run it by ring
# (nvtp.execute.ring); each declined call is recorded with why (nvtp.sharding.axes.cp refuses it).
RING_CLAIM: contextvars.ContextVar[list | None] = contextvars.ContextVar("nvtp_ring_claim", default=None)


@contextlib.contextmanager
def claim_for_ring():
    """Claim every causal or full attention as ``sdpfa_fwd``/``sdpfa_bwd`` (any float dtype);
    yields the list of declined calls (why, in words)."""
    declined: list[str] = []
    token = RING_CLAIM.set(declined)
    try:
        yield declined
    finally:
        RING_CLAIM.reset(token)


# Set while tracing for the reference backend (nvtp.driver.trace(flash=True)); see claim_flash.
FLASH_CLAIM: contextvars.ContextVar[bool] = contextvars.ContextVar("nvtp_flash_claim", default=False)


@contextlib.contextmanager
def claim_flash():
    """Claim every causal or full attention without mask, GQA or dropout as
    ``sdpfa_fwd``/``sdpfa_bwd``, in any float dtype; the rest stays Thunder's decomposition
    (attention dropout is drawn as eager's ``nn.Dropout`` would be only there)."""
    token = FLASH_CLAIM.set(True)
    try:
        yield
    finally:
        FLASH_CLAIM.reset(token)


def flash_claim_active() -> bool:
    """Whether a trace for the reference backend's flash kernels is under way (``claim_flash``)."""
    return FLASH_CLAIM.get()


def ring_claim_active() -> bool:
    """Whether a trace for a cp axis is under way (``claim_for_ring``)."""
    return RING_CLAIM.get() is not None


def _fwd_meta(query, key, value, dropout_p=0.0, is_causal=False, *, scale=None):
    b, h, s, _ = query.shape
    return (
        TensorProxy(like=query, shape=(b, h, s, value.shape[3])),
        TensorProxy(shape=(b, h, s), dtype=dtypes.float32, device=query.device, requires_grad=False),
        TensorProxy(shape=(2,), dtype=dtypes.uint64, device=query.device, requires_grad=False),
        TensorProxy(shape=(), dtype=dtypes.uint64, device=query.device, requires_grad=False),
    )


def _bwd_meta(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    return (TensorProxy(like=query), TensorProxy(like=key), TensorProxy(like=value))


def _check(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False) -> bool:
    ring = RING_CLAIM.get()
    if ring is not None:
        return _check_ring(ring, query, key, value, attn_mask, dropout_p, enable_gqa)
    if FLASH_CLAIM.get():
        return _check_ring([], query, key, value, attn_mask, dropout_p, enable_gqa)
    if attn_mask is not None or enable_gqa:
        return False
    if not all(isinstance(t, TensorProxy) and t.ndim == 4 for t in (query, key, value)):
        return False
    if {query.dtype, key.dtype, value.dtype} - {dtypes.bfloat16, dtypes.float16} or len({query.dtype, key.dtype, value.dtype}) != 1:
        return False
    if key.shape[:2] != query.shape[:2] or value.shape[:3] != key.shape[:3]:
        return False
    head_dim = query.shape[3]
    return head_dim % 8 == 0 and head_dim <= 256 and query.device.type in ("cpu", "cuda", "meta")


def _check_ring(declined: list, query, key, value, attn_mask, dropout_p, enable_gqa) -> bool:
    if attn_mask is not None:
        declined.append("scaled_dot_product_attention with an attn_mask (an arbitrary mask)")
    elif enable_gqa:
        declined.append("scaled_dot_product_attention with enable_gqa=True")
    elif dropout_p:
        declined.append(f"scaled_dot_product_attention with dropout_p={dropout_p}")
    elif not all(isinstance(t, TensorProxy) and t.ndim == 4 for t in (query, key, value)):
        declined.append("scaled_dot_product_attention on tensors that are not [batch, heads, seq, head_dim]")
    elif key.shape[:2] != query.shape[:2] or value.shape[:3] != key.shape[:3]:
        declined.append(f"scaled_dot_product_attention of q{list(query.shape)} k{list(key.shape)} v{list(value.shape)}")
    elif not (dtypes.is_float_dtype(query.dtype) and len({query.dtype, key.dtype, value.dtype}) == 1):
        declined.append(f"scaled_dot_product_attention in {query.dtype}")
    else:
        return True
    return False


def _execution(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    out, _, _, _ = _SYMBOLS["fwd"](query, key, value, dropout_p, is_causal, scale=scale)
    return out


def _grad(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    out, lse, seed, offset = _SYMBOLS["fwd"](query, key, value, dropout_p, is_causal, scale=scale)
    g = get_grad(out)
    gq, gk, gv = _SYMBOLS["bwd"](g, query, key, value, out, lse, dropout_p, is_causal, seed, offset, scale=scale)
    put_grads((query, key, value), (gq, gk, gv))
    return out


def register(ex) -> None:
    """Register the two attention ops on executor ``ex`` and claim torch's sdpa with them."""
    fwd = ex.register_operator("nvtp_sdpfa_fwd", meta=_fwd_meta, tags=[prims.OpTags.RANDOM_OP])
    bwd = ex.register_operator("nvtp_sdpfa_bwd", meta=_bwd_meta, tags=[prims.OpTags.RANDOM_OP])
    _SYMBOLS.update(fwd=fwd, bwd=bwd)
    ex.register_supported(fwd.id)
    ex.register_supported(bwd.id)
    ex.register_supported(_ltorch_sdpa, checker=_check, execution_transform=_execution, grad_transform=_grad)

    def translate_fwd(b, query, key, value, dropout_p=0.0, is_causal=False, *, scale=None):
        return b.op("sdpfa_fwd", query, key, value, dropout_p=float(dropout_p), is_causal=bool(is_causal), scale=scale)

    def translate_bwd(b, grad_out, query, key, value, out, lse, dropout_p, is_causal, seed, offset, *, scale=None):
        return b.op("sdpfa_bwd", grad_out, query, key, value, out, lse, float(dropout_p), bool(is_causal), seed, offset, scale)

    TRANSLATORS[fwd.id] = translate_fwd
    TRANSLATORS[bwd.id] = translate_bwd
