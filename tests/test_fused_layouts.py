"""A fused q/k/v projection in each common layout, split by heads or query groups under megatron.

For each layout of ``tests/fused_qkv.FusedQKVBlock`` (q|k|v blocks with grouped-query attention,
per-head interleaved as GPT-NeoX and BLOOM store it, per-query-group interleaved as Megatron-LM
stores GQA), ``nvtp.jit(plan="megatron")`` on a simulated mesh of 2 (ranks as threads) must:

* shard it as Megatron does: each rank holds exactly the weight rows of its own query heads and
  KV heads (``fused_qkv.rows_of``, worked out from the layout, not from nvtp's placement), and
  the output projection is row-parallel;
* train as the unsharded eager block does: 3 SGD steps, every loss within 1e-5 (relative), the
  final weights within 1e-4.

Multi-query attention (one KV head, fewer than the devices) keeps the KV head whole on every rank
and splits the queries.
"""

from __future__ import annotations

import copy

import pytest
import torch

import nvtp
from nvtp import dtensor
from nvtp.dump import relative_error
from nvtp.execute import spmd
from nvtp.execute.collectives import ThreadComm, ThreadGroup
from nvtp.sharding.placements import DeviceMesh
from tests.fused_qkv import FusedQKVBlock, rows_of

D = 2
X = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))


def _train(model: torch.nn.Module, frontend: str = "auto", steps: int = 3):
    group, mesh = ThreadGroup(D, timeout=120), DeviceMesh.of_size(D)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=mesh, comm=ThreadComm(group, r), frontend=frontend) for r in range(D)]
    ranks[0].compile(X)
    for m in ranks[1:]:
        m.share_compiled(ranks[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in ranks]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)

    def step(r):
        opts[r].zero_grad()
        loss = ranks[r](X).pow(2).mean()
        loss.backward()
        opts[r].step()
        return loss.item()

    for _ in range(steps):
        got = spmd.on_threads(step, group)
        ref_opt.zero_grad()
        want = ref(X).pow(2).mean()
        want.backward()
        ref_opt.step()
        assert all(abs(g - want.item()) <= 1e-5 * abs(want.item()) for g in got), (got, want.item())
    for name, p in ref.named_parameters():
        whole = spmd.assemble([dtensor.local(dict(m.module.named_parameters())[name]).detach() for m in ranks],
                              ranks[0].placement(name), p.shape)
        assert relative_error(whole, p.detach())[0] <= 1e-4, name
    return ranks, ref


def _holds_its_heads(ranks, ref, layout: str, H: int, G: int) -> None:
    hd = ref.hd
    for r, m in enumerate(ranks):
        heads, groups = range(r * H // D, (r + 1) * H // D), range(r * G // D, (r + 1) * G // D)
        rows = rows_of(layout, H, G, hd, heads, groups)
        for name in ("qkv.weight", "qkv.bias"):
            local = dtensor.local(dict(m.module.named_parameters())[name]).detach()
            want = dict(ref.named_parameters())[name].detach()[rows]  # both trained: equal within the training's tolerance
            assert local.shape == want.shape and relative_error(local, want)[0] <= 1e-4, (layout, r, name)


@pytest.mark.parametrize("layout,kv_heads,frontend", [("blocks", 4, "auto"), ("blocks", 4, "fx"), ("heads", 8, "auto"),
                                                      ("heads3", 8, "auto"), ("groups", 4, "auto"), ("groups", 2, "auto")])
def test_each_fused_layout_is_split_by_heads_and_trains_like_eager(layout, kv_heads, frontend):
    torch.manual_seed(0)
    model = FusedQKVBlock(layout, heads=8, kv_heads=kv_heads)
    ranks, ref = _train(model, frontend)
    _holds_its_heads(ranks, ref, layout, 8, kv_heads)
    assert str(ranks[0].placement("proj.weight")) == "S(1)"
    comms = [c.kind for c in ranks[0].last.forward.communications]
    assert comms == ["allreduce"], comms  # the row-parallel output projection's, nothing inside the pair


@pytest.mark.parametrize("layout", ["blocks", "groups"])  # with one query group the two layouts are one
def test_multi_query_splits_the_queries_and_keeps_the_kv_head_whole(layout):
    torch.manual_seed(0)
    model = FusedQKVBlock(layout, heads=8, kv_heads=1)
    ranks, ref = _train(model)
    placement = ranks[0].placement("qkv.weight")
    assert str(placement) == "parts([0:64] S(0), [64:72] R, [72:80] R)", placement
    w = ref.qkv.weight.detach()
    for r, m in enumerate(ranks):  # its 4 query heads, then the one key and value head
        local, want = dtensor.local(m.module.qkv.weight).detach(), torch.cat([w[r * 32:(r + 1) * 32], w[64:80]])
        assert local.shape == want.shape and relative_error(local, want)[0] <= 1e-4, r


class _Deep(torch.nn.Module):
    """An input projection, then a chain of fused-QKV blocks (nvtp.jit splices one traced block)."""

    def __init__(self, blocks: int = 4):
        super().__init__()
        self.inp = torch.nn.Linear(64, 64)
        self.blocks = torch.nn.ModuleList(FusedQKVBlock("blocks", heads=8, kv_heads=2) for _ in range(blocks))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_the_parts_of_every_block_of_a_spliced_deep_model_are_split():
    """The regional route (one block traced, spliced 4 times) keeps each block's parts."""
    torch.manual_seed(0)
    ranks, ref = _train(_Deep(), steps=2)
    assert ranks[0].last.traced.how.startswith("spliced"), ranks[0].last.traced.how
    for i in range(4):
        assert str(ranks[0].placement(f"blocks.{i}.qkv.weight")) == "parts([0:64] S(0), [64:80] S(0), [80:96] S(0))"
    for r, m in enumerate(ranks):
        w = ref.blocks[3].qkv.weight.detach()
        rows = rows_of("blocks", 8, 2, 8, range(4 * r, 4 * r + 4), range(r, r + 1))
        assert relative_error(dtensor.local(m.module.blocks[3].qkv.weight).detach(), w[rows])[0] <= 1e-4, r
