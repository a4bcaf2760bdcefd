"""Calibrate the ``cpu-gloo`` machine model from measurements on this host, and rewrite its entry.

    python tools/calibrate.py                      # measure, fit, rewrite nvtp/sharding/cost.py's cpu-gloo entry
    python tools/calibrate.py --dry-run --out /tmp/calibration.json

What the cost model (``nvtp/sharding/cost.py``) charges, and what is measured here for it:

* an op: ``op_overhead`` + its FLOPs / ``flops`` (linear, matmul, attention) or the bytes it
  writes / ``memory`` (the rest). Measured with ``--devices`` processes running the same
  benchmarks at once, one torch thread each, as the ranks of a mesh run (on this 2-core host 4
  ranks share the cores, so a rank's rate is not one core's): ``torch.add`` of two fp32 tensors
  of 16 to 4M elements (the time against the bytes written: its intercept is the overhead, its
  slope 1 / ``memory``), then ``F.linear`` at nvtp's small shapes (the time less the overhead
  against 2 m n k: 1 / ``flops``). Fits weight each point by 1 / time (relative error).
* a collective: the link's latency + the bytes each rank sends with ring algorithms /
  bandwidth (``propagate.reshard_bytes``: an all-reduce 2 (n - 1) / n of the tensor, an
  all-gather or a reduce-scatter (n - 1) / n). Measured with gloo's calls as the reference
  backend makes them (``dist.all_reduce``, ``dist.all_gather`` and ``dist.reduce_scatter`` on
  lists of chunks), on 2 and on 4 processes, tensors of 1 KiB to 4 MiB, each after about a
  millisecond of the rank's own work (a matmul), as collectives run in a step: the time of work and
  collective less that of the work alone (a collective back to back with the next is faster than
  one whose peers are still computing: on a shared host its latency is mostly waiting for the
  peers to be scheduled), the slowest rank's median; each world measured ``--repeat`` times, the median
  of each point kept. Fitted: one bandwidth (cpu-gloo has one link) and a
  latency for each kind and group size (gloo's reduce_scatter on 4 ranks is much slower than on 2:
  ``kind_latency``; the median of them for a kind or size not measured) to the collectives measured in ``--devices`` processes, on groups of every size that
  divides it, all groups at once (a mesh axis's collectives run so: dp2's two groups while the
  other ranks are busy too); ``--worlds`` measures smaller worlds as well, reported beside the fit.

The load average is printed (the host is shared; a fit under load describes that load). The
entry is rewritten in place, its ``describe`` naming the date, the load and the fitted numbers;
``--dry-run`` prints the new entry instead.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import textwrap
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

COST = Path(__file__).resolve().parents[1] / "nvtp" / "sharding" / "cost.py"
ADD_SIZES = (16, 256, 4096, 65536, 1 << 20, 4 << 20)  # elements, fp32
LINEAR_SHAPES = ((128, 64, 64), (128, 64, 256), (128, 256, 64), (512, 256, 256), (1024, 256, 1024), (512, 512, 512))  # (m, k, n)
COLLECTIVE_SIZES = (256, 4096, 65536, 1 << 20)  # elements, fp32: 1 KiB .. 4 MiB
KINDS = ("allreduce", "allgather", "reduce_scatter")  # the kinds of nvtp.sharding.reshard.COLLECTIVES
POINT_TO_POINT = "sendrecv"  # measured in pairs, fitted for any ranks (ranks 0 in kind_latency)


def _per_call(fn, seconds: float = 0.15, rounds: int = 5) -> float:
    """The median over ``rounds`` of the mean time of ``fn()`` called back to back for about ``seconds``."""
    fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds / rounds or n < 3:
        fn()
        n += 1
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times)


def sent_bytes(kind: str, tensor_bytes: int, n: int) -> float:
    """Bytes each rank sends for ``kind`` of a tensor of ``tensor_bytes`` on ``n`` ranks, as the cost model counts them."""
    if kind == POINT_TO_POINT:
        return tensor_bytes
    return (2 if kind == "allreduce" else 1) * (n - 1) / n * tensor_bytes


def _collective(kind: str, elements: int, n: int, group):
    import torch.distributed as dist
    if kind == "sendrecv":  # a pipeline's step: ranks in pairs, the even one sends, the odd one receives
        t = torch.ones(elements)
        rank = dist.get_rank()
        peer = rank ^ 1
        return (lambda: dist.send(t, peer)) if rank % 2 == 0 else (lambda: dist.recv(t, peer))
    if kind == "allreduce":
        t = torch.ones(elements)
        return lambda: dist.all_reduce(t, group=group)
    if kind == "allgather":  # the tensor is the whole: each rank holds 1/n of it
        part = torch.ones(max(1, elements // n))
        parts = [torch.empty_like(part) for _ in range(n)]
        return lambda: dist.all_gather(parts, part, group=group)
    chunks = [torch.ones(max(1, elements // n)) for _ in range(n)]
    out = torch.empty_like(chunks[0])
    return lambda: dist.reduce_scatter(out, chunks, group=group)


def _worker(rank: int, world: int, init_method: str, compute: bool, out: str) -> None:
    import torch.distributed as dist

    from nvtp.execute.launch import init_group
    init_group(rank, world, init_method, timeout_s=300.0)
    torch.set_num_threads(1)
    got: dict = {"world": world, "add": [], "linear": [], "collectives": []}
    if compute:  # every rank at once, as a mesh's ranks share the host
        for n in ADD_SIZES:
            a, b = torch.rand(n), torch.rand(n)
            dist.barrier()
            got["add"].append((n * 4, _per_call(lambda: torch.add(a, b))))
        for m, k, n in LINEAR_SHAPES:
            x, w = torch.rand(m, k), torch.rand(n, k)
            dist.barrier()
            got["linear"].append((2 * m * k * n, m * n * 4, _per_call(lambda: F.linear(x, w))))
    x, w = torch.rand(256, 256), torch.rand(256, 256)

    def busy():  # about a millisecond of a rank's own work between two collectives, as in a step
        F.linear(x, w)

    def per_round(fn, reps: int = 4) -> float:
        times = []
        for _ in range(7):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - start) / reps)
        return statistics.median(times)

    for size in [g for g in range(2, world + 1) if world % g == 0]:  # groups of `size` ranks, all of them at once (a mesh axis's groups)
        group = None if size == world else dist.new_subgroups(group_size=size)[0]
        for kind in KINDS + ((POINT_TO_POINT,) if size == 2 else ()):
            for elements in COLLECTIVE_SIZES:
                fn = _collective(kind, elements, size, group)
                for _ in range(2):
                    fn()
                alone = per_round(busy)  # a collective's time in a step: with the work between, less the work alone
                both = per_round(lambda: (busy(), fn()))
                slowest = [None] * world
                dist.all_gather_object(slowest, max(both - alone, 1e-6))
                got["collectives"].append((kind, elements * 4, size, max(slowest)))
    rates = [None] * world
    dist.all_gather_object(rates, (got["add"], got["linear"]))
    if rank == 0:
        got["per_rank"] = rates
        torch.save(got, out)


def median_run(repeats: list[dict]) -> dict:
    """One run from several of one world: each measured time the median of its repeats (the host is shared)."""
    first = repeats[0]

    def med(path):
        return statistics.median(path(r) for r in repeats)
    out = {"world": first["world"], "repeats": len(repeats),
           "collectives": [(*c[:3], med(lambda r, i=i: r["collectives"][i][3])) for i, c in enumerate(first["collectives"])]}
    if "per_rank" in first:
        out["per_rank"] = [([(a[0], med(lambda r, k=k, i=i: r["per_rank"][k][0][i][1])) for i, a in enumerate(pr[0])],
                            [(b[0], b[1], med(lambda r, k=k, i=i: r["per_rank"][k][1][i][2])) for i, b in enumerate(pr[1])])
                           for k, pr in enumerate(first["per_rank"])]
        out["add"], out["linear"] = first["add"], first["linear"]
    return out


def _weighted_line(xs, ys) -> tuple[float, float]:
    """(intercept, slope) of y = a + b x, least squares weighted by 1 / y (relative error)."""
    w = [1 / y ** 2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return (sy - slope * sx) / sw, slope


def _kind_lines(points) -> tuple[dict[tuple[str, int], float], float]:
    """({(kind, ranks): latency}, seconds a byte): t = the latency of its kind on its group's ranks + sent bytes
    x one slope for all, least squares weighted by 1 / t; a latency is at least 1 us and the slope positive."""
    kinds = sorted({(p[2], p[4]) for p in points})
    # normal equations of [one intercept a kind, the slope]
    n = len(kinds) + 1
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for sent, t, kind, _, ranks in points:
        row = [0.0] * n
        row[kinds.index((kind, ranks))], row[-1] = 1.0, sent
        w = 1 / t ** 2
        for i in range(n):
            b[i] += w * row[i] * t
            for j in range(n):
                a[i][j] += w * row[i] * row[j]
    x = torch.linalg.solve(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)).tolist()
    return {k: max(x[i], 1e-6) for i, k in enumerate(kinds)}, max(x[-1], 1e-12)


def fit(runs: list[dict], devices: int) -> dict:
    """The machine's constants from the measurements: op overhead and memory rate from the adds,
    matmul rate from the linears (less the overhead), a link's bandwidth and latency from every
    collective on every world size. Ranks' medians are taken per size."""
    main = next(r for r in runs if r["world"] == devices)
    adds = [(size, statistics.median(pr[0][i][1] for pr in main["per_rank"])) for i, (size, _) in enumerate(main["add"])]
    overhead, per_byte = _weighted_line([s for s, _ in adds], [t for _, t in adds])
    overhead = max(overhead, 0.0)
    linears = [(flop, statistics.median(pr[1][i][2] for pr in main["per_rank"])) for i, (flop, _, _) in enumerate(main["linear"])]
    ws = [1 / t ** 2 for _, t in linears]
    seconds_per_flop = sum(w * f * (t - overhead) for w, (f, t) in zip(ws, linears)) / sum(w * f * f for w, (f, _) in zip(ws, linears))
    points = [(sent_bytes(kind, nbytes, n), t, kind, nbytes, n) for kind, nbytes, n, t in main["collectives"]]
    latencies, per_sent_byte = _kind_lines(points)
    latency = statistics.median(latencies.values())  # for a kind or group size not measured
    machine = {"flops": 1 / seconds_per_flop, "memory": 1 / per_byte, "op_overhead": overhead,
               "bandwidth": 1 / per_sent_byte, "latency": latency, "kind_latency": latencies}
    machine["checks"] = {
        "add": [(s, t, overhead + s * per_byte) for s, t in adds],
        "linear": [(f, t, overhead + f * seconds_per_flop) for f, t in linears],
        "collectives": [(kind, nbytes, n, t, latencies[kind, n] + sent * per_sent_byte) for sent, t, kind, nbytes, n in points],
        "other worlds": [(r["world"], kind, nbytes, n, t, latencies.get((kind, n), latency) + sent_bytes(kind, nbytes, n) * per_sent_byte)
                         for r in runs if r is not main for kind, nbytes, n, t in r["collectives"]],
    }
    return machine


def entry(m: dict, load: tuple[float, float], devices: int, date: str | None = None) -> str:
    """The ``Machine("cpu-gloo", ...)`` call for ``m`` (``fit``'s constants), its description naming how (and when) it was measured."""
    date = date or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    describe = (f"CPU processes on one host, one torch thread a rank, gloo over loopback; calibrated by tools/calibrate.py "
                f"{date} with {devices} ranks at once on {os.cpu_count()} cores (load {load[0]:.1f}-{load[1]:.1f}): "
                f"{m['flops'] / 1e9:.1f} GFLOP/s a rank (F.linear), {m['memory'] / 1e9:.2f} GB/s written (torch.add), "
                f"{m['op_overhead'] * 1e6:.1f} us an op, collectives' latency "
                + ", ".join(f"{k} on {n} {v * 1e6:.0f} us" for (k, n), v in sorted(m["kind_latency"].items()))
                + f" (else {m['latency'] * 1e6:.0f} us) + bytes sent at "
                f"{m['bandwidth'] / 1e9:.2f} GB/s (groups of 2 and {devices} in {devices} processes)")
    describe = "\n".join(repr(line) for line in textwrap.wrap(describe, 104, drop_whitespace=False))
    link = f"({m['bandwidth']:.4g}, {m['latency']:.4g})"
    kinds = ",\n                          ".join(f"({k!r}, {0 if k == POINT_TO_POINT else n}, {v:.4g})"
                                             for (k, n), v in sorted(m["kind_latency"].items()))
    return (f'Machine("cpu-gloo", flops={m["flops"]:.4g}, memory={m["memory"]:.4g}, intra={link}, inter={link}, devices_per_node=1024,\n'
            f'            describe=' + describe.replace("\n", "\n                     ") + ',\n'
            f'            block_overhead={m["op_overhead"]:.4g}, op_overhead={m["op_overhead"]:.4g}, memory_per_device=20e9,\n'
            f'            kind_latency=({kinds}))')


def rewrite(source: str, new_entry: str) -> str:
    """``source`` (cost.py's text) with the ``Machine("cpu-gloo", ...)`` call replaced by ``new_entry``."""
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Machine"
             and n.args and isinstance(n.args[0], ast.Constant) and n.args[0].value == "cpu-gloo"]
    if len(calls) != 1:
        raise SystemExit(f"{COST}: expected one Machine(\"cpu-gloo\", ...) call, found {len(calls)}")
    lines = source.splitlines(keepends=True)
    c = calls[0]
    start = sum(len(x) for x in lines[:c.lineno - 1]) + c.col_offset
    end = sum(len(x) for x in lines[:c.end_lineno - 1]) + c.end_col_offset
    return source[:start] + new_entry + source[end:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=4, help="ranks running the compute benchmarks at once (the mesh's size you plan for)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="gloo world sizes to measure collectives on")
    p.add_argument("--repeat", type=int, default=3, help="measure each world this many times; each point's median is fitted")
    p.add_argument("--dry-run", action="store_true", help="print the new entry; do not rewrite cost.py")
    p.add_argument("--out", default=None, help="write the measurements and the fit as JSON here")
    p.add_argument("--refit", default=None, metavar="FILE", help="no measuring: fit the measurements of an earlier --out FILE")
    args = p.parse_args(argv)
    from nvtp.execute.launch import spawn

    if args.refit:
        old = json.loads(Path(args.refit).read_text())
        m = fit(old["runs"], args.devices)
        new = entry(m, tuple(old["load"]), args.devices, old.get("date"))
        print(new)
        if not args.dry_run:
            COST.write_text(rewrite(COST.read_text(), new))
            print(f"rewrote the cpu-gloo entry of {COST}")
        return 0
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

    load_before = os.getloadavg()[0]
    runs = []
    tmp = Path(f"/tmp/calibrate_{os.getpid()}.pt")
    for world in sorted(set(args.worlds) | {args.devices}):
        repeats = []
        for _ in range(args.repeat):
            codes = spawn(_worker, world, world == args.devices, str(tmp))
            if list(codes) != [0] * world:
                print(f"the measurement on {world} processes failed: exit codes {list(codes)}", file=sys.stderr)
                return 1
            repeats.append(torch.load(tmp, weights_only=False))
        runs.append(median_run(repeats))
    tmp.unlink(missing_ok=True)
    load = (load_before, os.getloadavg()[0])
    m = fit(runs, args.devices)
    c = m["checks"]
    print("torch.add, bytes written: measured us / fitted us: " + ", ".join(f"{s}: {t * 1e6:.1f}/{f * 1e6:.1f}" for s, t, f in c["add"]))
    print("F.linear, FLOPs: measured us / fitted us: " + ", ".join(f"{fl:.3g}: {t * 1e6:.1f}/{f * 1e6:.1f}" for fl, t, f in c["linear"]))
    print(f"collectives on {args.devices} processes (fitted), by group size:")
    for kind, nbytes, n, t, f in c["collectives"]:
        print(f"  {kind:<13} {nbytes:>8} B on {n}: measured {t * 1e6:8.1f} us, fitted {f * 1e6:8.1f} us ({f / t:.2f}x)")
    for world, kind, nbytes, n, t, f in c["other worlds"]:
        print(f"  (not fitted: {world} processes) {kind:<13} {nbytes:>8} B on {n}: measured {t * 1e6:8.1f} us, the fit {f * 1e6:8.1f} us")
    new = entry(m, load, args.devices, date)
    print(f"\nload average {load[0]:.1f} before, {load[1]:.1f} after ({os.cpu_count()} cores)\n{new}")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": date, "runs": runs, "fit": m | {"kind_latency": [[*k, v] for k, v in m["kind_latency"].items()]}, "load": load, "entry": new}, indent=1, default=str))
    if not args.dry_run:
        COST.write_text(rewrite(COST.read_text(), new))
        print(f"rewrote the cpu-gloo entry of {COST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
