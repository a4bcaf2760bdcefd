"""The load balance of a batch over a program's experts: how many tokens each expert of each
mixture-of-experts layer gets, per rank, and the imbalance (max / mean).

    report = nvtp.plan(model, idx, targets, plan="megatron", mesh=mesh)   # real tensors: the example batch
    report.expert_load                                                    # one ExpertLoad per MoE layer
    print(report.as_text())                                               # "expert load of the example batch: ..."

Routing depends on the data, so the counts come from running: the program's unsharded forward
fusion (``Program.source.forward``) on one process with the reference backend, on the batch and
the model's parameters as they are, every value kept (``reference.run(values=...)``); each
layer's expert index (the ``gather_mm`` operand its ops share, ``nvtp.sharding.moe``) is then cut
as the sharded forward places it (``spmd.shard_tensor``): rank r's part is the routed rows rank r
holds in a step. A program that drops rows (ep's capacity factor) routes its later layers on
what the drops left, which no unsharded run computes: its ranks are run instead, as threads of
this process (``spmd.run_rank``), each keeping its own index. A layer whose rows an axis dispatches to its experts' ranks (the all-to-alls of
``Strategy.extra_steps``: the ep axis) also gets what each rank's experts receive: the rows its
group's ranks route to the experts it holds (a contiguous block of E/P), and, with a capacity
factor, the rows each rank drops (an expert's rows past its capacity). A token is routed to k
distinct experts, so an expert's rows are its tokens.

Imbalance is max / mean of the counts (1.00: even; E: one expert took everything), the figure
Switch Transformer's and Megatron's load-balancing metrics use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from nvtp.execute import reference, spmd
from nvtp.execute.step import RankProgram
from nvtp.sharding import axes
from nvtp.sharding.axes.ep import capacity, capacity_factor
from nvtp.sharding.moe import module_of, moe_layers


@dataclass(frozen=True)
class ExpertLoad:
    """One MoE layer's load for a batch. ``total[e]``: rows (= tokens) routed to expert e by the
    whole batch; ``per_rank[p][e]``: by the rows mesh position p holds; ``received[p]``: rows the
    experts position p holds receive in a step (None where no axis dispatches the layer's rows;
    with a capacity factor, the rows kept); ``axis``: the mesh axis that does (its name), or "";
    ``dropped[p]``: with a capacity factor, the rows position p routes past its experts' capacity."""

    module: str
    experts: int
    top_k: int
    ranks: tuple[int, ...]  # the rank at each mesh position
    total: tuple[int, ...]
    per_rank: tuple[tuple[int, ...], ...]
    received: tuple[int, ...] | None = None
    axis: str = ""
    dropped: tuple[int, ...] | None = None  # with a capacity factor: rows each position's routing drops (its experts' overflow)

    @property
    def imbalance(self) -> float:
        """max / mean of ``total``."""
        return imbalance(self.total)

    @property
    def received_imbalance(self) -> float | None:
        return None if self.received is None else imbalance(self.received)

    def lines(self) -> list[str]:
        """``nvtp explain``'s lines: the whole batch's counts, each rank's (equal ranks folded), what
        each rank's experts receive."""
        out = [f"  {self.module}: {self.experts} experts, top-{self.top_k}: whole batch {list(self.total)} "
               f"(imbalance {self.imbalance:.2f})"]
        for ranks, counts in _folded(self.ranks, self.per_rank):
            out.append(f"    {ranks}: routes {list(counts)} (imbalance {imbalance(counts):.2f})")
        if self.received is not None:
            out.append(f"    on {self.axis}, each rank's experts receive " + ", ".join(
                f"rank {r} {n}" for r, n in zip(self.ranks, self.received)) + f" rows (imbalance {self.received_imbalance:.2f})")
        if self.dropped is not None:
            out.append("    dropped past the experts' capacity: " + ", ".join(f"rank {r} {n}" for r, n in zip(self.ranks, self.dropped))
                       + " rows")
        return out

    def as_json(self) -> dict[str, Any]:
        return {"module": self.module, "experts": self.experts, "top_k": self.top_k, "ranks": list(self.ranks),
                "total": list(self.total), "imbalance": self.imbalance, "per_rank": [list(c) for c in self.per_rank],
                "per_rank_imbalance": [imbalance(c) for c in self.per_rank], "axis": self.axis,
                "received": None if self.received is None else list(self.received),
                "received_imbalance": self.received_imbalance,
                "dropped": None if self.dropped is None else list(self.dropped)}


def imbalance(counts: Sequence[int]) -> float:
    """max / mean of ``counts`` (1.0 for an empty or all-zero list)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0


def not_computed(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """Why a batch's load cannot be counted (tensors on the meta device: nothing to run), or None."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if any(t.is_meta for t in tensors):
        return "the example arguments are on the meta device: routing depends on the data; pass real tensors to count it"
    if any(p.is_meta for p in model.parameters()):
        return "the model's parameters are on the meta device: routing depends on them; plan a model with its weights to count it"
    return None


def of_batch(program: Any, model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> list[ExpertLoad]:
    """Each MoE layer's load for the batch ``args``/``kwargs`` (as ``driver.bind_call`` binds them)
    under ``program`` (its mesh and its forward's placements); [] for a dense model. On a mesh
    whose program is traced for dp ranks' batches (a "dp" axis), the arguments are one rank's
    batch, as ``nvtp.jit`` takes them, every dp rank passing it. Requires real tensors
    (``not_computed`` is None); runs the unsharded forward once, without gradients."""
    f = program.source.forward
    layers = moe_layers(f)
    if not layers:
        return []
    parts = program.source.parts
    rp = RankProgram(program, run=None, rank=0, part_rows={label: (p.weight, p.start, p.stop) for label, p in parts.items()})
    named = rp.module_state(model)
    call = program.source.call
    user = call.bind(tuple(args), dict(kwargs)) | call.constants if call is not None else dict(zip(program.source.arguments, args))
    inputs = []
    for v in f.inputs:
        label = f.label(v.name)
        if label in user and isinstance(user[label], torch.Tensor) and rp.dp_axis is not None:
            inputs.append(_whole_step(rp, v, user[label]))
        elif label in parts:
            inputs.append(named[parts[label].weight][parts[label].start:parts[label].stop])
        else:
            inputs.append(user[label] if label in user else named[label])
    sharded, mesh = program.forward, program.mesh
    held = _held_indices(sharded, inputs, [layer.index for layer in layers])
    dispatching = _dispatching_axes(sharded)
    out = []
    for layer in layers:
        parts = held[layer.index]
        index = spmd.assemble(parts, sharded.sharding(layer.index), f.values[layer.index].shape, mesh).reshape(-1)
        per_rank = [_count(part, layer.experts) for part in parts]
        axis = next((dispatching[op.outputs[0].name] for op in f.ops
                     if op.kind == "gather_mm" and op.arg("index").name == layer.index and op.outputs[0].name in dispatching), None)
        factor = capacity_factor(sharded) if axis is not None else None
        kept, dropped = per_rank, None
        if factor is not None:  # an expert's rows past its capacity (from one rank) are not sent
            caps = [capacity(factor, sum(counts), layer.experts) for counts in per_rank]
            kept = [tuple(min(c, cap) for c in counts) for counts, cap in zip(per_rank, caps)]
            dropped = tuple(sum(a) - sum(b) for a, b in zip(per_rank, kept))
        received = None if axis is None else _received(kept, mesh, axis, layer.experts)
        out.append(ExpertLoad(module_of(f, layer), layer.experts, layer.top_k, tuple(mesh.devices), _count(index, layer.experts),
                              tuple(per_rank), received, "" if axis is None else mesh.names[axis], dropped))
    return out


def _held_indices(sharded: Any, inputs: list[Any], names: list[str]) -> dict[str, list[torch.Tensor]]:
    """Each of ``names`` (expert indices) as each mesh position holds it, for the whole inputs
    ``inputs`` of ``sharded.source``. A dropless program routes as the unsharded forward does:
    that forward is run once and cut by the placements. A program that drops rows (a capacity
    factor) changes what later layers route: its ranks are run (threads of this process)."""
    mesh = sharded.mesh
    with torch.no_grad():
        if not any(st.changes_result(sharded.options) for st, _ in axes.passes(mesh)):
            values: dict[str, Any] = {}
            reference.run(sharded.source, inputs, values=values)
            return {n: [spmd.shard_tensor(values[n], sharded.sharding(n), mesh, p) for p in range(mesh.size)] for n in names}
        threads = spmd.ThreadMesh(mesh, timeout=300)

        def body(pos: int) -> dict[str, torch.Tensor]:
            values: dict[str, Any] = {}
            spmd.run_rank(sharded, spmd.local_inputs(sharded, inputs, pos), threads.comm(pos), values=values)
            return {n: values[n] for n in names}

        per_position = spmd.on_threads(body, threads)
    return {n: [held[n] for held in per_position] for n in names}


def _whole_step(rp: RankProgram, v: Any, t: torch.Tensor) -> torch.Tensor:
    """The program's whole-step argument ``v`` when every rank's caller passes ``t``: each mesh
    position holds its part of ``t`` as ``nvtp.jit`` gives it (``RankProgram.callers``), joined as
    the program numbers the rows (``spmd.assemble``)."""
    sharded, mesh = rp.forward_fusion, rp.program.mesh
    held = [spmd.shard_tensor(t, rp.callers(sharded, v.name), mesh, p) for p in range(mesh.size)]
    return spmd.assemble(held, sharded.sharding(v.name), v.shape, mesh)


def _dispatching_axes(sharded: Any) -> dict[str, int]:
    """The forward's ops run by all-to-all (an axis's extra steps), by output name -> mesh axis."""
    out = {}
    for st, axis in axes.passes(sharded.mesh):
        for rec in st.extra_steps("forward", sharded, axis):
            if rec["kind"] == "alltoall":
                out[rec["value"]] = axis
    return out


def _received(per_rank: list[tuple[int, ...]], mesh: Any, axis: int, experts: int) -> tuple[int, ...]:
    """Rows each position's experts receive: its group's ranks' rows for the block of experts it
    holds (position c on ``axis`` holds experts [c E/P, (c+1) E/P))."""
    local = experts // mesh.shape[axis]
    out = []
    for p in range(mesh.size):
        c = mesh.coords(mesh.devices[p])[axis]
        group = [mesh.index(r) for r in mesh.group(mesh.devices[p], axis)]
        out.append(sum(sum(per_rank[s][c * local:(c + 1) * local]) for s in group))
    return tuple(out)


def _count(index: torch.Tensor, experts: int) -> tuple[int, ...]:
    return tuple(torch.bincount(index.reshape(-1).long(), minlength=experts).tolist())


def _folded(ranks: Sequence[int], rows: Sequence[tuple[int, ...]]) -> list[tuple[str, tuple[int, ...]]]:
    """Consecutive ranks with equal counts as one line ("ranks 0-3")."""
    out: list[tuple[list[int], tuple[int, ...]]] = []
    for r, c in zip(ranks, rows):
        if out and out[-1][1] == c:
            out[-1][0].append(r)
        else:
            out.append(([r], c))
    return [(f"rank {g[0]}" if len(g) == 1 else f"ranks {g[0]}-{g[-1]}", c) for g, c in out]


__all__ = ["ExpertLoad", "imbalance", "not_computed", "of_batch"]
