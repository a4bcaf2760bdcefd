"""Sharding plans: which placement each fusion input starts with.

``megatron`` is derived from the fusion graph, not from parameter names. A *projection* is a
``linear`` whose weight is a fusion input. Projection P is column-parallel when splitting its
output features reaches the contracted input of another projection Q without communication
(through pointwise ops, reshapes, attention, ...); Q is then row-parallel. Whether the sharding
gets through is asked of the propagation itself, so any block Thunder traces pairs up: fused or
separate q/k/v, GQA, SwiGLU, with or without biases. A fused projection (its output sliced into
k equal parts, like QKV's 3e into q, k, v) is split as ``_StridedShard(0, k)``: each rank holds
its slice of each part, so no weight is permuted by hand. A fused projection of parts of
*different* sizes (Phi-3's q 64 | k 32 | v 32) reaches the plans already split into one
projection per part by the FX front end (``nvtp.frontend.fused``). KV heads fewer than the
devices (multi-query attention) stay whole on every rank, named in the notes.

``megatron-sp`` adds sequence parallelism (Korthikanti et al., arXiv 2205.05198): activation
inputs are split along the sequence, so LayerNorm, dropout and residual regions run on 1/d of
the tokens, and the all-reduces become all-gathers and reduce-scatters.

Explicit plans map parameter-name globs (or module-name globs) to placements, ``"colwise"`` /
``"rowwise"``, or torch's ``ColwiseParallel()`` / ``RowwiseParallel()``; a per-input plan maps a
dumped fusion's value names (``T3``) to placements.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from nvtp.ir.graph import Fusion, Op, TensorValue
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Placement, Replicate, Shard, _StridedShard, axis_split, make_shard
from nvtp.sharding.projections import Projection, projections
from nvtp.sharding.propagate import ShardingError, propagate_locally, reshard_bytes


@dataclass
class Annotations:
    """A plan applied to one fusion: input value -> placement, and what it decided and why."""

    placements: dict[str, Placement]
    notes: list[str] = field(default_factory=list)
    column: list[str] = field(default_factory=list)
    row: list[str] = field(default_factory=list)
    hints: dict[str, Placement] = field(default_factory=dict)  # soft wishes for values inside the fusion


def _activation_inputs(fusion: Fusion) -> list[TensorValue]:
    return [v for v in fusion.inputs if isinstance(v, TensorValue) and fusion.role(v.name) in ("activation", "input", "")]


def megatron(fusion: Fusion, mesh: DeviceMesh, *, sequence_parallel: bool = False, vocab_parallel: bool = True,
             split_experts: bool = True) -> Annotations:
    """Column/row-parallel pairs found by propagation; with ``vocab_parallel``, token embeddings
    split along the vocabulary and an unpaired projection split along its outputs when what it
    then communicates is smaller than its output (an LM head feeding cross-entropy: Megatron's
    parallel cross-entropy); everything else replicated. With sequence parallelism, activation
    inputs ``[batch, seq, ...]`` are split along the sequence (axis 1). Without ``split_experts``
    (a target that cannot hold an expert's partial sum: ``Target.split_experts``) experts stay whole."""
    projs = [p for p in projections(fusion) if split_experts or p.op.kind != "gather_mm"]
    column: dict[str, Projection] = {}
    row: dict[str, Projection] = {}
    paired = _Paired(fusion, projs)
    for p in projs:
        if p.weight in column or p.weight in row:
            continue
        partner = paired.again(p)
        if partner is None:
            partner = _row_partner(fusion, mesh, p, projs)
            paired.remember(p, partner)
        if partner is None:
            continue
        column[p.weight] = p
        if partner.weight not in column:
            row[partner.weight] = partner
    vocab: list[str] = []
    if vocab_parallel:
        vocab = _vocab_parallel_embeddings(fusion, mesh)
        for p in projs:
            # Not KV heads fewer than the devices: they stay whole (split, they would be gathered again)
            if p.weight not in column and p.weight not in row and not _heads_fewer_than_devices(fusion, mesh, p) \
                    and _pays_to_split(fusion, mesh, p):
                column[p.weight] = p
    placements: dict[str, Placement] = {}
    for v in fusion.inputs:
        if isinstance(v, TensorValue):
            placements[v.name] = REPLICATE
    for w in vocab:
        placements[w] = Shard(0)
    for w, p in column.items():
        placements[w] = make_shard(p.out_axis, p.split_factor)
        if p.bias:
            placements[p.bias] = make_shard(0, p.split_factor)
    for w, p in row.items():
        placements[w] = Shard(p.in_axis)
    notes = [f"column-parallel {fusion.label(w)} ({'fused, ' + str(p.split_factor) + ' parts' if p.split_factor > 1 else 'split output features'})" for w, p in column.items()]
    notes += [f"row-parallel {fusion.label(w)}" for w in row]
    notes += [f"vocab-parallel {fusion.label(w)} (embedding rows split; lookups give partial sums)" for w in vocab]
    whole = [p for p in projs if p.weight not in column and p.weight not in row]
    few = {p.weight: h for p in whole if (h := _heads_fewer_than_devices(fusion, mesh, p))}
    for h in sorted(set(few.values())):
        names = ", ".join(fusion.label(w) for w, k in few.items() if k == h)
        notes.append(f"replicated KV heads ({h} head{'s' if h > 1 else ''}, fewer than the {mesh.size} devices: every rank computes "
                     f"them whole and their weights' gradients are summed over the ranks): {names}")
    unpaired = [fusion.label(p.weight) for p in whole if p.weight not in few]
    if unpaired:
        notes.append("replicated (no row-parallel partner): " + ", ".join(unpaired))
    hints: dict[str, Placement] = {}
    if sequence_parallel:
        for v in _activation_inputs(fusion):
            if v.ndim >= 2 and v.dtype.is_float:
                _check_sequence(fusion, v, mesh)
                placements[v.name] = Shard(1)
                notes.append(f"sequence-parallel {fusion.label(v.name)}: split along axis 1")
        for name in _embedding_streams(fusion):
            v = fusion.value(name)
            _check_sequence(fusion, v, mesh)
            if v.shape[1] % mesh.size == 0:
                hints[name] = Shard(1)
                notes.append(f"sequence-parallel from the embedding on ({name}: {v.dtype.value}{list(v.shape)} split along axis 1)")
    return Annotations(placements, notes, [fusion.label(w) for w in column], [fusion.label(w) for w in row], hints)


def _check_sequence(fusion: Fusion, v: TensorValue, mesh: DeviceMesh) -> None:
    n, d = v.shape[1], mesh.size
    if n % d:
        label = fusion.label(v.name)
        raise ShardingError(f"{label} ({v.describe()}): sequence parallelism splits axis 1 (the sequence, size {n}) over {d} devices, "
                            f"but {d} does not divide {n}; choose a mesh size that divides {n}, or plan megatron (no sequence parallelism)")


def _embedding_streams(fusion: Fusion) -> list[str]:
    """The [batch, seq, ...] activations token-embedding lookups produce (after the reshape back
    from the flattened lookup): where the residual stream of a whole model starts."""
    inputs = {v.name for v in fusion.inputs}
    consumers = fusion.consumers()
    found = []
    for op in fusion.ops:
        if op.kind in ("embedding_fwd", "index_select") and op.operands[0].name in inputs:
            v = op.outputs[0]
            while v.ndim < 3:
                users = [u for u in consumers.get(v.name, []) if u.kind in ("reshape", "cast")]
                if len(users) != 1:
                    break
                v = users[0].outputs[0]
            if v.ndim >= 3:
                found.append(v.name)
    return found


def _vocab_parallel_embeddings(fusion: Fusion, mesh: DeviceMesh) -> list[str]:
    """Weights of embedding lookups (``embedding_fwd``, or ``index_select`` of rows) of token ids:
    indices that come from an argument of the fusion, not computed positions nor positions the
    model holds (a buffer, or the FX route's constant position ids)."""
    inputs = {v.name for v in fusion.inputs}
    producers = fusion.producers()

    def from_input(v) -> bool:
        while v.name not in inputs:
            op = producers.get(v.name)
            if op is None or op.kind not in ("reshape", "cast", "set", "squeeze", "broadcast_in_dim"):
                return False
            v = op.operands[0]
        return fusion.role(v.name) != "parameter"  # token ids are an argument; positions held by the model are not

    found = []
    for op in fusion.ops:
        if op.kind == "embedding_fwd":
            w, idx = op.arg("weight"), op.arg("input")
        elif op.kind == "index_select" and op.arg("dim") == 0:
            w, idx = op.arg("arg"), op.arg("index")
        else:
            continue
        if w.name in inputs and w.ndim == 2 and idx.dtype.is_int and from_input(idx) and w.name not in found:
            vocab, d = w.shape[0], mesh.size
            if vocab % d:
                label = fusion.label(w.name)
                raise ShardingError(f"{label} ({w.describe()}): the vocabulary-parallel embedding splits axis 0 (the vocabulary, size "
                                    f"{vocab}) over {d} devices, but {d} does not divide {vocab}; pad the vocabulary to a multiple "
                                    f"of {d} ({-(-vocab // d) * d}, as Megatron-LM pads it) or choose a mesh size that divides {vocab}")
            found.append(w.name)
    return found


class _Paired:
    """The pairs found so far, to pair a renamed copy of a block (``Op.template``: the regional
    splice) as its first copy was paired without probing again. A pair P -> Q is taken again for P'
    only where the ops from P' to Q' are, one for one, copies of the same ops as those from P to Q:
    what a probe reaches between them is then the same computation, with everything outside it
    replicated in the probe alike. Anything else is probed (``_row_partner``)."""

    def __init__(self, fusion: Fusion, projs: list[Projection]):
        self.fusion = fusion
        self.at = {p.op_index: p for p in projs}
        self.first: dict[int, tuple[int, int]] = {}  # id(template of P's op) -> (P's op index, Q's op index)

    def remember(self, p: Projection, q: Projection | None) -> None:
        if q is not None and p.op.template is not None and q.op_index > p.op_index:
            self.first.setdefault(id(p.op.template), (p.op_index, q.op_index))

    def again(self, p: Projection) -> Projection | None:
        if p.op.template is None or id(p.op.template) not in self.first:
            return None
        p0, q0 = self.first[id(p.op.template)]
        ops, n = self.fusion.ops, q0 - p0
        if p.op_index + n >= len(ops) or p.op_index == p0:
            return None
        if not all(ops[p.op_index + k].template is not None and ops[p.op_index + k].template is ops[p0 + k].template
                   for k in range(n + 1)):
            return None
        return self.at.get(p.op_index + n)


def _pays_to_split(fusion: Fusion, mesh: DeviceMesh, p: Projection) -> bool:
    """An unpaired projection is split along its outputs when everything that then has to be
    communicated is smaller than gathering its output would be."""
    d = mesh.size if mesh.size > 1 else 2
    w = fusion.value(p.weight)
    if w.shape[p.out_axis] % (p.split_factor * d):
        return False
    prop = _trial(fusion, DeviceMesh.of_size(d), p, {v.name: REPLICATE for v in fusion.outputs if isinstance(v, TensorValue)})
    comm = sum(reshard_bytes(prop.placements[r.value], r.placement, fusion.value(r.value).nbytes, d)
               for r in prop.requirements if r.op_index > p.op_index)
    out = p.op.outputs[0]
    return comm < (d - 1) / d * out.nbytes


def _row_partner(fusion: Fusion, mesh: DeviceMesh, p: Projection, projs: list[Projection]) -> Projection | None:
    """The projection whose contracted input P's split output reaches without communication.

    Pairing is structural, so it is probed on a mesh of the mesh's size when that divides P's
    output features, else on the smallest size that does (the plan's divisibility is checked
    separately, with a message saying what to change)."""
    features = fusion.value(p.weight).shape[p.out_axis] // p.split_factor
    sizes = [mesh.size] if mesh.size > 1 and features % mesh.size == 0 else []
    sizes += [k for k in range(2, 8) if features % k == 0]
    if not sizes:
        return None
    probe = DeviceMesh.of_size(sizes[0])
    partner = _partner_on(fusion, probe, p, projs)
    if partner is None:
        # Does it pair on another mesh size? Then some axis on the way (heads, KV heads) does not
        # divide by this one, and the pair is never silently dropped: on this mesh the plan is
        # refused, saying why; probed on another size (this one does not divide the features),
        # the pair stands and the divisibility check refuses it. The sizes tried: the factors of
        # the outer sizes the split output is blocked at (3 heads on 2 devices: 3, a larger
        # mesh), then the smallest divisor of the features below the probed size.
        others = [k for k in _blocking_factors(fusion, probe, p) if features % k == 0]
        others += [k for k in sizes[1:2] if k < probe.size]
        for k in dict.fromkeys(k for k in others if k != probe.size):
            q = _partner_on(fusion, DeviceMesh.of_size(k), p, projs)
            if q is not None and probe.size != mesh.size:
                return q
            if q is not None:
                raise ShardingError(_blocked_pair(fusion, mesh, p, q, k))
    return partner


def _heads_fewer_than_devices(fusion: Fusion, mesh: DeviceMesh, p: Projection) -> int | None:
    """h when P's output is reshaped into ``[..., h, head_dim]`` with h heads fewer than the devices
    and dividing their number (multi-query attention's one KV head on 2 devices): why P stays
    whole, as vLLM keeps KV heads whole when there are fewer than devices. None otherwise."""
    d = mesh.size
    out = p.op.outputs[0]
    users = fusion.consumers().get(out.name, [])
    while len(users) == 1 and users[0].kind == "cast":
        out = users[0].outputs[0]
        users = fusion.consumers().get(out.name, [])
    for u in users:
        if u.kind == "reshape":
            group = _reshape_group(out.shape, u.outputs[0].shape, out.ndim - 1)
            if group and len(group) > 1 and 1 <= group[0] < d and d % group[0] == 0:
                return group[0]
    return None


def _blocking_factors(fusion: Fusion, mesh: DeviceMesh, p: Projection) -> list[int]:
    """The smallest prime factor of each outer size P's split output cannot be split along on
    ``mesh``: a reshape of the split axis into ``[h, ...]`` with ``h`` not divisible by the mesh."""
    prop = _trial(fusion, mesh, p)
    found = []
    for r in prop.requirements:
        if r.op_index < p.op_index:
            continue
        v = fusion.value(r.value)
        op = fusion.ops[r.op_index]
        split = axis_split(prop.placements[r.value])
        if op.kind != "reshape" or split is None or not reshard_bytes(prop.placements[r.value], r.placement, v.nbytes, mesh.size):
            continue
        group = _reshape_group(v.shape, op.outputs[0].shape, split[0])
        if group and len(group) > 1 and group[0] % mesh.size and group[0] > 1:
            found.append(next(k for k in range(2, group[0] + 1) if group[0] % k == 0))
    return found


def _trial(fusion: Fusion, d_mesh: DeviceMesh, p: Projection, output_hints: Mapping[str, Placement] | None = None):
    """Propagation with only P column-parallel (its weight and bias split along their outputs,
    the other non-parameter inputs replicated): where P's split output goes by itself."""
    trial = {p.weight: make_shard(p.out_axis, p.split_factor)}
    if p.bias:
        trial[p.bias] = make_shard(0, p.split_factor)
    for v in fusion.inputs:
        if isinstance(v, TensorValue) and v.name not in trial and fusion.role(v.name) != "parameter":
            trial[v.name] = REPLICATE
    return propagate_locally(fusion, d_mesh, trial, output_hints)  # linear in what P's split reaches


def _blocked_pair(fusion: Fusion, mesh: DeviceMesh, p: Projection, q: Projection, paired_on: int) -> str:
    """Why P's split output cannot reach Q on ``mesh`` (it does on ``paired_on`` devices): the
    first op that would communicate, and the two ways out."""
    from nvtp.ir.printer import format_op

    prop = _trial(fusion, mesh, p)
    d = mesh.size
    head = (f"{fusion.label(p.weight)} ({fusion.value(p.weight).describe()}) cannot be column-parallel with row-parallel "
            f"{fusion.label(q.weight)} over {d} devices")
    whole = (f"or an explicit plan that leaves {fusion.label(p.weight)} and {fusion.label(q.weight)} whole (replicated; "
             "docs/plans.md)")
    for r in prop.requirements:
        if not p.op_index <= r.op_index <= q.op_index:
            continue
        v = fusion.value(r.value)
        if not reshard_bytes(prop.placements[r.value], r.placement, v.nbytes, d):
            continue
        op = fusion.ops[r.op_index]
        split = axis_split(prop.placements[r.value])
        if op.kind == "reshape" and split is not None:
            group = _reshape_group(v.shape, op.outputs[0].shape, split[0])
            if group and len(group) > 1 and group[0] % d:
                return (f"{head}: its split output reaches `{format_op(op)}`, which splits axis {split[0]} (size "
                        f"{v.shape[split[0]]}) into {group}, and {d} devices do not divide the outer {group[0]} (attention "
                        f"heads, or KV heads with grouped-query attention); choose a mesh size that divides {group[0]}, {whole}")
        return (f"{head}: its split output reaches `{format_op(op)}`, which would need {v.name} as {r.placement} instead of "
                f"{prop.placements[r.value]} (a communication inside the pair); choose a mesh size that divides the "
                f"axes on the way (it pairs over {paired_on} devices), {whole}")
    return f"{head}; choose a mesh size that divides the axes between them (it pairs over {paired_on} devices), {whole}"


def _reshape_group(src: tuple[int, ...], dst: tuple[int, ...], axis: int) -> list[int] | None:
    """The output sizes axis ``axis`` of ``src`` becomes under a reshape to ``dst`` (None if it merges)."""
    i = j = 0
    while i < len(src) and j < len(dst):
        a, group, b = src[i], [dst[j]], dst[j]
        j += 1
        while b < a and j < len(dst):
            group.append(dst[j])
            b *= dst[j]
            j += 1
        if b != a:
            return None
        if i == axis:
            return group
        i += 1
    return None


def _partner_on(fusion: Fusion, d_mesh: DeviceMesh, p: Projection, projs: list[Projection]) -> Projection | None:
    prop = _trial(fusion, d_mesh, p)
    for q in projs:
        if q is p or q.op_index < p.op_index:
            continue
        x = q.op.arg("arg1")
        placed = prop.placements.get(x.name)
        if placed != Shard(x.ndim - 1):
            continue
        # No communication may happen on the way from P to Q.
        comm = 0.0
        for r in prop.requirements:
            if p.op_index <= r.op_index <= q.op_index:
                comm += reshard_bytes(prop.placements[r.value], r.placement, fusion.value(r.value).nbytes, d_mesh.size)
        if comm == 0:
            return q
    return None


# ---------------------------------------------------------------------------------------------
# explicit plans

_PLACEMENT = re.compile(r"^\s*(?:(_?S)\((\d+)(?:\s*,\s*(\d+))?\)|(R)|(replicate)|(colwise)|(rowwise))\s*$", re.I)


def parse_placement(text: str) -> Any:
    """``S(0)``, ``S(2, 3)`` / ``_S(2, 3)``, ``R`` / ``replicate``, ``colwise``, ``rowwise``."""
    m = _PLACEMENT.match(text)
    if not m:
        raise ShardingError(f"unknown placement {text!r}; write S(dim), S(dim, split_factor), R, colwise or rowwise")
    if m.group(2) is not None:
        return make_shard(int(m.group(2)), int(m.group(3) or 1))
    if m.group(4) or m.group(5):
        return REPLICATE
    return "colwise" if m.group(6) else "rowwise"


def parse_plan_text(text: str) -> dict[str, Any]:
    """``glob=placement;glob=placement`` as written on the command line."""
    plan: dict[str, Any] = {}
    if "=" not in text:
        raise ShardingError(f"unknown plan {text!r}; use megatron, megatron-sp, replicate, or an explicit plan "
                            "'glob=placement;...' (placements S(d), S(d,k), R, colwise, rowwise)")
    for item in filter(None, (s.strip() for s in re.split(r"[;\n]", text))):
        if "=" not in item:
            raise ShardingError(f"plan entry {item!r} is not `name-or-glob=placement`")
        key, value = item.split("=", 1)
        plan[key.strip()] = parse_placement(value)
    return plan


PLAN_NAMES = ("megatron", "megatron-sp", "replicate", "none")


def check_plan(plan: str | Mapping[str, Any], names: Iterable[str], owner: str = "the module") -> None:
    """Refuse, before anything is traced, a plan that cannot apply to a module whose parameters,
    buffers and arguments are ``names``: an unknown plan name, an entry that is not a placement or
    a style, a glob that matches no name and no module (a name's prefix before its last dot).
    Entries naming fusion values (``T3``) are checked once the fusion exists."""
    if isinstance(plan, str):
        if plan in PLAN_NAMES:
            return
        plan = parse_plan_text(plan)
    if not isinstance(plan, Mapping):
        raise ShardingError(f"plan {plan!r} is neither a plan name ({', '.join(PLAN_NAMES[:3])}) nor a mapping of name globs to placements")
    names = sorted(set(names))
    modules = {n.rsplit(".", 1)[0] for n in names if "." in n}
    for pattern, raw in plan.items():
        _style(raw)
        if re.fullmatch(r"T\d+", pattern) or any(fnmatch.fnmatchcase(n, pattern) for n in [*names, *modules]):
            continue
        raise ShardingError(f"plan entry {pattern!r} matches no parameter or module of {owner}; correct the name or glob (globs "
                            f"match parameter or module names); parameters are: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''}")


def _style(value: Any) -> str | Placement:
    """A plan entry as a placement or 'colwise' / 'rowwise' (accepting torch's ParallelStyle objects)."""
    if isinstance(value, str):
        return parse_placement(value)
    if isinstance(value, (Shard, _StridedShard, Replicate)):
        return value
    name = type(value).__name__
    if name == "ColwiseParallel":
        return "colwise"
    if name == "RowwiseParallel":
        return "rowwise"
    raise ShardingError(f"plan entry {value!r} is not a placement, 'colwise', 'rowwise', ColwiseParallel() or RowwiseParallel()")


def explicit(fusion: Fusion, mesh: DeviceMesh, plan: Mapping[str, Any]) -> Annotations:
    """Placements from name globs. A glob may name parameters (``*.c_fc.weight``) or modules
    (``*.c_fc``: colwise/rowwise then set its weight and bias as torch's styles do). Inputs no
    glob names are replicated; globs that match nothing are an error."""
    labels = {fusion.label(v.name): v for v in fusion.inputs if isinstance(v, TensorValue)}
    tied = _tied_aliases(fusion)  # a tied parameter's other names (lm_head.weight for wte.weight): the same input
    labels |= {alias: labels[name] for alias, name in tied.items() if name in labels}
    by_value = {v.name: v for v in fusion.inputs if isinstance(v, TensorValue)}
    projs = {p.weight: p for p in projections(fusion)}
    placements: dict[str, Placement] = {v.name: REPLICATE for v in by_value.values()}
    placed_by: dict[str, str] = {}  # value -> the plan entry that placed it
    notes = []

    def place(v: TensorValue, placement: Placement, pattern: str) -> None:
        other = placed_by.get(v.name)
        label = fusion.label(v.name)
        if other is not None and placements[v.name] != placement and label in tied.values():
            # One tensor under two names, each placed its own way: the weight has one placement (the
            # first entry's), the other use gets it by a reshard; said in the notes, never a broken tie.
            also = ", ".join(a for a, n in tied.items() if n == label)
            notes.append(f"tied weight {label} (also {also}): entries {other!r} and {pattern!r} place it {placements[v.name]} and "
                         f"{placement}; kept {placements[v.name]} ({other!r}), the other use reshards")
            return
        if other is not None and placements[v.name] != placement:
            raise ShardingError(f"plan entries {other!r} and {pattern!r} both place {label} ({v.describe()}), as {placements[v.name]} "
                                f"and as {placement}; make the globs disjoint or give them the same placement")
        placements[v.name], placed_by[v.name] = placement, pattern

    for pattern, raw in plan.items():
        style = _style(raw)
        matched = [name for name in labels if fnmatch.fnmatchcase(name, pattern)]
        matched += [name for name in by_value if fnmatch.fnmatchcase(name, pattern) and name not in labels]
        modules = sorted({n.rsplit(".", 1)[0] for n in labels if "." in n and fnmatch.fnmatchcase(n.rsplit(".", 1)[0], pattern)})
        if not matched and not modules:
            known = ", ".join(sorted(labels)[:12])
            raise ShardingError(f"plan entry {pattern!r} matches no input of {fusion.name}; correct the name or glob "
                                f"(globs match parameter or module names); inputs are: {known}{', ...' if len(labels) > 12 else ''}")
        for name in matched:
            v = labels.get(name) or by_value[name]
            place(v, _resolve(style, v, fusion, projs, is_bias=name.endswith(".bias")), pattern)
        for module in modules:
            for suffix in ("weight", "bias"):
                v = labels.get(f"{module}.{suffix}")
                if v is not None:
                    place(v, _resolve(style, v, fusion, projs, is_bias=suffix == "bias"), pattern)
        notes.append(f"{pattern} -> {raw if isinstance(raw, str) else type(raw).__name__ if not isinstance(raw, (Shard, _StridedShard, Replicate)) else raw}")
    return Annotations(placements, notes)


def _tied_aliases(fusion: Fusion) -> dict[str, str]:
    """A tied parameter's other names -> the name its fusion input has (``nvtp.frontend.tied``)."""
    text = str(fusion.attrs.get("tied", ""))
    return dict(part.split("=", 1) for part in text.split(",") if "=" in part)


def _resolve(style: str | Placement, v: TensorValue, fusion: Fusion, projs: Mapping[str, Projection], *, is_bias: bool) -> Placement:
    if not isinstance(style, str):
        return style
    weight = _weight_of(v, fusion, projs) if is_bias else projs.get(v.name)
    sf = weight.split_factor if weight is not None else 1
    if style == "colwise":
        return make_shard(weight.out_axis if weight is not None and not is_bias else 0, sf)
    # rowwise: weights split along the input features, biases replicated
    return REPLICATE if is_bias or v.ndim == 1 else Shard(weight.in_axis if weight is not None else 1)


def _weight_of(bias: TensorValue, fusion: Fusion, projs: Mapping[str, Projection]) -> Projection | None:
    for p in projs.values():
        if p.bias == bias.name:
            return p
    return None


def per_input(fusion: Fusion, plan: Mapping[str, Any]) -> Annotations:
    """A dumped fusion's inputs placed by value name (``T3``) or label; the rest left to propagation."""
    names = {v.name for v in fusion.inputs}
    labels = {fusion.label(v.name): v.name for v in fusion.inputs}
    placements = {}
    for key, raw in plan.items():
        name = key if key in names else labels.get(key)
        if name is None:
            raise ShardingError(f"the plan places {key!r}, which is not an input of {fusion.name}")
        style = _style(raw)
        if isinstance(style, str):
            raise ShardingError(f"per-input plans take placements (S(d), R), not {style!r}")
        placements[name] = style
    return Annotations(placements)
