"""One rank of the FSDP + TP benchmark: a Llama-style model trained on (dp, tp) = (2, 2) by nvtp
and by PyTorch's own FSDP2 + TP plan, side by side in the same 4 processes.

The model is ``tests/complex_rotary.py``'s ``ComplexRotaryLM`` (complex rotary embeddings,
RMSNorm, SwiGLU, grouped-query attention), written like pytorch/examples' ``llama2_model.py``.
Both sides start from the same seed's weights and train on the same global batch (each dp rank
its rows) with a whole step: forward, cross-entropy, backward, ``clip_grad_norm_(1.0)``, AdamW.

* nvtp: ``nvtp.jit(model, plan="megatron-sp", mesh=(dp, tp), fsdp=True)``: the plan derived
  from the graph, its collectives scheduled (``overlap=True``, the default).
* PyTorch: the plan of pytorch/examples' ``fsdp_tp_example.py``, by module name:
  ``parallelize_module`` with the embedding row-wise to a sequence-sharded output, the norms
  ``SequenceParallel``, q/k/v and the MLP's up projections column-wise, the attention output and
  MLP down projection row-wise to a sequence-sharded output, the head column-wise to a replicated
  output (heads divided by tp, as that example does); then ``fully_shard`` over dp, each block
  and the model.

With ``Job.compiled`` two more sides: ``nvtp.jit(..., compile="inductor")``, and PyTorch's plan
compiled the way torchtitan compiles FSDP2 + TP (``apply_compile``): after ``parallelize_module``
and before ``fully_shard``, each transformer block replaced by ``torch.compile(block,
fullgraph=True)`` (FSDP2's hooks then wrap the compiled block and run eagerly around it).

Timed in interleaved rounds (``tp_worker.timed_rounds``). Memory per rank, from the CPU
allocator's events under torch.profiler: what a side keeps between steps (``harness.held_after``:
allocated while it was made and ran its first three steps, and not freed: parameters, optimizer state,
anything else it keeps), and the peak one step allocates on top of that
(``harness.profile_step``: activations, gathered parameters, gradients, communication buffers);
their sum is the rank's peak. The parameter and AdamW bytes are also counted (exact), which the
measured figure must include. Also from the profiled steps: rank 0's time in matrix products (the
GEMM floor).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass
class Job:
    out: str
    dim: int = 256
    layers: int = 2
    heads: int = 16
    kv_heads: int = 16
    hidden: int = 704
    vocab: int = 512
    seq: int = 64
    batch: int = 4  # global: each dp rank trains on batch // dp rows
    dp: int = 2
    tp: int = 2
    rounds: int = 10
    warmup: int = 2
    threads: int = 1
    compiled: bool = False  # also nvtp compile="inductor" and PyTorch's plan under torch.compile
    profile: bool = False  # also write a torch.profiler table per side (rank 0)

    def config(self):
        from tests.complex_rotary import Config

        return Config(dim=self.dim, layers=self.layers, heads=self.heads, kv_heads=self.kv_heads, vocab=self.vocab,
                      hidden=self.hidden, max_seq=self.seq)


def pytorch_plan(model, mesh, compiled: bool = False) -> torch.nn.Module:
    """fsdp_tp_example.py's plan on ``ComplexRotaryLM``'s module names; ``compiled``: each block
    under ``torch.compile`` between TP and FSDP, as torchtitan's ``apply_compile`` does."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.blocks:
        parallelize_module(block, tp, {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "w1": ColwiseParallel(input_layouts=Shard(1)), "w3": ColwiseParallel(input_layouts=Shard(1)),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        block.attn.heads //= tp.size()
        block.attn.kv_heads //= tp.size()
    if compiled:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def held_bytes(model, optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (its shards)."""

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).nbytes + (local(p.grad).nbytes if p.grad is not None else 0)
    for state in optimizer.state.values():
        total += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def worker(rank: int, world: int, init_method: str, job: Job) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import nvtp
    from benchmarks.harness import held_after, mark, profile_step
    from benchmarks.tp_worker import timed_rounds
    from nvtp.execute.launch import init_group
    from tests.complex_rotary import ComplexRotaryLM

    init_group(rank, world, init_method, timeout_s=2400.0 if job.compiled else 900.0)
    torch.set_num_threads(job.threads)
    try:
        mesh = init_device_mesh("cpu", (job.dp, job.tp), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
        torch.manual_seed(0)
        model = ComplexRotaryLM(job.config())
        rows = job.batch // job.dp
        data = torch.randint(0, job.vocab, (job.batch, job.seq + 1), generator=torch.Generator().manual_seed(1))
        idx, targets = data[dp_rank * rows:(dp_rank + 1) * rows, :-1], data[dp_rank * rows:(dp_rank + 1) * rows, 1:]

        build = {"nvtp": lambda: nvtp.jit(copy.deepcopy(model), plan="megatron-sp", mesh=mesh, fsdp=True),
                 "pytorch": lambda: pytorch_plan(copy.deepcopy(model), mesh)}
        if job.compiled:
            build["nvtp_inductor"] = lambda: nvtp.jit(copy.deepcopy(model), plan="megatron-sp", mesh=mesh, fsdp=True,
                                                      compile="inductor")
            build["pytorch_compiled"] = lambda: pytorch_plan(copy.deepcopy(model), mesh, compiled=True)
        sides, optimizers, first, kept, kept_by_op = {}, {}, {}, {}, {}
        losses: dict[str, list[float]] = {n: [] for n in build}

        def step(name):
            m, opt = sides[name], optimizers[name]
            logits = m(idx)
            loss = F.cross_entropy(logits.reshape(-1, job.vocab), targets.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        def made(name):  # the side, its optimizer and its first step (nvtp traces and shards, torch.compile compiles)
            sides[name] = build[name]()
            optimizers[name] = torch.optim.AdamW(sides[name].parameters(), lr=1e-3)
            losses[name].append(float(step(name)))
            losses[name].append(float(step(name)))  # a second step keeps what a side makes late; a third's leftovers
            mark()  # were freed unseen (harness.held_after)
            losses[name].append(float(step(name)))

        for name in build:
            dist.barrier()
            start = time.perf_counter()
            _, kept[name], kept_by_op[name] = held_after(lambda name=name: made(name))
            first[name] = time.perf_counter() - start

        def timed(name):
            losses[name].append(float(step(name)))

        seconds = timed_rounds({n: (lambda n=n: timed(n)) for n in sides}, job.rounds, job.warmup)
        counted = {n: held_bytes(sides[n], optimizers[n]) for n in sides}
        measured = {}
        for n in sides:  # the GEMM floor (rank 0) and each rank's peak memory, 3 steps each
            dist.barrier()
            measured[n] = profile_step(lambda n=n: timed(n))
        memory = torch.tensor([[counted[n], kept[n], measured[n]["peak_bytes"], kept[n] + measured[n]["peak_bytes"]]
                               for n in sides], dtype=torch.float64)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)  # the rank that needs the most
        profiles = {}
        if job.profile:
            from torch.profiler import ProfilerActivity, profile

            for n in sides:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    timed(n)
                profiles[n] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        if rank == 0:
            with open(job.out, "w") as f:
                json.dump({"job": asdict(job), "world": world, "seconds": seconds, "losses": losses, "first_call_seconds": first,
                           "state_bytes": {n: memory[i, 0].item() for i, n in enumerate(sides)},  # counted
                           "held_bytes": {n: memory[i, 1].item() for i, n in enumerate(sides)},  # measured
                           "step_peak_bytes": {n: memory[i, 2].item() for i, n in enumerate(sides)},
                           "peak_bytes": {n: memory[i, 3].item() for i, n in enumerate(sides)},
                           "gemm_ms": {n: measured[n]["gemm_ms"] for n in sides},
                           "gemm_share": {n: measured[n]["gemm_share"] for n in sides},
                           "step_at_peak": {n: measured[n]["at_peak"] for n in sides},  # rank 0's
                           "profiles": profiles}, f)
        return 0
    finally:
        dist.destroy_process_group()


def eager_losses(job: Job, steps: int) -> list[float]:
    """One process on the whole batch, the same whole step: the losses both sides must reproduce
    (each dp rank's loss is its rows' mean; the mean over dp ranks is the whole batch's)."""
    from tests.complex_rotary import ComplexRotaryLM

    torch.manual_seed(0)
    model = ComplexRotaryLM(job.config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, job.vocab, (job.batch, job.seq + 1), generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(steps):
        rows = job.batch // job.dp
        per_rank = []
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, job.vocab), data[:, 1:].reshape(-1))
        for r in range(job.dp):
            part = logits[r * rows:(r + 1) * rows]
            per_rank.append(F.cross_entropy(part.reshape(-1, job.vocab), data[r * rows:(r + 1) * rows, 1:].reshape(-1)).item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(per_rank[0])
    return out
