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

from nvtp.dump.program_files import write_program
from nvtp.execute import reference
from nvtp.ir.graph import Fusion, TensorValue
from nvtp.report import report_of
from nvtp.sharding.placements import DeviceMesh, FusedParts, Placement, axis_split, local_shape
from nvtp.sharding.propagate import ShardingError
from nvtp.sharding.sharded import ShardedFusion
from nvtp.steps import Step, issued, issued_steps, tensor_steps

@dataclass(frozen=True)
class Source:
    """What the program was made from, as plain data (no tracer object: Thunder's traces and the
    FX binder stay with the runtime that calls the module): the fusions before sharding, the
    route and how it traced, and what the module boundary is."""

    forward: Fusion
    backward: Fusion | None
    route: str  # "thunder", "fx" or "dump"
    how: str  # how the fusions were made ("spliced: ...", "whole trace: <why>", or the file)
    arguments: tuple[str, ...]  # labels of the inputs that are the caller's arguments
    weights: frozenset[str] | None  # labels of the module's parameters (None: every parameter input)
    tied: Mapping[str, str]  # a tied parameter's other names -> its first name
    parts: Mapping[str, Any]  # inputs that are rows of a parameter (label -> nvtp.frontend.fused.Part)
    boundary: bool = True  # a module: outputs and argument gradients whole on the model-parallel axis
    declined: tuple[str, ...] = ()  # attentions not claimed whole for a ring, and why
    seconds: float = 0.0
    layers: Mapping[str, int] = field(default_factory=dict)  # spliced: each forward value a block's copy computes -> its block
    output_tree: Any = None  # the model's output object, each tensor a Leaf naming its output (nvtp.frontend.outputs)
    call: Any = None  # the FX route's nvtp.frontend.fx.Binding: binds a call's arguments, rebuilds the output object (None: Thunder's route)

    def record(self) -> "Source":
        """Itself: a Source may be sharded again (``driver.shard(program.source, ...)``), as a trace is."""
        return self


# Op kinds that a norm, a loss or an activation leaves when no kernel pattern took it (Program.kernels).
_SIGNS_OF_UNFUSED = ("rsqrt", "var_mean", "take_along_axis", "log", "tanh", "erf")


@dataclass(frozen=True)
class Program:
    forward: ShardedFusion
    backward: ShardedFusion | None
    mesh: DeviceMesh
    plan: str
    backend: str  # the backend whose target the passes sharded for (nvtp.execute.backends)
    fsdp: bool
    source: Source  # the fusions before sharding, the route, the module boundary (plain data)
    parameters: dict[str, Any]  # label -> placement of each forward input that is a whole tensor the caller or module holds (parts joined)
    schedules: dict[str, Any] = field(default_factory=dict)  # phase -> nvtp.sharding.overlap.Schedule (empty: collectives block where they stand)
    notes: list[str] = field(default_factory=list)  # the data plan's: weights FSDP leaves whole, and why (the plan's are forward.annotations.notes)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def traced(self) -> Source:
        """The program's ``source`` (the name ``nvtp.jit(...).last.traced.how`` has always read)."""
        return self.source

    # -- what it does ---------------------------------------------------------------------

    def phases(self) -> list[tuple[str, ShardedFusion]]:
        return [("forward", self.forward)] + ([("backward", self.backward)] if self.backward is not None else [])

    def steps(self, communication_only: bool = False) -> list[Step]:
        """Every step of one training step, in the order this rank's backend runs them: each
        collective as the schedule starts it (a bucket one step; ``at`` the op after which it
        starts, ``waits`` where its tensors are needed), each point-to-point exchange of a ring
        (cp's ring attention, a collective matmul) inside the op it belongs to, and the local
        reshards at their ``set``. ``communication_only``: the steps that move data."""
        out = []
        for phase, sharded in self.phases():
            out += issued_steps(phase, sharded, self.schedules.get(phase), communication_only)
        return out

    def communications(self) -> list[Step]:
        """Each tensor a training step moves between ranks, one step per tensor, in run order
        (a bucket's members apart, so each is named with its shape and bytes)."""
        out = []
        for phase, sharded in self.phases():
            out += tensor_steps(phase, sharded, communication_only=True)
        return out

    def collectives(self) -> list[dict[str, Any]]:
        """The communications one training step issues, in the order it starts them, as records:
        {phase, kind, axis, bytes, tensors, at, waits, overlaps_ops} (and ``ring``, ``ring_steps``
        for a collective matmul's steps): ``steps()`` less the local ones."""
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

    def kernels(self, rank: int = 0) -> dict[str, dict[str, dict[str, int]]]:
        """How mesh position ``rank`` runs this program's fusions on the reference backend with
        ``compile="kernels"`` (``nvtp/execute/kernels.py``), per phase: ``"fused"``, each group run
        as one torch kernel by its pattern's name and count; ``"left"``, the ops of norms, losses
        and activations still run one by one (``rsqrt``, ``var_mean``, ``take_along_axis``,
        ``log``, ``tanh``, ``erf``), with their count: a norm or loss written in a way no pattern
        knows runs op by op, slower, and shows here instead of silently. Lowers the fusions anew
        (a fraction of a second each)."""
        out = {}
        for phase, sharded in self.phases():
            lowered = reference.lower_fusion(sharded.fusion, sharded.shardings, sharded.mesh, rank, sharded.mesh.size,
                                             schedule=self.schedules.get(phase))
            left: dict[str, int] = {}
            for node in lowered.module.graph.nodes:
                op = node.meta.get("op")
                if op is not None and op.kind in _SIGNS_OF_UNFUSED:
                    left[op.kind] = left.get(op.kind, 0) + 1
            out[phase] = {"fused": {k: n for k, n in lowered.fused.items() if k != "set"}, "left": left}
        return out

    # -- output -----------------------------------------------------------------------------

    def report(self, model: str = ""):
        """The ``nvtp explain`` report of this program (``nvtp.report.ModelReport``)."""
        return report_of(self, model)

    def as_text(self) -> str:
        return self.report().as_text()

    def write_nvfuser(self, directory: str | os.PathLike, name: str = "program") -> list[Path]:
        """The forward and backward as nvFuser's own Python files in ``directory`` (``<name>_fwd.py``,
        ``<name>_bwd.py``): what the nvFuser backend builds for every rank, with the device schedule
        (``set_device_mesh``, splits, ``ParallelType.mesh_x``) and the resharding ``set`` ops; each
        rank passes its own shards; then each ring step's fusions (a collective matmul, a ring
        attention). nvfuser_direct builds them from their text, anywhere."""
        return write_program(self, directory, name)  # the one writer: nvtp.dump.program_files


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
