"""torch's no-op CUDA device guard for fake tensors, set up on a thread that outlives the others.

On a machine without CUDA, ``FakeTensorMode.__enter__`` calls ``c10::impl::ensureCUDADeviceGuardSet``,
which the first time stores the address of a *thread-local* no-op guard in torch's process-wide
registry of device guards (torch 2.10). When the thread that got there first exits, the registry
points at freed memory, and the next ``FakeTensorMode`` on any thread segfaults::

    def f():
        with FakeTensorMode(): pass
    t = threading.Thread(target=f); t.start(); t.join()
    with FakeTensorMode(): pass     # Segmentation fault

nvtp enters fake mode while tracing (dynamo's export, the splice proof of
``nvtp.frontend.variants``), and the ranks of a simulated mesh trace on threads that exit
(``nvtp.execute.spmd.on_threads``): a generation on 2 simulated ranks followed by any FX-route
trace crashed the process. ``hold`` sets the guard up on the calling thread (the main thread,
normally) before such threads start, so that they find it set and leave it.
"""

from __future__ import annotations

import torch


def hold() -> None:
    """Requires: called on a thread that outlives the threads that trace (idempotent, cheap).
    Ensures: torch's fake CUDA device guard, if this machine needs one, belongs to this thread."""
    if not torch.cuda.is_available():  # FakeTensorMode's own condition (``avoid_device_init``)
        torch._C._ensureCUDADeviceGuardSet()
