"""How long ``plan="auto"``'s search takes for a large model, and where the time goes.

    python tools/auto_search_time.py --config gpt3 --devices 64 --batch 16
    python tools/auto_search_time.py --config llama3-70b-shaped --devices 1024 --batch 1024
    python tools/auto_search_time.py --config llama3-70b --devices 1024 --batch 1024     # transformers' Llama 3 70B

The model is nvtp's GPT on the meta device (bf16): ``gpt3`` (96 layers, hidden 12288, sequence
2048), or ``llama3-70b-shaped``: Llama 3 70B's depth, width, heads, sequence and vocabulary (80
layers, hidden 8192, 64 heads, sequence 8192, vocabulary 128256) in the GPT's block (multi-head
attention and a 4x GELU MLP, not GQA and SwiGLU: 65B parameters). Prints the search's wall time,
the time spent tracing the sample, sharding programs (how many) and costing, and the choice.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import time
from dataclasses import replace

import torch

from nvtp.models import gpt

SHAPES = {"llama3-70b-shaped": gpt.GPTConfig(n_embd=8192, n_head=64, seq_len=8192, n_layer=80, vocab_size=128256)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="gpt3", help="an nvtp GPT config (gpt3), llama3-70b-shaped, or a transformers model of "
                    "nvtp.models.hf.PUBLISHED (llama3-70b: GQA and SwiGLU as published)")
    ap.add_argument("--seq", type=int, default=8192, help="the sequence of a transformers model (default 8192)")
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="the whole step's rows")
    ap.add_argument("--machine", default="h100-ib")
    ap.add_argument("--memory", default="80GB")
    ap.add_argument("--recompute", nargs="*", default=["none"], help="recomputation the planner may choose (none selective block)")
    a = ap.parse_args()
    hf = importlib.import_module("nvtp.models.hf")
    if a.config in hf.PUBLISHED:  # the transformers model as published, on the meta device
        model, call, kw = hf.on_meta(a.config, seq=a.seq, batch=a.batch)
    else:
        cfg = replace(SHAPES[a.config] if a.config in SHAPES else gpt.config(a.config), batch=a.batch)
        with torch.device("meta"):
            model = gpt.GPT(cfg).to(torch.bfloat16)
        call, kw = tuple(t.to("meta") for t in gpt.example_tokens(cfg)), {}

    search = importlib.import_module("nvtp.auto.search")  # the module (nvtp.auto.search is also the function)
    costing = importlib.import_module("nvtp.auto.costing")
    spent = {"tracing": [0.0, 0], "sharding": [0.0, 0]}

    def timed(module, name, what):
        f = getattr(module, name)

        @functools.wraps(f)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[what][0] += time.perf_counter() - start
                spent[what][1] += 1
        setattr(module, name, run)

    timed(search, "take", "tracing")
    timed(costing.driver, "shard", "sharding")
    start = time.perf_counter()
    choice = search.search(model, call, kw, devices=a.devices, machine=a.machine, memory=a.memory, backend="nvfuser",
                           recompute=tuple(a.recompute))
    wall = time.perf_counter() - start
    print(choice.as_text(top=5))
    print(f"\nwall {wall:.1f} s: tracing {spent['tracing'][0]:.1f} s ({spent['tracing'][1]} samples), sharding "
          f"{spent['sharding'][0]:.1f} s ({spent['sharding'][1]} programs), the rest (costing; {len(choice.ranked)} candidates fit, "
          f"{len(choice.over_budget)} over the budget) {wall - spent['tracing'][0] - spent['sharding'][0]:.1f} s")


if __name__ == "__main__":
    main()
