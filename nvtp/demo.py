"""``nvtp demo``: the main job on this machine.

Trace a GPT block with Thunder, shard its forward and backward fusions with the ``megatron``
plan, run them on a local CPU mesh of processes (gloo), and compare the output and every
gradient with eager PyTorch on one device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class BlockJob:
    forward: object  # ShardedFusion
    backward: object
    named: dict  # whole parameters and x
    grad: torch.Tensor
    seed: int


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def block_worker(rank: int, world: int, init_method: str, job: BlockJob) -> int:
    import torch.distributed as dist

    from nvtp.execute import spmd
    from nvtp.execute.collectives import DistComm
    from nvtp.execute.launch import init_group
    from nvtp.frontend.capture import backward_inputs, forward_inputs

    fwd, bwd = job.forward, job.backward
    init_group(rank, world, init_method)
    try:
        comm = DistComm()
        # Each rank keeps only its shards of the parameters and of x.
        local_named = {}
        for v in fwd.source.inputs:
            label = fwd.source.label(v.name)
            local_named[label] = spmd.shard_tensor(job.named[label], fwd.placement(v.name), fwd.mesh, rank)
        held = sum(t.nbytes for t in local_named.values())
        f_in = forward_inputs(fwd.source, local_named)
        f_out = spmd.run_rank(fwd, f_in, comm, seed=job.seed)
        values = {v.name: t for v, t in zip(fwd.source.inputs, f_in)}
        values.update({src.name: t for src, t in zip(fwd.source.outputs, f_out)})
        y_value = next(v for v in fwd.fusion.outputs if fwd.source.role(v.name) == "output" or v.name in fwd.set_steps)
        grad_placement = next(bwd.placement(v.name) for v in bwd.fusion.inputs if bwd.source.role(v.name) == "grad")
        g = spmd.shard_tensor(job.grad, grad_placement, bwd.mesh, rank)
        b_in = backward_inputs(bwd.source, local_named, values, g)
        b_out = spmd.run_rank(bwd, b_in, comm, seed=job.seed)
        _ = y_value
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((f_out, b_out, held), gathered, dst=0)
        if rank == 0:
            torch.save(gathered, job.named["__result_path__"])
        return 0
    finally:
        dist.destroy_process_group()


def main(args) -> int:
    import os
    import tempfile

    from nvtp.dump import relative_error
    from nvtp.execute import spmd
    from nvtp.execute.launch import spawn
    from nvtp.frontend.capture import capture, output_value
    from nvtp.models import gpt
    from nvtp.sharding.pipeline import shard_pair
    from nvtp.sharding.placements import DeviceMesh, describe, local_shape

    d = args.devices
    cfg = gpt.config(args.config)
    torch.manual_seed(0)
    block = gpt.Block(cfg)
    x = gpt.example_input(cfg)
    print(f"nvtp demo: a GPT block (config {args.config}: batch {cfg.batch}, sequence {cfg.seq_len}, hidden {cfg.n_embd}, "
          f"{cfg.n_head} heads; fp32) sharded over a local CPU mesh of {d} processes\n")

    start = time.perf_counter()
    c = capture(block, x)
    print(f"1. Thunder traced the block into one forward fusion ({len(list(c.forward.compute_ops()))} ops) and one backward "
          f"fusion ({len(list(c.backward.compute_ops()))} ops) in {time.perf_counter() - start:.1f} s")

    start = time.perf_counter()
    fwd, bwd = shard_pair(c.forward, c.backward, "megatron", DeviceMesh.of_size(d))
    print(f"2. plan megatron, derived from the graph in {1000 * (time.perf_counter() - start):.0f} ms:")
    for note in fwd.annotations.notes:
        print(f"     {note}")
    print("   parameters per rank:")
    for v in c.forward.inputs:
        label = c.forward.label(v.name)
        p = fwd.shardings[v.name]
        if label != "x" and describe(p) != "R":
            print(f"     {label:22} {describe(p):9} {list(v.shape)} -> {list(local_shape(v.shape, p, fwd.mesh))} per rank")
    for name, s in (("forward", fwd), ("backward", bwd)):
        comms = s.communications
        print(f"   {name} communication: {len(comms)} collective(s), {_mib(sum(x.bytes for x in comms))} per rank")
        for st in comms:
            v = s.source.value(st.value)
            print(f"     {st.kind:15} {st.value:>5} {v.dtype.value}{list(v.shape)} {st.src} -> {st.dst}  {_mib(st.bytes)}")

    g = torch.randn(cfg.batch, cfg.seq_len, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    named = {n: p.detach().clone() for n, p in block.named_parameters()} | {"x": x.detach().clone()}
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.pt")
        named["__result_path__"] = result_path
        start = time.perf_counter()
        codes = spawn(block_worker, d, BlockJob(fwd, bwd, named, g, seed=0))
        if any(codes):
            print(f"3. FAILED: rank exit codes {codes}")
            return 4
        gathered = torch.load(result_path, weights_only=False)
    print(f"\n3. ran forward and backward on {d} processes (gloo) in {time.perf_counter() - start:.1f} s, "
          f"each rank holding {_mib(gathered[0][2])} of {_mib(sum(t.nbytes for k, t in named.items() if k != '__result_path__'))} "
          "of parameters and input")
    f_out = spmd.assemble_outputs(fwd, [r[0] for r in gathered])
    b_out = spmd.assemble_outputs(bwd, [r[1] for r in gathered])
    y = f_out[[v.name for v in c.forward.outputs].index(output_value(c.forward))]
    grads = {c.backward.label(v.name): t for v, t in zip(c.backward.outputs, b_out)}

    x_ref = x.detach().clone().requires_grad_()
    y_ref = block(x_ref)
    y_ref.backward(g)
    errors = {"y": relative_error(y, y_ref)[0], "grad(x)": relative_error(grads["grad(x)"], x_ref.grad)[0]}
    for n, p in block.named_parameters():
        errors[f"grad({n})"] = relative_error(grads[f"grad({n})"], p.grad)[0]
    worst = max(errors, key=errors.get)
    ok = errors[worst] <= 1e-5
    print(f"4. check against eager PyTorch on one device: output and {len(errors) - 1} gradients, worst relative error "
          f"{errors[worst]:.2e} ({worst}); tolerance 1e-5: {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1
