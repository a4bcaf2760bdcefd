"""Shared fixtures: traced GPT blocks are expensive (Thunder), so each is traced once per session."""

from __future__ import annotations

import os

import pytest
import torch

from nvtp.frontend.capture import capture
from nvtp.models import gpt

# Every test traces for real: the trace cache (nvtp/tracecache.py) is off unless a test turns it on
# (tests/test_tracecache.py), and so for the processes the tests start, which inherit it.
os.environ["NVTP_CACHE"] = "0"


@pytest.fixture(autouse=True)
def _collector_left_on():
    """A test that leaves Python's cyclic collector off (a rank thread of simulated ranks still
    inside nvtp's pause, nvtp/gcpause.py, after its test gave up on it) would run every later test
    of its worker without it: turned back on, and the test named."""
    import gc
    import warnings

    was = gc.isenabled()
    yield
    if was and not gc.isenabled():
        gc.enable()
        warnings.warn("this test left the cyclic garbage collector disabled; re-enabled", stacklevel=1)


@pytest.fixture(scope="session")
def tiny_cfg() -> gpt.GPTConfig:
    return gpt.config("tiny")


def make_block(cfg: gpt.GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> gpt.Block:
    torch.manual_seed(seed)
    return gpt.Block(cfg).to(dtype)


@pytest.fixture(scope="session")
def tiny_block(tiny_cfg):
    return make_block(tiny_cfg)


@pytest.fixture(scope="session")
def tiny_capture(tiny_cfg, tiny_block):
    """Forward and backward fusions of the tiny fp32 block (no dropout)."""
    return capture(tiny_block, gpt.example_input(tiny_cfg))


@pytest.fixture(scope="session")
def tiny_bf16_capture(tiny_cfg):
    block = make_block(tiny_cfg, dtype=torch.bfloat16)
    return capture(block, gpt.example_input(tiny_cfg, dtype=torch.bfloat16)), block
