"""What a mesh axis's strategy is, the registry of them, and the state the driver's loop hands from one to the next.

    roles(mesh)                  # {"dp": 0, "tp": 1}: each axis name -> its index, the mesh checked
    for s, axis in strategies(mesh): ...   # the mesh's strategies, in the order the driver runs their passes
    batch_axis(mesh)             # the axis whose strategy splits the batch (each rank passes its own), or None

A ``Strategy`` owns everything nvtp knows of one mesh axis: the options it takes, its checks of
the user's input (before any work), the trace options it needs, its forward and backward passes
(each a 1-D sharding of the fusion the previous axis's pass left, over this axis's extent), the
extra communication steps it adds as data (cp's ring), its report terms and its line of ``nvtp
explain``. Nothing outside ``nvtp.sharding.axes`` branches on an axis's name: it asks the mesh's
strategies. A new axis is one module that subclasses ``Strategy`` and calls ``register``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Mapping

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.sharding.placements import DeviceMesh, Placement, axis_split, is_replicate
from nvtp.sharding.propagate import ShardingError
from nvtp.sharding.sharded import ShardedFusion


class MeshError(ShardingError):
    """A mesh nvtp cannot shard over; says what was given and what to pass instead.
    (A ``ShardingError``, so a ``ValueError`` too: bad input, refused before any work.)"""


@dataclass
class AxisPass:
    """The driver's loop over the mesh's strategies, for one phase (forward or backward): what
    every pass is given, and what the passes so far left (``done``: (mesh axis, the 1-D sharded
    fusion of that pass), in run order; each pass shards the fusion the one before it left)."""

    traced: Any  # nvtp.driver.Traced: the fusions, the module boundary
    plan: Any  # the user's plan (a name or a mapping): tp's
    mesh: DeviceMesh
    target: Any  # nvtp.sharding.target.Target
    fsdp: bool = False
    placed: Mapping[str, tuple[Placement, ...]] = field(default_factory=dict)  # forward input -> its sharding, placed already
    output_hints: Mapping[str, Placement] = field(default_factory=dict)  # the module's outputs whole (source names)
    grad_hints: Mapping[str, Placement] = field(default_factory=dict)  # its arguments' gradients whole (backward source names)
    done: list[tuple[int, ShardedFusion]] = field(default_factory=list)
    at_rest: dict[int, dict[str, Placement]] = field(default_factory=dict)  # mesh axis -> weights split at rest on it (forward)
    notes: list[str] = field(default_factory=list)  # what a pass left undone, and why (weights FSDP leaves whole)
    options: Mapping[str, Any] = field(default_factory=dict)  # the axes' own options given (Strategy.options), e.g. ep's capacity_factor

    def current(self, source: Fusion) -> Fusion:
        """The fusion the next pass shards: the last pass's result, or ``source`` before any."""
        return self.done[-1][1].fusion if self.done else source

    def sub(self, axis: int) -> DeviceMesh:
        """The 1-D mesh one pass shards over: the mesh itself when it has one axis (its devices kept)."""
        return self.mesh if self.mesh.ndim == 1 else self.mesh.sub(axis)

    def remap(self, hints: Mapping[str, Placement], source: Fusion) -> dict[str, Placement]:
        """Hints on ``source``'s outputs, keyed by the current fusion's outputs (a pass renames values; outputs keep their order)."""
        fusion = self.current(source)
        if fusion is source:
            return dict(hints)
        return {out.name: hints[src.name] for src, out in zip(source.outputs, fusion.outputs) if src.name in hints}

    def taken(self, name: str) -> set[int]:
        """The tensor dimensions of input ``name`` the passes so far split, at rest or where used."""
        dims = set()
        for axis, s in self.done:
            if name in s.shardings and axis_split(s.shardings[name][0]) is not None:
                dims.add(axis_split(s.shardings[name][0])[0])
        for placed in self.at_rest.values():
            if name in placed and axis_split(placed[name]) is not None:
                dims.add(axis_split(placed[name])[0])
        return dims

    def placed_on(self, axis: int) -> dict[str, Placement]:
        """Inputs placed already, on ``axis`` (a new call shape of a module whose parameters are placed)."""
        return {n: s[axis] for n, s in self.placed.items()}


class Strategy:
    """One mesh axis's meaning. Subclasses set the class attributes and override what their axis does."""

    name: ClassVar[str]  # the mesh axis name that selects it
    summary: ClassVar[str]  # one line: what sharding along it means
    order: ClassVar[int]  # the driver runs the passes of a mesh's strategies by this order
    options: ClassVar[frozenset[str]] = frozenset()  # the options of nvtp.jit / nvtp.plan only this axis uses
    # options a mesh with this axis does not honour: option -> why, and what to do instead (refused by nvtp.options)
    refuses: ClassVar[Mapping[str, str]] = {}
    splits_batch: ClassVar[bool] = False  # each rank passes its own batch (the program is traced for the whole)
    runs_plan: ClassVar[bool] = False  # the user's plan (megatron, megatron-sp, explicit) shards along it
    cuts_stages: ClassVar[bool] = False  # the model is cut into stages along it, before any pass (a pipeline)
    backends: ClassVar[frozenset[str] | None] = None  # backends that run it (None: every one)
    crosses_nodes: ClassVar[bool] = False  # placed outermost, it crosses the slower link first (data parallel)
    layout: ClassVar[int] = 0  # where the planner (nvtp.auto) puts the axis in a mesh: smaller is outer (Megatron's pp, dp, cp, tp)

    # -- before any work --------------------------------------------------------------------

    def check(self, mesh: DeviceMesh, axis: int, *, fsdp: bool = False) -> None:
        """Refuse, naming the fix, a mesh or options this axis cannot take (before anything is traced)."""

    def check_arguments(self, mesh: DeviceMesh, axis: int, arguments: list[tuple[str, Any]]) -> None:
        """Refuse, before tracing, a call's arguments ((name, tensor), in order) this axis cannot
        split, as their shapes already tell (``nvtp.precheck``)."""

    def trace_options(self, mesh: DeviceMesh, axis: int, plan: Any) -> dict[str, Any]:
        """Options of ``nvtp.driver.trace`` this axis needs (``batch``, ``ring``, ``split_parts``)."""
        return {}

    def check_traced(self, traced: Any, mesh: DeviceMesh, axis: int, fsdp: bool) -> None:
        """Refuse, before any sharding, a traced model this axis cannot shard."""

    # -- the passes -------------------------------------------------------------------------

    def forward(self, run: AxisPass, axis: int) -> ShardedFusion:
        raise NotImplementedError(f"the {self.name!r} axis has no forward pass")

    def backward(self, run: AxisPass, axis: int, forward: ShardedFusion) -> ShardedFusion:
        raise NotImplementedError(f"the {self.name!r} axis has no backward pass")

    # -- what it adds to the program and the report -----------------------------------------

    def changes_result(self, options: Mapping[str, Any]) -> str:
        """Why a program planned with ``options`` (``ShardedFusion.options``) computes, by design,
        something else than the model run eagerly ('' when it does not): ``nvtp.guard`` says so
        instead of comparing."""
        return ""

    def extra_steps(self, phase: str, sharded: ShardedFusion, axis: int) -> list[dict[str, Any]]:
        """Communication this axis runs beside the ``set`` ops (a ring's point-to-point steps), as
        records: {kind, tensor, label, shape, dtype, bytes, position (the op's index), src, dst}."""
        return []

    def headline(self, report: Any, axis: int) -> str:
        """This axis's part of the first line of ``nvtp explain`` (e.g. "plan megatron on tp")."""
        return f"{self.name} {report.mesh.shape[axis]}"

    def report_lines(self, report: Any, axis: int) -> list[str]:
        """This axis's own lines of ``nvtp explain`` (dp's bytes against DDP's and FSDP's formulas)."""
        return []

    def report_json(self, report: Any, axis: int) -> dict[str, Any]:
        return {}

    def runs_on(self, backend: str) -> bool:
        return self.backends is None or backend in self.backends

    # -- what the planner asks (nvtp.auto): extents, options, cost and memory terms ---------------
    # ``facts`` is an ``nvtp.auto.facts.Facts``: the model's batch, sequence, blocks, the backend, the machine.
    # ``extents`` maps each axis name to its extent in the candidate (1 for an axis it lacks).

    def refuse(self, extent: int, facts: Any) -> str | None:
        """Why this axis cannot span ``extent`` (> 1) devices for the model and machine of
        ``facts``, in the user's terms; None when it can."""
        if not self.runs_on(facts.backend):
            return f"the {facts.backend} backend does not run the {self.name!r} axis ({self.summary})"
        return None

    def choices(self, extent: int, extents: Mapping[str, int], facts: Any) -> list[dict[str, Any]]:
        """The options of this axis the planner tries at ``extent`` (keyword arguments of
        ``nvtp.jit`` / ``nvtp.driver.shard``); [{}] when it has none to choose."""
        return [{}]

    def conflicts(self, extents: Mapping[str, int], options: Mapping[str, Any], facts: Any) -> str | None:
        """Why this axis, at its extent, cannot go with the rest of a candidate (None: it can)."""
        return None

    def cost_terms(self, costed: Any) -> dict[str, float]:
        """This axis's terms of a candidate's step time (seconds, ``nvtp.auto.costing.Costed``): by
        default what the step waits for this axis's collectives, the schedule having hidden the rest."""
        return {f"{self.name} communication": costed.waited(self.name)}

    def memory_label(self, kind: str, parameter: bool) -> str | None:
        """The name of what a collective on this axis holds at run time (``nvtp.auto.memory``), a
        term of a candidate's memory: ``kind`` a reshard step ("allreduce", "allgather",
        "reduce_scatter") for its buffers, or "<step> result" for the value it makes (None: an
        ordinary value); ``parameter``: it gathers a weight. Names start with the axis's name."""
        return None if kind.endswith(" result") else f"{self.name}: {kind.replace('_', '-')} buffers"

    def memory_terms(self, costed: Any) -> dict[str, float]:
        """This axis's terms of a candidate's memory per rank (bytes), for the report: what it
        holds at the fullest moment (its collectives' buffers, ``memory_label``)."""
        return {k: v for k, v in costed.memory.items() if k.startswith(f"{self.name}:")}


AXES: dict[str, Strategy] = {}


def register(strategy: type[Strategy]) -> type[Strategy]:
    """Class decorator: the strategy selected by mesh axes named ``strategy.name``."""
    AXES[strategy.name] = strategy()
    return strategy


def known() -> str:
    """Every axis name nvtp knows, with what it means (for error messages)."""
    return ", ".join(f"{s.name!r} ({s.summary})" for s in sorted(AXES.values(), key=lambda s: s.order))


def roles(mesh: DeviceMesh, *, stages: bool = False) -> dict[str, int]:
    """Each axis name -> its index. Raises ``MeshError`` for a name nvtp does not know, a name
    twice, or (``stages`` False) an axis that cuts the model into stages, which only the
    pipeline's driver takes (``nvtp.driver.compile_pipeline``)."""
    unknown = [n for n in mesh.names if n not in AXES]
    if unknown:
        raise MeshError(f"mesh axis name(s) {unknown} mean nothing to nvtp (mesh {list(mesh.names)} of shape {list(mesh.shape)}); "
                        f"name each axis for its strategy: {known()}")
    cutting = [n for n in mesh.names if AXES[n].cuts_stages]
    if cutting and not stages:
        raise MeshError(f"a mesh with a {cutting[0]!r} axis ({list(mesh.names)}) is a pipeline: pass it to nvtp.jit(model, mesh=mesh, "
                        "microbatches=M), nvtp.plan(model, *args, mesh=mesh) or nvtp explain --mesh PPxDPxTP, which cut the model "
                        "into stages and shard each over the rest of the mesh")
    return {n: i for i, n in enumerate(mesh.names)}


def strategies(mesh: DeviceMesh) -> list[tuple[Strategy, int]]:
    """(strategy, mesh axis) of each axis, in the order the driver runs their passes."""
    roles(mesh, stages=True)
    return sorted(((AXES[n], i) for i, n in enumerate(mesh.names)), key=lambda sa: sa[0].order)


def passes(mesh: DeviceMesh) -> list[tuple[Strategy, int]]:
    """``strategies`` less those that cut stages: the sharding passes of a mesh (or a stage's)."""
    return [(s, a) for s, a in strategies(mesh) if not s.cuts_stages]


def find(mesh: DeviceMesh, attribute: str) -> int | None:
    """The mesh axis whose strategy has ``attribute`` true (e.g. "splits_batch"), or None."""
    return next((a for s, a in strategies(mesh) if getattr(s, attribute)), None)


def extent(mesh: DeviceMesh, attribute: str) -> int:
    """The extent of the axis whose strategy has ``attribute`` (1 without one)."""
    axis = find(mesh, attribute)
    return 1 if axis is None else mesh.shape[axis]


def plain(mesh: DeviceMesh) -> bool:
    """Whether ``mesh`` is a plain 1-D mesh (``DeviceMesh.of_size``'s axis), reported as a count of devices."""
    return mesh.names == DeviceMesh.of_size(mesh.size).names


def batch_axis(mesh: DeviceMesh) -> int | None:
    """The axis that splits the batch: each rank passes its own batch (None: every rank the whole)."""
    return find(mesh, "splits_batch")


def stage_axis(mesh: Any) -> int | None:
    """The axis that cuts the model into pipeline stages, of anything with mesh axis names."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or getattr(mesh, "names", None) or ())
    return next((i for i, n in enumerate(names) if n in AXES and AXES[n].cuts_stages), None)


def trace_options(mesh: DeviceMesh, plan: Any) -> dict[str, Any]:
    """What ``nvtp.driver.trace`` needs for ``mesh``: each strategy's options, merged."""
    out: dict[str, Any] = {"batch": 1, "ring": False, "split_parts": False}
    for s, axis in passes(mesh):
        for k, v in s.trace_options(mesh, axis, plan).items():
            out[k] = out[k] * v if k == "batch" else v
    if len(passes(mesh)) > 1:  # a fused projection's parts are split only on a mesh of one sharding axis
        out["split_parts"] = False
    return out


def check(mesh: DeviceMesh, *, fsdp: bool = False, backend: str | None = None) -> None:
    """Every strategy's checks of the mesh and options, before any work."""
    for s, axis in strategies(mesh):
        s.check(mesh, axis, fsdp=fsdp)
        if backend is not None and not s.runs_on(backend):
            raise MeshError(f"backend={backend!r} does not run the {s.name!r} axis ({s.summary}); "
                            f"use backend={sorted(s.backends)[0]!r} (docs/usage.md)")
    if fsdp and batch_axis(mesh) is None:
        data = next((s.name for s in AXES.values() if s.splits_batch), "a data-parallel axis")
        raise MeshError(f"fsdp=True shards weights over a data-parallel axis ({data!r}); the mesh {list(mesh.names)} has none: "
                        f"add one, e.g. init_device_mesh(device, (dp, tp), mesh_dim_names=({data!r}, 'tp')) "
                        "(on the command line --mesh DPxTP --fsdp), or pass fsdp=False")


def spelled(ndim: int) -> tuple[str, ...]:
    """The axis names of a mesh spelt by its shape alone (``--mesh 2x2``, ``mesh=(2, 2)``):
    (tp,), (dp, tp), (pp, dp, tp): Megatron's order, the fastest axis last."""
    names = {1: ("tp",), 2: ("dp", "tp"), 3: ("pp", "dp", "tp")}
    if ndim not in names:
        raise MeshError(f"a mesh spelt by its shape has 1 to 3 axes (TP, DPxTP, PPxDPxTP); name the axes of a {ndim}-D mesh: "
                        f"{known()}")
    return names[ndim]


def axis_sizes(mesh: DeviceMesh) -> dict[str, int]:
    """Each axis name -> its extent (1 for an axis nvtp knows that the mesh lacks)."""
    return {n: (mesh.shape[mesh.names.index(n)] if n in mesh.names else 1) for n in AXES}


def data_mode(fsdp: bool) -> str:
    """How the data axis holds the weights: "fsdp" (split at rest) or "ddp" (whole)."""
    return "fsdp" if fsdp else "ddp"


def whole_at_rest(sharding: Any) -> bool:
    """Whether a sharding (one placement, or one per axis) leaves the tensor whole on every rank."""
    return all(is_replicate(p) for p in sharding) if isinstance(sharding, tuple) else is_replicate(sharding)


def inputs_of(fusion: Fusion, role: str) -> Iterator[TensorValue]:
    return (v for v in fusion.inputs if isinstance(v, TensorValue) and fusion.role(v.name) == role)
