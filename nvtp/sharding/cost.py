"""The cost model, in one place: a machine's rates and links, the time of an op, of a
collective, of a collective matmul's ring, and what a schedule of collectives hides behind
compute. Estimates, stated with their numbers (``Machine.describe``); nothing here is measured
unless a machine's description says so.

    machine = MACHINES["h100-ib"]
    machine.link(mesh, axis)              # (bytes/s, latency) of the link an axis's collectives cross
    exposure(sharded, schedule, machine)  # compute, communication, and what the step still waits for
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nvtp.ir.graph import TensorValue
from nvtp.sharding.overlap import Issue, Ring, Schedule, collectives_of
from nvtp.sharding.placements import DeviceMesh
from nvtp.sharding.placements import local_shape as shape_of
from nvtp.sharding.sharded import ShardedFusion


# ---------------------------------------------------------------------------------------------
# what the schedule hides, under a stated machine model


@dataclass(frozen=True)
class Machine:
    """A machine for estimates: dense 16-bit matmul rate, memory bandwidth, and the two links a
    collective may run over (bytes per second each rank sends, and a latency per collective):
    inside a node and between nodes. Ranks are laid out as the mesh's shape reads, the last axis
    fastest (Megatron's order: tp innermost), ``devices_per_node`` to a node; an axis's
    collectives cross nodes when its ranks, with those of the axes inside it, span more than a
    node. Estimates, stated with their numbers: nothing here is measured unless ``describe`` says so."""

    name: str
    flops: float  # matmul FLOP/s a device sustains
    memory: float  # bytes/s (HBM)
    intra: tuple[float, float]  # inside a node: (bytes/s per rank, seconds of latency per collective)
    inter: tuple[float, float]  # between nodes
    devices_per_node: int = 8
    describe: str = ""
    block_overhead: float = 5e-6  # seconds one more, smaller matmul costs (a kernel launch and a stream switch; on CPU, Python)
    memory_per_device: float = 80e9  # bytes a device holds (HBM)
    op_overhead: float = 0.0  # seconds every op costs besides its FLOPs or bytes (a fusing GPU backend: ~0; the reference backend on CPU: Python's call)
    kind_latency: tuple[tuple[str, int, float], ...] = ()  # (kind, ranks, seconds): a latency measured for that kind on that many ranks (0: any), instead of the link's

    def crosses_nodes(self, mesh: DeviceMesh, axis: int) -> bool:
        """Whether the collectives of ``axis`` of ``mesh`` run between nodes."""
        return math.prod(mesh.shape[axis:]) > self.devices_per_node

    def link(self, mesh: DeviceMesh, axis: int) -> tuple[float, float]:
        """(bytes/s per rank, latency) of the link ``axis``'s collectives run over."""
        return self.inter if self.crosses_nodes(mesh, axis) else self.intra

    def collective_seconds(self, mesh: DeviceMesh, axis: int, kind: str | None, nbytes: float) -> float:
        """Seconds a collective of ``kind`` takes on ``axis``'s link, each rank sending ``nbytes``:
        a latency (the one measured for the kind on as many ranks, or on any (0), ``kind_latency``;
        else the link's) and the bytes at the link's bandwidth. A point-to-point step is kind "sendrecv"."""
        bw, latency = self.link(mesh, axis)
        n = mesh.shape[axis]
        latency = next((s for k, ranks, s in self.kind_latency if k == kind and ranks in (n, 0)), latency)
        return latency + nbytes / bw


MACHINES: dict[str, Machine] = {m.name: m for m in (
    Machine("h100-nvlink", flops=0.6 * 989e12, memory=0.8 * 3.35e12, intra=(0.8 * 450e9, 10e-6), inter=(0.8 * 450e9, 10e-6),
            devices_per_node=8,
            describe="8x H100 SXM in one node: 989 TFLOP/s bf16 dense at 60%, 3.35 TB/s HBM at 80%, NVLink 450 GB/s a "
                     "direction per GPU at 80% for every mesh axis, 10 us a collective"),
    Machine("h100-ib", flops=0.6 * 989e12, memory=0.8 * 3.35e12, intra=(0.8 * 450e9, 10e-6), inter=(0.8 * 50e9, 20e-6),
            devices_per_node=8,
            describe="H100 nodes of 8 GPUs: inside a node NVLink (450 GB/s at 80%), between nodes 400 Gb/s InfiniBand a GPU "
                     "(50 GB/s at 80%), 20 us a collective across nodes; the mesh's last axis fastest, so tp stays in a node"),
    Machine("cpu-gloo", flops=4.12e+10, memory=5.237e+09, intra=(7.824e+08, 0.002746), inter=(7.824e+08, 0.002746), devices_per_node=1024,
            describe='CPU processes on one host, one torch thread a rank, gloo over loopback; calibrated by tools/calibrate.py'
                     ' 2026-11-27 13:55 UTC with 4 ranks at once on 2 cores (load 3.7-4.5): 41.2 GFLOP/s a rank (F.linear), '
                     "5.24 GB/s written (torch.add), 6.2 us an op, collectives' latency allgather on 2 2026 us, allgather on 4"
                     ' 3550 us, allreduce on 2 1711 us, allreduce on 4 4303 us, reduce_scatter on 2 2746 us, reduce_scatter on'
                     ' 4 14009 us, sendrecv on 2 2255 us (else 2746 us) + bytes sent at 0.78 GB/s (groups of 2 and 4 in 4 '
                     'processes)',
            block_overhead=6.198e-06, op_overhead=6.198e-06, memory_per_device=20e9,
            kind_latency=(('allgather', 2, 0.002026),
                          ('allgather', 4, 0.00355),
                          ('allreduce', 2, 0.001711),
                          ('allreduce', 4, 0.004303),
                          ('reduce_scatter', 2, 0.002746),
                          ('reduce_scatter', 4, 0.01401),
                          ('sendrecv', 0, 0.002255))),
)}


def default_machine(target: str) -> Machine:
    """The machine a program for ``target`` is planned for when none is named: GPUs over NVLink
    for nvFuser, CPU processes over gloo for the reference backend."""
    return MACHINES["h100-nvlink" if target == "nvfuser" else "cpu-gloo"]


def op_seconds(op, machine: Machine, local_shape, factor=None) -> float:
    """A rough time for one op on one rank: matmul-like ops by FLOPs, the rest by the bytes they
    write (a fusing backend writes fewer; this is an upper bound for the light ops). ``factor``
    (value name -> number, default 1): how many times larger than its shape a value is on the
    rank costed (the planner's microbatches: a value carrying the batch, 1/M of the traced one);
    a product scales with its operand that carries the batch (never both: the batch is summed or kept).
    Every op costs the machine's ``op_overhead`` besides."""
    return machine.op_overhead + _work_seconds(op, machine, local_shape, factor)


def _work_seconds(op, machine: Machine, local_shape, factor=None) -> float:
    """``op_seconds`` without the machine's per-op overhead."""
    outs = [v for v in op.outputs if isinstance(v, TensorValue)]
    if op.kind in ("linear", "matmul"):
        a, b = (local_shape(v) for v in op.operands[:2])
        k = a[-1]
        n = b[0] if op.kind == "linear" else b[-1]
        # the operand that carries the batch: the factor farthest from 1 (a microbatch's is below 1, never max)
        scale = max((factor(v.name) for v in op.operands[:2]), key=lambda f: abs(math.log(f))) if factor is not None else 1.0
        return 2 * math.prod(a) * n * scale / machine.flops if k else 0.0
    if op.kind in ("sdpfa_fwd", "sdpfa_bwd"):
        q = local_shape(op.arg("query"))
        kv = local_shape(op.arg("key"))
        flops = 4 * math.prod(q) * kv[-2] * (2.5 if op.kind == "sdpfa_bwd" else 1.0)
        return flops * (factor(op.arg("query").name) if factor is not None else 1.0) / machine.flops
    return sum(math.prod(local_shape(v)) * v.dtype.itemsize * (factor(v.name) if factor is not None else 1.0)
               for v in outs) / machine.memory


@dataclass
class Exposure:
    """One fusion's communication under a machine: ``ideal`` the collectives' own time, ``exposed``
    what the step waits for them (blocking: all of it), ``compute`` the ops' time."""

    compute: float
    ideal: float
    exposed: float
    blocking_exposed: float

    @property
    def hidden(self) -> float:
        """The fraction of the collectives' time the schedule hides behind compute."""
        return 0.0 if self.ideal == 0 else 1.0 - self.exposed / self.ideal


def exposure(sharded: ShardedFusion, schedule: Schedule | None, machine: Machine) -> Exposure:
    """Simulate one rank: ops run in order; each mesh axis's link carries its collectives one at
    a time, in the order they start; a ``set`` waits for its collective. Exposed time is the step
    time minus the ops' time (``simulate``, summed)."""
    t = simulate(sharded, schedule, machine)
    ideal = 0.0
    for c in collectives_of(sharded):  # every collective, a ring's too (it runs as steps, never launched whole)
        ideal += machine.collective_seconds(sharded.mesh, c.axis, c.kind, c.bytes)
    return Exposure(t.compute, ideal, max(0.0, t.total - t.compute), ideal)


@dataclass(frozen=True)
class Sizes:
    """How large the values of a sharded fusion are on the rank being costed: as traced (``scale``
    1), or, for the planner's microbatches, the values that carry the batch (``batched``: names
    of the source fusion's values) ``scale`` times as large. A ``set``'s result is its value's size."""

    scale: float = 1.0
    batched: frozenset = frozenset()

    def factor_of(self, sharded: ShardedFusion):
        """value name -> its factor, for ``op_seconds``: a set's result counts as its value."""
        if self.scale == 1.0 or not self.batched:
            return None
        steps = sharded.set_steps
        batched, scale = self.batched, self.scale

        def factor(name: str) -> float:
            step = steps.get(name)
            return scale if (step.value if step is not None else name) in batched else 1.0
        return factor


@dataclass
class Timeline:
    """One rank running one sharded fusion (``simulate``): every op's own time (``compute``, per
    op index), what each op waited for its collectives (``waited``, per op index, and per mesh
    axis), each axis's collectives' own time (``busy``), and the whole."""

    total: float
    compute_by_op: dict[int, float]
    waited_by_op: dict[int, float]
    waited_by_axis: dict[int, float]
    busy: dict[int, float]  # per mesh axis: its collectives' own time, as started (a bucket is one)
    waits: list[tuple[int, int, float]] = field(default_factory=list)  # (op index, mesh axis, seconds) of each wait
    busy_by_op: dict[int, tuple[int, float]] = field(default_factory=dict)  # a set's index -> (its axis, its collective's seconds)

    @property
    def compute(self) -> float:
        return sum(self.compute_by_op.values())

    @property
    def ideal(self) -> float:
        return sum(self.busy.values())


def simulate(sharded: ShardedFusion, schedule: Schedule | None, machine: Machine, sizes: Sizes | None = None) -> Timeline:
    """Simulate one rank: ops run in order; each mesh axis's link carries its collectives one at a
    time, in the order they start (an ``Issue`` of the schedule, or an unscheduled ``set`` where it
    stands); a ``set`` waits for its collective, and so does the op an issue is ``done`` after; a
    collective matmul's ring takes its ``ring_seconds``. ``sizes``: the values' sizes on the rank costed (default: as traced)."""
    f = sharded.fusion
    factor = (sizes or Sizes()).factor_of(sharded)

    def local(v):
        return shape_of(v.shape, sharded.shardings[v.name], sharded.mesh) if v.name in sharded.shardings else v.shape

    def scaled(name: str, nbytes: int) -> float:
        return nbytes * (factor(name) if factor is not None else 1.0)

    comms = {c.name: c for c in collectives_of(sharded)}

    def comm_seconds(axis: int, kind: str, nbytes: float) -> float:
        return machine.collective_seconds(sharded.mesh, axis, kind, nbytes)

    busy: dict[int, float] = {}
    busy_by_op: dict[int, tuple[int, float]] = {}
    waits: list[tuple[int, int, float]] = []
    issues = schedule.by_position() if schedule is not None else {}
    finished: dict[int, list[Issue]] = {}
    for issue in schedule.issues if schedule is not None else ():
        if issue.done is not None:
            finished.setdefault(issue.done, []).append(issue)
    done: dict[str, float] = {}
    link_free: dict[int, float] = {}
    compute_by_op: dict[int, float] = {}
    waited_by_op: dict[int, float] = {}
    waited_by_axis: dict[int, float] = {}
    now = 0.0

    def launch(issue: Issue) -> None:
        start = max(now, link_free.get(issue.axis, 0.0))
        nbytes = sum(scaled(n, comms[n].bytes) for n in issue.sets if n in comms) if factor is not None else issue.bytes
        took = comm_seconds(issue.axis, issue.kind, nbytes)
        end = start + took
        link_free[issue.axis] = end
        done.update((name, end) for name in issue.sets)
        busy[issue.axis] = busy.get(issue.axis, 0.0) + took
        first = min(issue.waits)
        busy_by_op[first] = (issue.axis, busy_by_op.get(first, (issue.axis, 0.0))[1] + took)

    def wait(i: int, until: float, axis: int) -> None:
        nonlocal now
        if until > now:
            waited_by_op[i] = waited_by_op.get(i, 0.0) + until - now
            waited_by_axis[axis] = waited_by_axis.get(axis, 0.0) + until - now
            waits.append((i, axis, until - now))
            now = until

    rings = {r.at: r for r in getattr(schedule, "rings", ())}
    in_rings = {k for r in rings.values() for c in r.chains for k in c}
    for issue in issues.get(-1, ()):
        launch(issue)
    for i, op in enumerate(f.ops):
        name = op.outputs[0].name if op.outputs else ""
        if i in in_rings:  # its time is the ring's
            pass
        elif i in rings:  # a collective matmul: the ring's steps beside the blocks of its matmuls
            blocking, ringed = ring_seconds(sharded, rings[i], machine, factor)
            work = sum(op_seconds(f.ops[k], machine, local, factor) for k in rings[i].linears)
            compute_by_op[i] = work
            now += work
            wait(i, now + max(0.0, ringed - work), rings[i].axis)
        elif op.kind == "set" and name in comms:
            if name not in done:  # unscheduled: it starts here and blocks
                launch(Issue(None, i, (name,), (i,), comms[name].axis, comms[name].kind, comms[name].bytes))
            wait(i, done[name], comms[name].axis)
        elif op.kind not in ("define_tensor", "define_scalar"):
            t = op_seconds(op, machine, local, factor)
            compute_by_op[i] = t
            now += t
        for issue in finished.get(i, ()):  # waited for as a whole here (``Issue.done``), before the issues starting here
            wait(i, done[issue.sets[0]], issue.axis)
        for issue in issues.get(i, ()):
            launch(issue)
    return Timeline(now, compute_by_op, waited_by_op, waited_by_axis, busy, waits, busy_by_op)


def ring_seconds(sharded: ShardedFusion, ring: Ring, machine: Machine, factor=None) -> tuple[float, float]:
    """(the collective and its matmuls one after the other, the ring) in seconds on ``machine``:
    blocking is the collective's time plus the matmuls'; the ring runs n blocks of matmul and
    n - 1 steps, each step beside a block: (n - 1) * max(step, block) + block, plus the machine's
    ``block_overhead`` for each of the n smaller matmuls. ``factor``: as ``op_seconds`` takes it."""
    f = sharded.fusion

    def local(v):
        return shape_of(v.shape, sharded.shardings[v.name], sharded.mesh) if v.name in sharded.shardings else v.shape

    n = ring.steps + 1
    bw, latency = machine.link(sharded.mesh, ring.axis)
    step = sharded.set_steps[ring.name]
    k = factor(ring.name) if factor is not None else 1.0
    collective = latency + step.bytes * k / bw
    compute = sum(op_seconds(f.ops[j], machine, local, factor) for j in ring.linears)  # on the whole (gathered) rows
    one_step = latency + ring.step_bytes * k / bw
    block = compute / n
    return collective + compute, (n - 1) * max(one_step, block) + block + n * machine.block_overhead
