"""``nvtp replay FILE --plan P --devices N``: run a dump sharded on a mesh of processes.

Every rank parses the file and shards it the same way, builds the same random whole inputs
from the seed, keeps only its shards, and runs the sharded fusion on the reference backend with
torch.distributed collectives. With ``check``, rank 0 gathers and reassembles the outputs and
compares them with a single-device run of the unsharded fusion.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from nvtp.ir.parser import DumpError


@dataclass(frozen=True)
class MeshJob:
    file: str
    plan: str | None
    devices: int | None
    seed: int = 0
    check: bool = False
    timeout: float = 60.0


def prepare(job: MeshJob):
    """The sharded fusion ``job`` runs (the same on every rank); raises before any communication."""
    from nvtp import dump
    from nvtp.dump.sharded import from_dump
    from nvtp.sharding.pipeline import shard, shard_pair
    from nvtp.sharding.placements import DeviceMesh

    d = dump.load(job.file)
    if job.plan is None:
        sharded = from_dump(d)
        if sharded is None:
            raise DumpError("the file has no device schedule; give --plan (megatron, megatron-sp or name=placement;...) and --devices", job.file)
        if job.devices is not None and job.devices != sharded.mesh.size:
            raise DumpError(f"the file is sharded for {sharded.mesh.size} devices, not {job.devices}", job.file)
        return sharded
    if job.devices is None:
        raise DumpError("--plan needs --devices N", job.file)
    mesh = DeviceMesh.of_size(job.devices)
    fusion = d.fusion
    if fusion.attrs.get("role") == "backward":
        fwd_name = fusion.attrs.get("forward")
        if not fwd_name:
            raise DumpError("a backward fusion is sharded with its forward, but the file does not name one (nvtp_info 'forward')", job.file)
        fwd_path = Path(job.file).with_name(fwd_name)
        forward = dump.load(fwd_path).fusion
        return shard_pair(forward, fusion, job.plan, mesh)[1]
    return shard(fusion, job.plan, mesh)


def worker(rank: int, world: int, init_method: str | None, job: MeshJob) -> int:
    import torch
    import torch.distributed as dist

    from nvtp import dump
    from nvtp.execute import reference, spmd
    from nvtp.execute.collectives import DistComm
    from nvtp.execute.launch import init_group

    sharded = prepare(job)
    if sharded.mesh.size != world:
        print(f"nvtp replay: the sharding needs {sharded.mesh.size} ranks, the process group has {world}", file=sys.stderr)
        return 3
    init_group(rank, world, init_method, job.timeout)
    try:
        inputs = dump.random_inputs(sharded.source, seed=job.seed)
        local = spmd.local_inputs(sharded, inputs, rank)
        log: list = []
        outputs = spmd.run_rank(sharded, local, DistComm(), seed=job.seed, log=log)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object([o.cpu() if isinstance(o, torch.Tensor) else o for o in outputs], gathered, dst=0)
        if rank != 0:
            return 0
        held = sum(t.nbytes for t in local if isinstance(t, torch.Tensor))
        whole_bytes = sum(t.nbytes for t in inputs if isinstance(t, torch.Tensor))
        collectives = [c for c in log if c.kind != "local"]
        print(f"{job.file}: ran on {world} processes ({dist.get_backend()}); rank 0 holds {held} of {whole_bytes} input bytes; "
              f"{len(collectives)} collectives: {', '.join(c.kind + ' ' + c.value for c in collectives) or 'none'}")
        if not job.check:
            return 0
        whole = spmd.assemble_outputs(sharded, gathered)
        single = reference.run(sharded.source, inputs, seed=job.seed)
        checks = dump.check_outputs(sharded.source, whole, single)
        for c in checks:
            print(f"  {c.name:>8} {c.dtype.value:>8} {str(list(c.shape)):22} rel. error {c.rel_error:.3e}  {'ok' if c.ok else 'FAIL'}")
        ok = all(c.ok for c in checks)
        print(f"check of {world} ranks against a single-device run: {'passed' if ok else 'FAILED'}")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def run(job: MeshJob) -> int:
    """Run ``job`` on a local mesh of processes, or as this rank under ``torchrun``."""
    import os

    from nvtp.execute.launch import spawn, under_torchrun

    sharded = prepare(job)  # refuse bad input here, before starting anything
    if under_torchrun():
        return worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, job)
    codes = spawn(worker, sharded.mesh.size, job)
    if any(c == 3 for c in codes):
        return 3
    if codes[0] == 1 and all(c in (0, 1) for c in codes):
        return 1
    if any(codes):
        bad = [r for r, c in enumerate(codes) if c]
        print(f"nvtp replay: rank(s) {bad} failed with exit code(s) {[codes[r] for r in bad]}", file=sys.stderr)
        return 4
    return 0
