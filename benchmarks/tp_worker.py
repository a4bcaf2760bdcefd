"""One rank of the sharded benchmark: nvtp and PyTorch DTensor tensor parallelism on the same
block (``TPBlock``) and the same gloo mesh, forward+backward steps timed in turn.

Every rank builds the block from one seed and wraps a copy of it each way: ``nvtp.jit(block,
plan="megatron")`` (the plan derived from the graph) and ``parallelize_module(block, mesh,
dtensor_plan())`` with ``attn.n_head = n_head // d``. With ``Job.compiled`` two more sides:
``nvtp.jit(..., compile="inductor")`` (each rank's compute between collectives compiled by
Inductor) and PyTorch's plan under ``torch.compile`` the way torchtitan compiles a tensor-parallel
model: each transformer block, after ``parallelize_module``, ``torch.compile(block,
fullgraph=True)`` (here the model is one block). Every side is checked against the unsharded
block before anything is timed. Each timed step starts after a barrier; a step takes as long as
its slowest rank (the times are max-reduced). nvtp's collectives are counted as they run (a
counting wrapper around its torch.distributed comm), DTensor's with ``CommDebugMode``. After the
timed rounds, one more step of each side under torch.profiler (``harness.profile_step``): rank 0's
time in matrix products and each rank's peak of tensor memory the step allocated.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Job:
    d: int
    out: str
    n_embd: int = 768
    n_head: int = 12
    seq: int = 256
    batch: int = 1
    rounds: int = 10
    warmup: int = 2
    threads: int = 1
    compiled: bool = False  # also nvtp compile="inductor" and DTensor TP under torch.compile
    profile: bool = False  # also write a torch.profiler table per side (rank 0, 3 steps)


class CountingComm:
    """nvtp's torch.distributed comm, tallying each collective and the bytes a rank sends for it
    with the ring algorithm (all-reduce 2(d-1)/d N, all-gather and reduce-scatter (d-1)/d N)."""

    def __init__(self, inner):
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.calls: list[tuple[str, int, float]] = []

    def _count(self, kind: str, whole_bytes: int, factor: float):
        self.calls.append((kind, whole_bytes, factor * (self.size - 1) / self.size * whole_bytes))

    def all_reduce(self, t, op):
        self._count("allreduce", t.numel() * t.element_size(), 2.0)
        return self.inner.all_reduce(t, op)

    def all_gather(self, t):
        self._count("allgather", t.numel() * t.element_size() * self.size, 1.0)
        return self.inner.all_gather(t)

    def reduce_scatter(self, chunks, op):
        self._count("reduce_scatter", sum(c.numel() * c.element_size() for c in chunks), 1.0)
        return self.inner.reduce_scatter(chunks, op)

    # The scheduled program starts its collectives asynchronously (nvtp.sharding.overlap): count those too.
    def all_reduce_async(self, t, op):
        self._count("allreduce", t.numel() * t.element_size(), 2.0)
        return self.inner.all_reduce_async(t, op)

    def all_gather_async(self, t):
        self._count("allgather", t.numel() * t.element_size() * self.size, 1.0)
        return self.inner.all_gather_async(t)

    def reduce_scatter_async(self, chunks, op):
        self._count("reduce_scatter", sum(c.numel() * c.element_size() for c in chunks), 1.0)
        return self.inner.reduce_scatter_async(chunks, op)


def timed_rounds(steps: dict, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per step of each implementation, taking turns round after round (as
    ``harness.interleave``), each step started after a barrier and lasting as long as its
    slowest rank (the times are max-reduced over the ranks)."""
    import torch.distributed as dist

    names = list(steps)
    local = {n: [] for n in names}
    for r in range(warmup + rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            steps[n]()
            if r >= warmup:
                local[n].append(time.perf_counter() - start)
    times = torch.tensor([local[n] for n in names], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return {n: times[i].tolist() for i, n in enumerate(names)}


def worker(rank: int, world: int, init_method: str, job: Job) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    import nvtp
    from benchmarks.blocks import TPBlock, dtensor_plan
    from benchmarks.harness import held_after, mark, profile_step
    from nvtp.dump import relative_error
    from nvtp.execute.collectives import DistComm
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method, timeout_s=1800.0 if job.compiled else 600.0)
    torch.set_num_threads(job.threads)
    try:
        torch.manual_seed(0)
        block = TPBlock(job.n_embd, job.n_head)
        x = torch.randn(job.batch, job.seq, job.n_embd, generator=torch.Generator().manual_seed(1))
        g = torch.randn(job.batch, job.seq, job.n_embd, generator=torch.Generator().manual_seed(2))

        def step(m):
            xx = x.detach().requires_grad_()
            y = m(xx)
            y.backward(g)
            m.zero_grad(set_to_none=True)
            return y.detach(), xx.grad

        reference = copy.deepcopy(block)
        y_ref, gx_ref = step(reference)

        mesh = init_device_mesh("cpu", (world,))

        def dtensor():
            m = parallelize_module(copy.deepcopy(block), mesh, dtensor_plan())
            m.attn.n_head = job.n_head // world  # the model edit DTensor needs: heads per rank
            return m

        comm = CountingComm(DistComm())
        build = {"nvtp": lambda: nvtp.jit(copy.deepcopy(block), plan="megatron", comm=comm), "dtensor": dtensor}
        if job.compiled:
            build["nvtp_inductor"] = lambda: nvtp.jit(copy.deepcopy(block), plan="megatron", compile="inductor")
            build["dtensor_compiled"] = lambda: torch.compile(dtensor(), fullgraph=True)  # torchtitan: per block, after TP
        sides, first_call, errors, held, kept = {}, {}, {}, {}, {}

        def first(make):  # made and checked against the unsharded block; only the module is kept
            m = make()
            y, gx = step(m)  # nvtp traces and shards here, torch.compile compiles
            error = max(relative_error(y, y_ref)[0], relative_error(gx, gx_ref)[0])
            step(m)  # DDP-like late allocations land in the second step; the third's leftovers were freed unseen
            mark()
            step(m)
            return m, error

        for name, make in build.items():
            dist.barrier()
            start = time.perf_counter()
            (sides[name], errors[name]), held[name], kept[name] = held_after(lambda make=make: first(make))
            first_call[name] = time.perf_counter() - start
        nv, dt = sides["nvtp"], sides["dtensor"]
        comm.calls.clear()
        step(nv)
        nvtp_comms = list(comm.calls)
        with CommDebugMode() as debug:
            step(dt)
        dtensor_comms = {str(k).split(".")[-1]: int(v) for k, v in debug.get_comm_counts().items()}
        compiled = nv.last

        seconds = timed_rounds({n: (lambda m=m: step(m)) for n, m in sides.items()}, job.rounds, job.warmup)
        measured = {}
        for name, m in sides.items():  # the GEMM floor (rank 0) and each rank's peak memory, 3 steps each
            dist.barrier()
            measured[name] = profile_step(lambda m=m: step(m))
        params = {n: sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in m.parameters())
                  for n, m in sides.items()}
        peaks = torch.tensor([[held[n], measured[n]["peak_bytes"], held[n] + measured[n]["peak_bytes"]] for n in sides],
                             dtype=torch.float64)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the rank that needs the most
        profiles = {}
        if job.profile:
            from torch.profiler import ProfilerActivity, profile

            for name, m in sides.items():
                dist.barrier()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        step(m)
                profiles[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        if rank == 0:
            result = {
                "job": asdict(job), "world": world, "errors": errors,
                "seconds": seconds,
                "first_call_seconds": first_call,
                "gemm_ms": {n: measured[n]["gemm_ms"] for n in sides},
                "gemm_share": {n: measured[n]["gemm_share"] for n in sides},
                "step_at_peak": {n: measured[n]["at_peak"] for n in sides},  # rank 0's
                "param_bytes": params,
                "held_bytes": {n: peaks[i, 0].item() for i, n in enumerate(sides)},  # kept between steps (measured)
                "step_peak_bytes": {n: peaks[i, 1].item() for i, n in enumerate(sides)},  # a step's own peak
                "peak_bytes": {n: peaks[i, 2].item() for i, n in enumerate(sides)},  # the two together
                "nvtp_collectives": [{"kind": k, "bytes": n, "sent_per_rank": s} for k, n, s in nvtp_comms],
                "nvtp_planned": {"forward": [c.kind for c in compiled.forward.communications],
                                 "backward": [c.kind for c in compiled.backward.communications]},
                "dtensor_collectives": dtensor_comms,
                "profiles": profiles,
            }
            with open(job.out, "w") as f:
                json.dump(result, f)
        return 0
    finally:
        dist.destroy_process_group()
