"""One rank of the expert-parallel benchmark (issue 35, item 4): nvtp's MoE GPT trained at ep = 2
on 2 gloo processes three ways, side by side in the same processes:

* "nvtp": ``nvtp.jit(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))``, every
  rank passing the whole batch (nvtp splits it: each rank routes its half), dropless static
  all-to-alls (``nvtp.execute.ep``);
* "hand-written": the torchtitan recipe in plain PyTorch: each rank holds its 2 of the 4 experts
  and routes its half of the batch; per MoE layer the per-expert counts are exchanged
  (``all_to_all_single``) and read by the host (``.tolist()``: the split sizes), the routed rows
  sorted by expert are dispatched with ``torch.distributed.nn.functional.all_to_all_single`` of
  those splits (autograd: the backward sends the gradients back), each local expert runs on its
  rows, the results are combined back the same way; dense gradients all-reduced (sum of the
  ranks' losses / 2: the whole batch's mean);
* "unsharded": the model in eager PyTorch on the whole batch in each process (no communication).

Each step (forward, backward, SGD) starts after a barrier and lasts as long as its slowest rank;
the implementations take turns, the first of each round rotating. Before timing, step 0's loss
of every implementation is compared with the unsharded model's (and asserted in the test). Bytes:
nvtp's counted by ``nvtp.execute.ep.recording()`` (what ``Program.steps()`` plans); the
hand-written one's from its split sizes (rows sent to the other rank x width x 4 B, forward
dispatch and combine, and the same again in the backward), plus the counts.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

IMPLS = ("nvtp", "hand-written", "unsharded")


@dataclass
class Job:
    out: str
    batch: int = 8  # the global batch; each ep rank routes batch / 2 sequences
    seq: int = 32
    rounds: int = 8
    warmup: int = 2
    threads: int = 1

    def config(self):
        from nvtp.models import moe

        return moe.config("tiny", batch=self.batch, seq_len=self.seq)


def tokens(job: Job, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    from nvtp.models import moe

    return moe.example_tokens(job.config(), seed=step)


class HandExperts(torch.nn.Module):
    """This rank's experts [E/P, ...] of one MoE layer, run by all-to-all of host-read split sizes."""

    def __init__(self, experts: torch.nn.Module, rank: int, ranks: int, group, sent: list):
        super().__init__()
        n = experts.w_fc.shape[0]
        self.local, self.rank, self.ranks, self.group, self.sent = n // ranks, rank, ranks, group, sent
        mine = slice(rank * self.local, (rank + 1) * self.local)
        self.w_fc = torch.nn.Parameter(experts.w_fc.detach()[mine].clone())
        self.w_proj = torch.nn.Parameter(experts.w_proj.detach()[mine].clone())

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_to_all_single

        n, e = x.shape
        k = index.shape[-1]
        flat = index.reshape(n * k)
        order = torch.argsort(flat, stable=True)
        rows = x.unsqueeze(1).expand(n, k, e).reshape(n * k, e).index_select(0, order)  # grouped by expert, so by rank
        counts = torch.bincount(flat, minlength=self.local * self.ranks)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)  # [P, E/P]: what each rank sends each of my experts
        send = counts.view(self.ranks, self.local).sum(1).tolist()  # the host reads the split sizes (torchtitan's .tolist())
        recv_counts = got.view(self.ranks, self.local)
        recv = recv_counts.sum(1).tolist()
        other = 1 - self.rank
        self.sent[0] += 2 * (send[other] * e + recv[other] * e) * 4 + 2 * counts.nbytes // self.ranks  # fwd + bwd, and the counts
        mine = all_to_all_single(torch.empty(sum(recv), e), rows, recv, send, group=self.group)  # dispatch
        parts = []
        for p in range(self.ranks):  # rows of source p, grouped by local expert
            start = sum(recv[:p])
            block = mine[start:start + recv[p]]
            ys, at = [], 0
            for j, c in enumerate(recv_counts[p].tolist()):
                h = F.gelu(block[at:at + c] @ self.w_fc[j], approximate="tanh")
                ys.append(h @ self.w_proj[j])
                at += c
            parts.append(torch.cat(ys) if ys else block.new_zeros(0, e))
        out = torch.cat(parts)
        back = all_to_all_single(torch.empty(n * k, e), out, send, recv, group=self.group)  # combine
        y = torch.empty_like(back).index_copy(0, order, back)
        return (y * weights.reshape(n * k, 1)).reshape(n, k, e).sum(dim=1)


def hand_written(model: torch.nn.Module, rank: int, ranks: int, group, sent: list) -> torch.nn.Module:
    """``model`` with each MoE layer's experts replaced by this rank's ``HandExperts``."""
    from nvtp.models import moe

    hand = copy.deepcopy(model)
    for block in hand.h:
        block.moe.experts = HandExperts(block.moe.experts, rank, ranks, group, sent)
    assert all(not isinstance(m, moe.Experts) for m in hand.modules())
    return hand


def worker(rank: int, world: int, init_method: str, job: Job) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import nvtp
    from nvtp.execute import ep as ep_run
    from nvtp.execute.launch import _quiet_stdout, init_group
    from nvtp.models import moe

    init_group(rank, world, init_method, timeout_s=600.0)
    torch.set_num_threads(job.threads)
    try:
        with _quiet_stdout():
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        torch.manual_seed(0)
        base = moe.MoEGPT(job.config())
        hand_sent, nvtp_sent = [0.0], []
        models = {"nvtp": nvtp.jit(copy.deepcopy(base), plan="megatron", mesh=mesh),
                  "hand-written": hand_written(base, rank, world, dist.group.WORLD, hand_sent),
                  "unsharded": copy.deepcopy(base)}
        start = time.perf_counter()
        models["nvtp"].compile(*tokens(job, 0))
        compile_s = time.perf_counter() - start
        opts = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}
        dense = [p for p in models["hand-written"].parameters() if not _is_expert(models["hand-written"], p)]
        half = slice(rank * job.batch // world, (rank + 1) * job.batch // world)
        losses = {n: [] for n in IMPLS}
        steps = {n: 0 for n in IMPLS}

        def step(name: str) -> None:
            idx, targets = tokens(job, steps[name])
            model, opt = models[name], opts[name]
            opt.zero_grad(set_to_none=True)
            if name == "hand-written":
                loss = model(idx[half], targets[half])
                (loss / world).backward()  # the whole batch's mean: the ranks' halves' mean
                for p in dense:  # data parallel over ep: the experts' gradients came through the all-to-alls
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                whole = loss.detach().clone()
                dist.all_reduce(whole)
                losses[name].append(whole.item() / world)
            else:
                loss = model(idx, targets)
                loss.backward()
                losses[name].append(loss.item())
            opt.step()
            steps[name] += 1

        local = {n: [] for n in IMPLS}
        with ep_run.recording() as recorded:
            for r in range(job.warmup + job.rounds):
                if r == job.warmup:
                    recorded.clear()
                    hand_sent[0] = 0.0
                for n in IMPLS[r % len(IMPLS):] + IMPLS[: r % len(IMPLS)]:
                    dist.barrier()
                    start = time.perf_counter()
                    step(n)
                    if r >= job.warmup:
                        local[n].append(time.perf_counter() - start)
            nvtp_sent = sum(b for _, b in recorded)
        times = torch.tensor([local[n] for n in IMPLS], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        sent = torch.tensor([nvtp_sent / job.rounds, hand_sent[0] / job.rounds], dtype=torch.float64)
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        if rank == 0:
            program = models["nvtp"].last
            planned = sum(s.bytes for s in program.steps() if s.kind == "alltoall")
            cfg = job.config()
            rows = job.batch // world * job.seq * cfg.top_k  # a rank's routed rows a layer
            widths = (cfg.n_embd, cfg.expert_hidden)
            # analytical: each exchange of a routed row's activations to the other rank, routing uniform ((P-1)/P of the rows);
            # forward: dispatch (n_embd) and combine (n_embd) per layer; backward the same again
            analytical = cfg.n_layer * 2 * 2 * rows * (world - 1) / world * cfg.n_embd * 4
            result = {"job": asdict(job), "world": world, "seconds": {n: times[i].tolist() for i, n in enumerate(IMPLS)},
                      "losses": losses, "compile_seconds": compile_s,
                      "alltoall_bytes_per_rank_per_step": {"nvtp": sent[0].item(), "hand-written": sent[1].item(),
                                                           "nvtp planned": planned, "analytical uniform": analytical},
                      "widths": widths}
            with open(job.out, "w") as f:
                json.dump(result, f)
        return 0
    finally:
        dist.destroy_process_group()


def _is_expert(model: torch.nn.Module, p: torch.nn.Parameter) -> bool:
    return any(p is q for m in model.modules() if isinstance(m, HandExperts) for q in m.parameters())
