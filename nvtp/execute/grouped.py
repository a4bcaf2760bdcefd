"""How the reference backend runs the mixture-of-experts ops (``nvtp/ir/ops/moe.py``) with torch.

``gather_mm`` and ``gather_mm_wgrad`` group their rows by expert as a grouped GEMM does: a
stable sort of the rows by expert index, the per-expert counts (``bincount``) and offsets
(``cumsum``) on the device, then one product per group. On CUDA, in bf16/fp16/fp32 with the
16-byte strides the kernel needs, that is ``torch._grouped_mm`` with the offsets as a device
tensor: no host synchronisation. Elsewhere (the CPU meshes of the tests, float64 checks, odd
widths of a sharded expert) it is a loop over the experts, whose bounds the host reads; on a CPU
that read costs nothing. An expert that receives no row gets a zero weight gradient.

Under sharding both ops run on each rank's local parts as they are (their rules keep the expert
axis whole: ``index`` holds global expert numbers, which are the local ones), except where an
"ep" axis splits the experts: the program lists those ops' all-to-alls among its steps, and they
run by dispatch and combine (``nvtp.execute.ep``).
"""

from __future__ import annotations

import torch


def _grouped_by_expert(index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' order sorted by expert (stable) and the offsets where each expert's rows end.
    Rows whose index is ``experts`` (an ep rank's padding: ``nvtp.execute.ep``) sort last and
    belong to no expert: they add nothing to a gradient, and ``gather_mm``'s rows for them are
    left unset by ``torch._grouped_mm`` (zero in the loop): the caller masks them."""
    order = torch.argsort(index, stable=True)
    offsets = torch.cumsum(torch.bincount(index, minlength=experts), 0)[:experts]
    return order, offsets


def _grouped_mm_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all((s * a.element_size()) % 16 == 0 for s in (*a.shape[1:], *b.shape[1:])))


def gather_mm(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``y[s] = x[s] @ w[index[s]]`` for ``x [S, K]``, ``w [E, K, N]``, ``index [S]``."""
    dtype = torch.promote_types(x.dtype, w.dtype)
    x, w = x.to(dtype), w.to(dtype)
    order, offsets = _grouped_by_expert(index, w.shape[0])
    xs = x.index_select(0, order)
    if _grouped_mm_applies(xs, w):
        ys = torch._grouped_mm(xs, w, offs=offsets.to(torch.int32))
    else:
        ys = torch.zeros(x.shape[0], w.shape[2], dtype=dtype, device=x.device)
        start = 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                ys[start:end] = xs[start:end] @ w[e]
            start = end
    return torch.empty_like(ys).index_copy_(0, order, ys)


def gather_mm_wgrad(x: torch.Tensor, g: torch.Tensor, index: torch.Tensor, experts: int) -> torch.Tensor:
    """``dw[e] = sum over rows s with index[s] == e of x[s]^T g[s]``: ``[experts, K, N]``."""
    dtype = torch.promote_types(x.dtype, g.dtype)
    order, offsets = _grouped_by_expert(index, experts)
    xs, gs = x.to(dtype).index_select(0, order), g.to(dtype).index_select(0, order)
    if _grouped_mm_applies(xs, gs):
        return torch._grouped_mm(xs.t(), gs, offs=offsets.to(torch.int32))
    out = torch.zeros(experts, x.shape[1], g.shape[1], dtype=dtype, device=x.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[e] = xs[start:end].T @ gs[start:end]
        start = end
    return out
