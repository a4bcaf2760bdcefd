"""The plans derived from the graph, ``megatron`` and ``megatron-sp``: column/row-parallel pairs found by
propagation (``pairing.py``), vocabulary-parallel embeddings and LM heads, sequence parallelism."""

from __future__ import annotations

from typing import Mapping

from nvtp.ir.graph import Fusion, Op, TensorValue
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Placement, Shard, make_shard
from nvtp.sharding.plans.base import Annotations, Projection, projections, reshape_group
from nvtp.sharding.plans.pairing import Paired, Probes, pays_to_split, row_partner
from nvtp.sharding.propagate import ShardingError


def _activation_inputs(fusion: Fusion) -> list[TensorValue]:
    return [v for v in fusion.inputs if isinstance(v, TensorValue) and fusion.role(v.name) in ("activation", "input", "")]


def megatron(fusion: Fusion, mesh: DeviceMesh, *, sequence_parallel: bool = False, vocab_parallel: bool = True) -> Annotations:
    """Column/row-parallel pairs found by propagation; with ``vocab_parallel``, token embeddings
    split along the vocabulary and an unpaired projection split along its outputs when what it
    then communicates is smaller than its output (an LM head feeding cross-entropy: Megatron's
    parallel cross-entropy); everything else replicated. With sequence parallelism, activation
    inputs ``[batch, seq, ...]`` are split along the sequence (axis 1)."""
    projs = projections(fusion)
    column: dict[str, Projection] = {}
    row: dict[str, Projection] = {}
    paired = Paired(fusion, projs)
    probes = Probes(fusion, projs)
    consumers = fusion.consumers()
    for p in projs:
        if p.weight in column or p.weight in row:
            continue
        partner = paired.again(p)
        if partner is None:
            partner = row_partner(probes, mesh, p)
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
            if p.weight not in column and p.weight not in row and not _heads_fewer_than_devices(consumers, mesh, p) \
                    and pays_to_split(probes, mesh, p):
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
    few = {p.weight: h for p in whole if (h := _heads_fewer_than_devices(consumers, mesh, p))}
    for h in sorted(set(few.values())):
        names = ", ".join(fusion.label(w) for w, k in few.items() if k == h)
        notes.append(f"replicated KV heads ({h} head{'s' if h > 1 else ''}, fewer than the {mesh.size} devices: every rank computes "
                     f"them whole and their weights' gradients are summed over the ranks): {names}")
    unpaired = list(dict.fromkeys(fusion.label(p.weight) for p in whole if p.weight not in few))  # a weight read by many, once
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


def _heads_fewer_than_devices(consumers: Mapping[str, list[Op]], mesh: DeviceMesh, p: Projection) -> int | None:
    """h when P's output is reshaped into ``[..., h, head_dim]`` with h heads fewer than the devices
    and dividing their number (multi-query attention's one KV head on 2 devices): why P stays
    whole, as vLLM keeps KV heads whole when there are fewer than devices. None otherwise."""
    d = mesh.size
    out = p.op.outputs[0]
    users = consumers.get(out.name, [])
    while len(users) == 1 and users[0].kind == "cast":
        out = users[0].outputs[0]
        users = consumers.get(out.name, [])
    for u in users:
        if u.kind == "reshape":
            group = reshape_group(out.shape, u.outputs[0].shape, out.ndim - 1)
            if group and len(group) > 1 and 1 <= group[0] < d and d % group[0] == 0:
                return group[0]
    return None
