"""The mixture-of-experts layers of a fusion, read from its graph: which ``gather_mm`` ops make one
layer (they share the expert index of each routed row), its experts, top-k and routed rows, and
its expert weights. ``nvtp explain`` prints them (``summary``); the expert-parallel axis
(``nvtp.sharding.axes.ep``) places experts by them.
"""

from __future__ import annotations

from dataclasses import dataclass

from nvtp.ir.graph import Fusion, Op
from nvtp.sharding.placements import axis_split
from nvtp.sharding.projections import projections
from nvtp.sharding.sharded import ShardedFusion

# Ops an expert index passes through unchanged from the router's topk to a gather_mm.
_CARRY = ("reshape", "cast", "set", "segment_set", "squeeze", "broadcast_in_dim")


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer: ``experts`` experts, each routed row one token's choice (``top_k`` a token,
    or 0 where no ``topk`` was found), ``rows`` routed rows per step, and the expert weights
    (fusion input names, in the order the layer uses them)."""

    index: str  # the expert index value the layer's gather_mm ops share
    experts: int
    top_k: int
    rows: int
    weights: tuple[str, ...]

    @property
    def tokens(self) -> int:
        return self.rows // self.top_k if self.top_k else self.rows


def moe_layers(fusion: Fusion) -> list[MoELayer]:
    """The MoE layers of a (forward) fusion, in order; [] for a dense model."""
    producers = fusion.producers()
    weights: dict[str, list[str]] = {}
    first: dict[str, Op] = {}
    for p in projections(fusion):
        if p.op.kind == "gather_mm":
            index = p.op.arg("index").name
            weights.setdefault(index, []).append(p.weight)
            first.setdefault(index, p.op)
    for op in fusion.ops:  # a gather_mm whose weight is computed (no projection) still makes a layer
        if op.kind == "gather_mm":
            first.setdefault(op.arg("index").name, op)
            weights.setdefault(op.arg("index").name, [])
    layers = []
    for index, op in first.items():
        layers.append(MoELayer(index, op.arg("arg2").shape[0], _top_k(producers, op.arg("index")), op.arg("arg1").shape[0],
                               tuple(weights[index])))
    return layers


def _top_k(producers: dict[str, Op], v) -> int:
    """k of the ``topk`` the index comes from (through reshapes and casts), or 0."""
    while True:
        op = producers.get(v.name)
        if op is None:
            return 0
        if op.kind == "topk":
            return op.arg("k")
        if op.kind not in _CARRY:
            return 0
        v = op.operands[0]


def module_of(fusion: Fusion, layer: MoELayer) -> str:
    """The module a layer's expert weights share (``h.0.moe.experts``), else its index value's name."""
    return _common_prefix([fusion.label(w) for w in layer.weights]) or layer.index


def summary(sharded: ShardedFusion) -> dict[str, str]:
    """One line per MoE layer of a sharded forward, keyed by the module its weights share
    (``h.0.moe.experts``): experts, top-k, routed rows, and what each rank holds of the experts."""
    f = sharded.source
    out = {}
    for layer in moe_layers(f):
        labels = [f.label(w) for w in layer.weights]
        module = _common_prefix(labels) or layer.index
        held = []
        for w, label in zip(layer.weights, labels):
            splits = [axis_split(p) for p in sharded.shardings.get(w, ())]
            where = ", ".join(f"{n} S({s[0]})" for n, s in zip(sharded.mesh.names, splits) if s is not None) or "whole"
            held.append(f"{label[len(module) + 1:] if module else label} {where}")
        routing = f"top-{layer.top_k}, {layer.rows} routed rows ({layer.tokens} tokens x {layer.top_k})" if layer.top_k \
            else f"{layer.rows} routed rows"
        out[module] = f"MoE: {layer.experts} experts, {routing}; expert weights {', '.join(held) or 'computed'}"
    return out


def _common_prefix(labels: list[str]) -> str:
    parts = [label.split(".")[:-1] for label in labels]
    if not parts:
        return ""
    common = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return ".".join(common)
