"""Context parallelism: a mesh axis named "cp" splits the sequence of every activation.

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))     # or ("cp", "tp")
    sm = nvtp.jit(model, plan="megatron", mesh=mesh)                 # each rank passes the whole batch
    loss = sm(idx, targets)                                          # and gets the whole loss

The cp axis is one more per-axis pass of the driver (``nvtp.driver.shard``), as "dp" is
(``nvtp.sharding.multi``): the plan's pass on "tp" (if the mesh has one) runs first, then the
cp pass shards its result with the unchanged 1-D pipeline over cp's extent, starting from the
module's arguments split along their sequence axis (dimension 1: ``[B, T]`` tokens) and weights
whole. Propagation carries the split through every op; a contraction over the sequence (a
weight's gradient, the loss's mean) leaves a partial sum over cp, which the output hints resolve
by all-reduce: weights stay whole across cp and their gradients are summed over it, as in
Megatron. Positions made inside the model (``arange(T)`` for learned positions, a rotary table
sliced to ``T``) are whole values the propagation slices to each rank's tokens, so each token
keeps its global position.

Attention is the one op whose sequences the propagation may not split on other axes (the key
sequence is read whole by every query). On the cp axis (``rules.RING``) a self-attention's query
and key/value sequences are one factor that may split: each rank keeps its queries, and the
reference backend runs the op by ring (``nvtp.execute.ring``): the K/V blocks travel the cp
ranks by point-to-point steps, partial results merged by their log-sum-exp, in the forward and
the backward (dK/dV travel back home). ``ring_steps`` lists those steps with their bytes, for the
plan and the report. The model is traced with every causal or full attention claimed whole
(``nvtp.frontend.attention.claim_for_ring``), float32 included; an attention the ring cannot run
(an arbitrary mask, dropout) is refused before any work, naming the fix.

Layout: balanced (``placements.Zigzag``): of a sequence of 2·cp pieces rank r holds pieces r
and 2·cp-1-r, one from each end, so every rank does the same causal work every ring step (the
ring computes each block on the rows and columns the mask leaves: half a block off the
diagonal). With tp the sequence is seen as tp's chunks (megatron-sp splits it contiguously over
tp; two mesh axes may split one tensor axis only along different factors), each pair of chunks a
zigzag over cp (``Zigzag(1, tp)``, ``chunks``): at tp = 2 rank (c, t) holds piece c (t = 0) or
2·cp-1-c (t = 1), Megatron-Core's layout (zigzag over cp, then each cp rank's tokens split
contiguously over tp). A dp axis splits the batch (the data plan of ``nvtp.sharding.multi``,
DDP) between tp's pass and cp's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.sharding.axes import roles
from nvtp.sharding.passes import backward_annotations, shard
from nvtp.sharding.placements import REPLICATE, ZIGZAG, DeviceMesh, Placement, axis_split, is_replicate, local_shape, make_shard
from nvtp.sharding.propagate import ShardingError
from nvtp.sharding.rules import RING

SEQUENCE_DIM = 1  # of each module argument: [B, T, ...] (batch first, as nanoGPT and transformers models take tokens)
ATTENTION = ("sdpfa_fwd", "sdpfa_bwd")


class ContextError(ShardingError):
    """A model or input the cp axis cannot split; says what to change (before any work)."""


def has_cp(mesh: DeviceMesh) -> bool:
    return "cp" in mesh.names


def check_traced(traced: Any, mesh: DeviceMesh, fsdp: bool = False) -> None:
    """Refuse, before any work, what the ring cannot run: an attention Thunder would not claim
    whole (an arbitrary mask, dropout: ``traced.declined``), a sequence cp does not divide."""
    if fsdp and "dp" not in mesh.names:
        raise ContextError(f"fsdp=True splits the weights over a dp axis; the mesh {list(mesh.names)} has none: add one "
                           "(e.g. ('dp', 'cp')) or pass fsdp=False (weights whole over cp, their gradients all-reduced)")
    cp = mesh.shape[mesh.names.index("cp")]
    parts = chunks(mesh)
    layout = (f"{cp} x 2: the balanced layout gives each rank a piece from each end of the sequence" if parts == 2 else
              f"{cp} x {parts}: the balanced layout gives each cp rank a piece from each end of every pair of the {parts} "
              "chunks tp's sequence parallelism sees")
    declined = getattr(traced, "declined", [])
    if declined:
        raise ContextError(f"the cp axis runs attention by ring, which needs causal or full attention without a mask; the model "
                           f"calls {declined[0]}. Call F.scaled_dot_product_attention(q, k, v, is_causal=True) (or with no mask), "
                           "with dropout_p=0, or shard this model without a 'cp' axis (tp, dp)"
                           + ("; a transformers model's mask is read as causal when it is computed from positions alone "
                              "and is exactly the causal one: call the model without an attention_mask (padding)"
                              if getattr(traced, "route", "") == "fx" else ""))
    f = traced.forward
    for op in f.ops:
        if op.kind == "sdpfa_fwd":
            q, k = op.arg("query"), op.arg("key")
            if q.shape[2] != k.shape[2]:
                raise ContextError(f"{op}: the cp axis splits self-attention, whose queries and keys have one sequence; this one "
                                   f"has {q.shape[2]} queries and {k.shape[2]} keys: shard it without a 'cp' axis")
            if q.shape[2] % (cp * parts):
                raise ContextError(f"sequence length {q.shape[2]} cannot be split over the cp axis of size {cp} ({op.outputs[0].name} "
                                   f"= attention of q{list(q.shape)}): pass a sequence length that is a multiple of {cp * parts} ({layout})")
    for v in f.inputs:
        if isinstance(v, TensorValue) and f.label(v.name) in traced.arguments and v.ndim > SEQUENCE_DIM:
            n = v.shape[SEQUENCE_DIM]
            if n % (cp * parts):
                raise ContextError(f"argument {f.label(v.name)} {list(v.shape)}: its sequence axis (dimension {SEQUENCE_DIM}) of "
                                   f"length {n} cannot be split over the cp axis of size {cp}; pass a sequence length that is a "
                                   f"multiple of {cp * parts} ({layout})")


def sequence_inputs(fusion: Fusion, arguments: Any, cp: int, chunks: int = 1) -> dict[str, Placement]:
    """The forward inputs the cp axis splits: each module argument of 2 or more dimensions, along
    its sequence (in ``chunks`` strided pieces: ``_StridedShard``)."""
    out = {}
    for v in fusion.inputs:
        if isinstance(v, TensorValue) and fusion.label(v.name) in arguments and v.ndim > SEQUENCE_DIM \
                and v.shape[SEQUENCE_DIM] % (cp * chunks) == 0:
            out[v.name] = make_shard(SEQUENCE_DIM, chunks)
    if not out:
        raise ContextError(f"the cp axis of size {cp} splits the sequence of the module's arguments ([B, T, ...]), but none has "
                           "one (arguments: " + ", ".join(sorted(map(str, arguments))) + ")")
    return out


def shard_forward(traced: Any, plan: str | Mapping[str, Any], mesh: DeviceMesh, target: Any, *,
                  annotations: Mapping[str, tuple[Placement, ...]] | None = None,
                  output_hints: Mapping[str, Placement] | None = None, fsdp: bool = False):
    """The forward over a mesh with a cp axis: the plan on "tp" (if any), the data plan on "dp"
    (if any; ``fsdp``: the weights split over dp at rest, gathered where used), then the cp pass
    (``fsdp``: a weight dp splits is split over cp too, along a dimension tp and dp leave whole,
    ``cp_at_rest``). Returns (the sharded forward, the notes: weights FSDP leaves whole, and why)."""
    from nvtp.sharding.multi import combine

    axes = roles(mesh)
    cp_axis = axes["cp"]
    cp = mesh.shape[cp_axis]
    f = traced.forward
    passes = []
    fusion = f
    tp = _Whole()
    notes: list[str] = []
    if "tp" in axes:
        tp_axis = axes["tp"]
        ann = {n: s[tp_axis] for n, s in (annotations or {}).items()}
        tp = shard(f, plan, mesh.sub(tp_axis), annotations=ann, output_hints=output_hints, target=target)
        passes.append((tp_axis, tp))
        fusion = tp.fusion
    if "dp" in axes:  # the data plan (nvtp.sharding.multi): the batch split over dp, weights whole (DDP) or split (FSDP)
        from nvtp.sharding.multi import data_plan

        dp_axis = axes["dp"]
        data = data_plan(f, tp, mesh.shape[dp_axis], fsdp, traced.arguments, traced.weights)
        for n, s in (annotations or {}).items():  # parameters already placed stay where they are
            if not is_replicate(s[dp_axis]):
                data.at_rest[n] = s[dp_axis]
            else:
                data.at_rest.pop(n, None)
        notes = list(data.notes)
        dps = shard(fusion, "replicate", mesh.sub(dp_axis), annotations=data.batched, target=target, at_rest=data.at_rest,
                    hoist=False, keep_splits=True)
        passes.append((dp_axis, dps))
        fusion = dps.fusion
    # The balanced layout (``Zigzag``): each rank holds a piece from each end of the sequence, or,
    # with tp, of each pair of tp's chunks (``chunks``): tp's sequence parallelism (megatron-sp)
    # splits the sequence contiguously, and two mesh axes may split one tensor axis only along
    # different factors.
    hints = dict(output_hints or {})
    if fusion is not f:  # the tp pass's fusion: its outputs, in the source's order, under their new names
        hints = {out.name: hints[src.name] for src, out in zip(f.outputs, fusion.outputs) if src.name in hints}
    at_rest: dict[str, Placement] = {}
    if fsdp:
        at_rest, whole = cp_at_rest(f, tp, data.at_rest, cp)
        notes += whole
    for n, s in (annotations or {}).items():  # parameters already placed stay where they are
        if not is_replicate(s[cp_axis]):
            at_rest[n] = s[cp_axis]
    with _ring():
        seq = sequence_inputs(f, traced.arguments, cp, chunks(mesh))
        cpf = shard(fusion, "replicate", mesh.sub(cp_axis), annotations=seq, output_hints=hints, target=target,
                    at_rest=at_rest, hoist=False, keep_splits=True)
    passes.append((cp_axis, cpf))
    if mesh.ndim == 1:
        return replace(cpf, mesh=mesh, plan=plan if isinstance(plan, str) else "explicit"), notes
    return combine(passes, mesh, f, plan if isinstance(plan, str) else "explicit"), notes


def cp_at_rest(f: Fusion, tp: Any, dp_at_rest: Mapping[str, Placement], cp: int) -> tuple[dict[str, Placement], list[str]]:
    """FSDP over dp x cp (as Megatron's distributed optimizer shards over the dp and cp ranks):
    each weight dp splits at rest is split over cp too, along the first dimension neither tp nor
    dp splits that cp divides, so every rank holds 1/(dp·cp) of it; (placements, notes for the
    weights that stay whole over cp, and why)."""
    out, notes = {}, []
    for name, p in dp_at_rest.items():
        v = f.value(name)
        taken = {s[0] for s in (axis_split(tp.placement(name)), axis_split(p)) if s is not None}
        dim = next((d for d, n in enumerate(v.shape) if d not in taken and n % cp == 0), None)
        if dim is None:
            notes.append(f"fsdp: {f.label(name) or name} stays whole on cp: no dimension of {list(v.shape)} that tp and dp "
                         f"leave whole is a multiple of {cp}")
        else:
            out[name] = make_shard(dim)
    return out, notes


class _Whole:
    """tp's placements on a mesh without tp: every value whole (what ``multi.data_plan`` asks)."""

    def placement(self, name: str) -> Placement:
        return REPLICATE


def shard_backward(backward: Fusion, forward: Any, target: Any, output_hints: Mapping[str, Placement] | None = None):
    """The backward over the forward's mesh, axis by axis, consistently with it."""
    from nvtp.sharding.multi import combine

    mesh = forward.mesh
    axes = roles(mesh)
    cp_axis = axes["cp"]
    passes = []
    fusion = backward
    if "tp" in axes:
        tp_axis = axes["tp"]
        inputs, hints = backward_annotations(backward, forward.view(tp_axis))
        hints.update(output_hints or {})
        tp = shard(backward, "replicate", mesh.sub(tp_axis), annotations=inputs, output_hints=hints, target=target)
        passes.append((tp_axis, tp))
        fusion = tp.fusion
    if "dp" in axes:  # gradients contract the batch: partial sums over dp, all-reduced (DDP) or reduce-scattered (FSDP)
        dp_axis = axes["dp"]
        inputs, hints = backward_annotations(backward, forward.view(dp_axis))
        hints = {out.name: hints[src.name] for src, out in zip(backward.outputs, fusion.outputs) if src.name in hints}
        at_rest = {n: p for n, p in inputs.items() if backward.role(n) == "parameter" and not is_replicate(p)}
        inputs = {n: (REPLICATE if n in at_rest else p) for n, p in inputs.items()}
        dps = shard(fusion, "replicate", mesh.sub(dp_axis), annotations=inputs, output_hints=hints, target=target, at_rest=at_rest,
                    hoist=False, keep_splits=True)
        passes.append((dp_axis, dps))
        fusion = dps.fusion
    inputs, hints = backward_annotations(backward, forward.view(cp_axis))
    hints.update(output_hints or {})
    if fusion is not backward:
        hints = {out.name: hints[src.name] for src, out in zip(backward.outputs, fusion.outputs) if src.name in hints}
    at_rest = {n: p for n, p in inputs.items() if backward.role(n) == "parameter" and not is_replicate(p)}  # FSDP over cp
    inputs = {n: (REPLICATE if n in at_rest else p) for n, p in inputs.items()}
    with _ring():
        cpb = shard(fusion, "replicate", mesh.sub(cp_axis), annotations=inputs, output_hints=hints, target=target,
                    at_rest=at_rest, hoist=False, keep_splits=True)
    passes.append((cp_axis, cpb))
    if mesh.ndim == 1:
        return replace(cpb, mesh=mesh, plan=forward.plan)
    return combine(passes, mesh, backward, forward.plan)


def chunks(mesh: DeviceMesh) -> int:
    """The chunks each sequence is seen as, each split over cp, each pair of chunks a zigzag
    (``Zigzag``): 2 without tp; with tp the chunks tp's sequence parallelism makes, its extent
    (doubled when odd, so the chunks pair up)."""
    tp = mesh.shape[mesh.names.index("tp")] if "tp" in mesh.names else 1
    return tp if tp % 2 == 0 else 2 * tp


class _ring:
    """The attention rules of a cp pass (``rules.RING``), and its layout (``placements.ZIGZAG``), while it runs."""

    def __enter__(self):
        self.tokens = (RING.set(True), ZIGZAG.set(True))

    def __exit__(self, *exc):
        RING.reset(self.tokens[0])
        ZIGZAG.reset(self.tokens[1])


def ring_axis(mesh: DeviceMesh | None, sharding: tuple[Placement, ...] | None, seq_dim: int = 2) -> int | None:
    """The cp mesh axis that splits an attention operand's sequence (``seq_dim``), or None."""
    if mesh is None or sharding is None or "cp" not in mesh.names:
        return None
    a = mesh.names.index("cp")
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
    """Every point-to-point step the ring attentions of ``sharded`` run: per attention with its
    sequence split over cp (n ranks), the forward passes K and V n-1 times; the backward passes
    K and V n-1 times and their gradients n times (the last step brings them home)."""
    out = []
    mesh = sharded.mesh
    for i, op in enumerate(sharded.fusion.ops):
        if op.kind not in ATTENTION:
            continue
        names = ("key", "value")
        k = op.arg("key")
        axis = ring_axis(mesh, sharded.shardings.get(k.name))
        if axis is None:
            continue
        n = mesh.shape[axis]
        block = local_shape(k.shape, sharded.shardings[k.name], mesh)
        nbytes = _numel(block) * k.dtype.itemsize
        counts = [(t, n - 1) for t in names] if op.kind == "sdpfa_fwd" else \
            [(t, n - 1) for t in names] + [(f"grad_{t}", n) for t in names]
        for t, times in counts:
            for _ in range(times):
                out.append(RingStep(phase, op.outputs[0].name, t, block, k.dtype.value, nbytes, i))
    return out


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n




def ring_records(phase: str, sharded: Any) -> list[dict[str, Any]]:
    """``ring_steps`` as the report's communication records (``nvtp.sharding.report``)."""
    return [{"kind": "sendrecv", "tensor": f"{r.op}/{r.tensor}", "label": f"ring {r.tensor} of {r.op}", "shape": list(r.shape),
             "dtype": r.dtype, "bytes": r.bytes, "tensor_bytes": r.bytes, "from": "cp ring", "to": "next rank"}
            for r in ring_steps(phase, sharded)]


def context_header(report: Any) -> str:
    """The first line of ``nvtp explain`` on a mesh with a cp axis."""
    mesh = report.mesh
    axes = ", ".join(f"{n} {k}" for n, k in zip(mesh.names, mesh.shape))
    tp = f"plan {report.plan} on tp, " if "tp" in mesh.names else "weights whole (no tp axis), "
    return (f"{report.model}: {tp}the sequence split over cp (attention by ring: K/V blocks passed by point-to-point steps, "
            f"no all-gather of K or V), on a mesh of {axes} ({report.devices} devices), "
            f"for the {report.backend} backend")


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
    from nvtp.ir.build import FusionBuilder
    from nvtp.ir.dtypes import DType

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


def write_ring_steps(sharded: Any, directory: Any, name: str = "program") -> list:
    """``ring_step_fusions`` as nvFuser files in ``directory`` (``<name>_ring_step_diagonal.py``, ...)."""
    from pathlib import Path

    from nvtp.ir.printer import format_file

    paths = []
    for step, fusion in ring_step_fusions(sharded):
        path = Path(directory) / f"{name}_{step}.py"
        header = [f"One step of nvtp's ring attention on one rank of the cp axis ({'x'.join(map(str, sharded.mesh.shape))} mesh, "
                  f"{dict(zip(sharded.mesh.names, sharded.mesh.shape))}): attention of the local queries on one K/V block,",
                  "merged with the running output by log-sum-exp. The host passes the K/V blocks between steps (torch.distributed).",
                  "Written by nvtp.sharding.context.write_ring_steps."]
        path.write_text(format_file(fusion, header=header))
        paths.append(path)
    return paths


__all__ = ["ContextError", "RingStep", "check_traced", "chunks", "context_header", "has_cp", "ring_axis", "ring_records",
           "ring_step_fusions", "ring_steps", "sequence_inputs", "shard_backward", "shard_forward", "write_ring_steps"]
