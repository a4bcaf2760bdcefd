"""``nvtp demo``: the main job. Train a small GPT sharded over a local CPU mesh of processes and
check it against the same training on one process.

Every rank builds the same model from the same seed, wraps it with ``nvtp.jit`` (Thunder traces
it, nvtp shards it with the plan) and trains it with AdamW on the same token batches; rank 0 shows
the progress, the plan and the communication. The single-process run then repeats the training
with plain PyTorch, and the losses of every step and the final parameters are compared.
"""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
import time
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh
import torch.distributed as dist

from nvtp.sharding import axes
from nvtp.sharding.axes.cp import chunks
from nvtp.sharding.placements import DeviceMesh
from nvtp.checkpoint import latest_checkpoint, prune
from nvtp.dtensor import local as to_local
from nvtp.dump import relative_error
from nvtp.errors import EXIT_BAD_INPUT, EXIT_RUNTIME, RankFailure
from nvtp.execute import launch
from nvtp.execute.launch import _quiet_stdout, init_group, run_rank
from nvtp.models import gpt, hf
from nvtp.sharding.plans import check_plan
from nvtp.sharding.propagate import ShardingError
import nvtp


@dataclass
class TrainJob:
    config: str
    plan: str
    steps: int
    lr: float
    out: str
    verbose: bool = True
    optimizer: str = "sgd"  # SGD with momentum; "adamw" normalises rounding noise in zero gradients into full steps
    save_at: int | None = None  # save a checkpoint after this many steps ...
    save_dir: str | None = None  # ... here
    load_dir: str | None = None  # resume from this checkpoint (or the newest whole one under it)
    timeout: float = 60.0  # seconds a rank waits for a silent peer before the mesh stops (docs/faults.md)
    save_every: int | None = None  # checkpoint save_dir/step-NNNNNN every this many steps, keeping the newest two
    log_dir: str | None = None  # each rank appends {"step", "loss", "rss_kib", "seconds"} to rank<r>.jsonl here ...
    log_every: int = 1  # ... every this many steps
    inject_fault: tuple[int, int, str] | None = None  # (rank, step, "kill" | "raise" | "hang"): for tests of failure handling
    model: str = "nanogpt"  # nvtp's GPT (with ``config``), or a small Hugging Face causal LM: llama, gpt2, mistral, qwen2
    mesh: tuple[int, int] | None = None  # (dp, tp): a 2-D mesh, each dp rank training on its own part of every batch
    fsdp: bool = False  # with ``mesh``: the weights split over dp too (ZeRO-3)
    axes: tuple[str, ...] = axes.spelled(2)  # the names of ``mesh``'s axes: ("cp",) or ("cp", "tp") from --mesh cp=4 / cp=2,tp=2


def build_model(job: TrainJob) -> torch.nn.Module:
    """The model the job trains, seeded alike on every rank."""
    if job.model == "nanogpt":
        torch.manual_seed(0)
        return gpt.GPT(gpt.config(job.config))

    return hf.build(job.model)


def batch(job: TrainJob, step: int) -> tuple[tuple, dict]:
    """Step ``step``'s arguments, as the model is called: ``GPT(idx, targets)``, or a transformers
    model's ``model(input_ids, labels=input_ids)``."""
    if job.model == "nanogpt":
        return gpt.example_tokens(gpt.config(job.config), seed=step), {}

    idx = hf.batch(step)
    return (idx,), {"labels": idx}


def dp_part(args: tuple, kwargs: dict, dp_rank: int, dp: int) -> tuple[tuple, dict]:
    """dp rank ``dp_rank``'s rows of a step's batch (DDP's convention: each rank passes its own)."""
    def part(a):
        if not isinstance(a, torch.Tensor):
            return a
        rows = a.shape[0] // dp
        return a[dp_rank * rows:(dp_rank + 1) * rows].contiguous()

    return tuple(part(a) for a in args), {k: part(a) for k, a in kwargs.items()}


def batch_size(job: TrainJob) -> int:
    args, _ = batch(job, 0)
    return args[0].shape[0]


def loss_of(out) -> torch.Tensor:
    """The loss: the GPT returns it, a transformers model's output object holds it."""
    return out.loss if hasattr(out, "loss") else out


def rss_kib() -> int:
    """This process's resident memory (VmRSS), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


FAULT_ENV = "NVTP_INJECT_FAULT"  # "RANK:STEP:KIND" (kind kill, raise or hang): a fault in real training or replay (step 0), for tests


def fault_from_env() -> tuple[int, int, str] | None:
    """The fault ``NVTP_INJECT_FAULT=RANK:STEP:KIND`` asks for (tests of failure handling run
    ``nvtp demo`` or ``tools/train.py`` as users do, with one rank failing inside training)."""
    text = os.environ.get(FAULT_ENV)
    if not text:
        return None
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in ("kill", "raise", "hang"):
        raise ValueError(f"{FAULT_ENV}={text!r}: write RANK:STEP:KIND with KIND kill, raise or hang (e.g. 1:3:hang)")
    return int(parts[0]), int(parts[1]), parts[2]


def _inject(job: TrainJob, rank: int, step: int) -> None:
    if job.inject_fault is None or (job.inject_fault[0], job.inject_fault[1]) != (rank, step):
        return
    trigger(job.inject_fault[2], f"step {step}")


def trigger(kind: str, where: str) -> None:
    """Fail this process the way ``kind`` says (an injected fault, for tests): SIGKILL, raise, hang."""
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise RuntimeError(f"fault injected at {where}")
    elif kind == "hang":
        time.sleep(10**6)
    else:
        raise ValueError(f"unknown fault {kind!r}; use kill, raise or hang")


def make_optimizer(job: TrainJob, params) -> torch.optim.Optimizer:
    if job.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=job.lr)
    return torch.optim.SGD(params, lr=job.lr, momentum=0.9)


def _nvtp_mesh(job: TrainJob) -> DeviceMesh:
    return DeviceMesh.of_shape(job.mesh, job.axes)


def _share(job: TrainJob) -> str:
    """How much of each weight a rank holds, said in the mesh's terms."""
    mesh = _nvtp_mesh(job)
    plan, data = axes.find(mesh, "runs_plan"), axes.batch_axis(mesh)
    if plan is None:
        return " (weights whole" + (", split over dp at rest)" if job.fsdp else ")")
    k = mesh.shape[plan] * (mesh.shape[data] if job.fsdp and data is not None else 1)
    over = mesh.names[plan] + (f" and {mesh.names[data]}" if job.fsdp and data is not None else "")
    return f" (1/{k} of each weight split over {over})"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n:.0f} B"


def train_worker(rank: int, world: int, init_method: str | None, job: TrainJob) -> int:
    """One rank of the training (under ``spawn``, ``torchrun`` or alone); returns its exit code.
    A failure prints ``nvtp: rank r failed: ...`` and stops the other ranks (docs/faults.md)."""
    return run_rank(rank, lambda: _train(rank, world, init_method, job))


def _train(rank: int, world: int, init_method: str | None, job: TrainJob) -> int:
    if job.inject_fault is None:
        job.inject_fault = fault_from_env()
    if world > 1:
        init_group(rank, world, init_method, job.timeout)
    try:
        mesh, dp_rank = None, 0
        if job.mesh is not None:  # torch's 2-D DeviceMesh: one process group per axis
            with _quiet_stdout():  # gloo prints "[Gloo] Rank r is connected to ..." for every group
                mesh = init_device_mesh("cpu", job.mesh, mesh_dim_names=job.axes)
            data = axes.batch_axis(_nvtp_mesh(job))
            dp_rank = mesh.get_local_rank(data) if data is not None else 0
        model = nvtp.jit(build_model(job), plan=job.plan, mesh=mesh, fsdp=job.fsdp, timeout=job.timeout)
        whole_bytes = sum(p.nbytes for p in model.parameters())

        def step_batch(step: int) -> tuple[tuple, dict]:
            args, kwargs = batch(job, step)
            data = None if job.mesh is None else axes.batch_axis(_nvtp_mesh(job))
            return (args, kwargs) if data is None else dp_part(args, kwargs, dp_rank, job.mesh[data])

        args, kwargs = step_batch(0)
        start = time.perf_counter()
        model.compile(*args, **kwargs)
        compile_s = time.perf_counter() - start
        held = sum(to_local(p).nbytes for p in model.parameters())  # this rank's parts (parameters are DTensors on a mesh)
        opt = make_optimizer(job, model.parameters())
        show = rank == 0 and job.verbose
        if show:
            program = model.last  # the driver's Program: what nvtp.plan reports for this model and mesh
            fwd, bwd = program.forward, program.backward
            route = "TorchDynamo's graph, then Thunder," if model._fx else "Thunder"
            print(f"1. nvtp.jit traced the {type(model.module).__name__} with {route} into one forward fusion ({len(list(fwd.source.compute_ops()))} ops) "
                  f"and one backward fusion ({len(list(bwd.source.compute_ops()))} ops), and sharded them with plan {job.plan}, "
                  f"in {compile_s:.1f} s, for the {program.backend} backend", flush=True)
            for note in fwd.annotations.notes:
                print(f"     {note}")
            for note in model.notes:  # what the data plan left whole (fsdp: a bias tp splits)
                print(f"     {note}")
            share = "" if job.mesh is None else _share(job)
            print(f"   each rank holds {_mib(held)} of the {_mib(whole_bytes)} of parameters{share}")
            names = [None] if job.mesh is None else list(reversed(job.axes))
            for name, s in (("forward", fwd), ("backward", bwd)):
                for axis in names:
                    comms = [c for c in s.communications if axis is None or s.mesh.names[c.axis] == axis]
                    kinds = sorted({c.kind for c in comms})
                    summary = ", ".join(f"{sum(c.kind == k for c in comms)} {k}" for k in kinds) or "none"
                    where = "" if axis is None else f" on {axis}"
                    print(f"   {name}{where}: {summary}; {_mib(sum(c.bytes for c in comms))} sent per rank per step")
                    ring = [r for r in program.steps() if r.phase == name and r.axis == axis and r.kind == "sendrecv"]
                    if ring:  # a ring attention's point-to-point steps (a cp axis)
                        print(f"   {name} on {axis}, ring attention: {len(ring)} point-to-point steps (K/V blocks"
                              f"{' and their gradients' if name == 'backward' else ''}); {_mib(sum(r.bytes for r in ring))} sent per rank per step")
            print(f"2. training {job.steps} steps ({type(opt).__name__}, lr {job.lr}) on {world} processes (gloo):", flush=True)
        first = 0
        if job.load_dir:
            found = latest_checkpoint(job.load_dir)
            if found is None:
                raise FileNotFoundError(f"{job.load_dir} holds no whole checkpoint to resume from")
            first = nvtp.load_checkpoint(found, model, opt)
            if show:
                print(f"   resumed from {found} at step {first}", flush=True)
        log = open(os.path.join(job.log_dir, f"rank{rank}.jsonl"), "a") if job.log_dir else None
        losses, times = [], []
        for step in range(first, job.steps):
            _inject(job, rank, step)
            args, kwargs = step_batch(step)
            t0 = time.perf_counter()
            loss = loss_of(model(*args, **kwargs))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            if show:
                print(f"   step {step + 1:3d}/{job.steps}  loss {losses[-1]:.6f}  {1000 * times[-1]:6.1f} ms", flush=True)
            if job.save_at is not None and step + 1 == job.save_at:
                nvtp.save_checkpoint(job.save_dir, model, opt, step=step + 1)
            if job.save_every and (step + 1) % job.save_every == 0:
                nvtp.save_checkpoint(os.path.join(job.save_dir, f"step-{step + 1:06d}"), model, opt, step=step + 1)
                if rank == 0:
                    prune(job.save_dir, keep=2)
            if log is not None and ((step + 1) % job.log_every == 0 or step + 1 == job.steps):
                log.write(json.dumps({"step": step + 1, "loss": losses[-1], "rss_kib": rss_kib(), "seconds": times[-1]}) + "\n")
                log.flush()
        if log is not None:
            log.close()
        params = {n: nvtp.full_tensor(p) for n, p in model.module.named_parameters()}
        local = {n: (tuple(to_local(p).shape), model.global_shape(n), str(model.placement(n))) for n, p in model.module.named_parameters()}
        if rank == 0:
            torch.save({"losses": losses, "times": times, "params": params, "held": held, "whole": whole_bytes, "local": local,
                        "first": first}, job.out)
        return 0
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def single_process(job: TrainJob) -> dict:
    """The same training with plain PyTorch on one process."""
    model = build_model(job)
    opt = make_optimizer(job, model.parameters())
    losses = []
    for step in range(job.steps):
        args, kwargs = batch(job, step)
        loss = loss_of(model(*args, **kwargs))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def compare(sharded: dict, single: dict) -> tuple[float, float]:
    loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(sharded["losses"], single["losses"]))
    param_err = max(relative_error(sharded["params"][n], p)[0] for n, p in single["params"].items())
    return loss_diff, param_err


def run_sharded(job: TrainJob, devices: int) -> dict:
    """Train on a local mesh of ``devices`` processes; rank 0's results. Raises ``RankFailure``
    naming the rank that failed first (and how) if any rank fails."""
    if devices > 1:
        codes = launch.spawn(train_worker, devices, job)
        if any(codes):
            raise RankFailure(codes.summary(), EXIT_BAD_INPUT if EXIT_BAD_INPUT in codes else EXIT_RUNTIME)
    else:
        code = train_worker(0, 1, None, job)
        if code:
            raise RankFailure(f"rank 0 exited with code {code}", code)
    return torch.load(job.out, weights_only=False)


def run(job: TrainJob, devices: int) -> tuple[dict, dict]:
    return run_sharded(job, devices), single_process(job)


def split_sizes(job: TrainJob) -> dict[str, int]:
    """The sizes the job's Megatron plans split over the processes: heads, KV heads, the vocabulary
    (vocabulary-parallel embedding) and, with sequence parallelism, the sequence."""
    if job.model == "nanogpt":
        cfg = gpt.config(job.config)
        sizes, seq = {"heads": cfg.n_head, "vocabulary": cfg.vocab_size}, cfg.seq_len
    else:
        sizes, seq = hf.split_sizes(job.model), hf.SEQ
    return sizes | ({"sequence": seq} if job.plan == "megatron-sp" else {})


def gpt_seq(job: TrainJob) -> int:
    """The sequence length the demo trains on."""
    if job.model == "nanogpt":
        return gpt.config(job.config).seq_len

    return hf.SEQ


def check_job(job: TrainJob, devices: int, model: torch.nn.Module) -> None:
    """Refuse, before any process starts or anything is traced, a plan the demo's model cannot take
    (an unknown plan, a glob that names nothing) and a mesh its Megatron plans cannot split
    (``split_sizes`` must divide by the number of processes). (The plan checks the same once
    traced; this says it at once, once, instead of on every rank after tracing.)"""
    what = f"the demo's {type(model).__name__}"
    check_plan(job.plan, [n for n, _ in model.named_parameters()], what)
    over, choose = f"{devices} processes", "--devices"
    mesh = None if job.mesh is None else _nvtp_mesh(job)
    ring = mesh is not None and axes.trace_options(mesh, job.plan)["ring"]
    if ring:  # a cp axis: the sequence split (balanced: a piece from each end of each pair of tp's chunks)
        cp_axis = next(a for s, a in axes.passes(mesh) if s.trace_options(mesh, a, job.plan).get("ring"))
        cp, parts = mesh.shape[cp_axis], chunks(mesh)
        seq = gpt_seq(job)
        if seq % (cp * parts):
            raise ShardingError(f"--mesh {','.join(f'{n}={k}' for n, k in zip(job.axes, job.mesh))}: the demo's sequence of {seq} "
                                f"tokens cannot be split over {mesh.names[cp_axis]}={cp} (it must be a multiple of {cp} x {parts}); "
                                f"choose {mesh.names[cp_axis]} " + " or ".join(str(k) for k in range(1, seq + 1) if seq % (k * parts) == 0))
    if mesh is not None and axes.batch_axis(mesh) is not None:  # dp splits the batch
        data = axes.batch_axis(mesh)
        dp = mesh.shape[data]
        rows = batch_size(job)
        if rows % dp:
            fits = [k for k in range(1, rows + 1) if rows % k == 0]
            spelt = f"{dp}x{job.mesh[-1]}" if mesh.ndim == 2 else ",".join(f"{n}={k}" for n, k in zip(job.axes, job.mesh))
            raise ShardingError(f"--mesh {spelt}: dp={dp} does not divide the demo's batch of {rows} sequences (each dp rank trains "
                                f"on its own part of every batch); choose dp {', '.join(map(str, fits[:-1]))} or {fits[-1]} "
                                f"(e.g. --mesh {fits[-1]}x{job.mesh[-1]})")
    if mesh is not None:
        plan = axes.find(mesh, "runs_plan")
        if plan is None:
            return
        tp = mesh.shape[plan]
        devices, choose = tp, mesh.names[plan]
        over = f"{choose}={tp} (--mesh {'x'.join(map(str, job.mesh))})" if mesh.ndim == 2 and not ring else f"{choose}={tp}"
    if job.plan not in ("megatron", "megatron-sp"):
        return
    sizes = split_sizes(job)
    bad = [f"{n} {kind}" if kind != "vocabulary" else f"a vocabulary of {n}" for kind, n in sizes.items() if n % devices]
    if bad:
        fits = [k for k in range(1, max(sizes.values()) + 1) if all(n % k == 0 for n in sizes.values())]
        raise ShardingError(f"plan {job.plan} cannot split {what} over {over}: {devices} does not divide its "
                            f"{' and '.join(bad)}; choose {choose} {', '.join(map(str, fits[:-1]))} or {fits[-1]}")


def _where(job: TrainJob, d: int) -> str:
    """The mesh of the demo's processes, said as each axis's strategy runs it."""
    mesh = _nvtp_mesh(job)
    data, plan = axes.batch_axis(mesh), axes.find(mesh, "runs_plan")
    if axes.trace_options(mesh, job.plan)["ring"]:
        return (f"{', '.join(f'{n}={k}' for n, k in zip(job.axes, job.mesh))} = {d} processes (the sequence split over cp, "
                f"attention by ring{'; the plan on tp' if plan is not None else ''}; "
                + ("every rank passes the whole batch)" if data is None else "each dp rank passes its part of the batch)"))
    rows = batch_size(job)
    return (f"{'x'.join(map(str, job.mesh))} = {d} processes (dp={mesh.shape[data]} data parallel{' with FSDP' if job.fsdp else ''}, "
            f"tp={mesh.shape[plan]} tensor parallel; each dp rank trains on its {rows // mesh.shape[data]} of the batch's {rows} sequences)")


def describe(model: torch.nn.Module, job: TrainJob) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    if job.model == "nanogpt":
        cfg = gpt.config(job.config)
        return (f"a GPT ({cfg.n_layer} layers, hidden {cfg.n_embd}, {cfg.n_head} heads, vocabulary {cfg.vocab_size}, "
                f"{n_params:,} parameters, fp32)")
    sizes = split_sizes(job)
    return (f"a Hugging Face {type(model).__name__} from a config ({sizes['heads']} heads, {sizes['KV heads']} KV heads, "
            f"vocabulary {sizes['vocabulary']}, {n_params:,} parameters, fp32, random init)")


def main(args) -> int:
    mesh = getattr(args, "mesh_shape", None)  # (dp, tp), from --mesh DPxTP; a named mesh from --mesh cp=4 or cp=2,tp=2
    names = axes.spelled(2)
    if mesh is not None and not isinstance(mesh, tuple):
        mesh, names = tuple(mesh.shape), tuple(mesh.names)
    d = args.devices if mesh is None else math.prod(mesh)
    with tempfile.TemporaryDirectory() as tmp:
        job = TrainJob(args.config, args.plan, args.steps, 0.1, os.path.join(tmp, "result.pt"), timeout=args.timeout,
                       model=args.model, mesh=mesh, fsdp=args.fsdp, axes=names)
        model = build_model(job)
        check_job(job, d, model)
        where = f"{d} processes" if mesh is None else _where(job, d)
        against = "one process" if mesh is None else "one process on the whole batch"
        print(f"nvtp demo: train {describe(model, job)} sharded with plan {args.plan} over a local CPU mesh of {where}, "
              f"and check it against {against}\n", flush=True)
        start = time.perf_counter()
        sharded, single = run(job, d)
        elapsed = time.perf_counter() - start
    loss_diff, param_err = compare(sharded, single)
    ok = loss_diff <= 1e-4 and param_err <= 1e-4
    steady = sorted(sharded["times"])[len(sharded["times"]) // 2]
    print(f"\n3. done in {elapsed:.0f} s (median step {1000 * steady:.1f} ms on {d} processes sharing 2 cores)")
    print(f"4. check against the same training on one process (plain PyTorch): loss of every step within "
          f"{loss_diff:.1e} (relative), final parameters within {param_err:.1e}; tolerance 1e-4: {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1
