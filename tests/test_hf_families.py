"""Every decoder-only family of transformers' ``AutoModelForCausalLM`` mapping through nvtp (slow tier).

One fresh process per family (``tools/hf_families.py --family X``: a tiny config, ``nvtp.jit(model,
plan="megatron")`` on a simulated mesh of 2 against eager, as ``tests/test_hf.py`` checks; one
process each, as TorchDynamo's recompile limit would make later models fall back silently in one).
A family passes, or builds from no tiny config on the CPU, or fails as ``KNOWN`` says it does (the
table of docs/hf.md, from ``tools/hf_families.py --all``): a family that starts failing, or fails
another way, fails here; one that starts passing asks for its entry to go. The default tier keeps
a representative few (``tests/test_hf.py``, ``tests/test_strided.py``).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from hf_families import SIZES, build, families, not_decoder_only, runs_eagerly, tiny_sizes  # noqa: E402

# family -> a piece of the error it fails with today (2026-11-27; docs/hf.md's "The families sweep" says why)
KNOWN: dict[str, str] = {
    family: "convolution" for family in ("bailing_hybrid", "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba",
                                          "kimi_linear", "mamba", "nemotron_h", "olmo_hybrid", "qwen3_5_moe_text", "qwen3_5_text",
                                          "qwen3_next", "qwen4_exp_text", "recurrent_gemma", "inkling_text", "inkling2_text", "lfm3",
                                          "lfm2_moe", "mamba2", "zaya")
} | {"jetmoe": "checks a value it reads from the data",  # expert_size.tolist(): split sizes read from the router's data
     "gemma3n_text": "updates the parameter or buffer",  # its AltUp clamps prediction_coefs.weight.data in place in forward
     "longcat_flash": "cannot capture LongcatFlashForCausalLM.forward as one graph",  # its MoE loops over the experts hit
     "moshi": "2 does not divide 257",  # its vocabulary is the config's + 1: refused with the fix (pad it), by design
     "phimoe": "Unknown attribute uniform_"}  # its router's torch.rand_like(s).uniform_() in training: a random draw eager's RNG makes

DECODERS = [(t, c) for t, c in families() if not not_decoder_only(t, c)]


@pytest.mark.slow
@pytest.mark.parametrize("family", [t for t, _ in DECODERS])
def test_family_trains_at_tp2_like_eager_or_fails_as_known(family):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "hf_families.py"), "--family", family], capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stderr[-2000:]
    record = json.loads(lines[-1])
    if family in KNOWN:
        assert record["result"] != "PASS", f"{family} passes now: drop it from KNOWN and docs/hf.md's table"
        assert KNOWN[family] in record["error"], record
    else:
        assert record["result"] in ("PASS", "no tiny build"), record


class _KeepsState(torch.nn.Module):
    """A forward that leaves a tensor with autograd history on the module, as RecurrentGemma's does."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.state = None

    def forward(self, idx, labels=None):
        self.state = self.proj(idx.float())
        return self.state.sum()


def test_the_eager_probe_leaves_the_model_copyable():
    model = _KeepsState()
    runs_eagerly(model, torch.ones(2, 4, dtype=torch.long))
    assert model.state is None
    copy.deepcopy(model)  # the ranks and the eager reference are copies (RecurrentGemma failed here)


# Multi-head latent attention: the tool's MLA sizes, each family's ties (DeepSeek-V3.2: one key and value head per query
# head; all: head_dim is the rotary width) and AXK1's grouped routing over 4 experts; before, none of these built.
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "axk1"])
def test_an_mla_family_builds_tiny_and_runs_eagerly(family):
    model = build(family, dict(families())[family])
    config = model.config
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.head_dim) == (16, 8, 8), config
    assert config.num_key_value_heads == config.num_attention_heads == 4
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    runs_eagerly(model, idx)


def test_the_mla_sizes_leave_other_families_alone():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert tiny_sizes(CONFIG_MAPPING["llama"]) == SIZES  # its default kv heads equal its heads, and the tiny Llama is GQA
