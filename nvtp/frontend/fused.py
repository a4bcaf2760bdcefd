"""Fused projections with parts of different sizes, split into one projection per part (FX route).

Phi-3's ``qkv_proj`` (q 64 | k 32 | v 32 rows with grouped-query attention) and Falcon's
multi-query ``query_key_value`` (q 64 | k 16 | v 16) are one ``linear`` whose output is read
only as slices of its feature axis, of different widths. No placement splits such a weight so
that each rank holds a whole number of heads of each part (torch's ``_StridedShard(0, k)`` needs
k equal parts, which the plans keep using: GPT-2's ``c_attn``, Phi-3's ``gate_up_proj``).

``split_fused_projections`` rewrites the graph instead: each part is its own ``linear`` on the
part's rows of the weight, read from its own graph input labelled ``<weight>[start:stop]``
(``model.layers.0.self_attn.qkv_proj.weight[64:96]``). The plans then see separate q, k and v
projections, as in Llama, and place each part by itself: q and, with enough KV heads, k and v
column-parallel; a KV head fewer than the devices stays whole on every rank (its weight's
gradient is summed over the ranks), as Llama's ``k_proj`` with one KV head.

The user's model keeps one parameter: ``nvtp.parallel`` feeds each part as rows of the rank's
part of the weight and concatenates the parts' gradients into the weight's. On a rank the weight
holds each part's own rows one after the other; ``FusedParts`` is that layout (the parameter's
placement), which ``nvtp.sharding.placements.local_indices`` reads like any other.

Three read patterns are recognised (``y = linear(x, W, b)``, ``y: [..., n]``):

* slices of the last axis: ``y[..., a:b]`` (Phi-3);
* one ``split`` or ``chunk`` of the last axis: ``q, k, v = y.split([64, 32, 32], dim=-1)``;
* one view splitting the last axis into ``[m, h]``, then slices of ``m``: ``y.view(..., m, h)[..., a:b, :]``
  (Falcon multi-query, after ``[..., [-2], :]`` became ``[..., -2:-1, :]``).

A weight read by anything else (another op, another projection) stays as it is.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

_LINEARS = (torch.nn.functional.linear, torch._C._nn.linear)
_VIEWS = ("view", "reshape")


@dataclass(frozen=True)
class Part:
    """Rows ``start:stop`` of parameter ``weight``, a graph input of its own named ``label``."""

    weight: str
    start: int
    stop: int

    @property
    def label(self) -> str:
        return part_label(self.weight, self.start, self.stop)


def part_label(weight: str, start: int, stop: int) -> str:
    return f"{weight}[{start}:{stop}]"


def _example(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _axis_range(node: fx.Node, base: fx.Node, shape: tuple[int, ...], axis: int) -> tuple[int, int] | None:
    """(start, stop) if ``node`` is ``base[..., start:stop, (:)]`` selecting a range of ``axis``
    (step 1, every other axis whole), else None."""
    if not (node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2 and node.args[0] is base):
        return None
    return index_range(node.args[1], shape, axis)


def index_range(key: Any, shape: tuple[int, ...], axis: int) -> tuple[int, int] | None:
    """(start, stop) if indexing a tensor of ``shape`` with ``key`` (``x[key]``) selects the range
    ``start:stop`` of ``axis`` (step 1) and every other axis whole, else None."""
    index = key if isinstance(key, tuple) else (key,)
    if sum(i is Ellipsis for i in index) > 1 or any(not (i is Ellipsis or isinstance(i, slice)) for i in index):
        return None
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (len(shape) - len(index) + 1) + index[k + 1:]
    index = index + (slice(None),) * (len(shape) - len(index))
    if len(index) != len(shape):
        return None
    for d, i in enumerate(index):
        whole = i == slice(None) or (i.step in (None, 1) and i.indices(shape[d]) == (0, shape[d], 1))
        if d != axis and not whole:
            return None
    start, stop, step = index[axis].indices(shape[axis])
    if step != 1 or stop <= start:
        return None
    return start, stop


def split_ranges(kind: str, size: Any, n: int) -> list[tuple[int, int]] | None:
    """The ranges ``torch.split(y, size, -1)`` (``kind`` "split": an int or a list of sizes) or
    ``torch.chunk(y, size, -1)`` (``kind`` "chunk") gives of a last axis of ``n``."""
    if kind == "chunk":
        if not isinstance(size, int) or size < 1:
            return None
        size = -(-n // size)
    sizes = [size] * -(-n // size) if isinstance(size, int) else list(size)
    if not sizes or any(not isinstance(k, int) or k < 0 for k in sizes) or (not isinstance(size, int) and sum(sizes) != n):
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(a, min(a + k, n)) for a, k in zip(starts, sizes)]


_SPLITS = {torch.split: "split", torch.functional.split: "split", torch.Tensor.split: "split", torch.chunk: "chunk",
           torch.Tensor.chunk: "chunk", "split": "split", "chunk": "chunk"}


def _split_reads(node: fx.Node, y: fx.Node, ndim: int, n: int) -> list[tuple[fx.Node, int, int]] | None:
    """[(getitem, first row, end row)] when ``node`` is ``y.split(sizes, -1)`` / ``y.chunk(k, -1)``
    read only by indexing its results."""
    kind = _SPLITS.get(node.target) if node.op in ("call_function", "call_method") else None
    if kind is None or not node.args or node.args[0] is not y:
        return None
    size = node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size_or_sections", node.kwargs.get("chunks"))
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if not isinstance(dim, int) or dim % ndim != ndim - 1:
        return None
    ranges = split_ranges(kind, size, n)
    users = list(node.users)
    if ranges is None or not users or any(u.op != "call_function" or u.target is not operator.getitem or not isinstance(u.args[1], int)
                                          for u in users):
        return None
    return [(u, *ranges[u.args[1]]) for u in users]


def _reads(y: fx.Node, n: int) -> tuple[list[tuple[fx.Node, int, int]], fx.Node | None, bool] | None:
    """How the projection's output ``y`` (last axis ``n``) is read: [(getitem, first row, end row)],
    the node between them (a view or a split, or None), and whether that node is a view (each part
    is then reshaped as the slice of the view it replaces), when it is read only as ranges of its
    features: slices, one ``split``/``chunk`` of the last axis, or one view splitting the last axis."""
    shape = tuple(_example(y).shape)
    users = list(y.users)
    ranges = [(u, _axis_range(u, y, shape, len(shape) - 1)) for u in users]
    if users and all(r is not None for _, r in ranges):
        return [(u, a, b) for u, (a, b) in ranges], None, False
    if len(users) != 1:
        return None
    split = _split_reads(users[0], y, len(shape), n)
    if split is not None:
        return split, users[0], False
    view = users[0]
    if not (view.op == "call_method" and view.target in _VIEWS) and not (view.op == "call_function" and view.target is torch.reshape):
        return None
    vshape = tuple(_example(view).shape) if isinstance(_example(view), torch.Tensor) else ()
    if len(vshape) != len(shape) + 1 or vshape[:-2] != shape[:-1] or vshape[-2] * vshape[-1] != n:
        return None
    h = vshape[-1]
    ranges = [(u, _axis_range(u, view, vshape, len(vshape) - 2)) for u in view.users]
    if not ranges or any(r is None for _, r in ranges):
        return None
    return [(u, a * h, b * h) for u, (a, b) in ranges], view, True


def tiles(rows: list[tuple[int, int]], n: int) -> bool:
    """Whether the distinct ranges cover ``0:n`` exactly, one after the other, in parts of different widths."""
    parts = sorted(set(rows))
    if len(parts) < 2 or parts[0][0] != 0 or parts[-1][1] != n:
        return False
    if any(a[1] != b[0] for a, b in zip(parts, parts[1:])):
        return False
    return len({b - a for a, b in parts}) > 1  # equal parts: _StridedShard in the plans (plans.fused_parts)


def split_fused_projections(g: fx.Graph, attrs: dict[str, Any]) -> dict[str, Part]:
    """Write each fused projection read as parts of different widths as one projection per part
    (see the module docstring). ``attrs`` (the graph module's tensors by name) gains the parts and
    loses a weight no longer read whole. Returns the new inputs by label."""
    readers: dict[str, int] = {}
    for node in g.nodes:
        if node.op == "get_attr":
            readers[node.target] = readers.get(node.target, 0) + len(node.users)
    made: dict[str, Part] = {}
    for node in list(g.nodes):
        if not (node.op == "call_function" and node.target in _LINEARS) or node.kwargs:
            continue
        x, w, *rest = node.args
        b = rest[0] if rest else None
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and readers.get(w.target) == 1):
            continue
        weight = attrs.get(w.target)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not isinstance(_example(node), torch.Tensor):
            continue
        if b is not None and not (isinstance(b, fx.Node) and b.op == "get_attr" and readers.get(b.target) == 1):
            continue
        n = weight.shape[0]
        reads = _reads(node, n)
        if reads is None or not tiles([(a, c) for _, a, c in reads[0]], n):
            continue
        getitems, between, is_view = reads
        parts: dict[tuple[int, int], fx.Node] = {}
        for start, stop in sorted({(a, c) for _, a, c in getitems}):
            with g.inserting_before(node):
                wp = _part_input(g, attrs, made, w.target, start, stop)
                bp = _part_input(g, attrs, made, b.target, start, stop) if b is not None else None
                parts[(start, stop)] = g.call_function(node.target, (x, wp, bp))
        for u, start, stop in getitems:
            new = parts[(start, stop)]
            if is_view:  # the part viewed as the slice of the view it replaces: [..., parts, h]
                with g.inserting_after(new):
                    new = g.call_method("reshape", (new, tuple(_example(u).shape)))
            u.replace_all_uses_with(new)
            g.erase_node(u)
        if between is not None:
            g.erase_node(between)
        g.erase_node(node)
        for attr in (w, b):
            if attr is not None:
                g.erase_node(attr)
                attrs.pop(attr.target, None)
    return made


def _part_input(g: fx.Graph, attrs: dict[str, Any], made: dict[str, Part], name: str, start: int, stop: int) -> fx.Node:
    whole = attrs[name]
    part = Part(name, start, stop)
    if part.label not in attrs:
        value = torch.empty((stop - start, *whole.shape[1:]), dtype=whole.dtype, device=whole.device)
        attrs[part.label] = torch.nn.Parameter(value, requires_grad=whole.requires_grad) if isinstance(whole, torch.nn.Parameter) else value
        made[part.label] = part
    with warnings.catch_warnings():  # the graph module holding the part is made after the rewrite (fx.export_program)
        warnings.simplefilter("ignore", UserWarning)
        return g.get_attr(part.label)
