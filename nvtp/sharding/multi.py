"""Sharding over a mesh of several axes: one placement per axis, one pass per axis.

    mesh = DeviceMesh.of_shape((2, 2), ("dp", "tp"))
    fwd, bwd, data = shard_pair_mesh(forward, backward, "megatron", mesh, fsdp=True)
    fwd.sharding("T3")            # (Shard(dim=0), Shard(dim=1)): dp's placement, then tp's
    fwd.communications            # each ReshardStep names its mesh axis (step.axis)

Each mesh axis has its own plan: the model-parallel axis ("tp") the user's (Megatron, SP,
explicit), a data-parallel axis ("dp") the data plan: every batched input split along its first
dimension, parameters whole (DDP) or, with ``fsdp``, split at rest along a dimension tp leaves
whole (ZeRO-3). The passes run one axis after the other on the same fusion: tp's first, then dp's
on tp's result, each with the unchanged 1-D pipeline (annotate, propagate, plan and insert
reshards) over that axis's extent. A ``set`` one pass inserts is an identity to the other
passes, so each value's placement on each axis is that axis's pass's, and each ``set`` changes one
axis: it runs on that axis's process group.

The data plan is DDP's semantics as a sharding: the loss (a mean over the global batch) is a
partial sum over dp and is all-reduced; each weight gradient contracts the batch, so it is a
partial sum over dp, all-reduced (DDP) or reduce-scattered to the weight's at-rest shard (FSDP).
FSDP's all-gathers are ``set`` ops from a weight's at-rest placement to the whole weight, in the
forward and again in the backward (the backward fusion reads the weights it needs): per rank
and step 3·Ψ·(dp−1)/dp bytes for Ψ the bytes of the rank's tp shard of the sharded weights (a
weight the backward does not read, such as an embedding table, is gathered once: 2·Ψ'·(dp−1)/dp).

FSDP splits a weight along a dimension tp leaves whole. Activations may be split twice along one
dimension, by different factors of it: the batch (dp) and the sequence (tp, with SP) of a
flattened ``[B*T, C]``. A rank holds the entries both axes give it, and a collective on one axis
sees the other's cut (``placements.held``, ``placements.induced``); two axes splitting the same
factor are refused with the value's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Collection, Mapping, Sequence

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.sharding.axes import roles
from nvtp.sharding.passes import backward_annotations, shard
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Placement, Shard, axis_split, held, is_replicate, local_shape
from nvtp.sharding.propagate import ShardingError, reshard_bytes
from nvtp.sharding.reshard import ReshardStep
from nvtp.sharding.sharded import ShardedFusion



@dataclass
class DataPlan:
    """What the data plan did: inputs split along the batch, and per parameter its at-rest
    placement on dp (FSDP) with the reason a parameter stays whole."""

    batched: dict[str, Placement] = field(default_factory=dict)
    at_rest: dict[str, Placement] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def axis_roles(mesh: DeviceMesh) -> tuple[int, int]:
    """(tp axis, dp axis) of a (dp, tp) mesh (``nvtp.sharding.axes.roles`` refuses any other)."""
    axes = roles(mesh)
    if set(axes) != {"dp", "tp"}:
        raise ShardingError(f"a mesh of several axes needs axes named ('dp', 'tp'); got {list(mesh.names)}")
    return axes["tp"], axes["dp"]


def _fsdp_dim(v: TensorValue, tp_placement: Placement, dp: int) -> tuple[int | None, str]:
    """The dimension FSDP splits ``v`` along on dp: the first one tp leaves whole that dp divides."""
    taken = axis_split(tp_placement)
    for dim, n in enumerate(v.shape):
        if taken is not None and taken[0] == dim:
            continue
        if n % dp == 0:
            return dim, ""
    why = "its only dimension is split by tp" if taken is not None and v.ndim == 1 else f"no dimension of {list(v.shape)} that tp leaves whole is a multiple of {dp}"
    return None, why


def data_plan(fusion: Fusion, tp: ShardedFusion, dp: int, fsdp: bool, batched: Collection[str] | None = None,
              weights: Collection[str] | None = None) -> DataPlan:
    """The dp axis's plan for a forward fusion (``tp``: its tp-sharded form). ``batched``: the
    labels of the inputs that carry the batch (the module's arguments); None: every input that is
    not a parameter. ``weights``: the labels FSDP may split (the module's parameters, not its
    buffers); None: every parameter input."""
    plan = DataPlan()
    batch_inputs = [v for v in fusion.inputs if isinstance(v, TensorValue) and fusion.role(v.name) != "parameter" and v.ndim >= 1
                    and (batched is None or fusion.label(v.name) in batched)]
    for v in batch_inputs:
        if v.shape[0] % dp == 0 and v.shape[0] >= dp:
            plan.batched[v.name] = Shard(0)
        elif v.shape[0] != 1:
            raise ShardingError(f"input {fusion.label(v.name) or v.name} ({v.describe()}): its batch dimension of size {v.shape[0]} "
                                f"cannot be split over the dp axis of size {dp}; use a batch that is a multiple of {dp} per step")
    if not plan.batched:
        shapes = ", ".join(f"{fusion.label(v.name) or v.name} {list(v.shape)}" for v in batch_inputs) or "none"
        raise ShardingError(f"the dp axis of size {dp} splits the batch, but no input has a batch dimension it divides (inputs: {shapes}); "
                            f"pass a batch of at least {dp} (a multiple of {dp})")
    if fsdp:
        for v in fusion.inputs:
            if isinstance(v, TensorValue) and fusion.role(v.name) == "parameter" and (weights is None or fusion.label(v.name) in weights):
                dim, why = _fsdp_dim(v, tp.placement(v.name), dp)
                label = fusion.label(v.name) or v.name
                if dim is None:
                    plan.notes.append(f"fsdp: {label} stays whole on dp: {why}")
                else:
                    plan.at_rest[v.name] = Shard(dim)
    return plan


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
    want = local_shape(v.shape, sharding, mesh)
    for rank in mesh.devices:
        got = held(v.shape, sharding, mesh, mesh.coords(rank))
        if any(g is not None and g.numel() != w for g, w in zip(got, want)):
            raise ShardingError(f"{v.describe()}: mesh axes {list(mesh.names)} split one of its axes over the same entries "
                                f"({', '.join(map(str, sharding))}); a tensor axis is split by two mesh axes only along different factors")


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
                         axes=tuple(axes[a] for a in range(mesh.ndim)))


def shard_mesh(fusion: Fusion, plan: str | Mapping[str, Any], mesh: DeviceMesh, *, fsdp: bool = False,
               target: str = "nvfuser", batched: Collection[str] | None = None,
               annotations: Mapping[str, tuple[Placement, ...]] | None = None,
               output_hints: Mapping[str, Placement] | None = None,
               weights: Collection[str] | None = None) -> tuple[ShardedFusion, DataPlan]:
    """Shard a forward fusion over a 2-D (dp, tp) mesh: ``plan`` on tp, the data plan on dp.
    ``annotations`` (input -> sharding) keep inputs where they already are (a new trace of a
    module whose parameters are placed); ``output_hints`` are tp's (e.g. outputs whole over tp)."""
    tp_axis, dp_axis = axis_roles(mesh)
    tp_ann = {n: s[tp_axis] for n, s in (annotations or {}).items()}
    tp = shard(fusion, plan, mesh.sub(tp_axis), annotations=tp_ann, output_hints=output_hints, target=target)
    data = data_plan(fusion, tp, mesh.shape[dp_axis], fsdp, batched, weights)
    for n, s in (annotations or {}).items():
        if not is_replicate(s[dp_axis]):
            data.at_rest[n] = s[dp_axis]
        else:
            data.at_rest.pop(n, None)
    dp = shard(tp.fusion, "replicate", mesh.sub(dp_axis), annotations=data.batched, target=target, at_rest=data.at_rest,
               hoist=False, keep_splits=True)
    sharded = combine([(tp_axis, tp), (dp_axis, dp)], mesh, fusion, plan if isinstance(plan, str) else "explicit")
    return sharded, data


def shard_backward_mesh(backward: Fusion, forward: ShardedFusion, target: str = "nvfuser",
                        output_hints: Mapping[str, Placement] | None = None) -> ShardedFusion:
    """Shard a backward fusion over its forward's 2-D mesh, axis by axis, consistently with it.
    ``output_hints`` are tp's, over the defaults (gradients where their parameters live)."""
    mesh = forward.mesh
    tp_axis, dp_axis = axis_roles(mesh)
    inputs, hints = backward_annotations(backward, forward.view(tp_axis))
    hints.update(output_hints or {})
    tp = shard(backward, "replicate", mesh.sub(tp_axis), annotations=inputs, output_hints=hints, target=target)
    inputs, hints = backward_annotations(backward, forward.view(dp_axis))
    hints = {out.name: hints[src.name] for src, out in zip(backward.outputs, tp.fusion.outputs) if src.name in hints}
    at_rest = {n: p for n, p in inputs.items() if backward.role(n) == "parameter" and not is_replicate(p)}
    annotations = {n: (REPLICATE if n in at_rest else p) for n, p in inputs.items()}
    dp = shard(tp.fusion, "replicate", mesh.sub(dp_axis), annotations=annotations, output_hints=hints, target=target,
               at_rest=at_rest, hoist=False, keep_splits=True)
    return combine([(tp_axis, tp), (dp_axis, dp)], mesh, backward, forward.plan)


def shard_pair_mesh(forward: Fusion, backward: Fusion | None, plan: str | Mapping[str, Any], mesh: DeviceMesh, *,
                    fsdp: bool = False, target: str = "nvfuser", weights: Collection[str] | None = None
                    ) -> tuple[ShardedFusion, ShardedFusion | None, DataPlan]:
    fwd, data = shard_mesh(forward, plan, mesh, fsdp=fsdp, target=target, weights=weights)
    bwd = shard_backward_mesh(backward, fwd, target) if backward is not None else None
    return fwd, bwd, data
