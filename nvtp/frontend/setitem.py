"""In-place updates of tensors a model makes, written as the functional ops they compute.

A model may build a tensor and then update it in place: LitGPT's sliding-window mask
(``mask = torch.full((T, T), -inf); for i in range(T): mask[i, lo:i + 1] = 0.0``), or
``mask.masked_fill_(mask.bool(), -inf)``. Thunder functionalizes such code into three prims:

    t1 = copy_with_setitem(t0, key, value)   # a new tensor: t0 with t0[key] = value
    t2 = copy_(t1, t0)                       # written back into t0's memory
    (t3,) = update_aliases((t2,))            # later reads of t0 read t3

and every later read goes through the copy's result. nvtp's fusions compute new tensors and
write into nothing, so these are claimed only where the write-back is invisible:

* ``copy_with_setitem`` with a key of integers, slices (any step) and an ellipsis:
  ``where(mask, value placed in the region, t0)``, the mask built from iotas per axis, a tensor
  value padded into the region (``nvtp.frontend.strided.interior_pad`` for a step);
* ``copy_(src, dst)`` is ``src`` when ``dst`` is a tensor the trace itself made, by an op that is
  no view (``fresh_targets``): no argument, parameter or buffer of the model is written, and no
  other name of the same memory is read afterwards;
* ``update_aliases`` of one tensor is that tensor (several: they share memory, which nvtp's
  values cannot, so it is left unclaimed and capture names it).

Anything else stays unclaimed, and capture refuses the model naming the op and its line.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

from thunder.core.prims import PrimIDs
from thunder.core.proxies import TensorProxy

from nvtp.frontend.strided import interior_pad
from nvtp.ir.build import FusionBuilder
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import TensorValue


# Thunder's copy_ prim, and the torch executor's operator of it, which Thunder's functionalization binds directly.
COPY_IDS = ("copy_",)


def _is_copy(bsym) -> bool:
    return bsym.sym.id in (PrimIDs.COPY_, *COPY_IDS)


def axis_ranges(key: Any, shape: tuple[int, ...]) -> list[tuple[int, int, int, bool]] | None:
    """``key`` as one (start, stop, step, kept) per axis of a tensor of ``shape`` (``kept``: the
    axis is in ``t[key]``; an integer drops it), or None for a key this module does not take
    (None, tensors, lists, booleans)."""
    items = list(key) if isinstance(key, tuple) else [key]
    if sum(i is Ellipsis for i in items) > 1 or not all(isinstance(i, (int, slice)) or i is Ellipsis for i in items):
        return None
    if any(isinstance(i, bool) for i in items):
        return None
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items[k:k + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    if len(items) > len(shape):
        return None
    items += [slice(None)] * (len(shape) - len(items))
    out = []
    for i, n in zip(items, shape):
        if isinstance(i, int):
            j = i + n if i < 0 else i
            if not 0 <= j < n:
                return None
            out.append((j, j + 1, 1, False))
        else:
            if not all(isinstance(x, int) or x is None for x in (i.start, i.stop, i.step)):
                return None
            start, stop, step = i.indices(n)
            if step < 1:
                return None
            out.append((start, max(start, stop), step, True))
    return out


def supported(a: Any, key: Any, value: Any) -> bool:
    """Whether ``copy_with_setitem(a, key, value)`` is one this module writes."""
    shape = tuple(int(n) for n in getattr(a, "shape", ()))
    return axis_ranges(key, shape) is not None


def copy_with_setitem(b: FusionBuilder, a: TensorValue, key: Any, value: Any) -> TensorValue:
    """``a`` with ``a[key] = value`` (a number or a tensor broadcastable to ``a[key]``'s shape)."""
    ranges = axis_ranges(key, a.shape)
    if ranges is None:
        raise NotImplementedError(f"setitem with the key {key!r}")
    counts = [-(-(stop - start) // step) for start, stop, step, _ in ranges]
    if any(m == 0 for m in counts):
        return a  # an empty region
    mask = None
    for axis, ((start, stop, step, _), n) in enumerate(zip(ranges, a.shape)):
        if (start, stop, step) == (0, n, 1):
            continue
        ids = b.op("iota", n, 0, 1, DType.Int)
        hit = b.op("logical_and", b.op("ge", ids, start), b.op("lt", ids, stop))
        if step > 1:
            hit = b.op("logical_and", hit, b.op("eq", b.op("remainder", b.op("sub", ids, start), step), 0))
        hit = b.op("broadcast_in_dim", hit, shape=list(a.shape), broadcast_dims=[axis])
        mask = hit if mask is None else b.op("logical_and", mask, hit)
    placed = _placed(b, a, ranges, counts, value)
    if mask is None:  # the whole tensor
        return placed if isinstance(placed, TensorValue) else b.op("full", list(a.shape), placed, a.dtype)
    return b.op("where", mask, placed, a)


def _placed(b: FusionBuilder, a: TensorValue, ranges, counts: list[int], value: Any) -> Any:
    """``value`` at the region's places of a tensor shaped like ``a`` (what lies outside the region
    is masked away), or the number itself."""
    if not isinstance(value, TensorValue):
        return value
    region = [m for m, (*_, kept) in zip(counts, ranges) if kept]
    if value.dtype != a.dtype:
        value = b.op("cast", value, dtype=a.dtype)
    if tuple(value.shape) != tuple(region):  # broadcast to the region's shape, as torch's setitem does
        lead = len(region) - value.ndim
        value = b.op("broadcast_in_dim", value, shape=region, broadcast_dims=list(range(lead, len(region))))
    with_dropped = [m if kept else 1 for m, (*_, kept) in zip(counts, ranges)]
    if tuple(with_dropped) != tuple(region):
        value = b.op("broadcast_in_dim", value, shape=with_dropped,
                     broadcast_dims=[i for i, (*_, kept) in enumerate(ranges) if kept])
    config = [(start, n - (start + (m - 1) * step + 1), step - 1) for (start, _, step, _), m, n in zip(ranges, counts, a.shape)]
    zero = 0.0 if a.dtype.is_float else (False if a.dtype == DType.Bool else 0)
    return interior_pad(b, value, zero, config)


def fresh_targets(trace) -> tuple[set[str], dict[str, str]]:
    """(names of the tensors ``copy_`` may write functionally, why each other target may not).

    ``copy_(src, dst)`` is written as ``src`` when, eager semantics and nvtp's alike:

    * ``dst``, followed back through ``update_aliases`` and earlier ``copy_``s, was made by an op of
      the trace that makes a new tensor: not an input of the trace (an argument, parameter or
      buffer), and not a view (a reshape, slice, permute, ...) of another tensor;
    * nothing after the copy reads the memory's contents by a name it had before the copy (a view
      of it taken earlier, or an earlier name), other than through ``update_aliases`` to names no
      one reads: such a read sees the update in eager PyTorch and would not in nvtp's fusion."""
    inputs = {p.name for p in trace.args if isinstance(p, TensorProxy)} if trace.args else set()
    bsyms = list(trace.bound_symbols)
    root: dict[str, str] = {}  # a name -> the name of the tensor it renames (update_aliases, copy_)
    memory: dict[str, str] = {}  # a name -> the tensor whose memory it is (views too)
    made_by: dict[str, Any] = {}
    for bsym in bsyms:
        outs = [o for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy)]
        if bsym.sym.id == PrimIDs.UPDATE_ALIASES:
            pairs = [(src.name, o.name) for src, o in zip(bsym.args[0], outs)]
        elif _is_copy(bsym):
            pairs = [(bsym.args[1].name, o.name) for o in outs]
        else:
            for o in outs:
                made_by[o.name] = bsym
            tensors = [a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy)]
            if tensors and _is_view(bsym):
                for o in outs:
                    memory[o.name] = memory.get(tensors[0].name, tensors[0].name)
            continue
        for src, out in pairs:
            root[out] = root.get(src, src)
            memory[out] = memory.get(src, src)
    fresh, why = set(), {}
    for k, bsym in enumerate(bsyms):
        if not _is_copy(bsym):
            continue
        dst = bsym.args[1].name
        target = root.get(dst, dst)
        maker = made_by.get(target)
        if target in inputs or maker is None:
            why[dst] = f"writes into {target}, an argument, parameter or buffer of the model"
        elif _is_view(maker):
            why[dst] = f"writes into {target}, a view ({maker.sym.name}) of another tensor"
        else:
            stale = _stale_read(bsyms, k, memory.get(dst, dst), memory)
            if stale is not None:
                why[dst] = f"writes into {target}, which {stale.sym.name} reads afterwards by a name it had before"
            else:
                fresh.add(dst)
    return fresh, why


def _stale_read(bsyms: list, k: int, mem: str, memory: dict[str, str]) -> Any:
    """The first op after ``bsyms[k]`` (a copy_ into memory ``mem``) that reads that memory by a
    name made before the copy (directly, or renamed by ``update_aliases`` since), or None."""
    before = {o.name for b in bsyms[:k] for o in b.flat_proxy_outs if hasattr(o, "name")}
    old = {n for n in before if memory.get(n, n) == mem} | {mem}
    for later in bsyms[k + 1:]:
        if later.sym.id == PrimIDs.RETURN:
            continue
        if later.sym.id == PrimIDs.UPDATE_ALIASES:
            old |= {o.name for src, o in zip(later.args[0], later.flat_proxy_outs) if src.name in old}
            continue
        if any(getattr(p, "name", None) in old for p in later.flat_proxy_args):
            return later
    return None


_VIEWS = ("RESHAPE", "SLICE", "TRANSPOSE", "SQUEEZE", "BROADCAST_IN_DIM", "SHALLOW_COPY")


def _is_view(bsym) -> bool:
    """Whether ``bsym`` may return a view of an operand: a view prim, or an op made of view prims only."""
    if bsym.sym.id in {getattr(PrimIDs, n) for n in _VIEWS}:
        return True
    return bool(bsym.subsymbols) and all(_is_view(sub) for sub in bsym.subsymbols)


_WRITABLE: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("nvtp_writable", default=None)


@contextlib.contextmanager
def writable(names: set[str]):
    """Inside, ``copy_`` into the tensors ``names`` (``fresh_targets``) is claimed, and no other."""
    token = _WRITABLE.set(names)
    try:
        yield
    finally:
        _WRITABLE.reset(token)


def copy_claimed(copy_from: Any, copy_to: Any, **kwargs: Any) -> bool:
    """The checker of ``copy_``: its target is one ``writable`` names."""
    names = _WRITABLE.get()
    return names is not None and getattr(copy_to, "name", None) in names
