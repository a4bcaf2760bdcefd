"""What the planner traces: the model cut to a few blocks, each op placed in its block, and the values that carry the batch.

    facts = model_facts(model, args, kwargs, machine, memory, backend, devices)
    s = take(model, args, kwargs, facts)              # traced once on meta tensors, the whole batch
    s.blocks.forward[k]                               # the sample block forward op k runs in
    s.batched                                         # value names whose size follows the batch

A deep model's blocks are alike (``nvtp.frontend.regional``), so the planner traces the model cut
to ``count = min(L, 3)`` blocks through the compile driver (one block traced, spliced, as
``nvtp.jit`` traces the whole), shards that sample per candidate mesh, and counts its middle
block L - 2 times more: block 0 carries the head (embedding), the last block the tail (final
norm, head, loss), as the pipeline's cut reads them (``nvtp.pipeline.stages.block_ops``). A model
of one block (or none repeated) is its own sample.

A pipeline runs microbatches, a fraction of the traced batch; rather than tracing again per
microbatch count, the planner scales the values that carry the batch (``batched``): those the data
plan splits along the batch when the sample is sharded over a data-parallel axis alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from nvtp import driver, tracecache
from nvtp.errors import InputError
from nvtp.frontend.recompute import sequence_of
from nvtp.pipeline import calls
from nvtp.pipeline.stages import BlockOps, block_ops
from nvtp.sharding import axes
from nvtp.sharding.placements import DeviceMesh, axis_split
from nvtp.frontend.regional import NotRepeatable, find_repeated, truncated

SAMPLE_BLOCKS = 3  # head + block 0, a middle block, the last block + tail


@dataclass(frozen=True)
class Facts:
    """What the strategies' ``refuse``, ``choices`` and ``conflicts`` read of a planning problem."""

    devices: int
    machine: Any  # nvtp.sharding.cost.Machine
    memory: float  # bytes a device may hold
    backend: str
    batch: int  # rows of the whole step: every rank passes them, nvtp takes each data-parallel rank's part
    sequence: int | None  # axis 1 of the first argument of two or more axes
    blocks: int  # the model's repeated blocks (1: none repeated)
    prefix: str | None  # their ModuleList's name
    loss_only: bool  # the forward returns one scalar (a pipeline needs it)
    dims: frozenset[int] = frozenset()  # the sizes of the trainable weight matrices' dimensions (what a tensor split divides)
    experts: frozenset[int] = frozenset()  # the leading sizes of 3-D weights (a MoE layer's experts, [E, in, out]); empty: dense


@dataclass
class Sample:
    traced: Any  # nvtp.driver.Traced of the model cut to ``count`` blocks, at the whole batch
    count: int  # blocks in the sample
    blocks: BlockOps  # op index -> sample block, per phase; parameter label -> block
    batched: frozenset[str]  # forward and backward value names whose size follows the batch
    key: tuple  # the trace options it was traced with


def repeated(model: torch.nn.Module) -> tuple[str | None, int]:
    """(the ModuleList of the model's blocks, how many), or (None, 1) for a model without one."""
    try:
        rep = find_repeated(model)
    except NotRepeatable:
        return None, 1
    return rep.prefix, rep.count


def whole_batch(args: tuple, kwargs: Mapping[str, Any]) -> int:
    """Rows of the whole step: the first dimension of the first tensor argument."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.ndim:
            return int(a.shape[0])
    raise InputError("plan='auto' splits the batch over data-parallel ranks: pass at least one tensor argument with a batch dimension")


def model_facts(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any], *, machine: Any, memory: float, backend: str,
                devices: int, loss_only: bool | None = None) -> Facts:
    prefix, blocks = repeated(model)
    sequence = None
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.ndim >= 2:
            sequence = int(a.shape[1])
            break
    dims = frozenset(d for p in model.parameters() if p.requires_grad and p.ndim == 2 for d in p.shape)
    experts = frozenset(int(p.shape[0]) for p in model.parameters() if p.requires_grad and p.ndim == 3)
    return Facts(devices, machine, memory, backend, whole_batch(args, kwargs), sequence, blocks, prefix,
                 bool(loss_only), dims, experts)


def take(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any], facts: Facts, *, ring: bool = False,
         split_parts: bool = False, frontend: str = "auto") -> Sample:
    """The sample of ``model`` called with the whole batch (see the module docstring), traced by the
    compile driver with these trace options."""
    count = min(facts.blocks, SAMPLE_BLOCKS)
    sub = model
    if facts.prefix is not None and count < facts.blocks:
        sub = truncated(model, facts.prefix, count)
    way = driver.route(model, frontend)
    bargs, bkwargs = driver.bind_call(model, way, args, kwargs)
    options = dict(frontend=way, split_parts=split_parts, ring=ring, like=None)
    # nothing here checks the trace: read from the cache while the user's code is unchanged (nvtp/tracecache.py)
    traced = tracecache.trace(sub, bargs, bkwargs, options | {"sample": True}, lambda: driver.trace(sub, bargs, bkwargs, **options),
                              lambda t: False)
    if facts.prefix is not None:
        found = block_ops(traced, facts.prefix, count)
    else:
        f, b = traced.forward, traced.backward
        found = BlockOps({k: 0 for k in range(len(f.ops))}, {k: 0 for k in range(len(b.ops))} if b is not None else {},
                         {f.label(v.name): 0 for v in f.inputs if f.role(v.name) == "parameter"})
    return Sample(traced, count, found, _batched(traced, facts.batch), (ring, split_parts))


def _batched(traced: Any, batch: int) -> frozenset[str]:
    """The values the data plan splits along the batch, on a data-parallel axis of the batch's
    smallest prime factor (nothing for a batch of one row: it cannot be split)."""
    if batch < 2:
        return frozenset()
    p = next(d for d in range(2, batch + 1) if batch % d == 0)
    name = next(s.name for s in sorted(axes.AXES.values(), key=lambda s: s.order) if s.splits_batch)
    program = driver.shard(traced, "replicate", DeviceMesh.of_shape((p,), (name,)), "reference", overlap=False)
    out = set()
    for sharded in (program.forward, program.backward):
        if sharded is None:
            continue
        names = set(sharded.source.values)
        out |= {n for n, s in sharded.shardings.items() if n in names and axis_split(s[0]) is not None
                and sharded.source.role(n) != "parameter"}
    return frozenset(out)


def loss_only(traced: Any) -> bool:
    """Whether a pipeline can train the traced forward: it returns its loss alone, or an output
    object with a loss (``nvtp.pipeline.calls.loss_only``)."""
    try:
        calls.loss_only(traced, "")
    except InputError:
        return False
    return True


__all__ = ["Facts", "Sample", "SAMPLE_BLOCKS", "model_facts", "take", "repeated", "whole_batch", "loss_only", "sequence_of", "math"]
