"""``nvtp replay FILE --plan P --devices N``: run a dump sharded on a mesh of processes.

Every rank parses the file and shards it the same way, builds the same random whole inputs
from the seed, keeps only its shards, and runs the sharded fusion on the reference backend with
torch.distributed collectives. With ``check``, rank 0 gathers and reassembles the outputs and
compares them with a single-device run of the unsharded fusion.

``--mesh DPxTP`` (``mesh_shape``) runs on a 2-D mesh (dp, tp) of dp·tp processes: the plan on tp,
the data plan on dp (``nvtp.sharding.compose``; ``--fsdp`` splits the weights over dp too). Each
rank joins one process group per mesh axis (``torch.distributed.new_group``) and runs each
``set`` on its axis's group (``MeshComm``). A dump sharded over a 2-D mesh replays the same way.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nvtp.ir.parser import DumpError
from nvtp.sharding.reshard import COLLECTIVES
from nvtp import dump
from nvtp.demo import fault_from_env, trigger
from nvtp.dump.sharded import from_dump, mesh_text
from nvtp.errors import EXIT_BAD_INPUT, EXIT_RUNTIME
from nvtp.execute import backends, reference, spmd
from nvtp.execute.collectives import DistComm, MeshComm
from nvtp.execute import launch
from nvtp.execute.launch import _quiet_stdout, init_group, run_rank, under_torchrun
from nvtp.ir.graph import TensorValue
from nvtp.mesh import MeshError, named, parse
from nvtp.sharding.placements import axis_split
from nvtp.sharding.propagate import ShardingError

if TYPE_CHECKING:  # pragma: no cover
    from nvtp.program import Program
    from nvtp.sharding.sharded import ShardedFusion


@dataclass(frozen=True)
class MeshJob:
    file: str
    plan: str | None
    devices: int | None
    seed: int = 0
    check: bool = False
    timeout: float = 60.0
    mesh: tuple[int, int] | None = None  # (dp, tp): a 2-D mesh instead of ``devices``
    fsdp: bool = False  # on a 2-D mesh, split the weights over dp too (ZeRO-3)
    backend: str = "reference"  # the backend whose target ``--plan`` shards for (the replay runs on the reference backend)


def check_mesh_options(devices: int | None, mesh: str | None, fsdp: bool) -> tuple[int, int] | None:
    """The (dp, tp) of ``--mesh``, after refusing ``--devices`` with ``--mesh`` and ``--fsdp`` without it
    (``nvtp.mesh`` decides; this only spells the refusals with the command line's flags)."""
    if mesh is not None and devices is not None:
        raise MeshError(f"give either --devices N (a 1-D mesh) or --mesh DPxTP (a 2-D mesh), not both "
                        f"(got --devices {devices} --mesh {mesh})")
    if fsdp and mesh is None:
        raise MeshError("--fsdp splits the weights over the dp axis of a 2-D mesh; give --mesh DPxTP with it (e.g. --mesh 2x2)")
    if mesh is None:
        return None
    if "=" in mesh:  # named axes (cp=4, cp=2,tp=2): the mesh itself (nvtp.mesh.named)
        return named(mesh)
    shape = parse(mesh)
    if len(shape) != 2:
        raise MeshError(f"--mesh {mesh!r}: expected DPxTP, two positive integers joined by x (e.g. --mesh 2x2: dp=2, tp=2); "
                        "a 1-D mesh is --devices N")
    return shape


@dataclass(frozen=True)
class Replay:
    """What a replay runs: the driver's ``Program`` and the phase of it the file is."""

    program: "Program"
    phase: str  # "forward" or "backward"

    @property
    def sharded(self) -> "ShardedFusion":
        return dict(self.program.phases())[self.phase]


def prepare(job: MeshJob) -> Replay:
    """The program ``job`` runs (the same on every rank), from the compile driver: the file's own
    device schedule adopted as a program (``driver.adopt``), or the program for ``--plan`` (a
    backward file with the forward it names); its collectives scheduled as ``nvtp.jit``'s are.
    Raises before any communication."""
    d = dump.load(job.file)
    if job.plan is None:
        sharded = from_dump(d)
        if sharded is None:
            raise DumpError("the file has no device schedule; give --plan (megatron, megatron-sp or name=placement;...) and --devices N "
                            "or --mesh DPxTP", job.file)
        if job.devices is not None and job.devices != sharded.mesh.size:
            raise DumpError(f"the file is sharded for {sharded.mesh.size} devices, not {job.devices}", job.file)
        if job.mesh is not None and tuple(job.mesh) != sharded.mesh.shape:
            raise DumpError(f"the file is sharded for a {mesh_text(sharded.mesh)} mesh, not {'x'.join(map(str, job.mesh))}", job.file)
        if job.fsdp:
            raise DumpError("--fsdp applies when sharding with --plan; this file's schedule already places every weight", job.file)
        from nvtp import driver  # lazy: loads Thunder; CLI file commands load this module without it

        return Replay(driver.adopt(sharded, job.backend), "forward")
    if job.devices is None and job.mesh is None:
        raise DumpError("--plan needs --devices N (a 1-D mesh) or --mesh DPxTP (a 2-D mesh)", job.file)
    from nvtp import driver  # lazy: loads Thunder; CLI file commands load this module without it

    program = driver.compile(d, plan=job.plan, mesh=job.mesh if job.mesh is not None else job.devices, fsdp=job.fsdp,
                             backend=job.backend)
    return Replay(program, "backward" if program.backward is not None else "forward")


def worker(rank: int, world: int, init_method: str | None, job: MeshJob) -> int:
    """One rank of the replay; returns its exit code (a failure stops the other ranks)."""
    return run_rank(rank, lambda: _replay_rank(rank, world, init_method, job))


def _replay_rank(rank: int, world: int, init_method: str | None, job: MeshJob) -> int:
    replay = prepare(job)  # bad input is refused before joining the group (run() checked the world size)
    sharded = replay.sharded
    init_group(rank, world, init_method, job.timeout)
    try:
        fault = fault_from_env()  # NVTP_INJECT_FAULT=RANK:0:KIND: this rank fails in the replay (tests)
        if fault is not None and fault[:2] == (rank, 0):
            trigger(fault[2], "replay")
        comm = DistComm() if sharded.mesh.ndim == 1 else mesh_comm(sharded.mesh, rank)
        inputs = dump.random_inputs(sharded.source, seed=job.seed)
        local = spmd.local_inputs(sharded, inputs, rank)
        log: list = []
        runner = backends.BACKENDS["reference"].lower(replay.program, comm)  # the program's steps, its schedule, as given
        outputs = runner(replay.phase, local, seed=job.seed, log=log)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object([_picklable(o) for o in outputs], gathered, dst=0)
        if rank != 0:
            return 0
        gathered = [[_unpickled(o) for o in outs] for outs in gathered]
        return _report_on_rank0(job, world, sharded, inputs, local, log, gathered)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def mesh_comm(mesh, rank: int):
    """This rank's collectives on a mesh of several axes: one process group per axis
    (``torch.distributed.new_group``; every rank creates every group, in the same order, as
    new_group requires), each wrapped in a ``DistComm``."""
    per_axis = []
    for axis in range(mesh.ndim):
        mine = None
        for ranks in mesh.groups(axis):
            with _quiet_stdout():  # gloo prints "[Gloo] Rank r is connected to ..." for every group
                group = dist.new_group(list(ranks))
            if rank in ranks:
                mine = group
        per_axis.append(DistComm(mine))
    return MeshComm(mesh.index(rank), mesh.size, per_axis)


def _say(*args) -> None:
    """print, except that a reader gone away (`| head -1`) silences the rest of the report instead
    of failing the rank: the check still runs and its verdict is the exit status."""
    try:
        print(*args, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _report_on_rank0(job: MeshJob, world: int, sharded: "ShardedFusion", inputs, local, log, gathered) -> int:
    """Rank 0's summary and, with ``job.check``, the check of the gathered outputs (0 or 1)."""
    held = sum(t.nbytes for t in local if isinstance(t, torch.Tensor))
    whole_bytes = sum(t.nbytes for t in inputs if isinstance(t, torch.Tensor))
    collectives = [c for c in log if c.kind in COLLECTIVES]
    mesh = sharded.mesh
    shape = "" if mesh.ndim == 1 else f", a {'x'.join(map(str, mesh.shape))} mesh ({', '.join(mesh.names)})"
    on = (lambda c: "") if mesh.ndim == 1 else (lambda c: f" on {mesh.names[c.axis]}")
    _say(f"{job.file}: ran on {world} processes ({dist.get_backend()}{shape}); rank 0 holds {held} of {whole_bytes} input bytes; "
          f"{len(collectives)} collectives: {', '.join(c.kind + ' ' + c.value + on(c) for c in collectives) or 'none'}")
    if not job.check:
        return 0
    whole = spmd.assemble_outputs(sharded, gathered)
    single = reference.run(sharded.source, inputs, seed=job.seed)
    checks = dump.check_outputs(sharded.source, whole, single)
    for c in checks:
        _say(f"  {c.name:>8} {c.dtype.value:>8} {str(list(c.shape)):22} rel. error {c.rel_error:.3e}  {'ok' if c.ok else 'FAIL'}")
    ok = all(c.ok for c in checks)
    _say(f"check of {world} ranks against a single-device run: {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


# torch 2.10 pickles a torch.uint64 tensor (the RNG seed and offset a dropout fusion outputs) but
# cannot unpickle it ("UntypedStorage has no attribute 'dtype'"): such tensors travel through
# gather_object as their int64 bit pattern and are viewed back on rank 0.
def _picklable(x):
    if not isinstance(x, torch.Tensor):
        return x
    x = x.cpu()
    if x.dtype == torch.uint64:
        return ("uint64", x.view(torch.int64))
    return x


def _unpickled(x):
    if isinstance(x, tuple) and len(x) == 2 and x[0] == "uint64":
        return x[1].view(torch.uint64)
    return x


def check_world(sharded: "ShardedFusion", world: int) -> None:
    """The sharding's mesh must be the process group."""
    if sharded.mesh.size != world:
        raise ShardingError(f"the sharding is for a mesh of {sharded.mesh.size} devices but the process group has {world} rank(s); "
                            f"launch {sharded.mesh.size} processes (torchrun --nproc-per-node {sharded.mesh.size}) or shard for {world}")


def run(job: MeshJob) -> int:
    """Run ``job`` on a local mesh of processes, or as this rank under ``torchrun``; an exit code
    (0 ok, 1 check failed, 3 bad input, 4 a rank failed: the one that failed first is named)."""
    sharded = prepare(job).sharded  # refuse bad input here, before starting anything
    if under_torchrun():
        check_world(sharded, int(os.environ["WORLD_SIZE"]))
        check_memory(sharded.source, job.file, ranks=1, sharded=sharded, check=job.check)
        return worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, job)
    check_memory(sharded.source, job.file, ranks=sharded.mesh.size, sharded=sharded, check=job.check)
    codes = launch.spawn(worker, sharded.mesh.size, job)
    if any(c == EXIT_BAD_INPUT for c in codes):
        return EXIT_BAD_INPUT
    if codes[0] == 1 and all(c in (0, 1) for c in codes):
        return 1
    if any(codes):
        print(f"nvtp replay: {codes.summary()}", file=sys.stderr)
        return EXIT_RUNTIME
    return 0


# ---------------------------------------------------------------------------------------------
# memory: refuse a replay this machine cannot hold, before allocating anything


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def replay_bytes(fusion, *, sharded=None, check: bool = False) -> tuple[int, str]:
    """Bytes the reference backend holds to replay ``fusion`` (it keeps every value of a run),
    per rank when ``sharded``; and the largest value, described."""
    values = [v for op in fusion.ops for v in op.outputs if isinstance(v, TensorValue)]
    largest = max(values, key=lambda v: v.nbytes, default=None)
    total = sum(v.nbytes for v in values)
    if sharded is not None:
        inputs = sum(v.nbytes for v in sharded.source.inputs if isinstance(v, TensorValue))  # each rank draws them whole
        local = 0
        for op in sharded.fusion.ops:
            for v in op.outputs:
                if isinstance(v, TensorValue):
                    parts = 1  # the rank's share: each split mesh axis divides the tensor by its extent
                    for n, p in zip(sharded.mesh.shape, sharded.shardings.get(v.name, ())):
                        parts *= n if axis_split(p) is not None else 1
                    local += v.nbytes // parts
        total = inputs + local
    if check:  # a second run in float64
        total += sum(v.numel * 8 for v in values if v.dtype.is_float)
    what = largest.describe() if largest is not None else "none"
    return total, what


def check_memory(fusion, path: str | None, *, ranks: int = 1, sharded=None, check: bool = False) -> None:
    """Raise ``DumpError`` if replaying needs more memory than this machine has available."""
    need, largest = replay_bytes(fusion, sharded=sharded, check=check)
    need *= ranks
    have = available_bytes()
    if have is None or need <= 0.9 * have:
        return
    gib = 2**30
    raise DumpError(f"replaying needs about {need / gib:.1f} GiB on this machine (the reference backend keeps every value; "
                    f"the largest is {largest}), more than the {have / gib:.1f} GiB available; replay a smaller configuration "
                    "or shard it over more machines", path)
