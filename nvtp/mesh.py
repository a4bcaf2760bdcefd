"""Meshes: the one place nvtp builds a ``DeviceMesh`` and decides what each of its axes means.

    mesh = make_mesh(4)                                   # 1-D, tensor parallel: ("tp",)
    mesh = make_mesh("2x2", fsdp=True)                    # (dp, tp), from the CLI's --mesh
    mesh = make_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    roles(mesh)                                           # {"dp": 0, "tp": 1}

An axis's *name* selects its strategy (``nvtp.sharding.axes``): "tp" shards by the plan
(Megatron's tensor and sequence parallelism), "dp" splits the batch (DDP; with ``fsdp`` the
weights too). A 1-D mesh without names is tensor parallel. A name nvtp does not know, or one
whose strategy is not built yet, is refused here, before anything is traced, with the names nvtp
knows. Every entry point (``nvtp.jit``, ``nvtp.plan``, the CLI) builds its mesh with
``make_mesh``; the compile driver (``nvtp.driver``) asks ``roles`` which pass runs on which axis.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh as TorchMesh
import torch.distributed as dist

from nvtp.sharding import axes
from nvtp.sharding.axes import AXES, MeshError, roles  # noqa: F401 - what each axis name means lives with the strategies
from nvtp.sharding.placements import DeviceMesh


def parse(text: str) -> tuple[int, ...]:
    """The CLI's spelling of a mesh: ``4`` (1-D) or ``DPxTP`` (``2x2``)."""
    parts = str(text).lower().split("x")
    if not 1 <= len(parts) <= 2 or not all(p.strip().isdigit() for p in parts):
        raise MeshError(f"--mesh {text!r}: expected DPxTP, two positive integers joined by x (e.g. --mesh 2x2: dp=2, tp=2); "
                        "a 1-D mesh is --devices N; axes by name: --mesh cp=4 or cp=2,tp=2 (context parallel)")
    shape = tuple(int(p) for p in parts)
    if any(n < 1 for n in shape):
        raise MeshError(f"--mesh {text!r}: each mesh axis needs at least 1 device (dp={shape[0]}, tp={shape[-1]})")
    return shape


def named(text: str) -> DeviceMesh | None:
    """A mesh spelt by its axes' names and sizes, ``cp=4`` or ``cp=2,tp=2`` (None for another
    spelling); the names are checked by ``roles``."""
    if "=" not in str(text):
        return None
    names, shape = [], []
    for part in str(text).replace(" ", "").split(","):
        name, _, size = part.partition("=")
        if not name or not size.isdigit() or int(size) < 1:
            raise MeshError(f"--mesh {text!r}: expected NAME=SIZE pairs joined by commas, e.g. cp=4 or cp=2,tp=2 "
                            "(or DPxTP, e.g. 2x2)")
        names.append(name)
        shape.append(int(size))
    mesh = DeviceMesh.of_shape(tuple(shape), tuple(names))
    roles(mesh)
    return mesh


def make_mesh(spec: Any = None, *, devices: int | None = None, fsdp: bool = False, world: int | None = None) -> DeviceMesh:
    """nvtp's mesh for ``spec``, checked (``roles``):

    * None: ``devices`` (1-D), else ``world`` ranks (1-D), else one device;
    * an int: a 1-D tensor-parallel mesh of that many devices;
    * ``"2x2"`` or a pair ``(dp, tp)``: a 2-D (dp, tp) mesh;
    * nvtp's ``DeviceMesh``, as it is;
    * torch's ``DeviceMesh`` over the default process group's ranks, in order: its shape and
      ``mesh_dim_names`` (a 1-D mesh without names is "tp").

    ``fsdp`` needs a "dp" axis. Raises ``MeshError``, saying what to pass instead."""
    if devices is not None and spec is not None:
        raise MeshError(f"give either devices={devices} (a 1-D mesh) or mesh={spec!r} (a 2-D (dp, tp) mesh), not both")
    if spec is None:
        mesh = DeviceMesh.of_size(devices or world or 1)
    elif isinstance(spec, DeviceMesh):
        mesh = spec
    elif isinstance(spec, bool):
        raise MeshError(f"mesh={spec!r}: expected a number of devices, (dp, tp), 'DPxTP' or a DeviceMesh")
    elif isinstance(spec, int):
        if spec < 1:
            raise MeshError(f"a mesh needs at least 1 device, got {spec}")
        mesh = DeviceMesh.of_size(spec)
    elif isinstance(spec, str) and "=" in spec:
        mesh = named(spec)
    elif isinstance(spec, str):
        shape = parse(spec)
        mesh = DeviceMesh.of_size(shape[0]) if len(shape) == 1 else DeviceMesh.of_shape(shape, axes.spelled(len(shape)))
    elif isinstance(spec, (tuple, list)):
        if len(spec) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in spec):
            raise MeshError(f"mesh={spec!r}: expected (dp, tp), two positive integers, or a 2-D DeviceMesh with axes ('dp', 'tp')")
        mesh = DeviceMesh.of_shape(tuple(spec), axes.spelled(2))
    else:
        mesh = _from_torch(spec)
    roles(mesh)
    axes.check(mesh, fsdp=fsdp)
    return mesh


def _from_torch(mesh: Any) -> DeviceMesh:
    """nvtp's mesh for torch's ``DeviceMesh`` over every rank of the default group, in order."""
    if not isinstance(mesh, TorchMesh):
        raise TypeError(f"mesh must be torch.distributed.device_mesh.DeviceMesh, nvtp's DeviceMesh, a number of devices "
                        f"or (dp, tp), not {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim > 1 and not names:
        raise MeshError(f"a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} without names: nvtp reads each axis's strategy from its "
                        f"name; pass mesh_dim_names, e.g. init_device_mesh(device, {tuple(mesh.shape)}, "
                        f"mesh_dim_names={axes.spelled(mesh.ndim)}); the names nvtp knows: {axes.known()}")
    unknown = [n for n in names if n not in axes.AXES]
    if unknown:
        raise MeshError(f"torch mesh axis name(s) {unknown} mean nothing to nvtp (a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} "
                        f"named {names}): nvtp reads each axis's strategy from its name; pass mesh_dim_names, e.g. "
                        f"init_device_mesh(device, {tuple(mesh.shape)}, mesh_dim_names={axes.spelled(mesh.ndim)}); "
                        f"the names nvtp knows: {axes.known()}")

    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    if dist.is_initialized() and ranks != tuple(range(dist.get_world_size())):
        raise MeshError(f"the mesh holds ranks {list(ranks)}, the process group {dist.get_world_size()} ranks in order; "
                        "nvtp.jit shards over every rank of the default group: pass init_device_mesh(device, (world_size,)) "
                        "or a (dp, tp) mesh with dp * tp = world_size")
    return DeviceMesh(ranks, tuple(mesh.shape), names if mesh.ndim > 1 or names else ())


def world_of(comm: Any = None) -> tuple[int, str]:
    """(ranks, how that was found): ``comm``'s, the default process group's, or 1."""
    if comm is not None:
        return comm.size, f"the given comm has {comm.size} rank(s)"
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        return world, f"the process group has {world} rank(s)"
    return 1, "torch.distributed is not initialized (one process)"


def check_world(mesh: DeviceMesh, comm: Any = None) -> None:
    """The mesh must be the process group (or ``comm``): refuse a mismatch before anything starts."""
    world, how = world_of(comm)
    if mesh.size != world:
        raise MeshError(f"the mesh has {mesh.size} device(s) but {how}; start {mesh.size} processes (torchrun "
                        f"--nproc-per-node {mesh.size}, or nvtp demo --devices {mesh.size}) and init_process_group in each, "
                        f"or pass mesh=DeviceMesh.of_size({world})")


def text(mesh: DeviceMesh) -> str:
    """The mesh as headers and ``nvtp_info`` write it: ``4`` (1-D), ``2x2`` (dp x tp)."""
    return str(mesh.size) if mesh.ndim == 1 else "x".join(map(str, mesh.shape))
