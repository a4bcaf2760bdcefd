"""Sharding over a mesh of several axes: one placement per axis, one pass per axis, composed.

Each mesh axis's strategy (``nvtp.sharding.axes``) runs its 1-D pass over its extent on the
fusion the pass before it left (tp's plan, then dp's data plan, then cp's sequence split).
``compose`` makes one ``ShardedFusion`` of them: a ``set`` one pass inserts is an identity to
the other passes, so each value's placement on each axis is that axis's pass's, and each ``set``
changes one axis: it runs on that axis's process group.

Activations may be split twice along one dimension, by different factors of it: the batch (dp)
and the sequence (tp, with SP) of a flattened ``[B*T, C]``. A rank holds the entries both axes
give it, and a collective on one axis sees the other's cut (``placements.held``,
``placements.induced``); two axes splitting the same factor are refused with the value's name.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Collection, Mapping, Sequence

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.sharding.placements import REPLICATE, DeviceMesh, FusedParts, Placement, axis_split, held, local_shape
from nvtp.sharding.propagate import ShardingError, reshard_bytes
from nvtp.sharding.reshard import ReshardStep
from nvtp.sharding.sharded import ShardedFusion


def _rebytes(step: ReshardStep, axis: int, mesh: DeviceMesh, sharding: tuple[Placement, ...]) -> ReshardStep:
    """``step`` (planned on one axis over global bytes) counted on the rank's part along the other axes."""
    local = step.tensor_bytes
    for a, p in enumerate(sharding):
        if a != axis and axis_split(p) is not None:
            local //= mesh.shape[a]
    return replace(step, tensor_bytes=local, bytes=round(reshard_bytes(step.src, step.dst, local, mesh.shape[axis])), axis=axis)


def _check_shared_axis(v: TensorValue, sharding: tuple[Placement, ...], mesh: DeviceMesh) -> None:
    """Two mesh axes may split one tensor axis only by splitting different factors of it (the
    batch and the sequence of a flattened ``[B*T, C]``): then every rank holds 1/(n1*n2) of it."""
    if not _shares_fairly(v.shape, sharding, mesh.shape):
        raise ShardingError(f"{v.describe()}: mesh axes {list(mesh.names)} split one of its axes over the same entries "
                            f"({', '.join(map(str, sharding))}); a tensor axis is split by two mesh axes only along different factors")


@functools.lru_cache(maxsize=4096)
def _shares_fairly(shape: tuple[int, ...], sharding: tuple[Placement, ...], extents: tuple[int, ...]) -> bool:
    """Whether every mesh position holds ``local_shape``'s count of each tensor axis. Only the
    mesh axes that split a tensor axis change what a rank holds, so the positions checked are
    those axes' coordinates (the others at 0); past 64 of them (a large mesh: the planner's
    1024 devices), each splitting axis's coordinates 0, 1, n/2 and n-1: the placements nvtp has
    (contiguous, strided and zigzag pieces) hold pieces affine in the coordinate, so two axes
    splitting one factor already disagree at those. Cached: a model's values share a few shapes."""
    mesh = DeviceMesh.of_shape(extents, tuple(f"a{i}" for i in range(len(extents))))
    shape = _reduced(shape, sharding, extents)
    want = local_shape(shape, sharding, mesh)
    splitting = [a for a, p in enumerate(sharding) if axis_split(p) is not None]
    ranges = [range(extents[a]) for a in splitting]
    if math.prod(len(r) for r in ranges) > 64:
        ranges = [sorted({0, min(1, n - 1), n // 2, n - 1}) for n in (extents[a] for a in splitting)]
    for picked in itertools.product(*ranges):
        coords = [0] * len(extents)
        for a, c in zip(splitting, picked):
            coords[a] = c
        got = held(shape, sharding, mesh, coords)
        if any(g is not None and g.numel() != w for g, w in zip(got, want)):
            return False
    return True


def _reduced(shape: tuple[int, ...], sharding: tuple[Placement, ...], extents: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with each tensor axis divided by the gcd g of the pieces the placements splitting it
    cut it into (size / (split factor x devices)): a rank's entries are then g-long runs at the
    reduced axis's entries times g, so every count scales by g and the check holds on the reduced
    shape iff on the whole (the planner's 8.4M-row flattened batch checks on 8K rows). An axis a
    placement does not divide evenly, or fused parts split, is kept whole."""
    out = list(shape)
    for dim, size in enumerate(shape):
        pieces = []
        for n, p in zip(extents, sharding):
            split = axis_split(p)
            if split is None or split[0] != dim:
                continue
            if isinstance(p, FusedParts) or size % (split[1] * n):
                pieces = []
                break
            pieces.append(size // (split[1] * n))
        if pieces:
            out[dim] = size // math.gcd(*pieces)
    return tuple(out)


def compose(passes: Sequence[tuple[int, ShardedFusion]], mesh: DeviceMesh, source: Fusion, plan: str) -> ShardedFusion:
    """One ShardedFusion of the per-axis passes run one after the other; a mesh of one axis keeps
    its one pass, on the mesh itself (its devices, e.g. a pipeline stage's global ranks)."""
    if len(passes) == 1 and mesh.ndim == 1:
        return replace(passes[0][1], mesh=mesh, plan=plan)
    return combine(passes, mesh, source, plan)


def combine(passes: Sequence[tuple[int, ShardedFusion]], mesh: DeviceMesh, source: Fusion, plan: str) -> ShardedFusion:
    """One ShardedFusion from per-axis passes run one after the other (``passes`` in run order:
    each pass sharded the previous one's fusion)."""
    final = passes[-1][1]
    fusion = final.fusion
    producers = fusion.producers()
    shardings: dict[str, list[Placement]] = {}

    def placement_on(k: int, name: str) -> Placement:
        _, s = passes[k]
        if name in s.shardings and name in s.fusion.values:  # (a pass's shardings may keep names its fusion dropped)
            return s.shardings[name][0]
        op = producers.get(name)  # a set a later pass inserted: an identity on this axis
        if op is None or op.kind != "set":
            raise ShardingError(f"{name}: no placement on mesh axis {mesh.names[passes[k][0]]} (made by {op})")
        return placement_on(k, op.operands[0].name)

    for v in fusion.values.values():
        if not isinstance(v, TensorValue):
            continue
        per_axis: list[Placement] = [REPLICATE] * mesh.ndim
        for k, (axis, _) in enumerate(passes):
            per_axis[axis] = placement_on(k, v.name)
        split_dims = [axis_split(p)[0] for p in per_axis if axis_split(p) is not None]
        if len(split_dims) != len(set(split_dims)):
            _check_shared_axis(v, tuple(per_axis), mesh)
        shardings[v.name] = per_axis
    frozen = {k: tuple(p) for k, p in shardings.items()}
    set_steps: dict[str, ReshardStep] = {}
    for axis, s in passes:
        for name, step in s.set_steps.items():
            if name in frozen:
                set_steps[name] = _rebytes(step, axis, mesh, frozen[step.value] if step.value in frozen else frozen[name])
    first = passes[0][1]
    seconds = {f"{mesh.names[a]}:{k}": t for a, s in passes for k, t in s.seconds.items()}
    axes = {a: s for a, s in passes}
    return ShardedFusion(fusion, source, mesh, frozen, set_steps, first.annotations, plan, first.propagation, seconds,
                         axes=tuple(axes[a] for a in range(mesh.ndim)), options={k: v for _, s in passes for k, v in s.options.items()})
