"""A short training run end to end, as a user's script runs it: ``nvtp.jit`` on a mesh of one with a
``compile=`` mode, then N AdamW steps of one of ``tools/rank_bench.py``'s models; prints the
seconds from ``nvtp.jit`` to the last step's end, the first step's part, and the loss. The issue-37
question it answers: which ``compile=`` is fastest for a run of a few hundred steps, first call
(tracing, compiling) included. Time whole processes of it side by side with farm-bench:

    farm-bench -n 3 --timeout 1800 --vs ".venv/bin/python tools/end_to_end.py gpt --compile kernels --steps 300" \\
        -- .venv/bin/python tools/end_to_end.py gpt --compile inductor --steps 300

The trace and Inductor's code are read from nvtp's cache directory when an earlier run left them
(``NVTP_CACHE_DIR``; ``--cold`` points it at a new empty directory first: what a first run pays).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=["gpt", "llama", "torch-llama"])
    parser.add_argument("--compile", default=None, help="nvtp.jit's compile= (default: nvtp's default); 'eager': no nvtp")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's own)")
    parser.add_argument("--cold", action="store_true", help="an empty cache directory: nothing traced or compiled before")
    a = parser.parse_args()
    if a.cold:
        os.environ["NVTP_CACHE_DIR"] = tempfile.mkdtemp(prefix="nvtp-cold-")
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    import torch

    import nvtp
    from rank_bench import CASES

    if a.threads:
        torch.set_num_threads(a.threads)
    model, args, kwargs, loss_of = CASES[a.case]()
    start = time.perf_counter()
    if a.compile != "eager":
        model = nvtp.jit(model, mesh=1, **({"compile": a.compile} if a.compile else {}))
    inner = getattr(model, "module", model)
    opt = torch.optim.AdamW(inner.parameters(), lr=1e-3)
    first = None
    for step in range(a.steps):
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if first is None:
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    parts = ", ".join(f"{k} {v:.2f}" for k, v in getattr(model, "last", None).seconds.items()) if a.compile != "eager" else ""
    print(f"{a.case} compile={a.compile or 'default'}: {a.steps} steps in {total:.2f} s (first step {first:.2f} s"
          f"{'; ' + parts if parts else ''}; then {(total - first) / max(a.steps - 1, 1) * 1e3:.1f} ms a step), "
          f"final loss {loss.item():.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
