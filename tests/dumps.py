"""Dumps of the tiny GPT block, traced once per test session (Thunder takes seconds a trace) and
shared by the test modules that read them."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from nvtp import dump


@functools.cache
def tiny_dump(dtype: str = "bf16", dropout: float | None = None) -> tuple[Path, Path]:
    """``nvtp dump --config tiny --dtype DTYPE [--dropout P]``'s forward and backward files."""
    out = Path(tempfile.mkdtemp(prefix=f"nvtp-tiny-{dtype}-{dropout}-"))
    atexit.register(shutil.rmtree, out, True)
    return dump.dump_model("nanogpt", "tiny", out, dtype=dump.DTYPES[dtype], dropout=dropout)


@functools.cache
def sharded_dump(dtype: str, dropout: float | None, role: str, plan: str, devices: int) -> Path:
    """``nvtp shard`` of a tiny dump (``role`` fwd or bwd) with ``plan`` over ``devices``."""
    from nvtp.dump.mesh import MeshJob, prepare
    from nvtp.dump.sharded import write_sharded

    fwd, bwd = tiny_dump(dtype, dropout)
    source = fwd if role == "fwd" else bwd
    out = source.with_name(f"{source.stem}_{plan}_tp{devices}.py")
    command = f"nvtp shard {source.name} --plan {plan} --devices {devices} --out {out.name}"
    return write_sharded(prepare(MeshJob(str(source), plan, devices, backend="nvfuser")).sharded, out, command)  # as nvtp shard: for nvFuser
