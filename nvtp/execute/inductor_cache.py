"""Inductor's fixed costs paid once per machine, not once per process (``compile="inductor"``).

Two things make a process's first Inductor compile slow even when Inductor's cache already holds
its code:

* **Which vector instructions Inductor's C++ may use.** ``torch._inductor.cpu_vec_isa`` builds a
  test kernel per candidate instruction set (AVX-512, its bf16 and VNNI extensions, AMX, AVX2, ...)
  and loads each in a fresh Python that imports torch, to see that torch's own vector library
  links with it: about 15 s here in every process, warm cache or not (torch 2.10; a trivial
  ``torch.compile`` after it 1.3 s). The answer depends only on the test code, the compiler
  flags, the compiler, torch, the Python that loads it and the CPU, so nvtp keeps it on disk,
  keyed by all of them (``vec_isa.json`` beside Inductor's cache), and asks the check only for
  a key it has not seen. A key holds the check's own answer, pass or fail.
* **Where Inductor keeps its code.** By default ``/tmp/torchinductor_<user>``, which a reboot
  empties. Under nvtp it lives in nvtp's cache directory (``$NVTP_CACHE_DIR/inductor``, beside the
  traces), unless ``TORCHINDUCTOR_CACHE_DIR`` names another directory than torch's default;
  ``NVTP_CACHE=0`` leaves Inductor's defaults alone (and asks the check in every process, as
  torch does).

``prepare()`` does both, once per process, before nvtp's first compile.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from nvtp import cachedir

_DONE = False
_LOCK = threading.Lock()
_MEMO_FILE = "vec_isa.json"


def prepare() -> None:
    """Point Inductor's cache into nvtp's and remember its instruction-set checks (module docstring).
    Idempotent; does nothing with ``NVTP_CACHE=0``."""
    global _DONE
    with _LOCK:
        if _DONE:
            return
        _DONE = True
        root = cachedir.root()
        if root is None:
            return
        from torch._inductor import cpu_vec_isa
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        # Importing torch._dynamo writes torch's default into the environment: only a directory
        # other than that default is the user's choice.
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")

        check = getattr(cpu_vec_isa.VecISA, "check_build", None)
        if check is None or getattr(check, "nvtp_remembered", False):  # another torch, or done
            return
        cpu_vec_isa.VecISA.check_build = _remembered(check, Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / _MEMO_FILE)


def _remembered(check: Callable[[Any, str], bool], path: Path) -> Callable[[Any, str], bool]:
    """``VecISA.check_build`` answered from ``path`` where it was asked before with the same key."""

    @functools.wraps(check)
    def check_build(isa: Any, code: str) -> bool:
        key = _key(isa, code)
        memo = _read(path)
        if key in memo:
            return bool(memo[key])
        ok = bool(check(isa, code))
        memo = _read(path)  # another process may have written meanwhile
        memo[key] = ok
        _write(path, memo)
        return ok

    check_build.nvtp_remembered = True  # type: ignore[attr-defined]
    return check_build


def _key(isa: Any, code: str) -> str:
    """What a check's answer depends on: the test code, the flags, the compiler and torch (Inductor's
    own fingerprint), the Python that loads the kernel, and the CPU."""
    from torch._inductor import cpu_vec_isa

    flags = isa.build_arch_flags()
    parts = [code, flags, cpu_vec_isa._get_isa_dry_compile_fingerprint(flags), sys.executable, platform.machine(), _cpu()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


@functools.cache
def _cpu() -> str:
    """The CPU's model and feature flags (``/proc/cpuinfo``): a cache directory shared between
    machines must not carry one CPU's answer to another."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "cpu model"))]
    except OSError:
        return platform.processor()
    return "".join(sorted(set(lines)))


def _read(path: Path) -> dict[str, bool]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, bool)} if isinstance(data, dict) else {}


def _write(path: Path, memo: dict[str, bool]) -> None:
    """Atomically (a file renamed into place), so a reader never sees half of it; a cache that
    cannot be written only costs the check again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".vec_isa.")
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f)
        os.replace(tmp, path)
    except OSError:
        pass
