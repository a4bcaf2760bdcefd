"""Compile time at depth, for docs/benchmarks.md: nvtp explain (regional) beside plain thunder.jit.

    .venv/bin/python tools/scale_figures.py --layers 1 12 96 [--skip-thunder-above 12]

Each figure is one fresh process, timed from outside as a user would time it (wall seconds, and
the peak RSS of that process): ``nvtp explain --model nanogpt --config gpt3 --layers L --plan
megatron --devices 8 --json``, and ``thunder.jit(GPT)`` called once on meta tensors (tracing only:
meta tensors compute nothing) with Thunder's default executors.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

THUNDER = """
import sys, torch, thunder
from dataclasses import replace
from nvtp.models import gpt
cfg = replace(gpt.config("gpt3"), n_layer=int(sys.argv[1]))
with torch.device("meta"):
    model = gpt.GPT(cfg).to(torch.bfloat16)
idx = torch.zeros(cfg.batch, cfg.seq_len, dtype=torch.long, device="meta")
thunder.jit(model)(idx, idx)
"""


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one child process, by GNU time."""
    out = subprocess.run(["/usr/bin/time", "-f", "NVTP_TIME %e %M", *cmd], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    line = next(x for x in reversed(out.stderr.splitlines()) if x.startswith("NVTP_TIME "))
    seconds, kib = line.split()[1:]
    return float(seconds), int(kib) / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[1, 12, 96])
    p.add_argument("--skip-thunder-above", type=int, default=10**9, help="skip thunder.jit above this depth (minutes each)")
    args = p.parse_args()
    rows = []
    for layers in args.layers:
        nvtp_s, nvtp_rss = timed([sys.executable, "-m", "nvtp", "explain", "--model", "nanogpt", "--config", "gpt3", "--layers",
                                  str(layers), "--plan", "megatron", "--devices", "8", "--json"])
        row = {"layers": layers, "nvtp_explain_s": round(nvtp_s, 1), "nvtp_explain_peak_rss_mib": round(nvtp_rss)}
        if layers <= args.skip_thunder_above:
            thunder_s, _ = timed([sys.executable, "-c", THUNDER, str(layers)])
            row["thunder_jit_s"] = round(thunder_s, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
