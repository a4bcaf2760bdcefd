"""The cp axis's ring attention, as data: which attention runs by ring, its point-to-point steps
with their bytes (for the Program's steps and the report), and the fusions one ring step runs on
a rank, written as nvFuser files.

An attention whose key sequence the cp axis splits runs by ring (``nvtp.execute.ring``): each
rank keeps its queries; the K/V blocks travel the cp ranks by point-to-point steps, partial
results merged by their log-sum-exp, in the forward and the backward (dK/dV travel back home).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nvtp.ir.build import FusionBuilder
from nvtp.ir.dtypes import DType
from nvtp.sharding.placements import DeviceMesh, Placement, axis_split, local_shape
from nvtp.sharding.propagate import ShardingError

ATTENTION = ("sdpfa_fwd", "sdpfa_bwd")
NAME = "cp"


def ring_axis(mesh: DeviceMesh | None, sharding: tuple[Placement, ...] | None, seq_dim: int = 2) -> int | None:
    """The cp mesh axis that splits an attention operand's sequence (``seq_dim``), or None."""
    if mesh is None or sharding is None or NAME not in mesh.names:
        return None
    a = mesh.names.index(NAME)
    split = axis_split(sharding[a])
    if split is None or mesh.shape[a] == 1:  # one rank holds the whole sequence: the op runs as it is
        return None
    if split[0] != seq_dim:
        raise ShardingError(f"attention operand placed {sharding[a]} on the cp axis; the ring splits its sequence (Shard({seq_dim}))")
    return a


# ---------------------------------------------------------------------------------------------
# the ring's point-to-point steps, as the plan and the report count them


@dataclass(frozen=True)
class RingStep:
    """One point-to-point step of a ring attention: each rank sends ``tensor`` (its local block,
    ``bytes``) to the next rank on the cp axis and receives the previous rank's."""

    phase: str
    op: str  # the attention's first result (its name in the sharded fusion)
    tensor: str  # "key", "value", "grad_key", "grad_value"
    shape: tuple[int, ...]  # the block one rank sends
    dtype: str
    bytes: int
    position: int  # the op's index in its fusion (run order)


def ring_steps(phase: str, sharded: Any) -> list[RingStep]:
    """Every point-to-point step the ring attentions of ``sharded`` run, in the order a rank runs
    them (``nvtp.execute.ring``): per attention with its sequence split over cp (n ranks), the
    forward passes K then V at each of its n - 1 steps; the backward passes K, V, dK, dV at each
    of n - 1 steps and dK, dV once more (the last step brings them home). K and V travel in their
    own dtype, the gradient accumulators in float32 (or wider), one rank's block each step."""
    out = []
    mesh = sharded.mesh
    for i, op in enumerate(sharded.fusion.ops):
        if op.kind not in ATTENTION:
            continue
        k = op.arg("key")
        axis = ring_axis(mesh, sharded.shardings.get(k.name))
        if axis is None:
            continue
        n = mesh.shape[axis]
        block = local_shape(k.shape, sharded.shardings[k.name], mesh)
        work = k.dtype if k.dtype.itemsize >= 4 else DType.Float  # torch.promote_types(dtype, float32): the accumulators'
        order = []
        for step in range(n):
            if step < n - 1:
                order += [("key", k.dtype), ("value", op.arg("value").dtype)]
            if op.kind == "sdpfa_bwd":
                order += [("grad_key", work), ("grad_value", work)]
        out += [RingStep(phase, op.outputs[0].name, t, block, dt.value, _numel(block) * dt.itemsize, i) for t, dt in order]
    return out


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def ring_seconds(phase: str, sharded: Any, factor: Any, machine: Any) -> float:
    """The time a ring attention adds to its op's own (one block of queries against one K/V block,
    which ``nvtp.sharding.cost.op_seconds`` counts): n - 1 more blocks, each beside a step of the
    ring, (n - 1) max(step, block), on ``machine``'s cp link. ``factor``: a value's size against
    its traced one (``cost.Sizes``; None: as traced)."""
    from nvtp.sharding.cost import op_seconds  # lazy: kept off nvtp --help's path

    mesh = sharded.mesh
    steps: dict[int, list[RingStep]] = {}
    for r in ring_steps(phase, sharded):
        steps.setdefault(r.position, []).append(r)
    total = 0.0
    for position, rs in steps.items():
        op = sharded.fusion.ops[position]
        axis = ring_axis(mesh, sharded.shardings.get(op.arg("key").name if op.kind == "sdpfa_fwd" else op.arg("query").name))
        if axis is None:
            continue
        n = mesh.shape[axis]
        bw, latency = machine.link(mesh, axis)
        k = factor(op.arg("key").name) if factor is not None else 1.0
        messages = len(rs) / max(1, n - 1)  # K and V a step (and their gradients, backward)
        per_step = messages * latency + sum(r.bytes for r in rs) * k / max(1, n - 1) / bw

        def local(v):
            return local_shape(v.shape, sharded.shardings[v.name], mesh) if v.name in sharded.shardings else v.shape
        block = op_seconds(op, machine, local, factor)
        total += (n - 1) * max(per_step, block)
    return total


def ring_records(phase: str, sharded: Any) -> list[dict[str, Any]]:
    """``ring_steps`` as the report's communication records (``nvtp.sharding.report``)."""
    return [{"kind": "sendrecv", "tensor": f"{r.op}/{r.tensor}", "label": f"ring {r.tensor} of {r.op}", "shape": list(r.shape),
             "dtype": r.dtype, "bytes": r.bytes, "tensor_bytes": r.bytes, "from": f"{NAME} ring", "to": "next rank",
             "position": r.position, "value": r.op, "part": r.tensor}
            for r in ring_steps(phase, sharded)]


# ---------------------------------------------------------------------------------------------
# the ring's per-step fusions, as nvFuser files


def ring_step_fusions(sharded: Any) -> list[tuple[str, Any]]:
    """The fusions one ring step runs on a rank, for the first ring attention of ``sharded`` (a
    forward): the attention of the local queries on the K/V block at hand (``sdpfa_fwd``; causal
    on the diagonal step, full on a half block otherwise: the balanced layout's off-diagonal
    blocks are all queries on the keys before them, or the queries after them on all keys), and
    the log-sum-exp merge into the running output and lse. [(name, Fusion)], empty without a
    ring. nvFuser has no point-to-point step inside a fusion: the host passes the blocks between
    these (docs/context.md)."""
    mesh = sharded.mesh
    op = next((o for o in sharded.fusion.ops if o.kind == "sdpfa_fwd"
               and ring_axis(mesh, sharded.shardings.get(o.arg("key").name)) is not None), None)
    if op is None:
        return []
    q, v = op.arg("query"), op.arg("value")
    qs = local_shape(q.shape, sharded.shardings[q.name], mesh)
    vs = local_shape(v.shape, sharded.shardings[v.name], mesh)
    half = qs[2] // 2
    dtype = DType.BFloat16  # nvFuser's flash attention takes 16-bit operands; the merge runs in float32
    out = []
    for name, q_len, k_len, causal in (("ring_step_diagonal", qs[2], qs[2], True), ("ring_step_half", qs[2], half, False)):
        b = FusionBuilder(name)
        bq = b.define_tensor((*qs[:2], q_len, qs[3]), dtype)
        bk = b.define_tensor((*qs[:2], k_len, qs[3]), dtype)
        bv = b.define_tensor((*vs[:2], k_len, vs[3]), dtype)
        acc = b.define_tensor((*qs[:2], q_len, vs[3]), DType.Float)  # the running output (float32)
        acc_lse = b.define_tensor((*qs[:2], q_len), DType.Float)  # its log-sum-exp (-inf before the first block)
        o, lse, _, _ = b.op("sdpfa_fwd", bq, bk, bv, dropout_p=0.0, is_causal=causal)
        new_out, new_lse = _merge_ops(b, acc, acc_lse, b.op("cast", o, dtype=DType.Float), lse)
        b.add_output(new_out)
        b.add_output(new_lse)
        out.append((name, b.build()))
    return out


def _merge_ops(b: Any, out_a, lse_a, out_b, lse_b):
    """lse = m + log(exp(lse_a - m) + exp(lse_b - m)), m = max(lse_a, lse_b);
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)."""
    m = b.op("maximum", lse_a, lse_b)
    total = b.op("add", b.op("exp", b.op("sub", lse_a, m)), b.op("exp", b.op("sub", lse_b, m)))
    lse = b.op("add", m, b.op("log", total))
    shape, dims = list(out_a.shape), list(range(len(lse.shape)))
    wa = b.op("broadcast_in_dim", b.op("exp", b.op("sub", lse_a, lse)), shape=shape, broadcast_dims=dims)
    wb = b.op("broadcast_in_dim", b.op("exp", b.op("sub", lse_b, lse)), shape=shape, broadcast_dims=dims)
    return b.op("add", b.op("mul", out_a, wa), b.op("mul", out_b, wb)), lse


__all__ = ["RingStep", "ring_axis", "ring_records", "ring_step_fusions", "ring_steps"]
