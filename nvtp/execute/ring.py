"""Ring attention: ``sdpfa_fwd`` / ``sdpfa_bwd`` whose sequence the cp axis splits.

Each of the n ranks of a cp group holds its queries and one block of keys and values (its
tokens, at their global positions). The forward runs n steps: attention of the local queries on
the block at hand, then the K/V block passes to the next rank and the previous rank's arrives
(n - 1 point-to-point steps for K, as many for V). Partial results are merged by their
log-sum-exp, the online-softmax merge::

    lse = logaddexp(lse_a, lse_b)      out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

so the result and its lse are exactly the whole attention's (up to rounding). Under a causal
mask a block whose keys all follow every local query is skipped (it still travels). The
backward uses the merged lse, as flash attention's does: the K/V blocks travel again, and with
them their gradient accumulators dK and dV, which each rank adds its queries' share to; one
last step brings each block's dK and dV home (n steps each). The positions come from the
placements (``placements.held``), so any layout of the sequence over cp works.

Point-to-point steps: ``shift`` on torch.distributed (``batch_isend_irecv``: send to the next
rank, receive from the previous) or between the threads of the simulated tier
(``ThreadComm``). Each step is recorded in the run's log as a ``sendrecv`` (and in any open
``recording()``), and ``nvtp.sharding.axes.ring.ring_steps`` plans the same steps with their bytes.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from nvtp.execute.collectives import PROGRESS, Communication, DistComm, ThreadComm, on_axis
from nvtp.sharding.placements import held

_RECORDS: list[list[tuple[str, int]]] = []  # open ``recording()`` lists


@contextlib.contextmanager
def recording():
    """Yields a list that receives (tensor, bytes) of every point-to-point step this process
    runs (every thread of it: the simulated ranks) until the block ends."""
    sent: list[tuple[str, int]] = []
    _RECORDS.append(sent)
    try:
        yield sent
    finally:
        _RECORDS.remove(sent)


class _Shift:
    """One ring step under way: ``wait()`` gives the previous rank's tensor."""

    def __init__(self, out: torch.Tensor, works: list | None = None, peers: tuple[int, ...] | None = None):
        self.out, self.works, self.peers = out, works, peers

    def wait(self) -> torch.Tensor:
        if self.works:
            with PROGRESS.on(self.peers, f"a ring step with ranks {list(self.peers)}" if self.peers else ""):
                for w in self.works:
                    w.wait()
            self.works = None
        return self.out


def start_shift(t: torch.Tensor, comm: Any) -> _Shift:
    """Start sending ``t`` to the next rank of ``comm``'s ring and receiving the previous rank's:
    ``batch_isend_irecv`` on torch.distributed, waited for by ``wait()``; between threads (and on
    any other Comm, by a collective) the exchange is done here."""
    n = comm.size
    if n == 1:
        return _Shift(t)
    if isinstance(comm, ThreadComm):
        items = comm.group.exchange(comm.rank, t)
        return _Shift(items[(comm.rank - 1) % n].clone())
    if isinstance(comm, DistComm):
        dist = comm.dist
        ranks = dist.get_process_group_ranks(comm.group) if comm.group is not None else list(range(dist.get_world_size()))
        t = t.contiguous()
        out = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, ranks[(comm.rank + 1) % n], comm.group),
               dist.P2POp(dist.irecv, out, ranks[(comm.rank - 1) % n], comm.group)]
        peers = tuple(dict.fromkeys((ranks[(comm.rank - 1) % n], ranks[(comm.rank + 1) % n])))
        return _Shift(out, dist.batch_isend_irecv(ops), peers if comm.peers is not None else None)
    parts = comm.all_gather(t)  # any other Comm: the same data, by a collective
    return _Shift(parts[(comm.rank - 1) % n])


def shift(t: torch.Tensor, comm: Any) -> torch.Tensor:
    """Send ``t`` to the next rank of ``comm``'s ring and return the previous rank's tensor."""
    return start_shift(t, comm).wait()


def start_send(t: torch.Tensor, comm: Any, name: str, ctx: Any, axis: int, op_name: str) -> _Shift:
    """``start_shift``, recorded: in any open ``recording()`` as (``name``, bytes) and in the run's
    log as a ``sendrecv`` of ``op_name`` on mesh axis ``axis``."""
    nbytes = t.numel() * t.element_size()
    for record in _RECORDS:
        record.append((name, nbytes))
    ctx.log.append(Communication("sendrecv", op_name, nbytes, axis))
    return start_shift(t, comm)


def _send(t: torch.Tensor, comm: Any, name: str, ctx: Any, axis: int, op_name: str) -> torch.Tensor:
    return start_send(t, comm, name, ctx, axis, op_name).wait()


def _positions(ctx: Any, v: Any, axis: int, coord: int) -> torch.Tensor:
    """The global sequence positions (axis 2) of ``v`` the rank at cp coordinate ``coord`` holds."""
    coords = [ctx.coord(a) for a in range(ctx.mesh.ndim)]
    coords[axis] = coord
    idx = held(v.shape, ctx.sharding(v), ctx.mesh, coords)[2]
    return torch.arange(v.shape[2]) if idx is None else idx


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool):
    """(rows, columns) of a block some causal pair reaches: the queries at or after the first
    key, the keys at or before the last query (all of them without a mask); None when none.
    In the balanced layout a block from an earlier rank is all its queries on half its keys,
    one from a later rank half its queries on all its keys: half a block of work either way."""
    if not causal:
        return None, None
    rows = (q_pos >= k_pos.min()).nonzero().flatten()
    cols = (k_pos <= q_pos.max()).nonzero().flatten()
    if rows.numel() == 0 or cols.numel() == 0:
        return "empty", None
    return (None if rows.numel() == q_pos.numel() else rows), (None if cols.numel() == k_pos.numel() else cols)


def _pick(t: torch.Tensor, index):
    return t if index is None else t.index_select(-2, index)


def _block(qf, kf, vf, q_pos, k_pos, scale, causal):
    """Attention of queries on one K/V block: (out, lse), or None when the mask hides it all;
    computed on the rows and columns the mask leaves (``_visible``), -inf rows elsewhere."""
    rows, cols = _visible(q_pos, k_pos, causal)
    if isinstance(rows, str):
        return None
    q_s, k_s, v_s = _pick(qf, rows), _pick(kf, cols), _pick(vf, cols)
    scores = torch.matmul(q_s, k_s.transpose(-2, -1)) * scale  # (B, H, Sq', Sk')
    if causal:
        mask = _pick_pos(q_pos, rows)[:, None] >= _pick_pos(k_pos, cols)[None, :]
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Sq'); -inf for a row the mask hides
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.matmul(probs, v_s)
    if rows is None:
        return out, lse
    full_out = qf.new_zeros(*qf.shape[:-1], vf.shape[-1]).index_copy_(-2, rows, out)
    full_lse = lse.new_full(qf.shape[:-1], float("-inf")).index_copy_(-1, rows, lse)
    return full_out, full_lse


def _pick_pos(pos: torch.Tensor, index):
    return pos if index is None else pos[index]


def _merge(out, lse, out_b, lse_b):
    if out is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), 0.0, new)
    return out * torch.exp(lse - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1), new


def _add(acc: torch.Tensor, index, t: torch.Tensor) -> torch.Tensor:
    return acc + t if index is None else acc.index_add(-2, index, t)


def forward(ctx: Any, op: Any, axis: int, q, k, v, causal: bool, scale: float | None):
    """(out, lse) of this rank's queries on the whole sequence, K/V passed round the cp ring."""
    comm = on_axis(ctx.comm, axis)
    n, me = ctx.mesh.shape[axis], ctx.coord(axis)
    work = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(work)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q_pos = _positions(ctx, op.arg("query"), axis, me)
    out = lse = None
    name = op.outputs[0].name
    for step in range(n):  # the K/V blocks travel in their own dtype; each is computed on in float32 (or wider)
        src = (me - step) % n
        got = _block(qf, k.to(work), v.to(work), q_pos, _positions(ctx, op.arg("key"), axis, src), scale, causal)
        if got is not None:
            out, lse = _merge(out, lse, *got)
        if step < n - 1:
            k = _send(k, comm, "key", ctx, axis, name)
            v = _send(v, comm, "value", ctx, axis, name)
    return out.to(q.dtype), lse


def backward(ctx: Any, op: Any, axis: int, go, q, k, v, out, lse, causal: bool, scale: float | None):
    """(dQ, dK, dV) of this rank's blocks: K/V and their gradients passed round the cp ring."""
    comm = on_axis(ctx.comm, axis)
    n, me = ctx.mesh.shape[axis], ctx.coord(axis)
    work = torch.promote_types(q.dtype, torch.float32)
    k_dtype, v_dtype = k.dtype, v.dtype
    qf, gof, outf, lsef = (t.to(work) for t in (q, go, out, lse))
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q_pos = _positions(ctx, op.arg("query"), axis, me)
    delta = (gof * outf).sum(-1, keepdim=True)  # D = rowsum(dO * out)
    dq = torch.zeros_like(qf)
    dk, dv = k.to(work).new_zeros(k.shape), v.to(work).new_zeros(v.shape)  # gradient accumulators travel in float32
    name = op.outputs[0].name
    for step in range(n):
        src = (me - step) % n
        k_pos = _positions(ctx, op.arg("key"), axis, src)
        rows, cols = _visible(q_pos, k_pos, causal)
        if not isinstance(rows, str):  # the rows and columns the mask leaves (half a block off the diagonal, balanced)
            q_s, go_s, k_s, v_s = _pick(qf, rows), _pick(gof, rows), _pick(k.to(work), cols), _pick(v.to(work), cols)
            lse_s, delta_s = _pick(lsef.unsqueeze(-1), rows), _pick(delta, rows)
            probs = torch.exp(torch.matmul(q_s, k_s.transpose(-2, -1)) * scale - lse_s)
            if causal:
                probs = probs.masked_fill(~(_pick_pos(q_pos, rows)[:, None] >= _pick_pos(k_pos, cols)[None, :]), 0.0)
            ds = probs * (torch.matmul(go_s, v_s.transpose(-2, -1)) - delta_s)
            dq = _add(dq, rows, torch.matmul(ds, k_s) * scale)
            dk = _add(dk, cols, torch.matmul(ds.transpose(-2, -1), q_s) * scale)
            dv = _add(dv, cols, torch.matmul(probs.transpose(-2, -1), go_s))
        if step < n - 1:
            k = _send(k, comm, "key", ctx, axis, name)
            v = _send(v, comm, "value", ctx, axis, name)
        dk = _send(dk, comm, "grad_key", ctx, axis, name)  # with its block; the last step brings it home
        dv = _send(dv, comm, "grad_value", ctx, axis, name)
    return dq.to(q.dtype), dk.to(k_dtype), dv.to(v_dtype)
