"""``plan="auto"`` on published training configurations: its choice and predicted MFU beside what they used and measured.

    python tools/auto_published.py                       # every row of PUBLISHED, a markdown table
    python tools/auto_published.py --only llama3-405b-16k

Each row is a published run on H100s (the source's model shape, device count, tokens a step and
memory a GPU, its layout and its measured MFU, with the source's address). The model is nvtp's GPT
on the meta device (bf16) in that shape: the depth, width, heads, sequence and vocabulary of the
source's model, in the GPT's block (multi-head attention, a 4x GELU MLP; Llama 3's GQA and SwiGLU
are not traced on this path: ``tools/auto_search_time.py`` says the same). The planner searches
(``nvtp.auto.search``, machine ``h100-ib``: 60 % of 989 TFLOP/s bf16, NVLink in a node, 400 Gb/s
between nodes; recomputation offered when ``--recompute`` names it) and the table gives its choice,
its predicted step and MFU, and the predicted step of the source's own layout where the planner
costed it. MFU = model FLOPs / (step seconds x devices x 989e12), model FLOPs = 6 N T + 12 L h s T
(N parameters, T tokens a step, L layers, h the hidden size, s the sequence: the forward and
backward of every matmul and of attention's two products, no causal halving, no recomputation).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import torch

from nvtp.auto import search
from nvtp.models import gpt

PEAK = 989e12  # H100 SXM bf16 dense FLOP/s


@dataclass(frozen=True)
class Published:
    name: str
    shape: gpt.GPTConfig  # batch: the step's sequences
    devices: int
    memory: str
    used: dict  # the source's layout: axis -> extent (and notes)
    used_text: str
    measured_mfu: str
    source: str


LLAMA3_70B = gpt.GPTConfig(n_embd=8192, n_head=64, seq_len=8192, n_layer=80, vocab_size=128256)
LLAMA3_405B = gpt.GPTConfig(n_embd=16384, n_head=128, seq_len=8192, n_layer=126, vocab_size=128256)
GPT3 = gpt.GPTConfig(n_embd=12288, n_head=96, seq_len=2048, n_layer=96, vocab_size=51200)

PUBLISHED = [
    Published("llama3-405b-8k", replace(LLAMA3_405B, batch=2048), 8192, "80GB", {"tp": 8, "pp": 16, "dp": 64},
              "tp8 cp1 pp16 dp64 (FSDP), 16M tokens a step", "43 % (430 TFLOP/s a GPU), bf16",
              "https://arxiv.org/abs/2407.21783 (The Llama 3 Herd of Models, Table 4)"),
    Published("llama3-405b-16k", replace(LLAMA3_405B, batch=2048), 16384, "80GB", {"tp": 8, "pp": 16, "dp": 128},
              "tp8 cp1 pp16 dp128 (FSDP), 16M tokens a step", "41 % (400 TFLOP/s a GPU), bf16",
              "https://arxiv.org/abs/2407.21783 (The Llama 3 Herd of Models, Table 4)"),
    Published("llama3-70b-torchtitan", replace(LLAMA3_70B, batch=512), 256, "96GB", {"dp": 32, "tp": 8},
              "FSDP 32, tp8 (+ async TP), local batch 16, full activation checkpointing, Float8 linears",
              "829 tokens/s a GPU (about 40 % of bf16 peak by the formula; not comparable: Float8)",
              "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md (Table 4)"),
    Published("llama3-405b-torchtitan", replace(LLAMA3_405B, batch=256), 512, "96GB", {"dp": 8, "tp": 8, "pp": 8},
              "FSDP 8, tp8, pp8, 1F1B (interleaved 1F1B: 128 tokens/s), local batch 32, full activation checkpointing, Float8",
              "100 tokens/s a GPU (1F1B; about 27 % of bf16 peak by the formula; Float8)",
              "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md (Table 5)"),
    Published("gpt3-175b-megatron-96", replace(GPT3, batch=1152), 96, "80GB", {},
              "batch 1152 sequences, the smallest of its strong-scaling runs (the layout is in the README's figure, not its text)",
              "47 %", "https://github.com/NVIDIA/Megatron-LM/blob/main/README.md (Training Speed and Scalability)"),
    Published("gpt3-175b-megatron-4608", replace(GPT3, batch=1152), 4608, "80GB", {"tp": 8, "pp": 16, "dp": 36},
              "batch 1152 sequences on 4608 H100s; the layout compared: Megatron's own 175B script's tp8 pp16 "
              "(examples/gpt3/train_gpt3_175b_distributed.sh), dp36", "42 %",
              "https://github.com/NVIDIA/Megatron-LM/blob/main/README.md (Training Speed and Scalability)"),
]


def model_flops(cfg: gpt.GPTConfig, parameters: int) -> float:
    """6 N T + 12 L h s T for a step of ``cfg.batch`` sequences."""
    tokens = cfg.batch * cfg.seq_len
    return 6 * parameters * tokens + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len * tokens


def matches(candidate, used: dict) -> bool:
    """Whether ``candidate``'s mesh is the source's layout (extents by axis name; unnamed axes 1)."""
    have = {k: v for k, v in candidate.sizes.items() if v > 1}
    return all(have.get(k, 1) == v for k, v in used.items()) and all(v == used.get(k, 1) for k, v in have.items())


def run(p: Published, recompute: tuple[str, ...]) -> dict:
    with torch.device("meta"):
        model = gpt.GPT(p.shape).to(torch.bfloat16)
    parameters = sum(t.numel() for t in model.parameters())
    idx, targets = (t.to("meta") for t in gpt.example_tokens(p.shape))
    start = time.perf_counter()
    choice = search(model, (idx, targets), {}, devices=p.devices, machine="h100-ib", memory=p.memory, backend="nvfuser",
                    recompute=recompute)
    took = time.perf_counter() - start
    flops = model_flops(p.shape, parameters)
    best = choice.best
    costed = [*choice.ranked, *(r.costed for r in choice.over_budget if r.costed is not None)]
    theirs = [c for c in costed if p.used and matches(c.candidate, p.used)]
    ours = {"name": p.name, "parameters": parameters, "chosen": best.candidate.text(), "seconds": best.seconds,
            "mfu": flops / (best.seconds * p.devices * PEAK), "memory": best.memory.get("total", 0.0), "search_s": took,
            "terms": dict(best.terms)}
    if theirs:  # the fastest of the source's layout that fits, else the one over the budget by least
        fits = [c for c in theirs if c in choice.ranked]
        t = min(fits, key=lambda c: c.seconds) if fits else min(theirs, key=lambda c: c.memory.get("total", 0.0))
        ours |= {"theirs": t.candidate.text(), "theirs_seconds": t.seconds, "theirs_mfu": flops / (t.seconds * p.devices * PEAK),
                 "theirs_memory": t.memory.get("total", 0.0)}
    return ours


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="these rows of PUBLISHED (their names)")
    ap.add_argument("--recompute", nargs="*", default=["none"], help="recomputation the planner may choose (none selective block)")
    a = ap.parse_args()
    rows = [p for p in PUBLISHED if a.only is None or p.name in a.only]
    print("| run | source's layout | source's measured | auto's choice (predicted step, MFU, memory a GPU) | the source's layout as nvtp "
          "predicts it | search |\n|---|---|---|---|---|---:|", flush=True)
    for p in rows:
        try:
            r = run(p, tuple(a.recompute))
        except Exception as e:  # one row's failure (nothing fits, say) is its table cell
            print(f"| {p.name}, {p.devices} H100 | {p.used_text} | {p.measured_mfu} | {type(e).__name__}: {e} | | |", flush=True)
            continue
        theirs = (f"{r['theirs']}: {r['theirs_seconds']:.2f} s, MFU {r['theirs_mfu']:.0%}, {r['theirs_memory'] / 1e9:.1f} GB"
                  if "theirs" in r else "not among the candidates costed")
        print(f"| {p.name}, {p.devices} H100, {p.shape.batch} x {p.shape.seq_len} tokens, {r['parameters'] / 1e9:.0f}B parameters "
              f"| {p.used_text} | {p.measured_mfu} | {r['chosen']}: {r['seconds']:.2f} s, MFU {r['mfu']:.0%}, "
              f"{r['memory'] / 1e9:.1f} GB | {theirs} | {r['search_s']:.0f} s |", flush=True)
        print(f"<!-- {p.name} terms: " + ", ".join(f"{k} {v:.3g}" for k, v in r["terms"].items()) + f"; source: {p.source} -->", flush=True)


if __name__ == "__main__":
    main()
