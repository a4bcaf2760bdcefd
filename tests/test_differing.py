"""Blocks of one class that do not compute the same are never spliced as if equal (issue 33).

``tests/differing.py``'s GPT has blocks of one class and parameter shapes that differ by a Python
attribute (a residual scale ``1 / (i + 1)``), a buffer's value, a submodule's type, a config flag
or a per-layer attention window. Regional compilation traced block 0 and spliced it into every
layer: it trained silently wrong (the loss off by 0.02 to 0.09 after 3 SGD steps). Now a run on
fake tensors (``nvtp.frontend.variants``) groups the blocks by what they compute, one block of
each variant is traced, and each kind trains like one process in eager PyTorch (same seed, SGD,
every loss within 1e-5 relative, every final weight within 1e-4) on every route: ``nvtp.jit``
(Thunder's route, 2 simulated ranks), the Thunder transform (``nvtp.ShardingTransform``, 2
simulated ranks), a transformers model (the FX route, whose layers differ), and a pipeline (a
"pp" axis, 2 gloo processes). The default tier runs the grouping of every kind (6 s) and one kind
through ``nvtp.jit`` (35 s); the slow tier every kind on every route. On main's code (fff3152)
the default tier's training test fails (the first loss 4.1373 against eager's 4.1455), and so
does the pipeline's; the FX route traced the patched Llama whole already (its ``_alike``), and
since 2026-11-26 splices it, and a Qwen2 with sliding-window odd layers, one traced layer per variant.
"""

from __future__ import annotations

import copy

import pytest
import torch

import nvtp
from nvtp.driver import meta_copy
from nvtp.execute import spmd
from nvtp.execute.collectives import ThreadComm, ThreadGroup
from nvtp.execute.launch import spawn
from nvtp.frontend.blocks import find_repeated
from nvtp.frontend.variants import record
from nvtp.sharding.placements import DeviceMesh
from tests import differing

STEPS = 3
GROUPS = {"attribute": [0, 1, 2, 3], "buffer": [0, 0, 0, 0], "submodule": [0, 1, 0, 1], "flag": [0, 1, 0, 1], "window": [0, 1, 0, 1],
          "same": [0, 0, 0, 0]}


def _assert_like(losses, weights, want_losses, want_weights):
    for step, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    assert weights.keys() == want_weights.keys()
    for name, want in want_weights.items():
        err = (weights[name] - want).abs().max().item()
        assert err <= 1e-4, (name, err)


def _eager(kind: str, batch: int = 2):
    net = differing.model(kind)
    losses = differing.train_eager(net, differing.batches(STEPS, batch))
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize("kind", list(GROUPS))
def test_a_run_on_fake_tensors_groups_the_blocks_by_what_they_compute(kind):
    """Each kind's blocks fall into the variants they are: a buffer's value changes no program (one
    variant: the spliced copies read each block's own buffer); the others 2, or 4 for a scale per block."""
    net = meta_copy(differing.model(kind))
    idx, tgt = differing.batches(1)[0]
    rec = record(net, find_repeated(net), (idx.to("meta"), tgt.to("meta")), {})
    variant_of, why = rec.variants()
    assert variant_of == GROUPS[kind] and len(why) == max(variant_of)
    assert not rec.chain and not rec.uniform()
    if kind == "attribute":
        assert why[0].startswith("block 1 differs at its call ") and why[0].endswith("`mul(t17[2, 8, 32], 0.5)` where block 0 has "
                                                                                      "`mul(t17[2, 8, 32], 1.0)`"), why


def _jit_on_two_threads(kind: str):
    net = differing.model(kind)
    group = ThreadGroup(2, timeout=600)
    ranks = [nvtp.jit(copy.deepcopy(net), plan="megatron", mesh=DeviceMesh.of_size(2), comm=ThreadComm(group, r)) for r in range(2)]
    batches = differing.batches(STEPS)
    ranks[0].compile(*batches[0])
    ranks[1].share_compiled(ranks[0])

    def train(r):
        return differing.train_eager(ranks[r], batches)

    losses = spmd.on_threads(train, group)
    weights = {}
    for name, p in net.named_parameters():
        parts = [dict(m.module.named_parameters())[name].detach() for m in ranks]
        weights[name] = spmd.assemble(parts, ranks[0].placement(name), p.shape)
    return losses, weights, ranks[0].last.traced.how


@pytest.mark.parametrize("kind", ["window", pytest.param("attribute", marks=pytest.mark.slow),
                                  pytest.param("buffer", marks=pytest.mark.slow), pytest.param("submodule", marks=pytest.mark.slow),
                                  pytest.param("flag", marks=pytest.mark.slow)])
def test_blocks_that_differ_train_like_one_process_with_nvtp_jit(kind):
    """Thunder's route, tp=2 (ranks as threads): one block traced per variant, and ``how`` says so."""
    losses, weights, how = _jit_on_two_threads(kind)
    want = _eager(kind)
    for got in losses:
        _assert_like(got, weights, *want)
    n = max(GROUPS[kind]) + 1
    if n == 1:
        assert how.startswith("spliced: 4 blocks of h from one traced block"), how
    else:
        assert how.startswith(f"spliced: 4 blocks of h from {n} traced blocks, one per variant: {n} variants (blocks "), how


@pytest.mark.slow  # 30-130 s a kind: one Thunder trace per variant, and the model without its blocks
@pytest.mark.parametrize("kind", differing.KINDS)
def test_blocks_that_differ_train_like_one_process_through_the_thunder_transform(kind):
    """``thunder.jit(model, transforms=[nvtp.ShardingTransform("megatron", 2)])`` on 2 ranks as threads."""
    import thunder

    net = differing.model(kind)
    threads = spmd.ThreadMesh(DeviceMesh.of_size(2), timeout=600)
    transforms = [nvtp.ShardingTransform(plan="megatron", mesh=2, comm=threads.comm(r)) for r in range(2)]
    transforms[1].share(transforms[0])
    jms = [thunder.jit(copy.deepcopy(net), transforms=[t]) for t in transforms]
    batches = differing.batches(STEPS)

    def train(r):
        losses = differing.train_eager(jms[r], batches)
        return losses, {n: t for n, t in jms[r].original_state_dict().items() if n in dict(net.named_parameters())}  # buffers stay

    want = _eager(kind)
    for losses, weights in spmd.on_threads(train, threads):
        _assert_like(losses, weights, *want)
    assert "variant" in transforms[0].last.traced.how or kind == "buffer", transforms[0].last.traced.how


@pytest.mark.slow  # a subprocess, and a trace per variant: 40 s
def test_nvtp_explain_says_how_many_variants_and_why():
    """The command line as typed: the report's time line says how the fusions were made."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-m", "nvtp", "explain", "--module", "tests.differing:window", "--plan", "megatron", "--devices", "2"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("(spliced: 4 blocks of h from 2 traced blocks, one per variant: 2 variants (blocks 0, 2; 1, 3: block 1 differs at "
            "its call ") in out.stdout, out.stdout


# -- the FX route: a transformers model whose layers differ ------------------------------------------

def _llama(layers: int = 3, **extra):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                                   vocab_size=256, intermediate_size=128, use_cache=False, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0, **extra)
    return transformers.LlamaForCausalLM(cfg)


def _qwen2_sliding():
    """Qwen2 whose odd layers attend through a sliding window of 4 (``layer_types``): the model calls them with another mask."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                                   vocab_size=256, intermediate_size=128, use_cache=False, max_position_embeddings=64,
                                   use_sliding_window=True, sliding_window=4, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                   layer_types=["full_attention", "sliding_attention"] * 2)
    return transformers.Qwen2ForCausalLM(cfg)


def _scaled_layer(model):
    """Layer 2's attention scale patched (a per-layer attribute of one class): the export of layers 0 and 1 cannot see it."""
    model.model.layers[2].self_attn.scaling = 0.5 * model.model.layers[2].self_attn.scaling
    return model


def _hf_batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, 16), generator=g) for _ in range(STEPS)]


def _hf_train(model, batches):
    opt = torch.optim.SGD(model.parameters() if not isinstance(model, nvtp.ShardedModule) else model.module.parameters(), lr=0.1)
    losses = []
    for idx in batches:
        opt.zero_grad()
        loss = model(idx, labels=idx, use_cache=False).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow  # a trace per variant, on 2 ranks: 60 s
@pytest.mark.parametrize("build, how", [
    (lambda: _scaled_layer(_llama()), "spliced: 3 blocks of model.layers from 2 traced blocks, one per variant: 2 variants (blocks 0, 1; "
                                      "2: block 2 differs at its call "),
    (_qwen2_sliding, "spliced: 4 blocks of model.layers from 2 traced blocks, one per variant: 2 variants (blocks 0, 2; 1, 3: the "
                     "model calls block 1 with attention_mask ")],
    ids=["llama-patched-scale", "qwen2-sliding-layers"])
def test_a_transformers_model_whose_layers_differ_trains_like_one_process(build, how):
    """The FX route traces one layer of each variant (layers that compute differently, or that the
    model calls with another mask) and splices them, and ``how`` says which layers share which;
    tp=2 megatron (ranks as threads) trains like eager. Before, it traced such models whole (and
    before that, the Thunder route spliced block 0 for all: silently wrong)."""
    base = build()
    batches = _hf_batches()
    ref = copy.deepcopy(base)
    want = _hf_train(ref, batches)
    group = ThreadGroup(2, timeout=900)
    ranks = [nvtp.jit(copy.deepcopy(base), plan="megatron", mesh=DeviceMesh.of_size(2), comm=ThreadComm(group, r)) for r in range(2)]
    ranks[0].compile(batches[0], labels=batches[0], use_cache=False)
    ranks[1].share_compiled(ranks[0])
    assert ranks[0].last.traced.how.startswith(how), ranks[0].last.traced.how
    losses = spmd.on_threads(lambda r: _hf_train(ranks[r], batches), group)
    weights = {}
    for name, p in ref.named_parameters():
        parts = [dict(m.module.named_parameters())[name].detach() for m in ranks]
        weights[name] = spmd.assemble(parts, ranks[0].placement(name), p.shape)
    for got in losses:
        _assert_like(got, weights, want, {n: p.detach() for n, p in ref.named_parameters()})


# -- a pipeline ---------------------------------------------------------------------------------------

def _pipeline_worker(rank, world, init_method, out, kinds):
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group
    from tests import workers

    init_group(rank, world, init_method)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    result = {}
    for kind in kinds:
        model = nvtp.jit(differing.model(kind), plan="megatron", mesh=mesh, microbatches=2)
        losses = differing.train_eager(model, differing.batches(STEPS, batch=4))
        result[kind] = (losses, model.full_parameters(), model.program.traced.how)
    return workers.finish(result, out, world)


@pytest.mark.slow  # 2 gloo processes, a trace per variant: 60 s a kind
@pytest.mark.parametrize("kinds", [["flag"], ["attribute", "buffer", "submodule", "window"]], ids=["flag", "the-others"])
def test_blocks_that_differ_train_like_one_process_on_a_pipeline(tmp_path, kinds):
    """pp=2 (2 gloo processes), 2 microbatches: the stages cut from the spliced program, each block its variant's."""
    out = tmp_path / "got.pt"
    assert spawn(_pipeline_worker, 2, str(out), kinds) == [0, 0]
    got = torch.load(out, weights_only=False)
    for kind in kinds:
        want = _eager(kind, batch=4)
        for rank in got:
            losses, weights, how = rank[kind]
            _assert_like(losses, weights, *want)
            assert ("variant" in how) == (kind != "buffer"), how
