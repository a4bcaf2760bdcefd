"""Projections: the matmuls of a fusion whose weight is a fusion input, as the plans see them.

A *projection* is a ``linear`` whose weight is a fusion input, a ``matmul(x, W)`` whose ``W`` is
a 2-D input (GPT-2's ``Conv1D``), or an experts' ``gather_mm(x, W, index)`` whose ``W``
``[experts, in, out]`` is an input or the transpose of one (``[experts, out, in]``,
transformers' layout): Megatron splits an expert's ffn as it splits a dense one, every expert's
output features (column-parallel) or input features (row-parallel). ``fused_parts`` says how many
equal parts a projection's output is read as (fused QKV, an expert's fused gate|up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from nvtp.ir.graph import Fusion, Op


@dataclass(frozen=True)
class Projection:
    op_index: int
    op: Op
    weight: str
    bias: str | None
    split_factor: int  # > 1 for fused projections
    out_axis: int = 0  # the weight's axis of output features: 0 for linear ([out, in]), 1 for x @ W ([in, out])
    contracted: int | None = None  # the weight's axis of input features where it is not the other of two (experts' 3-D weights)

    @property
    def in_axis(self) -> int:
        """The weight's axis of input (contracted) features, split in a row-parallel projection."""
        return 1 - self.out_axis if self.contracted is None else self.contracted


def projections(fusion: Fusion) -> list[Projection]:
    """Every ``linear`` whose weight is a fusion input, every ``matmul(x, W)`` whose ``W`` is
    a 2-D fusion input (``x @ W``, weight ``[in, out]``: GPT-2's ``Conv1D``, whose bias is the
    ``add`` of a broadcast 1-D input that follows), and every experts' ``gather_mm`` of an input
    weight (``_expert_weight``)."""
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
        elif op.kind == "gather_mm" and (axes := _expert_weight(op, inputs, producers)) is not None:
            name, out_axis, in_axis = axes
            found.append(Projection(i, op, name, None, fused_parts(op, consumers), out_axis=out_axis, contracted=in_axis))
    return found


def _expert_weight(op: Op, inputs: set[str], producers: Mapping[str, Op]) -> tuple[str, int, int] | None:
    """(input, output-features axis, input-features axis) of a ``gather_mm``'s weight ``[E, K, N]``
    when it is a fusion input, or a permute of one that keeps the expert axis first."""
    w = op.arg("arg2")
    if w.name in inputs:
        return w.name, 2, 1
    source = producers.get(w.name)
    if source is not None and source.kind == "permute" and source.operands[0].name in inputs and source.arg("dims")[0] == 0:
        dims = source.arg("dims")
        return source.operands[0].name, dims[2], dims[1]
    return None


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
