"""The trace cache (nvtp/tracecache.py): a model traced once is read back, not traced again, and
trains as the model does in eager PyTorch; the key tells apart what the trace depends on; what it
cannot describe, what is damaged, and what the first-call check does not stand behind is traced."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import nvtp
from nvtp import driver, tracecache
from nvtp.models import gpt
from tests import differing

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NVTP_CACHE", "1")
    monkeypatch.setenv("NVTP_CACHE_DIR", str(tmp_path))
    return tmp_path / "traces"


def _data():
    g = torch.Generator().manual_seed(3)
    return [tuple(torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)) for _ in range(2)]


@pytest.fixture(scope="module")
def tiny_gpt():
    torch.manual_seed(0)
    return gpt.GPT(gpt.config("tiny"))


def test_a_second_jit_reads_the_trace_and_trains_like_eager(cache, tiny_gpt, monkeypatch):
    """The first ``nvtp.jit`` traces and keeps the trace; the second, with tracing made to fail,
    reads it; both train like the model in eager PyTorch (2 SGD steps: losses and weights)."""
    data = _data()
    want = copy.deepcopy(tiny_gpt)
    want_losses = differing.train_eager(want, data)
    first = nvtp.jit(copy.deepcopy(tiny_gpt), plan="megatron", mesh=1)
    assert differing.train_eager(first, data) == pytest.approx(want_losses, rel=1e-5)
    assert not first.lower(*data[0]).traced.how.startswith("from the trace cache")
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1

    def no_trace(*a, **k):
        raise AssertionError("traced again")

    monkeypatch.setattr(driver, "trace", no_trace)
    second = nvtp.jit(copy.deepcopy(tiny_gpt), plan="megatron", mesh=1)
    assert differing.train_eager(second, data) == pytest.approx(want_losses, rel=1e-5)
    assert second.lower(*data[0]).traced.how.startswith(f"from the trace cache ({cache}")
    cold, warm = first.lower(*data[0]).seconds, second.lower(*data[0]).seconds  # the first call's report
    assert {"trace", "shard", "lower", "check"} <= cold.keys() and {"trace", "shard", "lower", "check"} <= warm.keys()
    assert warm["trace"] < cold["trace"] / 3, (warm, cold)  # read, not traced
    for (name, p), q in zip(second.module.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_the_key_tells_apart_what_the_trace_depends_on():
    """Blocks that differ by an attribute, a buffer, a submodule, a flag or a window (issue 33's
    family) are other keys; so are another call shape, grad mode, training mode and option. The
    same model built again, with other weights, is the same key."""
    idx, tgt = differing.batches(1)[0]

    def key(m, args=(idx, tgt), **options):
        return tracecache.key(m, args, {}, options)

    same = key(differing.model("same"))
    assert key(differing.model("same", seed=7)) == same  # weights are inputs, not part of the program
    keys = {kind: key(differing.model(kind)) for kind in differing.KINDS}
    assert same not in keys.values() and len(set(keys.values())) == len(keys), keys
    assert key(differing.model("same"), args=(idx[:1], tgt[:1])) != same
    assert key(differing.model("same").eval()) != same
    assert key(differing.model("same"), regional=False) != same
    with torch.no_grad():
        assert key(differing.model("same")) != same
    m = differing.model("same")
    m.h[2].scale = 0.5  # one block's plain attribute
    assert key(m) != same
    m = differing.model("buffer")
    before = key(m)
    m.h[1].gain.fill_(3.0)  # a buffer's value: folded into the program
    assert key(m) != before


def test_what_the_key_cannot_describe_is_traced_and_not_kept(cache):
    m = differing.model("same")
    m.h[0].lock = threading.Lock()  # no class the key knows, no __dict__
    with pytest.raises(tracecache.Uncacheable, match=r"h\.0's attributes.*lock"):
        tracecache.key(m, (), {}, {})
    calls = []
    assert tracecache.trace(m, (), {}, {}, lambda: calls.append(1) or "traced", lambda t: True) == "traced"
    assert calls == [1] and not cache.exists()


@pytest.fixture(scope="module")
def traced_gpt(tiny_gpt):
    return driver.trace(copy.deepcopy(tiny_gpt), _data()[0])


def test_an_entry_reads_back_equal(cache, tiny_gpt, traced_gpt):
    args = _data()[0]
    calls = []
    tracecache.trace(tiny_gpt, args, {}, {}, lambda: calls.append(1) or traced_gpt, lambda t: True)
    back = tracecache.trace(tiny_gpt, args, {}, {}, lambda: calls.append(2) or traced_gpt, lambda t: True)
    assert calls == [1]
    assert back.forward == traced_gpt.forward and back.backward == traced_gpt.backward
    assert (back.arguments, back.weights, back.tied, back.route) == (traced_gpt.arguments, traced_gpt.weights, traced_gpt.tied,
                                                                      traced_gpt.route)
    assert back.record().layers == traced_gpt.record().layers and back.record().output_tree == traced_gpt.record().output_tree


def test_a_damaged_entry_is_reported_and_traced_anew(cache, tiny_gpt, traced_gpt):
    args = _data()[0]
    tracecache.trace(tiny_gpt, args, {}, {}, lambda: traced_gpt, lambda t: True)
    entry = next(p for p in cache.iterdir() if p.is_dir())
    (entry / "forward.py").write_text("import os\nos.system('echo crafted')\n")  # read by nvtp's parser: never run
    calls = []
    with pytest.warns(UserWarning, match="cannot be read.*tracing anew"):
        back = tracecache.trace(tiny_gpt, args, {}, {}, lambda: calls.append(1) or traced_gpt, lambda t: True)
    assert calls == [1] and back is traced_gpt


def test_a_program_the_check_cannot_compare_is_read_only_while_the_users_code_is_unchanged(cache, tiny_gpt, traced_gpt,
                                                                                              monkeypatch):
    """``verify=False``, or dropout the first-call check cannot compare: the entry is read while
    every source file of the user's own is as it was when it was written, else traced anew (and
    the entry rewritten)."""
    args = _data()[0]
    tracecache.trace(tiny_gpt, args, {}, {}, lambda: traced_gpt, lambda t: True)
    calls = []
    tracecache.trace(tiny_gpt, args, {}, {}, lambda: calls.append(1) or traced_gpt, lambda t: False)
    assert calls == []  # unchecked, but nothing of the user's changed
    monkeypatch.setattr(tracecache, "_user_code", lambda: "an edited helper")
    tracecache.trace(tiny_gpt, args, {}, {}, lambda: calls.append(2) or traced_gpt, lambda t: False)
    assert calls == [2]  # unchecked and the user's code changed: traced
    tracecache.trace(tiny_gpt, args, {}, {}, lambda: calls.append(3) or traced_gpt, lambda t: False)
    assert calls == [2]  # the entry was rewritten with the new code's digest


def test_the_users_code_is_the_files_loaded_from_outside_python_and_the_packages():
    import tests.differing as user_module

    digest = tracecache._user_code()
    assert digest == tracecache._user_code()
    files = {m.__file__ for m in (torch, pytest, tracecache)}  # the packages and nvtp are not the user's
    assert user_module.__file__ not in files
    original = user_module.__file__
    try:
        user_module.__file__ = str(Path(original).with_name("data_checks_models.py"))  # as if the user's file changed
        assert tracecache._user_code() != digest
    finally:
        user_module.__file__ = original


def test_ranks_that_start_together_trace_once(cache, tiny_gpt, traced_gpt):
    """The ranks of a job (here threads) ask at once: one traces, the others wait and read."""
    args = _data()[0]
    calls = []

    def slow():
        calls.append(1)
        time.sleep(1.0)
        return traced_gpt

    got = [None] * 3

    def rank(r):
        got[r] = tracecache.trace(tiny_gpt, args, {}, {}, slow, lambda t: True)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1]
    assert all(g is not None and g.forward == traced_gpt.forward for g in got)


def test_a_directory_it_cannot_write_is_said_and_traced_without(monkeypatch, tmp_path, tiny_gpt):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("NVTP_CACHE", "1")
    monkeypatch.setenv("NVTP_CACHE_DIR", str(blocked))  # traces/ cannot be made under a file
    with pytest.warns(UserWarning, match="cannot use .*tracing without it"):
        assert tracecache.trace(tiny_gpt, _data()[0], {}, {}, lambda: "traced", lambda t: True) == "traced"


def test_the_least_recently_used_entries_go_first_beyond_the_limit(cache, tiny_gpt, traced_gpt, monkeypatch):
    """Three entries (three call shapes); the first is read again, so the second is the least
    recently used: with room for two, the second goes. A bad limit is refused before any trace."""
    shapes = [_data()[0], tuple(t[:1] for t in _data()[0]), tuple(t[:, :8] for t in _data()[0])]
    keys = [tracecache.key(tiny_gpt, s, {}, {}) for s in shapes]
    for s in shapes[:2]:
        tracecache.trace(tiny_gpt, s, {}, {}, lambda: traced_gpt, lambda t: True)
    time.sleep(0.05)
    tracecache.trace(tiny_gpt, shapes[0], {}, {}, lambda: pytest.fail("traced again"), lambda t: True)  # read: used again
    size = max(tracecache._size(cache / k) for k in keys[:2])
    monkeypatch.setenv("NVTP_CACHE_MAX_MB", str(2.5 * size / 2**20))
    time.sleep(0.05)
    tracecache.trace(tiny_gpt, shapes[2], {}, {}, lambda: traced_gpt, lambda t: True)
    assert [(cache / k).exists() for k in keys] == [True, False, True]
    monkeypatch.setenv("NVTP_CACHE_MAX_MB", "lots")
    with pytest.raises(ValueError, match="NVTP_CACHE_MAX_MB='lots' is not a number"):
        tracecache.trace(tiny_gpt, shapes[0], {}, {}, lambda: pytest.fail("traced"), lambda t: True)


def test_the_cache_is_off_when_asked(monkeypatch, tmp_path):
    monkeypatch.setenv("NVTP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NVTP_CACHE", "0")
    assert tracecache.directory() is None
    monkeypatch.setenv("NVTP_CACHE", "1")
    assert tracecache.directory() == tmp_path / "traces"


_SCRIPT = """
import copy, time, torch, nvtp
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(cfg)
ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
eager = copy.deepcopy(model)(ids, labels=ids).loss
sharded = nvtp.jit(model, plan="megatron", mesh=1)
start = time.perf_counter()
loss = sharded(ids, labels=ids).loss
print(f"first call {time.perf_counter() - start:.2f} s; loss {loss.item():.6f} eager {eager.item():.6f}")
print("how:", sharded.lower(ids, labels=ids).traced.how)
"""


@pytest.mark.slow
def test_a_script_run_twice_traces_once(tmp_path):
    """As a user runs it: the same script twice in fresh processes (a transformers Llama); the
    second reads the first's trace, with eager's loss."""
    pytest.importorskip("transformers")
    env = {**os.environ, "NVTP_CACHE": "1", "NVTP_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    runs = [subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
        first = r.stdout.split("loss ")[1].split()
        assert abs(float(first[0]) - float(first[2])) < 1e-5, r.stdout
    assert "from the trace cache" not in runs[0].stdout and "from the trace cache" in runs[1].stdout, [r.stdout for r in runs]


def test_a_pipelines_trace_is_kept_and_read_back_into_the_same_stages(cache, monkeypatch):
    """``driver.compile_pipeline(..., cached=...)`` (what a pipeline's runtime passes: the first-call
    check stands behind it) keeps the whole trace; the second compile reads it, cuts the same
    stages and shards them alike."""
    cfg = gpt.config("tiny", n_layer=4, batch=4)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    idx, tgt = gpt.example_tokens(cfg)
    first = driver.compile_pipeline(model, idx, tgt, mesh="2x1x1", microbatches=2, cached=lambda t: True)
    monkeypatch.setattr(driver, "trace", lambda *a, **k: pytest.fail("traced again"))
    second = driver.compile_pipeline(model, idx, tgt, mesh="2x1x1", microbatches=2, cached=lambda t: True)
    assert second.traced.how.startswith("from the trace cache") and not first.traced.how.startswith("from the trace cache")
    for a, b in zip(first.programs, second.programs):
        assert a.forward.fusion == b.forward.fusion and a.backward.fusion == b.backward.fusion


def test_explain_reads_the_trace_while_the_users_code_is_unchanged(cache, monkeypatch):
    """``nvtp.plan`` / ``nvtp explain`` run nothing that could check a trace: they read an entry
    while the user's code is as it was (the same entry ``nvtp.jit`` keeps), and report it."""
    model, args, _ = differing.window()
    first = nvtp.plan(model, *args, plan="megatron", devices=2)
    monkeypatch.setattr(driver, "trace", lambda *a, **k: pytest.fail("traced again"))
    second = nvtp.plan(model, *args, plan="megatron", devices=2)
    assert "from the trace cache" in second.as_text() and "from the trace cache" not in first.as_text()
    strip = lambda text: [ln for ln in text.splitlines() if not ln.startswith("time:")]  # noqa: E731
    assert strip(second.as_text()) == strip(first.as_text())


@pytest.mark.slow
def test_nvtp_explain_as_typed_twice_reads_the_first_ones_trace(tmp_path):
    env = {**os.environ, "NVTP_CACHE": "1", "NVTP_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "nvtp", "explain", "--module", "tests.differing:window", "--plan", "megatron", "--devices", "2"]
    runs = [subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    assert "from the trace cache" not in runs[0].stdout and "from the trace cache" in runs[1].stdout
    strip = lambda text: [ln for ln in text.splitlines() if not ln.startswith("time:")]  # noqa: E731
    assert strip(runs[0].stdout) == strip(runs[1].stdout)


@pytest.mark.slow
def test_plan_auto_reads_its_sample_from_the_cache(tmp_path):
    """``nvtp explain --plan auto`` as typed, twice: the second search reads the sample's trace
    (the first's), chooses the same plan and prints the same table."""
    env = {**os.environ, "NVTP_CACHE": "1", "NVTP_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "nvtp", "explain", "--model", "nanogpt", "--config", "tiny", "--plan", "auto", "--devices", "4"]
    runs, entries = [], []
    for _ in range(2):
        runs.append(subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600))
        entries.append(sorted(p.name for p in (tmp_path / "traces").iterdir() if p.is_dir()))
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    same = lambda text: [ln for ln in text.splitlines() if not ln.startswith("searched ")]  # noqa: E731
    assert same(runs[0].stdout) == same(runs[1].stdout)
    assert entries[0] and entries[1] == entries[0]  # the sample kept by the first, read (not traced and kept again) by the second
