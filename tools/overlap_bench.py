"""A training step's forward and backward with the communication schedule (the default) and
without (``overlap=False``), the two interleaved in the same gloo processes, on nvtp's GPT (hidden
256, 4 heads, 4 layers, sequence 128, vocabulary 4096, fp32, one thread a rank).

    .venv/bin/python tools/overlap_bench.py --mesh 2x2 --fsdp     # (dp, tp) = (2, 2), FSDP
    .venv/bin/python tools/overlap_bench.py --mesh 4              # 1-D tensor parallelism, 4 ranks

Prints the median milliseconds a step of each, over 12 rounds after one warm-up step.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time

import torch


def worker(rank, world, init_method, out, shape, fsdp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import nvtp
    from nvtp.execute.launch import _quiet_stdout, init_group
    from nvtp.models import gpt

    init_group(rank, world, init_method, timeout_s=600)
    torch.set_num_threads(1)
    cfg = gpt.GPTConfig(n_embd=256, n_head=4, seq_len=128, batch=2, n_layer=4, vocab_size=4096)
    torch.manual_seed(0)
    base = gpt.GPT(cfg)
    idx, tgt = gpt.example_tokens(cfg)
    mesh = None
    if len(shape) == 2:
        with _quiet_stdout():
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        dp, n = mesh.get_local_rank("dp"), cfg.batch // shape[0]
        idx, tgt = idx[dp * n:(dp + 1) * n], tgt[dp * n:(dp + 1) * n]
    models = {"scheduled": nvtp.jit(copy.deepcopy(base), mesh=mesh, fsdp=fsdp),
              "blocking": nvtp.jit(copy.deepcopy(base), mesh=mesh, fsdp=fsdp, overlap=False)}
    for m in models.values():
        m(idx, tgt).backward()
    seconds = {k: [] for k in models}
    for _ in range(12):
        for k, m in models.items():
            dist.barrier()
            start = time.perf_counter()
            m(idx, tgt).backward()
            seconds[k].append(time.perf_counter() - start)
    if rank == 0:
        issued = {k: len(m.last.collectives()) for k, m in models.items()}
        with open(out, "w") as f:
            json.dump({"seconds": seconds, "collectives": issued}, f)
    dist.destroy_process_group()
    return 0


def main() -> None:
    from nvtp.execute.launch import spawn
    from nvtp.mesh import parse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="2x2", help="N (1-D) or DPxTP")
    p.add_argument("--fsdp", action="store_true")
    args = p.parse_args()
    shape = parse(args.mesh)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        assert spawn(worker, shape[0] * (shape[1] if len(shape) == 2 else 1), f.name, shape, args.fsdp) == [0] * (
            shape[0] * (shape[1] if len(shape) == 2 else 1))
        result = json.load(open(f.name))
    med = {k: 1000 * statistics.median(v) for k, v in result["seconds"].items()}
    print(f"mesh {args.mesh}{' fsdp' if args.fsdp else ''}: scheduled {med['scheduled']:.1f} ms "
          f"({result['collectives']['scheduled']} collectives), blocking {med['blocking']:.1f} ms "
          f"({result['collectives']['blocking']} collectives): ratio {med['scheduled'] / med['blocking']:.2f}")


if __name__ == "__main__":
    main()
