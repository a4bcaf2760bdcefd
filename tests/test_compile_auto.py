"""``compile="auto"`` (nvtp/execute/precompile.py, inductor.py's ``Compiled.decide``): a first run
of a program compiles nothing, runs the kernels pass and queues each traced piece for a background
compile; a later run, finding a record for every piece, compiles them all on its first call and
runs the compiled code. Results are eager PyTorch's on the unsharded model either way.

The fast tests put the traced aten graph where Inductor's code would run (``inductor.compiler``,
as tests/test_inductor.py does) and run the background compile in-process; the slow test runs the
whole thing as a user does: two processes, Inductor itself and the background process between."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import nvtp
from nvtp.execute import inductor, precompile, reference
from nvtp.sharding.placements import DeviceMesh
from tests.test_inductor import _loss, _pieces, _step, aten  # noqa: F401 - aten: the fixture
from tests.test_kernels import _close, _gpt

LATER = "left to the background compile, for a later run"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """nvtp's cache on, in a directory of the test's own; background starts recorded, not run."""
    monkeypatch.setenv("NVTP_CACHE", "1")
    monkeypatch.setenv("NVTP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    starts: list = []
    monkeypatch.setattr(precompile, "start", lambda where: starts.append(where))
    return tmp_path / "inductor" / "nvtp", starts


def test_a_first_run_queues_every_piece_and_a_later_run_compiles_them_all(aten, cache):  # noqa: F811
    where, starts = cache
    model, cfg, idx, tgt = _gpt()
    want = _step(copy.deepcopy(model), _loss, idx, tgt)

    first = nvtp.jit(copy.deepcopy(model), mesh=DeviceMesh.of_size(1), compile="auto")
    runs = [_step(first, _loss, idx, tgt) for _ in range(2)]
    pieces = _pieces(first)
    for phase in ("forward", "backward"):
        assert pieces[phase]["compiled"] == 0 and pieces[phase]["python"] == {LATER: 1}, pieces
    assert aten == []  # nothing compiled in this run
    assert len(list((where / "queued").glob("*.pt"))) == 2 and starts == [where, where]
    for got in runs:
        _close(got, want, "first run (the kernels) vs eager")

    assert precompile.compile_queue(where) == 2  # what the background process does
    assert len(aten) == 2 and not list((where / "queued").glob("*.pt")) and len(list((where / "compiled").iterdir())) == 2

    later = nvtp.jit(copy.deepcopy(model), mesh=DeviceMesh.of_size(1), compile="auto")
    runs = [_step(later, _loss, idx, tgt) for _ in range(2)]
    pieces = _pieces(later)
    for phase in ("forward", "backward"):
        assert pieces[phase]["compiled"] == 1 and pieces[phase]["python"] == {}, pieces
    assert len(aten) == 4 and all(calls >= 1 for _, calls in aten[2:])  # compiled on the first call, run on the second
    assert len(starts) == 2  # nothing left to compile
    for got in runs:
        _close(got, want, "later run (compiled) vs eager")


def test_with_nvtps_cache_off_auto_is_the_kernels(aten, monkeypatch):  # noqa: F811
    monkeypatch.setenv("NVTP_CACHE", "0")
    model, cfg, idx, tgt = _gpt()
    sm = nvtp.jit(copy.deepcopy(model), mesh=DeviceMesh.of_size(1), compile="auto")
    _step(sm, _loss, idx, tgt)
    _step(sm, _loss, idx, tgt)
    assert aten == [] and all(p == {"compiled": 0, "python": {}, "seconds": 0.0} for p in _pieces(sm).values())


class _Piece:
    def __init__(self, warm):
        self.graph, self.warm, self.key, self.layout, self.built, self.why = object(), warm, f"k{id(self)}", [], False, []

    def build(self):
        self.built = True

    def _python(self, why):
        self.why.append(why)


class _Peer:
    """A 2-rank comm whose other rank says ``peer`` (1.0: all its pieces are warm, 0.0: not)."""

    size = 2

    def __init__(self, peer):
        self.peer = peer

    def all_reduce(self, t, op):
        assert op == "min"
        return torch.minimum(t, torch.tensor([self.peer]))


@pytest.mark.parametrize("peer", [1.0, 0.0])
def test_ranks_compile_all_together_or_none_so_replicated_values_stay_equal(tmp_path, monkeypatch, peer):
    queued = []
    monkeypatch.setattr(precompile, "queue", lambda where, k, graph, layout: queued.append(k))
    monkeypatch.setattr(precompile, "start", lambda where: None)
    pieces = [_Piece(True), _Piece(True)]
    report = inductor.Compiled(run=None, pieces=0, ahead=precompile.Ahead(tmp_path), traced=list(pieces))
    report.decide(_Peer(peer))
    assert all(p.built == (peer == 1.0) for p in pieces)  # this rank is warm: it compiles only if its peer is
    assert queued == [] and all(p.why == ([] if peer == 1.0 else [LATER]) for p in pieces)
    cold = [_Piece(True), _Piece(False)]
    report = inductor.Compiled(run=None, pieces=0, ahead=precompile.Ahead(tmp_path), traced=list(cold))
    report.decide(_Peer(1.0))
    assert not any(p.built for p in cold) and queued == [cold[1].key]  # one piece cold here: none compiles, it is queued


RUN = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, "tools")
    from rank_bench import gpt_case  # noqa: E402
    import nvtp
    from nvtp.execute import reference
    from torch._dynamo.utils import counters
    model, args, kwargs, loss_of = gpt_case()
    sm = nvtp.jit(model, mesh=1, compile="auto")
    losses = []
    for _ in range(3):
        loss = loss_of(sm(*args)); loss.backward(); losses.append(loss.item())
    pieces = {p: reference.compiled_pieces(s.fusion)["compiled"] for p, s in sm.last.phases()}
    print(json.dumps({"losses": losses, "pieces": pieces, "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "compile": sm.last.seconds.get("compile")}))
""")


@pytest.mark.slow
def test_a_users_second_process_runs_what_the_first_ones_background_compile_built(tmp_path):
    """As a user runs it: ``compile="auto"``, nvtp's cache on; the first process queues its
    pieces and starts the background compile; once it has finished, a second process compiles
    every piece from Inductor's cache (graph-cache hits) and runs them, with the first's losses."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(NVTP_CACHE="1", NVTP_CACHE_DIR=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run():
        out = subprocess.run([sys.executable, "-c", RUN], env=env, cwd=root, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run()
    assert first["pieces"] == {"forward": 0, "backward": 0}, first
    where = tmp_path / "inductor" / "nvtp"
    deadline = time.monotonic() + 900
    while list((where / "queued").glob("*.pt")) or len(list((where / "compiled").glob("*"))) < 2:
        assert time.monotonic() < deadline, (where / "precompile.log").read_text()[-3000:]
        time.sleep(2)
    second = run()
    assert second["pieces"] == {"forward": 1, "backward": 1} and second["hits"] >= 1, second
    for a, b in zip(first["losses"], second["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (first, second)
