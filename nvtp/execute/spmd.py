"""Run a sharded fusion on a mesh: every rank holds only its shards and runs the same program.

Two ways to run the ranks:

* ``run_simulated`` runs them as threads of this process with ``ThreadComm`` collectives: the
  fast tier the tests use to check every rule against the unsharded result.
* ``run_rank`` is one rank of a real process group (torch.distributed: gloo on CPU, NCCL on
  GPU); ``nvtp replay --plan`` starts the processes itself or runs under ``torchrun``.

``shard_tensor`` / ``assemble`` move between whole tensors and per-rank parts (partial sums
are added up, shards put back in place), so results are compared with a single-device run.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from nvtp import fakeguard
from nvtp.execute import reference
from nvtp.execute.collectives import Comm, MeshComm, ThreadComm, ThreadGroup, take
from nvtp.ir.graph import TensorValue
from nvtp.sharding.placements import DeviceMesh, Placement, axis_split, held, is_partial, is_replicate, local_indices
from nvtp.sharding.sharded import ShardedFusion
from nvtp.execute.backends import ring_attentions
from nvtp.steps import tensor_steps


def _sharding(placement: Placement | Sequence[Placement]) -> tuple[Placement, ...]:
    return tuple(placement) if isinstance(placement, (tuple, list)) else (placement,)


def shard_tensor(full: torch.Tensor, placement: Placement | Sequence[Placement], mesh: DeviceMesh, position: int) -> torch.Tensor:
    """The part of ``full`` mesh position ``position`` holds under ``placement`` (one placement,
    or a sharding: one per mesh axis); a copy. A partial sum is held whole by the first position
    of its axis and as zeros by the others."""
    coords = mesh.coords(mesh.devices[position])
    sharding = _sharding(placement)
    out = full
    for dim, index in enumerate(held(full.shape, sharding, mesh, coords)):
        out = take(out, dim, index)
    if any(is_partial(p) and c != 0 for p, c in zip(sharding, coords)):
        out = torch.zeros_like(out)
    return out.clone(memory_format=torch.contiguous_format)  # one copy, contiguous (a column split's view is not)


def assemble(parts: Sequence[torch.Tensor], placement: Placement | Sequence[Placement], shape: Sequence[int],
             mesh: DeviceMesh | None = None) -> torch.Tensor:
    """The whole tensor from every rank's part (in mesh order): shards put in place, partial sums
    added up, replicas read once."""
    sharding = _sharding(placement)
    mesh = mesh or DeviceMesh.of_size(len(parts))
    partial = [p for p in sharding if is_partial(p)]
    op = partial[0].reduce_op if partial else None
    out: torch.Tensor | None = None
    for pos, part in enumerate(parts):
        coords = mesh.coords(mesh.devices[pos])
        if any(is_replicate(p) and c != 0 for p, c in zip(sharding, coords)):
            continue  # a replica of a part already read
        index: list[Any] = held(shape, sharding, mesh, coords)
        if out is None:
            fill = 0 if op in (None, "sum") else float("-inf") if op == "max" else float("inf")
            out = torch.full(tuple(shape), fill, dtype=part.dtype, device=part.device)
        where = _index_tuple(index, shape)
        if op is None:
            out[where] = part
        elif op == "sum":
            out[where] += part
        else:
            out[where] = torch.maximum(out[where], part) if op == "max" else torch.minimum(out[where], part)
    return out


def _index_tuple(index: list[Any], shape: Sequence[int]) -> tuple:
    """``index`` (per axis: None/slice for all, or a tensor of indices) as one advanced index that
    selects the block it describes (each axis's indices broadcast along its own dimension)."""
    if sum(isinstance(i, torch.Tensor) for i in index) <= 1:
        return tuple(slice(None) if i is None else i for i in index)
    n = len(index)
    out = []
    for axis, i in enumerate(index):
        full = i if isinstance(i, torch.Tensor) else torch.arange(shape[axis])
        view = [1] * n
        view[axis] = -1
        out.append(full.reshape(view))
    return tuple(out)


def local_inputs(sharded: ShardedFusion, inputs: Sequence[Any], position: int) -> list[Any]:
    """This rank's parts of the whole ``inputs`` of ``sharded.source``."""
    out = []
    for v, x in zip(sharded.fusion.inputs, inputs):
        if isinstance(v, TensorValue) and isinstance(x, torch.Tensor):
            out.append(shard_tensor(x, sharded.sharding(v.name), sharded.mesh, position))
        else:
            out.append(x)
    return out


def run_rank(sharded: ShardedFusion, inputs: Sequence[Any], comm: Comm, *, seed: int = 0, log: list | None = None,
             values: dict[str, Any] | None = None) -> list[Any]:
    """Run this rank's part of a bare sharded fusion (no Program: its own steps, unscheduled):
    ``inputs`` are this rank's shards; returns this rank's outputs (``values``, if given,
    receives every value this rank holds, as ``reference.run`` gives them)."""
    phase = "backward" if sharded.source.attrs.get("role") == "backward" else "forward"
    rings = ring_attentions(tensor_steps(phase, sharded), sharded.mesh).get(phase)
    return reference.run(sharded.fusion, inputs, shardings=sharded.shardings, mesh=sharded.mesh, comm=comm, seed=seed, log=log,
                         steps=sharded.set_steps, rings=rings, axis_options=sharded.options, values=values)


def run_simulated(sharded: ShardedFusion, inputs: Sequence[Any], *, seed: int = 0, timeout: float = 120.0) -> tuple[list[list[Any]], list[list]]:
    """All ranks as threads of this process, from the whole ``inputs``; returns each rank's
    outputs and the collectives each ran."""
    d = sharded.mesh.size
    threads = ThreadMesh(sharded.mesh, timeout)
    logs: list[list] = [[] for _ in range(d)]

    def body(pos: int) -> Any:
        return run_rank(sharded, local_inputs(sharded, inputs, pos), threads.comm(pos), seed=seed, log=logs[pos])

    return on_threads(body, threads), logs


class ThreadMesh:
    """Thread groups for every process group of a mesh: one per axis on a 1-D mesh, one per row
    and column (and so on) on a mesh of several axes."""

    def __init__(self, mesh: DeviceMesh, timeout: float = 120.0):
        self.mesh, self.size = mesh, mesh.size
        self.groups: dict[tuple[int, tuple[int, ...]], ThreadGroup] = {}
        for axis in range(mesh.ndim):
            for ranks in mesh.groups(axis):
                self.groups[(axis, ranks)] = ThreadGroup(len(ranks), timeout=timeout)

    def comm(self, pos: int) -> Comm:
        rank = self.mesh.devices[pos]
        per_axis = []
        for axis in range(self.mesh.ndim):
            ranks = self.mesh.group(rank, axis)
            per_axis.append(ThreadComm(self.groups[(axis, ranks)], ranks.index(rank)))
        return per_axis[0] if self.mesh.ndim == 1 else MeshComm(pos, self.size, per_axis)

    def abort(self) -> None:
        for g in self.groups.values():
            g.abort()


def on_threads(fn, group: ThreadGroup) -> list[Any]:
    """``fn(position)`` for every rank of ``group`` at once, one thread each; returns the results
    in rank order. The first real failure is raised; the others' broken barriers are not."""
    d = group.size
    fakeguard.hold()  # before any rank's thread enters fake mode and exits (torch's guard would die with it)
    results: list[Any] = [None] * d
    errors: list[BaseException | None] = [None] * d

    def body(pos: int) -> None:
        try:
            results[pos] = fn(pos)
        except BaseException as e:  # noqa: BLE001 - re-raised below, first failure wins
            errors[pos] = e
            group.abort()

    threads = [threading.Thread(target=body, args=(pos,), name=f"nvtp-rank{pos}") for pos in range(d)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real or any(errors):
        raise (real or [e for e in errors if e])[0]
    return results


def assemble_outputs(sharded: ShardedFusion, per_rank: Sequence[Sequence[Any]]) -> list[Any]:
    """The whole outputs of ``sharded.source`` from every rank's outputs."""
    out = []
    for i, v in enumerate(sharded.fusion.outputs):
        parts = [r[i] for r in per_rank]
        if isinstance(v, TensorValue):
            out.append(assemble(parts, sharded.sharding(v.name), v.shape, sharded.mesh))
        else:
            out.append(parts[0])
    return out
