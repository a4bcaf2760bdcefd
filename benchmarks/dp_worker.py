"""One rank of the data-parallel benchmark: nvtp on a (dp, tp) = (world, 1) mesh, with its
communication schedule (``overlap=True``, the default) and without, against PyTorch's
``DistributedDataParallel`` on the same GPT, the same gloo processes and the same batches,
training steps (forward, backward, SGD) timed in turn. With ``Job.compiled`` two more sides:
``nvtp.jit(..., compile="inductor")``, and DDP over a compiled model the way PyTorch's "Where to
apply torch.compile?" recommends (``model.compile()`` on the inner module, then
``DistributedDataParallel(model)``: TorchDynamo's DDPOptimizer splits the graph at DDP's bucket
boundaries so the all-reduces still overlap the backward). After one step every side's weights are
checked against one process that took the same step on all ranks' batches (the unsharded model)
before anything is reported. Then, as in ``tp_worker``: one profiled step per side for the GEMM
floor and the memory a rank holds and a step allocates."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass

import torch


@dataclass
class Job:
    out: str
    n_embd: int = 256
    n_head: int = 4
    n_layer: int = 4
    seq: int = 128
    batch: int = 2  # each rank's
    vocab: int = 4096
    rounds: int = 10
    warmup: int = 2
    threads: int = 1
    compiled: bool = False  # also nvtp compile="inductor" and DDP over model.compile()

    def config(self):
        from nvtp.models import gpt

        return gpt.GPTConfig(n_embd=self.n_embd, n_head=self.n_head, seq_len=self.seq, batch=self.batch, n_layer=self.n_layer,
                             vocab_size=self.vocab)


def unsharded_after_one_step(job: Job, base, world: int) -> list[torch.Tensor]:
    """The weights after one SGD step of one process on every rank's first batch (what DDP's
    averaged gradient is the gradient of: the mean of the ranks' equal-sized mean losses)."""
    from nvtp.models import gpt

    model = copy.deepcopy(base)
    batches = [gpt.example_tokens(job.config(), seed=r) for r in range(world)]
    loss = model(torch.cat([i for i, _ in batches]), torch.cat([t for _, t in batches]))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return [p.detach() for p in model.parameters()]


def worker(rank: int, world: int, init_method: str, job: Job) -> int:
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    import nvtp
    from benchmarks.harness import held_after, mark, profile_step
    from benchmarks.tp_worker import timed_rounds
    from nvtp.execute.launch import _quiet_stdout, init_group
    from nvtp.models import gpt

    init_group(rank, world, init_method, timeout_s=1800.0 if job.compiled else 600.0)
    torch.set_num_threads(job.threads)
    try:
        torch.manual_seed(0)
        base = gpt.GPT(job.config())
        want = unsharded_after_one_step(job, base, world)
        with _quiet_stdout():
            mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))

        def ddp_compiled():
            m = copy.deepcopy(base)
            m.compile()  # the inner module compiled, then wrapped (PyTorch's docs, "Where to apply torch.compile?")
            return DistributedDataParallel(m)

        build = {"ddp": lambda: DistributedDataParallel(copy.deepcopy(base)),
                 "nvtp": lambda: nvtp.jit(copy.deepcopy(base), plan="megatron", mesh=mesh),
                 "nvtp_blocking": lambda: nvtp.jit(copy.deepcopy(base), plan="megatron", mesh=mesh, overlap=False)}
        if job.compiled:
            build["nvtp_inductor"] = lambda: nvtp.jit(copy.deepcopy(base), plan="megatron", mesh=mesh, compile="inductor")
            build["ddp_compiled"] = ddp_compiled
        models, opts, first, held, worst, kept = {}, {}, {}, {}, {}, {}
        count = {n: 0 for n in build}
        losses = {n: [] for n in build}

        def step(name):
            idx, tgt = gpt.example_tokens(job.config(), seed=1000 * count[name] + rank)  # this rank's batch
            loss = models[name](idx, tgt)
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            opts[name].step()
            count[name] += 1
            losses[name].append(loss.item())

        def made(name):  # built, one step (nvtp traces and shards, torch.compile compiles), checked
            models[name] = build[name]()
            opts[name] = torch.optim.SGD(models[name].parameters(), lr=0.1)
            step(name)
            opts[name].zero_grad(set_to_none=True)
            worst = max((nvtp.full_tensor(p) - q).abs().max().item() for p, q in zip(models[name].parameters(), want))
            step(name)  # DDP rebuilds its buckets in its second iteration: kept
            mark()  # a third step's leftovers were freed unseen (harness.held_after)
            step(name)
            opts[name].zero_grad(set_to_none=True)
            return worst

        for name in build:
            dist.barrier()
            start = time.perf_counter()
            worst[name], held[name], kept[name] = held_after(lambda name=name: made(name))
            first[name] = time.perf_counter() - start
        issued = models["nvtp"].last.collectives()
        seconds = timed_rounds({n: (lambda n=n: step(n)) for n in models}, job.rounds, job.warmup)
        measured = {}
        for name in models:  # the GEMM floor (rank 0) and each rank's peak memory, 3 steps each
            dist.barrier()
            measured[name] = profile_step(lambda name=name: step(name))
        memory = torch.tensor([[held[n], measured[n]["peak_bytes"], held[n] + measured[n]["peak_bytes"]] for n in models],
                              dtype=torch.float64)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)  # the rank that needs the most
        if rank == 0:
            result = {"job": asdict(job), "world": world, "seconds": seconds, "losses": losses, "weights_vs_unsharded": worst,
                      "first_call_seconds": first, "gemm_ms": {n: measured[n]["gemm_ms"] for n in models},
                      "gemm_share": {n: measured[n]["gemm_share"] for n in models},
                      "step_at_peak": {n: measured[n]["at_peak"] for n in models},  # rank 0's
                      "param_bytes": {n: sum(nvtp.full_tensor(p).nbytes for p in m.parameters()) for n, m in models.items()},
                      "held_bytes": {n: memory[i, 0].item() for i, n in enumerate(models)},
                      "step_peak_bytes": {n: memory[i, 1].item() for i, n in enumerate(models)},
                      "peak_bytes": {n: memory[i, 2].item() for i, n in enumerate(models)},
                      "nvtp_collectives": len(issued), "nvtp_tensors": sum(len(c["tensors"]) for c in issued),
                      "blocking_collectives": len(models["nvtp_blocking"].last.collectives())}
            with open(job.out, "w") as f:
                json.dump(result, f)
        return 0
    finally:
        dist.destroy_process_group()
