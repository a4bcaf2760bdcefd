"""``nvtp demo``: the main job. Train a small GPT sharded over a local CPU mesh of processes and
check it against the same training on one process.

Every rank builds the same model from the same seed, wraps it with ``nvtp.jit`` (Thunder traces
it, nvtp shards it with the plan) and trains it with AdamW on the same token batches; rank 0 shows
the progress, the plan and the communication. The single-process run then repeats the training
with plain PyTorch, and the losses of every step and the final parameters are compared.
"""

from __future__ import annotations

import os
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
    load_dir: str | None = None  # resume from this checkpoint


def make_optimizer(job: TrainJob, params) -> torch.optim.Optimizer:
    if job.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=job.lr)
    return torch.optim.SGD(params, lr=job.lr, momentum=0.9)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def train_worker(rank: int, world: int, init_method: str | None, job: TrainJob) -> int:
    import torch.distributed as dist

    import nvtp
    from nvtp.execute.launch import init_group
    from nvtp.models import gpt

    if world > 1:
        init_group(rank, world, init_method)
    try:
        torch.manual_seed(0)
        cfg = gpt.config(job.config)
        model = nvtp.jit(gpt.GPT(cfg), plan=job.plan)
        whole_bytes = sum(p.nbytes for p in model.parameters())
        idx, tgt = gpt.example_tokens(cfg, seed=0)
        start = time.perf_counter()
        model.compile(idx, tgt)
        compile_s = time.perf_counter() - start
        held = sum(p.nbytes for p in model.parameters())
        opt = make_optimizer(job, model.parameters())
        show = rank == 0 and job.verbose
        if show:
            fwd, bwd = model.last.forward if model.last else None, None
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
            first = nvtp.load_checkpoint(job.load_dir, model, opt)
            if show:
                print(f"   resumed from {job.load_dir} at step {first}", flush=True)
        losses, times = [], []
        for step in range(first, job.steps):
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
        params = {n: nvtp.full_tensor(p) for n, p in model.module.named_parameters()}
        local = {n: (tuple(p.shape), model.global_shape(n), str(model.placement(n))) for n, p in model.module.named_parameters()}
        if rank == 0:
            torch.save({"losses": losses, "times": times, "params": params, "held": held, "whole": whole_bytes, "local": local,
                        "first": first}, job.out)
        return 0
    finally:
        if world > 1:
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


def run(job: TrainJob, devices: int) -> tuple[dict, dict]:
    from nvtp.execute.launch import spawn

    codes = spawn(train_worker, devices, job) if devices > 1 else [train_worker(0, 1, None, job)]
    if any(codes):
        raise RuntimeError(f"a rank failed: exit codes {codes}")
    return torch.load(job.out, weights_only=False), single_process(job)


def main(args) -> int:
    from nvtp.models import gpt

    d = args.devices
    cfg = gpt.config(args.config)
    n_params = sum(p.numel() for p in gpt.GPT(cfg).parameters())
    print(f"nvtp demo: train a GPT ({cfg.n_layer} layers, hidden {cfg.n_embd}, {cfg.n_head} heads, vocabulary {cfg.vocab_size}, "
          f"{n_params:,} parameters, fp32) sharded with plan {args.plan} over a local CPU mesh of {d} processes, "
          "and check it against one process\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        job = TrainJob(args.config, args.plan, args.steps, 0.1, os.path.join(tmp, "result.pt"))
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
