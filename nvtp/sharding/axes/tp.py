"""The "tp" axis: tensor parallelism by the user's plan (Megatron's column/row pairs, heads,
sequence parallelism with megatron-sp, or an explicit plan).

Its forward pass is the plan's 1-D pipeline over tp's extent (annotate, propagate, plan and
insert reshards; ``nvtp.sharding.passes``), the module's outputs asked whole (the caller holds
whole tensors); its backward pass starts from the placements the forward gave each value and
asks each parameter's gradient to land where the parameter lives, and the arguments' gradients
whole. It runs first on every mesh: the data and sequence axes shard what it leaves.
"""

from __future__ import annotations

from typing import Any, Mapping

from nvtp.sharding.axes.strategy import AxisPass, Strategy, register
from nvtp.sharding.passes import backward_annotations, shard
from nvtp.sharding.placements import DeviceMesh
from nvtp.sharding.sharded import ShardedFusion

DERIVED = ("megatron", "megatron-sp")  # the plans nvtp derives from the graph


@register
class TensorParallel(Strategy):
    name = "tp"
    summary = "tensor parallel: the plan (megatron, megatron-sp, explicit) splits weights and activations"
    order = 10
    runs_plan = True

    def trace_options(self, mesh: DeviceMesh, axis: int, plan: Any) -> dict[str, Any]:
        # Fused projections with parts of different sizes become one input per part
        # (nvtp/frontend/fused.py) for the derived plans; explicit plans name whole weights.
        return {"split_parts": isinstance(plan, str) and plan in DERIVED}

    def forward(self, run: AxisPass, axis: int) -> ShardedFusion:
        f = run.traced.forward
        return shard(run.current(f), run.plan, run.sub(axis), annotations=run.placed_on(axis),
                     output_hints=run.remap(run.output_hints, f), target=run.target)

    def backward(self, run: AxisPass, axis: int, forward: ShardedFusion) -> ShardedFusion:
        b = run.traced.backward
        inputs, hints = backward_annotations(b, forward.view(axis))  # parameters' gradients where they live
        hints.update(run.grad_hints)  # the arguments' gradients whole
        return shard(run.current(b), "replicate", run.sub(axis), annotations=inputs, output_hints=run.remap(hints, b),
                     target=run.target)

    def headline(self, report: Any, axis: int) -> str:
        return f"plan {report.plan} on tp"

    layout = 3  # innermost: the fastest link

    def refuse(self, extent: int, facts: Any) -> str | None:
        node = facts.machine.devices_per_node
        if extent > node:
            return (f"tp={extent} spans more than a node of {node} devices on {facts.machine.name}: its collectives, on the "
                    "critical path of every layer, would cross nodes")
        if facts.dims and not any(d % extent == 0 for d in facts.dims):
            return f"tp={extent} divides no dimension of the model's weight matrices ({', '.join(map(str, sorted(facts.dims)))})"
        return super().refuse(extent, facts)

    def choices(self, extent: int, extents: Mapping[str, int], facts: Any) -> list[dict[str, Any]]:
        if extent == 1:
            return [{"plan": DERIVED[0]}]
        # megatron: all-reduces; megatron-sp: gathers and reduce-scatters, blocking or as rings beside the matmuls
        return [{"plan": DERIVED[0], "collective_matmul": False}, {"plan": DERIVED[1], "collective_matmul": False},
                {"plan": DERIVED[1], "collective_matmul": True}]
