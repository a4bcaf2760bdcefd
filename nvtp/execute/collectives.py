"""Collectives and resharding on local tensors.

``Comm`` is the small interface the reference backend needs: all-reduce, all-gather and
reduce-scatter on this rank's tensor. ``DistComm`` wraps torch.distributed (gloo on CPU, NCCL on
GPU); ``ThreadComm`` runs the ranks of one process as threads for the fast simulated tier.
``reshard`` turns a local tensor from one placement into another with those collectives.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, Sequence

import torch

from nvtp.sharding.placements import Placement, axis_split, is_partial, local_indices


class Comm(Protocol):
    rank: int  # position on the mesh
    size: int

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...

    def reduce_scatter(self, chunks: Sequence[torch.Tensor], op: str) -> torch.Tensor: ...


class SoloComm:
    """One rank, no communication."""

    rank, size = 0, 1

    def all_reduce(self, t, op):
        return t

    def all_gather(self, t):
        return [t]

    def reduce_scatter(self, chunks, op):
        return chunks[0]


def _reduce(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    out = tensors[0].clone()
    for t in tensors[1:]:
        if op == "sum":
            out += t
        elif op == "max":
            out = torch.maximum(out, t)
        elif op == "min":
            out = torch.minimum(out, t)
        else:
            raise ValueError(f"unsupported reduction {op!r}")
    return out


class MeshComm:
    """One rank of a mesh of several axes: ``rank`` is its position on the mesh (row-major),
    ``axes[a]`` the collectives of its process group along mesh axis ``a``."""

    def __init__(self, rank: int, size: int, axes: Sequence[Comm]):
        self.rank, self.size, self.axes = rank, size, list(axes)

    def _whole(self, name: str):
        raise TypeError(f"{name} on a mesh of several axes needs an axis: use on_axis(comm, axis)")

    def all_reduce(self, t, op):
        self._whole("all_reduce")

    def all_gather(self, t):
        self._whole("all_gather")

    def reduce_scatter(self, chunks, op):
        self._whole("reduce_scatter")


def on_axis(comm: Comm, axis: int) -> Comm:
    """The collectives along mesh axis ``axis`` (on a 1-D mesh, ``comm`` itself)."""
    axes = getattr(comm, "axes", None)
    if axes is None:
        if axis != 0:
            raise ValueError(f"a 1-D comm has no mesh axis {axis}")
        return comm
    return axes[axis]


class ThreadGroup:
    """Shared state of ranks simulated as threads of one process."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list = [None] * size

    def exchange(self, rank: int, item):
        self.slots[rank] = item
        self.barrier.wait()
        items = list(self.slots)
        self.barrier.wait()
        return items

    def abort(self) -> None:
        self.barrier.abort()


class ThreadComm:
    """Collectives between threads of one process (deterministic: reductions run in rank order)."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce(self, t, op):
        return _reduce(self.group.exchange(self.rank, t), op)

    def all_gather(self, t):
        return [x.clone() for x in self.group.exchange(self.rank, t)]

    def reduce_scatter(self, chunks, op):
        everything = self.group.exchange(self.rank, list(chunks))
        return _reduce([c[self.rank] for c in everything], op)


class Progress:
    """How many collectives this process has started, and since when it waits in the current
    one (None between collectives): the watchdog (``nvtp.execute.launch``) names the ranks that
    never reach a collective another rank waits in."""

    def __init__(self) -> None:
        self.count = 0
        self.since: float | None = None

    def __enter__(self) -> "Progress":
        self.count += 1
        self.since = time.monotonic()
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:  # a collective that raised never completed: keep when it started
            self.since = None


PROGRESS = Progress()


class DistComm:
    """torch.distributed collectives on a process group (gloo or NCCL)."""

    _OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)

    def _op(self, op):
        return getattr(self.dist.ReduceOp, self._OPS[op])

    def all_reduce(self, t, op):
        t = t.contiguous().clone()
        with PROGRESS:
            self.dist.all_reduce(t, op=self._op(op), group=self.group)
        return t

    def all_gather(self, t):
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        with PROGRESS:
            self.dist.all_gather(parts, t, group=self.group)
        return parts

    def reduce_scatter(self, chunks, op):
        chunks = [c.contiguous() for c in chunks]
        out = torch.empty_like(chunks[self.rank])
        with PROGRESS:
            self.dist.reduce_scatter(out, chunks, op=self._op(op), group=self.group)
        return out


def take(t: torch.Tensor, dim: int, index: torch.Tensor | None) -> torch.Tensor:
    """``t``'s entries ``index`` along ``dim`` (a narrow when the index is a contiguous range)."""
    if index is None:
        return t
    n = index.numel()
    if n and int(index[-1]) - int(index[0]) == n - 1:
        return t.narrow(dim, int(index[0]), n)
    return t.index_select(dim, index)


def gather_axis(t: torch.Tensor, dim: int, split_factor: int, comm: Comm) -> torch.Tensor:
    """All-gather the shards of axis ``dim`` back into the whole axis (any split factor)."""
    parts = comm.all_gather(t)
    if split_factor == 1:
        return torch.cat(parts, dim)
    pieces = [p.unflatten(dim, (split_factor, -1)) for p in parts]  # [.., k, c, ..]
    return torch.stack(pieces, dim + 1).flatten(dim, dim + 2)  # [.., k, d, c, ..] -> [.., k*d*c, ..]


def reshard(t: torch.Tensor, kind: str, src: Placement, dst: Placement, global_size: Sequence[int], comm: Comm) -> torch.Tensor:
    """This rank's part of a tensor placed ``src``, re-placed as ``dst`` on one mesh axis, by the
    step ``kind`` the program planned (``nvtp.sharding.reshard.reshard_kind``): it is run as
    given, never worked out again here."""
    op = src.reduce_op if is_partial(src) else "sum"
    if kind == "allgather":
        dim, factor = axis_split(src)
        return _from_whole(gather_axis(t, dim, factor, comm), dst, global_size, comm)
    if kind == "allreduce":
        return _from_whole(comm.all_reduce(t, op), dst, global_size, comm)
    if kind == "reduce_scatter":
        dim, _ = axis_split(dst)
        chunks = [take(t, dim, local_indices(global_size[dim], dst, comm.size, r)) for r in range(comm.size)]
        return comm.reduce_scatter(chunks, op)
    if kind in ("slice", "partition"):
        return _from_whole(t, dst, global_size, comm)
    raise ValueError(f"no reshard step {kind!r} (from {src} to {dst}); nvtp.sharding.reshard.reshard_kind names the steps")


def _from_whole(t: torch.Tensor, dst: Placement, global_size: Sequence[int], comm: Comm) -> torch.Tensor:
    """This rank's part, placed ``dst``, of ``t``, a whole value every rank holds."""
    split = axis_split(dst)
    if split is not None:
        dim, _ = split
        return take(t, dim, local_indices(global_size[dim], dst, comm.size, comm.rank))
    if is_partial(dst):  # rank 0 keeps the value and the others hold zeros: their sum is the value, exactly
        return t if comm.rank == 0 else torch.zeros_like(t)
    return t
