"""What ``nvtp explain`` prints: each tensor's sharding and every communication with its bytes."""

from __future__ import annotations

from typing import Any

from nvtp.ir.graph import TensorValue
from nvtp.sharding.placements import describe, local_shape
from nvtp.sharding.sharded import ShardedFusion


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def communication_records(sharded: ShardedFusion) -> list[dict[str, Any]]:
    out = []
    for step in sharded.communications:
        v = sharded.source.value(step.value) if step.value in sharded.source.values else sharded.fusion.value(step.value)
        out.append({
            "kind": step.kind,
            "tensor": step.value,
            "label": sharded.source.label(step.value) if step.value in sharded.source.info else "",
            "shape": list(v.shape),
            "dtype": v.dtype.value,
            "bytes": step.bytes,
            "tensor_bytes": step.tensor_bytes,
            "from": str(step.src),
            "to": str(step.dst),
        })
    return out


def size_text(n: float) -> str:
    """``n`` bytes as text: 1.50 MiB, 12.0 KiB, 512 B."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def weight_of(sharded: ShardedFusion, result: str, step, users: dict | None = None) -> str:
    """The label of the parameter a collective moves: the parameter itself (FSDP's gathers), or the
    parameter whose gradient output the reduced value becomes through single-use ops (a cast, a
    slice to the at-rest shard); "" for anything else. ``users``: ``sharded.fusion.consumers()``,
    when the caller asks for many collectives (computing it is linear in the ops)."""
    src = sharded.source
    if step.value in src.info and src.role(step.value) == "parameter":
        return src.label(step.value)
    outputs = {out.name: s.name for s, out in zip(src.outputs, sharded.fusion.outputs)}
    users = sharded.fusion.consumers() if users is None else users
    name = result
    for _ in range(8):
        if name in outputs:
            return src.grad_of(outputs[name])
        ops = users.get(name, [])
        if len(ops) != 1 or len(ops[0].outputs) != 1:
            return ""
        name = ops[0].outputs[0].name
    return ""


def _sharded_from(sharded: ShardedFusion) -> str | None:
    """The forward file a backward fusion was sharded from (None for a forward)."""
    attrs = sharded.source.attrs
    return attrs.get("forward", "its forward") if attrs.get("role") == "backward" else None


def as_json(sharded: ShardedFusion, path: str | None = None) -> dict[str, Any]:
    tensors = {}
    for op in sharded.fusion.ops:
        for v in op.outputs:
            if isinstance(v, TensorValue) and v.name in sharded.shardings:
                tensors[v.name] = {
                    "placement": describe(sharded.shardings[v.name]),
                    "shape": list(v.shape),
                    "local_shape": list(local_shape(v.shape, sharded.shardings[v.name], sharded.mesh)),
                    "dtype": v.dtype.value,
                    "label": sharded.source.label(v.name) if v.name in sharded.source.info else "",
                    "role": sharded.source.role(v.name) if v.name in sharded.source.info else ("reshard" if v.name in sharded.set_steps else ""),
                }
    comms = communication_records(sharded)
    return {
        "file": path,
        "plan": sharded.plan,
        "sharded_from": _sharded_from(sharded),
        "devices": sharded.mesh.size,
        "notes": list(sharded.annotations.notes),
        "tensors": tensors,
        "communications": comms,
        "total_bytes": sum(c["bytes"] for c in comms),
        "pass_seconds": dict(sharded.seconds),
    }


def as_text(sharded: ShardedFusion, path: str | None = None, backend: str = "") -> str:
    src = sharded.source
    d = sharded.mesh.size
    lines = [f"{path or src.name}: plan {sharded.plan} on a mesh of {d} device(s){f', for the {backend} backend' if backend else ''}"]
    if _sharded_from(sharded):
        lines.append(f"  a backward fusion: sharded to match its forward ({_sharded_from(sharded)}) under plan {sharded.plan}; "
                     "its inputs take the placements the forward gave their values")
    for note in sharded.annotations.notes:
        lines.append(f"  {note}")
    lines.append("inputs:")
    for v in src.inputs:
        if not isinstance(v, TensorValue):
            continue
        placement = sharded.shardings[v.name]
        per_rank = local_shape(v.shape, placement, sharded.mesh)
        share = "" if per_rank == tuple(v.shape) else f"  per rank {list(per_rank)} (1/{d})"
        lines.append(f"  {v.name:>6} {src.label(v.name)[:28]:28} {v.dtype.value:>8}{str(list(v.shape)):22} {describe(placement):10}{share}")
    lines.append("values:")
    for op in sharded.fusion.compute_ops():
        for v in op.outputs:
            if isinstance(v, TensorValue):
                what = f"reshard: {sharded.set_steps[v.name].kind}" if v.name in sharded.set_steps else op.kind
                lines.append(f"  {v.name:>6} {what:28} {v.dtype.value:>8}{str(list(v.shape)):22} {describe(sharded.shardings[v.name])}")
    comms = communication_records(sharded)
    lines.append(f"communications ({len(comms)}; bytes each rank sends with ring algorithms):")
    for c in comms:
        lines.append(f"  {c['kind']:15} {c['tensor']:>6} {c['dtype']:>8}{str(c['shape']):22} {c['from']} -> {c['to']:10} {_mib(c['bytes']):>12}")
    lines.append(f"  total {_mib(sum(c['bytes'] for c in comms))} per rank")
    return "\n".join(lines)
