"""Explain a whole model at depth: its shardings, every communication, and the memory per rank.

    report = nvtp.plan(model, idx, targets, plan="megatron", devices=8)     # any module nvtp.jit takes
    report = explain_gpt(gpt.config("gpt3"), layers=96, plan="megatron", devices=8)
    print(report.as_text()); report.as_json()

A model is a list of *regions*, each a forward and a backward fusion sharded on the mesh and
run ``count`` times per step. ``plan`` traces the whole module once (one region; Thunder takes
seconds a layer). ``explain_gpt`` compiles a deep GPT *regionally*, as torch.compile's regional
compilation does for repeated layers: it traces one transformer block and the model without its
blocks (embeddings, final norm, LM head, loss), shards both, and counts the block ``layers``
times. That is exact for what is reported, because a block's sharding does not depend on its
neighbours: its input arrives as the plan places activations (whole, or split along the sequence
with SP), and it hands its output back the same way; tests/test_explain.py checks the regional
report against a whole traced model, figure for figure.

Memory per rank (bytes):

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
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.sharding.pipeline import shard_pair
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
                layers = range(r.count) if phase == "forward" else reversed(range(r.count))
                for layer in (layers if r.count > 1 else [None]):
                    for c in records:
                        tensor = c["label"] or c["tensor"]
                        out.append({"kind": c["kind"], "tensor": tensor if layer is None else f"{r.name}.{layer}/{tensor}",
                                    "shape": c["shape"], "dtype": c["dtype"], "bytes": c["bytes"], "phase": phase,
                                    "region": r.name, "layer": layer})
        return out

    # -- memory ---------------------------------------------------------------------------

    def memory_per_rank(self) -> dict[str, int]:
        params = grads = optimizer = 0
        seen: set[str] = set()
        for r in self.regions:
            f = r.forward.source
            for v in f.inputs:
                if not isinstance(v, TensorValue) or f.role(v.name) != "parameter":
                    continue
                label = f.label(v.name)
                if r.count == 1 and label in seen:
                    continue  # a tied weight is one parameter
                seen.add(label)
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
            "devices": self.devices,
            "regions": [{"name": r.name, "count": r.count, "forward_ops": len(r.forward.fusion.ops),
                         "backward_ops": len(r.backward.fusion.ops) if r.backward else 0,
                         "shardings": _parameter_shardings(r)} for r in self.regions],
            "communications": comms,
            "communication_bytes": {p: sum(c["bytes"] for c in comms if c["phase"] == p) for p in ("forward", "backward")},
            "memory_per_rank": self.memory_per_rank(),
            "activations_per_layer_korthikanti": self.korthikanti_per_layer(),
            "seconds": dict(self.seconds),
        }

    def as_text(self) -> str:
        lines = [f"{self.model}: plan {self.plan} on a mesh of {self.devices} device(s)"]
        for r in self.regions:
            times = f" x {r.count}" if r.count > 1 else ""
            n_bwd = len(r.backward.fusion.ops) if r.backward else 0
            lines.append(f"region {r.name}{times}: forward {len(r.forward.fusion.ops)} ops, backward {n_bwd} ops")
            for label, placement in _parameter_shardings(r).items():
                lines.append(f"  {label:40} {placement}")
        comms = self.communications()
        lines.append("communications per step (bytes each rank sends with ring algorithms):")
        groups: dict[tuple, list[dict]] = {}
        for c in comms:
            groups.setdefault((c["phase"], c["region"], c["kind"], str(c["shape"]), c["dtype"]), []).append(c)
        for (phase, region, kind, shape, dtype), cs in groups.items():
            per = f" ({len(cs) // max(1, self._count(region))} per layer)" if self._count(region) > 1 else ""
            lines.append(f"  {phase:8} {region:10} {len(cs):5} x {kind:15} {dtype:>8}{shape:20}{per} {_size(sum(c['bytes'] for c in cs)):>12}")
        for phase in ("forward", "backward"):
            lines.append(f"  {phase}: {sum(c['phase'] == phase for c in comms)} collectives, "
                         f"{_size(sum(c['bytes'] for c in comms if c['phase'] == phase))} per rank")
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
            lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        return "\n".join(lines)

    def _count(self, name: str) -> int:
        return next((r.count for r in self.regions if r.name == name), 1)


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
    f = r.forward.source
    out = {}
    for v in f.inputs:
        if isinstance(v, TensorValue) and f.role(v.name) == "parameter":
            p = r.forward.shardings[v.name][0]
            out[f.label(v.name)] = str(p) if axis_split(p) else "replicated"
    return out


# ---------------------------------------------------------------------------------------------
# entry points


def plan(model: torch.nn.Module, *example_args, plan: str = "megatron", devices: int = 2, target: str = "nvfuser") -> ModelReport:
    """Trace ``model`` on ``example_args`` once, on meta tensors (nothing is computed and the
    parameters are not touched), shard forward and backward for ``devices`` devices, and report
    (``ModelReport``). One region: the whole model, traced as it is."""
    import time

    from nvtp.frontend.capture import capture
    from nvtp.parallel import _meta_copy

    start = time.perf_counter()
    meta = _meta_copy(model)
    args = [torch.empty(a.shape, dtype=a.dtype, device="meta", requires_grad=a.requires_grad)
            if isinstance(a, torch.Tensor) else a for a in example_args]
    captured = capture(meta, *args)
    traced = time.perf_counter() - start
    start = time.perf_counter()
    fwd, bwd = shard_pair(captured.forward, captured.backward, plan, DeviceMesh.of_size(devices), target=target)
    return ModelReport(type(model).__name__, plan, devices, [Region("model", 1, fwd, bwd)],
                       {"trace": traced, "shard": time.perf_counter() - start})


def explain_gpt(cfg, *, layers: int, plan: str = "megatron", devices: int = 8, dtype: torch.dtype = torch.bfloat16,
                target: str = "nvfuser", regional: bool = True) -> ModelReport:
    """nvtp's GPT with ``cfg`` at ``layers`` layers, traced on meta tensors. ``regional`` (the
    default) traces one block and the model without blocks, and counts the block ``layers``
    times; ``regional=False`` traces the whole model (seconds a layer)."""
    import time

    start = time.perf_counter()
    mesh = DeviceMesh.of_size(devices)
    shape = {"s": cfg.seq_len, "b": cfg.batch, "h": cfg.n_embd, "a": cfg.n_head, "t": devices, "L": layers}
    name = f"GPT ({layers} layers, hidden {cfg.n_embd}, {cfg.n_head} heads, sequence {cfg.seq_len}, batch {cfg.batch}, {str(dtype).replace('torch.', '')})"
    if not regional:
        captured = _trace_gpt(cfg, layers, dtype)
        traced = time.perf_counter() - start
        fwd, bwd = shard_pair(captured.forward, captured.backward, plan, mesh, target=target)
        return ModelReport(name, plan, devices, [Region("model", 1, fwd, bwd)],
                           {"trace": traced, "shard": time.perf_counter() - start - traced}, shape)
    c_outer, c_block = _trace_gpt(cfg, 0, dtype), _trace_gpt(cfg, None, dtype)
    traced = time.perf_counter() - start
    o_fwd, o_bwd = shard_pair(c_outer.forward, c_outer.backward, plan, mesh, target=target)
    b_fwd, b_bwd = shard_pair(c_block.forward, c_block.backward, plan, mesh, target=target)
    regions = [Region("outer", 1, o_fwd, o_bwd), Region("block", layers, b_fwd, b_bwd)]
    return ModelReport(name, plan, devices, regions, {"trace": traced, "shard": time.perf_counter() - start - traced}, shape)


@functools.lru_cache(maxsize=8)
def _trace_gpt(cfg, n_layer: int | None, dtype: torch.dtype):
    """The captured fusions of GPT(cfg) with ``n_layer`` layers, or of one Block (None), on meta
    tensors; kept, so that explaining several plans traces once."""
    from dataclasses import replace

    from nvtp.frontend.capture import capture
    from nvtp.models import gpt

    with torch.device("meta"):
        if n_layer is None:
            return capture(gpt.Block(cfg).to(dtype), gpt.example_input(cfg, dtype=dtype, device="meta"))
        model = gpt.GPT(replace(cfg, n_layer=n_layer)).to(dtype)
    tokens = [torch.zeros(cfg.batch, cfg.seq_len, dtype=torch.long, device="meta") for _ in range(2)]
    return capture(model, *tokens)
