"""One rank of the 2-D mesh benchmark: nvtp's GPT trained on the same 4 processes under meshes
(dp, tp) = (2, 2), (1, 4) and (4, 1), side by side in one process group.

Every rank builds the GPT from one seed once per mesh and wraps it with ``nvtp.jit(model,
plan="megatron", mesh=init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")))``. Each
mesh trains on the same global batch (each dp rank passing its rows, DDP's convention) with SGD;
the meshes take turns step by step (the first in each round rotating), each step started after
a barrier and lasting as long as its slowest rank (the times are max-reduced). The bytes a rank
sends are counted on each mesh axis's collectives as they run (ring algorithm: all-reduce
2(n-1)/n N, all-gather and reduce-scatter (n-1)/n N, N the whole tensor's bytes).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch

MESHES = [(2, 2), (1, 4), (4, 1)]


@dataclass
class Job:
    out: str
    meshes: list = field(default_factory=lambda: list(MESHES))
    fsdp: bool = False
    n_embd: int = 256
    n_head: int = 4
    n_layer: int = 2
    seq: int = 128
    vocab: int = 256
    batch: int = 4  # the global batch: every mesh trains on it, each dp rank on batch // dp rows
    rounds: int = 10
    warmup: int = 2
    threads: int = 1

    def config(self):
        from nvtp.models import gpt

        return gpt.GPTConfig(n_embd=self.n_embd, n_head=self.n_head, seq_len=self.seq, batch=self.batch, n_layer=self.n_layer,
                             vocab_size=self.vocab)


def count_bytes(comm, sent: list) -> None:
    """Make ``comm`` (one mesh axis's DistComm) add the bytes this rank sends to ``sent[0]``, on the
    blocking collectives and on the ones the scheduled program starts asynchronously."""
    n = comm.size
    names = ("all_reduce", "all_gather", "reduce_scatter")
    size = {"all_reduce": lambda t: 2 * (n - 1) / n * t.nbytes, "all_gather": lambda t: (n - 1) * t.nbytes,
            "reduce_scatter": lambda chunks: (n - 1) / n * sum(c.nbytes for c in chunks)}
    for name in names:
        for method in (name, f"{name}_async"):
            inner = getattr(comm, method)

            def counted(arg, *rest, inner=inner, name=name):
                sent[0] += size[name](arg)
                return inner(arg, *rest)

            setattr(comm, method, counted)


def tokens(job: Job, step: int, dp_rank: int | None = None, dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, or dp rank ``dp_rank``'s rows of it."""
    from nvtp.models import gpt

    idx, targets = gpt.example_tokens(job.config(), seed=step)
    if dp_rank is None:
        return idx, targets
    rows = slice(dp_rank * job.batch // dp, (dp_rank + 1) * job.batch // dp)
    return idx[rows].contiguous(), targets[rows].contiguous()


def eager_losses(job: Job, steps: int) -> list[float]:
    """The same training on one process on the whole batch (plain PyTorch)."""
    from nvtp.models import gpt

    torch.manual_seed(0)
    model = gpt.GPT(job.config())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        loss = model(*tokens(job, step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def worker(rank: int, world: int, init_method: str, job: Job) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import nvtp
    from nvtp.execute.launch import _quiet_stdout, init_group
    from nvtp.models import gpt

    init_group(rank, world, init_method, timeout_s=600.0)
    torch.set_num_threads(job.threads)
    try:
        runs = {}
        for dp, tp in job.meshes:
            name = f"({dp},{tp})"
            with _quiet_stdout():  # gloo prints "[Gloo] Rank r is connected to ..." for every group
                mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            dp_rank = mesh.get_local_rank("dp")
            torch.manual_seed(0)
            model = nvtp.jit(gpt.GPT(job.config()), plan="megatron", mesh=mesh, fsdp=job.fsdp)
            sent = {"tp": [0.0], "dp": [0.0]}
            for axis, comm in zip(mesh.mesh_dim_names, model.comm.axes):
                count_bytes(comm, sent[axis])
            start = time.perf_counter()
            model.compile(*tokens(job, 0, dp_rank, dp))
            compile_s = time.perf_counter() - start
            held = sum(p.to_local().nbytes for p in model.parameters())
            runs[name] = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "dp": dp, "dp_rank": dp_rank,
                          "sent": sent, "losses": [], "compile_s": compile_s, "held": held, "steps": 0}

        def step(run):
            loss = run["model"](*tokens(job, run["steps"], run["dp_rank"], run["dp"]))
            run["opt"].zero_grad(set_to_none=True)
            loss.backward()
            run["opt"].step()
            run["losses"].append(loss.item())  # the GPT's loss: the whole batch's mean on every rank
            run["steps"] += 1

        names = list(runs)
        local = {n: [] for n in names}
        for r in range(job.warmup + job.rounds):
            if r == job.warmup:  # count the steady steps' bytes only (the first call also checks the batch shapes)
                for run in runs.values():
                    for s in run["sent"].values():
                        s[0] = 0.0
            for n in names[r % len(names):] + names[: r % len(names)]:
                dist.barrier()
                start = time.perf_counter()
                step(runs[n])
                if r >= job.warmup:
                    local[n].append(time.perf_counter() - start)
        times = torch.tensor([local[n] for n in names], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        sent = torch.tensor([[runs[n]["sent"][a][0] / job.rounds for a in ("dp", "tp")] for n in names], dtype=torch.float64)
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)  # ranks send alike; the most any rank sends
        if rank == 0:
            result = {"job": asdict(job), "world": world, "seconds": {n: times[i].tolist() for i, n in enumerate(names)},
                      "bytes_per_rank_per_step": {n: {"dp": sent[i, 0].item(), "tp": sent[i, 1].item()} for i, n in enumerate(names)},
                      "losses": {n: runs[n]["losses"] for n in names},
                      "compile_seconds": {n: runs[n]["compile_s"] for n in names},
                      "param_bytes_per_rank": {n: runs[n]["held"] for n in names},
                      "param_bytes_whole": sum(p.nbytes for p in gpt.GPT(job.config()).parameters())}
            with open(job.out, "w") as f:
                json.dump(result, f)
        return 0
    finally:
        dist.destroy_process_group()
