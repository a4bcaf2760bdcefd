"""Expert parallelism at run time: ``gather_mm`` and ``gather_mm_wgrad`` whose experts an "ep"
axis splits (``nvtp.sharding.axes.ep`` plans them; ``nvtp.sharding.rules_moe`` says why).

Each of the P ranks of an ep group holds its routed rows (its tokens' choices, ``index`` the
global expert of each) and a contiguous block of E/P experts: rank r holds experts
``[r E/P, (r+1) E/P)``, so a row's destination is ``index // (E/P)``. The plan
(``nvtp.sharding.axes.ep.expert_layout``) says which values are held on the experts' ranks;
``Experts`` runs one fusion's expert ops and the row-wise ops between them on those rows:

1. per routing index, once: the rows sorted by expert (stable), so grouped by destination, each
   destination's rows in a block of ``capacity`` rows (a static bound: every row a rank holds;
   dropless), padded past its count; ``alltoall`` of the per-expert counts (``[P, E/P]``
   integers), each received row's local expert found from them on the device (padding rows
   belong to none: zero, adding nothing to a gradient);
2. a row operand not held: written into a send buffer ``[P, capacity, K]`` by ``index_copy`` and
   sent by one ``alltoall`` (the dispatch), once per value and index; equal blocks, so no split
   size is read by the host;
3. ``gather_mm`` on the received rows (its local grouped matmul), ``gather_mm_wgrad`` (this rank's
   experts' gradient ``[E/P, K, N]``, no combine), row-wise ops in runs of the rank's row count;
4. a held value another op reads: ``alltoall`` back (the combine), put back in the rows' order.

With a capacity factor (``nvtp.sharding.axes.ep.capacity``: ``capacity`` rows per expert per
source rank), step 1 gives each destination block E/P slots of ``capacity`` rows, one per local
expert; an expert's rows past its capacity (the later ones in the rank's row order) are dropped:
not sent, and their result is zero. The counts sent are the rows kept.

Each exchange is a collective of equal blocks (``all_to_all_single`` on torch.distributed; between the threads
of the simulated tier, an exchange of the buffers), counted in ``recording()`` and the run's log
with the bytes a rank sends to the others, as ``nvtp.sharding.axes.ep.exchanges`` plans them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from nvtp.execute.collectives import PROGRESS, Communication, DistComm, ThreadComm, on_axis
from nvtp.execute.grouped import gather_mm, gather_mm_wgrad
from nvtp.sharding.axes.ep import CAPACITY_FACTOR, NAME, Layout, capacity, expert_layout

_RECORDS: list[list[tuple[str, int]]] = []  # open ``recording()`` lists


@contextlib.contextmanager
def recording():
    """Yields a list that receives (what, bytes sent to the other ranks) of every all-to-all this
    process runs (every thread of it: the simulated ranks) until the block ends."""
    sent: list[tuple[str, int]] = []
    _RECORDS.append(sent)
    try:
        yield sent
    finally:
        _RECORDS.remove(sent)


def all_to_all(t: torch.Tensor, comm: Any, what: str, log: list | None = None, value: str = "", axis: int = 0) -> torch.Tensor:
    """Block p of ``t`` (``[P * c, ...]``, P equal blocks) goes to rank p; the result's block p
    is what rank p sent this rank. Recorded with the bytes this rank sends to the others."""
    n = comm.size
    sent = t.numel() * t.element_size() * (n - 1) // n
    for r in _RECORDS:
        r.append((what, sent))
    if log is not None:
        log.append(Communication("alltoall", value or what, sent, axis))
    if n == 1:
        return t
    t = t.contiguous()
    if isinstance(comm, ThreadComm):
        items = comm.group.exchange(comm.rank, t)
        return torch.cat([x.chunk(n)[comm.rank] for x in items]).clone()
    if isinstance(comm, DistComm):
        out = torch.empty_like(t)
        with PROGRESS:
            comm.dist.all_to_all_single(out, t, group=comm.group)
        return out
    raise TypeError(f"expert parallelism needs an all-to-all, which {type(comm).__name__} does not run")


class _Route:
    """Where this rank's rows go: their order sorted by expert, each sorted row's slot in the
    send buffer ``[P * block]``, and the per-(destination, local expert) counts sent. Dropless
    (``per_expert`` None): a block of every row the rank holds, each destination's rows in a
    run; else each expert ``per_expert`` slots (a block of E/P of them), its rows past them dropped."""

    def __init__(self, index: torch.Tensor, experts: int, ranks: int, per_expert: int | None = None):
        self.ranks, self.local, self.per_expert = ranks, experts // ranks, per_expert
        rows = torch.arange(index.shape[0], device=index.device)
        self.order = torch.argsort(index, stable=True)
        sorted_index = index.index_select(0, self.order)
        counts = torch.bincount(index, minlength=experts)
        if per_expert is None:
            self.capacity = max(1, index.shape[0])  # every row could go to one rank: dropless
            dest = torch.div(sorted_index, self.local, rounding_mode="floor")
            self.counts = counts.reshape(ranks, self.local)  # [P, E/P]
            per_rank = self.counts.sum(1)
            start = torch.cumsum(per_rank, 0) - per_rank  # where each destination's rows begin, sorted
            self.slot = dest * self.capacity + rows - start[dest]
            self.kept = None
        else:
            self.capacity = self.local * per_expert  # a destination's block: its experts' slots
            start = torch.cumsum(counts, 0) - counts  # where each expert's rows begin, sorted
            position = rows - start[sorted_index]  # a row's place among its expert's (in the rank's order: a stable sort)
            self.kept = position < per_expert
            self.slot = torch.where(self.kept, sorted_index * per_expert + position, 0)  # experts contiguous: block, then slot
            self.counts = counts.clamp(max=per_expert).reshape(ranks, self.local)

    def send(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (this rank's, in their order) placed in the send buffer ``[P * capacity, ...]``."""
        buf = rows.new_zeros((self.ranks * self.capacity, *rows.shape[1:]))
        if self.kept is None:
            return buf.index_copy_(0, self.slot, rows.index_select(0, self.order))
        return buf.index_copy_(0, self.slot[self.kept], rows.index_select(0, self.order[self.kept]))

    def back(self, buf: torch.Tensor) -> torch.Tensor:
        """The rows of a combined buffer ``[P * capacity, ...]`` put back in this rank's order
        (a dropped row: zero)."""
        picked = buf.index_select(0, self.slot)
        if self.kept is not None:
            picked = torch.where(self.kept.reshape(-1, *[1] * (picked.ndim - 1)), picked, 0)
        return torch.empty_like(picked).index_copy_(0, self.order, picked)

    def received_experts(self, counts: torch.Tensor) -> torch.Tensor:
        """Each received row's local expert from the counts each rank sent (``[P, E/P]``); a
        padding row's is E/P (none)."""
        if self.per_expert is None:
            return _received_experts(counts, self.capacity)
        j = torch.arange(self.capacity, device=counts.device)
        expert, place = torch.div(j, self.per_expert, rounding_mode="floor"), j % self.per_expert  # [block]
        filled = place[None, :] < counts[:, expert]  # [P, block]: slot j of block p holds a row
        return torch.where(filled, expert[None, :], self.local).reshape(-1)


def _received_experts(counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Each received row's local expert from the counts each rank sent (``[P, E/P]``), on the
    device: row j of block p belongs to the first expert whose running count exceeds j; a padding
    row to none (E/P, one past the last)."""
    ends = torch.cumsum(counts, 1)  # [P, E/P]
    j = torch.arange(capacity, device=counts.device)
    return (j[None, :, None] >= ends[:, None, :]).sum(-1).reshape(-1)  # [P * capacity]


class Experts:
    """One run's expert rows on this rank (``reference.run`` makes one per run of an ep program):
    the routes by index, the rows held on this rank's experts by value name. ``execute`` runs the
    ops of ``layout.runs`` on held rows, dispatching a row operand not held (once) and combining
    a result ``layout.combined`` names (once, where it is made); the exchanges are the layout's,
    in its order."""

    def __init__(self, layout: Layout, comm: Any):
        self.layout, self.comm = layout, on_axis(comm, layout.axis)
        self.routes: dict[str, tuple[_Route, torch.Tensor]] = {}  # index -> its route, each received row's local expert
        self.held: dict[str, torch.Tensor] = {}  # value -> its rows as this rank's experts received them
        self.dispatched: dict[tuple[str, str], torch.Tensor] = {}

    def runs(self, op: Any) -> bool:
        return bool(op.outputs) and op.outputs[0].name in self.layout.runs

    def _route(self, ctx: Any, op: Any, index: torch.Tensor, experts: int) -> tuple[_Route, torch.Tensor]:
        name = op.arg("index").name
        if name not in self.routes:
            factor = ctx.options.get(CAPACITY_FACTOR)  # as planned (ShardedFusion.options)
            route = _Route(index, experts, self.comm.size, None if factor is None else capacity(factor, index.shape[0], experts))
            counts = all_to_all(route.counts.reshape(-1).contiguous(), self.comm, "counts", ctx.log, op.outputs[0].name, self.layout.axis)
            self.routes[name] = route, route.received_experts(counts.reshape(self.comm.size, route.local))
        return self.routes[name]

    def _rows(self, ctx: Any, op: Any, v: Any, x: torch.Tensor, index: str) -> torch.Tensor:
        """Operand ``v`` (``x`` as the fusion holds it) on this rank's experts: held, or dispatched once."""
        if self.layout.held.get(v.name) == index:
            return self.held[v.name]
        key = (v.name, index)
        if key not in self.dispatched:
            route = self.routes[index][0]
            self.dispatched[key] = all_to_all(route.send(x), self.comm, "dispatch", ctx.log, op.outputs[0].name, self.layout.axis)
        return self.dispatched[key]

    def execute(self, ctx: Any, op: Any, args: dict[str, Any], impl: Any) -> tuple[torch.Tensor]:
        """``op``'s result: computed on held rows; as the fusion holds it where it is combined
        (else the held rows, which no op outside ``layout.runs`` reads)."""
        name = op.outputs[0].name
        if op.kind in ("gather_mm", "gather_mm_wgrad"):
            w = args["arg2"]
            experts = w.shape[0] * self.comm.size if op.kind == "gather_mm" else args["groups"]
            route, local = self._route(ctx, op, args["index"], experts)
            index = op.arg("index").name
            x = self._rows(ctx, op, op.arg("arg1"), args["arg1"], index)
            if op.kind == "gather_mm_wgrad":  # this rank's experts' gradient [E/P, K, N]: no combine
                g = gather_mm_wgrad(x, self._rows(ctx, op, op.arg("arg2"), w, index), local, route.local)
                return (g.to(ctx.dtype(op.outputs[0].dtype)),)
            y = torch.where((local < w.shape[0]).unsqueeze(1), gather_mm(x, w, local), 0)  # padding rows: no expert: zero
        else:  # a ROWWISE op of held rows: on them (padding rows compute what they compute; nothing reads them)
            index = self.layout.held[name]
            y = self._rowwise(ctx, op, args, impl)
        y = y.to(ctx.dtype(op.outputs[0].dtype))  # the dtype the op table infers, as reference.execute_op casts
        self.held[name] = y
        if name in self.layout.combined:
            route = self.routes[index][0]
            return (route.back(all_to_all(y, self.comm, "combine", ctx.log, name, self.layout.axis)),)
        return (y,)

    def _rowwise(self, ctx: Any, op: Any, args: dict[str, Any], impl: Any) -> torch.Tensor:
        """A ``ROWWISE`` op on held rows: its implementation called on runs of as many rows as the
        fusion's value holds on this rank (the shapes it is written for; tp's splits inside a row
        included), the last run padded with zeros, the results joined and cut."""
        held = [(arg, v) for arg, v in op.args if getattr(v, "name", None) in self.layout.held]
        rows = ctx.local_shape(op.outputs[0])[0]
        total = self.held[held[0][1].name].shape[0]
        out = []
        for start in range(0, total, rows):
            a = dict(args)
            for arg, v in held:
                part = self.held[v.name][start:start + rows]
                a[arg] = part if part.shape[0] == rows else torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
            y = impl(ctx, op, a)
            out.append(y[0] if isinstance(y, tuple) else y)
        return torch.cat(out)[:total]


_LAYOUTS: dict[tuple[int, int], tuple[Any, Any, Layout | None, float | None]] = {}  # (fusion, shardings, layout, factor)
_KEEP = 16  # layouts kept (a program has a forward and a backward per region)


def experts_for(fusion: Any, shardings: Any, mesh: Any, comm: Any, options: Any) -> Experts | None:
    """A run's ``Experts`` for ``fusion`` on ``mesh`` (None: no expert an ep axis splits); the
    layout planned once per fusion and placements (``nvtp.sharding.axes.ep.expert_layout``)."""
    if shardings is None or mesh is None or NAME not in mesh.names:
        return None
    key = (id(fusion), id(shardings))
    got = _LAYOUTS.get(key)
    factor = (options or {}).get(CAPACITY_FACTOR)
    if got is None or got[0] is not fusion or got[1] is not shardings or got[3] != factor:
        got = _LAYOUTS[key] = (fusion, shardings, expert_layout(fusion, shardings, mesh, factor), factor)
        for k in list(_LAYOUTS)[:-_KEEP]:
            del _LAYOUTS[k]
    return None if got[2] is None else Experts(got[2], comm)
