"""Sharded dumps: nvFuser's format with the device schedule and the resharding ``set`` ops.

The file is self-contained: the mesh size is written in, the definition function takes only
``fd`` and ends with the schedule (``set_device_mesh``, ``outer_split``,
``axis(i).parallelize(ParallelType.mesh_x)``), and the ``inputs`` list holds one rank's shards,
so it runs as is under ``mpirun -np N`` / ``torchrun`` with one process per GPU.

A 2-D mesh (dp, tp) is one ``DeviceMesh(torch.tensor([[0, 1], [2, 3]]))``: tp's splits are
parallelized with ``mesh_x``, dp's with ``mesh_y``. nvFuser's mesh has no axis names, so
``nvtp_info`` records them (``"devices": "2x2", "mesh": "dp,tp"``) and a replay rebuilds the same mesh.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from nvtp.dump.resharding import implicit_reshards
from nvtp.ir.parser import Dump, DumpError
from nvtp.ir.printer import format_file, format_schedule
from nvtp.sharding import plans as plans_mod
from nvtp.sharding.placements import REPLICATE, DeviceMesh, axis_split, local_shape
from nvtp.sharding.sharded import ShardedFusion
from nvtp.sharding.propagate import Propagation
from nvtp.sharding.reshard import ReshardStep, reshard_bytes
from nvtp.sharding.schedule import ScheduleError, schedule_steps, shardings_from_schedule

PREAMBLE = [
    "# One process per GPU (mpirun -np N, or torchrun): each rank runs on its GPU with its own shards.",
    "rank = nvfuser_direct.multidevice.Communicator.instance().rank()",
    "torch.cuda.set_device(rank)",
]


def mesh_text(mesh: DeviceMesh) -> str:
    """The mesh as the header and ``nvtp_info`` write it: ``4`` (1-D), ``2x2`` (dp x tp)."""
    return str(mesh.size) if mesh.ndim == 1 else "x".join(map(str, mesh.shape))


def format_sharded(sharded: ShardedFusion, header: list[str]) -> str:
    fusion = sharded.fusion
    mesh = sharded.mesh
    attrs = {**sharded.source.attrs, "plan": sharded.plan, "devices": mesh_text(mesh), "inputs": "per rank"}
    if mesh.ndim > 1:
        attrs["mesh"] = ",".join(mesh.names)
    fusion = replace(fusion, attrs=attrs, info={k: v for k, v in sharded.source.info.items() if k in fusion.values})
    notes = {}
    for name, step in sharded.set_steps.items():
        on = f" on {mesh.names[step.axis]}" if mesh.ndim > 1 else ""
        if step.kind in ("slice", "partition"):
            notes[name] = f"{step.kind} {step.src} -> {step.dst}{on} (local)"
        else:
            notes[name] = f"{step.kind} {step.src} -> {step.dst}{on}, {step.bytes} bytes per rank"
    shapes = {v.name: local_shape(v.shape, sharded.shardings[v.name], sharded.mesh) for v in fusion.inputs if v.name in sharded.shardings}
    return format_file(
        fusion,
        header=header,
        extra_imports=["import nvfuser_direct", "from nvfuser_direct import ParallelType"],
        extra_body=format_schedule(schedule_steps(sharded)),
        input_shapes=shapes,
        device="cuda",
        preamble=PREAMBLE,
        notes=notes,
    )


def write_sharded(sharded: ShardedFusion, path: str | os.PathLike, command: str, data: str | None = None) -> Path:
    """Write ``sharded`` as a dump; ``data`` names the data plan of a 2-D mesh (ddp or fsdp) for the header."""
    mesh = sharded.mesh
    if mesh.ndim == 1:
        where = f"over {mesh.size} devices"
    else:
        axes = ", ".join(f"{n}={k}" for n, k in zip(mesh.names, mesh.shape))
        where = f"over a {mesh_text(mesh)} mesh ({axes}{', ' + data if data else ''})"
    header = [
        f"{sharded.source.attrs.get('role', 'fusion')} fusion sharded by nvtp with plan {sharded.plan} {where}.",
        f"Regenerate: {command}",
        "Each rank passes its own shards (the inputs below are one rank's); `nvtp replay FILE --check` runs it on a CPU mesh.",
    ]
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(format_sharded(sharded, header))
    return p


def from_dump(dump: Dump) -> ShardedFusion | None:
    """The sharded fusion a parsed dump describes with its device schedule; None if it has none.
    A 2-D mesh takes its axis names from ``nvtp_info``'s ``"mesh"`` (nvFuser's mesh has none)."""
    if not dump.schedule:
        return None
    fusion = dump.fusion
    try:
        placements, parsed = shardings_from_schedule(fusion, dump.schedule)
    except ScheduleError as e:
        raise DumpError(f"its device schedule: {e}", dump.path) from None
    mesh = parsed or DeviceMesh((0,))
    if mesh.ndim > 1:
        names = tuple(n for n in str(fusion.attrs.get("mesh", "")).split(",") if n)
        if len(names) != mesh.ndim:
            raise DumpError(f"the device schedule's mesh has shape {list(mesh.shape)}, but nvtp_info names its axes "
                            f"{list(names) or 'nowhere'}; add \"mesh\": \"dp,tp\" (one name per axis) to nvtp_info's \"fusion\"", dump.path)
        try:
            mesh = DeviceMesh(mesh.devices, mesh.shape, names)
        except ValueError as e:
            raise DumpError(f"nvtp_info's \"mesh\": {e}", dump.path) from None
    whole = (REPLICATE,) * mesh.ndim
    shardings = {v.name: placements.get(v.name, whole) for op in fusion.ops for v in op.outputs}
    set_steps = {}
    for op in fusion.compute_ops():
        if op.kind != "set":
            continue
        v = op.outputs[0]
        src, dst = shardings[op.arg("arg").name], shardings[v.name]
        for axis, (s, d) in enumerate(zip(src, dst)):
            if s != d:  # a set changes one mesh axis; count it on the rank's part along the others
                local = v.nbytes
                for other, p in enumerate(dst):
                    if other != axis and axis_split(p) is not None:
                        local //= mesh.shape[other]
                set_steps[v.name] = ReshardStep(op.arg("arg").name, s, d, (), local, round(reshard_bytes(s, d, local, mesh.shape[axis])), axis)
                break
    ran = fusion
    if mesh.ndim == 1:  # the gathers nvFuser inserts itself before an op that reads a split operand whole (a collective matmul)
        try:
            ran, placements_1d, implicit = implicit_reshards(fusion, {k: p[0] for k, p in shardings.items()}, mesh)
        except ValueError as e:
            raise DumpError(f"its device schedule: {e}", dump.path) from None
        shardings = {k: (p,) for k, p in placements_1d.items()}
        set_steps.update(implicit)
    prop = Propagation({k: s[0] for k, s in shardings.items()}, {}, [])
    return ShardedFusion(ran, fusion, mesh, shardings, set_steps,
                         plans_mod.Annotations({}), fusion.attrs.get("plan", "from file"), prop)
