"""What a candidate costs: its step time and its memory per rank, from the sample's sharded programs.

    costing = Costing(sampler, facts)
    costed = costing.evaluate(candidate)    # a Costed: terms of the step time, memory per rank
    costed.seconds, costed.terms, costed.memory

The model of one training step (forward, backward, optimizer), in one place:

* **Compute**: each op of the sharded sample at the machine's rates (``cost.op_seconds``: a
  product by its FLOPs, the rest by the bytes it writes), on the rank's part of each value.
* **Communication**: every collective of the Program (its ``set`` ops' planned steps: kind,
  bytes, the mesh axis and the link that axis crosses, ``Machine.link``), run as the schedule
  starts them (buckets, prefetch, collective matmul rings): ``cost.simulate`` runs one rank,
  and what the step still waits for each axis is that axis's term (``Strategy.cost_terms``).
  A step is never shorter than any link's collectives end to end.
* **Depth**: the sample has ``count`` blocks (``nvtp.auto.sample``); block 0 holds the head, the
  last block the tail, the middle block is counted L - count more times. A pipeline stage holds
  the blocks of nvtp's balanced cut (``nvtp.pipeline.stages.balance``, by FLOPs, as it runs).
* **Microbatches**: a pipeline runs ``M`` microbatches; the values that carry the batch are 1/M
  as large (``cost.Sizes``); each microbatch runs the stage's whole program (its data-parallel
  gradient reductions too, as nvtp's pipeline does). The pipeline strategy adds its bubble and
  point-to-point transfers (``PipelineParallel.cost_terms``).
* **Recomputation**: the forward ops the backward re-runs (``nvtp.frontend.recompute``'s plan)
  at their forward time, and the collectives among them (a block's tensor-parallel ones).
* **Optimizer**: Adam over the rank's parameters, memory-bound: 28 bytes an element (read the
  weight, gradient and two moments, write the weight and moments, 4 bytes each).
* **Memory per rank** (bytes, the rank's part of each tensor): parameters; gradients (the
  parameters' dtype); Adam's state (two fp32 moments, and an fp32 master copy of 16-bit weights:
  12 bytes an element, 8 for fp32, as ``nvtp.report`` counts); and the fullest moment of the
  step as the runtime allocates it (``nvtp.auto.memory``): the forward's end, holding every
  activation it saves for the backward, or the backward's fullest moment, holding the gradients,
  the saved activations not yet freed, its own values and its collectives' buffers (DDP's flat
  copy of a gradient bucket, FSDP's gathered weights and gradient chunks: each a term named by
  its axis strategy, ``Strategy.memory_label``), plus one block's recomputed values; a pipeline
  stage's other microbatches in flight keep their activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from nvtp import driver
from nvtp.auto.candidate import Candidate
from nvtp.auto.memory import ACTIVATIONS, VALUES, Peak, live_peak, local_bytes
from nvtp.auto.sample import Facts, Sample
from nvtp.frontend.recompute import layers_of, plan_recompute, sequence_of
from nvtp.ir.graph import TensorValue, defines_input
from nvtp.pipeline import schedule as pipeline_schedule
from nvtp.pipeline.stages import Cost, balance, op_cost
from nvtp.sharding import axes
from nvtp.sharding.collective_matmul import plan_rings
from nvtp.sharding.cost import Sizes, simulate
from nvtp.sharding.overlap import BUCKET_BYTES, schedule_collectives
from nvtp.sharding.placements import axis_split

OPTIMIZER_BYTES = 28  # Adam: read weight, gradient, two moments; write weight, two moments (4 bytes each)


@dataclass
class _Phase:
    """One phase of a sharded sample program, with each op's sample block."""

    sharded: Any  # ShardedFusion
    block: list[int]  # per op index of the sharded fusion
    at: dict[str, int]  # source value name -> the sharded op index making it


@dataclass
class _Priced:
    program: Any  # nvtp.program.Program (unscheduled)
    phases: dict[str, _Phase]
    schedules: dict[Any, dict[str, Any]] = field(default_factory=dict)  # collective_matmul -> phase -> Schedule


@dataclass
class _Blocks:
    """Per sample block: seconds of ops, what the step waited for each axis, each axis's collectives' own time."""

    compute: list[float]
    waited: list[dict[str, float]]
    busy: list[dict[str, float]]
    op_seconds: dict[int, float]  # sharded op index -> its seconds (for recomputation)


@dataclass
class StageCost:
    """One pipeline stage (or the whole program), per microbatch."""

    blocks: tuple[int, int]  # model blocks [first, end)
    compute: float
    waited: dict[str, float]
    recompute: float
    memory: dict[str, float]

    @property
    def seconds(self) -> float:
        return self.compute + sum(self.waited.values()) + self.recompute


@dataclass
class Costed:
    """A candidate priced: its stages, the step's terms (seconds; they sum to ``seconds``) and the memory per rank of its fullest stage."""

    candidate: Candidate
    machine: Any
    facts: Facts
    stages: list[StageCost]
    microbatches: int
    junction_bytes: float  # what crosses a pipeline cut per microbatch, per rank (forward; its gradient the same)
    tp_gather: float  # seconds to make that value whole over its tensor-parallel axis before sending
    optimizer: float
    _programs: list[tuple[str, Any, Any, float]] = field(default_factory=list)
    terms: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    memory_notes: dict[str, float] = field(default_factory=dict)

    @property
    def options(self) -> dict[str, Any]:
        return self.candidate.opts

    @property
    def bottleneck(self) -> StageCost:
        return max(self.stages, key=lambda s: s.seconds)

    @property
    def stage_seconds(self) -> list[float]:
        return [s.seconds for s in self.stages]

    def waited(self, axis: str) -> float:
        """What the step waits for ``axis``'s collectives: the slowest stage's, each microbatch."""
        return self.microbatches * self.bottleneck.waited.get(axis, 0.0)

    def programs(self) -> Iterator[tuple[str, Any, Any, float]]:
        """(phase, sharded fusion, size factor, times it runs a step) of the slowest stage's programs."""
        return iter(self._programs)

    def transfer_seconds(self, stage: int) -> float:
        """A stage's point-to-point transfers per microbatch, forward and backward, on the pipeline's
        link: each received activation and each sent one (and their gradients back), each made
        whole over tensor parallelism first."""
        n = len(self.stages)
        if n < 2:
            return 0.0
        mesh = self.candidate.mesh()
        axis = next(i for i, name in enumerate(mesh.names) if axes.AXES[name].cuts_stages)
        cuts = (stage > 0) + (stage < n - 1)
        return cuts * 2 * (self.machine.collective_seconds(mesh, axis, "sendrecv", self.junction_bytes) + self.tp_gather)

    @property
    def in_flight_bytes(self) -> float:
        return self.memory_notes.get("in_flight_bytes", 0.0)

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())

    @property
    def total_memory(self) -> float:
        return self.memory.get("total", 0.0)


class Costing:
    """Prices candidates; shards each (sample, program mesh, plan, FSDP) once, through the compile driver."""

    def __init__(self, sampler: Callable[[tuple], Sample], facts: Facts):
        self.sampler = sampler
        self.facts = facts
        self.machine = facts.machine
        self._priced: dict[tuple, _Priced] = {}
        self._blocks: dict[tuple, _Blocks] = {}
        self._cuts: dict[tuple, tuple[int, ...]] = {}
        self._recompute: dict[tuple, Any] = {}
        self._peaks: dict[tuple, tuple[Peak, Peak]] = {}
        self.shardings = 0

    # -- programs ---------------------------------------------------------------------------

    def sample_key(self, c: Candidate) -> tuple:
        mesh = c.program_mesh()
        options = axes.trace_options(mesh, c.opts.get("plan", "megatron"))
        split = options["split_parts"] and not c.pipelined
        return (bool(options["ring"]), bool(split))

    def priced(self, c: Candidate) -> tuple[Sample, _Priced]:
        sample = self.sampler(self.sample_key(c))
        mesh = c.program_mesh()
        shard = {k: v for k, v in c.shard_options().items() if k != "collective_matmul"}
        key = (sample.key, mesh.shape, mesh.names, tuple(sorted(shard.items())))
        got = self._priced.get(key)
        if got is None:
            plan = shard.pop("plan", "megatron")
            program = driver.shard(sample.traced, plan, mesh, self.facts.backend, overlap=False, **shard)
            self.shardings += 1
            phases = {}
            for phase, sharded, blocks in (("forward", program.forward, sample.blocks.forward),
                                           ("backward", program.backward, sample.blocks.backward)):
                if sharded is not None:
                    phases[phase] = _phase(sharded, blocks, sample.blocks.parameters)
            got = self._priced[key] = _Priced(program, phases)
        return sample, got

    def schedule(self, priced: _Priced, cm: Any) -> dict[str, Any]:
        if priced.program.mesh.size == 1:
            return {}
        if cm not in priced.schedules:
            priced.schedules[cm] = {phase: schedule_collectives(p.sharded, rings=plan_rings(p.sharded, self.machine, cm))
                                    for phase, p in priced.phases.items()}
        return priced.schedules[cm]

    def blocks(self, c: Candidate, sample: Sample, priced: _Priced, phase: str, scale: float) -> _Blocks:
        cm = c.opts.get("collective_matmul", False)
        key = (id(priced), phase, cm, scale)
        got = self._blocks.get(key)
        if got is not None:
            return got
        p = priced.phases[phase]
        schedule = self.schedule(priced, cm).get(phase)
        t = simulate(p.sharded, schedule, self.machine, Sizes(scale, sample.batched))
        names = p.sharded.mesh.names
        n = sample.count
        compute = [0.0] * n
        waited: list[dict[str, float]] = [{} for _ in range(n)]
        busy: list[dict[str, float]] = [{} for _ in range(n)]
        for i, s in t.compute_by_op.items():
            compute[p.block[i]] += s
        share = _shares(p, schedule, Sizes(scale, sample.batched).factor_of(p.sharded))
        for i, axis, s in t.waits:  # a bucket's wait and time: its members' layers, by their bytes
            for b, f in share.get(i, ((p.block[i], 1.0),)):
                w = waited[b]
                w[names[axis]] = w.get(names[axis], 0.0) + s * f
        for i, (axis, s) in t.busy_by_op.items():
            for b, f in share.get(i, ((p.block[i], 1.0),)):
                w = busy[b]
                w[names[axis]] = w.get(names[axis], 0.0) + s * f
        got = self._blocks[key] = _Blocks(compute, waited, busy, dict(t.compute_by_op))
        return got

    # -- the pipeline's cut --------------------------------------------------------------------

    def cut(self, sample: Sample, stages: int) -> tuple[int, ...]:
        """The first block of each stage after the first: nvtp's balanced cut (by FLOPs) of the model's blocks."""
        L = self.facts.blocks
        key = (sample.key, stages)
        if key not in self._cuts:
            costs = [Cost() for _ in range(sample.count)]
            f, b = sample.traced.forward, sample.traced.backward
            for k, blk in sample.blocks.forward.items():
                costs[blk] = costs[blk] + op_cost(f.ops[k])
            for k, blk in sample.blocks.backward.items():
                costs[blk] = costs[blk] + op_cost(b.ops[k])
            per_block = [costs[sample_block(i, L, sample.count)] for i in range(L)]
            self._cuts[key] = balance(per_block, stages) if stages > 1 else ()
        return self._cuts[key]

    # -- one candidate ---------------------------------------------------------------------------

    def evaluate(self, c: Candidate) -> Costed:
        sample, priced = self.priced(c)
        L, m = self.facts.blocks, c.microbatches
        scale = 1.0 / m
        program = priced.program
        mesh = program.mesh
        bounds = (0, *self.cut(sample, c.stages), L) if c.pipelined else (0, L)
        fwd = self.blocks(c, sample, priced, "forward", scale)
        bwd = self.blocks(c, sample, priced, "backward", scale) if "backward" in priced.phases else None
        rec = self.recompute(c, sample, priced, fwd, scale)
        mem = self.block_memory(sample, priced, scale)
        stages = []
        for s in range(len(bounds) - 1):
            mult = [0] * sample.count
            for i in range(bounds[s], bounds[s + 1]):
                mult[sample_block(i, L, sample.count)] += 1
            compute, waited = 0.0, {}
            for phase in (fwd, bwd):
                if phase is None:
                    continue
                pc = sum(k * phase.compute[b] for b, k in enumerate(mult))
                pw: dict[str, float] = {}
                for b, k in enumerate(mult):
                    for a, w in phase.waited[b].items():
                        pw[a] = pw.get(a, 0.0) + k * w
                for a in mesh.names:  # never shorter than a link's collectives end to end
                    link = sum(k * phase.busy[b].get(a, 0.0) for b, k in enumerate(mult))
                    if link > pc + sum(pw.values()):
                        pw[a] = pw.get(a, 0.0) + link - pc - sum(pw.values())
                compute += pc
                for a, w in pw.items():
                    waited[a] = waited.get(a, 0.0) + w
            recompute = sum(k * rec["seconds"][b] for b, k in enumerate(mult))
            peaks = self.transients(c, sample, priced, scale, mult, mem["saved_names"])
            stages.append(StageCost((bounds[s], bounds[s + 1]), compute, waited, recompute,
                                    self.stage_memory(c, s, len(bounds) - 1, mult, mem, rec, peaks)))
        worst = max(stages, key=lambda st: st.memory["total"])
        params = worst.memory["parameter_elements"]
        costed = Costed(c, self.machine, self.facts, stages, m, *self.junction(sample, priced, scale),
                        optimizer=params * OPTIMIZER_BYTES / self.machine.memory)
        slow = costed.bottleneck
        mult = [0] * sample.count
        for i in range(*slow.blocks):
            mult[sample_block(i, L, sample.count)] += 1
        costed._programs = [(phase, priced.phases[phase].sharded, Sizes(scale, sample.batched).factor_of(priced.phases[phase].sharded),
                             m * sum(mult) / max(1, sample.count)) for phase in priced.phases]
        terms = {"compute": m * slow.compute}
        for s, _ in c.used():
            terms.update(s.cost_terms(costed))
        terms["recompute"] = m * slow.recompute
        terms["optimizer"] = costed.optimizer
        costed.terms = {k: v for k, v in terms.items() if v or k == "compute"}
        costed.memory = {k: v for k, v in worst.memory.items() if k != "parameter_elements"}
        costed.memory_notes = {"in_flight_bytes": worst.memory.get("activations", 0.0)}
        return costed

    # -- recomputation ------------------------------------------------------------------------------

    def recompute(self, c: Candidate, sample: Sample, priced: _Priced, fwd: _Blocks, scale: float) -> dict[str, list[float]]:
        """Per sample block: seconds the backward spends recomputing, bytes no longer kept, bytes kept instead."""
        n = sample.count
        none = {"seconds": [0.0] * n, "dropped": [0.0] * n, "kept": [0.0] * n}
        if c.recompute == "none" or "backward" not in priced.phases:
            return none
        key = (sample.key, c.recompute)
        if key not in self._recompute:
            t = sample.traced
            self._recompute[key] = plan_recompute(t.forward, t.backward, c.recompute, layers_of(t), sequence_of(t))
        plan = self._recompute[key]
        if plan.empty:
            return none
        p = priced.phases["forward"]
        sizes = Sizes(scale, sample.batched).factor_of(p.sharded)
        out = {"seconds": [0.0] * n, "dropped": [0.0] * n, "kept": [0.0] * n}
        src = t_forward = sample.traced.forward
        rerun = set()
        for k in plan.ops:
            i = p.at.get(src.ops[k].outputs[0].name)
            if i is None:
                continue
            rerun.add(i)
            out["seconds"][p.block[i]] += fwd.op_seconds.get(i, 0.0)
        ops = p.sharded.fusion.ops
        for i, op in enumerate(ops):  # a collective between re-run ops runs again (blocking)
            if op.kind == "set" and i + 1 < len(ops) and (i + 1) in rerun:
                axis_s = self._set_seconds(p.sharded, op.outputs[0].name, sizes)
                out["seconds"][p.block[i]] += axis_s
        for name, key_ in ((plan.dropped, "dropped"), (plan.kept, "kept")):
            for v in name:
                if t_forward.role(v) == "parameter":
                    continue
                i = p.at.get(v)
                b = p.block[i] if i is not None else 0
                out[key_][b] += local_bytes(p.sharded, t_forward.value(v), sizes)
        return out

    def _set_seconds(self, sharded: Any, name: str, factor: Any) -> float:
        step = sharded.set_steps.get(name)
        if step is None or not step.is_communication:
            return 0.0
        return self.machine.collective_seconds(sharded.mesh, step.axis, step.kind, step.bytes * (factor(name) if factor is not None else 1.0))

    # -- memory --------------------------------------------------------------------------------

    def block_memory(self, sample: Sample, priced: _Priced, scale: float) -> dict[str, Any]:
        """Per sample block: parameter bytes and elements (trainable), other inputs' bytes, saved activation bytes;
        and the sample's largest transients (forward; backward besides its gradients)."""
        n = sample.count
        f = priced.phases["forward"]
        factor = Sizes(scale, sample.batched).factor_of(f.sharded)
        src = f.sharded.source
        weights = sample.traced.weights
        params = [0.0] * n
        elements = [0.0] * n
        bytes16 = [0.0] * n
        buffers = [0.0] * n
        for v in src.inputs:
            if not isinstance(v, TensorValue) or src.role(v.name) != "parameter":
                continue
            label = src.label(v.name)
            b = sample.blocks.parameters.get(label, 0)
            nbytes = local_bytes(f.sharded, v, None)
            if weights is None or label in weights or label.split("[", 1)[0] in weights:
                params[b] += nbytes
                elements[b] += nbytes / v.dtype.itemsize
                if v.dtype.itemsize < 4:
                    bytes16[b] += nbytes / v.dtype.itemsize
            else:
                buffers[b] += nbytes
        saved = [0.0] * n
        saved_names = set()
        b_src = priced.phases["backward"].sharded.source if "backward" in priced.phases else None
        if b_src is not None:
            saved_names = {b_src.info[v.name].source for v in b_src.inputs if b_src.role(v.name) == "saved"}
        for name in saved_names:
            if name not in src.values:
                continue
            v = src.value(name)
            if not isinstance(v, TensorValue) or src.role(name) == "parameter":
                continue
            i = f.at.get(name)
            b = f.block[i] if i is not None else 0
            saved[b] += local_bytes(f.sharded, v, factor)
        return {"parameters": params, "elements": elements, "elements16": bytes16, "buffers": buffers, "saved": saved,
                "saved_names": saved_names}

    def transients(self, c: Candidate, sample: Sample, priced: _Priced, scale: float, mult: list[int], saved: set[str]) -> tuple[Peak, Peak]:
        """The fullest moment of the forward (besides what it saves) and of the backward (besides
        the gradients it returns), as the runtime allocates them (``nvtp.auto.memory``), for a
        stage of ``mult`` blocks per sample block."""
        cm = c.opts.get("collective_matmul", False)
        key = (id(priced), cm, scale, tuple(mult))
        if key not in self._peaks:
            schedules = self.schedule(priced, cm)
            out = []
            for phase in ("forward", "backward"):
                p = priced.phases.get(phase)
                if p is None:
                    out.append(Peak())
                    continue
                mesh = p.sharded.mesh
                exclude = saved if phase == "forward" else {v.name for v in p.sharded.fusion.outputs}
                held, kept = None, 0.0
                if phase == "backward":  # the saved values (to their last reader) and what the caller holds (``nvtp.parallel._Run``)
                    f, src = priced.phases["forward"], p.sharded.source
                    held = {}
                    for v in src.inputs:
                        if src.role(v.name) == "saved":  # every saved activation, to its last reader in the backward
                            i = f.at.get(src.info[v.name].source)
                            held[v.name] = float(mult[f.block[i]] if i is not None else 1)
                        elif src.role(v.name) == "grad":  # each output's incoming gradient, this rank's part (zeros if unused)
                            kept += local_bytes(p.sharded, v, Sizes(scale, sample.batched).factor_of(p.sharded))
                    fsrc, read = f.sharded.source, {src.info[v.name].source for v in src.inputs if src.role(v.name) == "saved"}
                    f_factor = Sizes(scale, sample.batched).factor_of(f.sharded)
                    kept += sum(local_bytes(f.sharded, v, f_factor) for v in fsrc.outputs  # the forward's outputs the backward does not read
                                if isinstance(v, TensorValue) and v.name not in read and fsrc.role(v.name) == "output")

                def label(kind: str, axis: int, parameter: bool, names=mesh.names) -> str | None:
                    s = axes.AXES.get(names[axis])
                    return s.memory_label(kind, parameter) if s is not None else None

                out.append(live_peak(p.sharded, schedules.get(phase), Sizes(scale, sample.batched).factor_of(p.sharded),
                                     exclude=exclude, block=p.block, mult=mult, label=label, cap=BUCKET_BYTES, held=held, kept=kept))
            self._peaks[key] = tuple(out)
        return self._peaks[key]

    def stage_memory(self, c: Candidate, stage: int, stages: int, mult: list[int], mem: dict[str, Any],
                     rec: dict[str, list[float]], peaks: tuple[Peak, Peak]) -> dict[str, float]:
        def total(key: str) -> float:
            return sum(k * mem[key][b] for b, k in enumerate(mult))

        params = total("parameters") + total("buffers")
        elements = total("elements")
        sixteen = total("elements16")
        optimizer = 12 * sixteen + 8 * (elements - sixteen)
        grads = total("parameters")
        per_mb = sum(k * (mem["saved"][b] - rec["dropped"][b] + rec["kept"][b]) for b, k in enumerate(mult))
        moments = (("F", 1, 0), ("B", 1, 0))
        if c.pipelined:
            moments = pipeline_schedule.flights(c.opts.get("schedule", "1f1b"), stage, stages, c.microbatches)
        recomputed = max(rec["dropped"]) if any(rec["dropped"]) else 0.0
        forward, backward = peaks
        # A forward ends holding every activation it saves, besides those of the other microbatches
        # in flight; a backward holds them all to its end (``backward.parts[ACTIVATIONS]``) and makes
        # the gradients; a pipeline sums each microbatch's gradients into a buffer from its first
        # backward on (``nvtp/pipeline/runtime.py``). The fullest of the stage's moments:
        changed = sum(k * (rec["kept"][b] - rec["dropped"][b]) for b, k in enumerate(mult))
        fullest = None
        for kind, in_flight, done in moments:
            accumulated = grads if done else 0.0
            if kind == "F":
                moment = (forward, per_mb * in_flight, forward.bytes + accumulated)
            else:
                moment = (backward, per_mb * (in_flight - 1) + backward.parts.get(ACTIVATIONS, 0.0) + changed,
                          backward.bytes - backward.parts.get(ACTIVATIONS, 0.0) + grads + accumulated + recomputed)
            if fullest is None or moment[1] + moment[2] > fullest[1] + fullest[2]:
                fullest = moment
        at, activations, peak = fullest
        parts = {k: v for k, v in at.parts.items() if k not in (VALUES, ACTIVATIONS)}  # each axis's named term (its collectives' buffers)
        transient = peak - sum(parts.values())
        return {"parameters": params, "gradients": grads, "optimizer": optimizer, "activations": activations,
                "peak_transient": transient, **parts, "total": params + optimizer + activations + peak, "parameter_elements": elements}

    def junction(self, sample: Sample, priced: _Priced, scale: float) -> tuple[float, float]:
        """(bytes per rank of what one block hands the next, per microbatch; seconds to make it whole over
        tensor parallelism): what a pipeline cut sends."""
        if sample.count < 2 or "forward" not in priced.phases:
            return 0.0, 0.0
        p = priced.phases["forward"]
        f = p.sharded.fusion
        src = p.sharded.source
        factor = Sizes(scale, sample.batched).factor_of(p.sharded)
        crossing = set()
        for i, op in enumerate(f.ops):
            if p.block[i] != 1 or defines_input(op):
                continue
            for u in op.operands:
                j = p.at.get(u.name)
                if j is not None and p.block[j] == 0 and not defines_input(f.ops[j]) and u.name in src.values:  # a weight is not sent
                    crossing.add(u.name)
        mesh = p.sharded.mesh
        nbytes = gather = 0.0
        for name in crossing:
            v = src.value(name)
            if not isinstance(v, TensorValue):
                continue
            whole = v.nbytes * (factor(name) if factor is not None else 1.0)
            sharding = p.sharded.shardings[name]
            for a, pl in enumerate(sharding):
                split = axes.AXES[mesh.names[a]] if mesh.names[a] in axes.AXES else None
                if split is not None and split.splits_batch:
                    whole /= mesh.shape[a]
            nbytes += whole
            for a, pl in enumerate(sharding):
                s = axes.AXES.get(mesh.names[a])
                if s is not None and s.runs_plan and axis_split(pl) is not None and mesh.shape[a] > 1:  # made whole over tp before it is sent
                    gather += self.machine.collective_seconds(mesh, a, "allgather", whole * (mesh.shape[a] - 1) / mesh.shape[a])
        return nbytes, gather


def sample_block(i: int, blocks: int, count: int) -> int:
    """The sample block that model block ``i`` (of ``blocks``) costs as: 0 the first, the last the last, else the middle."""
    if i == 0:
        return 0
    if i == blocks - 1:
        return count - 1
    return min(1, count - 1)


def _phase(sharded: Any, blocks: dict[int, int], parameters: dict[str, int]) -> _Phase:
    """Each op of ``sharded`` in its sample block: a source op's by its result's name; a ``set`` of
    a parameter (FSDP's gather) in the parameter's block, of a value in the block of the op making
    it (a gradient's reduction, placed at the end, belongs to its layer), else of the op after it."""
    src = sharded.source
    producer = {v.name: k for k, op in enumerate(src.ops) for v in op.outputs}
    ops = sharded.fusion.ops
    out = [0] * len(ops)
    at: dict[str, int] = {}
    pending: list[int] = []
    last = 0
    for i, op in enumerate(ops):
        name = op.outputs[0].name if op.outputs else ""
        k = producer.get(name)
        if op.kind == "set" or k is None:
            pending.append(i)
            continue
        for v in op.outputs:
            at[v.name] = i
        b = blocks.get(k, last) if not defines_input(op) else 0
        for j in pending:
            out[j] = b
        pending = []
        out[i] = b
        last = b
    for j in pending:
        out[j] = last
    made = {v.name: i for i, op in enumerate(ops) for v in op.outputs}
    for i, op in enumerate(ops):  # a set by what it moves
        if op.kind != "set" or not op.operands:
            continue
        u = op.operands[0].name
        while u in made and ops[made[u]].kind == "set" and ops[made[u]].operands:  # a set of a set: the first one's value
            u = ops[made[u]].operands[0].name
        if src.role(u) == "parameter" and u in src.values:
            out[i] = parameters.get(src.label(u), out[i])
        elif u in at and not defines_input(ops[at[u]]):
            out[i] = out[at[u]]
    return _Phase(sharded, out, at)


def _shares(p: _Phase, schedule: Any, factor: Any) -> dict[int, tuple[tuple[int, float], ...]]:
    """A bucket's set ops -> (block, fraction of the bucket's bytes) of its members."""
    if schedule is None:
        return {}
    index = {op.outputs[0].name: i for i, op in enumerate(p.sharded.fusion.ops) if op.outputs}
    out = {}
    for issue in schedule.issues:
        if len(issue.sets) < 2:
            continue
        weights: dict[int, float] = {}
        for name in issue.sets:
            step = p.sharded.set_steps[name]
            b = p.block[index[name]]
            weights[b] = weights.get(b, 0.0) + step.bytes * (factor(name) if factor is not None else 1.0) + 1.0
        total = sum(weights.values())
        parts = tuple((b, w / total) for b, w in weights.items())
        for name in issue.sets:
            out[index[name]] = parts
    return out


__all__ = ["Costing", "Costed", "StageCost", "sample_block", "OPTIMIZER_BYTES"]
