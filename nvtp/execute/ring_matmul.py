"""Collective matmul: a gather before ``linear``s, or a reduce-scatter after one, run as ring steps.

The schedule (``nvtp.sharding.overlap.Ring``, chosen by ``plan_rings``) names the ``set`` and the
``linear``s; the reference backend's lowering (``nvtp.execute.lower``) runs them here as one node.
Each of the n ranks of the mesh axis holds one block of the split dimension:

* **all-gather + linear** (a column-parallel projection of sequence-parallel activations): the
  rank multiplies the block it holds while sending it on to the next rank and receiving the
  previous rank's, n blocks in n steps (n - 1 transfers, each beside a block's matmuls). The
  products and the gathered tensor are assembled in rank order, as the all-gather would give.
* **linear + reduce-scatter** (a row-parallel projection back to sequence-parallel): at step s
  the rank computes its partial product for block (rank - 1 - s) mod n and adds it to the
  running sum arriving from the previous rank; after n - 1 transfers the sum it holds is its
  own block, summed over every rank (the next block's matmul runs while a sum travels).

On torch.distributed each transfer is ``batch_isend_irecv`` started before the block's matmul
and waited for after it; between the threads of the simulated tier it is an exchange. Every
transfer is logged as a ``sendrecv`` on the axis with its bytes, as the schedule plans it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from nvtp.execute import ring
from nvtp.execute.collectives import on_axis


def product(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``linear(x, w, b)``, or (``kind`` "matmul") x's rows times w in x's leading shape: the
    backward's reshape -> matmul -> reshape."""
    if kind == "linear":
        return F.linear(x, w, b)
    return torch.matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[-1])


def allgather_linear(ctx: Any, axis: int, dim: int, name: str, x: torch.Tensor,
                     uses: Sequence[tuple[str, torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
    """[the gathered x, the product of the gathered x by w for each (kind, w, b) of ``uses``]: x
    is this rank's block of ``dim`` on mesh axis ``axis``."""
    comm = on_axis(ctx.comm, axis)
    n, r = comm.size, comm.rank
    blocks: list[torch.Tensor | None] = [None] * n
    outs: list[list[torch.Tensor | None]] = [[None] * n for _ in uses]
    held = x
    for s in range(n):
        index = (r - s) % n
        transfer = ring.start_send(held, comm, name, ctx, axis, name) if s < n - 1 else None
        blocks[index] = held
        for k, (kind, w, b) in enumerate(uses):
            outs[k][index] = product(kind, held, w, b)
        if transfer is not None:
            held = transfer.wait()
    return [torch.cat(blocks, dim)] + [torch.cat(o, dim) for o in outs]


def linear_reducescatter(ctx: Any, axis: int, dim: int, name: str, x: torch.Tensor,
                         use: tuple[str, torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """This rank's block (of ``dim``, on mesh axis ``axis``) of the product ``use`` = (kind, w, b)
    of x, summed over the axis's ranks: x and w are this rank's parts of a contraction split over
    the axis."""
    kind, w, b = use
    comm = on_axis(ctx.comm, axis)
    n, r = comm.size, comm.rank
    xs = x.chunk(n, dim)
    total, transfer = None, None
    for s in range(n):
        part = product(kind, xs[(r - 1 - s) % n], w, b)
        total = part if transfer is None else transfer.wait() + part
        transfer = ring.start_send(total, comm, name, ctx, axis, name) if s < n - 1 else None
    return total
