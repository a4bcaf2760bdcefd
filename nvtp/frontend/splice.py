"""The splice of a trace of several blocks: the L-layer fusions from a trace of the model cut to 3.

``splice(forward, backward, prefix, traced, layers)`` takes the fusions of the model cut to
``traced`` blocks (``blocks.truncated``) and builds those of the model with ``layers`` blocks. It is
regional compilation's second way (``nvtp.frontend.regional``), for chains the one-block template
(``nvtp.frontend.template``) does not take: a block called with more than the carry, a model
reading block outputs outside the chain.

How the splice finds a block (no model-specific names). Every op gets a *tag*, the block it
belongs to. In the forward: the highest block index among the block parameters it depends on
(-1: none, the embedding; a random draw takes its consumers' block). In the backward: the highest
block index among the parameter gradients it feeds (none: the embedding's gradient alone). Ops of
one tag form a *region*. In the order of the computation (forward: -1, 0, 1, 2; backward: 2,
1, 0, untagged) the fusion is a head, units 1..K-1 (one per block but one) and a tail (the last
block and the loss in the forward; block 0's gradient pieces and the embedding's in the
backward). The units are one computation on different data: the second unit is matched to the
first op by op (same kind, arguments, parameter names relative to the block, saved inputs of the
same forward value relative to the block) and checked value by value, which also says what each
use of a value from outside the unit is: a carry from the unit before (the residual stream, the
next layer norm's statistics) or a value every block reads (the causal mask). The L-layer fusion
is the head, L-1 copies of the first unit (labels renamed ``h.<i>...``; carries read from the copy
before; backward inputs saved from the forward copy of the same block), and the tail, with values
renamed T0, T1, ... in op order (inputs first).

The match proves the traced units alike; that the blocks never traced are too is proven before
this runs, by a run of the whole model (``nvtp.frontend.variants``). A unit whose second copy does
not match the first raises ``NotRepeatable`` with the reason. When only block 0's backward
differs (Thunder recomputes the embedding for a Llama-style block 0 whose RMSNorm needs its
input, and saves the other blocks' inputs), ``first_in_tail`` keeps block 0's backward whole in
the tail (a trace of 4 blocks). This splice cannot take a backward that recomputes the residual
stream through every block (a residual block of one linear and a GELU), whose recomputation is a
chain of its own; the one-block template can (each copy recomputes its own).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from nvtp.frontend.blocks import NotRepeatable, block_index, relabel
from nvtp.ir.graph import Fusion, Op, ScalarValue, Value, ValueInfo, defines_input, is_value, renamed_value
from nvtp.ir.ops import RANDOM


def walk_values(args: Any) -> list[Value]:
    out: list[Value] = []
    for _, a in args:
        if is_value(a):
            out.append(a)
        elif isinstance(a, tuple):
            out.extend(x for x in a if is_value(x))
    return out


def _has_value(a: Any) -> bool:
    return is_value(a) or (isinstance(a, tuple) and any(is_value(x) for x in a))


@dataclass
class _Chain:
    """One fusion cut into head, units (chain order) and tail, with block indices as traced and as built."""

    fusion: Fusion
    region: dict[int, Any]  # op index -> "head" | unit number (1-based, chain order) | "tail"
    ops_of: dict[Any, list[int]]
    producer: dict[str, int]
    traced_index: dict[Any, int]  # region -> the block index its labels are relative to, as traced
    built_index: Callable[[Any], int]  # region (or ("copy", k)) -> that block index in the L-layer fusion
    units: int  # units traced (chain order 1..units)
    copies: int  # copies of the first unit built


def _ancestor_tags(f: Fusion, seed: Callable[[Op], int | None]) -> dict[str, int | None]:
    """Forward: each value's highest block index among the block parameters it depends on."""
    tag: dict[str, int | None] = {}
    for op in f.ops:
        if defines_input(op):
            t = seed(op)
        else:
            found = [tag[v.name] for v in op.operands if tag.get(v.name) is not None]
            t = max(found) if found else None
        for v in op.outputs:
            tag[v.name] = t
    return tag


def _random_to_consumers(f: Fusion, tag: dict[str, int | None]) -> dict[str, int | None]:
    """Forward: a random draw (dropout's ``uniform``) reads no parameter, so nothing puts it in a
    block: give it, and what is computed from draws alone (the keep-mask), the block of its
    consumers when they are all of one block, so that every block draws its own."""
    drawn: set[str] = set()
    members: list[int] = []
    for i, op in enumerate(f.ops):
        if defines_input(op):
            continue
        if (op.kind in RANDOM and all(tag.get(v.name) is None for v in op.operands)) or \
                (op.operands and all(v.name in drawn for v in op.operands)):
            members.append(i)
            drawn.update(v.name for v in op.outputs)
    users = f.consumers()
    for i in reversed(members):  # consumers first
        found = {tag.get(u.outputs[0].name) for v in f.ops[i].outputs for u in users.get(v.name, [])}
        if len(found) == 1 and None not in found:
            t = found.pop()
            for v in f.ops[i].outputs:
                tag[v.name] = t
    return tag


def _descendant_tags(f: Fusion, seed: Callable[[str], int | None]) -> dict[str, int | None]:
    """Backward: for each value, the highest block index among the parameter gradients it feeds
    (the incoming gradient feeds every block's; the embedding's gradient alone, none)."""
    tag: dict[str, int | None] = {v.name: seed(v.name) for v in f.outputs}
    for op in reversed(f.ops):
        found = [tag[v.name] for v in op.outputs if tag.get(v.name) is not None]
        t = max(found) if found else None
        for v in op.outputs:
            tag[v.name] = t
        if t is not None:
            for v in op.operands:
                if tag.get(v.name) is None or tag[v.name] < t:
                    tag[v.name] = t
    return tag


def _chain(f: Fusion, tag: dict[str, int | None], forward: bool, traced: int, layers: int, first_in_tail: bool = False) -> _Chain:
    """Cut ``f`` into head, units and tail by ``tag``. ``first_in_tail`` (backward only): block 0
    joins the tail, for a backward whose block 0 is unlike the others (Thunder recomputes its input)."""
    k = traced
    low = 1 if first_in_tail else 0  # the lowest block that is a unit
    region: dict[int, Any] = {}
    for i, op in enumerate(f.ops):
        t = tag[op.outputs[0].name] if op.outputs else None
        if forward:
            t = -1 if t is None else t
            region[i] = "head" if t == -1 else "tail" if t == k - 1 else t + 1
        else:
            region[i] = "tail" if t is None or t < low else "head" if t == k - 1 else k - 1 - t
    ops_of: dict[Any, list[int]] = {}
    for i, r in region.items():
        ops_of.setdefault(r, []).append(i)
    producer = {v.name: i for i, op in enumerate(f.ops) for v in op.outputs}
    if forward:
        traced_index = {"head": -1, "tail": k - 1} | {j: j - 1 for j in range(1, k)}

        def built(r):
            return -1 if r == "head" else layers - 1 if r == "tail" else r[1] - 1
    else:
        traced_index = {"head": k - 1, "tail": low - 1} | {j: k - 1 - j for j in range(1, k - low)}

        def built(r):
            return layers - 1 if r == "head" else low - 1 if r == "tail" else layers - 1 - r[1]
    units = k - 1 - (0 if forward else low)
    return _Chain(f, region, ops_of, producer, traced_index, built, units, layers - 1 - (0 if forward else low))


def _splice(ch: _Chain, prefix: str, source_key: Callable[[str, int], Any] | None,
            source_name: Callable[[str, int, int], str] | None, what: str) -> tuple[list[Op], list[Value], dict[str, ValueInfo], dict[Any, str]]:
    """Build the L-layer op list of one fusion (built names, not yet canonical). Returns the ops,
    the outputs, the info, ``where``: (traced value name, built block index) -> built name, for
    the forward values the backward's saved inputs name, and ``tid``: a traced value -> the
    first unit's value it is a copy of (itself outside the units)."""
    f = ch.fusion
    outputs = {v.name for v in f.outputs}

    def rel_label(label: str, region: Any) -> tuple:
        found = block_index(label, prefix)
        if found is None:
            return (label,)
        return (found[0] - ch.traced_index[region], found[1], label.startswith("grad("))

    def info_key(name: str, region: Any) -> tuple:
        info = f.info.get(name)
        if info is None:
            return ()
        src = source_key(info.source, ch.traced_index[region]) if (source_key and info.source) else ""
        return (info.role, rel_label(info.label, region), rel_label(info.grad_of, region) if info.grad_of else "", src)

    # 1. match every later unit to the first, op by op
    units = list(range(1, ch.units + 1))
    if len(units) < 2:
        raise NotRepeatable(f"the {what} has {len(units)} block(s) to match, not 2")
    if any(u not in ch.ops_of for u in units):
        raise NotRepeatable(f"the {what} has no ops of some block: the blocks do not each compute something")

    def hashes(u: int) -> list[tuple]:
        h: dict[str, tuple] = {}
        out = []
        for i in ch.ops_of[u]:
            op = f.ops[i]

            def key(v: Value) -> Any:
                r = ch.region[ch.producer[v.name]]
                if r == u:
                    return h[v.name]
                # From outside the unit: a carry from the block before or a value every block reads
                # (the first unit reads both from the head); step 2 tells which.
                return ("outside", v.shape, str(v.dtype))

            args = tuple((n, key(a) if is_value(a) else tuple(key(x) if is_value(x) else x for x in a) if isinstance(a, tuple) else a)
                         for n, a in op.args)
            sig = (op.kind, repr(args), tuple((str(v.dtype), v.shape, v.name in outputs, info_key(v.name, u)) for v in op.outputs))
            hv = hash(sig)
            for j, v in enumerate(op.outputs):
                h[v.name] = (hv, j)
            out.append(sig)
        return out

    first = hashes(1)
    slots: dict[tuple, list[int]] = {}
    for i, sig in zip(ch.ops_of[1], first):
        slots.setdefault(sig, []).append(i)
    phi: dict[int, dict[str, str]] = {1: {}}  # unit -> its value name -> the first unit's value name
    for u in units[1:]:
        taken = {s: list(v) for s, v in slots.items()}
        vmap: dict[str, str] = {}
        if len(ch.ops_of[u]) != len(ch.ops_of[1]):
            raise NotRepeatable(f"the {what}'s block {ch.traced_index[u]} has {len(ch.ops_of[u])} ops, "
                                f"block {ch.traced_index[1]} {len(ch.ops_of[1])}: the blocks differ")
        for i, sig in zip(ch.ops_of[u], hashes(u)):
            if not taken.get(sig):
                raise NotRepeatable(f"the {what}'s block {ch.traced_index[u]} computes `{f.ops[i]}`, which block "
                                    f"{ch.traced_index[1]} does not")
            p = taken[sig].pop(0)
            for a, b in zip(f.ops[i].outputs, f.ops[p].outputs):
                vmap[a.name] = b.name
        phi[u] = vmap

    def tid(name: str) -> str:
        """A unit value's name in the first unit (itself outside the units)."""
        u = ch.region[ch.producer[name]]
        return name if u in ("head", "tail", 1) else phi[u][name]

    # 2. check the match value by value; learn what each use of the region before becomes
    use: dict[tuple[int, int], tuple[str, str]] = {}  # (first unit's op, operand position) -> ("carry"|"inv", name)
    for u in units[1:]:
        for i in ch.ops_of[u]:
            op = f.ops[i]
            p = ch.producer[phi[u][op.outputs[0].name]]
            for pos, (a, b) in enumerate(zip(walk_values(op.args), walk_values(f.ops[p].args))):
                ra, rb = ch.region[ch.producer[a.name]], ch.region[ch.producer[b.name]]
                if ra == u:
                    ok = rb == 1 and phi[u][a.name] == b.name
                    rec = None
                elif ra == u - 1:
                    ok = rb == "head"
                    rec = ("carry", tid(a.name))
                elif ra == "head":
                    ok = a.name == b.name
                    rec = ("inv", a.name)
                else:
                    ok = False
                    rec = None
                if not ok:
                    raise NotRepeatable(f"the {what}'s block {ch.traced_index[u]} reads {a.name} in `{op}` where block "
                                        f"{ch.traced_index[1]} reads {b.name}: the blocks are not one computation repeated")
                if rec is not None:
                    if use.setdefault((p, pos), rec) != rec:
                        raise NotRepeatable(f"the {what}'s blocks read different values at `{f.ops[p]}`")
    last = ch.units
    for i in ch.ops_of.get("tail", []):
        for a in f.ops[i].operands:
            r = ch.region[ch.producer[a.name]]
            if r not in ("head", "tail", last):
                raise NotRepeatable(f"the {what}'s last part reads {a.name} of block {ch.traced_index[r]} in `{f.ops[i]}`, "
                                    "not of the block next to it")

    # 3. build
    def built_label(label: str, region: Any, built: int) -> str:
        found = block_index(label, prefix)
        if found is None:
            return label
        offset = found[0] - ch.traced_index[region]
        if region in ("head", "tail") and abs(offset) > 1:
            raise NotRepeatable(f"the {what}'s {region} names {label}, {abs(offset)} blocks from its own")
        return relabel(label, prefix, built + offset)

    ops: list[Op] = []
    info: dict[str, ValueInfo] = {}
    where: dict[Any, str] = {}

    def emit(i: int, region: Any, built: int, read: Callable[[int, int, Value], str], suffix: str) -> None:
        """Op ``i`` of ``region`` as block ``built``'s: operand ``pos`` renamed ``read(i, pos, value)``."""
        op = f.ops[i]
        pos = iter(range(len(op.operands)))
        ops.append(op.renamed(lambda v: read(i, next(pos), v), lambda v: v.name + suffix))
        outs = ops[-1].outputs
        for v, nv in zip(op.outputs, outs):
            where[(v.name, built)] = nv.name
            old = f.info.get(v.name)
            if old is not None:
                src = source_name(old.source, built, ch.traced_index[region]) if (source_name and old.source) else old.source
                info[nv.name] = ValueInfo(old.role, built_label(old.label, region, built), src,
                                          built_label(old.grad_of, region, built) if old.grad_of else "")

    for i in ch.ops_of.get("head", []):
        emit(i, "head", ch.built_index("head"), lambda i, pos, v: v.name, "")
    for c in range(1, ch.copies + 1):  # copy c of the first unit; from the second on, the copy before gives the carries
        def read(i: int, pos: int, v: Value, c: int = c) -> str:
            if ch.region[ch.producer[v.name]] == 1:
                return f"{v.name}#{c}"
            rec = use.get((i, pos)) if c > 1 else None
            if rec is None:
                return v.name  # the head's value, as traced
            return f"{rec[1]}#{c - 1}" if rec[0] == "carry" else rec[1]

        for i in ch.ops_of[1]:
            emit(i, 1, ch.built_index(("copy", c)), read, f"#{c}")

    def read_tail(i: int, pos: int, v: Value) -> str:
        r = ch.region[ch.producer[v.name]]
        return v.name if r in ("head", "tail") else f"{tid(v.name)}#{ch.copies}"  # the last copy's (checked above)

    for i in ch.ops_of.get("tail", []):
        emit(i, "tail", ch.built_index("tail"), read_tail, "")

    outs: list[Value] = []
    for v in f.outputs:
        r = ch.region[ch.producer[v.name]]
        if r in ("head", "tail"):
            outs.append(v)
        elif r == 1:
            outs.extend(renamed_value(v, f"{v.name}#{c}") for c in range(1, ch.copies + 1))
    # The head's values that are "block -1's" copies of first-unit values: those the first block reads
    # as carries, and up from them the ops alike on both sides (the layer norm statistics of the
    # embedding that the backward of block 0 reads as the backward of block 1 reads those of block 0's output).
    todo = [(name, walk_values(f.ops[p].args)[pos].name) for (p, pos), (how, name) in use.items() if how == "carry"]
    seen: dict[str, str] = {}
    while todo:
        a, b = todo.pop()
        if seen.setdefault(a, b) != b:
            seen[a] = ""  # two head values for one: neither
            continue
        pa, pb = f.ops[ch.producer[a]], f.ops[ch.producer[b]]
        if (pa.kind != pb.kind or defines_input(pa) or [x for x in pa.args if not _has_value(x[1])] != [x for x in pb.args if not _has_value(x[1])]
                or [v.name for v in pa.outputs].index(a) != [v.name for v in pb.outputs].index(b)):
            continue
        for va, vb in zip(walk_values(pa.args), walk_values(pb.args)):
            if ch.region[ch.producer[va.name]] == 1 and ch.region[ch.producer[vb.name]] == "head" and va.name not in seen:
                todo.append((va.name, vb.name))
    for a, b in seen.items():
        where[(a, -1)] = b
    return ops, outs, info, where, tid


def live(ops: list[Op], outputs) -> list[Op]:
    """``ops`` without those none of whose results reaches an output (inputs stay): what the
    skeleton's backward recomputed only for the boundary it no longer has (the embedding, when
    Thunder rematerialises the boundary's input), which would otherwise be planned and not run."""
    live = set(outputs)
    keep: list[Op] = []
    for op in reversed(ops):
        if defines_input(op) or any(v.name in live for v in op.outputs):
            keep.append(op)
            live.update(v.name for v in op.operands)
    return keep[::-1]


def canonical(name: str, ops: list[Op], outputs: list[Value], info: dict[str, ValueInfo], base: Fusion) -> tuple[Fusion, dict[str, str]]:
    """The fusion with inputs first and values renamed T0, T1, S2, ... in op order."""
    ordered = [op for op in ops if defines_input(op)] + [op for op in ops if not defines_input(op)]
    rename: dict[str, str] = {}
    for op in ordered:
        for v in op.outputs:
            rename[v.name] = f"{'S' if isinstance(v, ScalarValue) else 'T'}{len(rename)}"

    def fix(v: Value) -> Value:
        return renamed_value(v, rename[v.name])

    new_ops = tuple(op.renamed(lambda v: rename[v.name], lambda v: rename[v.name]) for op in ordered)
    new_info = {rename[n]: i for n, i in info.items()}
    return replace(base, ops=new_ops, outputs=tuple(fix(v) for v in outputs), info=new_info), rename


def splice(forward: Fusion, backward: Fusion | None, prefix: str, traced: int, layers: int,
           first_in_tail: bool = False) -> tuple[Fusion, Fusion | None]:
    """The fusions of the model with ``layers`` blocks, from those traced with ``traced`` blocks
    (see the module docstring). ``first_in_tail``: the backward of block 0 is not spliced but kept
    whole in the tail (it needs a trace of 4 blocks: two others to match). Raises ``NotRepeatable``
    when the trace is not a repeated block."""
    need = 4 if first_in_tail else 3
    if traced < need or layers < need - 1:
        raise NotRepeatable(f"splicing needs a trace of {need} or more blocks and {need - 1} or more layers (got {traced}, {layers})")

    def param_block(f: Fusion) -> Callable[[Op], int | None]:
        def seed(op: Op) -> int | None:
            v = op.outputs[0]
            info = f.info.get(v.name)
            found = block_index(info.label, prefix) if info and info.role == "parameter" else None
            return found[0] if found else None
        return seed

    def param_grad_block(f: Fusion) -> Callable[[str], int | None]:
        def seed(name: str) -> int | None:
            found = block_index(f.grad_of(name), prefix) if f.grad_of(name) else None
            return found[0] if found else None
        return seed

    ftag = _random_to_consumers(forward, _ancestor_tags(forward, param_block(forward)))
    fch = _chain(forward, ftag, True, traced, layers)
    fops, fouts, finfo, fwhere, ftid = _splice(fch, prefix, None, None, "forward")
    fwd, frename = canonical(forward.name, fops, fouts, finfo, forward)
    if backward is None:
        return fwd, None

    carry_of = {b: a for (a, blk), b in fwhere.items() if blk == -1 and b and b != a}  # head value -> template value

    def forward_key(source: str) -> tuple[str, Any]:
        """A saved input's forward value as (a name the same for every block, its forward block), the
        block "head" or "tail" for a value of the forward's head or tail that is no block's."""
        r = fch.region[fch.producer[source]]
        if r == "head":
            return (carry_of[source], -1) if source in carry_of else (source, "head")
        return (source, "tail") if r == "tail" else (ftid(source), fch.traced_index[r])

    def source_key(source: str, block: int) -> tuple:
        name, fblock = forward_key(source)
        return (name, fblock if isinstance(fblock, str) else fblock - block)

    def source_name(source: str, built: int, traced_block: int) -> str:
        name, fblock = forward_key(source)
        fixed = {"head": -1, "tail": layers - 1}
        key = (name, fixed[fblock] if isinstance(fblock, str) else built + fblock - traced_block)
        if not fwhere.get(key):
            raise NotRepeatable(f"the backward of block {built} reads forward value {source}, which the forward of block "
                                f"{key[1]} does not give")
        return frename[fwhere[key]]

    bseed = param_grad_block(backward)
    btag = _descendant_tags(backward, bseed)
    bch = _chain(backward, btag, False, traced, layers, first_in_tail)
    bops, bouts, binfo, _, _ = _splice(bch, prefix, source_key, source_name, "backward")
    bwd, _ = canonical(backward.name, bops, bouts, binfo, backward)
    return fwd, bwd
