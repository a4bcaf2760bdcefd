"""One training step of a freshly built model through ``nvtp.jit``, as a user's script runs it:
prints the first call's seconds (trace, shard, the first-call check, the step). Run twice with
the trace cache on (``NVTP_CACHE_DIR``), the second run reads the first's trace; with
``NVTP_CACHE=0`` every run traces. docs/benchmarks.md times whole processes of it with farm-bench:

    farm-bench -n 3 --timeout 900 --vs "env NVTP_CACHE=0 .venv/bin/python benchmarks/first_call.py llama" \\
        -- env NVTP_CACHE_DIR=/tmp/nvtp-cache .venv/bin/python benchmarks/first_call.py llama

``llama``: a transformers ``LlamaForCausalLM`` (2 layers, hidden 64; the FX route); ``gpt``:
nvtp's tiny GPT (Thunder's route). A second argument is ``nvtp.jit``'s ``compile=`` (default: its
default), e.g. ``first_call.py gpt inductor`` for the first call of Inductor's compiled pieces.
"""

from __future__ import annotations

import sys
import time

import torch

import nvtp


def main(which: str, compile: str | None = None) -> None:
    torch.manual_seed(0)
    if which == "llama":
        from nvtp.models.hf import build

        model = build("llama")
        ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        args, kwargs = (ids,), {"labels": ids}
    elif which == "gpt":
        from nvtp.models import gpt

        model = gpt.GPT(gpt.config("tiny"))
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        args, kwargs = (ids, ids), {}
    else:
        raise SystemExit(f"usage: first_call.py llama|gpt (got {which!r})")
    sharded = nvtp.jit(model, plan="megatron", mesh=1, **({"compile": compile} if compile else {}))
    start = time.perf_counter()
    out = sharded(*args, **kwargs)
    (out.loss if hasattr(out, "loss") else out).backward()
    seconds = time.perf_counter() - start
    cached = sharded.lower(*args, **kwargs).traced.how.startswith("from the trace cache")
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sharded.last.seconds.items())
    print(f"first step {seconds:.2f} s ({'read from the trace cache' if cached else 'traced'}; {parts})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llama", sys.argv[2] if len(sys.argv) > 2 else None)
