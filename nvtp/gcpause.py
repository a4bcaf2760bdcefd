"""Python's cyclic garbage collector paused while nvtp compiles.

Tracing, splicing and the sharding passes build hundreds of thousands of objects that live as long
as the compiled model (ops, values, placements, factor descriptions). CPython's collector walks
every tracked object at each full collection, and the allocations of a compile trigger many: on
GPT-3 at 96 layers (d = 8, nvFuser target) the collector was about 30% of the sharding passes
(megatron 2.43 s -> 1.77 s without it) and 20% of the capture (6.2 s -> 5.1 s). Reference counting
still frees everything at once; only cycles made meanwhile wait until the pause ends.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block; enable it again after if it was enabled
    (nested or concurrent pauses leave it as the outermost one found it)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
