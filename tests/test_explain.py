"""Whole-model explain: regional compilation is exact, the CLI prints what the issue promises,
and the figures agree with what is derived here by hand from the model."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nvtp import explain
from nvtp.models import gpt

ROOT = Path(__file__).parent.parent
CFG = gpt.config("tiny")  # hidden 64, 4 heads, sequence 16, batch 2, vocabulary 256


def _comm_multiset(report):
    return collections.Counter((c["phase"], c["kind"], tuple(c["shape"]), c["dtype"], c["bytes"]) for c in report.communications())


@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
def test_regional_report_equals_the_whole_traced_model(plan):
    """One block traced and counted L times gives the whole model's communications (kind, shape,
    bytes, phase) and memory; only the activation peak, a liveness bound, may differ a little."""
    regional = explain.explain_gpt(CFG, layers=2, plan=plan, devices=2)
    whole = explain.explain_gpt(CFG, layers=2, plan=plan, devices=2, regional=False)
    assert _comm_multiset(regional) == _comm_multiset(whole)
    assert len(regional.communications()) > 0
    mine, theirs = regional.memory_per_rank(), whole.memory_per_rank()
    for key in ("parameters", "gradients", "optimizer", "activations"):
        assert mine[key] == theirs[key], key
    assert abs(mine["peak_activations"] - theirs["peak_activations"]) <= 0.1 * theirs["peak_activations"]


def _megatron_split(name: str) -> bool:
    """Megatron-LM's column- and row-parallel weights of a GPT block (and column biases)."""
    return any(name.endswith(s) for s in ("c_attn.weight", "c_attn.bias", "attn.c_proj.weight", "c_fc.weight", "c_fc.bias", "mlp.c_proj.weight"))


def test_memory_is_what_megatron_places_per_rank():
    """Parameters, gradients and Adam state per rank, derived from the torch model's own
    parameters and Megatron's layout (bf16 weights: 2 bytes; Adam: fp32 master, m and v)."""
    layers, d = 3, 2
    report = explain.explain_gpt(CFG, layers=layers, plan="megatron", devices=d)
    model = gpt.GPT(gpt.config("tiny", n_layer=layers))
    local = sum(p.numel() // (d if _megatron_split(n) else 1) for n, p in model.named_parameters())
    mem = report.memory_per_rank()
    assert mem["parameters"] == 2 * local
    assert mem["gradients"] == 2 * local
    assert mem["optimizer"] == 12 * local
    assert mem["activations"] > 0 and mem["peak_activations"] >= mem["activations"]


def test_cli_explains_a_deep_model_as_json():
    """`nvtp explain --model nanogpt ... --json` as a user types it: one JSON object, every
    communication with kind/tensor/shape/dtype/bytes/phase, Megatron's 2 allreduces per layer
    each way, memory fields, and Korthikanti et al.'s formula computed here by hand."""
    layers, d = 4, 2
    out = subprocess.run([sys.executable, "-m", "nvtp", "explain", "--model", "nanogpt", "--config", "tiny", "--layers", str(layers),
                          "--plan", "megatron", "--devices", str(d), "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    comms = report["communications"]
    assert comms and all(set(c) >= {"kind", "tensor", "shape", "dtype", "bytes", "phase"} for c in comms)
    block = [c for c in comms if c["region"] == "block"]
    for phase in ("forward", "backward"):
        per_layer = collections.Counter(c["layer"] for c in block if c["phase"] == phase and c["kind"] == "allreduce")
        assert per_layer == {j: 2 for j in range(layers)}, phase
    # An allreduce of a [b, s, h] bf16 activation sends 2(d-1)/d of it per rank.
    fwd = [c for c in block if c["phase"] == "forward"]
    assert all(c["bytes"] == 2 * (d - 1) * CFG.batch * CFG.seq_len * CFG.n_embd * 2 // d for c in fwd)
    assert set(report["memory_per_rank"]) >= {"parameters", "gradients", "optimizer", "activations"}
    s, b, h, a = CFG.seq_len, CFG.batch, CFG.n_embd, CFG.n_head
    assert report["activations_per_layer_korthikanti"] == pytest.approx(s * b * h * (10 + 24 / d + 5 * a * s / (h * d)))


def test_cli_text_groups_communications_per_layer(capsys):
    """In-process (the traces are shared with the tests above); the JSON test runs a subprocess."""
    from nvtp.cli import main

    assert main(["explain", "--model", "nanogpt", "--config", "tiny", "--layers", "3", "--plan", "megatron-sp", "--devices", "2"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("GPT (3 layers, hidden 64, 4 heads")
    assert "region block x 3" in text
    assert "allgather" in text and "reduce_scatter" in text and "(2 per layer)" in text
    assert "Korthikanti" in text and "peak_activations" in text


def tiny_block_model():
    """A factory for ``--module``: (model, example_args)."""
    torch.manual_seed(0)
    return gpt.Block(CFG), (gpt.example_input(CFG),)


def test_cli_explains_any_module_through_a_factory(capsys):
    from nvtp.cli import main

    assert main(["explain", "--module", "tests.test_explain:tiny_block_model", "--plan", "megatron", "--devices", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["kind"] for c in report["communications"] if c["phase"] == "forward"] == ["allreduce", "allreduce"]
    params = sum(p.numel() // (2 if _megatron_split(n) else 1) for n, p in gpt.Block(CFG).named_parameters())
    assert report["memory_per_rank"]["parameters"] == 4 * params  # fp32


def tiny_gpt_model():
    """A factory for ``--module``: a GPT of 2 blocks and its tokens."""
    torch.manual_seed(0)
    cfg = gpt.config("tiny", n_layer=2)
    return gpt.GPT(cfg), gpt.example_tokens(cfg)


def test_cli_text_folds_the_shardings_of_repeated_blocks(capsys):
    """``--module``'s text lists a parameter of the repeated blocks once, ``h.{0..1}.<name>``, when
    every block places it alike; a block placed otherwise keeps its own line."""
    from nvtp.cli import main
    from nvtp.report import _folded

    assert main(["explain", "--module", "tests.test_explain:tiny_gpt_model", "--plan", "megatron", "--devices", "2"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  h.")]
    assert ["h.{0..1}.attn.c_attn.weight", "_S(0,", "3)"] in lines and ["h.{0..1}.mlp.c_proj.weight", "S(1)"] in lines
    assert len(lines) == len(dict(gpt.Block(gpt.config("tiny")).named_parameters()))  # one line per block parameter
    assert _folded({"wte": "R", "h.0.w": "S(0)", "h.1.w": "S(0)", "h.2.w": "R", "h.3.w": "S(0)", "h.0.b": "R", "h.1.b": "R"}) == [
        ("wte", "R"), ("h.{0..1}.w", "S(0)"), ("h.2.w", "R"), ("h.3.w", "S(0)"), ("h.{0..1}.b", "R")]


def test_cli_refuses_a_file_and_a_model_together(tmp_path):
    out = subprocess.run([sys.executable, "-m", "nvtp", "explain", "x.py", "--model", "nanogpt", "--plan", "megatron", "--devices", "2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert "either a dump FILE" in out.stderr
