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

from nvtp.execute import reference
from nvtp.execute.collectives import Comm, ThreadComm, ThreadGroup, take
from nvtp.ir.graph import TensorValue
from nvtp.sharding.placements import DeviceMesh, Placement, axis_split, is_partial, local_indices
from nvtp.sharding.sharded import ShardedFusion


def shard_tensor(full: torch.Tensor, placement: Placement, mesh: DeviceMesh, position: int) -> torch.Tensor:
    """The part of ``full`` mesh position ``position`` holds under ``placement`` (a copy)."""
    split = axis_split(placement)
    if split is None:
        if is_partial(placement):
            return full.clone() if position == 0 else torch.zeros_like(full)
        return full.clone()
    dim, _ = split
    return take(full, dim, local_indices(full.shape[dim], placement, mesh.size, position)).contiguous().clone()


def assemble(parts: Sequence[torch.Tensor], placement: Placement, shape: Sequence[int]) -> torch.Tensor:
    """The whole tensor from every rank's part (in mesh order)."""
    if is_partial(placement):
        out = parts[0].clone()
        for p in parts[1:]:
            out = out + p if placement.reduce_op == "sum" else torch.maximum(out, p) if placement.reduce_op == "max" else torch.minimum(out, p)
        return out
    split = axis_split(placement)
    if split is None:
        return parts[0]
    dim, _ = split
    out = torch.empty(tuple(shape), dtype=parts[0].dtype)
    index = [slice(None)] * len(shape)
    for pos, p in enumerate(parts):
        index[dim] = local_indices(shape[dim], placement, len(parts), pos)
        out[tuple(index)] = p
    return out


def local_inputs(sharded: ShardedFusion, inputs: Sequence[Any], position: int) -> list[Any]:
    """This rank's parts of the whole ``inputs`` of ``sharded.source``."""
    out = []
    for v, x in zip(sharded.fusion.inputs, inputs):
        if isinstance(v, TensorValue) and isinstance(x, torch.Tensor):
            out.append(shard_tensor(x, sharded.placement(v.name), sharded.mesh, position))
        else:
            out.append(x)
    return out


def run_rank(sharded: ShardedFusion, inputs: Sequence[Any], comm: Comm, *, seed: int = 0, log: list | None = None) -> list[Any]:
    """Run this rank's part: ``inputs`` are this rank's shards; returns this rank's outputs."""
    return reference.run(sharded.fusion, inputs, shardings=sharded.shardings, mesh=sharded.mesh, comm=comm, seed=seed, log=log)


def run_simulated(sharded: ShardedFusion, inputs: Sequence[Any], *, seed: int = 0, timeout: float = 120.0) -> tuple[list[list[Any]], list[list]]:
    """All ranks as threads of this process, from the whole ``inputs``; returns each rank's
    outputs and the collectives each ran."""
    d = sharded.mesh.size
    group = ThreadGroup(d, timeout=timeout)
    logs: list[list] = [[] for _ in range(d)]

    def body(pos: int) -> Any:
        return run_rank(sharded, local_inputs(sharded, inputs, pos), ThreadComm(group, pos), seed=seed, log=logs[pos])

    return on_threads(body, group), logs


def on_threads(fn, group: ThreadGroup) -> list[Any]:
    """``fn(position)`` for every rank of ``group`` at once, one thread each; returns the results
    in rank order. The first real failure is raised; the others' broken barriers are not."""
    d = group.size
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
            out.append(assemble(parts, sharded.placement(v.name), v.shape))
        else:
            out.append(parts[0])
    return out
