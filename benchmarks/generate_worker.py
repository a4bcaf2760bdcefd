"""One rank of the generation benchmark: transformers' ``model.generate`` (greedy) of a Llama
built from a config, sharded by ``nvtp.jit(model, plan="megatron")`` on a gloo mesh, against the
unsharded model's own ``generate`` in eager PyTorch on rank 0.

Each new length of the growing sequence is a new program: the first three are traced, the rest
derived from them (``nvtp.frontend.lengths``). The job records the whole call's time (what a
user waits for, tracing included), the time of the tokens after the traced ones (what each
further token costs), and eager's; and checks that nvtp generated eager's tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Job:
    d: int
    out: str
    tokens: int = 32
    prompt: int = 8
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    vocab: int = 256
    threads: int = 1


def build(job: Job) -> torch.nn.Module:
    import transformers as t

    torch.manual_seed(0)
    cfg = t.LlamaConfig(hidden_size=job.hidden, num_attention_heads=job.heads, num_key_value_heads=job.heads // 2,
                        num_hidden_layers=job.layers, vocab_size=job.vocab, intermediate_size=2 * job.hidden,
                        max_position_embeddings=job.prompt + job.tokens, use_cache=False, bos_token_id=0, eos_token_id=0,
                        pad_token_id=0)
    return t.LlamaForCausalLM(cfg).eval()


def worker(rank: int, world: int, init_method: str, job: Job) -> int:
    import torch.distributed as dist

    import nvtp
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method, timeout_s=1800.0)
    torch.set_num_threads(job.threads)
    model = build(job)
    eager = build(job)
    ids = torch.randint(1, job.vocab, (1, job.prompt), generator=torch.Generator().manual_seed(1))
    sharded = nvtp.jit(model, plan="megatron")
    steps: list[float] = []
    forward = sharded.forward

    def timed(*args, **kwargs):  # each step of generate: one forward at the next length
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        steps.append(time.perf_counter() - start)
        return out

    sharded.forward = timed
    start = time.perf_counter()
    out = sharded.generate(ids, max_new_tokens=job.tokens, do_sample=False)
    total = time.perf_counter() - start
    result = {"job": asdict(job), "nvtp_seconds": total, "steps": steps}
    if rank == 0:
        start = time.perf_counter()
        want = eager.generate(ids, max_new_tokens=job.tokens, do_sample=False)
        result["eager_seconds"] = time.perf_counter() - start
        result["same_tokens"] = bool(torch.equal(out, want))
        family = next(iter(sharded._lengths.families.values()))
        result["traced"], result["derived"] = len(family.traces) + int(family.checked), family.derived
        with open(job.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0
