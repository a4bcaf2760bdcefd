"""torch's own ``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer``) as ops nvtp traces.

``nn.MultiheadAttention.forward`` calls ``F._canonical_mask`` on its masks and then
``F.multi_head_attention_forward``. Thunder 0.2.6 runs the latter only as an opaque torch call,
which fails when its weights need a gradient (and nvtp could not fuse it anyway); it reads the
former's dtype checks wrongly. Here both are written with the ops nvtp fuses and shards: one
packed projection (``in_proj_weight`` ``[3E, E]``, split in three as GPT-2's ``c_attn`` is, or
three separate weights), ``scaled_dot_product_attention`` (``is_causal`` kept, so a cp axis can
ring it), the output projection. With ``need_weights=True`` the attention is written out
(scores, softmax, the head-averaged weights returned), as torch computes it then.

``nn.TransformerEncoder`` guesses whether a mask given without ``is_causal`` is causal by comparing
its values (``_detect_is_causal_mask``), which a trace on meta tensors cannot: nvtp's takes the
hint alone, so such a mask is applied as given (the same values; ``is_causal`` is only a hint).

They take the place of torch's on both routes: on Thunder's as lookasides of nvtp's executor
(``thunder.torch`` ops on proxies), on the FX route as decompositions of the graph's calls
(torch ops). What torch's takes and these do not (``add_bias_kv``, ``add_zero_attn``, static
keys and values, masks neither bool nor floating) raises ``NotImplementedError`` saying so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.modules import transformer as _transformer
from thunder.core import dtypes
import thunder.torch as ltorch


@dataclass(frozen=True)
class Ops:
    """The functions the attention is written with: torch's, or Thunder's on proxies."""

    linear: Callable
    sdpa: Callable
    softmax: Callable
    matmul: Callable
    where: Callable
    dropout: Callable
    is_bool: Callable[[Any], bool]
    is_float: Callable[[Any], bool]


def torch_ops() -> Ops:
    return Ops(F.linear, F.scaled_dot_product_attention, torch.softmax, torch.matmul, torch.where, F.dropout,
               lambda t: t.dtype == torch.bool, lambda t: t.is_floating_point())


def thunder_ops() -> Ops:
    return Ops(ltorch.linear, ltorch.scaled_dot_product_attention, ltorch.softmax, ltorch.matmul, ltorch.where,
               ltorch.dropout, lambda t: dtypes.is_boolean_dtype(t.dtype), lambda t: dtypes.is_float_dtype(t.dtype))


def canonical_mask(ops: Ops, mask: Any, mask_name: str, other_type: Any, other_name: str, target_type: Any,
                   check_other: bool = True) -> Any:
    """``F._canonical_mask``: a bool mask (True: masked out) as an additive float mask of
    ``target_type`` (-inf where masked), a float mask as it is."""
    if mask is None:
        return None
    if ops.is_bool(mask):
        return ops.where(mask, -math.inf, 0.0).to(target_type)
    if not ops.is_float(mask):
        raise NotImplementedError(f"nn.MultiheadAttention's {mask_name} must be bool or floating, not {mask.dtype}")
    return mask


def multi_head_attention_forward(ops: Ops, query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
                                 bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias, training=True,
                                 key_padding_mask=None, need_weights=True, attn_mask=None, use_separate_proj_weight=False,
                                 q_proj_weight=None, k_proj_weight=None, v_proj_weight=None, static_k=None, static_v=None,
                                 average_attn_weights=True, is_causal=False):
    """``F.multi_head_attention_forward`` for ``query`` ``[L, N, E]`` (or ``[L, E]``), ``key`` and
    ``value`` ``[S, N, E]``: ``(output [L, N, E], weights [N, L, S] or None)``, as torch's."""
    unsupported = [n for n, v in (("add_bias_kv", bias_k is not None or bias_v is not None), ("add_zero_attn", add_zero_attn),
                                  ("static_k/static_v", static_k is not None or static_v is not None)) if v]
    if unsupported:
        raise NotImplementedError(f"nvtp takes nn.MultiheadAttention without {', '.join(unsupported)}")
    batched = query.ndim == 3
    if not batched:  # [L, E]: one sequence
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    L, N, E = query.shape
    S, H = key.shape[0], num_heads
    D = E // H
    if E != embed_dim_to_check or D * H != E:
        raise NotImplementedError(f"nn.MultiheadAttention with embed_dim {E}, {H} heads (expected {embed_dim_to_check})")
    q, k, v = _projections(ops, query, key, value, in_proj_weight, in_proj_bias, use_separate_proj_weight,
                           q_proj_weight, k_proj_weight, v_proj_weight)

    def heads(t, n):  # [n, N, E] -> [N, H, n, D]
        return t.reshape(n, N, H, D).permute(1, 2, 0, 3)

    q, k, v = heads(q, L), heads(k, S), heads(v, S)
    if is_causal and attn_mask is None:
        raise RuntimeError("nn.MultiheadAttention: is_causal needs attn_mask as a hint (as torch requires)")
    if is_causal and key_padding_mask is None and not need_weights:
        mask, causal = None, True  # torch drops the mask for SDPA's is_causal here too
    else:
        mask, causal = _merged_mask(ops, attn_mask, key_padding_mask, N, H, L, S, q.dtype), False
    p = dropout_p if training else 0.0
    if not need_weights:
        out = ops.sdpa(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)  # [N, H, L, D]
        weights = None
    else:
        scores = ops.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(D))  # [N, H, L, S]
        if mask is not None:
            scores = scores + mask
        probs = ops.softmax(scores, -1)
        weights = probs.mean(1) if average_attn_weights else probs
        out = ops.matmul(ops.dropout(probs, p, training) if p > 0 else probs, v)
    out = out.permute(2, 0, 1, 3).reshape(L, N, E)
    out = ops.linear(out, out_proj_weight, out_proj_bias)
    if not batched:
        out = out.squeeze(1)
        weights = weights.squeeze(0) if weights is not None else None
    return out, weights


def _projections(ops: Ops, query, key, value, w, b, separate, wq, wk, wv):
    """q, k, v: one packed projection read in three when query, key and value are one tensor (as
    GPT-2's c_attn), else each its own rows of the packed weight (or its own weight)."""
    if separate:
        return ops.linear(query, wq, b[:wq.shape[0]] if b is not None else None), \
            ops.linear(key, wk, b[wq.shape[0]:wq.shape[0] + wk.shape[0]] if b is not None else None), \
            ops.linear(value, wv, b[wq.shape[0] + wk.shape[0]:] if b is not None else None)
    E = query.shape[-1]
    if query is key and key is value:
        qkv = ops.linear(query, w, b)
        return qkv[..., :E], qkv[..., E:2 * E], qkv[..., 2 * E:]
    part = [(w[i * E:(i + 1) * E], b[i * E:(i + 1) * E] if b is not None else None) for i in range(3)]
    return ops.linear(query, *part[0]), ops.linear(key, *part[1]), ops.linear(value, *part[2])


def _merged_mask(ops: Ops, attn_mask, key_padding_mask, N, H, L, S, dtype):
    """The additive mask ``[N, H, L, S]`` (or one that broadcasts to it) of ``attn_mask`` (``[L, S]``
    or ``[N*H, L, S]``) and ``key_padding_mask`` (``[N, S]``), both float (``canonical_mask``)."""
    mask = None
    if attn_mask is not None:
        attn_mask = canonical_mask(ops, attn_mask, "attn_mask", None, "", dtype)
        mask = attn_mask.reshape(N, H, L, S) if attn_mask.ndim == 3 else attn_mask
    if key_padding_mask is not None:
        pad = canonical_mask(ops, key_padding_mask, "key_padding_mask", None, "", dtype).reshape(N, 1, 1, S)
        mask = pad if mask is None else mask + pad
    return mask


def functions(ops: Ops) -> dict[Any, Callable]:
    """torch's functions -> nvtp's, written with ``ops``."""
    def mha(*args, **kwargs):
        return multi_head_attention_forward(ops, *args, **kwargs)

    def mask(*args, **kwargs):
        return canonical_mask(ops, *args, **kwargs)

    return {F.multi_head_attention_forward: mha, F._canonical_mask: mask, _transformer._detect_is_causal_mask: detect_is_causal_mask}


def detect_is_causal_mask(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
    """``nn.TransformerEncoder``'s guess whether ``mask`` is causal, from the hint alone: torch
    compares the mask's values, which a trace (on meta tensors) does not have. Without the hint
    the mask is applied as given, which computes the same (``is_causal`` is only a hint)."""
    return is_causal is True
