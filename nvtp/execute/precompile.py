"""Compiling a rank's pieces for the next run, off the run's path: ``compile="auto"``.

A compile pays for itself only over many steps when it is cold (tens of seconds of Inductor's C++
builds here, against a gain of 10-30 ms a step), and costs a second or two when Inductor's cache
already holds the code. So ``compile="auto"`` (the default) traces each piece on its first call
(``inductor.py``) and then:

* where an earlier run compiled every piece of the program (a *record* here for each), every rank
  compiles them now, from Inductor's cache, and runs the compiled code from the next call on;
* otherwise nothing is compiled in this run: the pieces run as the kernels pass left them, each
  piece not yet compiled is *queued* here (its aten graph and input layouts, ``torch.save``), and
  a background process (``python -m nvtp.execute.precompile DIR``, at low priority, one at a time
  per directory) compiles the queue into Inductor's cache and leaves a record for each piece.

Where nvtp's cache is off (``NVTP_CACHE=0``) there is nowhere to keep the work, and ``"auto"`` is
``"kernels"``. The directory is ``<Inductor's cache>/nvtp``: Inductor's own code is loaded from
that tree too, so it holds code this user's runs put there and nothing else should write to it.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from nvtp import cachedir
from nvtp.execute import inductor, inductor_cache

Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


def directory() -> Path | None:
    """Where records and the queue live, or None when nvtp's cache is off."""
    if cachedir.root() is None:
        return None
    inductor_cache.prepare()
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cachedir.root() / "inductor") / "nvtp"


def settled(graph: fx.GraphModule) -> fx.GraphModule:
    """``graph`` as a process reads it back from the queue: fx writes a GraphModule as its code and
    reads it by tracing that code again, which renames its nodes (``view`` -> ``view_default``).
    Inductor's cache keys a graph by its code, so the run compiles this form, as the background
    compile does, and the two find each other's code (reading it back again changes nothing)."""
    import torch._inductor.compile_fx  # noqa: F401 - what reading a make_fx graph back needs imported (its tracer's ops)

    buf = io.BytesIO()
    torch.save(graph, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def key(graph: fx.GraphModule, layouts: list[Layout]) -> str:
    """What Inductor's code for ``graph`` on inputs of ``layouts`` depends on: the graph's code, its
    constants' values, the layouts and torch's version."""
    h = hashlib.sha256()
    h.update(torch.__version__.encode())
    h.update(graph.code.encode())
    h.update(repr(layouts).encode())
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            value = getattr(graph, node.target)
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu().contiguous()
                h.update(f"{node.target}{tuple(value.shape)}{value.dtype}".encode())
                h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
            else:
                h.update(f"{node.target}={value!r}".encode())
    return h.hexdigest()


def done(where: Path, k: str) -> bool:
    return (where / "compiled" / k).exists()


def queue(where: Path, k: str, graph: fx.GraphModule, layouts: list[Layout]) -> None:
    """Keep ``graph`` for the background compile (once per key; written whole or not at all)."""
    path = where / "queued" / f"{k}.pt"
    if path.exists() or done(where, k):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".queued.")
    os.close(fd)
    try:
        # Inductor's C++ is generated for the process's intra-op threads: compiled for as many as the run has
        torch.save({"graph": graph, "layouts": layouts, "threads": torch.get_num_threads()}, tmp)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - a graph that cannot be kept is compiled by no later run: it runs as Python
        Path(tmp).unlink(missing_ok=True)
        raise


def start(where: Path) -> subprocess.Popen | None:
    """The background compile of ``where``'s queue (None when nothing is queued). It outlives
    this process if need be; its output goes to ``where/precompile.log``."""
    if not any((where / "queued").glob("*.pt")):
        return None
    log = open(where / "precompile.log", "ab")  # noqa: SIM115 - the child holds it
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # one core for the compiler: the run keeps the others
    try:
        return subprocess.Popen([sys.executable, "-m", "nvtp.execute.precompile", str(where)], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True, env=env)
    finally:
        log.close()


class Ahead:
    """One directory's records and queue, as ``inductor.Compiled`` uses them under ``compile="auto"``."""

    settled = staticmethod(settled)
    key = staticmethod(key)

    def __init__(self, where: Path):
        self.where = where

    def done(self, k: str) -> bool:
        return done(self.where, k)

    def queue(self, k: str, graph: fx.GraphModule, layouts: list[Layout]) -> None:
        queue(self.where, k, graph, layouts)

    def start(self) -> subprocess.Popen | None:
        return start(self.where)


def compile_queue(where: Path) -> int:
    """Compile every queued graph of ``where`` into Inductor's cache, leaving a record for each
    (one process at a time per directory: others wait for the lock, then find the work done).
    Returns how many it compiled."""
    import torch._inductor.compile_fx  # noqa: F401 - what torch.load of a make_fx graph needs imported

    inductor_cache.prepare()  # Inductor's cache and instruction-set record as the run has them
    where.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(where / "precompile.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for path in sorted((where / "queued").glob("*.pt")):
            k = path.stem
            if not done(where, k):
                # The queue holds only what this user's runs wrote (the module docstring): a GraphModule
                # is Python code, so it is read as one.
                item: dict[str, Any] = torch.load(path, weights_only=False)
                if key(item["graph"], item["layouts"]) != k:  # not the graph the run keyed: no record
                    print(f"nvtp precompile: {path.name} reads back as another graph; not compiled", flush=True)
                    path.unlink(missing_ok=True)
                    continue
                torch.set_num_threads(item["threads"])
                inputs = [torch.empty_strided(shape, stride, dtype=dtype) for shape, stride, dtype in item["layouts"]]
                with torch.no_grad():  # as a rank's pieces are compiled, inside autograd's Function calls
                    inductor.compiler(item["graph"], inputs)
                (where / "compiled").mkdir(exist_ok=True)
                (where / "compiled" / k).touch()
                n += 1
            path.unlink(missing_ok=True)
    return n


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m nvtp.execute.precompile DIR", file=sys.stderr)
        return 2
    os.nice(10)  # a background job: the training runs first
    n = compile_queue(Path(argv[0]))
    print(f"nvtp precompile: {n} piece(s) compiled into {os.environ.get('TORCHINDUCTOR_CACHE_DIR')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
