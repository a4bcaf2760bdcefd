"""``PipelineProgram``: what ``nvtp.driver.compile_pipeline`` returns, and what a pipeline run performs.

    pp = nvtp.driver.compile_pipeline(model, idx, targets, mesh="2x1x2", microbatches=4)
    pp.stages[0].blocks, pp.programs[0]       # a stage's blocks; its Program on its (dp, tp) sub-mesh
    pp.p2p()                                   # point-to-point steps on the pp axis, per microbatch, with bytes per rank
    print(pp.as_text())                        # what nvtp explain --mesh PPxDPxTP prints
    pp.as_data()                               # what nvtp.plan gives (the same numbers)
    pp.write_nvfuser("out/")                   # each stage's fusions as nvFuser files, with the stage's sub-mesh

The runtime (``nvtp.pipeline.runtime``) runs exactly these stages, transfers and schedule; a test
counts what it sends against ``p2p()``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from nvtp.errors import InputError
from nvtp.pipeline import schedule as sched
from nvtp.sharding.axes.pp import NAME as STAGES, Layout, layout_of
from nvtp.pipeline.stages import StageError, Staged
from nvtp.sharding.placements import local_shape
from nvtp.steps import Step
from nvtp.frontend.blocks import NotRepeatable, find_repeated


def check_pipeline(module: torch.nn.Module, args: Sequence[Any], mesh: Any, microbatches: int, schedule: str):
    """(layout, the repeated blocks, one microbatch's arguments) or a clear error before any work:
    fewer blocks than stages, a batch the microbatches do not divide, an unknown schedule."""
    layout = layout_of(mesh)
    sched.check(schedule)
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise InputError(f"microbatches={microbatches!r}: give a positive number of microbatches per step (e.g. microbatches={layout.pp})")
    try:
        rep = find_repeated(module)
    except NotRepeatable as e:
        raise StageError(f"nvtp cuts pipeline stages at block boundaries, and {type(module).__name__} has none: {e}") from None
    if rep.count < layout.pp:
        raise StageError(f"{type(module).__name__} has {rep.count} blocks ({rep.prefix}.0 .. {rep.prefix}.{rep.count - 1}) but the "
                         f"mesh has pp={layout.pp} stages; each stage holds at least one block: use pp <= {rep.count}")
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.ndim]
    if not tensors:
        raise InputError("a pipeline splits the batch into microbatches: pass at least one tensor argument with a batch dimension")
    batch = tensors[0].shape[0]
    if batch % microbatches:
        lower = max(d for d in range(1, microbatches + 1) if batch % d == 0)
        raise InputError(f"this rank's batch of {batch} does not split into microbatches={microbatches}; pass a batch that is a multiple "
                         f"of {microbatches} (e.g. {microbatches * max(1, batch // microbatches)}), or microbatches={lower}")
    mb = tuple(a[: a.shape[0] // microbatches] if isinstance(a, torch.Tensor) and a.ndim else a for a in args)
    return layout, rep, mb


@dataclass
class PipelineProgram:
    staged: Staged
    programs: list  # one nvtp.program.Program per stage, on layout.submesh(stage)
    layout: Layout
    microbatches: int
    schedule: str
    traced: Any  # the whole model's Traced (one microbatch of the dp group)
    batch_shapes: tuple  # the shapes of one rank's tensor arguments (its whole batch)
    plan: str
    backend: str
    tied: dict = field(default_factory=dict)  # a tied parameter's other names -> its first (nvtp.frontend.tied.aliases)
    parameters: frozenset = frozenset()  # the module's parameter names (every name of a tied one)

    @property
    def stages(self):
        return self.staged.stages

    def stage_of(self, rank: int) -> int:
        return self.layout.coords(rank)[0]

    # -- what crosses the cuts ---------------------------------------------------------------

    def _sharding_of(self, stage: int, phase: str, name: str):
        program = self.programs[stage]
        sharded = program.forward if phase == "forward" else program.backward
        for src, out in zip(sharded.source.outputs, sharded.fusion.outputs):
            if src.name == name:
                return sharded.sharding(out.name)
        return sharded.sharding(name)

    def holders(self) -> dict[str, list[int]]:
        """Each parameter (by its first name) -> the stages whose fusions read it, in order; the
        first holds it (``nvtp.dtensor.OnStage``), a later one keeps a replica."""
        out: dict[str, list[int]] = {}
        for s in self.stages:
            for label in s.parameters:
                if label in self.parameters:
                    name = self.tied.get(label, label)
                    if s.index not in out.setdefault(name, []):
                        out[name].append(s.index)
        return out

    def replica_steps(self, stage: int) -> tuple[list, list]:
        """(at the start of a step, at the end of its backward): for each weight several stages read
        that ``stage`` reads, the broadcast of its value from the stage that holds it, and the
        reduction of its gradient to that stage, as ``Step`` records on the pp axis (bytes: one
        rank's part, sent by ring algorithms' count for one message)."""
        start, end = [], []
        for name, stages in sorted(self.holders().items()):
            if len(stages) < 2 or stage not in stages:
                continue
            owner = stages[0]
            program = self.programs[owner]
            label = next(lab for lab in self.stages[owner].parameters if self.tied.get(lab, lab) == name)
            v = next(x for x in program.forward.source.inputs if program.forward.source.label(x.name) == label)
            shape = tuple(local_shape(v.shape, program.forward.sharding(v.name), program.mesh))
            nbytes = math.prod(shape) * v.dtype.itemsize
            to = "stages " + ", ".join(map(str, stages))
            start.append(Step("forward", "broadcast", STAGES, name, name, shape, v.dtype.value, nbytes, f"stage {owner}", to,
                              payload=nbytes))
            end.append(Step("backward", "reduce", STAGES, name, f"grad of {name}", shape, v.dtype.value, nbytes, to, f"stage {owner}",
                            payload=nbytes))
        return start, end

    def loss_step(self) -> list:
        """The step's loss, from the last stage to every stage (one float32 scalar)."""
        if self.layout.pp < 2:
            return []
        return [Step("forward", "broadcast", STAGES, "loss", "loss", (), "float32", 4, f"stage {self.layout.pp - 1}", "every stage",
                     payload=4)]

    def p2p(self) -> list[dict[str, Any]]:
        """Every point-to-point step of one microbatch on the pp axis: phase, from and to stage,
        the value's label, its whole shape, the shape each rank sends and its bytes (each of the
        sending stage's dp x tp ranks sends to the rank at its own (dp, tp) place in the next)."""
        out = []
        for t in self.staged.transfers:
            mesh = self.programs[t.src].mesh
            local = local_shape(t.shape, self._sharding_of(t.src, t.phase, t.value), mesh)
            itemsize = t.nbytes // max(1, math.prod(t.shape))
            out.append({"phase": t.phase, "src": t.src, "dst": t.dst, "value": t.value, "label": t.label, "shape": list(t.shape),
                        "local_shape": list(local), "dtype": t.dtype, "bytes": math.prod(local) * itemsize})
        return out

    def steps(self, stage: int, communication_only: bool = False) -> list:
        """Every step one rank of ``stage`` runs in one training step, in the order it runs them
        (``nvtp.program.Step`` records, as ``Program.steps()`` gives): for each action of the
        schedule, the transfers it receives on the pp axis (kind "recv"), the stage Program's
        steps of that phase (its dp / tp collectives), then the transfers it sends (kind "send").
        A send's or recv's ``bytes`` is the message's, one rank's part (``p2p()``); ``src`` and
        ``dst`` name the stages. Once a step, outside the schedule: first the broadcast of each
        weight tied across stages from its holder (``replica_steps``), last the reduction of its
        gradient to the holder, then the loss's broadcast from the last stage (``loss_step``)."""
        if not 0 <= stage < self.layout.pp:
            raise InputError(f"stage={stage}: this pipeline has stages 0..{self.layout.pp - 1}")
        by_phase: dict[str, list] = {"forward": [], "backward": []}
        for st in self.programs[stage].steps(communication_only):
            by_phase[st.phase].append(st)
        p2p = self.p2p()

        def moved(kind: str, p: dict) -> Step:
            return Step(p["phase"], kind, STAGES, p["value"], p["label"], tuple(p["local_shape"]), p["dtype"], p["bytes"],
                        f"stage {p['src']}", f"stage {p['dst']}", payload=p["bytes"])

        start, end = self.replica_steps(stage)
        out = list(start)
        for action in sched.actions(self.schedule, stage, self.layout.pp, self.microbatches):
            phase = "forward" if action.kind == "F" else "backward"
            out += [moved("recv", p) for p in p2p if p["phase"] == phase and p["dst"] == stage]
            out += by_phase[phase]
            out += [moved("send", p) for p in p2p if p["phase"] == phase and p["src"] == stage]
        return out + end + self.loss_step()

    # -- memory ------------------------------------------------------------------------------

    def activation_bytes(self, stage: int) -> int:
        """Bytes one rank of ``stage`` keeps per microbatch for its backward (saved values, its part)."""
        program = self.programs[stage]
        b = program.backward
        if b is None:
            return 0
        total = 0
        for v in b.source.inputs:
            if b.source.role(v.name) == "saved" and hasattr(v, "shape"):
                total += math.prod(local_shape(v.shape, b.sharding(v.name), b.mesh)) * v.dtype.itemsize
        return total

    def in_flight(self, stage: int) -> int:
        return sched.in_flight(self.schedule, stage, self.layout.pp, self.microbatches)

    def bubble(self) -> float:
        return sched.bubble(self.schedule, self.layout.pp, self.microbatches)

    # -- output ------------------------------------------------------------------------------

    def as_data(self) -> dict[str, Any]:
        """The plan as data: layout and groups, stages (blocks, cost, memory), p2p, schedule."""
        lay = self.layout
        stages = []
        for s in self.stages:
            program = self.programs[s.index]
            comms = program.communications()
            stages.append({"stage": s.index, "blocks": list(s.blocks), "ranks": list(program.mesh.devices),
                           "flops": s.cost.flops, "bytes": s.cost.bytes, "parameters": len(s.parameters),
                           "parameter_bytes_per_rank": program.parameter_bytes(),
                           "activation_bytes_per_microbatch": self.activation_bytes(s.index),
                           "in_flight_microbatches": self.in_flight(s.index),
                           "activation_bytes_per_rank": self.activation_bytes(s.index) * self.in_flight(s.index),
                           "collectives_per_microbatch": len(comms),
                           "collective_bytes_per_microbatch": sum(c.bytes for c in comms),
                           "step": _totals(self.steps(s.index, communication_only=True))})
        return lay.as_json() | {
                "cut": self.staged.chosen, "block_costs": [{"flops": c.flops, "bytes": c.bytes} for c in self.staged.block_costs],
                "stages": stages, "p2p": self.p2p(), "schedule": self.schedule, "microbatches": self.microbatches,
                "bubble": self.bubble(), "plan": self.plan, "backend": self.backend}

    def as_text(self, model: str = "") -> str:
        d = self.as_data()
        lay = self.layout
        lines = [f"nvtp pipeline plan{' of ' + model if model else ''}: mesh pp={lay.pp} x dp={lay.dp} x tp={lay.tp} "
                 f"({lay.size} devices, Megatron's layout: rank = (pp*{lay.dp} + dp)*{lay.tp} + tp), plan {self.plan}, "
                 f"backend {self.backend}", ""]
        for axis, what, groups in lay.group_lines():
            shown = ", ".join("[" + ", ".join(f"g{r}" for r in g) + "]" for g in groups[:4])
            lines.append(f"  {len(groups)} {what}-parallel groups: {shown}{', ...' if len(groups) > 4 else ''}")
        emb = d["groups"]["embedding"]
        lines.append(f"  {len(emb)} embedding groups (first and last stage): "
                     + ", ".join("[" + ", ".join(f"g{r}" for r in g) + "]" for g in emb[:4]) + (", ..." if len(emb) > 4 else ""))
        lines += ["", f"stages ({d['cut']} cut; cost of each block, forward + backward: "
                  + ", ".join(f"{c['flops'] / 1e6:.1f} MFLOP" for c in d["block_costs"]) + "):"]
        lines.append(f"  {'stage':>5}  {'blocks':<12} {'ranks':<20} {'GFLOP':>8} {'MB moved':>9} {'params/rank':>12} "
                     f"{'act/mb/rank':>12} {'in flight':>9} {'act/rank':>10}")
        for s in d["stages"]:
            blocks = f"{s['blocks'][0]}..{s['blocks'][-1]}" if len(s["blocks"]) > 1 else str(s["blocks"][0])
            ranks = ",".join(map(str, s["ranks"]))
            lines.append(f"  {s['stage']:>5}  {blocks:<12} {ranks[:20]:<20} {s['flops'] / 1e9:>8.3f} {s['bytes'] / 1e6:>9.2f} "
                         f"{_mb(s['parameter_bytes_per_rank']):>12} {_mb(s['activation_bytes_per_microbatch']):>12} "
                         f"{s['in_flight_microbatches']:>9} {_mb(s['activation_bytes_per_rank']):>10}")
        lines += ["", "point-to-point on the pp axis, per microbatch (each rank to the rank at its (dp, tp) place):"]
        for p in d["p2p"]:
            lines.append(f"  {p['phase']:<8} stage {p['src']} -> {p['dst']}  {p['label']:<24} whole {p['shape']}, "
                         f"per rank {p['local_shape']}: {p['bytes']} B")
        per_mb = sum(p["bytes"] for p in d["p2p"])
        lines.append(f"  total per microbatch per rank pair: {per_mb} B; per step ({self.microbatches} microbatches): "
                     f"{per_mb * self.microbatches} B")
        lines += ["", "one training step, per rank of each stage (steps(stage): the schedule's p2p and each microbatch's collectives):"]
        for s in d["stages"]:
            lines.append(f"  stage {s['stage']}: " + ", ".join(f"{t['count']} {k} ({t['bytes']} B)" for k, t in sorted(s["step"].items())))
        lines += ["", f"schedule {self.schedule}, {self.microbatches} microbatches: bubble (p-1)/(m+p-1) = "
                  f"{lay.pp - 1}/{self.microbatches + lay.pp - 1} = {d['bubble']:.3f}"]
        for s in range(lay.pp):
            acts = sched.actions(self.schedule, s, lay.pp, self.microbatches)
            lines.append(f"  stage {s}: " + " ".join(map(str, acts)))
        return "\n".join(lines)

    def write_nvfuser(self, directory: str | os.PathLike) -> list[Path]:
        """Each stage's forward and backward as nvFuser files (``stage<s>_fwd.py``, ``stage<s>_bwd.py``),
        each on its stage's sub-mesh of global device ids."""
        paths = []
        for s, program in enumerate(self.programs):
            paths += program.write_nvfuser(directory, name=f"stage{s}")
        return paths


def _totals(steps: list) -> dict[str, dict[str, int]]:
    """Per (axis, kind) of one rank's training step: how many steps and their bytes."""
    out: dict[str, dict[str, int]] = {}
    for st in steps:
        t = out.setdefault(f"{st.axis} {st.kind}", {"count": 0, "bytes": 0})
        t["count"] += 1
        t["bytes"] += st.bytes
    return out


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


__all__ = ["PipelineProgram", "check_pipeline"]
