"""What the proof of a splice and the first-call check cost, for docs/splicing.md and docs/usage.md.

    .venv/bin/python tools/verify_cost.py                 # nvtp's GPT at GPT-2 small's width, 12 layers, sequence 256
    .venv/bin/python tools/verify_cost.py --layers 4 --embd 256 --seq 128

Each setting runs in a fresh process (peak memory is the process's): ``nvtp.jit(GPT(cfg),
mesh=1)`` compiled, then three SGD steps, with ``verify=True`` and ``verify=False``; printed: the
compile, the first step (which runs the check when verify is on), the later steps, the check's own
seconds (``nvtp.guard.outcomes``), the peak resident memory of the process, and the seconds of the
run on fake tensors that proves the blocks alike (``nvtp.frontend.variants.record``) against the
whole compile.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(verify: bool, layers: int, embd: int, seq: int) -> dict:
    import torch

    import nvtp
    from nvtp import guard
    from nvtp.driver import meta_copy
    from nvtp.frontend.blocks import find_repeated
    from nvtp.frontend.variants import record
    from nvtp.models import gpt

    cfg = gpt.config("gpt2", n_layer=layers, n_embd=embd, n_head=max(1, embd // 64), seq_len=seq, dropout=0.0, batch=1)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    idx, tgt = gpt.example_tokens(cfg)
    meta = meta_copy(model)
    start = time.perf_counter()
    record(meta, find_repeated(meta), (idx.to("meta"), tgt.to("meta")), {})
    proof = time.perf_counter() - start
    sm = nvtp.jit(model, plan="megatron", mesh=1, verify=verify)
    opt = torch.optim.SGD(sm.module.parameters(), lr=0.1)
    start = time.perf_counter()
    sm.compile(idx, tgt)
    compile_s = time.perf_counter() - start
    steps = []
    for _ in range(3):
        start = time.perf_counter()
        opt.zero_grad()
        sm(idx, tgt).backward()
        opt.step()
        steps.append(time.perf_counter() - start)
    checks = guard.outcomes(sm)
    return {"verify": verify, "compile": compile_s, "steps": steps, "check": checks[0].seconds if checks else 0.0,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "proof": proof, "how": sm.last.traced.how}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.one:
        print(json.dumps(one(a.one == "on", a.layers, a.embd, a.seq)))
        return
    for setting in ("off", "on", "off", "on"):
        out = subprocess.run([sys.executable, __file__, "--one", setting, "--layers", str(a.layers), "--embd", str(a.embd),
                              "--seq", str(a.seq)], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        print(f"verify={str(r['verify']):5}  compile {r['compile']:.1f} s  steps {', '.join(f'{s:.2f}' for s in r['steps'])} s  "
              f"check {r['check']:.2f} s  peak {r['peak_mb']:.0f} MB  proof {r['proof']:.2f} s  ({r['how'][:60]})", flush=True)


if __name__ == "__main__":
    main()
