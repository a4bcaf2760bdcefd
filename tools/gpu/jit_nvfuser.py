"""``nvtp.jit(model, backend="nvfuser")`` on one GPU: parity with eager, a profile, and a timing.

    python3 tools/gpu/jit_nvfuser.py parity [gpt|moe|llama]  # fp32, 10 SGD steps against eager: tiny GPT, MoE GPT, transformers Llama
    python3 tools/gpu/jit_nvfuser.py profile    # torch.profiler of one step: whose kernels run
    python3 tools/gpu/jit_nvfuser.py bench [N]  # N layers (4); bf16 GPT step: nvtp, thunder.jit, torch.compile, eager, interleaved

Run on the lent GPU machine (tools/gpu/run_jit.sh installs nvFuser and Thunder there first).
"""

from __future__ import annotations

import copy
import sys
import time

import torch

import nvtp
from nvtp.models import gpt


def _case(name: str):
    """(eager model on the GPU, batch(step), loss(model, batch)) for ``name``: gpt, moe (nvtp's MoE GPT) or llama (transformers)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "llama":
        from nvtp.models import hf

        return hf.build("llama").cuda(), lambda step: (hf.batch(step).cuda(),), lambda m, b: m(input_ids=b[0], labels=b[0]).loss
    if name == "moe":
        from nvtp.models import moe

        cfg = moe.config("tiny")
        model = moe.MoEGPT(cfg).cuda()
    else:
        cfg = gpt.config("tiny", dropout=0.0)
        model = gpt.GPT(cfg).cuda()

    def batch(step):
        return tuple(torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=g).cuda() for _ in range(2))

    return model, batch, lambda m, b: m(*b)


def parity(name: str = "gpt", steps: int = 10) -> None:
    eager, batch, loss_of = _case(name)
    model = nvtp.jit(copy.deepcopy(eager), backend="nvfuser")
    print(f"{name}: backend {model.backend}, mesh {model.mesh}", flush=True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager))
    worst = 0.0
    for step in range(steps):
        b = batch(step)
        start = time.perf_counter()
        loss = loss_of(model, b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        want = loss_of(eager, b)
        ref_opt.zero_grad()
        want.backward()
        ref_opt.step()
        rel = abs(loss.item() - want.item()) / abs(want.item())
        worst = max(worst, rel)
        print(f"step {step + 1:2d}  nvtp {loss.item():.7f}  eager {want.item():.7f}  rel {rel:.2e}  {seconds * 1e3:9.1f} ms", flush=True)
    params = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(model.module.parameters(), eager.parameters()))
    program = model.last
    print(f"program: backend {program.backend}, forward {len(program.forward.fusion.ops)} ops, backward {len(program.backward.fusion.ops)} ops, "
          f"traced: {program.traced.how}")
    print(f"PARITY {name} worst loss rel {worst:.2e}, final parameters max |diff| {params:.2e}: {'PASSED' if worst <= 1e-4 else 'FAILED'} (tolerance 1e-4)")


def profile() -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cfg = gpt.config("gpt2", n_layer=2, dropout=0.0, batch=2)
    torch.manual_seed(0)
    model = nvtp.jit(gpt.GPT(cfg).cuda().to(torch.bfloat16), plan="megatron", backend="nvfuser")
    idx, tgt = (t.cuda() for t in gpt.example_tokens(cfg))
    for _ in range(3):
        model(idx, tgt).backward()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        model(idx, tgt).backward()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    total = sum(sum(v) for v in kernels.values())
    nv = {k: v for k, v in kernels.items() if k.startswith("nvfuser") or "nvfuser" in k}
    print(f"PROFILE one step (GPT-2 width, 2 layers, bf16, batch 2 x 1024): {sum(len(v) for v in kernels.values())} kernel launches, "
          f"{len(kernels)} distinct; nvFuser-generated ({len(nv)} distinct, {sum(len(v) for v in nv.values())} launches) "
          f"{100 * sum(sum(v) for v in nv.values()) / max(total, 1):.1f}% of GPU time")
    for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:20]:
        print(f"  {sum(times) / 1e3:8.3f} ms  x{len(times):3d}  {name[:110]}")


def bench(n_layer: int = 4, only: str = "eager,nvtp,compile,thunder", rounds: int = 5, iters: int = 10) -> None:
    cfg = gpt.config("gpt2", n_layer=n_layer, dropout=0.0, batch=4)
    torch.manual_seed(0)
    base = gpt.GPT(cfg).cuda().to(torch.bfloat16)
    idx, tgt = (t.cuda() for t in gpt.example_tokens(cfg))
    variants = {}
    made = {}

    def add(name, make):
        if {"nvtp.jit nvfuser": "nvtp", "torch.compile": "compile", "thunder.jit": "thunder"}.get(name, name) not in only.split(","):
            return
        start = time.perf_counter()
        try:
            m = make(copy.deepcopy(base))
            m(idx, tgt).backward()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported verbatim
            print(f"BENCH {name}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            return
        made[name] = time.perf_counter() - start
        variants[name] = m
        print(f"BENCH {name}: first step (compile) {made[name]:.1f} s", flush=True)

    add("eager", lambda m: m)
    add("nvtp.jit nvfuser", lambda m: nvtp.jit(m, plan="megatron", backend="nvfuser"))
    add("torch.compile", lambda m: torch.compile(m))

    def thunder_jit(m):
        import nvfuser_direct

        # Thunder 0.2.6's nvFuser executor still imports the legacy module for one helper
        # (nvfuserex_impl: `from nvfuser import compute_tensor_descriptor`); nvfuser_direct has it.
        sys.modules.setdefault("nvfuser", nvfuser_direct)
        import thunder

        return thunder.jit(m)

    add("thunder.jit", thunder_jit)
    times = {n: [] for n in variants}
    peaks = {n: 0 for n in variants}
    for name, m in variants.items():  # warm-up
        for _ in range(3):
            m(idx, tgt).backward()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, m in variants.items():
            for p in m.parameters():
                p.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_mem = torch.cuda.memory_allocated()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                m(idx, tgt).backward()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / iters)
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() - base_mem)
    eager_ms = sorted(times["eager"])[len(times["eager"]) // 2]
    print(f"BENCH GPT (hidden {cfg.n_embd}, {cfg.n_head} heads, {cfg.n_layer} layers, vocab {cfg.vocab_size}, batch {cfg.batch} x {cfg.seq_len}, "
          f"bf16), forward + backward, {rounds} interleaved rounds of {iters} steps:")
    for name, ts in times.items():
        med = sorted(ts)[len(ts) // 2]
        print(f"  {name:18} median {med:8.3f} ms (min {min(ts):.3f}, max {max(ts):.3f})  {med / eager_ms:5.2f}x eager  "
              f"peak memory above the parameters {peaks[name] / 2**20:8.1f} MiB  first step {made[name]:.1f} s")


if __name__ == "__main__":
    step, *args = sys.argv[1:]
    if step == "parity":
        parity(*args)
    elif step == "bench":
        bench(int(args[0]) if args else 4, *args[1:])
    else:
        profile()
