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

Where the step divides the axis (``h[..., ::2]`` and ``h[..., 1::2]`` of an even axis), both are
written in groups of ``step`` instead, with no slice or pad of the axis itself:

    x [.., n, ..] -> reshape [.., n/step, step, ..]  spread x [.., m, ..] -> [.., m, k, ..]
    slice the groups taken, position start % step    where(iota(k) == low, x, value)
    squeeze                            -> [.., m, ..] reshape -> [.., m*k, ..]  (low + high == k - 1)

so a split of the axis into contiguous parts of whole groups stays a split through them: gpt-oss's
gate and up, interleaved in one projection's features, are taken on the rank that holds them, and
Megatron's column/row pair passes through (``tests/test_strided.py``).

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
    lengths = [-(-(e - s) // st) for s, e, st in bounds]
    # an axis whose size the step divides is taken in groups of step (no slice or pad of the axis
    # itself, so a split of it into whole groups stays a split: gpt-oss's interleaved gate and up)
    grouped = [st > 1 and m > 1 and n % st == 0 for (_, _, st), m, n in zip(bounds, lengths, a.shape)]
    # First the stride-1 slice that ends at each other axis's last element taken.
    first = [0 if g else s for (s, _, _), g in zip(bounds, grouped)]
    stop = [n if g else s + (m - 1) * st + 1 if m > 0 else s for (s, _, st), m, n, g in zip(bounds, lengths, a.shape, grouped)]
    x = a
    if any((s, e) != (0, n) for s, e, n in zip(first, stop, a.shape)):
        x = b.op("slice", a, start_indices=first, end_indices=stop, strides=[1] * a.ndim)
    for axis, ((start, _, st), m) in enumerate(zip(bounds, lengths)):
        if grouped[axis]:
            x = _grouped(b, x, axis, st, start, m)
        elif st > 1 and m > 1:  # one element (or none) taken: the slice above is it
            x = _every(b, x, axis, st, m)
    return x


def _grouped(b: FusionBuilder, x: TensorValue, axis: int, step: int, start: int, m: int) -> TensorValue:
    """Elements start, start + step, ... (m of them) of ``axis``, whose size ``step`` divides: the
    axis as [size/step, step], groups start//step onwards, position start % step in each."""
    shape = list(x.shape)
    split = shape[:axis] + [shape[axis] // step, step] + shape[axis + 1:]
    x = b.op("reshape", x, new_shape=split)
    lo, at = divmod(start, step)
    begin, end = [0] * len(split), list(split)
    begin[axis], begin[axis + 1] = lo, at
    end[axis], end[axis + 1] = lo + m, at + 1
    x = b.op("slice", x, start_indices=begin, end_indices=end, strides=[1] * len(split))
    return b.op("squeeze", x, dims=[axis + 1])


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
    outer = []
    for axis, (lo, hi, d) in enumerate(config):
        if d and x.shape[axis] > 1 and lo >= 0 and hi >= 0 and lo + hi == d:
            x = _spread(b, x, axis, d + 1, lo, value)  # whole groups: the strided slice's backward over a grouped axis
            lo = hi = 0
        elif d and x.shape[axis] > 1:
            x = _dilate(b, x, axis, d, value)
        outer.append((lo, hi))
    widths: list[int] = []
    for lo, hi in reversed(outer):
        widths += [lo, hi]
    if any(widths):
        x = b.op("pad", x, widths, value)
    return x


def _spread(b: FusionBuilder, x: TensorValue, axis: int, k: int, at: int, value: Any) -> TensorValue:
    """Each element of ``axis`` (size m) at position ``at`` of a group of ``k``, ``value`` in the
    others: size m*k, with neither slice nor pad of the axis."""
    shape = list(x.shape)
    wide = shape[:axis + 1] + [k] + shape[axis + 1:]
    spread = b.op("broadcast_in_dim", x, shape=wide, broadcast_dims=[i for i in range(len(wide)) if i != axis + 1])
    here = b.op("eq", b.op("iota", k, 0, 1, DType.Int), at)
    mask = b.op("broadcast_in_dim", here, shape=wide, broadcast_dims=[axis + 1])
    kept = b.op("where", mask, spread, value)
    return b.op("reshape", kept, new_shape=shape[:axis] + [shape[axis] * k] + shape[axis + 1:])


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
