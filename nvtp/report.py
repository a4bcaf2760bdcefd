"""What ``nvtp explain`` prints of a whole model: its shardings, every communication, the memory per rank.

    report = report_of(program, "GPT")          # a Program of the compile driver (nvtp.program)
    print(report.as_text()); report.as_json()

A model is a list of *regions*, each a forward and a backward fusion sharded on the mesh and run
``count`` times per step: one region for a program of the whole model (``report_of``), or the
model without its blocks and one block counted ``layers`` times (``nvtp.explain.explain_gpt``).

Memory per rank (bytes; each tensor's local part under all its mesh axes' placements):

* ``parameters``: each parameter's local shard, in its dtype (a tied parameter once).
* ``gradients``: one gradient per parameter, local, in the parameter's dtype.
* ``optimizer``: Adam's two moments in fp32, plus an fp32 master copy when the parameters are
  16-bit (Megatron's mixed precision): 12 bytes per local element for bf16/fp16, 8 for fp32.
* ``activations``: what the forward fusions save for backward (their outputs other than the
  model's result), local: the figure Korthikanti et al. count per layer.
* ``peak_activations``: the largest live set of the forward pass by liveness of the fusions'
  values (a value lives from its op to its last use; saved values to the end): all earlier
  layers' saved values plus the peak inside the region being run.
"""


from __future__ import annotations

import collections

import re
from dataclasses import dataclass, field
from typing import Any, Sequence


from nvtp.ir.graph import Fusion, TensorValue
from nvtp.sharding.sharded import ShardedFusion
from nvtp.sharding.placements import DeviceMesh, axis_split, local_shape
from nvtp.sharding import axes
from nvtp.sharding.cost import exposure
from nvtp.sharding.moe import summary as moe_summary
from nvtp.sharding.report import communication_records, size_text
from nvtp.steps import issued


@dataclass
class Region:
    """A part of the model: its sharded forward and backward, run ``count`` times a step."""

    name: str
    count: int
    forward: ShardedFusion
    backward: ShardedFusion | None
    schedules: dict[str, Any] = field(default_factory=dict)  # phase -> nvtp.sharding.overlap.Schedule (empty: unscheduled)


@dataclass
class ModelReport:
    model: str
    plan: str
    devices: int
    regions: list[Region]
    seconds: dict[str, float] = field(default_factory=dict)
    shape: dict[str, int] = field(default_factory=dict)  # s, b, h, a, t, L for the formula (nvtp's GPT, a transformers config)
    mesh: DeviceMesh | None = None  # None: a 1-D mesh of ``devices``; else the (dp, tp) mesh
    data: str = ""  # on a 2-D mesh: "ddp" or "fsdp"
    weights: frozenset[str] | None = None  # labels of the parameters FSDP may split (None: every parameter)
    batch: str = ""  # how the traced batch relates to a rank's (2-D meshes)
    notes: list[str] = field(default_factory=list)  # the data plan's (weights FSDP leaves whole, and why)
    how: str = ""  # how the fusions were traced (nvtp.frontend.regional's Captured.regional)
    backend: str = "nvfuser"  # the backend whose target the program was sharded for (nvtp.execute.backends)
    machine: Any = None  # an nvtp.sharding.cost.Machine: estimate what the schedule hides on it
    tied: dict[str, str] = field(default_factory=dict)  # a tied parameter's other names -> its first (counted once)
    layers: dict[str, int] = field(default_factory=dict)  # a spliced program: each forward value a block's copy computes -> its block
    expert_load: list[Any] = field(default_factory=list)  # per MoE layer, the example batch's tokens per expert (nvtp.execute.expert_load)
    expert_load_note: str = ""  # how the example batch was counted, or why it was not

    # -- communications -------------------------------------------------------------------

    def communications(self) -> list[dict[str, Any]]:
        """Every collective of one training step, in order: {kind, tensor, shape, dtype, bytes,
        phase, region, layer}; a repeated region's collectives once per layer."""
        out = []
        for phase, r, sharded, layers in self._in_step_order():
            records = communication_records(sharded)
            names = [sharded.mesh.names[step.axis] for step in sharded.communications]
            for st, axis in axes.passes(sharded.mesh):  # what an axis runs beside the set ops (cp's ring attention)
                extra = st.extra_steps(phase, sharded, axis)
                records, names = records + extra, names + [sharded.mesh.names[axis]] * len(extra)
            for layer in layers:
                for c, axis in zip(records, names):
                    tensor = c["label"] or c["tensor"]
                    out.append({"kind": c["kind"], "tensor": tensor if layer is None else f"{r.name}.{layer}/{tensor}",
                                "shape": c["shape"], "dtype": c["dtype"], "bytes": c["bytes"], "phase": phase,
                                "axis": axis, "region": r.name, "layer": layer})
        return out

    def _in_step_order(self):
        """(phase, region, its sharded fusion, its layers) as a step runs them: the forward's
        regions in order, the backward's reversed; layers None for a region run once."""
        for phase in ("forward", "backward"):
            for r in (self.regions if phase == "forward" else list(reversed(self.regions))):
                sharded = r.forward if phase == "forward" else r.backward
                if sharded is None:
                    continue
                layers = range(r.count) if phase == "forward" else reversed(range(r.count))
                yield phase, r, sharded, (layers if r.count > 1 else [None])

    def collectives(self) -> list[dict[str, Any]]:
        """The collectives one step issues, as started (buckets of the schedule are one each):
        {phase, kind, axis, bytes, tensors, at, waits, region, layer}; what ``communications``
        lists per tensor, grouped as the backend runs it."""
        out = []
        for phase, r, sharded, layers in self._in_step_order():
            for layer in layers:
                out += [c | {"region": r.name, "layer": layer} for c in issued([(phase, sharded)], r.schedules)]
        return out

    def schedule_summary(self) -> dict[str, Any]:
        """Under ``self.machine``: per phase the ops' time, the collectives' own time, and what the
        step still waits for them, scheduled and blocking (seconds; a repeated region counted
        ``count`` times), and the fraction the schedule hides."""
        out: dict[str, Any] = {"machine": self.machine.name, "describe": self.machine.describe}
        for phase in ("forward", "backward"):
            total = {"compute": 0.0, "communication": 0.0, "exposed": 0.0, "exposed_blocking": 0.0}
            for r in self.regions:
                sharded = r.forward if phase == "forward" else r.backward
                if sharded is None:
                    continue
                e = exposure(sharded, r.schedules.get(phase), self.machine)
                total["compute"] += r.count * e.compute
                total["communication"] += r.count * e.ideal
                total["exposed"] += r.count * e.exposed
                total["exposed_blocking"] += r.count * e.blocking_exposed
            total["hidden"] = 0.0 if not total["communication"] else 1 - total["exposed"] / total["communication"]
            out[phase] = total
        return out

    # -- memory ---------------------------------------------------------------------------

    def memory_per_rank(self) -> dict[str, int]:
        params = grads = optimizer = 0
        for r, v, _ in self.parameters():
            n = _numel(local_shape(v.shape, r.forward.shardings[v.name], r.forward.mesh))
            params += r.count * n * v.dtype.itemsize
            grads += r.count * n * v.dtype.itemsize
            optimizer += r.count * n * (12 if v.dtype.itemsize < 4 else 8)
        saved = [sum(_saved_bytes(r.forward, r.backward)) for r in self.regions]
        activations = sum(r.count * s for r, s in zip(self.regions, saved))
        peak = 0
        for r, s in zip(self.regions, saved):  # each region's own peak on top of everything else saved
            others = activations - s
            peak = max(peak, others + _peak_bytes(r.forward))
        return {"parameters": params, "gradients": grads, "optimizer": optimizer, "activations": activations,
                "peak_activations": peak, "total": params + grads + optimizer + peak}

    def parameters(self):
        """(region, forward input, label) of each parameter once (a tied weight is one parameter;
        buffers and folded constants, inputs too, are not parameters where the module's are known)."""
        seen: set[str] = set()
        for r in self.regions:
            f = r.forward.source
            for v in f.inputs:
                if not isinstance(v, TensorValue) or f.role(v.name) != "parameter":
                    continue
                if not _is_weight(f.label(v.name), self.weights):
                    continue
                label = self.tied.get(f.label(v.name), f.label(v.name))
                if r.count == 1 and label in seen:
                    continue  # a tied weight is one parameter, under all its names
                seen.add(label)
                yield r, v, label

    def dp_traffic(self) -> dict[str, Any] | None:
        """The data axis's bytes per rank per step against DDP's and FSDP's formulas
        (``nvtp.sharding.axes.dp.dp_traffic``); None on a mesh without one."""
        return self.axis_json().get("dp_traffic")

    def axis_json(self) -> dict[str, Any]:
        """Each axis strategy's own terms of this report (dp's traffic against its formula)."""
        out: dict[str, Any] = {}
        if self.mesh is not None:
            for st, axis in axes.passes(self.mesh):
                out |= st.report_json(self, axis)
        return out

    def activations_per_layer(self, square_only: bool = False) -> int | None:
        """Local bytes one layer keeps for backward: a block region's (``explain_gpt``), or in a
        program spliced from one block (``layers``) the mean over its blocks of what each copy
        computes and the forward keeps; None for a model of neither kind. ``square_only``: only
        the values whose last two axes are the sequence (the s*s attention scores or probabilities)."""
        s = self.shape.get("s")

        def counted(r: Region, name: str) -> bool:
            shape = r.forward.source.value(name).shape
            return not square_only or (s is not None and len(shape) >= 2 and tuple(shape[-2:]) == (s, s))

        blocks = [r for r in self.regions if r.count > 1 or r.name == "block"]
        if blocks:
            r = blocks[0]
            return sum(n for name, n in _saved_named(r.forward, r.backward) if counted(r, name))
        if not self.layers or len(self.regions) != 1:
            return None
        r = self.regions[0]
        kept = sum(n for name, n in _saved_named(r.forward, r.backward) if name in self.layers and counted(r, name))
        return round(kept / len(set(self.layers.values())))

    def korthikanti_per_layer(self) -> float | None:
        """Korthikanti et al. (2022): activation bytes per layer per rank, s·b·h·(34 + 5·a·s/h)
        for 16-bit activations, divided by t with tensor and sequence parallelism (with tensor
        parallelism alone the 10 bytes of LayerNorm inputs and dropout masks stay whole)."""
        if not self.shape:
            return None
        s, b, h, a, t = (self.shape[k] for k in ("s", "b", "h", "a", "t"))
        if self.plan == "megatron-sp":
            return s * b * h * (34 + 5 * a * s / h) / t
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))

    # -- output ---------------------------------------------------------------------------

    def as_json(self) -> dict[str, Any]:
        comms = self.communications()
        return {
            "model": self.model,
            "plan": self.plan,
            "backend": self.backend,
            "devices": self.devices,
            "regions": [{"name": r.name, "count": r.count, "forward_ops": len(r.forward.fusion.ops),
                         "backward_ops": len(r.backward.fusion.ops) if r.backward else 0,
                         "shardings": _parameter_shardings(r)} for r in self.regions],
            "communications": comms,
            "collectives": self.collectives(),
            "scheduled": any(r.schedules for r in self.regions),
            "communication_bytes": {p: sum(c["bytes"] for c in comms if c["phase"] == p) for p in ("forward", "backward")},
            "memory_per_rank": self.memory_per_rank(),
            "activations_per_layer": self.activations_per_layer(),
            "attention_matrices_per_layer": self.activations_per_layer(square_only=True),
            "activations_per_layer_korthikanti": self.korthikanti_per_layer(),
            "seconds": dict(self.seconds),
            **({"schedule": self.schedule_summary()} if self.machine is not None else {}),
            **({"expert_load": [x.as_json() for x in self.expert_load], "expert_load_note": self.expert_load_note}
               if self.expert_load or self.expert_load_note else {}),
        } | ({"traced": self.how} if self.how else {}) | ({} if self.mesh is None else {
            "mesh": {"shape": list(self.mesh.shape), "names": list(self.mesh.names)},
            "data": self.data,
            "batch": self.batch,
            "notes": list(self.notes),
            "communication_bytes_per_axis": {a: {p: sum(c["bytes"] for c in comms if c["phase"] == p and c["axis"] == a)
                                                 for p in ("forward", "backward")} for a in self.mesh.names},
            **self.axis_json(),
        })

    def as_text(self) -> str:
        if self.mesh is None:
            lines = [f"{self.model}: plan {self.plan} on a mesh of {self.devices} device(s), for the {self.backend} backend"]
        else:
            shape = "x".join(map(str, self.mesh.shape))
            parts = ", ".join(st.headline(self, axis) for st, axis in axes.passes(self.mesh))
            lines = [f"{self.model}: {parts}, on a {shape} mesh ({', '.join(f'{n} {k}' for n, k in zip(self.mesh.names, self.mesh.shape))}; "
                     f"{self.devices} devices), for the {self.backend} backend"]
            if self.batch:
                lines.append(f"  {self.batch}")
            lines += [f"  {n}" for n in self.notes]
        for r in self.regions:
            times = f" x {r.count}" if r.count > 1 else ""
            n_bwd = len(r.backward.fusion.ops) if r.backward else 0
            lines.append(f"region {r.name}{times}: forward {len(r.forward.fusion.ops)} ops, backward {n_bwd} ops")
            for label, placement in _folded(_parameter_shardings(r)):
                lines.append(f"  {label:40} {placement}")
            lines += [f"  {label:40} {text}" for label, text in _folded(moe_summary(r.forward))]  # nvtp/sharding/moe.py
        comms = self.communications()
        lines.append("communications per step (bytes each rank sends with ring algorithms):")
        groups: dict[tuple, list[dict]] = {}
        on = self.mesh is not None
        for c in comms:
            groups.setdefault((c["phase"], c["region"], c["axis"] if on else "", c["kind"], str(c["shape"]), c["dtype"]), []).append(c)
        for (phase, region, axis, kind, shape, dtype), cs in groups.items():
            per = f" ({len(cs) // max(1, self._count(region))} per layer)" if self._count(region) > 1 else ""
            where = f" on {axis}" if on else ""
            lines.append(f"  {phase:8} {region:10}{where} {len(cs):5} x {kind:15} {dtype:>8}{shape:20}{per} {size_text(sum(c['bytes'] for c in cs)):>12}")
        for phase in ("forward", "backward"):
            for axis in (self.mesh.names if on else ("",)):
                cs = [c for c in comms if c["phase"] == phase and (not on or c["axis"] == axis)]
                lines.append(f"  {phase}{' on ' + axis if on else ''}: {len(cs)} collectives, {size_text(sum(c['bytes'] for c in cs))} per rank")
        issued = self.collectives()
        if any(r.schedules for r in self.regions):
            for phase in ("forward", "backward"):
                cs = [c for c in issued if c["phase"] == phase and "ring" not in c and c["kind"] != "sendrecv"]
                moved = sum(len(c["tensors"]) for c in cs)
                lines.append(f"  {phase} as issued: {len(cs)} collectives for {moved} tensors (started as soon as their inputs "
                             f"exist, buckets of one kind and axis sent as one; nvtp.sharding.overlap)")
                ring_steps = [c for c in issued if c["phase"] == phase and "ring" in c]
                steps = collections.Counter(c["ring"] for c in ring_steps)
                rings = collections.Counter()
                for c in ring_steps:  # each ring lists its steps
                    rings[c["ring"]] += 1 / c["ring_steps"]
                if ring_steps:
                    lines.append(f"  {phase} collective matmuls (ring steps, each beside a block of the matmul): " + ", ".join(
                        f"{round(rings[kind])} {kind} in {n} steps" for kind, n in steps.items()))
        if self.machine is not None:
            summary = self.schedule_summary()
            lines.append(f"schedule on {self.machine.name} ({self.machine.describe}), estimated per step:")
            for phase in ("forward", "backward"):
                t = summary[phase]
                lines.append(f"  {phase:8} ops {t['compute'] * 1e3:9.2f} ms, communication {t['communication'] * 1e3:8.2f} ms, "
                             f"exposed {t['exposed'] * 1e3:8.2f} ms (blocking: {t['exposed_blocking'] * 1e3:.2f} ms): "
                             f"{t['hidden']:.0%} hidden")
        if self.mesh is not None:
            for st, axis in axes.passes(self.mesh):
                lines += st.report_lines(self, axis)
        if self.expert_load or self.expert_load_note:
            lines.append("expert load of the example batch (tokens routed to each expert; imbalance = max / mean)"
                         + (f": {self.expert_load_note}" if self.expert_load_note else ":"))
            for x in self.expert_load:
                lines += x.lines()
        mem = self.memory_per_rank()
        lines.append("memory per rank:")
        for k in ("parameters", "gradients", "optimizer", "activations", "peak_activations", "total"):
            lines.append(f"  {k:18} {size_text(mem[k]):>12}")
        formula = self.korthikanti_per_layer()
        mine = self.activations_per_layer()
        if formula is not None and mine is not None:
            square = self.activations_per_layer(square_only=True) or 0
            why = ("with flash attention nvtp keeps no s*s attention scores or probabilities" if not square else
                   f"of which {size_text(square)} s*s attention matrices (the formula counts 5 bytes an element of them: scores, "
                   "probabilities, dropout mask)")
            lines.append(f"activations saved per layer per rank: {size_text(mine)}; Korthikanti et al.'s s*b*h*(34 + 5*a*s/h)"
                         f"{'/t' if self.plan == 'megatron-sp' else ' (TP: 10 + 24/t + 5as/(ht))'}: {size_text(int(formula))} "
                         f"(ratio {mine / formula:.2f}; {why})")
        if self.seconds:
            lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()) + (f" ({self.how})" if self.how else ""))
        return "\n".join(lines)

    def _count(self, name: str) -> int:
        return next((r.count for r in self.regions if r.name == name), 1)


def _is_weight(label: str, weights: frozenset[str] | None) -> bool:
    """Whether an input labelled ``label`` is one of the module's parameters (``weights``; None: any
    parameter input), or rows of one (a fused projection's part, ``weight[start:stop]``)."""
    return weights is None or label in weights or label.split("[", 1)[0] in weights


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _local_bytes(sharded: ShardedFusion, v: TensorValue) -> int:
    sharding = sharded.shardings.get(v.name)
    shape = v.shape if sharding is None else local_shape(v.shape, sharding, sharded.mesh)
    return _numel(shape) * v.dtype.itemsize


def _saved_bytes(sharded: ShardedFusion, backward: ShardedFusion | None) -> list[int]:
    """Local bytes of what the forward keeps for backward: its outputs other than the model's
    result, and the activation inputs the backward reads (a block's input: inside a whole model
    an intermediate kept alive for backward like any other)."""
    return [n for _, n in _saved_named(sharded, backward)]


def _saved_named(sharded: ShardedFusion, backward: ShardedFusion | None) -> list[tuple[str, int]]:
    """``_saved_bytes`` with each value's name in the source fusion."""
    src = sharded.source
    found = [(s.name, _local_bytes(sharded, out)) for s, out in zip(src.outputs, sharded.fusion.outputs)
             if isinstance(out, TensorValue) and src.role(s.name) != "output"]
    if backward is not None:
        b = backward.source
        sources = {b.info[v.name].source for v in b.inputs if b.role(v.name) == "saved" and v.name in b.info}
        found += [(v.name, _local_bytes(sharded, v)) for v in src.inputs
                  if isinstance(v, TensorValue) and src.role(v.name) == "activation" and v.name in sources]
    return found


def _peak_bytes(sharded: ShardedFusion) -> int:
    """The largest sum of local bytes of values alive at once while the fusion runs (inputs not
    counted: parameters are counted apart, activations by the region that made them)."""
    f: Fusion = sharded.fusion
    last_use: dict[str, int] = {}
    for i, op in enumerate(f.ops):
        for v in op.operands:
            last_use[v.name] = i
    outputs = {v.name for v in f.outputs}
    inputs = {v.name for v in f.inputs}
    live = peak = 0
    dying: dict[int, int] = {}
    for i, op in enumerate(f.ops):
        for v in op.outputs:
            if isinstance(v, TensorValue) and v.name not in inputs:
                n = _local_bytes(sharded, v)
                live += n
                if v.name not in outputs:
                    end = last_use.get(v.name, i)
                    dying[end] = dying.get(end, 0) + n
        peak = max(peak, live)
        live -= dying.pop(i, 0)
    return peak


def _parameter_shardings(r: Region) -> dict[str, str]:
    """Each parameter's placement: on a 1-D mesh ``S(0)`` or ``replicated``; on a 2-D mesh one per
    axis, ``dp S(1), tp S(0)``."""
    f = r.forward.source
    mesh = r.forward.mesh
    out = {}
    for v in f.inputs:
        if isinstance(v, TensorValue) and f.role(v.name) == "parameter":
            shown = [str(p) if axis_split(p) else "replicated" for p in r.forward.shardings[v.name]]
            out[f.label(v.name)] = shown[0] if mesh.ndim == 1 else ", ".join(f"{n} {p}" for n, p in zip(mesh.names, shown))
    return out


_BLOCK_LABEL = re.compile(r"^(.*?)\.(\d+)\.(.+)$")


def _folded(shardings: dict[str, str]) -> list[tuple[str, str]]:
    """Labels of repeated blocks folded per block: ``layers.{0..31}.q.weight  S(0)`` where blocks 0
    to 31 place their ``q.weight`` alike (a block placed otherwise keeps its own lines), in the
    order the labels first appear."""
    runs: dict[tuple[str, str], list[list]] = {}  # (prefix, rest) -> runs [first, last, placement]
    order: list[tuple] = []  # ("label", label, placement) or ("block", (prefix, rest))
    for label, placement in shardings.items():
        m = _BLOCK_LABEL.match(label)
        if m is None:
            order.append(("label", label, placement))
            continue
        key, i = (m.group(1), m.group(3)), int(m.group(2))
        group = runs.get(key)
        if group is None:
            runs[key] = group = []
            order.append(("block", key))
        if group and group[-1][1] == i - 1 and group[-1][2] == placement:
            group[-1][1] = i
        else:
            group.append([i, i, placement])
    out = []
    for item in order:
        if item[0] == "label":
            out.append(item[1:])
            continue
        (prefix, rest) = item[1]
        for first, last, placement in runs[item[1]]:
            blocks = str(first) if first == last else f"{{{first}..{last}}}"
            out.append((f"{prefix}.{blocks}.{rest}", placement))
    return out


def report_of(program, model: str = "", *, batch: str = "", shape: dict[str, int] | None = None) -> ModelReport:
    """The report of a whole ``nvtp.program.Program``: one region, the model. ``shape`` (s, b, h,
    a, t, L): a transformer's, for Korthikanti et al.'s formula."""
    mesh = program.mesh
    two = mesh.names != DeviceMesh.of_size(mesh.size).names  # a plain 1-D mesh is reported as its device count
    return ModelReport(model or "model", program.plan, mesh.size, [Region("model", 1, program.forward, program.backward, dict(program.schedules))],
                       dict(program.seconds), dict(shape or {}), mesh=mesh if two else None,
                       data=axes.data_mode(program.fsdp) if two else "", weights=program.traced.weights, batch=batch,
                       notes=list(program.notes), how=program.traced.how, backend=program.backend, tied=dict(program.traced.tied),
                       layers=dict(program.source.layers))
