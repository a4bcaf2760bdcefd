"""``plan="auto"`` on a published configuration's shape (docs/auto.md, "Published configurations"):
GPT-3 175B (Megatron-LM's ``examples/gpt3/train_gpt3_175b_distributed.sh``: 96 layers, hidden 12288,
96 heads, sequence 2048) for 64 H100s of the ``h100-ib`` machine, 80 GB each, on the meta device."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from nvtp.auto import search
from nvtp.models import gpt
from nvtp.sharding.cost import MACHINES


def test_gpt3_on_64_h100s_fits_keeps_tp_in_a_node_and_costs_about_its_flops():
    """The choice fits 80 GB, its tensor-parallel extent stays within a node of 8, and its compute
    term is between the model's FLOPs at the machine's matmul rate (6 N T + 12 L h s T, the forward
    and backward of every product) and three times that (the rest: the ops priced by bytes). Every
    candidate's compute is between 1 and 6 times it (measured 2026-11-27: 1.45 for dp16 tp4, up to
    4.7 for pp8 tp8 megatron-sp with 16 one-row microbatches, whose programs repeat the weights'
    ops per microbatch as the runtime does). A step cannot beat that bound; a planner that priced
    each microbatch's products at the whole batch (as before bb8f153) is outside the band by its
    microbatch count."""
    cfg = replace(gpt.config("gpt3"), batch=16, dropout=0.0)
    with torch.device("meta"):
        model = gpt.GPT(cfg).to(torch.bfloat16)
    idx, targets = (t.to("meta") for t in gpt.example_tokens(cfg))
    machine = MACHINES["h100-ib"]
    choice = search(model, (idx, targets), {}, devices=64, machine="h100-ib", memory="80GB", backend="nvfuser")
    best = choice.best
    assert best.memory["total"] <= 80e9, best.memory
    tensor = [n for strategy, n in best.candidate.used() if strategy.runs_plan]
    assert all(n <= machine.devices_per_node for n in tensor), best.candidate.text()
    n = sum(p.numel() for p in model.parameters())
    tokens = cfg.batch * cfg.seq_len
    flops = 6 * n * tokens + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len * tokens
    bound = flops / (64 * machine.flops)
    # The choice's compute within 3x the bound: since FSDP's reduce-scatters go one block at a time
    # (2026-12-02) the choice is pp8 tp8 megatron with 16 microbatches, 2.40x (its programs repeat the
    # weights' ops per microbatch); it had been within 2x.
    assert bound <= best.terms["compute"] <= 3 * bound, (best.candidate.text(), best.terms, bound)
    assert best.seconds >= bound
    outside = [(c.candidate.text(), c.terms["compute"] / bound) for c in choice.ranked if not bound <= c.terms["compute"] <= 6 * bound]
    assert not outside and any(c.candidate.pipelined for c in choice.ranked), outside


@pytest.mark.slow
def test_a_70b_model_for_1024_devices_is_planned_within_a_minute():
    """Issue 34's speed target: a 70B model for 1024 devices planned in at most 30 s on this machine.
    Llama 3 70B's shape in nvtp's GPT block (80 layers, hidden 8192, 64 heads, sequence 8192,
    vocabulary 128256: 65B parameters), batch 1024, h100-ib, 80 GB: measured 14.4 s at load 2
    (2026-11-26); asserted within 60 s, twice the target, as this shared 2-core machine's load moves it."""
    cfg = gpt.GPTConfig(n_embd=8192, n_head=64, seq_len=8192, n_layer=80, vocab_size=128256, batch=1024)
    with torch.device("meta"):
        model = gpt.GPT(cfg).to(torch.bfloat16)
    idx, targets = (t.to("meta") for t in gpt.example_tokens(cfg))
    start = time.perf_counter()
    choice = search(model, (idx, targets), {}, devices=1024, machine="h100-ib", memory="80GB", backend="nvfuser")
    took = time.perf_counter() - start
    assert took <= 60.0, took
    assert choice.best.memory["total"] <= 80e9
    assert all(n <= 8 for strategy, n in choice.best.candidate.used() if strategy.runs_plan), choice.best.candidate.text()
