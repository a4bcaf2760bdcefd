"""The contract: every file nvtp writes is a fusion definition nvFuser itself accepts.

Each file is used as an nvFuser user uses it: its function definitions (and its imports of torch
and nvfuser_direct, nothing else) run inside nvfuser_direct's own ``FusionDefinition``
(``nvtp.execute.nvfuser.build_from_text``); nvtp's emitter takes no part. What nvFuser then holds
is checked against the text itself (inputs, outputs, device meshes, counted from the file with
``ast``) and against nvtp's reading of the file (``compare_definition``: every value's shape and
dtype and the dataflow op by op).

Covered: ``nvtp dump`` of the tiny block for each dtype nvtp emits (bf16, the default; fp16;
fp32), without and with dropout; ``nvtp shard`` of each, forward and backward, with plans
megatron and megatron-sp over 2 and 4 devices; and the checked-in fusions/*.py.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from nvtp.execute.nvfuser import build_from_text, compare_definition
from nvtp.ir.parser import parse
from tests.dumps import sharded_dump, tiny_dump

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ["bf16", "fp16", "fp32"]
DROPOUTS = [None, 0.1]  # None: the tiny config's own (0.0)
CONFIGS = [(dt, p) for dt in DTYPES for p in DROPOUTS]


@dataclass
class TextFacts:
    """What a dump's definition function says, read with ``ast`` alone."""

    tensor_inputs: int
    outputs: int
    meshed: set[str]  # tensors given a device mesh
    split: set[str]  # tensors with an outer_split / inner_split


def text_facts(text: str) -> TextFacts:
    tree = ast.parse(text)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert len(defs) == 1, "a dump holds one definition function"
    facts = TextFacts(0, 0, set(), set())
    for node in ast.walk(defs[0]):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        attr, owner = node.func.attr, node.func.value
        if attr == "define_tensor":
            facts.tensor_inputs += 1
        elif attr == "add_output":
            facts.outputs += 1
        elif attr == "set_device_mesh" and isinstance(owner, ast.Name):
            facts.meshed.add(owner.id)
        elif attr in ("outer_split", "inner_split") and isinstance(owner, ast.Name):
            facts.split.add(owner.id)
    return facts


def check_nvfuser_reads(path: Path) -> str:
    """Build ``path`` in nvFuser from its text and check what nvFuser holds; returns print_math()."""
    text = path.read_text()
    facts = text_facts(text)
    fd = build_from_text(text, str(path))
    nv = fd.fusion
    assert facts.outputs > 0 and len(nv.outputs()) == facts.outputs, path.name
    assert len([x for x in nv.inputs() if x.is_tensor()]) == facts.tensor_inputs, path.name
    assert compare_definition(parse(text, str(path)).fusion, fd) == [], path.name
    return nv.print_math()


@pytest.mark.parametrize("dtype,dropout", CONFIGS, ids=[f"{dt}-dropout{p}" for dt, p in CONFIGS])
def test_nvfuser_builds_each_dump_from_its_text(dtype, dropout):
    fwd, bwd = tiny_dump(dtype, dropout)
    for path in (fwd, bwd):
        math = check_nvfuser_reads(path)
        assert "ideviceIdx" not in math  # unsharded
    # Flash attention (sdpfa_fwd/sdpfa_bwd) is nvFuser's for half types only; fp32 attention is
    # written out. The backward's sdpfa_bwd had no scale before (nvFuser refused it).
    assert ("fd.ops.sdpfa_bwd(" in bwd.read_text()) == (dtype != "fp32")


SHARDED = [(dt, p, role, plan, d) for dt, p in CONFIGS for role in ("fwd", "bwd") for plan in ("megatron", "megatron-sp") for d in (2, 4)]


@pytest.mark.parametrize("dtype,dropout,role,plan,devices", SHARDED, ids=["-".join(map(str, s)) for s in SHARDED])
def test_nvfuser_builds_each_sharded_dump_from_its_text(dtype, dropout, role, plan, devices):
    path = sharded_dump(dtype, dropout, role, plan, devices)
    text = path.read_text()
    facts = text_facts(text)
    math = check_nvfuser_reads(path)
    # The device schedule is nvFuser's: every tensor the text gives a mesh has one, and the
    # split ones are parallelized over the devices (a device axis of extent `devices`).
    assert facts.split and facts.split <= facts.meshed
    extents = re.findall(r"ideviceIdx\.x\d+\{(\d+)\}", math)
    assert extents and set(extents) == {str(devices)}


@pytest.mark.parametrize("path", sorted((ROOT / "fusions").glob("*.py")), ids=lambda p: p.name)
def test_nvfuser_builds_each_checked_in_dump_from_its_text(path):
    check_nvfuser_reads(path)


def test_nvfuser_builds_the_reference_backends_float32_flash_attention_from_its_text(tmp_path):
    """The reference backend's trace claims float32 attention whole (sdpfa_fwd / sdpfa_bwd, run by
    torch's CPU flash kernels); printed, both fusions are definitions nvFuser builds from the text."""
    import torch

    from nvtp import driver
    from nvtp.ir.printer import format_file
    from nvtp.models import gpt

    cfg = gpt.config("tiny")
    with torch.device("meta"):
        block = gpt.Block(cfg)
    traced = driver.trace(block, (gpt.example_input(cfg, device="meta"),), regional=False, boundary=False, flash=True)
    for name, fusion, op in (("fwd", traced.forward, "fd.ops.sdpfa_fwd("), ("bwd", traced.backward, "fd.ops.sdpfa_bwd(")):
        path = tmp_path / f"block_fp32_flash_{name}.py"
        path.write_text(format_file(fusion))
        assert op in path.read_text() and "DataType.Float" in path.read_text()
        assert "ideviceIdx" not in check_nvfuser_reads(path)
