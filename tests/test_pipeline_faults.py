"""A pipeline's faults end every process within the timeout, naming the rank (issue 36, item 2).

Run as a user runs a pipeline on their own launcher: each rank a process of its own that calls
``torch.distributed.init_process_group`` itself and trains ``nvtp.jit(model, mesh=(pp,),
microbatches=2, timeout=T)``; no launcher stops the survivors, so each must stop by itself. Rank 1
(stage 1) sleeps, raises or is killed at step 2; rank 0 (stage 0), blocked in a receive from it,
must stop within the bound naming rank 1, and a sleeping rank 1 must stop too.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvtp.errors import EXIT_RUNTIME

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 4.0

SCRIPT = """
import os, signal, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import nvtp
from nvtp.models import gpt

rank, fault, out = int(os.environ["RANK"]), sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo")
torch.manual_seed(0)
cfg = gpt.config("tiny", n_layer=2, batch=4)
model = nvtp.jit(gpt.GPT(cfg), plan="replicate", mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)),
                 microbatches=2, timeout=float(sys.argv[3]))
opt = torch.optim.SGD(model.module.parameters(), lr=0.1)
for step in range(4):
    if rank == 1 and step == 2:
        (out / "fault_time").write_text(repr(time.time()))
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "raise":
            raise RuntimeError("the batch file is corrupt")
        time.sleep(1000)
    idx, targets = gpt.example_tokens(cfg, seed=step)
    loss = model(idx, targets)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
"""


def _free_port() -> int:
    from torch.distributed.elastic.utils.distributed import get_free_port

    return get_free_port()


def _run_ranks(tmp_path: Path, fault: str, world: int = 2, limit: float = 240.0):
    """Start ``world`` ranks of SCRIPT; each one's (exit code, stderr, time it ended), and when rank 1 failed."""
    script = tmp_path / "pipeline_rank.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, str(script), fault, str(tmp_path), str(TIMEOUT)], cwd=ROOT,
                              env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]
    deadline = time.time() + limit
    ended: dict[int, float] = {}
    while len(ended) < world and time.time() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.time()
        time.sleep(0.05)
    for r, p in enumerate(procs):  # what did not end by itself fails the test below; leave nothing running
        if p.poll() is None:
            p.kill()
    results = [(p.wait(), p.communicate()[1], ended.get(r)) for r, p in enumerate(procs)]
    fault_file = tmp_path / "fault_time"
    return results, float(fault_file.read_text()) if fault_file.exists() else None


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sleep", "raise", "kill"])
def test_a_pipeline_rank_that_fails_ends_every_process_naming_it(tmp_path, fault):
    results, fault_time = _run_ranks(tmp_path, fault)
    (code0, err0, end0), (code1, err1, end1) = results
    both = f"rank 0:\n{err0}\nrank 1:\n{err1}"
    assert fault_time is not None, both
    assert end0 is not None, "rank 0 never ended by itself\n" + both
    bound = TIMEOUT + 5.0 if fault == "sleep" else 5.0  # the timeout for a silent rank; about a second for a dead one
    assert end0 - fault_time <= bound, (end0 - fault_time, both)
    assert code0 == EXIT_RUNTIME, both
    assert "Traceback" not in err0 and "Connection reset" not in err0, err0
    if fault == "sleep":
        assert re.search(r"nvtp: rank 0 stopping: rank 1 failed: hung: rank 0 waited \d+ s in collective #\d+ "
                         r"\(a receive from rank 1\), which rank 1 never reached", err0), both
        assert end1 is not None and end1 - fault_time <= bound, ("the silent rank did not stop", both)
        assert "nvtp: rank 1 stopping: hung: rank 0 waited" in err1, both
        assert end0 - fault_time >= TIMEOUT - 0.5, both
    elif fault == "raise":
        assert "nvtp: rank 0 stopping: rank 1 failed: RuntimeError: the batch file is corrupt" in err0, both
        assert "nvtp: rank 1 failed: RuntimeError: the batch file is corrupt" in err1, both
        assert code1 == EXIT_RUNTIME and end1 is not None and end1 - fault_time <= bound, (code1, both)  # not torch's slow teardown
    else:
        assert code1 == -signal.SIGKILL
        assert re.search(r"nvtp: rank 0 stopping: rank 1 failed: its process \(pid \d+\) (was killed by SIGKILL|is gone)", err0), both
