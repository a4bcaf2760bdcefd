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

import contextvars
import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = [
    "DeviceMesh", "FusedParts", "Zigzag", "ZIGZAG", "Partial", "Placement", "Replicate", "Shard", "Sharding", "_StridedShard", "axis_split",
    "describe", "is_partial", "is_replicate", "local_indices", "local_shape", "make_shard", "REPLICATE",
]

Sharding = tuple  # tuple[Placement, ...], one per mesh axis
REPLICATE = Replicate()


@dataclass(frozen=True)
class DeviceMesh:
    """A mesh of ranks: ``devices`` in row-major mesh order, ``shape`` one extent per mesh axis,
    ``names`` one name per axis (torch's ``mesh_dim_names``; ``("dp", "tp")`` for a 2-D mesh).

    A 1-D mesh is ``DeviceMesh.of_size(n)``; a 2-D one ``DeviceMesh.of_shape((2, 2), ("dp", "tp"))``.
    As in nvFuser (``DeviceMesh::parallelTypeToAxis``) the last axis is ``mesh_x`` (DIDx), the one
    before it ``mesh_y`` (DIDy); as in torch, a sharding holds one placement per axis, in order."""

    devices: tuple[int, ...]
    shape: tuple[int, ...] = ()
    names: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.devices:
            raise ValueError("a device mesh needs at least one device")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"device mesh {list(self.devices)} repeats a device")
        if not self.shape:
            object.__setattr__(self, "shape", (len(self.devices),))
        if math.prod(self.shape) != len(self.devices):
            raise ValueError(f"a mesh of shape {list(self.shape)} holds {math.prod(self.shape)} devices, not {len(self.devices)}")
        if not self.names:
            object.__setattr__(self, "names", ("tp",) if len(self.shape) == 1 else tuple(f"axis{i}" for i in range(len(self.shape))))
        if len(self.names) != len(self.shape) or len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh axis names {list(self.names)} must be distinct, one per axis of shape {list(self.shape)}")

    @staticmethod
    def of_size(n: int) -> "DeviceMesh":
        return DeviceMesh(tuple(range(n)))

    @staticmethod
    def of_shape(shape: Sequence[int], names: Sequence[str] = ()) -> "DeviceMesh":
        return DeviceMesh(tuple(range(math.prod(shape))), tuple(shape), tuple(names))

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def axis(self, name: str | int) -> int:
        """The index of mesh axis ``name`` (a name or an index)."""
        if isinstance(name, int):
            return name
        if name not in self.names:
            raise ValueError(f"the mesh has axes {list(self.names)}, not {name!r}")
        return self.names.index(name)

    def index(self, rank: int) -> int:
        """Position of ``rank`` along the mesh (row-major)."""
        return self.devices.index(rank)

    def coords(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate on each mesh axis."""
        flat, out = self.index(rank), []
        for n in reversed(self.shape):
            out.append(flat % n)
            flat //= n
        return tuple(reversed(out))

    def group(self, rank: int, axis: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``rank`` but the one on ``axis``, in order:
        the process group a collective on ``axis`` runs in."""
        c = list(self.coords(rank))
        out = []
        for i in range(self.shape[axis]):
            c[axis] = i
            flat = 0
            for x, n in zip(c, self.shape):
                flat = flat * n + x
            out.append(self.devices[flat])
        return tuple(out)

    def groups(self, axis: int) -> list[tuple[int, ...]]:
        """Every process group along ``axis``, each once."""
        seen: dict[tuple[int, ...], None] = {}
        for r in self.devices:
            seen.setdefault(self.group(r, axis), None)
        return list(seen)

    def sub(self, axis: int) -> "DeviceMesh":
        """The 1-D mesh of ``axis`` alone (its extent, its name): what a per-axis pass shards over."""
        return DeviceMesh(tuple(range(self.shape[axis])), (self.shape[axis],), (self.names[axis],))

    def __str__(self) -> str:
        if self.ndim == 1:
            return f"DeviceMesh({list(self.devices)})"
        rows = torch.tensor(self.devices).reshape(self.shape).tolist()
        return f"DeviceMesh({rows}, names={list(self.names)})"


@dataclass(frozen=True)
class FusedParts:
    """A parameter whose axis ``dim`` is made of parts ``(start, stop, placement)`` placed each by
    itself: a fused projection whose parts differ in size (``nvtp.frontend.fused``), e.g. Phi-3's
    ``qkv_proj`` rows ``[0:64] S(0), [64:96] S(0), [96:128] S(0)`` or Falcon multi-query's
    ``[0:64] S(0), [64:80] R, [80:96] R``. A rank holds its rows of each part, one part after the
    other. Only parameters take it (the fusions see each part as an input of its own)."""

    dim: int
    parts: tuple[tuple[int, int, Placement], ...]

    def local_rows(self, num_devices: int, position: int) -> list[torch.Tensor]:
        """Per part, the global indices of axis ``dim`` mesh position ``position`` holds."""
        out = []
        for start, stop, p in self.parts:
            mine = local_indices(stop - start, p, num_devices, position)
            out.append(start + (torch.arange(stop - start) if mine is None else mine))
        return out

    def local_sizes(self, num_devices: int) -> list[int]:
        return [len(r) for r in self.local_rows(num_devices, 0)]

    def __str__(self) -> str:
        return "parts(" + ", ".join(f"[{a}:{b}] {p}" for a, b, p in self.parts) + ")"


class Zigzag(_StridedShard):
    """The balanced layout of a causal sequence over a context-parallel axis (``nvtp.sharding.axes.cp``):
    axis ``dim`` seen as ``[k, n/k]`` (k even: each sequence's two halves, per batch row of a
    flattened ``[B*T]``), each chunk cut in one piece per rank; rank r holds piece r of the
    even chunks and piece d-1-r of the odd ones, so of one sequence of 2d pieces it holds pieces
    r and 2d-1-r, one from each end. ``_StridedShard`` is the same with piece r of every chunk."""

    def __str__(self) -> str:
        return f"Z({self.dim}, {self.split_factor})"

    def __repr__(self) -> str:
        return f"Zigzag(dim={self.dim}, sf={self.split_factor})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Zigzag) and (self.dim, self.split_factor) == (other.dim, other.split_factor)

    def __hash__(self) -> int:
        return hash(("zigzag", self.dim, self.split_factor))


# True while the passes shard a context-parallel axis in the balanced layout: every strided
# split they make of an even number of chunks is a ``Zigzag`` (nvtp.sharding.axes.cp).
ZIGZAG: contextvars.ContextVar[bool] = contextvars.ContextVar("nvtp_zigzag", default=False)


def make_shard(dim: int, split_factor: int = 1) -> Placement:
    """``Shard(dim)``, or ``_StridedShard(dim, k)`` for k > 1 (a ``Zigzag`` for even k while
    ``ZIGZAG`` is set); one object per pair (torch's placements are immutable; the propagation
    asks for them hundreds of thousands of times)."""
    if split_factor > 1 and split_factor % 2 == 0 and ZIGZAG.get():
        return _zigzag(dim, split_factor)
    return _make_shard(dim, split_factor)


@functools.lru_cache(maxsize=None)
def _make_shard(dim: int, split_factor: int) -> Placement:
    return Shard(dim) if split_factor == 1 else _StridedShard(dim, split_factor=split_factor)


@functools.lru_cache(maxsize=None)
def _zigzag(dim: int, split_factor: int) -> Placement:
    return Zigzag(dim, split_factor=split_factor)


def axis_split(p: Placement) -> tuple[int, int] | None:
    """(dim, split_factor) of a shard placement; None for Replicate and Partial. ``FusedParts``
    gives (dim, number of parts) (``local_indices`` and ``local_shape`` read its parts)."""
    if isinstance(p, FusedParts):
        return p.dim, len(p.parts)
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
    if isinstance(p, FusedParts):
        return torch.cat(p.local_rows(num_devices, position))
    split = axis_split(p)
    if split is None:
        return None
    _, k = split
    chunk = size // k
    piece = chunk // num_devices
    starts = torch.arange(k) * chunk + position * piece
    if isinstance(p, Zigzag):  # the odd chunks' pieces in reverse rank order
        starts[1::2] = torch.arange(1, k, 2) * chunk + (num_devices - 1 - position) * piece
    return (starts[:, None] + torch.arange(piece)[None, :]).reshape(-1)


def within(a: torch.Tensor, b: torch.Tensor, size: int) -> torch.Tensor:
    """The entries of ``a`` that ``b`` also holds, in ``a``'s order (both: indices into an axis of
    ``size``). A mask over the axis of which only ``a``'s and ``b``'s entries are written and read
    (no pass over the whole axis), not ``torch.isin``: for 16K of 131K indices, isin took 10 ms on
    one thread, this 0.4 ms (2026-11-26, this project's 2-core machine; the planner's GPT-3 sample
    on a (dp 8, tp 8) mesh asks 640 of them)."""
    mask = torch.empty(size, dtype=torch.bool)
    mask[a] = False
    mask[b] = True
    return a[mask[a]]


def held(shape: Sequence[int], sharding: Sequence[Placement], mesh: DeviceMesh, coords: Sequence[int],
         skip: int | None = None) -> list[torch.Tensor | None]:
    """Per tensor axis, the global indices (ascending) a rank at mesh ``coords`` holds under
    ``sharding`` (None: all of them), leaving out mesh axis ``skip``. Two mesh axes may split one
    tensor axis when they split different factors of it (the batch and the sequence of a
    flattened ``[B*T, C]``): the rank holds the indices both give it."""
    out: list[torch.Tensor | None] = [None] * len(shape)
    for axis, p in enumerate(sharding):
        split = axis_split(p)
        if split is None or axis == skip:
            continue
        dim = split[0]
        mine = local_indices(shape[dim], p, mesh.shape[axis], coords[axis])
        out[dim] = mine if out[dim] is None else within(out[dim], mine, shape[dim])
    return out


def induced(p: Placement, dim_size: int, others: torch.Tensor | None, n: int) -> tuple[Placement, int]:
    """A placement on one mesh axis as its process group sees the tensor axis, when other mesh axes
    already split that tensor axis (``others``: the global indices they leave this rank): the
    group's whole axis is ``others`` (its size is returned), and ``p``'s part of it is again a
    ``Shard`` or a ``_StridedShard`` with fewer chunks."""
    split = axis_split(p)
    if others is None:
        return p, dim_size
    size = others.numel()
    if split is None:
        return p, size
    dim, _ = split
    mine = local_indices(dim_size, p, n, 0)
    positions = torch.searchsorted(others, within(mine, others, dim_size))
    for k in range(1, size + 1):
        q = make_shard(dim, k)
        if size % k == 0 and (size // k) % n == 0 and torch.equal(local_indices(size, q, n, 0), positions):
            return q, size
    raise ValueError(f"placement {p} on an axis of {dim_size} that other mesh axes cut to {size} entries is no shard of them")


def local_shape(shape: Sequence[int], sharding: Sequence[Placement], mesh: DeviceMesh) -> tuple[int, ...]:
    """The shape a rank holds: each split axis divided by the extent of the mesh axis splitting it."""
    out = list(shape)
    for n, p in zip(mesh.shape, sharding):
        split = axis_split(p)
        if isinstance(p, FusedParts):
            out[p.dim] = sum(p.local_sizes(n))
        elif split is not None:
            out[split[0]] //= n
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
