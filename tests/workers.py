"""What the tests' gloo workers share: each rank's result gathered on rank 0 and written for the test to read."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def finish(result: Any, out: str, world: int) -> int:
    """Requires: a process group of ``world`` ranks, every rank calling this. Ensures: rank 0 has
    written the ranks' ``result``s, in rank order, to ``out`` (``torch.save``); the group is
    destroyed after every rank got there. Returns the worker's exit code, 0."""
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        torch.save(gathered, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0
