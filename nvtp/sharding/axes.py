"""Mesh axes mean what their names say, decided here: each name selects a sharding strategy.

"tp" shards by the plan (Megatron's tensor and sequence parallelism), "dp" splits the batch (DDP;
with ``fsdp`` the weights too); "pp" cuts pipeline stages (``nvtp.pipeline``, split off before these
passes run on each stage's (dp, tp) sub-mesh); "cp" splits the sequence of every activation and runs
attention by ring (``nvtp.sharding.context``), weights whole.
``roles(mesh)`` refuses, with the names nvtp knows, a name it does not know, one whose strategy is
not built yet, or a combination of axes the passes do not compose. ``nvtp.mesh`` builds meshes
with it; ``nvtp.sharding.multi`` and the compile driver ask it which pass runs on which axis.
"""

from __future__ import annotations

from dataclasses import dataclass

from nvtp.sharding.placements import DeviceMesh
from nvtp.sharding.propagate import ShardingError


class MeshError(ShardingError):
    """A mesh nvtp cannot shard over; says what was given and what to pass instead.
    (A ``ShardingError``, so a ``ValueError`` too: bad input, refused before any work.)"""


@dataclass(frozen=True)
class Axis:
    name: str
    strategy: str
    built: bool  # False: the name is reserved for a strategy nvtp does not run yet


# One entry per mesh axis name nvtp knows: what sharding along it means.
AXES: dict[str, Axis] = {a.name: a for a in (
    Axis("tp", "tensor parallel: the plan (megatron, megatron-sp, explicit) splits weights and activations", True),
    Axis("dp", "data parallel: each rank passes its own batch; fsdp=True also splits the weights (ZeRO-3)", True),
    Axis("pp", "pipeline parallel: stages of blocks, cut by nvtp.pipeline; each stage sharded over its (dp, tp) sub-mesh", True),
    Axis("cp", "context parallel: the sequence of every activation split, attention by ring; weights whole", True),
)}

# The meshes the passes compose today (nvtp.sharding.multi): axis names, in any order.
SUPPORTED = ({"tp"}, {"dp", "tp"}, {"cp"}, {"cp", "tp"}, {"dp", "cp"}, {"dp", "cp", "tp"})


def _known() -> str:
    return ", ".join(f"{a.name!r} ({a.strategy}{'' if a.built else '; not available yet'})" for a in AXES.values())


def roles(mesh: DeviceMesh) -> dict[str, int]:
    """Each axis name -> its index; raises ``MeshError`` for a name nvtp does not know or does
    not shard over yet, and for a combination of axes the passes do not compose."""
    unknown = [n for n in mesh.names if n not in AXES]
    if unknown:
        raise MeshError(f"mesh axis name(s) {unknown} mean nothing to nvtp (mesh {list(mesh.names)} of shape {list(mesh.shape)}); "
                        f"name each axis for its strategy: {_known()}")
    later = [n for n in mesh.names if not AXES[n].built]
    if later:
        raise MeshError(f"mesh axis {later[0]!r} ({AXES[later[0]].strategy}) is not available yet in nvtp; "
                        f"shard over 'tp' and 'dp' axes: init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))")
    if "pp" in mesh.names:  # the pipeline splits it off first (nvtp.driver.compile_pipeline); the passes see the stages' sub-meshes
        raise MeshError(f"a mesh with a 'pp' axis ({list(mesh.names)}) is a pipeline: pass it to nvtp.jit(model, mesh=mesh, "
                        "microbatches=M), nvtp.plan(model, *args, mesh=mesh) or nvtp explain --mesh PPxDPxTP, which cut the model "
                        "into stages and shard each over its (dp, tp) sub-mesh")
    if set(mesh.names) not in SUPPORTED:
        raise MeshError(f"a mesh with axes {list(mesh.names)}: nvtp shards over a 1-D 'tp' or 'cp' mesh or a 2-D mesh with axes "
                        "('dp', 'tp') (data parallel, tensor parallel) or ('cp', 'tp') (context parallel, tensor parallel): "
                        "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))")
    return {n: i for i, n in enumerate(mesh.names)}
