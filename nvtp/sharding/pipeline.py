"""The sharding pipeline: annotate, propagate, plan reshards, insert them, verify.

    sharded = shard(fusion, "megatron", DeviceMesh.of_size(4))
    sharded.communications   # [ReshardStep(allreduce T49 ...), ...]

Each step is a named pure function; the runner times them and re-raises a failure as
"in pass X after [a, b]". A backward fusion is sharded with its forward (``shard_backward``):
parameters take the plan's placements, saved inputs the placement their forward value had, and
each gradient is asked to land where its parameter lives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.ir.verify import verify
from nvtp.sharding import plans as plans_mod
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Placement, is_partial
from nvtp.sharding.propagate import Propagation, ShardingError, check_annotations, implied, propagate_shardings
from nvtp.sharding.reshard import ReshardStep, communications, hoist_gathers, insert_reshards, plan_reshards
from nvtp.sharding.rules import factors_of, tensor_operands

PLANS = ("megatron", "megatron-sp")


@dataclass
class ShardedFusion:
    """A fusion with its reshard ``set`` ops inserted and a placement for every tensor."""

    fusion: Fusion
    source: Fusion
    mesh: DeviceMesh
    shardings: dict[str, tuple[Placement, ...]]
    steps: list[ReshardStep]
    set_steps: dict[str, ReshardStep]
    annotations: plans_mod.Annotations
    plan: str
    propagation: Propagation
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def communications(self) -> list[ReshardStep]:
        """Collectives in the order the sharded fusion runs them."""
        order = {op.outputs[0].name: i for i, op in enumerate(self.fusion.ops) if op.outputs}
        by_result = sorted(self.set_steps.items(), key=lambda kv: order.get(kv[0], 0))
        return [s for _, s in by_result if s.is_communication]

    def placement(self, name: str) -> Placement:
        return self.shardings[name][0]

    def output_placements(self) -> dict[str, Placement]:
        """Placement of each output, keyed by the *source* fusion's output names."""
        return {src.name: self.placement(out.name) for src, out in zip(self.source.outputs, self.fusion.outputs)}


class PassError(RuntimeError):
    pass


def run_passes(passes: list[tuple[str, Callable[[dict], Any]]], state: dict) -> dict:
    done: list[str] = []
    for name, fn in passes:
        start = time.perf_counter()
        try:
            fn(state)
        except ShardingError:
            raise
        except Exception as e:
            raise PassError(f"in pass {name} after [{', '.join(done)}]: {type(e).__name__}: {e}") from e
        state["seconds"][name] = time.perf_counter() - start
        done.append(name)
    return state


def annotate(fusion: Fusion, plan: str | Mapping[str, Any], mesh: DeviceMesh, target: str = "nvfuser") -> plans_mod.Annotations:
    """Apply ``plan`` (a plan name, an explicit glob plan, or a per-input plan) to ``fusion``.

    The Megatron plans split embedding tables along the vocabulary only for the reference
    target: a vocabulary-parallel lookup gives a partial sum on an ``index_select``, which
    nvFuser cannot hold (it keeps partial sums only on reduction axes)."""
    if isinstance(plan, str):
        if plan in ("megatron", "megatron-sp"):
            return plans_mod.megatron(fusion, mesh, sequence_parallel=plan == "megatron-sp", vocab_parallel=target == "reference")
        if plan in ("replicate", "none"):
            return plans_mod.Annotations({v.name: REPLICATE for v in fusion.inputs if isinstance(v, TensorValue)})
        return _explicit_or_per_input(fusion, plans_mod.parse_plan_text(plan), mesh)
    return _explicit_or_per_input(fusion, plan, mesh)


def _explicit_or_per_input(fusion: Fusion, plan: Mapping[str, Any], mesh: DeviceMesh) -> plans_mod.Annotations:
    names = {v.name for v in fusion.inputs}
    if plan and all(k in names for k in plan):
        return plans_mod.per_input(fusion, plan)
    return plans_mod.explicit(fusion, mesh, plan)


def verify_sharded(fusion: Fusion, source: Fusion, shardings: Mapping[str, tuple[Placement, ...]], prop: Propagation) -> None:
    """Every op reads each operand in the placement its decision needs, results are where the
    decision puts them, and no output is a partial sum. Checks the reshard passes' wiring."""
    producers = fusion.producers()
    for old, decision in prop.decisions.items():
        name = source.ops[old].outputs[0].name
        op = producers.get(name)
        if op is None:
            continue  # removed as dead after a gather moved
        f = factors_of(op)
        for pos, (axes, v) in enumerate(zip(f.operands, tensor_operands(op))):
            want = implied(axes, f, decision, result=False, position=pos)
            if shardings[v.name][0] != want:
                raise ShardingError(f"{op}: operand {v.name} is {shardings[v.name][0]} but the op needs {want}")
        for axes, v in zip(f.results, op.outputs):
            if isinstance(v, TensorValue) and shardings[v.name][0] != implied(axes, f, decision, result=True):
                raise ShardingError(f"{op}: result {v.name} is {shardings[v.name][0]}, its decision gives another placement")
    for v in fusion.outputs:
        if isinstance(v, TensorValue) and is_partial(shardings[v.name][0]):
            raise ShardingError(f"output {v.name} is a partial sum; outputs must be resolved")


TARGETS = ("reference", "nvfuser")


def shard(fusion: Fusion, plan: str | Mapping[str, Any], mesh: DeviceMesh, *,
          annotations: Mapping[str, Placement] | None = None, output_hints: Mapping[str, Placement] | None = None,
          check: bool = True, target: str = "nvfuser") -> ShardedFusion:
    """Shard ``fusion`` over ``mesh`` following ``plan``.

    ``annotations`` (input name -> placement) override the plan's, e.g. a backward fusion's saved
    inputs placed as their forward values are. Raises ``ShardingError`` before any work when the
    plan does not fit the fusion or mesh. ``target`` "nvfuser" resolves partial sums where they
    are produced (nvFuser's representation); "reference" lets them flow through linear ops.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose one of {TARGETS}")
    state: dict[str, Any] = {"seconds": {}}

    def _annotate(s):
        ann = annotate(fusion, plan, mesh, target)
        if annotations:
            ann.placements.update(annotations)
        check_annotations(fusion, mesh, ann.placements)
        s["annotations"] = ann

    def _propagate(s):
        hints = {**s["annotations"].hints, **(output_hints or {})}
        s["prop"] = propagate_shardings(fusion, mesh, s["annotations"].placements, hints, partial_pass=target == "reference")

    def _plan(s):
        s["steps"] = plan_reshards(fusion, s["prop"], mesh, dict(output_hints or {}))

    def _insert(s):
        s["fusion"], s["placements"], s["set_steps"], s["index_map"] = insert_reshards(fusion, s["prop"], s["steps"])

    def _hoist(s):
        s["fusion"], s["placements"], s["set_steps"] = hoist_gathers(s["fusion"], s["placements"], s["set_steps"], mesh)
        s["steps"] = [st for st in s["set_steps"].values()]

    def _verify(s):
        verify(s["fusion"])
        verify_sharded(s["fusion"], fusion, {k: (p,) for k, p in s["placements"].items()}, s["prop"])

    passes = [("annotate", _annotate), ("propagate", _propagate), ("plan_reshards", _plan), ("insert_reshards", _insert),
              ("hoist_gathers", _hoist)]
    if check:
        passes.append(("verify", _verify))
    run_passes(passes, state)
    return ShardedFusion(
        state["fusion"], fusion, mesh, {k: (p,) for k, p in state["placements"].items()}, state["steps"],
        state["set_steps"], state["annotations"], plan if isinstance(plan, str) else "explicit", state["prop"], state["seconds"],
    )


def backward_annotations(backward: Fusion, forward: ShardedFusion) -> tuple[dict[str, Placement], dict[str, Placement]]:
    """Input placements and output hints for ``backward`` from its sharded ``forward``."""
    fwd = forward.source
    by_label = {fwd.label(v.name): forward.placement(v.name) for v in fwd.inputs if isinstance(v, TensorValue)}
    produced = {v.name: forward.placement(v.name) for v in fwd.inputs if isinstance(v, TensorValue)}
    produced.update(forward.output_placements())
    user_outputs = [v.name for v in fwd.outputs if fwd.role(v.name) == "output"]
    inputs: dict[str, Placement] = {}
    for v in backward.inputs:
        info = backward.info.get(v.name)
        if info is None or not isinstance(v, TensorValue):
            continue
        if info.role == "parameter" and info.label in by_label:
            inputs[v.name] = by_label[info.label]
        elif info.role == "saved" and info.source in produced:
            inputs[v.name] = produced[info.source]
        elif info.role == "grad" and len(user_outputs) == 1:
            inputs[v.name] = produced[user_outputs[0]]
    hints: dict[str, Placement] = {}
    for v in backward.outputs:
        label = backward.label(v.name)
        if label.startswith("grad(") and label[5:-1] in by_label:
            hints[v.name] = by_label[label[5:-1]]
    return inputs, hints


def shard_backward(backward: Fusion, forward: ShardedFusion, target: str = "nvfuser") -> ShardedFusion:
    """Shard a backward fusion consistently with its sharded forward; its ``plan`` is the forward's
    (the backward's inputs take the placements the forward gave their values, not a plan's)."""
    inputs, hints = backward_annotations(backward, forward)
    sharded = shard(backward, "replicate", forward.mesh, annotations=inputs, output_hints=hints, target=target)
    return replace(sharded, plan=forward.plan)


def shard_pair(forward: Fusion, backward: Fusion | None, plan: str | Mapping[str, Any], mesh: DeviceMesh,
               target: str = "nvfuser") -> tuple[ShardedFusion, ShardedFusion | None]:
    fwd = shard(forward, plan, mesh, target=target)
    bwd = shard_backward(backward, fwd, target) if backward is not None else None
    return fwd, bwd
