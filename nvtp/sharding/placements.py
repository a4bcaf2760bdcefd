"""Device meshes and placements.

Placements are torch's own (``Shard``, ``Replicate``, ``Partial``, ``_StridedShard``), so a
sharding reads as DTensor's does and converts to a DTensor without translation. A value's
sharding is a tuple with one placement per mesh axis (the mesh is 1-D today; nothing here assumes
it stays so).

``_StridedShard(dim, split_factor=k)`` is the non-outermost split nvtp needs for fused
projections: axis ``dim`` is seen as ``[k, n/k]`` and the inner part is split over the devices,
so rank r holds the r-th slice of each of the k chunks (the fused QKV output's ``3e`` axis as
``[3, e]`` with ``e`` split). ``Shard(dim)`` is the case k = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = [
    "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "Sharding", "_StridedShard", "axis_split",
    "describe", "is_partial", "is_replicate", "local_indices", "local_shape", "make_shard", "REPLICATE",
]

Sharding = tuple  # tuple[Placement, ...], one per mesh axis
REPLICATE = Replicate()


@dataclass(frozen=True)
class DeviceMesh:
    """A mesh of ranks. ``devices`` are the ranks in mesh order; 1-D for now."""

    devices: tuple[int, ...]

    def __post_init__(self):
        if not self.devices:
            raise ValueError("a device mesh needs at least one device")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"device mesh {list(self.devices)} repeats a device")

    @staticmethod
    def of_size(n: int) -> "DeviceMesh":
        return DeviceMesh(tuple(range(n)))

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def ndim(self) -> int:
        return 1

    def index(self, rank: int) -> int:
        """Position of ``rank`` along the mesh."""
        return self.devices.index(rank)

    def __str__(self) -> str:
        return f"DeviceMesh({list(self.devices)})"


def make_shard(dim: int, split_factor: int = 1) -> Placement:
    return Shard(dim) if split_factor == 1 else _StridedShard(dim, split_factor=split_factor)


def axis_split(p: Placement) -> tuple[int, int] | None:
    """(dim, split_factor) of a shard placement; None for Replicate and Partial."""
    if isinstance(p, _StridedShard):
        return p.dim, p.split_factor
    if isinstance(p, Shard):
        return p.dim, 1
    return None


def is_partial(p: Placement) -> bool:
    return isinstance(p, Partial)


def is_replicate(p: Placement) -> bool:
    return isinstance(p, Replicate)


def describe(sharding: Sequence[Placement]) -> str:
    """Short text for a sharding: ``S(2)``, ``_S(2, 3)``, ``R``, ``P(sum)``; comma-joined over mesh axes."""
    return ", ".join(str(p) for p in sharding)


def local_indices(size: int, p: Placement, num_devices: int, position: int) -> torch.Tensor | None:
    """Global indices (ascending local order) that mesh position ``position`` holds of an axis of
    ``size`` under placement ``p``; None when it holds the whole axis."""
    split = axis_split(p)
    if split is None:
        return None
    _, k = split
    chunk = size // k
    piece = chunk // num_devices
    starts = torch.arange(k) * chunk + position * piece
    return (starts[:, None] + torch.arange(piece)[None, :]).reshape(-1)


def local_shape(shape: Sequence[int], sharding: Sequence[Placement], mesh: DeviceMesh) -> tuple[int, ...]:
    out = list(shape)
    for p in sharding:
        split = axis_split(p)
        if split is not None:
            out[split[0]] //= mesh.size
    return tuple(out)


def divisibility_error(size: int, p: Placement, num_devices: int) -> str | None:
    """Why axis ``size`` cannot take placement ``p`` on ``num_devices`` devices, or None."""
    split = axis_split(p)
    if split is None:
        return None
    _, k = split
    if size % k:
        return f"size {size} is not a multiple of the split factor {k}"
    if (size // k) % num_devices:
        what = f"size {size}" if k == 1 else f"size {size} seen as [{k}, {size // k}]: {size // k}"
        return f"{what} cannot be split over {num_devices} devices"
    return None
