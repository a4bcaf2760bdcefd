"""A scheduled all-reduce's flat buffer, kept between steps, as DDP keeps its gradient buckets.

    bucket = Bucket()                                    # one per start node of a lowered program (sets.start_for)
    buffer, views = bucket.take([(4, 8), (8,)], torch.float32, device)
    # views[k]: member k's slice of buffer, in its shape: copied into, reduced in place, handed on as its result

A bucket of gradients (``nvtp.sharding.overlap``) used to be a fresh ``torch.cat`` of its members
every step, reduced into a clone of that, the gradients slices of the clone. Kept, the buffer is
allocated once per rank and start node; each member is copied into its slice, the buffer reduced
in place, and each gradient autograd receives is a view of it (DDP with
``gradient_as_bucket_view=True``).

A kept buffer is reused only when nothing outside holds any view of it: a user keeping ``p.grad``
between steps (accumulation without ``zero_grad``, ``zero_grad(set_to_none=False)``, ``g =
p.grad``) holds one, and autograd's ``p.grad += new`` would read the slice the next step writes.
Every view of a tensor holds its storage, so the storage's use count says it: the buffer and this
bucket's own handle on its storage, and nothing else. A held buffer is left to its holders and
this step takes a fresh one, kept from then on. Views are made under a lock before ``take``
returns, so two threads running one lowered program (simulated meshes of one program) never share a step's buffer.
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

import torch

# The use count of a storage: the tensors (views included) and Python storage objects holding it.
# Without it (another torch), every step takes a fresh buffer, as before buffers were kept.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Bucket:
    """The flat buffer of one scheduled all-reduce on one rank, kept between steps (see the module docstring)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self._storage = None  # the buffer's storage, held: its use count is read through it
        self._alone = 0  # that use count with nothing else holding the storage
        self._lock = threading.Lock()
        self.fresh = 0  # buffers allocated (the first, and one for each step that found it held)

    def held(self) -> bool:
        """Whether anything but this bucket holds the kept buffer's storage (a view of it: a gradient)."""
        if self.buffer is None or _use_count is None:
            return True
        return _use_count(self._storage._cdata) != self._alone

    def take(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The buffer for members of ``shapes`` (flat, one after the other) and each member's view
        of it: the kept one when it fits and nothing holds it, else a fresh one, kept from now."""
        sizes = [math.prod(s) for s in shapes]
        with self._lock:
            b = self.buffer
            if b is None or b.numel() != sum(sizes) or b.dtype != dtype or b.device != device or self.held():
                b = torch.empty(sum(sizes), dtype=dtype, device=device)
                self.buffer, self._storage = b, b.untyped_storage()
                self._alone = _use_count(self._storage._cdata) if _use_count is not None else 0
                self.fresh += 1
            return b, views(b, shapes, sizes)


def views(buffer: torch.Tensor, shapes: Sequence[Sequence[int]], sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Each member's slice of the flat ``buffer`` (members of ``shapes``, one after the other), in its shape."""
    out, at = [], 0
    for shape, n in zip(shapes, sizes if sizes is not None else [math.prod(s) for s in shapes]):
        out.append(buffer[at:at + n].view(shape))
        at += n
    return out


__all__ = ["Bucket", "views"]
