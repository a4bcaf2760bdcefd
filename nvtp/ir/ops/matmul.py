"""Contractions: ``linear``, ``matmul`` and the attention ops ``sdpfa_fwd`` / ``sdpfa_bwd``."""

from __future__ import annotations

from nvtp.ir.dtypes import DType, promote
from nvtp.ir.graph import TensorValue
from nvtp.ir.ops.table import Out, Param, broadcast_shapes, check, register, tensor_arg


# ---------------------------------------------------------------------------------------------
# matmuls


def _infer_linear(a):
    x, w, b = tensor_arg(a, "arg1"), tensor_arg(a, "arg2"), a["bias"]
    check(w.ndim in (1, 2), lambda: f"linear weight must be 1-D or 2-D, got shape {list(w.shape)}")
    k = w.shape[-1]
    check(x.ndim >= 1 and x.shape[-1] == k, lambda: f"linear input {list(x.shape)} and weight {list(w.shape)} disagree on the contracted size")
    shape = x.shape[:-1] + ((w.shape[0],) if w.ndim == 2 else ())
    if b is not None:
        check(isinstance(b, TensorValue) and b.shape in ((), (w.shape[0],) if w.ndim == 2 else ()), lambda: f"linear bias shape {list(getattr(b, 'shape', []))} does not match weight {list(w.shape)}")
    return [Out(shape, x.dtype)]


register("linear", [Param("arg1", "tensor"), Param("arg2", "tensor"), Param("bias", "tensor?", None)], _infer_linear, "matmul", 2)


def matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    check(len(a) >= 1 and len(b) >= 1, lambda: "matmul needs tensors of rank >= 1")
    ka = a[-1]
    kb = b[-2] if len(b) >= 2 else b[0]
    check(ka == kb, lambda: f"matmul of {list(a)} and {list(b)}: contracted sizes {ka} and {kb} differ")
    if len(a) == 1 and len(b) == 1:
        return ()
    if len(b) == 1:
        return a[:-1]
    if len(a) == 1:
        return b[:-2] + b[-1:]
    batch = broadcast_shapes([a[:-2], b[:-2]])
    return batch + (a[-2], b[-1])


def _infer_matmul(a):
    x, y = tensor_arg(a, "arg1"), tensor_arg(a, "arg2")
    return [Out(matmul_shape(x.shape, y.shape), promote(x.dtype, y.dtype))]


register("matmul", [Param("arg1", "tensor"), Param("arg2", "tensor")], _infer_matmul, "matmul", 2)


# ---------------------------------------------------------------------------------------------
# attention


def _infer_sdpfa_fwd(a):
    q, k, v = tensor_arg(a, "query"), tensor_arg(a, "key"), tensor_arg(a, "value")
    check(q.ndim == k.ndim == v.ndim == 4, lambda: "sdpfa_fwd needs [batch, heads, seq, head_dim] query, key and value")
    b, h, s, _ = q.shape
    check(k.shape[:2] == (b, h) and v.shape[:3] == k.shape[:3] and k.shape[3] == q.shape[3], lambda: f"sdpfa_fwd shapes q{list(q.shape)} k{list(k.shape)} v{list(v.shape)} disagree")
    return [
        Out((b, h, s, v.shape[3]), q.dtype),
        Out((b, h, s), DType.Float),
        Out((2,), DType.UInt64),
        Out((), DType.UInt64),
    ]


register(
    "sdpfa_fwd",
    [
        Param("query", "tensor"),
        Param("key", "tensor"),
        Param("value", "tensor"),
        Param("bias", "tensor?", None),
        Param("mask", "tensor?", None),
        Param("dropout_p", "scalar?", None),
        Param("is_causal", "scalar?", None),
        Param("scale", "scalar?", None),
    ],
    _infer_sdpfa_fwd,
    "attention",
    3,
)


def _infer_sdpfa_bwd(a):
    q, k, v = tensor_arg(a, "query"), tensor_arg(a, "key"), tensor_arg(a, "value")
    return [Out(q.shape, q.dtype), Out(k.shape, k.dtype), Out(v.shape, v.dtype)]


register(
    "sdpfa_bwd",
    [
        Param("grad_output", "tensor"),
        Param("query", "tensor"),
        Param("key", "tensor"),
        Param("value", "tensor"),
        Param("output", "tensor"),
        Param("logsumexp", "tensor"),
        Param("dropout_p", "scalar?"),
        Param("is_causal", "scalar?"),
        Param("philox_seed", "tensor"),
        Param("philox_offset", "tensor"),
        # Required, as in nvFuser (0.2.36): its sdpfa_bwd has no defaults, so a dump must always
        # write scale, None included; one that left it out would be refused by nvFuser.
        Param("scale", "scalar?"),
    ],
    _infer_sdpfa_bwd,
    "attention",
    6,
)
