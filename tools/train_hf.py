"""Train a small Hugging Face causal LM, built from a config, sharded with nvtp under torchrun,
and check it against the same training on one process:

    torchrun --nproc-per-node 2 tools/train_hf.py --model llama --plan megatron --steps 20

Every rank builds the model from the same seed (random init; nothing is downloaded), wraps it
with ``nvtp.jit`` (the FX route: TorchDynamo's graph of the whole forward, traced by Thunder into
one forward and one backward fusion, sharded by the plan) and trains it with SGD on the same
batches, calling it as transformers users do: ``model(input_ids, labels=labels).loss``. Rank 0
trains an unsharded copy in plain PyTorch beside it, prints both losses and the worst
differences, and exits 1 if any loss or final parameter differs by more than ``--tolerance``
(relative). Needs transformers (``uv sync`` installs it with the dev group; ``pip install nvtp[hf]``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

from nvtp.models.hf import CONFIGS, batch, build  # the small configs, shared with nvtp demo --model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=sorted(CONFIGS))
    p.add_argument("--plan", default="megatron")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--tolerance", type=float, default=1e-4)
    args = p.parse_args()

    try:
        import transformers  # noqa: F401
    except ImportError:
        print("train_hf: transformers is not installed; run `uv sync` (dev group) or `pip install nvtp[hf]`", file=sys.stderr)
        return 2
    import nvtp
    from nvtp.execute.launch import init_group

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        init_group(rank, world, None)
    model = build(args.model)
    reference = copy.deepcopy(model) if rank == 0 else None
    sharded = nvtp.jit(model, plan=args.plan)
    opt = torch.optim.SGD(sharded.parameters(), lr=args.lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr) if reference is not None else None
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"train_hf: {type(model).__name__} ({sum(p.numel() for p in reference.parameters()) if reference else 0:,} parameters, fp32) "
        f"sharded with plan {args.plan} over {world} process(es)")

    worst_loss = 0.0
    for step in range(args.steps):
        idx = batch(step)
        start = time.perf_counter()
        out = sharded(idx, labels=idx)  # the model's own output object
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        seconds = time.perf_counter() - start
        if reference is not None:
            want = reference(idx, labels=idx)
            ref_opt.zero_grad()
            want.loss.backward()
            ref_opt.step()
            diff = abs(out.loss.item() - want.loss.item()) / abs(want.loss.item())
            worst_loss = max(worst_loss, diff)
            say(f"step {step + 1:3d}/{args.steps}  loss {out.loss.item():.6f}  one process {want.loss.item():.6f}  {seconds * 1e3:8.1f} ms")
        if step == 0:
            c = sharded.last
            say(f"   traced and sharded: forward fusion {len(list(c.forward.source.compute_ops()))} ops, backward "
                f"{len(list(c.backward.source.compute_ops()))} ops; trace {c.traced.seconds:.1f} s")

    worst_param = 0.0
    for name, p in sharded.module.named_parameters():
        whole = nvtp.full_tensor(p)  # a collective: every rank takes part
        if reference is not None:
            want = dict(reference.named_parameters())[name].detach()
            worst_param = max(worst_param, ((whole - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    ok = worst_loss <= args.tolerance and worst_param <= args.tolerance
    say(f"check against one process: every loss within {worst_loss:.1e} (relative), final parameters within {worst_param:.1e}; "
        f"tolerance {args.tolerance:g}: {'PASSED' if ok else 'FAILED'}")
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0 if ok or rank != 0 else 1


if __name__ == "__main__":
    sys.exit(main())
