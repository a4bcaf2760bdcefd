"""Strided slices and their backward (interior padding), written with ops nvFuser has.

Interleaved rotary embeddings (GPT-J, CodeGen, Cohere: ``x[..., ::2]`` and ``x[..., 1::2]``) take
every other element of the head dimension. Thunder traces that as a ``slice`` with stride 2, and
its gradient as a ``pad`` with *interior* padding: the incoming gradient with ``stride - 1``
zeros between its elements. nvFuser 0.2.36 has neither: its ``slice`` accepts stride 1 only, and
its ``pad`` has no interior padding. Both are written here as the stride-1 ops they compute,
so every table nvtp keeps (sharding rules, reference implementation, nvFuser text, the
independent float64 check) already knows them:

    strided slice, (start, end, step) on an axis      dilation by d zeros on an axis of size m
    x[s : s + (m-1)*step + 1]          slice          broadcast x [.., m, ..] -> [.., m, d+1, ..]
    pad the axis at its end by step-1  -> m*step      where(iota(d+1) == 0, x, value)  (a mask, no pad)
    reshape [.., m*step, ..] -> [.., m, step, ..]     reshape [.., m, d+1, ..] -> [.., m*(d+1), ..]
    slice [.., :, 0:1, ..], squeeze    -> [.., m, ..] slice to (m-1)*(d+1) + 1, then the outer pad

A new op (a strided slice with its own rule, implementation and emitter) would say the same in
four tables, and still need these ops for nvFuser; the rewrite keeps one place.
"""

from __future__ import annotations

from typing import Any, Sequence

from nvtp.ir.build import FusionBuilder
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import TensorValue
from nvtp.ir.ops import slice_bounds


def strided_slice(b: FusionBuilder, a: TensorValue, starts: Sequence[int], ends: Sequence[int],
                  strides: Sequence[int] | None) -> TensorValue:
    """``a[starts:ends:strides]`` (nvFuser's ``slice``, any stride >= 1) from stride-1 slices,
    pads, reshapes and squeezes. Requires what ``slice`` requires; ensures the same shape and values."""
    bounds = slice_bounds(a, starts, ends, strides)
    # First the stride-1 slice that ends at each axis's last element taken.
    lengths = [-(-(e - s) // st) for s, e, st in bounds]
    stop = [s + (m - 1) * st + 1 if m > 0 else s for (s, _, st), m in zip(bounds, lengths)]
    x = a
    if any((s, e) != (0, n) for (s, _, _), e, n in zip(bounds, stop, a.shape)):
        x = b.op("slice", a, start_indices=[s for s, _, _ in bounds], end_indices=stop, strides=[1] * a.ndim)
    for axis, ((_, _, st), m) in enumerate(zip(bounds, lengths)):
        if st == 1 or m <= 1:
            continue  # one element (or none) taken: the slice above is it
        x = _every(b, x, axis, st, m)
    return x


def _every(b: FusionBuilder, x: TensorValue, axis: int, step: int, m: int) -> TensorValue:
    """Elements 0, step, 2*step, ... of ``axis`` (size (m-1)*step + 1): m of them."""
    widths = [0, 0] * (x.ndim - 1 - axis) + [0, step - 1]  # innermost axis first, as nvFuser's pad
    zero = 0.0 if x.dtype.is_float else (False if x.dtype == DType.Bool else 0)  # nvFuser: the tensor's own dtype
    padded = b.op("pad", x, widths, zero)  # [.., m*step, ..]
    shape = list(x.shape)
    split = shape[:axis] + [m, step] + shape[axis + 1:]
    x = b.op("reshape", padded, new_shape=split)
    x = b.op("slice", x, start_indices=[0] * len(split), end_indices=split[:axis + 1] + [1] + split[axis + 2:],
             strides=[1] * len(split))
    return b.op("squeeze", x, dims=[axis + 1])


def interior_pad(b: FusionBuilder, a: TensorValue, value: Any, config: Sequence[tuple[int, int, int]]) -> TensorValue:
    """Thunder's ``pad`` prim: ``config`` one (low, high, interior) per axis, outermost first;
    ``interior`` copies of ``value`` between neighbouring elements. The interior padding is a
    masked broadcast (see the module docstring), the rest nvFuser's ``pad``."""
    x = a
    for axis, (_, _, d) in enumerate(config):
        if d and x.shape[axis] > 1:
            x = _dilate(b, x, axis, d, value)
    widths: list[int] = []
    for lo, hi, _ in reversed(config):
        widths += [lo, hi]
    if any(widths):
        x = b.op("pad", x, widths, value)
    return x


def _dilate(b: FusionBuilder, x: TensorValue, axis: int, d: int, value: Any) -> TensorValue:
    """``d`` copies of ``value`` between neighbouring elements of ``axis``: size m -> (m-1)*(d+1) + 1."""
    m, k = x.shape[axis], d + 1
    shape = list(x.shape)
    wide = shape[:axis + 1] + [k] + shape[axis + 1:]
    spread = b.op("broadcast_in_dim", x, shape=wide, broadcast_dims=[i for i in range(len(wide)) if i != axis + 1])
    first = b.op("eq", b.op("iota", k, 0, 1, DType.Int), 0)  # [k]: only position 0 holds an element
    mask = b.op("broadcast_in_dim", first, shape=wide, broadcast_dims=[axis + 1])
    kept = b.op("where", mask, spread, value)
    flat = shape[:axis] + [m * k] + shape[axis + 1:]
    x = b.op("reshape", kept, new_shape=flat)
    out = shape[:axis] + [(m - 1) * k + 1] + shape[axis + 1:]
    return b.op("slice", x, start_indices=[0] * len(flat), end_indices=out, strides=[1] * len(flat))
