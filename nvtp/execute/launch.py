"""Start a mesh of processes on this machine, or join the one ``torchrun`` started.

``spawn(fn, n, *args)`` runs ``fn(rank, n, init_method, *args)`` in ``n`` fresh processes and
returns their exit codes; ``init_group`` joins torch.distributed (gloo on CPU, NCCL when each rank
has a GPU) with a bounded timeout, so a rank that dies makes the others fail instead of hang.
"""

from __future__ import annotations

import datetime
import os
import socket
import contextlib
import sys
from typing import Any, Callable

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def backend_for_this_machine() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def init_group(rank: int, world: int, init_method: str | None, timeout_s: float = 60.0) -> None:
    import torch.distributed as dist

    import torch.distributed as dist

    if dist.is_initialized():
        return  # the caller (e.g. a torchrun script) already joined
    backend = backend_for_this_machine()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    with _quiet_stdout():  # gloo prints "[Gloo] Rank r is connected to ..." for every rank
        if init_method is None:
            dist.init_process_group(**kwargs)  # torchrun's environment
        else:
            dist.init_process_group(init_method=init_method, rank=rank, world_size=world, **kwargs)


@contextlib.contextmanager
def _quiet_stdout():
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _entry(rank: int, fn: Callable, world: int, init_method: str, args: tuple) -> None:
    code = fn(rank, world, init_method, *args)
    if code:
        raise SystemExit(code)


def spawn(fn: Callable[..., int], world: int, *args: Any) -> list[int]:
    """Run ``fn(rank, world, init_method, *args)`` in ``world`` processes; their exit codes."""
    import torch.multiprocessing as mp

    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, fn, world, init_method, args), daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return [p.exitcode if p.exitcode is not None else 1 for p in procs]
