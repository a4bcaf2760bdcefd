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
from dataclasses import replace
from typing import Any, Callable, Mapping, TypeVar

from nvtp.gcpause import paused
from nvtp.ir.graph import Fusion, TensorValue
from nvtp.ir.verify import verify
from nvtp.sharding import plans as plans_mod
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Placement, is_partial
from nvtp.sharding.propagate import Propagation, ShardingError, check_annotations, implied, propagate_shardings
from nvtp.sharding.reshard import hoist_gathers, insert_reshards, plan_reshards
from nvtp.sharding.rules import factors_of, tensor_operands
from nvtp.sharding.sharded import ShardedFusion
from nvtp.sharding.target import Target, as_target

T = TypeVar("T")


class PassError(RuntimeError):
    pass


class Passes:
    """Runs named passes in order: ``run("propagate", fn, *args)`` returns ``fn(*args)``, records
    its wall time in ``seconds`` and re-raises a failure (other than a ``ShardingError``, which
    already says what to fix) as ``PassError("in pass X after [a, b]: ...")``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except ShardingError:
            raise
        except Exception as e:
            raise PassError(f"in pass {name} after [{', '.join(self.seconds)}]: {type(e).__name__}: {e}") from e
        self.seconds[name] = time.perf_counter() - start
        return result


def annotate(fusion: Fusion, plan: str | Mapping[str, Any], mesh: DeviceMesh, target: str | Target = "nvfuser",
             overrides: Mapping[str, Placement] | None = None) -> plans_mod.Annotations:
    """Apply ``plan`` (a plan name, an explicit glob plan, or a per-input plan) to ``fusion``, then
    ``overrides`` (input name -> placement); checked against the fusion and mesh.

    The Megatron plans split embedding tables along the vocabulary only for a target that holds
    the partial sum a vocabulary-parallel lookup gives (``Target.vocab_parallel``: the reference
    backend; nvFuser keeps partial sums only on reduction axes)."""
    target = as_target(target)
    if plan in ("megatron", "megatron-sp"):
        ann = plans_mod.megatron(fusion, mesh, sequence_parallel=plan == "megatron-sp", vocab_parallel=target.vocab_parallel,
                                 split_experts=target.split_experts)
    elif plan in ("replicate", "none"):
        ann = plans_mod.Annotations({v.name: REPLICATE for v in fusion.inputs if isinstance(v, TensorValue)})
    else:
        plan = plans_mod.parse_plan_text(plan) if isinstance(plan, str) else plan
        per_input = plan and all(k in {v.name for v in fusion.inputs} for k in plan)
        ann = plans_mod.per_input(fusion, plan) if per_input else plans_mod.explicit(fusion, mesh, plan)
    ann.placements.update(overrides or {})
    check_annotations(fusion, mesh, ann.placements)
    return ann


def verify_sharded(fusion: Fusion, source: Fusion, shardings: Mapping[str, tuple[Placement, ...]], prop: Propagation) -> None:
    """``fusion`` verifies, every op reads each operand in the placement its decision needs, results
    are where the decision puts them, and no output is a partial sum: the reshard passes' wiring."""
    verify(fusion)
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


def shard(fusion: Fusion, plan: str | Mapping[str, Any], mesh: DeviceMesh, *,
          annotations: Mapping[str, Placement] | None = None, output_hints: Mapping[str, Placement] | None = None,
          check: bool = True, target: str | Target = "nvfuser", at_rest: Mapping[str, Placement] | None = None,
          hoist: bool = True, keep_splits: bool = False) -> ShardedFusion:
    """Shard ``fusion`` over ``mesh`` following ``plan``.

    ``annotations`` (input name -> placement) override the plan's, e.g. a backward fusion's saved
    inputs placed as their forward values are. Raises ``ShardingError`` before any work when the
    plan does not fit the fusion or mesh. ``target`` (a ``Target``, or the name of the backend
    that owns it) says what the machine holds: nvFuser's resolves partial sums where they are
    produced; the reference backend's lets them flow through linear ops.
    ``at_rest`` (input name -> placement) places inputs differently from where propagation used
    them, so each gets a ``set`` before its consumers: FSDP's weight all-gather on a dp axis.
    """
    target = as_target(target)
    with paused():  # the collector walking the fusions was 30% of the passes on a deep model
        return _shard(fusion, plan, mesh, annotations, output_hints, check, target, at_rest, hoist, keep_splits)


def _shard(fusion: Fusion, plan: str | Mapping[str, Any], mesh: DeviceMesh, annotations: Mapping[str, Placement] | None,
           output_hints: Mapping[str, Placement] | None, check: bool, target: Target, at_rest: Mapping[str, Placement] | None,
           hoist: bool, keep_splits: bool) -> ShardedFusion:
    run = Passes()
    ann = run("annotate", annotate, fusion, plan, mesh, target, annotations)
    prop = run("propagate", propagate_shardings, fusion, mesh, ann.placements, {**ann.hints, **(output_hints or {})},
               partial_pass=target.partial_through_linear, keep_splits=keep_splits)
    if at_rest:
        check_annotations(fusion, mesh, dict(at_rest))
        prop.placements.update(at_rest)
    steps = run("plan_reshards", plan_reshards, fusion, prop, mesh, dict(output_hints or {}))
    sharded, placements, set_steps, _ = run("insert_reshards", insert_reshards, fusion, prop, steps)
    if hoist:
        sharded, placements, set_steps = run("hoist_gathers", hoist_gathers, sharded, placements, set_steps, mesh)
    shardings = {k: (p,) for k, p in placements.items()}
    if check:
        run("verify", verify_sharded, sharded, fusion, shardings, prop)
    return ShardedFusion(sharded, fusion, mesh, shardings, set_steps, ann,
                         plan if isinstance(plan, str) else "explicit", prop, run.seconds)


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
        elif info.role == "grad" and info.source in produced:  # several outputs: each gradient placed as its output
            inputs[v.name] = produced[info.source]
    hints = {v.name: by_label[backward.grad_of(v.name)] for v in backward.outputs if backward.grad_of(v.name) in by_label}
    return inputs, hints


def shard_backward(backward: Fusion, forward: ShardedFusion, target: str | Target = "nvfuser") -> ShardedFusion:
    """Shard a backward fusion consistently with its sharded forward; its ``plan`` is the forward's
    (the backward's inputs take the placements the forward gave their values, not a plan's)."""
    inputs, hints = backward_annotations(backward, forward)
    sharded = shard(backward, "replicate", forward.mesh, annotations=inputs, output_hints=hints, target=target)
    return replace(sharded, plan=forward.plan)


def shard_pair(forward: Fusion, backward: Fusion | None, plan: str | Mapping[str, Any], mesh: DeviceMesh,
               target: str | Target = "nvfuser") -> tuple[ShardedFusion, ShardedFusion | None]:
    fwd = shard(forward, plan, mesh, target=target)
    bwd = shard_backward(backward, fwd, target) if backward is not None else None
    return fwd, bwd
