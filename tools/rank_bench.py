"""One rank's forward + backward against eager PyTorch, interleaved in one process: nvtp on a
mesh of one with ``compile="inductor"`` (the kernels, then each rank's compute compiled by
Inductor: ``nvtp/execute/inductor.py``), with ``compile="kernels"`` (the default: attention traced as ``sdpfa_fwd`` /
``sdpfa_bwd``, run by torch's CPU flash kernels), the same with the attention traced as Thunder
decomposes it (``saved-p``: the backward keeps the probabilities, as before the flash claim; the
causal-attention entry runs its forward), with only the LayerNorm, GELU and softmax patterns
(``ln-gelu``: the reference backend before issue 37, attention decomposed), and ``compile="none"``
(the interpreter, attention as ``sdpfa`` by its implementations' formulas).

    .venv/bin/python tools/rank_bench.py                    # nvtp's GPT and a transformers Llama
    .venv/bin/python tools/rank_bench.py gpt --rounds 30 --threads 1
    .venv/bin/python tools/rank_bench.py gpt llama torch-llama --modes inductor,kernels --threads 1

The models (docs/benchmarks.md, issue 37): nvtp's GPT (hidden 384, 6 heads, sequence 256, batch 2,
2 blocks, vocabulary 4096, no dropout) and a transformers ``LlamaForCausalLM`` from a small config
(hidden 256, 4 blocks, 4 heads, sequence 128, batch 2, SwiGLU 688, vocabulary 1024), and PyTorch's
example Llama (``torch-llama``: ``tests/complex_rotary.py``, the same sizes). Each round
runs every implementation once, in turn (``benchmarks.harness.interleave``); a step is the loss,
its backward, and the gradients dropped. Printed: the 1-minute load average before and after
(the machine is shared: read the ratios, measured side by side, not the times), each
implementation's median and quartiles, the median of the per-round ratios to eager with its
~95 % interval, the first call (trace, shard, lower, run), and the GEMM floor: eager's time in
matrix products alone (torch.profiler, one step), the least any rank can take on this CPU.
Every implementation's loss and gradients are checked against eager's first.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.harness import GEMMS, Timing, interleave, paired_ratio  # noqa: E402


def gpt_case():
    from nvtp.models import gpt

    cfg = gpt.config("tiny", n_embd=384, n_head=6, seq_len=256, batch=2, n_layer=2, vocab_size=4096, dropout=0.0)
    torch.manual_seed(0)
    model = gpt.GPT(cfg).train()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=g)
    return model, (idx, tgt), {}, lambda out: out


def llama_case():
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256, use_cache=False,
                                   bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    idx = torch.randint(0, cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": idx, "labels": idx}, lambda out: out.loss


def torch_llama_case():
    """PyTorch's example Llama as ``tests/complex_rotary.py`` writes it (pytorch/examples'
    ``llama2_model.py``: complex rotary, RMSNorm, SwiGLU), at the transformers Llama's sizes; the
    cross-entropy on its logits, outside the model, as that example's training loop does."""
    import torch.nn.functional as F

    from tests.complex_rotary import ComplexRotaryLM, Config

    torch.manual_seed(0)
    model = ComplexRotaryLM(Config(dim=256, layers=4, heads=4, kv_heads=4, vocab=1024, hidden=688, max_seq=128)).train()
    data = torch.randint(0, 1024, (2, 129), generator=torch.Generator().manual_seed(1))
    idx, tgt = data[:, :-1], data[:, 1:]
    return model, (idx,), {}, lambda logits: F.cross_entropy(logits.reshape(-1, 1024), tgt.reshape(-1))


CASES = {"gpt": gpt_case, "llama": llama_case, "torch-llama": torch_llama_case}


def _step(model, args, kwargs, loss_of):
    inner = getattr(model, "module", model)

    def step():
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
        grads = [p.grad for p in inner.parameters()]
        inner.zero_grad(set_to_none=True)
        return loss.detach(), grads

    return step


def _check(name: str, got, want) -> None:
    (loss, grads), (want_loss, want_grads) = got, want
    worst = max((g - w).abs().max().item() / (w.abs().max().item() or 1.0) for g, w in zip(grads, want_grads))
    if abs(loss.item() - want_loss.item()) > 1e-4 * abs(want_loss.item()) or worst > 1e-4:
        raise SystemExit(f"{name} differs from eager: loss {loss.item()} vs {want_loss.item()}, gradients {worst:.2e}")


@contextlib.contextmanager
def _without(tables: str):
    """While tracing and lowering: "decomposed" (``saved-p``: attention traced as Thunder
    decomposes it, the reference target's ``flash_attention`` off), "all but patterns.py"
    (``ln-gelu``: that, and the kernels pass with only the LayerNorm, GELU and softmax patterns main
    had before issue 37), or "" (nothing left out)."""
    from dataclasses import replace

    from nvtp.execute import attention_kernel, kernels
    from nvtp.sharding import target

    saved, attention, targets = list(kernels.KERNELS), list(attention_kernel.ATTENTION), dict(target.TARGETS)
    if tables:
        target.TARGETS["reference"] = replace(targets["reference"], flash_attention=False)
    if tables == "all but patterns.py":
        kernels.KERNELS.clear()
        attention_kernel.ATTENTION.clear()
    try:
        yield
    finally:
        kernels.KERNELS[:] = saved
        attention_kernel.ATTENTION[:] = attention
        target.TARGETS.update(targets)


# name -> (compile=, what is left out while tracing and lowering)
MODES = {"eager": (None, ""), "inductor": ("inductor", ""), "kernels": ("kernels", ""), "saved-p": ("kernels", "decomposed"),
         "ln-gelu": ("kernels", "all but patterns.py"), "none": ("none", "")}


def _gemm_share(step) -> float:
    """The fraction of one step's aten time spent in matrix products (self CPU time)."""
    with torch.profiler.profile() as prof:
        step()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in GEMMS) / total if total else 0.0


def run(case: str, rounds: int, warmup: int, modes: list[str]) -> None:
    import nvtp
    from nvtp.sharding.placements import DeviceMesh

    model, args, kwargs, loss_of = CASES[case]()
    steps, first = {}, {}
    for name in modes:
        compile_mode, left_out = MODES[name]
        m = copy.deepcopy(model)
        if compile_mode is not None:
            m = nvtp.jit(m, mesh=DeviceMesh.of_size(1), compile=compile_mode)
        steps[name] = _step(m, args, kwargs, loss_of)
        start = time.perf_counter()
        with _without(left_out):
            result = steps[name]()  # lowered on the first call
        first[name] = time.perf_counter() - start
        if name == "eager":
            want = result
        else:
            _check(name, result, want)
    load = os.getloadavg()[0]
    samples = interleave(steps, rounds, warmup)
    load_after = os.getloadavg()[0]
    share = _gemm_share(steps["eager"])
    eager = Timing.of(samples["eager"])
    print(f"== {case}: {rounds} rounds after {warmup} warm-up, {torch.get_num_threads()} threads, "
          f"load average {load:.1f} before, {load_after:.1f} after ({os.cpu_count()} cores)")
    for name, s in samples.items():
        t = Timing.of(s)
        line = f"{name:8s} median {t.median_ms:8.1f} ms  quartiles {t.q1_ms:.1f}-{t.q3_ms:.1f}  first call {first[name]:.2f} s"
        if name != "eager":
            r = paired_ratio(samples, "eager", of=name)
            line += f"  / eager {r.value:.3f} ± {r.noise:.3f}"
        print(line)
    for of, base, what in (("inductor", "kernels", "Inductor on each rank's compute between collectives"),
                           ("kernels", "saved-p", "attention as sdpfa + flash kernels against the decomposition that saves p")):
        if of in samples and base in samples:
            r = paired_ratio(samples, base, of=of)
            print(f"{of} / {base} {r.value:.3f} ± {r.noise:.3f} ({what}, paired per round)")
    print(f"GEMM floor: {share:.2f} of eager's aten time = {share * eager.median_ms:.1f} ms ({share:.2f}x eager)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"which models (default: all of {', '.join(CASES)})")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's own choice)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"which implementations, comma-separated (eager always; "
                        f"default: all of {', '.join(MODES)})")
    a = parser.parse_args()
    unknown = [c for c in a.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    modes = ["eager"] + [m for m in a.modes.split(",") if m and m != "eager"]
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"unknown mode {', '.join(bad)}; choose from {', '.join(MODES)}")
    for case in a.cases or list(CASES):
        run(case, a.rounds, a.warmup, modes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
