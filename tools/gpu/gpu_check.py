"""Run on the GPU machine: nvtp's dumps through nvFuser, as users run them. Prints one line per case."""
import glob, os, sys, time, traceback
import torch
from nvtp import dump
from nvtp.dump import eager
from nvtp.execute import nvfuser as nvx

files = sys.argv[1:]
for path in files:
    text = open(path).read()
    try:
        d = dump.load(path)
        fusion = d.fusion
        t0 = time.perf_counter()
        fd = nvx.build_from_text(text, path)          # nvFuser builds the printed file itself
        inputs = dump.random_inputs(fusion, seed=0)
        prepared = nvx.prepare_inputs(fusion, inputs, torch.device("cuda"))
        outs = fd.execute(prepared)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        outs2 = fd.execute(prepared); torch.cuda.synchronize(); t2 = time.perf_counter()
        expected = eager.evaluate(fusion, inputs, seed=0)
        checks = dump.check_outputs(fusion, [o.cpu() for o in outs], expected, backend="nvfuser")
        bad = [f"{c.name}:{c.rel_error:.2e}>{c.tolerance:.0e}" for c in checks if not c.ok]
        skipped = [c.name for c in checks if getattr(c, "not_compared", None)]
        worst = max((c.rel_error for c in checks if not getattr(c, "not_compared", None)), default=0.0)
        print(f"TEXT {path}: {len(outs)} outputs, first run {t1-t0:.2f} s (build+compile+run), second {1e3*(t2-t1):.2f} ms; "
              f"worst rel err {worst:.2e} over {len(checks)-len(skipped)} compared, {len(skipped)} not compared; {'ALL OK' if not bad else 'FAIL ' + ' '.join(bad)}", flush=True)
    except Exception as e:
        print(f"TEXT {path}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
        traceback.print_exc(limit=3)
