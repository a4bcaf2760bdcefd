"""Where a benchmark's step time goes: torch.profiler tables (rank 0) for nvtp and the PyTorch plan
it is compared with, as docs/benchmarks.md cites them.

    .venv/bin/python tools/bench_profile.py fsdp_tp      # benchmarks/test_fsdp_tp.py's case, one step each
    .venv/bin/python tools/bench_profile.py tp --d 2     # benchmarks/test_sharded.py's block at d, 3 steps each
    .venv/bin/python tools/bench_profile.py tp --d 2 --compiled   # also nvtp compile="inductor" and torch.compile's plan
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    from nvtp.execute.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=["fsdp_tp", "tp"])
    parser.add_argument("--d", type=int, default=2, help="processes of the tp case")
    parser.add_argument("--compiled", action="store_true", help="also the compiled sides (issue 37 item 3)")
    args = parser.parse_args()
    out = os.path.join(tempfile.mkdtemp(prefix="nvtp-profile-"), "result.json")
    if args.case == "fsdp_tp":
        from benchmarks.fsdp_tp_worker import Job, worker

        job, world = Job(out=out, rounds=2, warmup=1, profile=True, compiled=args.compiled), 4
    else:
        from benchmarks.tp_worker import Job, worker

        job, world = Job(d=args.d, out=out, rounds=2, warmup=1, profile=True, compiled=args.compiled), args.d
    codes = spawn(worker, world, job)
    if codes != [0] * world:
        print(f"a rank failed: exit codes {codes}", file=sys.stderr)
        return 1
    with open(out) as f:
        result = json.load(f)
    for name, table in result["profiles"].items():
        print(f"== {name}\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
