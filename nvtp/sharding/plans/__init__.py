"""Sharding plans: which placement each fusion input starts with.

``megatron`` is derived from the fusion graph, not from parameter names. A *projection* is a
``linear`` whose weight is a fusion input. Projection P is column-parallel when splitting its
output features reaches the contracted input of another projection Q without communication
(through pointwise ops, reshapes, attention, ...); Q is then row-parallel. Whether the sharding
gets through is asked of the propagation itself, so any block Thunder traces pairs up: fused or
separate q/k/v, GQA, SwiGLU, with or without biases. A fused projection (its output sliced into
k equal parts, like QKV's 3e into q, k, v) is split as ``_StridedShard(0, k)``: each rank holds
its slice of each part, so no weight is permuted by hand. A fused projection of parts of
*different* sizes (Phi-3's q 64 | k 32 | v 32) reaches the plans already split into one
projection per part by the FX front end (``nvtp.frontend.fused``). KV heads fewer than the
devices (multi-query attention) stay whole on every rank, named in the notes.

``megatron-sp`` adds sequence parallelism (Korthikanti et al., arXiv 2205.05198): activation
inputs are split along the sequence, so LayerNorm, dropout and residual regions run on 1/d of
the tokens, and the all-reduces become all-gathers and reduce-scatters.

Explicit plans map parameter-name globs (or module-name globs) to placements, ``"colwise"`` /
``"rowwise"``, or torch's ``ColwiseParallel()`` / ``RowwiseParallel()``; a per-input plan maps a
dumped fusion's value names (``T3``) to placements.

The package: ``base.py`` (projections read off the graph, ``Annotations``), ``derived.py`` (the
derived plans), ``pairing.py`` (which projection pairs with which, by propagation),
``explicit.py`` (name globs and per-input plans, ``check_plan``).
"""

from nvtp.sharding.plans.base import Annotations, Projection, fused_parts, projections
from nvtp.sharding.plans.explicit import PLAN_NAMES, check_plan, explicit, parse_placement, parse_plan_text, per_input
from nvtp.sharding.plans.derived import megatron

__all__ = ["Annotations", "Projection", "fused_parts", "projections", "PLAN_NAMES", "check_plan", "explicit", "parse_placement",
           "parse_plan_text", "per_input", "megatron"]
