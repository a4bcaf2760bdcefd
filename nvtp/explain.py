"""Explain a whole model at depth: its shardings, every communication, and the memory per rank.

    report = nvtp.plan(model, idx, targets, plan="megatron", devices=8)     # any module nvtp.jit takes
    report = explain_gpt(gpt.config("gpt3"), layers=96, plan="megatron", devices=8)
    print(report.as_text()); report.as_json()

A model is a list of *regions*, each a forward and a backward fusion sharded on the mesh and
run ``count`` times per step. ``plan`` traces the module as ``nvtp.jit`` does (one region: a chain
of repeated blocks is traced as block 0 and the model without its blocks, then spliced to full
depth, nvtp.frontend.regional; else whole). ``explain_gpt`` compiles a deep GPT *regionally*, as torch.compile's regional
compilation does for repeated layers: it traces one transformer block and the model without its
blocks (embeddings, final norm, LM head, loss), shards both, and counts the block ``layers``
times. That is exact for what is reported, because a block's sharding does not depend on its
neighbours: its input arrives as the plan places activations (whole, or split along the sequence
with SP), and it hands its output back the same way; tests/test_explain.py checks the regional
report against a whole traced model, figure for figure.

On a 2-D (dp, tp) mesh (``mesh=(dp, tp)``, ``fsdp``) the plan runs on tp and the data plan on dp
(nvtp.sharding.multi); every communication names its mesh axis; the traced batch is dp times one
rank's (``batch``, or the config's, or the example arguments'); ``dp_traffic`` sets the dp bytes
against DDP's 2W(dp-1)/dp and FSDP's 3Psi(dp-1)/dp + 2R(dp-1)/dp.

Memory per rank (bytes; each tensor's local part under all its mesh axes' placements):

* ``parameters``: each parameter's local shard, in its dtype.
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

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.sharding.sharded import ShardedFusion
from nvtp.sharding.placements import DeviceMesh, axis_split, local_shape
from nvtp.sharding.report import communication_records


@dataclass
class Region:
    """A part of the model: its sharded forward and backward, run ``count`` times a step."""

    name: str
    count: int
    forward: ShardedFusion
    backward: ShardedFusion | None


@dataclass
class ModelReport:
    model: str
    plan: str
    devices: int
    regions: list[Region]
    seconds: dict[str, float] = field(default_factory=dict)
    shape: dict[str, int] = field(default_factory=dict)  # b, s, h, a, L for the formula (GPT only)
    mesh: DeviceMesh | None = None  # None: a 1-D mesh of ``devices``; else the (dp, tp) mesh
    data: str = ""  # on a 2-D mesh: "ddp" or "fsdp"
    weights: frozenset[str] | None = None  # labels of the parameters FSDP may split (None: every parameter)
    batch: str = ""  # how the traced batch relates to a rank's (2-D meshes)
    notes: list[str] = field(default_factory=list)  # the data plan's (weights FSDP leaves whole, and why)
    how: str = ""  # how the fusions were traced (nvtp.frontend.regional's Captured.regional)
    backend: str = "nvfuser"  # the backend whose target the program was sharded for (nvtp.execute.backends)
    tied: dict[str, str] = field(default_factory=dict)  # a tied parameter's other names -> its first (counted once)

    # -- communications -------------------------------------------------------------------

    def communications(self) -> list[dict[str, Any]]:
        """Every collective of one training step, in order: {kind, tensor, shape, dtype, bytes,
        phase, region, layer}; a repeated region's collectives once per layer."""
        out = []
        for phase in ("forward", "backward"):
            regions = self.regions if phase == "forward" else list(reversed(self.regions))
            for r in regions:
                sharded = r.forward if phase == "forward" else r.backward
                if sharded is None:
                    continue
                records = communication_records(sharded)
                axes = [sharded.mesh.names[step.axis] for step in sharded.communications]
                layers = range(r.count) if phase == "forward" else reversed(range(r.count))
                for layer in (layers if r.count > 1 else [None]):
                    for c, axis in zip(records, axes):
                        tensor = c["label"] or c["tensor"]
                        out.append({"kind": c["kind"], "tensor": tensor if layer is None else f"{r.name}.{layer}/{tensor}",
                                    "shape": c["shape"], "dtype": c["dtype"], "bytes": c["bytes"], "phase": phase,
                                    "axis": axis, "region": r.name, "layer": layer})
        return out

    # -- memory ---------------------------------------------------------------------------

    def memory_per_rank(self) -> dict[str, int]:
        params = grads = optimizer = 0
        for r, v, _ in self._parameters():
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

    def _parameters(self):
        """(region, forward input, label) of each parameter once (a tied weight is one parameter)."""
        seen: set[str] = set()
        for r in self.regions:
            f = r.forward.source
            for v in f.inputs:
                if not isinstance(v, TensorValue) or f.role(v.name) != "parameter":
                    continue
                label = self.tied.get(f.label(v.name), f.label(v.name))
                if r.count == 1 and label in seen:
                    continue  # a tied weight is one parameter, under all its names
                seen.add(label)
                yield r, v, label

    def dp_traffic(self) -> dict[str, Any] | None:
        """On a (dp, tp) mesh, the bytes each rank sends per step on dp against DDP's and FSDP's
        formulas: DDP 2W(dp-1)/dp; FSDP 3Psi(dp-1)/dp for the weights it splits (gathered in
        forward and again in backward, gradients reduce-scattered) plus 2R(dp-1)/dp for those it
        leaves whole; W, Psi, R this rank's tp shards of the weights, in their dtype. A split
        weight the backward does not read (an embedding table, the bias of a residual projection)
        is not gathered again: it counts 2Psi'(dp-1)/dp (Psi' within ``split_weight_bytes``,
        outside ``split_read_by_backward_bytes``). ``weights``
        is the measured dp collectives of the weights and their gradients, each counted in its
        weight's dtype, so it equals ``formula``; ``gradients_in_fp32`` the extra bytes of 16-bit
        weights' gradients reduced in fp32 before their cast; ``other`` the rest (the loss's
        scalars); ``measured`` = weights + gradients_in_fp32 + other; ``deviations`` the weights
        whose measured bytes differ from their share of the formula (nvtp's GPT on megatron-sp:
        wpe's gradient is reduced over dp while still split along the sequence by tp, so 1/tp of
        it; with FSDP it is all-reduced whole before the slice to the rank's shard, not
        reduce-scattered). None on a 1-D mesh."""
        if self.mesh is None:
            return None
        tp_axis, dp_axis = self.mesh.names.index("tp"), self.mesh.names.index("dp")
        dp = self.mesh.shape[dp_axis]
        itemsize, split, once, whole = {}, 0, 0, 0
        expected: dict[str, float] = {}
        for r, v, label in self._parameters():
            if self.weights is not None and label not in self.weights:
                continue
            itemsize[label] = v.dtype.itemsize
            sharding = r.forward.shardings[v.name]
            tp_part = _numel(local_shape(v.shape, (sharding[tp_axis],), self.mesh.sub(tp_axis))) * v.dtype.itemsize
            b = r.backward.source if r.backward is not None else None
            read = b is not None and any(b.role(u.name) == "parameter" and b.label(u.name) == label for u in b.inputs)
            if axis_split(sharding[dp_axis]) is None:
                whole += r.count * tp_part
                times = 2
            elif read:
                split += r.count * tp_part
                times = 3
            else:  # the backward does not read it (an embedding table, a bias): gathered once a step
                once += r.count * tp_part
                times = 2
            expected[label] = expected.get(label, 0) + times * r.count * tp_part * (dp - 1) / dp
        measured: dict[str, int] = {}
        widened = other = 0
        others: list[str] = []
        for r in self.regions:
            for sharded in (r.forward, r.backward):
                if sharded is None:
                    continue
                for result, step in sharded.set_steps.items():
                    if step.axis != dp_axis or not step.is_communication:
                        continue
                    label = _weight_of(sharded, result, step)
                    v = sharded.fusion.value(result)
                    if label not in itemsize:
                        other += r.count * step.bytes
                        others.append(f"{step.kind} {sharded.source.label(step.value) if step.value in sharded.source.info else step.value} "
                                      f"{list(v.shape)} {v.dtype.value}")
                        continue
                    at_weight = step.bytes * itemsize[label] // v.dtype.itemsize
                    measured[label] = measured.get(label, 0) + r.count * at_weight
                    widened += r.count * (step.bytes - at_weight)
        frac = (dp - 1) / dp
        formula = round((3 * split + 2 * once + 2 * whole) * frac)
        weights = sum(measured.values())
        return {"data": self.data, "dp": dp, "split_weight_bytes": split + once, "split_read_by_backward_bytes": split,
                "whole_weight_bytes": whole,
                "formula": formula, "weights": weights, "gradients_in_fp32": widened, "other": other,
                "other_collectives": others, "measured": weights + widened + other,
                "deviations": {k: {"measured": measured.get(k, 0), "formula": round(expected[k])}
                               for k in expected if measured.get(k, 0) != round(expected[k])}}

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
            "communication_bytes": {p: sum(c["bytes"] for c in comms if c["phase"] == p) for p in ("forward", "backward")},
            "memory_per_rank": self.memory_per_rank(),
            "activations_per_layer_korthikanti": self.korthikanti_per_layer(),
            "seconds": dict(self.seconds),
        } | ({"traced": self.how} if self.how else {}) | ({} if self.mesh is None else {
            "mesh": {"shape": list(self.mesh.shape), "names": list(self.mesh.names)},
            "data": self.data,
            "batch": self.batch,
            "notes": list(self.notes),
            "communication_bytes_per_axis": {a: {p: sum(c["bytes"] for c in comms if c["phase"] == p and c["axis"] == a)
                                                 for p in ("forward", "backward")} for a in self.mesh.names},
            "dp_traffic": self.dp_traffic(),
        })

    def as_text(self) -> str:
        if self.mesh is None:
            lines = [f"{self.model}: plan {self.plan} on a mesh of {self.devices} device(s), for the {self.backend} backend"]
        else:
            shape = "x".join(map(str, self.mesh.shape))
            lines = [f"{self.model}: plan {self.plan} on tp, {self.data.upper()} on dp, on a {shape} mesh "
                     f"({', '.join(f'{n} {k}' for n, k in zip(self.mesh.names, self.mesh.shape))}; {self.devices} devices), "
                     f"for the {self.backend} backend"]
            if self.batch:
                lines.append(f"  {self.batch}")
            lines += [f"  {n}" for n in self.notes]
        for r in self.regions:
            times = f" x {r.count}" if r.count > 1 else ""
            n_bwd = len(r.backward.fusion.ops) if r.backward else 0
            lines.append(f"region {r.name}{times}: forward {len(r.forward.fusion.ops)} ops, backward {n_bwd} ops")
            for label, placement in _folded(_parameter_shardings(r)):
                lines.append(f"  {label:40} {placement}")
        comms = self.communications()
        lines.append("communications per step (bytes each rank sends with ring algorithms):")
        groups: dict[tuple, list[dict]] = {}
        on = self.mesh is not None
        for c in comms:
            groups.setdefault((c["phase"], c["region"], c["axis"] if on else "", c["kind"], str(c["shape"]), c["dtype"]), []).append(c)
        for (phase, region, axis, kind, shape, dtype), cs in groups.items():
            per = f" ({len(cs) // max(1, self._count(region))} per layer)" if self._count(region) > 1 else ""
            where = f" on {axis}" if on else ""
            lines.append(f"  {phase:8} {region:10}{where} {len(cs):5} x {kind:15} {dtype:>8}{shape:20}{per} {_size(sum(c['bytes'] for c in cs)):>12}")
        for phase in ("forward", "backward"):
            for axis in (self.mesh.names if on else ("",)):
                cs = [c for c in comms if c["phase"] == phase and (not on or c["axis"] == axis)]
                lines.append(f"  {phase}{' on ' + axis if on else ''}: {len(cs)} collectives, {_size(sum(c['bytes'] for c in cs))} per rank")
        traffic = self.dp_traffic()
        if traffic is not None:
            lines += _traffic_text(traffic)
        mem = self.memory_per_rank()
        lines.append("memory per rank:")
        for k in ("parameters", "gradients", "optimizer", "activations", "peak_activations", "total"):
            lines.append(f"  {k:18} {_size(mem[k]):>12}")
        formula = self.korthikanti_per_layer()
        blocks = [r for r in self.regions if r.count > 1 or r.name == "block"]
        if formula is not None and blocks:
            mine = sum(_saved_bytes(blocks[0].forward, blocks[0].backward))
            lines.append(f"activations saved per layer per rank: {_size(mine)}; Korthikanti et al.'s s*b*h*(34 + 5*a*s/h)"
                         f"{'/t' if self.plan == 'megatron-sp' else ' (TP: 10 + 24/t + 5as/(ht))'}: {_size(int(formula))} "
                         f"(ratio {mine / formula:.2f}: with flash attention nvtp keeps no s*s attention scores or probabilities)")
        if self.seconds:
            lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()) + (f" ({self.how})" if self.how else ""))
        return "\n".join(lines)

    def _count(self, name: str) -> int:
        return next((r.count for r in self.regions if r.name == name), 1)


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


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _size(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def _local_bytes(sharded: ShardedFusion, v: TensorValue) -> int:
    sharding = sharded.shardings.get(v.name)
    shape = v.shape if sharding is None else local_shape(v.shape, sharding, sharded.mesh)
    return _numel(shape) * v.dtype.itemsize


def _saved_bytes(sharded: ShardedFusion, backward: ShardedFusion | None) -> list[int]:
    """Local bytes of what the forward keeps for backward: its outputs other than the model's
    result, and the activation inputs the backward reads (a block's input: inside a whole model
    an intermediate kept alive for backward like any other)."""
    src = sharded.source
    found = [_local_bytes(sharded, out) for s, out in zip(src.outputs, sharded.fusion.outputs)
             if isinstance(out, TensorValue) and src.role(s.name) != "output"]
    if backward is not None:
        b = backward.source
        sources = {b.info[v.name].source for v in b.inputs if b.role(v.name) == "saved" and v.name in b.info}
        found += [_local_bytes(sharded, v) for v in src.inputs
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


def _weight_of(sharded: ShardedFusion, result: str, step) -> str:
    """The label of the parameter a collective moves: the parameter itself (FSDP's gathers), or the
    parameter whose gradient output the reduced value becomes through single-use ops (a cast, a
    slice to the at-rest shard); "" for anything else."""
    src = sharded.source
    if step.value in src.info and src.role(step.value) == "parameter":
        return src.label(step.value)
    outputs = {out.name: s.name for s, out in zip(src.outputs, sharded.fusion.outputs)}
    users = sharded.fusion.consumers()
    name = result
    for _ in range(8):
        if name in outputs:
            return src.grad_of(outputs[name])
        ops = users.get(name, [])
        if len(ops) != 1 or len(ops[0].outputs) != 1:
            return ""
        name = ops[0].outputs[0].name
    return ""


# ---------------------------------------------------------------------------------------------
# entry points: every program comes from the compile driver (nvtp.driver)


def _mesh(devices: int | None, mesh: Any, fsdp: bool, default: int) -> DeviceMesh:
    """The mesh to plan for: ``devices`` (1-D) or ``mesh`` ((dp, tp), "DPxTP" or a DeviceMesh), else ``default`` devices."""
    from nvtp.mesh import make_mesh

    return make_mesh(mesh, devices=devices if devices is not None or mesh is not None else default, fsdp=fsdp)


def _axis_size(mesh: DeviceMesh, name: str) -> int:
    return mesh.shape[mesh.names.index(name)] if name in mesh.names else 1


def report_of(program, model: str = "", *, batch: str = "") -> ModelReport:
    """The report of a whole ``nvtp.program.Program``: one region, the model."""
    mesh = program.mesh
    two = mesh.ndim > 1
    return ModelReport(model or "model", program.plan, mesh.size, [Region("model", 1, program.forward, program.backward)],
                       dict(program.seconds), mesh=mesh if two else None, data=("fsdp" if program.fsdp else "ddp") if two else "",
                       weights=program.traced.weights, batch=batch, notes=list(program.notes), how=program.traced.how,
                       backend=program.backend, tied=dict(program.traced.tied))


def plan(model: torch.nn.Module, *example_args, plan: str = "megatron", devices: int | None = None, backend: str | None = None,
         mesh: "tuple[int, int] | DeviceMesh | None" = None, fsdp: bool = False, regional: bool = True, **example_kwargs) -> ModelReport:
    """The program ``nvtp.jit(model, plan=plan, mesh=..., backend=backend)`` runs for these
    arguments, made by the same driver (``nvtp.driver.compile``) on meta tensors (nothing is
    computed, the parameters are not touched), and reported (``ModelReport``): every tensor's
    placement, every communication with its bytes, the memory per rank. ``devices`` (default 2)
    or ``mesh`` = (dp, tp) (the plan on tp, the batch split over dp; ``fsdp`` splits the weights
    over dp too); on a dp mesh ``example_args`` are one rank's batch, as ``nvtp.jit`` takes them.
    ``backend``: the backend to plan for (default: the one ``nvtp.jit`` would run this model on
    here, ``nvtp.execute.backends.default_name``); "nvfuser" plans for GPUs on any machine.
    Takes every model ``nvtp.jit`` takes (the FX route for transformers models included)."""
    from nvtp import driver
    from nvtp.execute import backends

    mesh = _mesh(devices, mesh, fsdp, 2)
    if backend is None:
        backend = backends.default_name(next((p.device.type for p in model.parameters()), "cpu"))
    backends.resolve(backend, run=False)
    args, kwargs = driver.bind_call(model, driver.route(model), example_args, example_kwargs)
    program = driver.compile(model, *args, plan=plan, mesh=mesh, backend=backend, fsdp=fsdp, regional=regional, **kwargs)
    batch = ""
    if mesh.ndim > 1 and example_args and isinstance(example_args[0], torch.Tensor) and example_args[0].ndim:
        batch = f"traced batch = dp x each rank's batch (the example arguments') = {_axis_size(mesh, 'dp')} x {example_args[0].shape[0]}"
    return report_of(program, type(model).__name__, batch=batch)


def explain_gpt(cfg, *, layers: int, plan: str = "megatron", devices: int | None = None, dtype: torch.dtype = torch.bfloat16,
                backend: str = "nvfuser", regional: bool = True, mesh: "tuple[int, int] | DeviceMesh | None" = None,
                fsdp: bool = False, batch: int | None = None) -> ModelReport:
    """nvtp's GPT with ``cfg`` at ``layers`` layers, traced on meta tensors, on ``devices``
    devices (default 8) or ``mesh`` = (dp, tp) (``fsdp``: weights split over dp too), for
    ``backend`` (default nvFuser: a model of this size is planned for GPUs). ``batch`` is each
    rank's batch (default the config's); on a dp mesh the traced batch is dp times it.
    ``regional`` (the default) traces one block and the model without blocks through the compile
    driver, and counts the block ``layers`` times: exact, because a block's input arrives as the
    plan places activations and it hands its output back the same way (the program ``nvtp.jit``
    splices to full depth has the same placements and steps: tests/test_driver.py);
    ``regional=False`` traces the whole model (seconds a layer)."""
    import time
    from dataclasses import replace

    from nvtp.sharding.plans import check_plan

    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch={batch!r}: each rank's batch must be a positive integer")
    check_plan(plan, [])  # a misspelt plan name, before any tracing
    mesh = _mesh(devices, mesh, fsdp, 8)
    dp, tp = (_axis_size(mesh, "dp"), _axis_size(mesh, "tp")) if mesh.ndim > 1 else (1, mesh.size)
    per_rank = batch or cfg.batch
    cfg = replace(cfg, batch=per_rank * dp)
    start = time.perf_counter()
    shape = {"s": cfg.seq_len, "b": per_rank, "h": cfg.n_embd, "a": cfg.n_head, "t": tp, "L": layers}
    name = f"GPT ({layers} layers, hidden {cfg.n_embd}, {cfg.n_head} heads, sequence {cfg.seq_len}, batch {cfg.batch}, {str(dtype).replace('torch.', '')})"
    extra = {"backend": backend}
    if mesh.ndim > 1:
        extra |= {"mesh": mesh, "data": "fsdp" if fsdp else "ddp",
                  "batch": f"traced batch {cfg.batch} = dp {dp} x {per_rank} per rank ({'--batch' if batch else 'the config' + chr(39) + 's batch'})"}
    if not regional:
        whole = _shard_gpt(_trace_gpt(cfg, layers, dtype), plan, mesh, backend, fsdp)
        traced = time.perf_counter() - start
        return ModelReport(name, plan, mesh.size, [Region("model", 1, whole.forward, whole.backward)],
                           {"trace": traced, "shard": whole.seconds["shard"]}, shape, notes=whole.notes, **extra)
    outer_t, block_t = _trace_gpt(cfg, 0, dtype), _trace_gpt(cfg, None, dtype)
    traced = time.perf_counter() - start
    outer, block = (_shard_gpt(t, plan, mesh, backend, fsdp) for t in (outer_t, block_t))
    regions = [Region("outer", 1, outer.forward, outer.backward), Region("block", layers, block.forward, block.backward)]
    return ModelReport(name, plan, mesh.size, regions, {"trace": traced, "shard": time.perf_counter() - start - traced}, shape,
                       notes=outer.notes + [f"block: {n}" for n in block.notes], **extra)


def _shard_gpt(traced, plan: str, mesh: DeviceMesh, backend: str, fsdp: bool):
    from nvtp import driver

    return driver.shard(traced, plan, mesh, backend, fsdp=fsdp)


@functools.lru_cache(maxsize=8)
def _trace_gpt(cfg, n_layer: int | None, dtype: torch.dtype):
    """The traced fusions of GPT(cfg) with ``n_layer`` layers, or of one Block (None: its output
    is the next block's input, so no module boundary), on meta tensors; kept, so that
    explaining several plans traces once."""
    from dataclasses import replace

    from nvtp import driver
    from nvtp.models import gpt

    with torch.device("meta"):
        if n_layer is None:
            block = gpt.Block(cfg).to(dtype)
            return driver.trace(block, (gpt.example_input(cfg, dtype=dtype, device="meta"),), regional=False, boundary=False)
        model = gpt.GPT(replace(cfg, n_layer=n_layer)).to(dtype)
    tokens = tuple(torch.zeros(cfg.batch, cfg.seq_len, dtype=torch.long, device="meta") for _ in range(2))
    return driver.trace(model, tokens, regional=False)
