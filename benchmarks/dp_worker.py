"""One rank of the data-parallel benchmark: nvtp on a (dp, tp) = (world, 1) mesh, with its
communication schedule (``overlap=True``, the default) and without, against PyTorch's
``DistributedDataParallel`` on the same GPT, the same gloo processes and the same batches,
training steps (forward, backward, SGD) timed in turn. After one step every implementation's
weights are checked against DDP's before anything is reported."""

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

    def config(self):
        from nvtp.models import gpt

        return gpt.GPTConfig(n_embd=self.n_embd, n_head=self.n_head, seq_len=self.seq, batch=self.batch, n_layer=self.n_layer,
                             vocab_size=self.vocab)


def worker(rank: int, world: int, init_method: str, job: Job) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    import nvtp
    from benchmarks.tp_worker import timed_rounds
    from nvtp.execute.launch import _quiet_stdout, init_group
    from nvtp.models import gpt

    init_group(rank, world, init_method, timeout_s=600.0)
    torch.set_num_threads(job.threads)
    try:
        torch.manual_seed(0)
        base = gpt.GPT(job.config())
        with _quiet_stdout():
            mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
        models = {"ddp": DistributedDataParallel(copy.deepcopy(base)),
                  "nvtp": nvtp.jit(copy.deepcopy(base), plan="megatron", mesh=mesh),
                  "nvtp_blocking": nvtp.jit(copy.deepcopy(base), plan="megatron", mesh=mesh, overlap=False)}
        opts = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}
        count = {n: 0 for n in models}
        losses = {n: [] for n in models}

        def step(name):
            idx, tgt = gpt.example_tokens(job.config(), seed=1000 * count[name] + rank)  # this rank's batch
            loss = models[name](idx, tgt)
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            opts[name].step()
            count[name] += 1
            losses[name].append(loss.item())

        for name in models:  # compile; after one step the three agree on every weight
            step(name)
        ref = [p.detach() for p in models["ddp"].module.parameters()]
        worst = {n: max((nvtp.full_tensor(p) - q).abs().max().item() for p, q in zip(models[n].parameters(), ref))
                 for n in ("nvtp", "nvtp_blocking")}
        issued = models["nvtp"].last.collectives()
        seconds = timed_rounds({n: (lambda n=n: step(n)) for n in models}, job.rounds, job.warmup)
        if rank == 0:
            result = {"job": asdict(job), "world": world, "seconds": seconds, "losses": losses, "weights_vs_ddp": worst,
                      "nvtp_collectives": len(issued), "nvtp_tensors": sum(len(c["tensors"]) for c in issued),
                      "blocking_collectives": len(models["nvtp_blocking"].last.collectives())}
            with open(job.out, "w") as f:
                json.dump(result, f)
        return 0
    finally:
        dist.destroy_process_group()
