"""Predicted against measured: ``plan="auto"``'s candidates run on a local gloo mesh, their step times ranked both ways.

    python tools/auto_measure.py --devices 4 --layers 4 --batch 8 --steps 6 --out /tmp/auto_measure.json
    python tools/auto_measure.py --candidates "dp4" "tp4 megatron" "pp2 dp2 microbatches=2 schedule=1f1b"

The planner (``nvtp.auto.search``) costs every candidate for nvtp's GPT (``--config``, ``--layers``,
the whole ``--batch``) on ``--devices`` CPU processes (the ``cpu-gloo`` machine model). This tool
then runs a few of them (``--candidates``, by their table text; default: a spread of the ranked
list, from the fastest to the slowest, one per layout) on that many gloo processes, each through
``nvtp.auto.runtime.AutoModule`` as ``nvtp.jit(plan="auto")`` would run it: the whole batch on
every rank, AdamW (``--optimizer``), ``--warmup`` steps (the first compiles) then ``--steps`` timed ones between
barriers (the median taken), then one more step under torch's memory profiler (each rank's peak of
live tensor bytes). It prints predicted and measured times and peak memory side by side, the Spearman rank
correlation, and whether the plan auto picks is measured within 10 % of the fastest measured; the
losses of every candidate must agree (they train the same model on the same batch). With
``--name-peak`` it also says what is alive at each candidate's measured peak: the values of each
fusion (forward, backward) and their collectives' buffers, named by the value whose op made each
allocation, and what was allocated outside nvtp's programs.

The processes of one mesh share this machine's cores: compare the times as a ranking, measured
in one run, never as absolute numbers; and say how loaded the machine was (printed: the load
average before and after).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from nvtp.auto import Candidate, search  # noqa: E402
from nvtp.execute import reference  # noqa: E402
from nvtp.models import gpt  # noqa: E402


def _cfg(args) -> gpt.GPTConfig:
    if args.family != "gpt":
        size = {"num_hidden_layers": args.layers} | ({"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden} if args.hidden else {})
        return {"family": args.family, "overrides": size, "batch": args.batch}
    cfg = replace(gpt.config(args.config, n_layer=args.layers), batch=args.batch)
    return replace(cfg, n_embd=args.hidden) if getattr(args, "hidden", None) else cfg


def _model(cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    if isinstance(cfg, dict):  # a transformers family (nvtp.models.hf), e.g. Llama from a tiny config
        from nvtp.models import hf
        config_cls, model_cls, kwargs = hf.CONFIGS[cfg["family"]]
        transformers = hf._transformers()
        config = getattr(transformers, config_cls)(**(kwargs | cfg["overrides"]), use_cache=False, bos_token_id=0, eos_token_id=0)
        return getattr(transformers, model_cls)(config)
    return gpt.GPT(cfg)


def _call(cfg) -> tuple[tuple, dict]:
    """The whole batch's call: nvtp's GPT (idx, targets); a transformers model (ids, labels=ids)."""
    if isinstance(cfg, dict):
        ids = torch.randint(0, 256, (cfg["batch"], 16), generator=torch.Generator().manual_seed(0))
        return (ids,), {"labels": ids}
    return gpt.example_tokens(cfg), {}


def _loss(out):
    if hasattr(out, "loss"):
        return out.loss
    return out[1] if isinstance(out, tuple) else out


def name_values() -> None:
    """From now on, each op of the reference backend's lowered modules runs under
    ``record_function("v:<fusion>:<value>")`` (its fx node is named after the value it makes), so
    ``peak_live_bytes(..., named=...)`` can say which values are alive at the fullest moment."""
    lower = reference.lower_fusion

    def wrap(target, name):
        @functools.wraps(target)
        def run(*a, **k):
            with torch.profiler.record_function(name):
                return target(*a, **k)
        return run

    def lower_fusion(fusion, *a, **k):
        lowered = lower(fusion, *a, **k)
        for node in lowered.module.graph.nodes:
            if node.op == "call_function":
                node.target = wrap(node.target, f"v:{fusion.name}:{node.name}")
        lowered.module.recompile()
        return lowered
    reference.lower_fusion = lower_fusion


def _owner(n) -> str:
    """What made an allocation: ``<fusion>`` (a value of it), ``<fusion> collective start``, or the op path outside any fusion."""
    p, path = n.parent, []
    while p is not None:
        if p.name.startswith("v:"):
            _, fusion, value = p.name.split(":", 2)
            return f"{fusion} collective start" if value.startswith("start_") else fusion
        path.append(p.name)
        p = p.parent
    return "outside: " + " < ".join(path[:4])


def _kept_buffers() -> list[torch.Tensor]:
    """The buffers nvtp's lowered programs in this process keep between steps (a backward's
    gradient buckets, ``reference.kept_buckets``): allocated before a step and reused in it, so
    the step's profile never sees them."""
    from nvtp.execute import reference

    out = []
    for entries in list(reference._CACHE.values()):
        for e in entries:
            f = e.fusion()
            if f is not None:
                out += [b.buffer for b in reference.kept_buckets(f) if b.buffer is not None]
    return out


def peak_live_bytes(step, held, named: dict | None = None) -> tuple[int, int]:
    """(peak, start): the bytes of CPU tensors alive at the fullest moment of ``step()``, and at its
    start: the distinct storages of the tensors ``held`` (the parameters' parts, the optimizer's
    state, the inputs, nvtp's kept gradient buckets: the step must free none of them) plus the largest running sum of the
    allocations and frees torch's profiler records during the step (``profile_memory``).
    ``named`` (after ``name_values()``) receives the bytes alive at that moment by what made them."""
    from torch.profiler import ProfilerActivity, profile

    seen, start = set(), 0
    for t in held:
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            start += storage.nbytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)

    allocations = [n for n in walk(prof.profiler.kineto_results.experimental_event_tree())
                   if type(n.extra_fields).__name__ == "_ExtraFields_Allocation" and n.extra_fields.device.type == "cpu"]
    live = peak = 0
    alive: dict[int, tuple[int, Any]] = {}
    at_peak: dict[int, tuple[int, Any]] = {}
    for n in sorted(allocations, key=lambda n: (n.start_time_ns, n.extra_fields.alloc_size > 0)):  # a free before an allocation at one instant
        live += n.extra_fields.alloc_size
        if named is not None:
            if n.extra_fields.alloc_size > 0:
                alive[n.extra_fields.ptr] = (n.extra_fields.alloc_size, n)
            else:
                alive.pop(n.extra_fields.ptr, None)
        if live > peak:
            peak = live
            at_peak = dict(alive) if named is not None else at_peak
    if named is not None:
        for size, n in at_peak.values():
            named[_owner(n)] = named.get(_owner(n), 0) + size
    return start + peak, start


def _worker(rank, world, init_method, cfg, extents, options, warmup, steps, out, optimizer="adamw", name_peak=False):
    import torch.distributed as dist

    from nvtp.auto.runtime import AutoModule
    from nvtp.execute.launch import init_group

    if name_peak:
        name_values()

    init_group(rank, world, init_method, timeout_s=600.0)
    torch.set_num_threads(1)
    model = _model(cfg)
    sm = AutoModule(model, world, candidate=Candidate(tuple(extents), tuple(options)), timeout=600.0)
    opt = (torch.optim.AdamW(sm.parameters(), lr=1e-3) if optimizer == "adamw"  # Adam's state: what the planner counts
           else torch.optim.SGD(sm.parameters(), lr=0.1))
    whole, kw = _call(cfg)
    times, losses = [], []

    def step():
        loss = _loss(sm(*whole, **kw))
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        loss = step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    opt.zero_grad()  # the gradients freed before the profiled step (a free of an older block has no size in the profile)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    named = {} if name_peak else None
    kept = _kept_buffers()  # nvtp's gradient buckets, kept between steps (nvtp/execute/buckets.py): held at the start too
    peak, held = peak_live_bytes(step, [*sm.parameters(), *state, *whole, *kept], named)  # one more step, profiled: each rank's own
    peaks = [None] * world
    dist.all_gather_object(peaks, (peak, held, named))
    if rank == 0:
        torch.save({"times": times, "losses": losses, "peaks": peaks}, out)


def _interleaved_worker(rank, world, init_method, cfg, candidates, warmup, rounds, out):
    """Every candidate built in these processes, then ``rounds`` rounds of one step of each, in an
    order rotated each round (so none always runs first after another's), between barriers."""
    import torch.distributed as dist

    from nvtp.auto.runtime import AutoModule
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method, timeout_s=900.0)
    torch.set_num_threads(1)
    whole, kw = _call(cfg)
    built = []
    for extents, options in candidates:
        sm = AutoModule(_model(cfg), world, candidate=Candidate(tuple(extents), tuple(options)), timeout=900.0)
        opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
        built.append((sm, opt))
    times = [[] for _ in built]
    losses = [[] for _ in built]

    def step(i):
        sm, opt = built[i]
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        loss = _loss(sm(*whole, **kw))
        loss.backward()
        opt.step()
        dist.barrier()
        return time.perf_counter() - start, loss.item()

    for i in range(len(built)):  # the first calls compile
        for _ in range(warmup):
            step(i)
    for r in range(rounds):
        for k in range(len(built)):
            i = (k + r) % len(built)
            took, loss = step(i)
            times[i].append(took)
            losses[i].append(loss)
    if rank == 0:
        torch.save({"times": times, "losses": losses}, out)


def interleaved(args, cfg, choice, runs) -> list[dict]:
    """``runs`` measured in one set of processes, interleaved (``_interleaved_worker``): each one's
    median step, its spread (the lowest and highest step), predicted beside it."""
    from nvtp.execute.launch import spawn
    tmp = Path(f"/tmp/auto_measure_{os.getpid()}.pt")
    codes = spawn(_interleaved_worker, args.devices, cfg, [(list(c.candidate.extents), list(c.candidate.options)) for c in runs],
                  args.warmup, args.interleave, str(tmp))
    if list(codes) != [0] * args.devices:
        print(f"the interleaved run failed, exit codes {list(codes)}", flush=True)
        return []
    got = torch.load(tmp, weights_only=False)
    tmp.unlink(missing_ok=True)
    rows = []
    for c, times, losses in zip(runs, got["times"], got["losses"]):
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        rows.append({"candidate": c.candidate.text(), "predicted_s": c.seconds, "measured_s": statistics.median(times),
                     "times": times, "quartiles": [q[0], q[2]], "losses": losses})
        print(f"{c.candidate.text():<48} predicted {c.seconds * 1e3:8.2f} ms   measured median {statistics.median(times) * 1e3:8.2f} ms "
              f"(quartiles {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f}, {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} ms over {len(times)} rounds)",
              flush=True)
    return rows


def repredict(args, cfg, path: str) -> int:
    """The measured times of an earlier ``--out`` file beside the planner's predictions now (after a
    calibration, say): the Spearman correlation and auto's pick, with the same measurements."""
    old = json.loads(Path(path).read_text())
    call, kw = _call(cfg)
    choice = search(_model(cfg), call, kw, devices=args.devices)
    by_text = {c.candidate.text(): c for c in choice.ranked}
    ok = [r for r in old["rows"] if "measured_s" in r and r["candidate"] in by_text]
    for r in ok:
        r["predicted_before_s"], r["predicted_s"] = r["predicted_s"], by_text[r["candidate"]].seconds
        print(f"{r['candidate']:<48} predicted {r['predicted_s'] * 1e3:8.2f} ms (was {r['predicted_before_s'] * 1e3:8.2f})   "
              f"measured {r['measured_s'] * 1e3:8.2f} ms", flush=True)
    rho = spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])
    before = spearman([r["predicted_before_s"] for r in ok], [r["measured_s"] for r in ok])
    fastest = min(ok, key=lambda r: r["measured_s"])
    best = next((r for r in ok if r["candidate"] == choice.best.candidate.text()), None)
    print(f"\nSpearman rank correlation, predicted vs measured ({len(ok)} candidates): {rho:.2f} now, {before:.2f} with {path}'s predictions")
    print(f"auto's choice now: {choice.best.candidate.text()}, " + (
        f"measured {best['measured_s'] / fastest['measured_s']:.2f}x the fastest measured ({fastest['candidate']})" if best
        else "not among the measured candidates"))
    print(f"auto's choice then: {old['chosen']}, measured {old['chosen_vs_fastest']:.2f}x the fastest")
    return 0


def spread(ranked, count: int) -> list:
    """Up to ``count`` candidates from the ranked list, fastest to slowest, one per layout (mesh
    and plan), as evenly spaced as the list allows; pipelines and cp need processes (no threads)."""
    seen, picked = set(), []
    step = max(1, len(ranked) // count)
    for c in ranked[::step] + ranked:
        key = (c.candidate.extents, c.candidate.opts.get("plan"))
        if key in seen:
            continue
        seen.add(key)
        picked.append(c)
        if len(picked) == count:
            break
    return sorted(picked, key=lambda c: c.seconds)


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return float("nan")
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--family", default="gpt", help="gpt (nvtp's GPT), or a transformers family of nvtp.models.hf (llama, ...) from its tiny config")
    p.add_argument("--config", default="tiny")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=None, help="the hidden size (n_embd; default: the config's)")
    p.add_argument("--batch", type=int, default=8, help="the whole step's batch (every rank passes it)")
    p.add_argument("--count", type=int, default=6, help="how many candidates to run (default 6)")
    p.add_argument("--candidates", nargs="*", default=None, help="run these (their text in the table) instead")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="adamw: the state the planner's memory counts")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--name-peak", action="store_true", help="say what is alive at each candidate's measured peak: the values of "
                   "each fusion (forward, backward), its collectives' buffers, allocations outside nvtp's programs")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="measure the candidates in one set of processes, one step of each per round, ROUNDS rounds "
                        "(their medians and spread; no memory profile)")
    p.add_argument("--repredict", default=None, metavar="FILE",
                   help="no run: the measured times in FILE (an earlier --out) beside the planner's predictions now")
    args = p.parse_args(argv)
    from nvtp.execute.launch import spawn

    load_before = os.getloadavg()
    cfg = _cfg(args)
    if args.repredict:
        return repredict(args, cfg, args.repredict)
    t0 = time.perf_counter()
    call, kw = _call(cfg)
    choice = search(_model(cfg), call, kw, devices=args.devices)
    planned = time.perf_counter() - t0
    print(choice.as_text(top=12), flush=True)
    if args.candidates:
        by_text = {c.candidate.text(): c for c in choice.ranked}
        missing = [t for t in args.candidates if t not in by_text]
        if missing:
            print(f"not among the candidates that fit: {missing}; the table's texts are: {sorted(by_text)}", file=sys.stderr)
            return 2
        runs = sorted((by_text[t] for t in args.candidates), key=lambda c: c.seconds)
    else:
        runs = spread(choice.ranked, args.count)
        if choice.best not in runs:
            runs = [choice.best] + runs[:-1]
    rows = interleaved(args, cfg, choice, runs) if args.interleave else []
    tmp = Path(f"/tmp/auto_measure_{os.getpid()}.pt")
    for c in ([] if args.interleave else runs):
        start = time.perf_counter()
        codes = spawn(_worker, args.devices, cfg, list(c.candidate.extents), list(c.candidate.options), args.warmup, args.steps, str(tmp),
                      args.optimizer, args.name_peak)
        wall = time.perf_counter() - start
        if list(codes) != [0] * args.devices:
            print(f"{c.candidate.text()}: the run failed, exit codes {list(codes)}", flush=True)
            rows.append({"candidate": c.candidate.text(), "predicted_s": c.seconds, "failed": list(codes)})
            continue
        got = torch.load(tmp, weights_only=False)
        measured = statistics.median(got["times"][args.warmup:])
        peak = max(p for p, _, _ in got["peaks"])  # the fullest rank, as the planner predicts the fullest stage
        rows.append({"candidate": c.candidate.text(), "predicted_s": c.seconds, "measured_s": measured,
                     "first_step_s": got["times"][0], "losses": got["losses"], "wall_s": wall,
                     "predicted_memory": dict(c.memory), "measured_peak_bytes": peak, "peaks": got["peaks"]})
        print(f"{c.candidate.text():<48} predicted {c.seconds * 1e3:8.2f} ms   measured {measured * 1e3:8.2f} ms "
              f"(first step {got['times'][0]:.1f} s; losses {got['losses'][0]:.6f} .. {got['losses'][-1]:.6f})", flush=True)
        print(f"{'':<48} memory: predicted {c.memory['total'] / 2**20:8.2f} MiB   measured peak {peak / 2**20:8.2f} MiB "
              f"({c.memory['total'] / peak:.2f}x; per rank {', '.join(f'{p / 2**20:.2f}' for p, _, _ in got['peaks'])}; "
              f"predicted {', '.join(f'{k} {v / 2**20:.2f}' for k, v in c.memory.items() if k != 'total')})", flush=True)
        if args.name_peak:  # the fullest rank's bytes alive at its peak, beyond what it held at the step's start, by what made them
            p, held, named = max(got["peaks"], key=lambda x: x[0])
            print(f"{'':<48} at the fullest rank's peak: held at the start {held / 2**20:.3f} MiB; then alive: "
                  + ", ".join(f"{k} {v / 2**20:.3f}" for k, v in sorted(named.items(), key=lambda kv: -kv[1]) if v >= 1024), flush=True)
    tmp.unlink(missing_ok=True)
    ok = [r for r in rows if "measured_s" in r]
    rho = spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])
    fastest = min(ok, key=lambda r: r["measured_s"]) if ok else None
    best = next((r for r in ok if r["candidate"] == choice.best.candidate.text()), None)
    within = best["measured_s"] / fastest["measured_s"] if best and fastest else float("nan")
    spread_losses = max(abs(r["losses"][0] - ok[0]["losses"][0]) for r in ok) if ok else float("nan")
    load_after = os.getloadavg()
    print(f"\nSpearman rank correlation, predicted vs measured ({len(ok)} candidates): {rho:.2f}")
    print(f"auto's choice {choice.best.candidate.text()}: measured {within:.2f}x the fastest measured "
          f"({fastest['candidate'] if fastest else '-'})" + (" (within 10 %)" if within <= 1.10 else " (NOT within 10 %)"))
    print(f"first losses agree across candidates within {spread_losses:.2e}")
    ratios = [r["predicted_memory"]["total"] / r["measured_peak_bytes"] for r in ok if "measured_peak_bytes" in r]
    if ratios:
        print(f"predicted / measured peak memory per rank: {', '.join(f'{x:.2f}' for x in ratios)} "
              f"({sum(abs(x - 1) <= 0.15 for x in ratios)} of {len(ratios)} within 15 %)")
    print(f"planning took {planned:.1f} s; load average before {load_before[0]:.1f}, after {load_after[0]:.1f} "
          f"({os.cpu_count()} cores)")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
                                              "rows": rows, "spearman": rho, "chosen": choice.best.candidate.text(),
                                              "chosen_vs_fastest": within, "load_before": load_before, "load_after": load_after,
                                              "planning_s": planned}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
