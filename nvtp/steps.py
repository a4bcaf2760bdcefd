"""The steps of a program: every reshard and every exchange of data a training step makes, as
data, in the order a backend runs them (``Program.steps()``; the report's regions read the same).

    issued_steps("forward", sharded, schedule)   # [Step(kind="allreduce", axis="tp", tensors=(...), at=41, payload=...)]
    tensor_steps("forward", sharded)             # one step per tensor, before a schedule groups them

A step is one call a rank makes: a collective (a bucket of the schedule is one, naming each
tensor it carries), a point-to-point exchange (a ring's, a pipeline's), or a local reshard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from nvtp.sharding import axes
from nvtp.sharding.reshard import COLLECTIVES
from nvtp.sharding.sharded import ShardedFusion

# Steps that are no reshard of a value but move data all the same: a ring's exchange (sendrecv),
# a pipeline's transfers (send, recv), a tied weight's broadcast and gradient reduction, the loss's broadcast.
POINT_TO_POINT = ("sendrecv", "send", "recv", "broadcast", "reduce")


@dataclass(frozen=True)
class Step:
    """One step of a training step that moves data or reshards a value, as the backend runs it:
    one collective call (a bucket of the schedule is one step, naming each tensor it carries),
    one point-to-point exchange (a ring's, a pipeline's), or one local reshard (a slice)."""

    phase: str  # "forward" or "backward"
    kind: str  # allreduce, allgather, reduce_scatter, sendrecv (cp), send / recv / broadcast / reduce (pp); slice, partition (local)
    axis: str  # the mesh axis's name: its process group runs it
    value: str  # the value it reshards (the sharded fusion's name); a bucket's first
    tensor: str  # its label where it has one (a parameter, an argument), else the value's name
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # what each rank sends with ring algorithms (0 for local steps)
    src: str
    dst: str
    tensors: tuple[str, ...] = ()  # every value the call carries (a bucket's members), in the order they are waited for
    at: int = -1  # it starts right after the op of this index in its phase's fusion (-1: before the first)
    waits: tuple[int, ...] = ()  # where each of ``tensors`` is waited for (op indices)
    payload: int = 0  # bytes of the buffer this rank hands to the call (a bucket's concatenation)
    ring: str = ""  # a collective matmul's kind ("allgather-linear", "linear-reducescatter"), or "" for anything else

    @property
    def is_communication(self) -> bool:
        return (self.kind in COLLECTIVES or self.kind in POINT_TO_POINT) and self.bytes > 0


def _label(sharded: ShardedFusion, value: str) -> str:
    src = sharded.source
    return (src.label(value) if value in src.info else "") or value


def _value(sharded: ShardedFusion, value: str):
    src = sharded.source
    return src.value(value) if value in src.values else sharded.fusion.value(value)


def _payload(kind: str, tensor_bytes: int, n: int) -> int:
    """Bytes of the buffer one rank hands to a collective moving a tensor of ``tensor_bytes`` (as
    the axis's group sees it) over ``n`` ranks: its part for a gather, the whole otherwise."""
    return tensor_bytes // n if kind == "allgather" else tensor_bytes


def tensor_steps(phase: str, sharded: ShardedFusion, communication_only: bool = False) -> list[Step]:
    """One step per reshard of ``sharded`` at its ``set`` (and per point-to-point exchange of an
    axis's ring), in op order: what each tensor needs, before any schedule groups them."""
    mesh = sharded.mesh
    order = {op.outputs[0].name: i for i, op in enumerate(sharded.fusion.ops) if op.outputs}
    ordered = []
    for result, step in sharded.set_steps.items():
        if communication_only and not step.is_communication:
            continue
        v = _value(sharded, step.value)
        at = order.get(result, 0)
        ordered.append(((at, 1), Step(phase, step.kind, mesh.names[step.axis], step.value, _label(sharded, step.value), tuple(v.shape),
                                      v.dtype.value, step.bytes if step.is_communication else 0, str(step.src), str(step.dst),
                                      (result,), at - 1, (at,), _payload(step.kind, step.tensor_bytes, mesh.shape[step.axis])
                                      if step.is_communication else 0)))
    ordered += _axis_steps(phase, sharded, communication_only)
    return [s for _, s in sorted(ordered, key=lambda x: x[0])]


def _axis_steps(phase: str, sharded: ShardedFusion, communication_only: bool) -> list[tuple[tuple, Step]]:
    """What the mesh's axis strategies run beside the ``set`` ops (cp's ring attention), keyed by position."""
    mesh, out = sharded.mesh, []
    for s, axis in axes.passes(mesh):
        for r in s.extra_steps(phase, sharded, axis):
            if communication_only and not r["bytes"]:
                continue
            out.append(((r["position"], 1), Step(phase, r["kind"], mesh.names[axis], r["value"], r["part"], tuple(r["shape"]),
                                                r["dtype"], r["bytes"], r["from"], r["to"], (r["value"],), r["position"] - 1,
                                                (r["position"],), r.get("payload", r["bytes"]))))
    return out


def issued_steps(phase: str, sharded: ShardedFusion, schedule: Any, communication_only: bool = False) -> list[Step]:
    """The steps of one phase as its backend runs them: with a ``schedule``
    (``nvtp.sharding.overlap.Schedule``) each issue once, right after the op it follows (a bucket
    of several tensors one step), each collective matmul's ring steps at its op; without one
    each reshard at its ``set``. A ring attention's exchanges inside their op, local reshards at
    their ``set``."""
    if schedule is None:
        return tensor_steps(phase, sharded, communication_only)
    mesh = sharded.mesh
    order = {op.outputs[0].name: i for i, op in enumerate(sharded.fusion.ops) if op.outputs}
    started = {name for i in schedule.issues for name in i.sets} | {r.name for r in schedule.rings}
    ordered = []
    for issue in schedule.issues:  # started right after op ``at``: before op at + 1 runs
        first = sharded.set_steps[issue.sets[0]]
        v = _value(sharded, first.value)
        n = mesh.shape[issue.axis]
        payload = sum(_payload(issue.kind, sharded.set_steps[name].tensor_bytes, n) for name in issue.sets)
        ordered.append(((issue.at + 1, 0), Step(phase, issue.kind, mesh.names[issue.axis], first.value, _label(sharded, first.value),
                                                tuple(v.shape), v.dtype.value, issue.bytes, str(first.src), str(first.dst),
                                                tuple(issue.sets), issue.at, tuple(issue.waits), payload)))
    for r in schedule.rings:  # a collective matmul: its point-to-point steps inside the op it takes the place of
        v = _value(sharded, r.name)
        for _ in range(r.steps):
            ordered.append(((r.at, 1), Step(phase, "sendrecv", mesh.names[r.axis], r.name, _label(sharded, r.name), tuple(v.shape),
                                            v.dtype.value, r.step_bytes, f"{mesh.names[r.axis]} ring", "next rank", (r.name,), r.at - 1,
                                            (r.at,), r.step_bytes, r.kind)))
    if not communication_only:
        for result, step in sharded.set_steps.items():
            if result not in started and not step.is_communication:
                v = _value(sharded, step.value)
                at = order.get(result, 0)
                ordered.append(((at, 1), Step(phase, step.kind, mesh.names[step.axis], step.value, _label(sharded, step.value),
                                              tuple(v.shape), v.dtype.value, 0, str(step.src), str(step.dst), (result,), at - 1, (at,))))
    ordered += _axis_steps(phase, sharded, communication_only)
    return [s for _, s in sorted(ordered, key=lambda x: x[0])]


def issued(phases, schedules: Mapping[str, Any]) -> list[dict[str, Any]]:
    """(phase, sharded fusion) pairs and their schedules -> the communications as started:
    {phase, kind, axis, bytes, tensors, at, waits, overlaps_ops}, ``at`` the op after which it
    starts (``issued_steps``, as records)."""
    out = []
    for phase, sharded in phases:
        for s in issued_steps(phase, sharded, schedules.get(phase), communication_only=True):
            record = {"phase": phase, "kind": s.kind, "axis": s.axis, "bytes": s.bytes, "tensors": list(s.tensors), "at": s.at,
                      "waits": list(s.waits), "overlaps_ops": 0 if s.kind == "sendrecv" else min(s.waits) - s.at - 1}
            if s.ring:
                ring = next(r for r in schedules[phase].rings if r.name == s.value)
                record |= {"overlaps_ops": len(ring.linears), "ring": s.ring, "ring_steps": ring.steps}
            out.append(record)
    return out


__all__ = ["POINT_TO_POINT", "Step", "issued", "issued_steps", "tensor_steps"]
