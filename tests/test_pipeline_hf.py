"""Pipelines of transformers models, unwrapped: ``model(input_ids, labels=ids).loss`` on a (pp, tp) mesh.

A pipeline trains from the loss alone. A transformers model returns an object holding the loss
and the logits; nvtp refused it ("a pipeline needs a forward returning the loss alone"), and the
FX route's folded causal mask, read by every stage, tied the backward to stage 0 ("StageError:
backward ... stage 1 reads T... of stage 0"). Now the loss is the program's one output (the
logits' gradient, which ``out.loss.backward()`` never gives, zero: nvtp/pipeline/calls.py), a
constant or buffer ties a backward op to no stage (nvtp/pipeline/stages.py), and the pipeline
returns the model's own object with its ``.loss``. Every check is against eager PyTorch on one
process: the one-process tests run the loss-only program on the reference backend; the slow ones
train a tiny Llama on gloo processes at pp = 2 and (pp, tp) = (2, 2).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nvtp import driver
from nvtp.dump import relative_error
from nvtp.execute import reference
from nvtp.frontend.capture import run_pair
from nvtp.pipeline.calls import loss_only
from nvtp.pipeline.stages import cut_stages
from tests import workers


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv, self.out, self.mlp = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.out(a)
        return x + self.mlp(torch.tanh(x))


class DictLM(nn.Module):
    """Returns ``{"loss": ..., "logits": ...}``; a causal mask made from positions (the FX route folds it)."""

    def __init__(self, vocab=32, d=16, layers=4):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, idx, labels):
        t = idx.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.head(x)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def _traced(model):
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    args, kwargs = driver.bind_call(model, "fx", (idx,), {"labels": idx})
    return idx, driver.trace(model, args, kwargs, frontend="fx", tie=False)


@pytest.fixture(scope="module")
def dict_lm():
    """The model and its trace (one trace for the tests of this module's first part)."""
    torch.manual_seed(0)
    model = DictLM()
    return model, *_traced(model)


def test_the_loss_alone_trains_like_eagers_loss_backward(dict_lm):
    """The loss-only program (forward and backward, one process, reference backend) gives the
    loss and every gradient of eager's ``out["loss"].backward()``: the logits' gradient is zero,
    not the ones the trace differentiated with."""
    model, idx, traced = dict_lm
    lone = loss_only(traced, "DictLM")
    f, b = lone.forward, lone.backward
    assert len([v for v in f.outputs if f.role(v.name) == "output"]) == 1  # the loss; the logits gone
    named = {n: p.detach() for n, p in model.named_parameters()} | {"idx": idx, "labels": idx} | traced.call.constants
    values, grads = run_pair(f, b, named, torch.ones(()), lambda fusion, inputs: reference.run(fusion, inputs))
    want = copy.deepcopy(model)
    out = want(idx, idx)
    out["loss"].backward()
    assert relative_error(values[[v.name for v in f.outputs if f.role(v.name) == "output"][0]], out["loss"].detach())[0] <= 1e-6
    for name, p in want.named_parameters():
        assert relative_error(grads[f"grad({name})"], p.grad)[0] <= 1e-5, name


def test_a_folded_constant_every_stage_reads_ties_no_backward_op_to_stage_0(dict_lm):
    _, _, traced = dict_lm
    staged = cut_stages(loss_only(traced, "DictLM"), "layers", 4, 2)
    assert [s.blocks for s in staged.stages] == [(0, 1), (2, 3)]
    assert all(t.label != "nvtp_constant_0" for t in staged.transfers)  # read in each stage, never sent


def test_a_weight_tied_across_stages_is_one_input_per_name_on_the_fx_route_each_stage_its_own():
    """dynamo reads a tied weight once, under its first name; a pipeline's trace (``tie=False``)
    holds one input per name, so the embedding's stage reads ``emb.weight`` and the head's stage
    ``head.weight``, each use's gradient its own output, their sum eager's gradient (the runtime
    sums them over the stages). Before, the one input tied the head's backward to stage 0:
    "StageError: backward ...: stage 1 reads T... of stage 0" (transformers' GPT-2 on pp=2)."""
    torch.manual_seed(0)
    model = DictLM()
    model.head.weight = model.emb.weight
    idx, traced = _traced(model)
    lone = loss_only(traced, "DictLM")
    f, b = lone.forward, lone.backward
    labels = {f.label(v.name) for v in f.inputs if f.role(v.name) == "parameter"}
    assert {"emb.weight", "head.weight"} <= labels
    staged = cut_stages(lone, "layers", 4, 2)
    assert "emb.weight" in staged.stages[0].parameters and "head.weight" not in staged.stages[0].parameters
    assert "head.weight" in staged.stages[1].parameters and "emb.weight" not in staged.stages[1].parameters
    named = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)} | {"idx": idx, "labels": idx} | traced.call.constants
    _, grads = run_pair(f, b, named, torch.ones(()), lambda fusion, inputs: reference.run(fusion, inputs))
    want = copy.deepcopy(model)
    want(idx, idx)["loss"].backward()
    assert relative_error(grads["grad(emb.weight)"] + grads["grad(head.weight)"], want.emb.weight.grad)[0] <= 1e-5


def test_a_pipelines_trace_recomputes_no_forward_value_in_the_backward_so_gemma_2_cuts():
    """Thunder's rematerialization rebuilt Gemma 2's residual stream in the backward from every
    block's saved pieces (its post-attention and post-feedforward norms), so the last stage's
    backward read stage 0's values: "StageError: backward ...: stage 1 reads T586 of stage 0". A
    pipeline traces with it off (``driver.trace(remat=False)``): the cut holds, and the stages'
    sends are the residual stream alone."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_hidden_layers=2, vocab_size=256, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.Gemma2ForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    args, _ = driver.bind_call(model, "thunder", (ids,), {"labels": ids})  # as the pipeline's call binds them
    staged = driver.compile_pipeline(model, *args, mesh="2x1x1", microbatches=2).staged
    assert [s.blocks for s in staged.stages] == [(0,), (1,)]
    assert {tuple(t.shape) for t in staged.transfers} == {(1, 16, 64)}, staged.transfers  # a microbatch's residual stream


def test_a_forward_of_several_tensors_none_named_the_loss_is_refused_saying_how_to_wrap_it(dict_lm):
    """The same program seen as a tuple ``(loss, logits)`` (no output object naming the loss), as
    nanoGPT's ``(logits, loss)`` is: refused, saying how to wrap it."""
    from dataclasses import replace

    from nvtp.errors import InputError

    _, _, traced = dict_lm
    with pytest.raises(InputError, match=r"returns its loss alone.*or an output object with a .loss.*Pair.forward returns 2 tensor"):
        loss_only(replace(traced, call=None), "Pair")


def test_a_pipelines_call_binds_a_transformers_models_keywords_with_the_cache_off():
    """A pipeline binds ``model(ids, labels=ids)`` to positions, defaults included (``use_cache=None``
    among them); the FX route then turned the cache off by adding ``use_cache=False`` as a keyword
    too: "TypeError: multiple values for argument 'use_cache'" from deep inside torch.export, for
    any transformers model whose config keeps transformers' default (the cache on). Now the cache
    is turned off where the call gives it, by position or keyword; ``use_cache=True`` is refused."""
    from nvtp.errors import InputError

    model, ids = _llama(), torch.zeros(2, 8, dtype=torch.long)
    assert model.config.use_cache
    names = list(inspect.signature(model.forward).parameters)
    args, kwargs = driver.bind_call(model, "fx", *driver.bind_call(model, "thunder", (ids,), {"labels": ids}))  # as a pipeline does
    assert args[names.index("use_cache")] is False and "use_cache" not in kwargs and args[names.index("labels")] is ids
    args, kwargs = driver.bind_call(model, "fx", (ids,), {"labels": ids})  # as nvtp.jit does
    assert args == (ids,) and kwargs == {"labels": ids, "use_cache": False}
    for call in [((ids,), {"use_cache": True}), driver.bind_call(model, "thunder", (ids,), {"use_cache": True})]:
        with pytest.raises(InputError, match="call it with use_cache=False"):
            driver.bind_call(model, "fx", *call)


# -- a transformers Llama on gloo processes ---------------------------------------------------------

STEPS = 3


def _llama(tied: bool = False):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=256,
                                   intermediate_size=128, bos_token_id=0, eos_token_id=0,  # use_cache: transformers' default, on
                                   tie_word_embeddings=tied)  # tied: the head reads the embedding, across the stages
    return transformers.LlamaForCausalLM(cfg)


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (4, 16), generator=g) for _ in range(STEPS)]


def _worker(rank, world, init_method, out, shape, microbatches, tied):
    from torch.distributed.device_mesh import init_device_mesh

    import nvtp
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    names, sizes = (("pp", "tp"), shape) if shape[1] > 1 else (("pp",), shape[:1])
    model = nvtp.jit(_llama(tied), plan="megatron", mesh=init_device_mesh("cpu", sizes, mesh_dim_names=names), microbatches=microbatches)
    opt = torch.optim.SGD(model.module.parameters(), lr=0.1)
    losses = []
    for ids in _batches():
        result = model(ids, labels=ids)  # unwrapped: the model's own output object, .loss taken
        opt.zero_grad()
        result.loss.backward()
        opt.step()
        losses.append(result.loss.item())
    return workers.finish({"losses": losses, "params": model.full_parameters(), "type": type(result).__name__}, out, world)


@pytest.mark.slow
@pytest.mark.parametrize("shape,tied", [((2, 1), False), ((2, 2), False), ((2, 1), True)], ids=["pp2", "pp2-tp2", "pp2-tied"])
def test_a_transformers_llama_trains_on_a_pipeline_like_one_process(shape, tied, tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")
    from nvtp.execute.launch import spawn

    out = tmp_path / "ranks.pt"
    assert spawn(_worker, shape[0] * shape[1], str(out), shape, 2, tied) == [0] * (shape[0] * shape[1])
    ref = _llama(tied)
    assert (ref.lm_head.weight is ref.model.embed_tokens.weight) == tied
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for ids in _batches():
        result = ref(ids, labels=ids)
        opt.zero_grad()
        result.loss.backward()
        opt.step()
        want.append(result.loss.item())
    for rank in torch.load(out, weights_only=False):
        assert rank["type"] == "CausalLMOutputWithPast"
        for got, w in zip(rank["losses"], want):
            assert abs(got - w) <= 1e-5 * abs(w), (rank["losses"], want)
        for name, p in ref.named_parameters():
            assert (rank["params"][name] - p.detach()).abs().max().item() <= 1e-4, name
