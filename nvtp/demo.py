"""``nvtp demo``: the main job. Train a small GPT sharded over a local CPU mesh of processes and
check it against the same training on one process.

Every rank builds the same model from the same seed, wraps it with ``nvtp.jit`` (Thunder traces
it, nvtp shards it with the plan) and trains it with AdamW on the same token batches; rank 0 shows
the progress, the plan and the communication. The single-process run then repeats the training
with plain PyTorch, and the losses of every step and the final parameters are compared.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import dataclass

import torch


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


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def train_worker(rank: int, world: int, init_method: str | None, job: TrainJob) -> int:
    """One rank of the training (under ``spawn``, ``torchrun`` or alone); returns its exit code.
    A failure prints ``nvtp: rank r failed: ...`` and stops the other ranks (docs/faults.md)."""
    from nvtp.execute.launch import run_rank

    return run_rank(rank, lambda: _train(rank, world, init_method, job))


def _train(rank: int, world: int, init_method: str | None, job: TrainJob) -> int:
    import torch.distributed as dist

    import nvtp
    from nvtp.checkpoint import latest_checkpoint, prune
    from nvtp.execute.launch import init_group
    from nvtp.models import gpt

    if job.inject_fault is None:
        job.inject_fault = fault_from_env()
    if world > 1:
        init_group(rank, world, init_method, job.timeout)
    try:
        torch.manual_seed(0)
        cfg = gpt.config(job.config)
        model = nvtp.jit(gpt.GPT(cfg), plan=job.plan, timeout=job.timeout)
        whole_bytes = sum(p.nbytes for p in model.parameters())
        idx, tgt = gpt.example_tokens(cfg, seed=0)
        start = time.perf_counter()
        model.compile(idx, tgt)
        compile_s = time.perf_counter() - start
        held = sum(p.nbytes for p in model.parameters())
        opt = make_optimizer(job, model.parameters())
        show = rank == 0 and job.verbose
        if show:
            compiled = next(iter(model._compiled.values()))
            fwd, bwd = compiled.forward, compiled.backward
            print(f"1. nvtp.jit traced the GPT with Thunder into one forward fusion ({len(list(fwd.source.compute_ops()))} ops) "
                  f"and one backward fusion ({len(list(bwd.source.compute_ops()))} ops), and sharded them with plan {job.plan}, "
                  f"in {compile_s:.1f} s", flush=True)
            for note in fwd.annotations.notes:
                print(f"     {note}")
            print(f"   each rank holds {_mib(held)} of the {_mib(whole_bytes)} of parameters")
            for name, s in (("forward", fwd), ("backward", bwd)):
                comms = s.communications
                kinds = sorted({c.kind for c in comms})
                summary = ", ".join(f"{sum(c.kind == k for c in comms)} {k}" for k in kinds) or "none"
                print(f"   {name}: {summary}; {_mib(sum(c.bytes for c in comms))} sent per rank per step")
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
            idx, tgt = gpt.example_tokens(cfg, seed=step)
            t0 = time.perf_counter()
            loss = model(idx, tgt)
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
        local = {n: (tuple(p.shape), model.global_shape(n), str(model.placement(n))) for n, p in model.module.named_parameters()}
        if rank == 0:
            torch.save({"losses": losses, "times": times, "params": params, "held": held, "whole": whole_bytes, "local": local,
                        "first": first}, job.out)
        return 0
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def single_process(job: TrainJob) -> dict:
    """The same training with plain PyTorch on one process."""
    from nvtp.models import gpt

    torch.manual_seed(0)
    cfg = gpt.config(job.config)
    model = gpt.GPT(cfg)
    opt = make_optimizer(job, model.parameters())
    losses = []
    for step in range(job.steps):
        idx, tgt = gpt.example_tokens(cfg, seed=step)
        loss = model(idx, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def compare(sharded: dict, single: dict) -> tuple[float, float]:
    from nvtp.dump import relative_error

    loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(sharded["losses"], single["losses"]))
    param_err = max(relative_error(sharded["params"][n], p)[0] for n, p in single["params"].items())
    return loss_diff, param_err


def run_sharded(job: TrainJob, devices: int) -> dict:
    """Train on a local mesh of ``devices`` processes; rank 0's results. Raises ``RankFailure``
    naming the rank that failed first (and how) if any rank fails."""
    from nvtp.errors import EXIT_BAD_INPUT, EXIT_RUNTIME, RankFailure
    from nvtp.execute.launch import spawn

    if devices > 1:
        codes = spawn(train_worker, devices, job)
        if any(codes):
            raise RankFailure(codes.summary(), EXIT_BAD_INPUT if EXIT_BAD_INPUT in codes else EXIT_RUNTIME)
    else:
        code = train_worker(0, 1, None, job)
        if code:
            raise RankFailure(f"rank 0 exited with code {code}", code)
    return torch.load(job.out, weights_only=False)


def run(job: TrainJob, devices: int) -> tuple[dict, dict]:
    return run_sharded(job, devices), single_process(job)


def check_job(cfg, plan: str, devices: int, model: torch.nn.Module) -> None:
    """Refuse, before any process starts or anything is traced, a plan the demo's GPT cannot take
    (an unknown plan, a glob that names nothing) and a mesh its Megatron plans cannot split: the
    heads, the vocabulary (vocabulary-parallel embedding) and, with sequence parallelism, the
    sequence must divide by the number of processes. (The plan checks the same once traced; this
    says it at once, once, instead of on every rank after tracing.)"""
    from nvtp.sharding.plans import check_plan
    from nvtp.sharding.propagate import ShardingError

    check_plan(plan, [n for n, _ in model.named_parameters()], "the demo's GPT")
    if plan not in ("megatron", "megatron-sp"):
        return
    sizes = {"heads": cfg.n_head, "vocabulary": cfg.vocab_size}
    if plan == "megatron-sp":
        sizes["sequence"] = cfg.seq_len
    bad = [f"{n} {what}" if what != "vocabulary" else f"a vocabulary of {n}" for what, n in sizes.items() if n % devices]
    if bad:
        fits = [k for k in range(1, max(sizes.values()) + 1) if all(n % k == 0 for n in sizes.values())]
        raise ShardingError(f"plan {plan} cannot split the demo's GPT over {devices} processes: {devices} does not divide its "
                            f"{' and '.join(bad)}; choose --devices {', '.join(map(str, fits[:-1]))} or {fits[-1]}")


def main(args) -> int:
    from nvtp.models import gpt

    d = args.devices
    cfg = gpt.config(args.config)
    model = gpt.GPT(cfg)
    check_job(cfg, args.plan, d, model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"nvtp demo: train a GPT ({cfg.n_layer} layers, hidden {cfg.n_embd}, {cfg.n_head} heads, vocabulary {cfg.vocab_size}, "
          f"{n_params:,} parameters, fp32) sharded with plan {args.plan} over a local CPU mesh of {d} processes, "
          "and check it against one process\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        job = TrainJob(args.config, args.plan, args.steps, 0.1, os.path.join(tmp, "result.pt"), timeout=args.timeout)
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
