"""Regional compilation on the FX route (nvtp/frontend/fx_regional.py): a transformers model's
decoder layers traced once and spliced. dynamo exports the model cut to 2 layers, Thunder traces
the model without its layers and layer 0 alone, and the L-layer fusions compute what the whole
trace computes, bit for bit (loss, logits and every gradient on the reference backend, fp32 and
bf16). The route says which way it took and why (``Traced.how``), so a splice silently skipped
fails here. Planning a published configuration on the meta device (Llama 3 70B's shape) goes the
same way and reports parameter bytes and activations per rank."""

from __future__ import annotations

import collections
import copy
import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group, or pip install nvtp[hf])")

import nvtp  # noqa: E402
from nvtp import driver  # noqa: E402
from nvtp.execute import reference  # noqa: E402
from nvtp.frontend import fx as fxroute  # noqa: E402
from nvtp.frontend import fx_regional  # noqa: E402
from nvtp.frontend.blocks import NotRepeatable, find_repeated  # noqa: E402
from nvtp.frontend.capture import run_pair  # noqa: E402
from nvtp.models import hf  # noqa: E402

LAYERS = 3  # more than the 2 layers the export keeps: a layer the export never saw is spliced in


def build(family: str = "llama", layers: int = LAYERS, dtype: torch.dtype = torch.float32, seed: int = 0, **extra) -> torch.nn.Module:
    """A small causal LM of ``family`` (hidden 64, 4 heads, 2 KV heads, vocabulary 256) with ``layers`` layers."""
    t = transformers
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = t.GPT2Config(n_embd=64, n_head=4, n_layer=layers, vocab_size=256, n_positions=64, use_cache=False, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **extra)
        return t.GPT2LMHeadModel(cfg).to(dtype)
    if family == "bloom":
        cfg = t.BloomConfig(hidden_size=64, n_head=4, n_layer=layers, vocab_size=256, use_cache=False, **extra)
        return t.BloomForCausalLM(cfg).to(dtype)
    config, model = {"llama": (t.LlamaConfig, t.LlamaForCausalLM), "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
                     "phi3": (t.Phi3Config, t.Phi3ForCausalLM), "mistral": (t.MistralConfig, t.MistralForCausalLM),
                     "gemma": (t.GemmaConfig, t.GemmaForCausalLM), "granite": (t.GraniteConfig, t.GraniteForCausalLM),
                     "stablelm": (t.StableLmConfig, t.StableLmForCausalLM)}[family]
    kwargs = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers, vocab_size=256,
                  intermediate_size=128, use_cache=False, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    kwargs |= {"head_dim": 16} if family == "gemma" else {}
    return model(config(**kwargs | extra)).to(dtype)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


def call_kwargs(**extra) -> dict:
    idx = tokens()
    return {"labels": idx, "use_cache": False} | extra


def trace(model: torch.nn.Module, regional: bool = True, split_parts: bool = False, **extra) -> driver.Traced:
    return driver.trace(model, (tokens(),), call_kwargs(**extra), regional=regional, split_parts=split_parts)


def run(model: torch.nn.Module, traced: driver.Traced, **extra) -> tuple[object, dict[str, torch.Tensor]]:
    """The traced forward and backward on the reference backend, with the model's weights and one
    fixed incoming gradient per output: (the model's output object, gradients by label)."""
    idx = tokens()
    call = traced.call
    named = dict(model.named_parameters()) | dict(model.named_buffers()) | call.bind((idx,), call_kwargs(**extra))
    named |= call.constants
    for label, part in call.parts.items():
        named[label] = named[part.weight][part.start:part.stop]
    f, b = traced.forward, traced.backward
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(v.shape, generator=gen).to(v.dtype.torch) if v.shape else torch.ones((), dtype=v.dtype.torch)
             for v in b.inputs if b.role(v.name) == "grad"]
    values, got = run_pair(f, b, named, grads, lambda fusion, inputs: reference.run(fusion, inputs, seed=7))
    return call.rebuild([values[v.name] for v in f.outputs if f.role(v.name) == "output"]), got


def assert_bit_for_bit(model: torch.nn.Module, spliced: driver.Traced, whole: driver.Traced, rounded: tuple[str, ...] = (),
                       **extra) -> None:
    """Loss, logits and every gradient equal; ``rounded``: gradients allowed to differ in their last bits."""
    out, grads = run(model, spliced, **extra)
    want, want_grads = run(model, whole, **extra)
    assert torch.equal(out.loss, want.loss) and torch.equal(out.logits, want.logits)
    assert sorted(grads) == sorted(want_grads) and len(grads) >= len(list(model.parameters()))
    for label, g in want_grads.items():
        if label in rounded:
            torch.testing.assert_close(grads[label], g, rtol=1e-6, atol=1e-6 * g.abs().max().item(), msg=label)
        else:
            assert torch.equal(grads[label], g), label


@pytest.fixture
def recorded(monkeypatch):
    """What the FX route hands dynamo (the modules exported) and Thunder (the graph modules traced)."""
    seen = {"exported": [], "traced": []}
    real_export, real_capture = fxroute._export, fx_regional.capture
    monkeypatch.setattr(fxroute, "_export", lambda m, *a: seen["exported"].append(m) or real_export(m, *a))
    monkeypatch.setattr(fx_regional, "capture", lambda m, *a, **k: seen["traced"].append(m) or real_capture(m, *a, **k))
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])  # bf16: 24 s
def test_a_llama_spliced_from_one_traced_layer_computes_the_whole_trace_bit_for_bit(dtype, recorded):
    model = build("llama", dtype=dtype)
    spliced = trace(model)
    assert spliced.how.startswith(f"spliced: {LAYERS} blocks of model.layers from one traced block"), spliced.how
    # dynamo saw the model cut to 2 layers; Thunder traced the model without layers, then one layer
    assert [len(m.model.layers) for m in recorded["exported"]] == [2]
    skeleton, block = recorded["traced"]
    assert not any(n.startswith("model.layers") for n, _ in skeleton.named_parameters())
    assert [n.target for n in block.graph.nodes if n.op == "placeholder"][0] == fx_regional.CARRY
    assert {n for n, _ in block.named_parameters()} == {n for n, _ in model.model.layers[0].named_parameters()}
    for f in (spliced.forward, spliced.backward):  # each op is a renamed copy: the skeleton's once, the layer's once a layer
        copies = collections.Counter(id(op.template) for op in f.compute_ops() if op.template is not None)
        assert sum(copies.values()) == len(list(f.compute_ops())) and set(copies.values()) == {1, LAYERS}
    assert sorted(set(spliced.captured.layers.values())) == list(range(LAYERS))
    whole = trace(model, regional=False)
    assert whole.how.startswith("whole trace (regional=False)")
    assert_bit_for_bit(model, spliced, whole)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "qwen2", "phi3", "gemma", "bloom", "granite"])
def test_other_families_spliced_compute_the_whole_trace_bit_for_bit(family):
    """GPT-2 (Conv1D, learned positions, tied embedding), Qwen2 (q/k/v biases), Phi-3 (a fused
    qkv_proj of unequal parts, split per layer), Gemma (a scaled embedding, tied), BLOOM (ALiBi
    biases every layer reads; a GeLU written as an autograd.Function, a subgraph per layer),
    Granite (its embedding multiplier 1.0: an ``x * 1.0`` the boundary marker must not be taken for).
    BLOOM's tied embedding gradient alone differs in its last bits: the whole trace's backward
    recomputes the embedding LayerNorm's output (Thunder's choice with the layers there), the
    spliced one reads it as the forward saved it (as block 0's trace saves its input)."""
    model = build(family)
    split = family == "phi3"
    spliced = trace(model, split_parts=split)
    prefix = "transformer.h" if family in ("gpt2", "bloom") else "model.layers"
    assert spliced.how.startswith(f"spliced: {LAYERS} blocks of {prefix} from one traced block"), spliced.how
    if split:
        assert {p.weight for p in spliced.parts.values()} == {f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(LAYERS)}
    rounded = ("grad(transformer.word_embeddings.weight)",) if family == "bloom" else ()
    assert_bit_for_bit(model, spliced, trace(model, regional=False, split_parts=split), rounded)


@pytest.mark.slow
def test_a_padding_mask_every_layer_reads_is_computed_once_and_spliced_bit_for_bit():
    """An ``attention_mask`` argument (the last 3 tokens of a row padded): the mask the layers read
    is computed from it once, in the model without its layers, and every copy reads it."""
    model = build("llama")
    mask = torch.ones_like(tokens())
    mask[0, -3:] = 0
    spliced = trace(model, attention_mask=mask)
    assert spliced.how.startswith(f"spliced: {LAYERS} blocks of model.layers from one traced block"), spliced.how
    assert_bit_for_bit(model, spliced, trace(model, regional=False, attention_mask=mask), attention_mask=mask)


def _meta_call():
    return (tokens().to("meta"),), {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in call_kwargs().items()}


SLIDING = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]


def test_layers_called_with_different_masks_are_variants_of_their_own():
    """Qwen2 whose odd layers attend through a sliding window (``layer_types``): the layers' own code
    is one, but the model calls the odd ones with another mask, so they are a variant of their own
    (each variant is traced once, ``test_layers_of_different_kinds_are_spliced_one_traced_layer_per_variant``);
    the export keeps 3 layers (layer 2 is compared with layer 0 to tell its carry). Block 0 the only
    one of its kind (``max_window_layers=1``) is traced whole, saying why. On a run on fake tensors: no trace."""
    with torch.device("meta"):
        model = build("qwen2", layers=4, use_sliding_window=True, sliding_window=4, layer_types=SLIDING)
    proof = fx_regional.prove(model, find_repeated(model), *_meta_call())
    assert proof.variant_of == [0, 1, 0, 1] and proof.keep == 3, proof
    assert re.fullmatch(r"the model calls block 1 with attention_mask t\d+ before the blocks\[2, 1, 16, 16\] where block 0 gets "
                        r"t\d+ before the blocks\[2, 1, 16, 16\]", proof.why[0]), proof.why
    with torch.device("meta"):
        model = build("qwen2", layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    with pytest.raises(NotRepeatable, match=r"block 0 of model.layers is the only block of its variant \(2 variants \(blocks 0; 1, 2: "):
        fx_regional.prove(model, find_repeated(model), *_meta_call())


@pytest.mark.slow  # a spliced and a whole trace: 70 s
def test_layers_of_different_kinds_are_spliced_one_traced_layer_per_variant(recorded):
    """The spliced program of that Qwen2 computes the whole trace's, bit for bit (loss, logits and
    every gradient); ``how`` names the variants; dynamo exported the model cut to 3 layers, Thunder
    traced the skeleton and one layer of each variant."""
    model = build("qwen2", layers=4, use_sliding_window=True, sliding_window=4, layer_types=SLIDING)
    spliced = trace(model)
    assert spliced.how.startswith("spliced: 4 blocks of model.layers from 2 traced blocks, one per variant: 2 variants (blocks 0, 2; "
                                  "1, 3: the model calls block 1 with attention_mask "), spliced.how
    assert [len(m.model.layers) for m in recorded["exported"]] == [3] and len(recorded["traced"]) == 3
    assert_bit_for_bit(model, spliced, trace(model, regional=False))


def test_blocks_that_differ_past_the_first_two_are_told_apart_by_what_they_compute():
    """Block 2's attention scale unlike the others' (an export of blocks 0 and 1 alone cannot see
    it) makes block 2 a variant of its own before anything is traced, naming the call that differs,
    and the export keeps 3 blocks so that it is traced; a setting that differs but changes no call
    (``layer_idx`` without a cache) does not."""
    with torch.device("meta"):
        model = build("llama", layers=4)
    model.model.layers[2].self_attn.scaling = 0.5
    args, kwargs = _meta_call()
    rep = find_repeated(model)
    proof = fx_regional.prove(model, rep, args, kwargs)
    assert proof.variant_of == [0, 0, 1, 0] and proof.keep == 3, proof
    assert re.fullmatch(r"block 2 differs at its call \d+: `scaled_dot_product_attention\(.*scale=0.5.*\)` where block 0 has "
                        r"`scaled_dot_product_attention\(.*scale=0.25.*\)`", proof.why[0]), proof.why
    model.model.layers[2].self_attn.scaling = 0.25
    model.model.layers[1].self_attn.layer_idx = 7  # read only by a cache: the same program
    proof = fx_regional.prove(model, rep, args, kwargs)
    assert proof.variant_of == [0, 0, 0, 0] and proof.keep == 2, proof


def _stablelm(layers: int = LAYERS) -> torch.nn.Module:
    """StableLM with per-head q and k LayerNorms (``self_attn.q_layernorm.norms``: a ModuleList of 4,
    longer than the 3 layers) and a parallel residual."""
    return build("stablelm", layers=layers, qk_layernorm=True, use_parallel_residual=True)


def test_the_layer_finder_takes_the_decoder_layers_not_a_list_inside_them():
    """The longest repeated list of StableLM is a layer's per-head norms; before, the finder took it,
    cut it to 2 and the export failed blaming the arguments' shapes. Lists inside the blocks of an
    outer list are parts of those blocks; of lists side by side, the one holding the most parameters."""
    with torch.device("meta"):
        model = _stablelm()
    assert len(model.model.layers[0].self_attn.q_layernorm.norms) > len(model.model.layers)
    assert find_repeated(model).prefix == "model.layers"

    class Heads(torch.nn.Module):  # 6 small heads beside 3 large blocks: the blocks
        def __init__(self):
            super().__init__()
            self.heads = torch.nn.ModuleList(torch.nn.Linear(4, 1) for _ in range(6))
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    assert find_repeated(Heads()).prefix == "blocks"


def test_a_cut_model_that_does_not_export_is_traced_whole_saying_why():
    """A model whose forward indexes its layers by a fixed count cannot be cut to 2: the route says
    so and traces the model whole (its error, if any, then shows in the user's terms)."""

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for i in range(3):
                x = torch.tanh(self.layers[i](x))
            return x.sum()

    traced = driver.trace(Fixed(), (torch.randn(2, 8),), frontend="fx")
    assert traced.how.startswith("whole trace: the model cut to 2 blocks of layers did not run on fake tensors, so its blocks "
                                 "could not be compared (IndexError: index 2 is out of range)"), traced.how


@pytest.mark.parametrize("plan", ["megatron", pytest.param("megatron-sp", marks=pytest.mark.slow)])
def test_stablelm_with_qk_layernorm_and_a_parallel_residual_trains_on_tp2_like_one_process(plan):
    """Its decoder layers spliced from one traced layer; 3 SGD steps on 2 ranks (threads) against
    eager on one process: every loss within 1e-5 relative, every weight within 1e-5."""
    from nvtp.execute import spmd
    from nvtp.execute.collectives import ThreadComm, ThreadGroup
    from nvtp.sharding.placements import DeviceMesh

    base = _stablelm()
    batches = [tokens(seed) for seed in range(3)]

    def train(model, params):
        opt = torch.optim.SGD(params, lr=0.1)
        losses = []
        for idx in batches:
            opt.zero_grad()
            loss = model(idx, labels=idx, use_cache=False).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    ref = copy.deepcopy(base)
    want = train(ref, ref.parameters())
    group = ThreadGroup(2, timeout=900)
    ranks = [nvtp.jit(copy.deepcopy(base), plan=plan, mesh=DeviceMesh.of_size(2), comm=ThreadComm(group, r)) for r in range(2)]
    ranks[0].compile(batches[0], labels=batches[0], use_cache=False)
    ranks[1].share_compiled(ranks[0])
    assert ranks[0].last.traced.how.startswith(f"spliced: {LAYERS} blocks of model.layers from one traced block"), ranks[0].last.traced.how
    for losses in spmd.on_threads(lambda r: train(ranks[r], ranks[r].module.parameters()), group):
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, want, strict=True)), (losses, want)
    for name, p in ref.named_parameters():
        parts = [dict(m.module.named_parameters())[name].detach() for m in ranks]
        assert (spmd.assemble(parts, ranks[0].placement(name), p.shape) - p.detach()).abs().max() <= 1e-5, name


def llama3_70b_4_layers():
    """A factory for ``--module``: Llama 3 70B's published shape cut to 4 layers, bf16 on the meta
    device, and a training call at sequence 4096 (model, args, kwargs)."""
    return hf.on_meta("llama3-70b", layers=4)


def test_cli_plans_llama3_70b_shape_on_the_meta_device_spliced(capsys):
    """Llama 3 70B's shape (hidden 8192, 64 heads, 8 KV heads, vocabulary 128256; 4 of its 80 layers)
    for 8 devices with megatron-sp at sequence 4096: the layers spliced, each rank holding 1/8 of
    the parameters (norms whole), activations per layer set against Korthikanti et al.'s formula,
    and nothing allocated: the model's parameters stay on the meta device."""
    from nvtp.cli import main

    assert main(["explain", "--module", "tests.test_fx_regional:llama3_70b_4_layers", "--plan", "megatron-sp", "--devices", "8",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["traced"].startswith("spliced: 4 blocks of model.layers from one traced block"), report["traced"]
    model, _, _ = llama3_70b_4_layers()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report["memory_per_rank"]["parameters"] == pytest.approx(total / 8, rel=0.001)  # only the norms are whole
    s, b, h, a, t = 4096, 1, 8192, 64, 8
    assert report["activations_per_layer_korthikanti"] == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    # No s*s attention matrix: for the reference backend transformers' causal mask (computed from
    # positions alone) is read as is_causal=True and the attention claimed whole (sdpfa: output and
    # logsumexp saved), where the formula counts 5 bytes an element (scores, probabilities, dropout mask).
    assert report["backend"] == "reference" and report["attention_matrices_per_layer"] == 0
    # The rest under the formula's 34 bytes: no dropout masks, RMSNorm, and SwiGLU's 3.5h intermediate kept split.
    rest = report["activations_per_layer"] - report["attention_matrices_per_layer"]
    assert 20 * s * b * h / t < rest < 34 * s * b * h / t
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("plan", [pytest.param("megatron", marks=pytest.mark.slow), "megatron-sp"])
def test_the_plan_pairs_each_spliced_layer_as_the_first_and_shards_exactly_as_probing_each(plan, monkeypatch):
    """The derived plans probe which projections pair (column-, then row-parallel) once for the
    first layer and take the same pairs in its renamed copies (``plans.pairing.Paired``): the program is
    the one probing every layer gives, placement for placement and step for step."""
    from nvtp.mesh import make_mesh
    from nvtp.sharding.plans import derived as plans, pairing

    model, args, kwargs = hf.on_meta("llama3-70b", layers=4, seq=64)
    traced = driver.trace(model, args, kwargs, split_parts=True)
    assert traced.how.startswith("spliced: 4 blocks"), traced.how
    probes = []
    real = plans.row_partner
    monkeypatch.setattr(plans, "row_partner", lambda found, m, p: probes.append(p) or real(found, m, p))
    fast = driver.shard(traced, plan, make_mesh(None, devices=8), "nvfuser")
    taken = len(probes)
    monkeypatch.setattr(pairing.Paired, "again", lambda self, p: None)
    slow = driver.shard(traced, plan, make_mesh(None, devices=8), "nvfuser")
    assert fast.parameters == slow.parameters
    assert fast.steps() == slow.steps()
    assert str(fast.forward.fusion) == str(slow.forward.fusion) and str(fast.backward.fusion) == str(slow.backward.fusion)
    assert len(probes) - taken - taken == 3 * 5  # q, k, v, gate and up of layers 1-3 were not probed again


@pytest.mark.parametrize("path", ["L['self'].model.layers.3.mlp", "L['self'].model.layers[3].mlp", "L['self']._modules['model']._modules['layers']._modules['3'].mlp"])
def test_dynamo_module_paths_name_the_layer(path):
    """The spellings dynamo's ``nn_module_stack`` has used for a module inside layer 3."""
    assert fx_regional._module_path(path) == "model.layers.3.mlp"
