"""`nvtp explain` and `nvtp.plan` on a 2-D (dp, tp) mesh: every communication names its mesh axis,
the dp bytes equal DDP's and FSDP's formulas (derived here from the torch model's parameters and
Megatron's layout, not from nvtp's report), memory per rank is divided as the 2-D placements say,
and bad --mesh spellings are refused with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nvtp import explain
from nvtp.models import gpt

ROOT = Path(__file__).parent.parent
CFG = gpt.config("tiny")  # hidden 64, 4 heads, sequence 16, batch 2, vocabulary 256
DP, TP, LAYERS = 2, 2, 2


def _tp_split(name: str) -> bool:
    """Megatron-LM's column- and row-parallel weights of a GPT block (and column biases)."""
    return any(name.endswith(s) for s in ("c_attn.weight", "c_attn.bias", "attn.c_proj.weight", "c_fc.weight", "c_fc.bias", "mlp.c_proj.weight"))


def _fsdp_whole(name: str) -> bool:
    """FSDP splits a weight along a dimension tp leaves whole: a 1-D weight tp splits stays whole on dp."""
    return name.endswith(("c_attn.bias", "c_fc.bias"))


def _not_read_by_backward(name: str) -> bool:
    """The embedding tables (their gradients are scatters of the output gradient) and the biases of
    the residual projections (their gradient is a sum of the output gradient): FSDP gathers them once."""
    return name in ("wte.weight", "wpe.weight") or name.endswith(("attn.c_proj.bias", "mlp.c_proj.bias"))


def _tp_bytes():
    """(name, bytes of this rank's tp shard in bf16) of every parameter of the GPT."""
    model = gpt.GPT(gpt.config("tiny", n_layer=LAYERS))
    return [(n, 2 * p.numel() // (TP if _tp_split(n) else 1)) for n, p in model.named_parameters()]


def _dp_bytes(report_json) -> int:
    return sum(c["bytes"] for c in report_json["communications"] if c["axis"] == "dp")


def test_cli_fsdp_json_names_axes_and_dp_bytes_equal_the_formula():
    """`nvtp explain --model nanogpt ... --mesh 2x2 --fsdp --json` as a user types it."""
    out = subprocess.run([sys.executable, "-m", "nvtp", "explain", "--model", "nanogpt", "--config", "tiny", "--layers", str(LAYERS),
                          "--plan", "megatron", "--mesh", f"{DP}x{TP}", "--fsdp", "--json", "--backend", "nvfuser"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    comms = report["communications"]
    assert all(set(c) >= {"kind", "tensor", "shape", "dtype", "bytes", "phase", "axis"} for c in comms)
    assert {c["axis"] for c in comms} == {"dp", "tp"}
    assert report["mesh"] == {"shape": [DP, TP], "names": ["dp", "tp"]} and report["devices"] == DP * TP
    # Megatron's 2 allreduces of a [b, s, h] activation per layer each way stay on tp, over each rank's batch.
    tp_fwd = [c for c in comms if c["axis"] == "tp" and c["phase"] == "forward" and c["region"] == "block"]
    assert len(tp_fwd) == 2 * LAYERS and all(c["shape"] == [DP * CFG.batch, CFG.seq_len, CFG.n_embd] for c in tp_fwd)
    assert all(c["bytes"] == 2 * (TP - 1) * CFG.batch * CFG.seq_len * CFG.n_embd * 2 // TP for c in tp_fwd)
    # FSDP: 3Psi(dp-1)/dp for the split weights the backward reads, 2Psi'(dp-1)/dp for those it does not, 2R(dp-1)/dp for the whole ones.
    split = sum(b for n, b in _tp_bytes() if not _fsdp_whole(n) and not _not_read_by_backward(n))
    once = sum(b for n, b in _tp_bytes() if not _fsdp_whole(n) and _not_read_by_backward(n))
    whole = sum(b for n, b in _tp_bytes() if _fsdp_whole(n))
    formula = (3 * split + 2 * once + 2 * whole) * (DP - 1) // DP
    traffic = report["dp_traffic"]
    assert (traffic["split_read_by_backward_bytes"], traffic["split_weight_bytes"], traffic["whole_weight_bytes"]) == (split, split + once, whole)
    assert traffic["formula"] == formula
    # The measured dp collectives: the weights' own equal the formula, but for the deviations the report names.
    assert _dp_bytes(report) == traffic["measured"] == traffic["weights"] + traffic["gradients_in_fp32"] + traffic["other"]
    assert set(traffic["deviations"]) <= {"wpe.weight"}  # its gradient is all-reduced whole before the slice to its shard
    deviation = sum(d["measured"] - d["formula"] for d in traffic["deviations"].values())
    assert traffic["weights"] == formula + deviation
    assert traffic["other"] == 4 + 8  # the loss's sum (fp32) and token count (int64), all-reduced over dp
    # Parameters, gradients and Adam state: 1/(dp*tp) of the weights both axes split.
    model = gpt.GPT(gpt.config("tiny", n_layer=LAYERS))
    local = sum(p.numel() // ((TP if _tp_split(n) else 1) * (1 if _fsdp_whole(n) else DP)) for n, p in model.named_parameters())
    mem = report["memory_per_rank"]
    assert (mem["parameters"], mem["gradients"], mem["optimizer"]) == (2 * local, 2 * local, 12 * local)


def test_ddp_bytes_equal_the_formula_and_activations_are_split_by_dp():
    """DDP: dp sends 2W(dp-1)/dp, no deviation; parameters are tp's shards as on a 1-D mesh of tp
    devices, and each rank's activations are those of its own batch (the 1-D report's, whose
    batch is one rank's)."""
    two_d = explain.explain_gpt(CFG, layers=LAYERS, plan="megatron", mesh=(DP, TP))
    one_d = explain.explain_gpt(CFG, layers=LAYERS, plan="megatron", devices=TP)
    traffic = two_d.dp_traffic()
    w = sum(b for _, b in _tp_bytes())
    assert traffic["formula"] == traffic["weights"] == 2 * w * (DP - 1) // DP and traffic["deviations"] == {}
    assert _dp_bytes(two_d.as_json()) == traffic["measured"]
    mine, theirs = two_d.memory_per_rank(), one_d.memory_per_rank()
    for key in ("parameters", "gradients", "optimizer", "activations"):
        assert mine[key] == theirs[key] > 0, key
    text = two_d.as_text()
    assert "on a 2x2 mesh (dp 2, tp 2" in text and "DDP's 2W(dp-1)/dp" in text and "traced batch 4 = dp 2 x 2 per rank" in text
    assert one_d.dp_traffic() is None and "axis" in one_d.communications()[0]


def test_plan_of_a_module_on_a_fsdp_mesh():
    """nvtp.plan(module, one rank's batch, mesh=(dp, tp), fsdp=True): fp32 block weights, all read
    by the backward but the residual projections' biases: the dp bytes equal the formula exactly."""
    block = gpt.Block(CFG)
    report = explain.plan(block, gpt.example_input(CFG), plan="megatron", mesh=(DP, TP), fsdp=True)
    traffic = report.dp_traffic()
    params = [(n, 4 * p.numel() // (TP if _tp_split(n) else 1)) for n, p in block.named_parameters()]
    split = sum(b for n, b in params if not _fsdp_whole(n) and not _not_read_by_backward(n))
    once = sum(b for n, b in params if not _fsdp_whole(n) and _not_read_by_backward(n))
    whole = sum(b for n, b in params if _fsdp_whole(n))
    assert traffic["formula"] == traffic["measured"] == (3 * split + 2 * once + 2 * whole) * (DP - 1) // DP
    assert traffic["other"] == traffic["gradients_in_fp32"] == 0 and traffic["deviations"] == {}
    assert "= 2 x 2" in report.batch  # the traced batch is dp times the example's


@pytest.mark.parametrize("argv, says", [
    (["--mesh", "2by2"], "expected DPxTP"),
    (["--mesh", "0x2"], "at least 1 device"),
    (["--devices", "2", "--fsdp"], "give a mesh with a 'dp' axis, --mesh DPxTP, or leave --fsdp out"),
    (["--devices", "4", "--mesh", "2x2"], "not both"),
])
def test_bad_mesh_spellings_are_refused_with_one_line(argv, says, capsys):
    """In-process (nvtp.cli.main is what the console script calls); the first also as a subprocess."""
    from nvtp.cli import main

    command = ["explain", "--model", "nanogpt", "--config", "tiny", "--plan", "megatron", *argv]
    if argv == ["--mesh", "2by2"]:
        out = subprocess.run([sys.executable, "-m", "nvtp", *command], capture_output=True, text=True, cwd=ROOT, timeout=120)
        code, stdout, stderr = out.returncode, out.stdout, out.stderr
    else:
        code = main(command)
        stdout, stderr = capsys.readouterr()
    assert code == 3, stderr
    assert stdout == "" and len(stderr.strip().splitlines()) == 1 and says in stderr


def test_plan_refuses_a_bad_mesh_before_tracing():
    with pytest.raises(ValueError, match=r"expected \(dp, tp\)"):
        explain.plan(gpt.Block(CFG), gpt.example_input(CFG), mesh=(2,))
    with pytest.raises(ValueError, match=r"fsdp=True is an option of the 'dp' mesh axis .* and this mesh has the axis tp: give a mesh with a 'dp' axis"):
        explain.plan(gpt.Block(CFG), gpt.example_input(CFG), devices=2, fsdp=True)


@pytest.mark.slow
def test_plan_splices_a_deep_model_like_a_whole_trace():
    """nvtp.plan traces a deep model as block 0 and the model without its blocks, then splices (as nvtp.jit does):
    the same communications and memory as the whole trace (the activation peak, a liveness bound,
    within 1%). About 45 s: two traces of an 8-layer GPT."""
    import collections

    import torch

    cfg = gpt.config("tiny", n_layer=8)
    model = gpt.GPT(cfg)
    idx = torch.zeros(cfg.batch, cfg.seq_len, dtype=torch.long)
    spliced = explain.plan(model, idx, idx, plan="megatron", devices=2)
    whole = explain.plan(model, idx, idx, plan="megatron", devices=2, regional=False)
    assert spliced.how.startswith("spliced: 8 blocks") and spliced.as_json()["traced"] == spliced.how
    multiset = lambda r: collections.Counter((c["phase"], c["kind"], tuple(c["shape"]), c["bytes"]) for c in r.communications())
    assert multiset(spliced) == multiset(whole) and len(spliced.communications()) >= 4 * 8  # Megatron: 2 + 2 a layer
    mine, theirs = spliced.memory_per_rank(), whole.memory_per_rank()
    for key in ("parameters", "gradients", "optimizer", "activations"):
        assert mine[key] == theirs[key], key
    assert abs(mine["peak_activations"] - theirs["peak_activations"]) <= 0.01 * theirs["peak_activations"]
