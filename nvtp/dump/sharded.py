"""Sharded dumps: nvFuser's format with the device schedule and the resharding ``set`` ops.

The file is self-contained: the mesh size is written in, the definition function takes only
``fd`` and ends with the schedule (``set_device_mesh``, ``outer_split``,
``axis(i).parallelize(ParallelType.mesh_x)``), and the ``inputs`` list holds one rank's shards,
so it runs as is under ``mpirun -np N`` / ``torchrun`` with one process per GPU.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from nvtp.ir.parser import Dump
from nvtp.ir.printer import format_file, format_schedule
from nvtp.sharding import plans as plans_mod
from nvtp.sharding.placements import REPLICATE, DeviceMesh, local_shape
from nvtp.sharding.sharded import ShardedFusion
from nvtp.sharding.propagate import Propagation
from nvtp.sharding.reshard import ReshardStep, reshard_bytes
from nvtp.sharding.schedule import placements_from_schedule, schedule_steps

PREAMBLE = [
    "# One process per GPU (mpirun -np N, or torchrun): each rank runs on its GPU with its own shards.",
    "rank = nvfuser_direct.multidevice.Communicator.instance().rank()",
    "torch.cuda.set_device(rank)",
]


def format_sharded(sharded: ShardedFusion, header: list[str]) -> str:
    fusion = sharded.fusion
    attrs = {**sharded.source.attrs, "plan": sharded.plan, "devices": str(sharded.mesh.size), "inputs": "per rank"}
    fusion = replace(fusion, attrs=attrs, info={k: v for k, v in sharded.source.info.items() if k in fusion.values})
    notes = {}
    for name, step in sharded.set_steps.items():
        if step.kind in ("slice", "partition"):
            notes[name] = f"{step.kind} {step.src} -> {step.dst} (local)"
        else:
            notes[name] = f"{step.kind} {step.src} -> {step.dst}, {step.bytes} bytes per rank"
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


def write_sharded(sharded: ShardedFusion, path: str | os.PathLike, command: str) -> Path:
    header = [
        f"{sharded.source.attrs.get('role', 'fusion')} fusion sharded by nvtp with plan {sharded.plan} over {sharded.mesh.size} devices.",
        f"Regenerate: {command}",
        "Each rank passes its own shards (the inputs below are one rank's); `nvtp replay FILE --check` runs it on a CPU mesh.",
    ]
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(format_sharded(sharded, header))
    return p


def from_dump(dump: Dump) -> ShardedFusion | None:
    """The sharded fusion a parsed dump describes with its device schedule; None if it has none."""
    if not dump.schedule:
        return None
    fusion = dump.fusion
    placements, devices = placements_from_schedule(fusion, dump.schedule)
    mesh = DeviceMesh(devices or (0,))
    shardings = {v.name: (placements.get(v.name, REPLICATE),) for op in fusion.ops for v in op.outputs}
    set_steps = {}
    for op in fusion.compute_ops():
        if op.kind == "set":
            src, dst = shardings[op.arg("arg").name][0], shardings[op.outputs[0].name][0]
            if src != dst:
                v = op.outputs[0]
                set_steps[v.name] = ReshardStep(op.arg("arg").name, src, dst, (), v.nbytes, round(reshard_bytes(src, dst, v.nbytes, mesh.size)))
    prop = Propagation({k: s[0] for k, s in shardings.items()}, {}, [])
    return ShardedFusion(fusion, fusion, mesh, shardings, set_steps,
                         plans_mod.Annotations({}), fusion.attrs.get("plan", "from file"), prop)
