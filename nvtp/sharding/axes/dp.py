"""The "dp" axis: data parallelism. Each rank passes its own batch; the weights stay whole (DDP)
or, with ``fsdp=True``, are split at rest and gathered where used (ZeRO-3).

The data plan is DDP's semantics as a sharding: every batched input (the module's arguments) is
split along its first dimension and propagated with ``keep_splits``, so gathering the batch is
the last resort; the loss (a mean over the global batch) is a partial sum over dp and is
all-reduced; each weight gradient contracts the batch, so it is a partial sum over dp,
all-reduced (DDP) or reduce-scattered to the weight's at-rest shard (FSDP). FSDP's all-gathers
are ``set`` ops from a weight's at-rest placement to the whole weight, in the forward and again
in the backward (the backward fusion reads the weights it needs): per rank and step
3·Ψ·(dp−1)/dp bytes for Ψ the bytes of the rank's part of the split weights (a weight the
backward does not read, such as an embedding table, is gathered once: 2·Ψ'·(dp−1)/dp).

FSDP splits a weight along a dimension the passes before it (tp's) leave whole. Activations may
be split twice along one dimension, by different factors of it: the batch (dp) and the sequence
(tp, with SP) of a flattened ``[B*T, C]`` (``nvtp.sharding.compose``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.sharding.axes.strategy import AxisPass, Strategy, inputs_of, register
from nvtp.sharding.passes import backward_annotations, shard
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Placement, axis_split, is_replicate, local_shape, make_shard
from nvtp.sharding.propagate import ShardingError
from nvtp.sharding.report import size_text as _size
from nvtp.sharding.report import weight_of
from nvtp.sharding.sharded import ShardedFusion


@dataclass
class DataPlan:
    """What the data plan did: inputs split along the batch, and per parameter its at-rest
    placement on dp (FSDP), with the reason a parameter stays whole."""

    batched: dict[str, Placement] = field(default_factory=dict)
    at_rest: dict[str, Placement] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _fsdp_dim(v: TensorValue, taken: set[int], dp: int) -> tuple[int | None, str]:
    """The dimension FSDP splits ``v`` along on dp: the first one the passes before leave whole that dp divides."""
    for dim, n in enumerate(v.shape):
        if dim not in taken and n % dp == 0:
            return dim, ""
    why = "its only dimension is split by tp" if taken and v.ndim == 1 else \
        f"no dimension of {list(v.shape)} that tp leaves whole is a multiple of {dp}"
    return None, why


def data_plan(fusion: Fusion, run: AxisPass | None, dp: int, fsdp: bool, batched: Collection[str] | None = None,
              weights: Collection[str] | None = None) -> DataPlan:
    """The dp axis's plan for a forward fusion. ``batched``: the labels of the inputs that carry
    the batch (the module's arguments); None: every input that is not a parameter. ``weights``:
    the labels FSDP may split (the module's parameters, not its buffers); None: every parameter
    input. ``run``: the passes before (FSDP splits a dimension they leave whole)."""
    plan = DataPlan()
    batch_inputs = [v for v in fusion.inputs if isinstance(v, TensorValue) and fusion.role(v.name) != "parameter" and v.ndim >= 1
                    and (batched is None or fusion.label(v.name) in batched)]
    for v in batch_inputs:
        outer = _batch_split(run, v.name)  # an earlier pass (ep) split the batch: dp splits each of its parts
        if v.shape[0] % (dp * outer) == 0 and v.shape[0] >= dp * outer:
            plan.batched[v.name] = make_shard(0, outer)
        elif v.shape[0] != 1:
            raise ShardingError(f"input {fusion.label(v.name) or v.name} ({v.describe()}): its batch dimension of size {v.shape[0]} "
                                f"cannot be split over the dp axis of size {dp}; use a batch that is a multiple of {dp} per step")
    if not plan.batched:
        shapes = ", ".join(f"{fusion.label(v.name) or v.name} {list(v.shape)}" for v in batch_inputs) or "none"
        raise ShardingError(f"the dp axis of size {dp} splits the batch, but no input has a batch dimension it divides (inputs: {shapes}); "
                            f"pass a batch of at least {dp} (a multiple of {dp})")
    if fsdp:
        for v in inputs_of(fusion, "parameter"):
            if weights is None or fusion.label(v.name) in weights:
                dim, why = _fsdp_dim(v, run.taken(v.name) if run is not None else set(), dp)
                if dim is None:
                    plan.notes.append(f"fsdp: {fusion.label(v.name) or v.name} stays whole on dp: {why}")
                else:
                    plan.at_rest[v.name] = make_shard(dim)
    return plan


def _batch_split(run: AxisPass | None, name: str) -> int:
    """Into how many parts the passes before dp's split input ``name``'s batch (dimension 0)."""
    parts = 1
    for axis, s in run.done if run is not None else ():
        split = axis_split(s.shardings[name][0]) if name in s.shardings else None
        if split is not None and split[0] == 0:
            parts *= run.mesh.shape[axis]
    return parts


def split_at_rest(inputs: dict[str, Placement], backward: Fusion) -> tuple[dict[str, Placement], dict[str, Placement]]:
    """(annotations, at_rest) of a backward pass on a data-like axis: parameters split at rest
    enter whole where used (gathered by ``set`` ops), the rest as given."""
    at_rest = {n: p for n, p in inputs.items() if backward.role(n) == "parameter" and not is_replicate(p)}
    return {n: (REPLICATE if n in at_rest else p) for n, p in inputs.items()}, at_rest


@register
class DataParallel(Strategy):
    name = "dp"
    summary = "data parallel: each rank passes its own batch; fsdp=True also splits the weights (ZeRO-3)"
    order = 20
    options = frozenset({"fsdp"})
    splits_batch = True
    crosses_nodes = True

    def trace_options(self, mesh: DeviceMesh, axis: int, plan: Any) -> dict[str, Any]:
        return {"batch": mesh.shape[axis]}  # the program is the whole step's: dp times a rank's batch

    def forward(self, run: AxisPass, axis: int) -> ShardedFusion:
        traced, f = run.traced, run.traced.forward
        data = data_plan(f, run, run.mesh.shape[axis], run.fsdp, set(traced.arguments) if traced.boundary else None, traced.weights)
        for n, p in run.placed_on(axis).items():  # parameters already placed stay where they are
            if not is_replicate(p):
                data.at_rest[n] = p
            else:
                data.at_rest.pop(n, None)
        run.at_rest[axis] = dict(data.at_rest)
        run.notes += data.notes
        return shard(run.current(f), "replicate", run.sub(axis), annotations=data.batched, target=run.target, at_rest=data.at_rest,
                     hoist=False, keep_splits=True)

    def backward(self, run: AxisPass, axis: int, forward: ShardedFusion) -> ShardedFusion:
        # Gradients contract the batch: partial sums over dp, all-reduced (DDP) or reduce-scattered (FSDP).
        b = run.traced.backward
        inputs, hints = backward_annotations(b, forward.view(axis))
        annotations, at_rest = split_at_rest(inputs, b)
        return shard(run.current(b), "replicate", run.sub(axis), annotations=annotations, output_hints=run.remap(hints, b),
                     target=run.target, at_rest=at_rest, hoist=False, keep_splits=True)

    def headline(self, report: Any, axis: int) -> str:
        return f"{(report.data or 'ddp').upper()} on dp"

    layout = 1  # outside cp and tp, inside pp

    def refuse(self, extent: int, facts: Any) -> str | None:
        if facts.batch % extent:
            return f"the batch of {facts.batch} rows does not split over dp={extent}"
        return super().refuse(extent, facts)

    def choices(self, extent: int, extents: Mapping[str, int], facts: Any) -> list[dict[str, Any]]:
        return [{"fsdp": False}, {"fsdp": True}] if extent > 1 else [{}]


    def memory_label(self, kind: str, parameter: bool) -> str | None:
        """DDP's all-reduce of a bucket of gradients copies them into one flat buffer (kept between
        steps, the gradients views of it: ``nvtp.execute.buckets``); FSDP's
        gather holds every rank's part of a bucket of weights and makes each weight whole where it
        is used; its reduce-scatter copies a bucket of whole gradients into per-rank chunks."""
        return _MEMORY_LABELS.get((kind, parameter)) or super().memory_label(kind, parameter)

    def report_lines(self, report: Any, axis: int) -> list[str]:
        return _traffic_text(dp_traffic(report, axis))

    def report_json(self, report: Any, axis: int) -> dict[str, Any]:
        return {"dp_traffic": dp_traffic(report, axis)}


_MEMORY_LABELS = {  # (reshard step, gathers a weight) -> the term's name (nvtp.auto.memory says what each holds)
    ("allreduce", False): "dp: gradient bucket (DDP all-reduce)",
    ("reduce_scatter", False): "dp: gradient bucket, per-rank chunks (FSDP reduce-scatter)",
    ("allgather", True): "dp: weight bucket, every rank's part (FSDP all-gather)",
    ("allgather result", True): "dp: gathered whole weights (FSDP)",
}


def dp_traffic(report: Any, dp_axis: int) -> dict[str, Any]:
    """The bytes each rank sends per step on dp against DDP's and FSDP's formulas: DDP
    2W(dp-1)/dp; FSDP 3Psi(dp-1)/dp for the weights it splits (gathered in forward and again in
    backward, gradients reduce-scattered) plus 2R(dp-1)/dp for those it leaves whole; W, Psi, R
    this rank's parts of the weights under the other axes, in their dtype. A split weight the
    backward does not read (an embedding table, the bias of a residual projection) is not
    gathered again: it counts 2Psi'(dp-1)/dp (Psi' within ``split_weight_bytes``, outside
    ``split_read_by_backward_bytes``). ``weights`` is the measured dp collectives of the weights
    and their gradients, each counted in its weight's dtype, so it equals ``formula``;
    ``gradients_in_fp32`` the extra bytes of 16-bit weights' gradients reduced in fp32 before
    their cast; ``other`` the rest (the loss's scalars); ``measured`` = weights +
    gradients_in_fp32 + other; ``deviations`` the weights whose measured bytes differ from their
    share of the formula (nvtp's GPT on megatron-sp: wpe's gradient is reduced over dp while
    still split along the sequence by tp, so 1/tp of it; with FSDP it is all-reduced whole before
    the slice to the rank's shard, not reduce-scattered)."""
    mesh = report.mesh
    dp = mesh.shape[dp_axis]
    itemsize, split, once, whole = {}, 0, 0, 0
    expected: dict[str, float] = {}
    for r, v, label in report.parameters():
        if report.weights is not None and label not in report.weights:
            continue
        itemsize[label] = v.dtype.itemsize
        sharding = r.forward.shardings[v.name]
        others = tuple(p for a, p in enumerate(sharding) if a != dp_axis)
        rest = DeviceMesh.of_shape(tuple(n for a, n in enumerate(mesh.shape) if a != dp_axis) or (1,))
        part = _numel(local_shape(v.shape, others or (REPLICATE,), rest)) * v.dtype.itemsize
        b = r.backward.source if r.backward is not None else None
        read = b is not None and any(b.role(u.name) == "parameter" and b.label(u.name) == label for u in b.inputs)
        if axis_split(sharding[dp_axis]) is None:
            whole += r.count * part
            times = 2
        elif read:
            split += r.count * part
            times = 3
        else:  # the backward does not read it (an embedding table, a bias): gathered once a step
            once += r.count * part
            times = 2
        expected[label] = expected.get(label, 0) + times * r.count * part * (dp - 1) / dp
    measured: dict[str, int] = {}
    widened = other = 0
    others_seen: list[str] = []
    for r in report.regions:
        for sharded in (r.forward, r.backward):
            if sharded is None:
                continue
            for result, step in sharded.set_steps.items():
                if step.axis != dp_axis or not step.is_communication:
                    continue
                label = weight_of(sharded, result, step)
                v = sharded.fusion.value(result)
                if label not in itemsize:
                    other += r.count * step.bytes
                    others_seen.append(f"{step.kind} {sharded.source.label(step.value) if step.value in sharded.source.info else step.value} "
                                       f"{list(v.shape)} {v.dtype.value}")
                    continue
                at_weight = step.bytes * itemsize[label] // v.dtype.itemsize
                measured[label] = measured.get(label, 0) + r.count * at_weight
                widened += r.count * (step.bytes - at_weight)
    frac = (dp - 1) / dp
    formula = round((3 * split + 2 * once + 2 * whole) * frac)
    weights = sum(measured.values())
    return {"data": report.data or "ddp", "dp": dp, "split_weight_bytes": split + once,
            "split_read_by_backward_bytes": split, "whole_weight_bytes": whole,
            "formula": formula, "weights": weights, "gradients_in_fp32": widened, "other": other,
            "other_collectives": others_seen, "measured": weights + widened + other,
            "deviations": {k: {"measured": measured.get(k, 0), "formula": round(expected[k])}
                           for k in expected if measured.get(k, 0) != round(expected[k])}}


def _traffic_text(t: dict[str, Any]) -> list[str]:
    """dp's bytes against DDP's or FSDP's formula, as ``dp_traffic`` counts them."""
    k = f"(dp-1)/dp = {t['dp'] - 1}/{t['dp']}"
    if t["data"] == "ddp":
        formula = f"DDP's 2W{k[:9]} with W = {_size(t['whole_weight_bytes'])} (this rank's tp shards of the weights)"
    else:
        once = t["split_weight_bytes"] - t["split_read_by_backward_bytes"]
        formula = (f"FSDP's 3Psi{k[:9]} + 2Psi'{k[:9]} + 2R{k[:9]} with Psi = {_size(t['split_read_by_backward_bytes'])} "
                   f"(split weights the backward gathers again), Psi' = {_size(once)} (split weights it does not read), "
                   f"R = {_size(t['whole_weight_bytes'])} (weights left whole); this rank's tp shards")
    lines = [f"dp bytes per rank per step: {_size(t['measured'])} measured = {_size(t['weights'])} weights and gradients "
             f"(in the weights' dtype) + {_size(t['gradients_in_fp32'])} gradients reduced in fp32 before their cast "
             f"+ {_size(t['other'])} other ({', '.join(t['other_collectives']) or 'none'})",
             f"  formula: {formula}, {k}: {_size(t['formula'])} ({t['formula']} B; weights measured {t['weights']} B)"]
    for label, d in t["deviations"].items():
        lines.append(f"  {label}: {d['measured']} B measured, {d['formula']} B by the formula")
    return lines


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n
