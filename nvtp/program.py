"""``Program``: what the compile driver returns, and what every backend runs and every report prints.

    program = nvtp.driver.compile(model, idx, targets, plan="megatron", mesh=4)
    program.parameters["h.0.attn.c_attn.weight"]   # its placement (FusedShard parts, per mesh axis on n-D meshes)
    program.steps()                                # every reshard step in run order: phase, kind, axis, tensor, bytes
    print(program.as_text())                       # what nvtp explain prints (nvtp.explain.report_of)
    program.write_nvfuser("out/")                  # the forward and backward as nvFuser's own Python files

Plain data: the sharded forward and backward fusions (``ShardedFusion``: every value's placement
per mesh axis, the ``set`` ops with their ``ReshardStep``), the mesh, the plan, the backend whose
target it was sharded for, the parameters' placements and how the model was traced. A backend
(``nvtp.execute.backends``) runs exactly these steps; ``nvtp.plan`` reports exactly these; so
what is planned is what runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from nvtp.ir.graph import TensorValue
from nvtp.sharding import axes
from nvtp.sharding.axes.ring import write_ring_steps
from nvtp.sharding.placements import DeviceMesh, FusedParts, Placement, axis_split, local_shape
from nvtp.sharding.propagate import ShardingError
from nvtp.sharding.sharded import ShardedFusion

# Steps that are no reshard of a value but move data all the same: a ring's exchange (sendrecv),
# a pipeline's transfers (send, recv), a tied weight's broadcast and gradient reduction, the loss's broadcast.
POINT_TO_POINT = ("sendrecv", "send", "recv", "broadcast", "reduce")


@dataclass(frozen=True)
class Step:
    """One reshard of a training step, as the program runs it."""

    phase: str  # "forward" or "backward"
    kind: str  # allreduce, allgather, reduce_scatter, sendrecv (cp), send / recv / broadcast / reduce (pp); slice, partition (local)
    axis: str  # the mesh axis's name: its process group runs it
    value: str  # the value it reshards (the sharded fusion's name)
    tensor: str  # its label where it has one (a parameter, an argument), else the value's name
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # what each rank sends with ring algorithms (0 for local steps)
    src: str
    dst: str

    @property
    def is_communication(self) -> bool:
        from nvtp.sharding.reshard import COLLECTIVES

        return (self.kind in COLLECTIVES or self.kind in POINT_TO_POINT) and self.bytes > 0


@dataclass
class Program:
    forward: ShardedFusion
    backward: ShardedFusion | None
    mesh: DeviceMesh
    plan: str
    backend: str  # the backend whose target the passes sharded for (nvtp.execute.backends)
    fsdp: bool
    traced: "Traced"  # nvtp.driver.Traced: the fusions before sharding, the route, the module boundary
    parameters: dict[str, Any]  # label -> placement of each forward input that is a whole tensor the caller or module holds (parts joined)
    schedules: dict[str, Any] = field(default_factory=dict)  # phase -> nvtp.sharding.overlap.Schedule (empty: collectives block where they stand)
    notes: list[str] = field(default_factory=list)  # the data plan's: weights FSDP leaves whole, and why (the plan's are forward.annotations.notes)
    seconds: dict[str, float] = field(default_factory=dict)

    # -- what it does ---------------------------------------------------------------------

    def phases(self) -> list[tuple[str, ShardedFusion]]:
        return [("forward", self.forward)] + ([("backward", self.backward)] if self.backward is not None else [])

    def steps(self, communication_only: bool = False) -> list[Step]:
        """Every reshard step of one training step, in the order the fusions run them."""
        out = []
        for phase, sharded in self.phases():
            order = {op.outputs[0].name: i for i, op in enumerate(sharded.fusion.ops) if op.outputs}
            ordered = []
            for result, step in sharded.set_steps.items():
                if communication_only and not step.is_communication:
                    continue
                src = sharded.source
                v = src.value(step.value) if step.value in src.values else sharded.fusion.value(step.value)
                label = src.label(step.value) if step.value in src.info else ""
                ordered.append((order.get(result, 0), Step(phase, step.kind, self.mesh.names[step.axis], step.value, label or step.value,
                                                           tuple(v.shape), v.dtype.value, step.bytes if step.is_communication else 0,
                                                           str(step.src), str(step.dst))))
            for s, axis in axes.passes(self.mesh):  # what an axis runs beside the set ops (cp's ring attention)
                for r in s.extra_steps(phase, sharded, axis):
                    if communication_only and not r["bytes"]:
                        continue
                    ordered.append((r["position"], Step(phase, r["kind"], self.mesh.names[axis], r["value"], r["part"],
                                                        tuple(r["shape"]), r["dtype"], r["bytes"], r["from"], r["to"])))
            out += [s for _, s in sorted(ordered, key=lambda x: x[0])]
        return out

    def communications(self) -> list[Step]:
        """The steps that move data between ranks, in run order."""
        return self.steps(communication_only=True)

    def collectives(self) -> list[dict[str, Any]]:
        """The collectives one training step issues, in the order it starts them: one per bucket
        of the schedule (``nvtp.sharding.overlap``), or one per communication step unscheduled."""
        return issued(self.phases(), self.schedules)

    def parameter_bytes(self) -> int:
        """Bytes of parameters one rank holds (each tied parameter once)."""
        return sum(n for _, n in self.parameter_shares())

    def parameter_shares(self) -> list[tuple[str, int]]:
        """(label, bytes this rank holds) of each module parameter, tied ones once."""
        f = self.forward.source
        tied = self.traced.tied
        seen, out = set(), []
        for v in f.inputs:
            if not isinstance(v, TensorValue) or f.role(v.name) != "parameter":
                continue
            label = tied.get(f.label(v.name), f.label(v.name))
            weights = self.traced.weights  # the module's parameters: not its buffers, not folded constants
            if weights is not None and label not in weights and label.split("[", 1)[0] not in weights:
                continue
            if label in seen:
                continue
            seen.add(label)
            out.append((label, _numel(local_shape(v.shape, self.forward.shardings[v.name], self.mesh)) * v.dtype.itemsize))
        return out

    # -- output -----------------------------------------------------------------------------

    def report(self, model: str = ""):
        """The ``nvtp explain`` report of this program (``nvtp.report.ModelReport``)."""
        from nvtp.report import report_of

        return report_of(self, model)

    def as_text(self) -> str:
        return self.report().as_text()

    def write_nvfuser(self, directory: str | os.PathLike, name: str = "program") -> list[Path]:
        """The forward and backward as nvFuser's own Python files in ``directory`` (``<name>_fwd.py``,
        ``<name>_bwd.py``): what the nvFuser backend builds for every rank, with the device schedule
        (``set_device_mesh``, splits, ``ParallelType.mesh_x``) and the resharding ``set`` ops; each
        rank passes its own shards. nvfuser_direct builds them from their text, anywhere."""
        from nvtp.dump.sharded import write_sharded
        from nvtp.sharding.schedule import ScheduleError

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        data = axes.data_mode(self.fsdp) if self.mesh.ndim > 1 else None
        for phase, sharded in self.phases():
            path = out / f"{name}_{'fwd' if phase == 'forward' else 'bwd'}.py"
            command = f"nvtp.jit(model, plan={self.plan!r}, backend={self.backend!r}).program.write_nvfuser({str(directory)!r})"
            try:
                paths.append(write_sharded(sharded, path, command, data=data))
            except ScheduleError as e:
                if self.backend == "nvfuser":
                    raise
                raise ScheduleError(f"this program was sharded for the {self.backend} backend's target, whose placements "
                                    f"nvFuser's device schedule cannot always express ({e}); write the program nvFuser would run: "
                                    "nvtp.plan(..., backend='nvfuser') or nvtp.driver.compile(..., backend='nvfuser')") from e
        paths += write_ring_steps(self.forward, out, name)  # a ring attention's per-step fusions (a cp axis), if any
        for phase, sharded in self.phases():  # collective matmuls, as nvFuser's stream-parallel schedule writes them
            rings = list(getattr(self.schedules.get(phase), "rings", ()))
            if rings:
                from nvtp.sharding.collective_matmul import write_collective_matmuls

                paths += write_collective_matmuls(sharded, rings, out, f"{name}_{'fwd' if phase == 'forward' else 'bwd'}")
        return paths


def issued(phases, schedules: Mapping[str, Any]) -> list[dict[str, Any]]:
    """(phase, sharded fusion) pairs and their schedules -> the collectives as started:
    {phase, kind, axis, bytes, tensors, at, waits}, ``at`` the op after which it starts."""
    out = []
    for phase, sharded in phases:
        schedule = schedules.get(phase)
        names = sharded.mesh.names
        if schedule is not None:
            started = [{"phase": phase, "kind": i.kind, "axis": names[i.axis], "bytes": i.bytes, "tensors": list(i.sets),
                        "at": i.at, "waits": list(i.waits), "overlaps_ops": min(i.waits) - i.at - 1} for i in schedule.issues]
            for r in schedule.rings:  # a collective matmul: its point-to-point steps, each beside a block's matmuls
                started += [{"phase": phase, "kind": "sendrecv", "axis": names[r.axis], "bytes": r.step_bytes, "tensors": [r.name],
                             "at": r.at - 1, "waits": [r.at], "overlaps_ops": len(r.linears), "ring": r.kind, "ring_steps": r.steps}
                            for _ in range(r.steps)]
            out += sorted(started, key=lambda c: c["at"])
            continue
        order = {op.outputs[0].name: k for k, op in enumerate(sharded.fusion.ops) if op.outputs}
        for name, step in sorted(sharded.set_steps.items(), key=lambda kv: order.get(kv[0], 0)):
            if step.is_communication:
                out.append({"phase": phase, "kind": step.kind, "axis": names[step.axis], "bytes": step.bytes, "tensors": [name],
                            "at": order[name] - 1, "waits": [order[name]], "overlaps_ops": 0})
    return out


def join_parts(placed: Sequence[tuple[str, Any]], parts: Mapping[str, Any], mesh: DeviceMesh) -> dict[str, Any]:
    """label -> placement of each input, the parts of one fused parameter (``parts``: label ->
    ``nvtp.frontend.fused.Part``) joined into the parameter, placed ``FusedParts``."""
    out: dict[str, Any] = {}
    joined: dict[str, list] = {}
    for label, placement in placed:
        part = parts.get(label)
        if part is None:
            out.setdefault(label, placement)
            continue
        split = axis_split(placement) if not isinstance(placement, tuple) else None
        if isinstance(placement, tuple) or (split is not None and split[0] != 0):
            raise ShardingError(f"{label}: a part of a fused projection's weight placed {placement}; nvtp holds such parts split "
                                "along their rows (output features) or whole: plan it colwise or replicated")
        if part.weight not in joined:
            joined[part.weight] = []
            out[part.weight] = None
        joined[part.weight].append((part.start, part.stop, placement))
    for weight, pieces in joined.items():
        out[weight] = FusedParts(0, tuple(sorted(pieces)))
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


__all__ = ["Program", "Step", "join_parts", "Placement"]
