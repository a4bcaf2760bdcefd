"""Train the small GPT with ``thunder.jit`` and nvtp's sharding transform, under torchrun (or alone):

    torchrun --nproc-per-node 2 tools/thunder_train.py --plan megatron --steps 5
    python tools/thunder_train.py                      # one process: a mesh of 1

Each rank joins the default process group (gloo on CPU, NCCL on GPUs) and trains

    jm = thunder.jit(model, transforms=[nvtp.ShardingTransform(plan=plan)])
    opt = torch.optim.SGD(jm.parameters(), lr=lr)
    loss = jm(idx, targets); opt.zero_grad(); loss.backward()
    torch.nn.utils.clip_grad_norm_(jm.parameters(), max_norm); opt.step()

then rank 0 trains the same model in eager PyTorch on one process and prints whether every
loss (and that of a last call of half the length, which Thunder traces anew), every gradient norm (the whole model's: on a mesh of processes the parameters are DTensors)
and the final weights (``jm.original_state_dict()``, gathered whole) agree.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="megatron")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--max-norm", type=float, default=1.0, help="clip_grad_norm_'s max_norm (the tiny GPT's norms are about 3.5)")
    p.add_argument("--out", default=None, help="each rank writes its losses, whole weights and bytes held to OUT.<rank> (torch.save)")
    args = p.parse_args()

    import thunder
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import nvtp
    from nvtp.execute.launch import init_group
    from nvtp.models import gpt

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        init_group(rank, world, None, timeout_s=300)
    cfg = gpt.config("tiny")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    eager = copy.deepcopy(model) if rank == 0 else None
    whole_bytes = sum(t.nbytes for t in model.parameters())
    jm = thunder.jit(model, transforms=[nvtp.ShardingTransform(plan=args.plan)])  # mesh: every rank of the group
    opt = torch.optim.SGD(jm.parameters(), lr=args.lr)
    losses, norms = [], []
    for step in range(args.steps):
        idx, targets = gpt.example_tokens(cfg, seed=step)
        loss = jm(idx, targets)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(jm.parameters(), args.max_norm)))
        opt.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step + 1:3d}/{args.steps}  loss {losses[-1]:.6f}", flush=True)
    calls = (_calls(thunder.last_traces(jm)[-1]), _calls(thunder.last_backward_traces(jm)[-1]))  # of the training steps
    short = tuple(t[:, : cfg.seq_len // 2].contiguous() for t in gpt.example_tokens(cfg, seed=args.steps))
    with torch.no_grad():
        short_loss = jm(*short).item()  # another length: Thunder traces again, with the parameters sharded already
    parts = {n: t.to_local() if isinstance(t, DTensor) else t for n, t in jm.named_parameters()}  # this rank's part
    held = sum(t.nbytes for t in parts.values())
    weights = jm.original_state_dict()  # a collective: every rank gathers the whole weights
    if args.out:
        torch.save({"losses": losses, "norms": norms, "short_loss": short_loss, "weights": weights, "bytes": held, "misses": thunder.cache_misses(jm),
                    "shapes": {n: tuple(t.shape) for n, t in parts.items()},
                    "types": sorted({type(t).__name__ for t in jm.parameters()})}, f"{args.out}.{rank}")
    ok = True
    if rank == 0:
        print(f"thunder.jit with nvtp.ShardingTransform(plan={args.plan!r}) on {world} process(es): each rank holds "
              f"{held:,} of the {whole_bytes:,} parameter bytes; Thunder compiled {thunder.cache_misses(jm)} time(s)")
        print(f"the forward trace calls {', '.join(sorted(calls[0]))}; the backward trace {', '.join(sorted(calls[1]))}")
        opt = torch.optim.SGD(eager.parameters(), lr=args.lr)
        want, want_norms = [], []
        for step in range(args.steps):
            loss = eager(*gpt.example_tokens(cfg, seed=step))
            opt.zero_grad()
            loss.backward()
            want_norms.append(float(torch.nn.utils.clip_grad_norm_(eager.parameters(), args.max_norm)))
            opt.step()
            want.append(loss.item())
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        norm_diff = max(abs(a - b) / abs(b) for a, b in zip(norms, want_norms))
        weight_diff = max((weights[n] - t).abs().max().item() for n, t in eager.named_parameters())
        with torch.no_grad():
            loss_diff = max(loss_diff, abs(short_loss - eager(*short).item()) / abs(short_loss))
        ok = loss_diff <= 1e-5 and norm_diff <= 1e-5 and weight_diff <= 1e-4
        print(f"against eager PyTorch on one process: losses within {loss_diff:.1e}, gradient norms within {norm_diff:.1e} "
              f"(relative), weights within {weight_diff:.1e}; tolerances 1e-5, 1e-5 and 1e-4: {'PASSED' if ok else 'FAILED'}")
    if world > 1:
        dist.destroy_process_group()
    return 0 if ok else 1


def _calls(trace) -> set[str]:
    """The nvtp symbols a Thunder trace calls."""
    return {b.sym.name for b in trace.bound_symbols if b.sym.name.startswith("nvtp_")}


if __name__ == "__main__":
    sys.exit(main())
