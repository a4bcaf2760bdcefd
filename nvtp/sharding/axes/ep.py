"""The "ep" axis: expert parallelism. Each MoE layer's experts are split over the ep ranks in
contiguous blocks; each rank routes its own tokens and sends each routed row to the rank holding
its expert, and the results back, by all-to-all.

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))      # or ("dp", "ep"), ("ep", "tp")
    sm = nvtp.jit(model, plan="megatron", mesh=mesh)                  # each ep rank passes the whole batch
    loss = sm(idx, targets)                                           # and gets the whole loss

The ep pass runs after tp's and before dp's. It shards what tp left with the 1-D pipeline over
ep's extent, starting from the module's arguments split along their batch (dimension 0: the
ranks of an ep group share its batch, as cp's share a sequence) and every MoE layer's expert
weights split along their expert axis (``Shard(0)``: rank r holds experts ``[r E/P, (r+1) E/P)``);
the other weights stay whole. Everything but the experts is then data parallel over ep: a weight's
gradient contracts the tokens, a partial sum over ep, all-reduced. On the ep axis a ``gather_mm``'s
rows and its experts are one factor (``nvtp.sharding.rules_moe.EXPERTS``), so the experts'
matmuls run where their weights are, by dispatch and combine (``nvtp.execute.ep``), and their
weight gradients need no reduction over ep: the rows of every rank are dispatched to them. On a
(dp, ep) mesh dp splits each ep rank's tokens again (``Shard`` inside ep's: ``_StridedShard``), and
the experts' gradients are all-reduced over dp only (their replicas).

Where the routed rows live is planned per fusion (``expert_layout``): a ``gather_mm``'s result is
held on its experts' ranks, and so is every row-wise op of held rows (``ROWWISE``: an expert
MLP's activation, a gated MLP's halves); an expert op's row operand not held is dispatched once
per routing index, a held value read by any other op is combined once. Each exchange is a step of
the Program with its bytes (``exchanges``): per routing index and fusion the per-expert counts,
then the dispatches and combines. The exchanges are of equal blocks of a static capacity (every
row a rank holds: dropless, no host synchronisation), so the planned bytes are the bytes a run
sends: ``(P-1)/P`` of the send buffer ``[P, rows, width]``.

``capacity_factor=c`` (the axis's option: ``nvtp.jit(..., capacity_factor=1.25)``): each expert
takes at most ``capacity(c, rows, E) = ceil(c * rows / E)`` of a rank's ``rows`` routed rows
(rows = tokens x top_k: Switch's, GShard's and Megatron-Core's ``moe_expert_capacity_factor``),
the first in the rank's row order (Megatron-Core's ``moe_token_drop_policy="position"``); a
dropped row's expert output is zero (the token keeps its other experts' and the residual). The
send buffer is then ``[P, E/P * capacity, width]``: each destination block holds E/P experts'
slots of ``capacity`` rows. The option is kept in the program (``ShardedFusion.options``), so the
planned bytes and the run agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.ir.ops.elementwise import POINTWISE
from nvtp.ir.ops.shapes import pad_pairs, slice_bounds
from nvtp.sharding.axes.strategy import AxisPass, Strategy, passes, register
from nvtp.sharding.moe import module_of, moe_layers
from nvtp.sharding.passes import backward_annotations, shard
from nvtp.sharding.placements import DeviceMesh, Placement, Shard, axis_split, local_shape
from nvtp.sharding.propagate import ShardingError
from nvtp.sharding.report import size_text
from nvtp.sharding.rules_moe import EXPERTS
from nvtp.sharding.sharded import ShardedFusion

NAME = "ep"
BATCH_DIM = 0  # of each module argument: [B, ...]
COUNT_BYTES = 8  # the per-expert counts travel as int64
CAPACITY_FACTOR = "capacity_factor"  # the axis's option (nvtp.options checks its value)


def capacity(factor: float, rows: int, experts: int) -> int:
    """Rows each expert takes from one rank's ``rows`` routed rows under capacity factor
    ``factor``: ``ceil(factor * rows / experts)``, at most ``rows`` (no expert gets more)."""
    return min(rows, math.ceil(factor * rows / experts))


def capacity_factor(sharded: ShardedFusion) -> float | None:
    """The capacity factor ``sharded`` was planned with (None: dropless)."""
    return sharded.options.get(CAPACITY_FACTOR)


class ExpertError(ShardingError):
    """A model or mesh the ep axis cannot shard; says what to change (before any work)."""


class _experts_split:
    """The expert-parallel rules of ``gather_mm`` (``rules_moe.EXPERTS``) while a pass runs."""

    def __enter__(self):
        self.token = EXPERTS.set(True)

    def __exit__(self, *exc):
        EXPERTS.reset(self.token)


def batch_inputs(fusion: Fusion, arguments: Any, ep: int) -> dict[str, Placement]:
    """The module arguments the ep axis splits along their batch (dimension 0)."""
    return {v.name: Shard(BATCH_DIM) for v in fusion.inputs
            if isinstance(v, TensorValue) and fusion.label(v.name) in arguments and v.ndim > BATCH_DIM and v.shape[BATCH_DIM] % ep == 0}


def expert_weights(fusion: Fusion) -> dict[str, Placement]:
    """Every MoE layer's expert weights (fusion inputs), split along their expert axis."""
    inputs = {v.name for v in fusion.inputs}
    return {w: Shard(0) for layer in moe_layers(fusion) for w in layer.weights if w in inputs}


@register
class ExpertParallel(Strategy):
    name = NAME
    summary = "expert parallel: each MoE layer's experts split, tokens dispatched to them and combined back by all-to-all"
    order = 15  # after tp (which splits inside experts), before dp (which splits each ep rank's tokens again)
    backends = frozenset({"reference"})  # nvFuser has no all-to-all inside a fusion: the dispatch would be host-driven
    options = frozenset({CAPACITY_FACTOR})  # each expert's capacity per rank; without it, dropless

    def refuse(self, extent: int, facts: Any) -> str | None:
        """The planner's question (``nvtp.auto``): a dense model, or expert counts ``extent`` does not divide."""
        if not facts.experts:
            return f"ep={extent} splits the experts of mixture-of-experts layers, and this model has none (no 3-D expert weights)"
        if not any(e % extent == 0 for e in facts.experts):
            return f"ep={extent} divides none of the model's expert counts ({', '.join(map(str, sorted(facts.experts)))})"
        return super().refuse(extent, facts)

    def check_traced(self, traced: Any, mesh: DeviceMesh, axis: int, fsdp: bool) -> None:
        """Refuse, before any work: a model with no MoE layer, experts the axis does not divide,
        arguments whose batch it does not divide."""
        ep, f = mesh.shape[axis], traced.forward
        layers = moe_layers(f)
        if not layers:
            raise ExpertError(f"the ep axis (size {ep}) splits the experts of mixture-of-experts layers, and this model has no MoE "
                              "layer (no gather_mm: experts as 3-D weights [E, in, out] indexed by each token's routed expert; "
                              "docs/moe.md); shard a dense model without an 'ep' axis (tp, dp, cp)")
        for layer in layers:
            where = ", ".join(f.label(w) for w in layer.weights) or layer.index
            if ep > layer.experts:
                raise ExpertError(f"the ep axis has {ep} ranks and the MoE layer of {where} has {layer.experts} experts: each ep rank "
                                  f"holds at least one expert; use an ep axis of at most {layer.experts} ranks (a divisor of "
                                  f"{layer.experts}) and put the other ranks on dp")
            if layer.experts % ep:
                raise ExpertError(f"the MoE layer of {where} has {layer.experts} experts, which the ep axis of size {ep} cannot split "
                                  f"evenly; use an ep size that divides {layer.experts}")
        for v in f.inputs:
            if isinstance(v, TensorValue) and f.label(v.name) in traced.arguments and v.ndim > BATCH_DIM and v.shape[BATCH_DIM] % ep \
                    and v.shape[BATCH_DIM] != 1:  # a batch of one broadcasts (a constant of the FX route): every rank holds it
                raise ExpertError(f"argument {f.label(v.name)} {list(v.shape)}: the ep axis of size {ep} splits the batch (dimension "
                                  f"{BATCH_DIM}) between its ranks, each routing its own tokens; pass a batch that is a multiple of {ep}")

    def forward(self, run: AxisPass, axis: int) -> ShardedFusion:
        f = run.traced.forward
        annotations = batch_inputs(f, run.traced.arguments, run.mesh.shape[axis]) | expert_weights(f)
        for n, p in run.placed_on(axis).items():  # parameters already placed stay where they are
            annotations[n] = p
        with _experts_split():
            out = shard(run.current(f), "replicate", run.sub(axis), annotations=annotations,
                        output_hints=run.remap(run.output_hints, f), target=run.target, hoist=False, keep_splits=True)
        return _with_options(out, run)

    def backward(self, run: AxisPass, axis: int, forward: ShardedFusion) -> ShardedFusion:
        b = run.traced.backward
        inputs, hints = backward_annotations(b, forward.view(axis))  # experts' gradients split as they are; the rest summed over ep
        hints.update(run.grad_hints)  # each rank passed the whole arguments: their gradients whole
        with _experts_split():
            out = shard(run.current(b), "replicate", run.sub(axis), annotations=inputs, output_hints=run.remap(hints, b),
                        target=run.target, hoist=False, keep_splits=True)
        return _with_options(out, run)

    def changes_result(self, options: Any) -> str:
        factor = options.get(CAPACITY_FACTOR)
        if factor is None:
            return ""
        return (f"capacity_factor={factor!r}: the ep axis drops each expert's rows past its capacity, which the model run "
                "eagerly does not (compare with an eager model that drops the same rows: docs/moe.md)")

    def extra_steps(self, phase: str, sharded: ShardedFusion, axis: int) -> list[dict[str, Any]]:
        return exchanges(phase, sharded, axis)

    def headline(self, report: Any, axis: int) -> str:
        return "experts split over ep (tokens dispatched to their experts' ranks and combined back by all-to-all)"

    def report_lines(self, report: Any, axis: int) -> list[str]:
        return expert_lines(report, axis)


def _with_options(sharded: ShardedFusion, run: AxisPass) -> ShardedFusion:
    """``sharded`` holding the axis's options given (the capacity factor), for its steps and its run."""
    given = {k: v for k, v in run.options.items() if k in ExpertParallel.options}
    return replace(sharded, options={**sharded.options, **given}) if given else sharded


# ---------------------------------------------------------------------------------------------
# where the expert rows live, and the exchanges that move them, as the plan and the run share them

def _same_rows(op: Any) -> bool:
    """Every row operand has the result's shape (no broadcast across rows)."""
    return all(a.shape == op.outputs[0].shape for a in _row_operands(op))


def _slice_keeps_rows(op: Any) -> bool:
    x = op.operands[0]
    return slice_bounds(x, op.arg("start_indices"), op.arg("end_indices"), op.arg("strides"))[0] == (0, x.shape[0], 1)


def _pad_keeps_rows(op: Any) -> bool:
    return pad_pairs(op.operands[0].ndim, op.arg("pad_widths"))[0] == (0, 0)


# Ops whose result row s is computed from their operands' rows s alone, when the check holds: run
# on the rows where they are held (an expert MLP's activation, a gated MLP's gate|up halves and the
# backward's pads of them). A ``set`` reshards, so it is none of them. Extend with an op and its check.
ROWWISE: dict[str, Any] = {k: _same_rows for k in POINTWISE - {"set", "segment_set"}} | {
    "slice": _slice_keeps_rows, "pad": _pad_keeps_rows}


@dataclass(frozen=True)
class Exchange:
    """One all-to-all of an ep program: ``part`` "counts" (the per-expert counts of ``index``'s
    rows, ``[P, E/P]`` int64), "dispatch" (``value``'s rows to their experts' ranks) or "combine"
    (``value``'s rows back); issued at op ``position`` (its first result ``op``), a send buffer of
    ``shape`` ``[P, block, width]`` of which a rank sends the P - 1 blocks for the others."""

    part: str
    position: int
    op: str
    value: str
    index: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    @property
    def bytes(self) -> int:
        return _numel(self.shape) * self.itemsize * (self.shape[0] - 1) // self.shape[0]


@dataclass(frozen=True)
class Layout:
    """Where an ep program's routed rows live (``expert_layout``). A value in ``held`` (name ->
    its routing index's name) is held on its experts' ranks, in the received order: a
    ``gather_mm``'s result on the experts it splits, and every ``ROWWISE`` op of such values (an
    expert MLP's activation, the backward's products), computed there. ``runs``: the ops (first
    result) the run computes on held rows (``nvtp.execute.ep``). A row operand of those ops that
    is not held is dispatched once (``exchanges``); a held value any other op reads, or the
    fusion returns, is combined back once, where it is made (``combined``)."""

    axis: int
    held: dict[str, str]
    runs: frozenset[str]
    combined: frozenset[str]
    exchanges: tuple[Exchange, ...]


def _split_experts(fusion: Fusion, shardings: Any, axis: int) -> list[tuple[int, Any]]:
    """(index, op) of each ``gather_mm`` / ``gather_mm_wgrad`` whose experts the ep axis ``axis`` splits."""
    out = []
    for i, op in enumerate(fusion.ops):
        experts = op.arg("arg2") if op.kind == "gather_mm" else op.outputs[0] if op.kind == "gather_mm_wgrad" else None
        if experts is None:
            continue
        split = axis_split(shardings[experts.name][axis])
        if split is not None:
            if split[0] != 0:
                raise ShardingError(f"{op}: the ep axis places its experts {shardings[experts.name][axis]}; it splits "
                                    "their expert axis (Shard(0))")
            out.append((i, op))
    return out


def _row_operands(op: Any) -> list[TensorValue]:
    return [a for _, a in op.args if isinstance(a, TensorValue) and a.ndim > 0]


def expert_layout(fusion: Fusion, shardings: Any, mesh: DeviceMesh, factor: float | None = None) -> Layout | None:
    """The layout of ``fusion``'s routed rows on ``mesh``'s ep axis (None: no expert it splits).

    Requires the fusion's ops in run order; ensures each exchange is listed once, in the order a
    rank issues them: at an op that runs on held rows, the counts of its index (first use), then
    the dispatch of each row operand not yet held or dispatched; after an op whose result is
    combined, the combine. The blocks: every row a rank holds (dropless), or with capacity factor
    ``factor`` E/P experts' ``capacity`` rows each."""
    if NAME not in mesh.names or mesh.shape[mesh.names.index(NAME)] == 1:
        return None
    axis = mesh.names.index(NAME)
    split = dict(_split_experts(fusion, shardings, axis))
    if not split:
        return None
    n = mesh.shape[axis]
    held: dict[str, str] = {}
    runs: set[str] = set()
    for i, op in enumerate(fusion.ops):
        if i in split:
            runs.add(op.outputs[0].name)
            if op.kind == "gather_mm":
                held[op.outputs[0].name] = op.arg("index").name
        elif op.kind in ROWWISE and len(op.outputs) == 1:
            rows = _row_operands(op)
            indices = {held.get(a.name) for a in rows}
            if rows and None not in indices and len(indices) == 1 and ROWWISE[op.kind](op):
                held[op.outputs[0].name] = indices.pop()
                runs.add(op.outputs[0].name)
    combined = {v.name for v in fusion.outputs if v.name in held}
    for i, op in enumerate(fusion.ops):
        reads_held = {a.name for _, a in op.args if isinstance(a, TensorValue) and a.name in held}
        if not reads_held:
            continue
        if op.outputs and op.outputs[0].name in runs:
            index = held.get(op.outputs[0].name) or op.arg("index").name
            ok = {a.name for a in ([op.arg("arg1")] if op.kind == "gather_mm" else [op.arg("arg1"), op.arg("arg2")]
                                   if op.kind == "gather_mm_wgrad" else _row_operands(op)) if held.get(a.name) == index}
            combined |= reads_held - ok
        else:
            combined |= reads_held

    def local(v: TensorValue) -> tuple[int, ...]:
        return local_shape(v.shape, shardings[v.name], mesh)

    out: list[Exchange] = []
    routed: dict[str, int] = {}  # index -> a destination's block of rows
    sent: set[tuple[str, str]] = set()
    for i, op in enumerate(fusion.ops):
        name = op.outputs[0].name if op.outputs else None
        if i in split:
            index = op.arg("index")
            if index.name not in routed:
                experts = op.arg("arg2").shape[0] if op.kind == "gather_mm" else op.arg("groups")
                rows = local(index)[0]
                routed[index.name] = rows if factor is None else experts // n * capacity(factor, rows, experts)
                out.append(Exchange("counts", i, name, index.name, index.name, (n, experts // n), "int64", COUNT_BYTES))
            for v in [op.arg("arg1")] + ([op.arg("arg2")] if op.kind == "gather_mm_wgrad" else []):
                if held.get(v.name) != index.name and (v.name, index.name) not in sent:
                    sent.add((v.name, index.name))
                    out.append(Exchange("dispatch", i, name, v.name, index.name, (n, routed[index.name], local(v)[1]),
                                        v.dtype.value, v.dtype.itemsize))
        if name in combined:
            v = op.outputs[0]
            out.append(Exchange("combine", i, name, name, held[name], (n, routed[held[name]], local(v)[1]), v.dtype.value,
                                v.dtype.itemsize))
    return Layout(axis, held, frozenset(runs), frozenset(combined), tuple(out))


def exchanges(phase: str, sharded: ShardedFusion, axis: int) -> list[dict[str, Any]]:
    """The all-to-alls of ``sharded``'s expert rows (``expert_layout``), in the order a rank runs
    them (``nvtp.execute.ep``), as the report's communication records."""
    layout = expert_layout(sharded.fusion, sharded.shardings, sharded.mesh, capacity_factor(sharded))
    out = []
    for x in layout.exchanges if layout is not None else ():
        total = _numel(x.shape) * x.itemsize
        out.append({"kind": "alltoall", "tensor": f"{x.value}/{x.part}", "label": f"{x.part} of {x.value}",
                    "shape": list(x.shape), "dtype": x.dtype, "bytes": x.bytes, "tensor_bytes": total, "payload": total,
                    "from": f"{NAME} ranks", "to": f"{NAME} ranks", "position": x.position, "value": x.op, "part": x.part})
    return out


def expert_lines(report: Any, axis: int) -> list[str]:
    """``nvtp explain``'s lines for the ep axis: the experts each rank holds, per MoE layer, and
    the bytes a rank sends per step by all-to-all (counts, dispatch, combine; forward and
    backward), against what the routed rows alone would take (1/P of the padded blocks)."""
    mesh = report.mesh
    n = mesh.shape[axis]
    data = [(s.name, a) for s, a in passes(mesh) if s.splits_batch]
    layout = (f"; with {data[0][0]}, the batch is split over {data[0][0]} x ep ({data[0][0]} splits each ep rank's part again), "
              f"the experts' gradients reduced over {data[0][0]} only" if data else "")
    factor = capacity_factor(report.regions[0].forward) if report.regions else None
    held_rows = ("every row a rank holds: dropless" if factor is None else
                 f"capacity factor {factor:g}: each expert takes at most ceil({factor:g} x a rank's routed rows / experts) of a "
                 "rank's rows, the later ones in the rank's order dropped (Megatron-Core's 'position' drop policy)")
    lines = [f"ep: {n} ranks; each routes its own 1/{n} of the tokens and holds a contiguous block of every MoE layer's "
             f"experts; all-to-alls of {n} equal blocks of a static capacity ({held_rows}; no host "
             f"synchronisation){layout}"]
    for r in report.regions:
        f = r.forward.source
        held: dict[str, list[str]] = {}
        for layer in moe_layers(f):
            per = layer.experts // n
            text = (f"{layer.experts} experts, top-{layer.top_k}: {per} experts per ep rank (rank r: experts "
                    + (f"{per}r..{per}r+{per - 1})" if per > 1 else "r)"))
            held.setdefault(text, []).append(module_of(f, layer) + (f" x {r.count}" if r.count > 1 else ""))
        lines += [f"  {', '.join(modules)}: {text}" for text, modules in held.items()]
        for phase, sharded in (("forward", r.forward), ("backward", r.backward)):
            sent: dict[str, int] = {}
            for rec in exchanges(phase, sharded, axis) if sharded is not None else ():
                sent[rec["part"]] = sent.get(rec["part"], 0) + r.count * rec["bytes"]
            if sent:
                rows = sum(b for k, b in sent.items() if k != "counts")
                uniform = rows // n if factor is None else round(rows / factor)  # capped: each expert c times its even share
                rest = "the rest pads the static capacity" if factor is None else f"the capacity factor {factor:g} sizes the buffers"
                lines.append(f"  {phase} all-to-all bytes per rank per step: " + ", ".join(f"{k} {size_text(b)}" for k, b in sent.items())
                             + f" (the same exchanges of the routed rows alone, routed uniformly: {size_text(uniform)}; {rest})")
    return lines


def _numel(shape) -> int:
    out = 1
    for x in shape:
        out *= x
    return out


__all__ = ["ExpertError", "ExpertParallel", "NAME", "Exchange", "Layout", "batch_inputs", "exchanges", "expert_layout", "expert_weights"]
