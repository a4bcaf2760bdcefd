"""Train a model defined in someone else's Python file, sharded with nvtp under torchrun, and check
it against the same training in one plain process (the rows of docs/models.md):

    torchrun --nproc-per-node 2 tools/train_file.py /tmp/llama2_model.py \\
        --build 'Transformer.from_model_args(ModelArgs(dim=256, n_layers=2, n_heads=16, vocab_size=512))' \\
        --vocab 512 --plan megatron --steps 10

The file is imported as it is, from where it lies (its folder goes on ``sys.path``, so its own
imports work); ``--build`` is a Python expression evaluated in that module's namespace (the
model's own constructor and config class), ``--setup`` statements run on the built ``model``
(a model that wants its caches set up first), ``--args`` further arguments of each call. Every rank builds the model from the same seed, wraps
it with ``nvtp.jit`` and trains it with SGD on the same random token batches; rank 0 trains an
unsharded copy in eager PyTorch beside it, prints both losses, the plan's split weights and the
worst differences, and exits 1 if a loss differs by more than ``--loss-tolerance`` or a final
weight by more than ``--tolerance`` (relative).

``--loss logits`` (default): ``model(tokens)`` returns logits ``[B, T, vocab]``, the loss is
cross-entropy against the next tokens. ``--loss returned``: ``model(tokens, targets)`` returns the
loss, or a tuple holding it (nanoGPT's ``(logits, loss)``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch


def load(path: str):
    """The module at ``path``, imported under its own name with its folder on ``sys.path``."""
    folder, name = os.path.dirname(os.path.abspath(path)), os.path.splitext(os.path.basename(path))[0]
    sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def batch(step: int, vocab: int, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, vocab, (size[0], size[1] + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def loss_of(model, tokens: torch.Tensor, targets: torch.Tensor, how: str, extra: tuple = ()) -> torch.Tensor:
    if how == "logits":
        logits = model(tokens, *extra)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    out = model(tokens, targets, *extra)
    if isinstance(out, (tuple, list)):
        out = next(x for x in out if isinstance(x, torch.Tensor) and x.dim() == 0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="the Python file that defines the model")
    p.add_argument("--build", required=True, help="expression that builds the model, in the file's namespace")
    p.add_argument("--vocab", type=int, required=True, help="token ids are drawn from [0, vocab)")
    p.add_argument("--setup", default="", help="statements run once after --build, with the model as `model` (e.g. caches)")
    p.add_argument("--args", default="", help="further positional arguments of each call, an expression (e.g. positions)")
    p.add_argument("--plan", default="megatron")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--loss", default="logits", choices=["logits", "returned"])
    p.add_argument("--frontend", default="auto", choices=["auto", "thunder", "fx"])
    p.add_argument("--loss-tolerance", type=float, default=1e-5)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--mesh", default="", help="DPxTP, or axes by name (cp=2, cp=2,tp=2, dp=2,cp=2): the mesh over the processes (default: a 1-D tp mesh of all)")
    p.add_argument("--fsdp", action="store_true", help="with --mesh: split the weights over dp too")
    p.add_argument("--collective-matmul", default="auto", choices=["auto", "on", "off"],
                   help="megatron-sp's gathers and reduce-scatters around the projections as ring steps (nvtp.jit's collective_matmul)")
    p.add_argument("--microbatches", type=int, default=None, help="with a pp axis in --mesh (pp=2, pp=2,tp=2): microbatches a step")
    args = p.parse_args()

    import nvtp
    from nvtp.execute.launch import init_group

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        init_group(rank, world, None)
    source = load(args.file)
    namespace = {**vars(source), "torch": torch}

    def build():
        torch.manual_seed(0)
        model = eval(args.build, namespace)  # noqa: S307 - a developer's own command line, in the file's namespace
        if args.setup:
            exec(args.setup, {**namespace, "model": model})  # noqa: S102 - as --build
        return model

    model = build()
    extra = tuple(eval(f"({args.args},)", namespace)) if args.args else ()  # noqa: S307 - as --build
    # Built again rather than deep-copied: a model may keep functions closing over its own parts
    # (minGPT's `self.mlpf = lambda x: m.c_proj(...)`), which a deep copy would share with the original.
    reference = build() if rank == 0 else None
    if reference is not None:
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values())), \
            "--build is not deterministic under torch.manual_seed(0)"
    mesh, dp, dp_index = None, 1, 0
    if args.mesh:
        from torch.distributed.device_mesh import init_device_mesh

        if "=" in args.mesh:  # axes by name: cp=2, cp=2,tp=2, dp=2,cp=2
            axes = [(n.strip(), int(k)) for n, k in (pair.split("=") for pair in args.mesh.split(","))]
        else:  # DPxTP
            axes = list(zip(("dp", "tp"), (int(n) for n in args.mesh.lower().split("x"))))
        names, sizes = tuple(n for n, _ in axes), tuple(k for _, k in axes)
        dp = dict(axes).get("dp", 1)
        if torch.Size(sizes).numel() != world or args.batch % dp:
            raise SystemExit(f"--mesh {args.mesh}: needs {' x '.join(map(str, sizes))} = {world} processes and dp to divide --batch {args.batch}")
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        if "dp" in names:  # this rank's coordinate on the dp axis (row-major ranks)
            inner = torch.Size(sizes[names.index("dp") + 1:]).numel()
            dp_index = rank // inner % dp
    pipeline = {"microbatches": args.microbatches} if args.microbatches else {}
    from nvtp.sharding.collective_matmul import SPELLED

    rings = {} if pipeline else {"collective_matmul": SPELLED[args.collective_matmul]}
    sharded = nvtp.jit(model, plan=args.plan, frontend=args.frontend, mesh=mesh, fsdp=args.fsdp, **pipeline, **rings)
    rows = slice(dp_index * (args.batch // dp), (dp_index + 1) * (args.batch // dp))  # this dp rank's rows (cp and tp ranks: all)
    opt = torch.optim.SGD(sharded.parameters(), lr=args.lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr) if reference is not None else None
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"train_file: {type(model).__name__} from {args.file} ({sum(p.numel() for p in reference.parameters()) if reference else 0:,} "
        f"parameters) with plan {args.plan} over {world} process(es)"
        f"{f', mesh {args.mesh}' + (' fsdp' if args.fsdp else '') if args.mesh else ''}")

    worst_loss = 0.0
    for step in range(args.steps):
        tokens, targets = batch(step, args.vocab, (args.batch, args.seq))
        start = time.perf_counter()
        loss = loss_of(sharded, tokens[rows], targets[rows], args.loss, extra)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seconds = time.perf_counter() - start
        if dp > 1:  # DDP's convention: each dp rank's loss is its rows' mean; the whole batch's is their mean
            import torch.distributed as dist

            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world  # tp and cp ranks of one dp rank hold the same loss
        if step == 0 and pipeline:
            stages = sharded.program.as_data()["stages"]
            say(f"   pipeline of {len(stages)} stages, blocks " + ", ".join(str(st["blocks"]) for st in stages)
                + f"; {args.microbatches} microbatches, schedule {sharded.schedule}")
        elif step == 0:
            c = sharded.last
            say(f"   route {c.traced.route} ({c.traced.how}); forward fusion {len(list(c.forward.source.compute_ops()))} "
                f"ops, backward {len(list(c.backward.source.compute_ops()))} ops; trace {c.traced.seconds:.1f} s")
            rings = {phase: len(getattr(s, "rings", ())) for phase, s in c.schedules.items()}
            if any(rings.values()):
                say("   collective matmuls (ring steps beside the matmul's blocks): " + ", ".join(f"{n} {p}" for p, n in rings.items()))
        if reference is not None:
            want = loss_of(reference, tokens, targets, args.loss, extra)
            ref_opt.zero_grad()
            want.backward()
            ref_opt.step()
            diff = abs(loss.item() - want.item()) / abs(want.item())
            worst_loss = max(worst_loss, diff)
            say(f"step {step + 1:3d}/{args.steps}  loss {loss.item():.6f}  one process {want.item():.6f}  {seconds * 1e3:8.1f} ms")

    worst_param, held, whole_bytes, split = 0.0, 0, 0, []
    if pipeline:  # a rank holds its stage's parameters only: gather them whole (a collective)
        wholes = sharded.full_parameters()
        for name, want in (reference.named_parameters() if reference is not None else ()):
            whole = wholes[name]
            worst_param = max(worst_param, ((whole - want.detach()).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    for name, param in ([] if pipeline else sharded.module.named_parameters()):
        whole = nvtp.full_tensor(param)  # a collective: every rank takes part
        local = param.to_local() if hasattr(param, "to_local") else param
        held += local.numel() * local.element_size()
        whole_bytes += whole.numel() * whole.element_size()
        placement = sharded.placement(name)
        if str(placement) != "R":
            split.append(f"{name} {placement}")
        if reference is not None:
            want = dict(reference.named_parameters())[name].detach()
            worst_param = max(worst_param, ((whole - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    if not pipeline:
        say(f"split weights ({len(split)}): " + ", ".join(split))
        say(f"rank 0 holds {held:,} of {whole_bytes:,} parameter bytes ({held / whole_bytes:.2f})")
    ok = worst_loss <= args.loss_tolerance and worst_param <= args.tolerance
    say(f"check against one process: every loss within {worst_loss:.1e} (relative), final weights within {worst_param:.1e}; "
        f"tolerances {args.loss_tolerance:g} / {args.tolerance:g}: {'PASSED' if ok else 'FAILED'}")
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0 if ok or rank != 0 else 1


if __name__ == "__main__":
    sys.exit(main())
