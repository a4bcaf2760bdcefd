"""Measure the figures docs/ quotes: fusion sizes, tracing time, errors against eager PyTorch,
sharded-versus-single errors and communication. Prints Markdown tables.

    .venv/bin/python tools/figures.py
"""

from __future__ import annotations

import datetime
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def fusion_sizes() -> None:
    from nvtp import dump

    print("| block | dtype | forward ops | backward ops | trace time (meta tensors) |")
    print("|---|---|---|---|---|")
    for config, dtype in [("tiny", torch.float32), ("gpt2", torch.bfloat16), ("gpt3", torch.bfloat16)]:
        start = time.perf_counter()
        captured, _ = dump.trace_block("nanogpt", config, dtype)
        seconds = time.perf_counter() - start
        f, b = captured.forward, captured.backward
        print(f"| {config} | {dump.SHORT[dtype]} | {len(list(f.compute_ops()))} | {len(list(b.compute_ops()))} | {seconds:.1f} s |")


def errors_vs_eager() -> None:
    from nvtp.dump import relative_error
    from nvtp.execute import reference
    from nvtp import driver
    from nvtp.frontend.capture import output_value, run_pair
    from nvtp.models import gpt

    print("| block | dtype | output rel. error | worst gradient rel. error (of 13) |")
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        cfg = gpt.config("tiny")
        torch.manual_seed(0)
        block = gpt.Block(cfg).to(dtype)
        x = gpt.example_input(cfg, dtype=dtype)
        c = driver.trace(block, (x,), regional=False, boundary=False)
        g = torch.randn(cfg.batch, cfg.seq_len, cfg.n_embd, generator=torch.Generator().manual_seed(1)).to(dtype)
        named = {n: p.detach() for n, p in block.named_parameters()} | {"x": x.detach()}
        values, grads = run_pair(c.forward, c.backward, named, g, lambda f, i: reference.run(f, i))
        xr = x.detach().clone().requires_grad_()
        y = block(xr)
        y.backward(g)
        out_err = relative_error(values[output_value(c.forward)], y)[0]
        worst = max([relative_error(grads["grad(x)"], xr.grad)[0]] + [relative_error(grads[f"grad({n})"], p.grad)[0] for n, p in block.named_parameters()])
        print(f"| tiny | {'fp32' if dtype == torch.float32 else 'bf16'} | {out_err:.1e} | {worst:.1e} |")


def sharded_vs_single() -> None:
    from nvtp import dump
    from nvtp import driver
    from nvtp.execute import reference, spmd
    from nvtp.sharding.placements import DeviceMesh

    captured, _ = dump.trace_block("nanogpt", "tiny", torch.float32, dropout=0.1, device="cpu")
    print("| plan | d | forward: worst rel. error | backward: worst rel. error | forward collectives | backward collectives |")
    print("|---|---|---|---|---|---|")
    for plan in ("megatron", "megatron-sp"):
        for d in (1, 2, 4):
            row = []
            comms = []
            program = driver.shard(driver.of_fusions(captured.forward, captured.backward), plan, DeviceMesh.of_size(d), "nvfuser")
            for s in (program.forward, program.backward):
                inputs = dump.random_inputs(s.source, seed=0)
                single = reference.run(s.source, inputs, seed=0)
                per_rank, _ = spmd.run_simulated(s, inputs, seed=0)
                checks = dump.check_outputs(s.source, spmd.assemble_outputs(s, per_rank), single)
                row.append(max(c.rel_error for c in checks))
                kinds = [c.kind for c in s.communications]
                comms.append(", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds))) or "none")
            print(f"| {plan} | {d} | {row[0]:.1e} | {row[1]:.1e} | {comms[0]} | {comms[1]} |")


def communication() -> None:
    from nvtp import driver, dump
    from nvtp.sharding.placements import DeviceMesh

    f = dump.load(ROOT / "fusions/nanogpt_gpt3_bf16_fwd.py").fusion
    b = dump.load(ROOT / "fusions/nanogpt_gpt3_bf16_bwd.py").fusion
    print("| plan | d | direction | collectives (tensor elements) | bytes per rank | sharding passes |")
    print("|---|---|---|---|---|---|")
    for plan in ("megatron", "megatron-sp"):
        d = 4
        start = time.perf_counter()
        program = driver.shard(driver.of_fusions(f, b), plan, DeviceMesh.of_size(d), "nvfuser")
        sf, sb = program.forward, program.backward
        ms = 1000 * (time.perf_counter() - start)
        for name, s in (("forward", sf), ("backward", sb)):
            groups: dict[tuple[str, int], int] = {}
            for c in s.communications:
                key = (c.kind, s.source.value(c.value).numel)
                groups[key] = groups.get(key, 0) + 1
            text = ", ".join(f"{n}× {k} ({e:,})" for (k, e), n in sorted(groups.items()))
            total = sum(c.bytes for c in s.communications)
            print(f"| {plan} | {d} | {name} | {text} | {total / 2**20:.1f} MiB | {ms:.0f} ms (fwd+bwd) |")


if __name__ == "__main__":
    print(f"Measured {datetime.date.today()} on {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    for section in (fusion_sizes, errors_vs_eager, sharded_vs_single, communication):
        print(f"### {section.__name__}\n")
        section()
        print()
