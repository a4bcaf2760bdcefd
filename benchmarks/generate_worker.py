"""One rank of the generation benchmark: a model's own ``generate`` (greedy), sharded by
``nvtp.jit(model, plan="megatron")`` on a gloo mesh, against the unsharded model's ``generate`` in
eager PyTorch on rank 0. Two models: a transformers Llama built from a config (transformers'
``model.generate``), and karpathy's nanoGPT as Thunder ships it (``thunder.tests.nanogpt_model``,
its ``generate`` with ``top_k=1``: greedy).

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
    model: str = "llama"  # or "nanogpt"


def build(job: Job) -> torch.nn.Module:
    torch.manual_seed(0)
    if job.model == "nanogpt":
        from thunder.tests.nanogpt_model import GPT, GPTConfig

        return GPT(GPTConfig(block_size=job.prompt + job.tokens, vocab_size=job.vocab, n_layer=job.layers, n_head=job.heads,
                             n_embd=job.hidden, dropout=0.0, bias=True)).eval()
    import transformers as t

    cfg = t.LlamaConfig(hidden_size=job.hidden, num_attention_heads=job.heads, num_key_value_heads=job.heads // 2,
                        num_hidden_layers=job.layers, vocab_size=job.vocab, intermediate_size=2 * job.hidden,
                        max_position_embeddings=job.prompt + job.tokens, use_cache=False, bos_token_id=0, eos_token_id=0,
                        pad_token_id=0)
    return t.LlamaForCausalLM(cfg).eval()


def _generate(model, ids: torch.Tensor, job: Job) -> torch.Tensor:
    if job.model == "nanogpt":
        return model.generate(ids, job.tokens, top_k=1)  # top_k=1: the sample is the argmax
    return model.generate(ids, max_new_tokens=job.tokens, do_sample=False)


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
    out = _generate(sharded, ids, job)
    total = time.perf_counter() - start
    result = {"job": asdict(job), "nvtp_seconds": total, "steps": steps}
    if rank == 0:
        start = time.perf_counter()
        want = _generate(eager, ids, job)
        result["eager_seconds"] = time.perf_counter() - start
        result["same_tokens"] = bool(torch.equal(out, want))
        family = next(iter(sharded._lengths.families.values()))
        result["traced"], result["derived"] = len(steps) - family.derived, family.derived  # each step traced or derived
        with open(job.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0
