"""nvtp.jit of a transformers Llama at L layers: compile time with its layers spliced from one
traced layer (the default) against every layer traced (``regional=False``), in turn in one process.

    .venv/bin/python tools/hf_jit_depth.py --layers 8 --rounds 2

The model: hidden 256, 8 heads, 4 KV heads, intermediate 512, vocabulary 1024, real weights (fp32),
batch 2 x 128 tokens, plan megatron, rank 0 of a simulated mesh of 2 (compile only: trace, shard,
this rank's parameters, the backend's runner). Prints one line a compile, with how it was traced.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

import nvtp
from nvtp.execute.collectives import ThreadComm, ThreadGroup
from nvtp.sharding.placements import DeviceMesh


def main(layers: int, rounds: int) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=512,
                                   num_hidden_layers=layers, vocab_size=1024, max_position_embeddings=256, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 1024, (2, 128), generator=torch.Generator().manual_seed(1))
    for _ in range(rounds):
        for regional in (True, False):
            sm = nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=DeviceMesh.of_size(2), comm=ThreadComm(ThreadGroup(2), 0),
                          regional=regional)
            start = time.perf_counter()
            sm.compile(ids, labels=ids)
            print(f"{layers} layers, regional={regional}: compile {time.perf_counter() - start:.1f} s ({sm.last.traced.how})", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    main(args.layers, args.rounds)
