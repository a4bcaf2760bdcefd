"""What the plans read off the graph, and what a plan gives: ``Projection`` (a ``linear`` or
``x @ W`` whose weight is a fusion input, with its bias and fused parts) and ``Annotations``
(input value -> placement, with the plan's notes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from nvtp.ir.graph import Fusion, Op
from nvtp.sharding.placements import Placement


@dataclass(frozen=True)
class Projection:
    op_index: int
    op: Op
    weight: str
    bias: str | None
    split_factor: int  # > 1 for fused projections
    out_axis: int = 0  # the weight's axis of output features: 0 for linear ([out, in]), 1 for x @ W ([in, out])

    @property
    def in_axis(self) -> int:
        """The weight's axis of input (contracted) features, split in a row-parallel projection."""
        return 1 - self.out_axis


@dataclass
class Annotations:
    """A plan applied to one fusion: input value -> placement, and what it decided and why."""

    placements: dict[str, Placement]
    notes: list[str] = field(default_factory=list)
    column: list[str] = field(default_factory=list)
    row: list[str] = field(default_factory=list)
    hints: dict[str, Placement] = field(default_factory=dict)  # soft wishes for values inside the fusion


def projections(fusion: Fusion) -> list[Projection]:
    """Every ``linear`` whose weight is a fusion input, and every ``matmul(x, W)`` whose ``W`` is
    a 2-D fusion input (``x @ W``, weight ``[in, out]``: GPT-2's ``Conv1D``, whose bias is the
    ``add`` of a broadcast 1-D input that follows)."""
    inputs = {v.name for v in fusion.inputs}
    consumers = fusion.consumers()
    producers = fusion.producers()
    found = []
    for i, op in enumerate(fusion.ops):
        if op.kind == "linear":
            w, b = op.arg("arg2"), op.arg("bias")
            if w.name not in inputs or w.ndim != 2:
                continue
            found.append(Projection(i, op, w.name, b.name if b is not None and b.name in inputs else None, fused_parts(op, consumers)))
        elif op.kind == "matmul":
            w = op.arg("arg2")
            if w.name not in inputs or w.ndim != 2 or op.arg("arg1").ndim < 2:
                continue
            bias, out = _matmul_bias(op, inputs, consumers, producers)
            found.append(Projection(i, op, w.name, bias, fused_parts(op, consumers, out), out_axis=1))
    return found


def _matmul_bias(op: Op, inputs: set[str], consumers: Mapping[str, list[Op]], producers: Mapping[str, Op]) -> tuple[str | None, Any]:
    """The bias of ``x @ W`` (the only consumer adds a 1-D input broadcast along the last axis) and
    the biased output; (None, the product) without one."""
    out = op.outputs[0]
    users = consumers.get(out.name, [])
    if len(users) != 1 or users[0].kind != "add":
        return None, out
    other = next((x for x in users[0].operands if x.name != out.name), None)
    b = producers.get(other.name) if other is not None else None
    if b is not None and b.kind == "broadcast_in_dim" and b.operands[0].name in inputs and b.operands[0].ndim == 1 \
            and list(b.arg("broadcast_dims")) == [out.ndim - 1]:
        return b.operands[0].name, users[0].outputs[0]
    return None, out


def fused_parts(op: Op, consumers: Mapping[str, list[Op]], out: Any = None) -> int:
    """k if the projection's output features are only read as k equal, aligned slices (fused QKV),
    directly or after reshapes that keep the feature axis (``x @ W`` on flattened tokens)."""
    out = op.outputs[0] if out is None else out
    n = out.shape[-1]
    users = consumers.get(out.name, [])
    while len(users) == 1 and users[0].kind == "reshape" and users[0].outputs[0].shape[-1] == n:
        out = users[0].outputs[0]
        users = consumers.get(out.name, [])
    parts = set()
    for u in users:
        if u.kind != "slice":
            return 1
        start, end = u.arg("start_indices")[-1], u.arg("end_indices")[-1]
        strides = u.arg("strides")
        if strides is not None and strides[-1] != 1:
            return 1
        parts.add((start, min(end, n)))
    if len(parts) < 2:
        return 1
    widths = {e - s for s, e in parts}
    if len(widths) != 1:
        return 1
    w = widths.pop()
    if n % w or any(s % w for s, _ in parts) or len(parts) != n // w:
        return 1
    return n // w



def reshape_group(src: tuple[int, ...], dst: tuple[int, ...], axis: int) -> list[int] | None:
    """The output sizes axis ``axis`` of ``src`` becomes under a reshape to ``dst`` (None if it merges)."""
    i = j = 0
    while i < len(src) and j < len(dst):
        a, group, b = src[i], [dst[j]], dst[j]
        j += 1
        while b < a and j < len(dst):
            group.append(dst[j])
            b *= dst[j]
            j += 1
        if b != a:
            return None
        if i == axis:
            return group
        i += 1
    return None
