"""One rank of the Hugging Face benchmark: a Llama causal LM (transformers, built from a config)
sharded by nvtp (``nvtp.jit(model, plan="megatron")``, the plan derived from the graph) and by
PyTorch's DTensor tensor parallelism with the per-module plan torchtitan uses for Llama
(``llama_tp_plan``), on the same gloo mesh; forward+backward steps (``model(idx, labels=idx)``,
``.loss.backward()``) timed in turn, as in ``benchmarks/tp_worker.py``.

Both are checked against the unsharded model (loss and the gradient of the first query
projection) before anything is timed.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Job:
    d: int
    out: str
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 8
    intermediate: int = 1408
    layers: int = 2
    vocab: int = 4096
    seq: int = 128
    batch: int = 2
    rounds: int = 8
    warmup: int = 2
    threads: int = 1


def build(job: Job) -> torch.nn.Module:
    import transformers as t

    torch.manual_seed(0)
    cfg = t.LlamaConfig(hidden_size=job.hidden, num_attention_heads=job.heads, num_key_value_heads=job.kv_heads,
                        num_hidden_layers=job.layers, vocab_size=job.vocab, intermediate_size=job.intermediate,
                        max_position_embeddings=job.seq, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return t.LlamaForCausalLM(cfg)


def llama_tp_plan(layers: int) -> dict:
    """torchtitan's Llama TP plan without sequence parallelism, in transformers' module names:
    the embedding split over the vocabulary (row-wise), q/k/v and gate/up column-wise, o and down
    row-wise, the LM head column-wise with its logits gathered whole."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()), "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


def worker(rank: int, world: int, init_method: str, job: Job) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import nvtp
    from benchmarks.tp_worker import timed_rounds
    from nvtp.dump import relative_error
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method, timeout_s=900.0)
    torch.set_num_threads(job.threads)
    try:
        model = build(job)
        idx = torch.randint(0, job.vocab, (job.batch, job.seq), generator=torch.Generator().manual_seed(1))
        probe = "model.layers.0.self_attn.q_proj.weight"

        def step(m):
            out = m(idx, labels=idx)
            out.loss.backward()
            grad = next(p for n, p in m.named_parameters() if n.endswith(probe)).grad.detach().clone()
            m.zero_grad(set_to_none=True)
            return out.loss.detach(), grad

        reference = copy.deepcopy(model)
        loss_ref, grad_ref = step(reference)

        start = time.perf_counter()
        nv = nvtp.jit(copy.deepcopy(model), plan="megatron")
        out = nv(idx, labels=idx)
        out.loss.backward()
        loss_nv, grad_nv = out.loss.detach(), nvtp.full_tensor(dict(nv.module.named_parameters())[probe].grad)
        nv.zero_grad(set_to_none=True)
        compile_nvtp = time.perf_counter() - start

        start = time.perf_counter()
        dt = parallelize_module(copy.deepcopy(model), init_device_mesh("cpu", (world,)), llama_tp_plan(job.layers))
        loss_dt, grad_dt = step(dt)
        grad_dt = grad_dt.full_tensor() if isinstance(grad_dt, DTensor) else grad_dt
        compile_dtensor = time.perf_counter() - start

        errors = {"nvtp": max(relative_error(loss_nv, loss_ref)[0], relative_error(grad_nv, grad_ref)[0]),
                  "dtensor": max(relative_error(loss_dt, loss_ref)[0], relative_error(grad_dt, grad_ref)[0])}
        seconds = timed_rounds({"dtensor": lambda: step(dt), "nvtp": lambda: step(nv)}, job.rounds, job.warmup)
        if rank == 0:
            with open(job.out, "w") as f:
                json.dump({"job": asdict(job), "world": world, "errors": errors, "seconds": seconds,
                           "first_call_seconds": {"nvtp": compile_nvtp, "dtensor": compile_dtensor}}, f)
        return 0
    finally:
        dist.destroy_process_group()
