"""Inductor's per-process instruction-set check answered from disk (nvtp/execute/inductor_cache.py),
and Inductor's cache kept in nvtp's cache directory and read by later processes (nvtp's compiler
gives Inductor the shape environment its graph cache needs: ``inductor.inductor``).

The check is torch's own: it builds a test kernel per vector instruction set and loads each in a
fresh Python (about 15 s a process here). The first test runs it for real in one fresh process and
then, in a second, takes away the means to run it (every subprocess fails): Inductor must pick the
same instruction set from nvtp's record alone. Without the record the second process's checks all
fail and Inductor falls back to no vector instructions, so the test fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

PICK = textwrap.dedent("""
    import json, os, subprocess, sys
    import torch._dynamo  # writes torch's default cache directory into the environment, as any user's import does
    from nvtp.execute import inductor_cache
    inductor_cache.prepare()
    if sys.argv[1] == "no-subprocess":
        def refuse(*a, **k):
            raise OSError("this process may not start subprocesses")
        subprocess.check_call = refuse
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    isa = str(cpu_vec_isa.pick_vec_isa())
    hits = None
    if sys.argv[1] == "compile":  # nvtp's compiler on a small aten graph, then whether Inductor's disk cache answered
        import torch
        from torch._dynamo.utils import counters
        from torch.fx.experimental.proxy_tensor import make_fx
        from nvtp.execute import inductor
        x = torch.arange(64.0).reshape(8, 8)
        graph = make_fx(lambda a: [torch.softmax(a @ a.t() * 0.5, -1).sum(0)])(x)
        got = inductor.inductor(graph, [x])([x])[0]
        torch.testing.assert_close(got, torch.softmax(x @ x.t() * 0.5, -1).sum(0))
        hits = counters["inductor"]["fxgraph_cache_hit"]
    print(json.dumps({"isa": isa, "cache": cache_dir(), "hits": hits}))
""")


def _pick(env: dict[str, str], how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PICK, how], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_later_process_picks_inductors_instruction_set_from_nvtps_record_and_reads_its_compiled_code(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(NVTP_CACHE_DIR=str(tmp_path), NVTP_CACHE="1")
    first = _pick(env, "compile")
    assert first["cache"] == str(tmp_path / "inductor")  # Inductor's cache lives in nvtp's
    assert first["hits"] == 0 and _pick(env, "compile")["hits"] == 1  # and a later process's compile reads it
    memo = json.loads((tmp_path / "inductor" / "vec_isa.json").read_text())
    assert memo and all(isinstance(v, bool) for v in memo.values())
    second = _pick(env, "no-subprocess")
    assert second["isa"] == first["isa"]
    # Torch's own check, with no record to read, cannot pick it without a subprocess: the control.
    if first["isa"]:
        cold = dict(env, NVTP_CACHE_DIR=str(tmp_path / "elsewhere"))
        assert _pick(cold, "no-subprocess")["isa"] != first["isa"]


def test_a_record_is_per_key_and_a_users_inductor_cache_dir_is_kept(tmp_path, monkeypatch):
    from nvtp.execute import inductor_cache

    calls = []

    def check(isa, code):
        calls.append((isa.flags, code))
        return isa.flags == "-mgood"

    class ISA:
        def __init__(self, flags):
            self.flags = flags

        def build_arch_flags(self):
            return self.flags

    path = tmp_path / "vec_isa.json"
    remembered = inductor_cache._remembered(check, path)
    assert remembered(ISA("-mgood"), "k") is True and remembered(ISA("-mbad"), "k") is False
    assert remembered(ISA("-mgood"), "k") is True and remembered(ISA("-mbad"), "k") is False
    assert remembered(ISA("-mgood"), "other code") is True
    assert calls == [("-mgood", "k"), ("-mbad", "k"), ("-mgood", "other code")]  # each key asked once
    path.write_text("{not json")  # a damaged record costs the check again, nothing else
    assert remembered(ISA("-mgood"), "k") is True and len(calls) == 4

    from torch._inductor import cpu_vec_isa

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", cpu_vec_isa.VecISA.check_build)  # put back after
    monkeypatch.setattr(inductor_cache, "_DONE", False)
    monkeypatch.setenv("NVTP_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("NVTP_CACHE_DIR", str(tmp_path / "nvtp"))
    inductor_cache.prepare()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert getattr(cpu_vec_isa.VecISA.check_build, "nvtp_remembered", False)
