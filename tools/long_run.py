"""A long training run with a killed rank: memory stays flat, the mesh stops, nothing is lost.

    .venv/bin/python tools/long_run.py                      # 500 steps, d = 2, kill rank 1 at step 250
    .venv/bin/python tools/long_run.py --steps 40 --kill-at 20 --save-every 10    # the test's short version

Three runs of the small sharded GPT (``nvtp.demo.TrainJob``, plan megatron, SGD) on a local CPU mesh:

1. uninterrupted: every step's loss, and each rank's resident memory (VmRSS) every step;
2. killed: checkpoints every ``--save-every`` steps; once rank 0 has logged step ``--kill-at``,
   this tool sends SIGKILL to rank 1 and measures how long the other ranks take to stop, and
   checks that they name rank 1;
3. resumed: from the newest whole checkpoint of run 2, to the end.

It checks that the resumed losses equal the uninterrupted ones bit for bit, prints a report
(``--json FILE`` writes it as JSON) and exits 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nvtp.demo import TrainJob, train_worker  # noqa: E402
from nvtp.execute.launch import spawn  # noqa: E402


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def job_for(args, out: Path, name: str, **extra) -> TrainJob:
    (out / name).mkdir(parents=True, exist_ok=True)
    return TrainJob("tiny", "megatron", args.steps, 0.1, str(out / name / "result.pt"), verbose=False, timeout=args.timeout,
                    log_dir=str(out / name), **extra)


def run_uninterrupted(args, out: Path) -> dict:
    job = job_for(args, out, "full")
    start = time.perf_counter()
    codes = spawn(train_worker, args.devices, job)
    seconds = time.perf_counter() - start
    logs = [read_log(out / "full" / f"rank{r}.jsonl") for r in range(args.devices)]
    return {"codes": list(codes), "seconds": seconds, "logs": logs}


def run_killed(args, out: Path) -> dict:
    job = job_for(args, out, "killed", save_every=args.save_every, save_dir=str(out / "ckpt"))
    log0 = out / "killed" / "rank0.jsonl"
    stderr_path = out / "killed" / "stderr.txt"
    killed: dict = {}

    def killer():
        while not killed.get("stop"):
            steps = read_log(log0)
            if steps and steps[-1]["step"] >= args.kill_at:
                victim = next((p for p in multiprocessing.active_children() if p.name == f"nvtp-rank{args.victim}"), None)
                if victim is not None and victim.pid:
                    killed.update(step=steps[-1]["step"], pid=victim.pid, at=time.perf_counter())
                    os.kill(victim.pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=killer, daemon=True)
    # The ranks inherit this process's stderr: catch what they print in a file.
    sys.stderr.flush()
    saved = os.dup(2)
    with open(stderr_path, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            thread.start()
            start = time.perf_counter()
            codes = spawn(train_worker, args.devices, job)
            end = time.perf_counter()
        finally:
            killed["stop"] = True
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
    thread.join()
    text = stderr_path.read_text()
    sys.stderr.write(text)
    return {"codes": list(codes), "seconds": end - start, "killed_at_step": killed.get("step"),
            "stop_seconds": (end - killed["at"]) if "at" in killed else None, "stderr": text,
            "first_failure": str(codes.first_failure) if codes.first_failure else None,
            "cause": str(codes.cause) if codes.cause else None}


def run_resumed(args, out: Path) -> dict:
    job = job_for(args, out, "resumed", load_dir=str(out / "ckpt"))
    start = time.perf_counter()
    codes = spawn(train_worker, args.devices, job)
    seconds = time.perf_counter() - start
    return {"codes": list(codes), "seconds": seconds, "logs": [read_log(out / "resumed" / f"rank{r}.jsonl") for r in range(args.devices)]}


def rss_summary(logs: list[list[dict]], every: int, warmup: int) -> dict:
    """Per rank: VmRSS (MiB) every ``every`` steps, and the growth from step ``warmup`` to the end."""
    per_rank = []
    for r, log in enumerate(logs):
        by_step = {e["step"]: e["rss_kib"] for e in log}
        if not by_step:
            continue
        last = max(by_step)
        samples = {s: round(by_step[s] / 1024, 1) for s in sorted(by_step) if s == 1 or s % every == 0 or s == last}
        base = by_step.get(warmup, by_step[min(by_step)])
        after = [v for s, v in by_step.items() if s >= warmup]
        per_rank.append({"rank": r, "rss_mib": samples, "from_step": warmup, "growth_kib": by_step[last] - base,
                         "max_minus_min_kib_after_warmup": max(after) - min(after)})
    return {"ranks": per_rank}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=250, help="kill a rank once rank 0 has logged this step")
    p.add_argument("--victim", type=int, default=1, help="the rank to kill")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--rss-every", type=int, default=25, help="report memory every this many steps")
    p.add_argument("--warmup", type=int, default=None, help="measure memory growth from this step (default: the first reported after 10%%)")
    p.add_argument("--timeout", type=float, default=10.0, help="the ranks' timeout for silent peers (seconds)")
    p.add_argument("--out", default=None, help="directory for logs and checkpoints (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    warmup = args.warmup or max(args.rss_every, (args.steps // 10) // args.rss_every * args.rss_every or args.rss_every)

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        print(f"long run: {args.steps} steps of the tiny GPT, plan megatron, {args.devices} processes; kill rank {args.victim} "
              f"at step {args.kill_at}; checkpoints every {args.save_every} steps; timeout {args.timeout:g} s", flush=True)
        full = run_uninterrupted(args, out)
        print(f"1. uninterrupted: exit codes {full['codes']}, {full['seconds']:.1f} s", flush=True)
        killed = run_killed(args, out)
        print(f"2. killed rank {args.victim} at step {killed['killed_at_step']}: exit codes {killed['codes']}; the other ranks "
              f"stopped {killed['stop_seconds']:.1f} s after the kill" if killed["stop_seconds"] is not None
              else f"2. the kill did not happen: exit codes {killed['codes']}", flush=True)
        resumed = run_resumed(args, out)
        print(f"3. resumed: exit codes {resumed['codes']}, {resumed['seconds']:.1f} s", flush=True)

        full_losses = {e["step"]: e["loss"] for e in full["logs"][0]}
        resumed_losses = {e["step"]: e["loss"] for e in resumed["logs"][0]} if resumed["logs"] else {}
        first = min(resumed_losses) if resumed_losses else None
        mismatched = [s for s, v in resumed_losses.items() if full_losses.get(s) != v]
        memory = rss_summary(full["logs"], args.rss_every, warmup)
        survivors = [r for r in range(args.devices) if r != args.victim]
        named = all(f"rank {r} stopping: rank {args.victim} failed" in killed["stderr"] for r in survivors)
        checks = {
            "uninterrupted run succeeded": full["codes"] == [0] * args.devices and len(full_losses) == args.steps,
            "killed rank died of SIGKILL": killed["codes"][args.victim] == -signal.SIGKILL,
            "the other ranks exited non-zero": all(killed["codes"][r] not in (0, None) for r in survivors),
            "the other ranks named the killed rank": named,
            f"the other ranks stopped within the timeout ({args.timeout:g} s)": killed["stop_seconds"] is not None
            and killed["stop_seconds"] <= args.timeout,
            "resumed run succeeded": resumed["codes"] == [0] * args.devices,
            "resumed from a checkpoint at or before the kill": first is not None and killed["killed_at_step"] is not None
            and first - 1 <= killed["killed_at_step"],
            "resumed losses equal the uninterrupted ones bit for bit": bool(resumed_losses) and not mismatched
            and max(resumed_losses) == args.steps,
        }
        report = {"date": time.strftime("%Y-%m-%d"), "steps": args.steps, "devices": args.devices, "timeout": args.timeout,
                  "kill_at": args.kill_at, "killed_at_step": killed["killed_at_step"], "resumed_from_step": None if first is None else first - 1,
                  "seconds": {"uninterrupted": round(full["seconds"], 1), "killed": round(killed["seconds"], 1),
                              "resumed": round(resumed["seconds"], 1),
                              "stop_after_kill": None if killed["stop_seconds"] is None else round(killed["stop_seconds"], 2)},
                  "median_step_ms": round(1000 * sorted(e["seconds"] for e in full["logs"][0])[len(full["logs"][0]) // 2], 1)
                  if full["logs"][0] else None,
                  "losses_compared": len(resumed_losses), "losses_mismatched": len(mismatched),
                  "final_loss": full_losses.get(args.steps), "memory": memory, "stop_messages": [
                      line for line in killed["stderr"].splitlines() if line.startswith("nvtp:")],
                  "codes": {"uninterrupted": full["codes"], "killed": killed["codes"], "resumed": resumed["codes"]},
                  "checks": checks}
    for r in memory["ranks"]:
        samples = ", ".join(f"{s}: {v}" for s, v in r["rss_mib"].items())
        print(f"   rank {r['rank']} VmRSS (MiB) by step: {samples}")
        print(f"   rank {r['rank']} growth from step {r['from_step']} to {args.steps}: {r['growth_kib']} KiB "
              f"(max - min after step {r['from_step']}: {r['max_minus_min_kib_after_warmup']} KiB)")
    for line in report["stop_messages"]:
        print(f"   {line}")
    for name, ok in checks.items():
        print(f"   {'ok  ' if ok else 'FAIL'} {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
