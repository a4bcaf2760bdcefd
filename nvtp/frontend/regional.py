"""Regional compilation: trace a deep model's repeated block a few times, not once per layer.

Thunder's trace costs seconds a layer, so ``nvtp.jit`` of a 12-layer GPT would spend most of its
start-up tracing twelve copies of one block. Instead, ``capture_regional`` finds the repeated
blocks (an ``nn.ModuleList`` whose children have one class and the same parameters), traces the
model cut to ``TRACED`` blocks (3), and builds the L-layer forward and backward fusions from that
trace by splicing the dataflow graph: still ONE forward and ONE backward fusion, which nvtp shards
and runs as any other.

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

Anything that does not fit (no repeated ModuleList, blocks that differ, a region that reads a
block other than its neighbour, a unit whose second copy does not match the first) raises
``NotRepeatable`` with the reason; ``capture_regional`` then traces the whole model as before and
says why in ``Captured.regional``. When only block 0's backward differs (Thunder recomputes the
embedding for a Llama-style block 0 whose RMSNorm needs its input, and saves the other blocks'
inputs), the model is traced again at 4 blocks and block 0's backward kept whole in the tail.
Still traced whole: a backward that recomputes the residual stream through every block (a
residual block of one linear and a GELU), whose recomputation is a chain of its own. Assumed, not checked: the model's forward does not depend on the number
of blocks other than by running them (a trace of 3 blocks computes what 3 of L compute).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from nvtp.ir.graph import Fusion, Op, ScalarValue, TensorValue, Value, ValueInfo, defines_input, is_value
from nvtp.ir.verify import verify

TRACED = 3  # blocks traced: a head, two units to match against each other, and a tail


class NotRepeatable(Exception):
    """The model's blocks cannot be spliced; the message says why (one line)."""


# -- finding the repeated blocks -------------------------------------------------------------------

@dataclass(frozen=True)
class Repeated:
    """``module.<prefix>`` is an ``nn.ModuleList`` of ``count`` blocks alike."""

    prefix: str
    count: int


def _signature(m: torch.nn.Module) -> tuple:
    return (type(m), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))


def find_repeated(module: torch.nn.Module) -> Repeated:
    """The longest ``nn.ModuleList`` of ``module`` whose children share a class and parameter
    shapes, and own their parameters (none tied to another part of the model)."""
    best: Repeated | None = None
    why = f"{type(module).__name__} has no nn.ModuleList of 2 or more blocks alike"
    for name, m in module.named_modules():
        if not isinstance(m, torch.nn.ModuleList) or len(m) < 2 or not name:
            continue
        sigs = {_signature(c) for c in m}
        if len(sigs) != 1:
            why = f"the blocks of {name} differ (class or parameter shapes)"
            continue
        inside = {id(p) for p in m.parameters()}
        outside = [n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in inside and not n.startswith(name + ".")]
        if outside:
            why = f"a parameter of {name} is tied to {outside[0]}"
            continue
        if best is None or len(m) > best.count:
            best = Repeated(name, len(m))
    if best is None:
        raise NotRepeatable(why)
    return best


def truncated(module: torch.nn.Module, prefix: str, k: int) -> torch.nn.Module:
    """``module`` with only the first ``k`` blocks of ``module.<prefix>`` (shallow: parameters shared)."""
    path = prefix.split(".")
    root = copy.copy(module)
    root._modules = dict(module._modules)
    parent = root
    for part in path[:-1]:
        child = copy.copy(parent._modules[part])
        child._modules = dict(child._modules)
        parent._modules[part] = child
        parent = child
    parent._modules[path[-1]] = torch.nn.ModuleList(list(parent._modules[path[-1]])[:k])
    return root


# -- the splice ------------------------------------------------------------------------------------

def _block_index(label: str, prefix: str) -> tuple[int, str] | None:
    """``h.3.attn.c_attn.weight`` -> (3, ``attn.c_attn.weight``); also inside ``grad(...)``."""
    inner = label[5:-1] if label.startswith("grad(") and label.endswith(")") else label
    if not inner.startswith(prefix + "."):
        return None
    idx, _, rest = inner[len(prefix) + 1:].partition(".")
    return (int(idx), rest) if idx.isdigit() else None


def _relabel(label: str, prefix: str, index: int) -> str:
    found = _block_index(label, prefix)
    if found is None:
        return label
    inner = f"{prefix}.{index}.{found[1]}"
    return f"grad({inner})" if label.startswith("grad(") else inner


def _walk_values(args: Any) -> list[Value]:
    out: list[Value] = []
    for _, a in args:
        if is_value(a):
            out.append(a)
        elif isinstance(a, tuple):
            out.extend(x for x in a if is_value(x))
    return out


def _has_value(a: Any) -> bool:
    return is_value(a) or (isinstance(a, tuple) and any(is_value(x) for x in a))


def _map_args(args: tuple, fn: Callable[[Value], Value]) -> tuple:
    def one(a: Any) -> Any:
        if is_value(a):
            return fn(a)
        if isinstance(a, tuple):
            return tuple(fn(x) if is_value(x) else x for x in a)
        return a

    return tuple((k, one(a)) for k, a in args)


def _renamed(v: Value, name: str) -> Value:
    # Not dataclasses.replace: a 96-layer splice renames ~10^5 values, and replace is 10x slower.
    return TensorValue(name, v.shape, v.dtype) if isinstance(v, TensorValue) else ScalarValue(name, v.dtype)


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
    from nvtp.ir.ops import RANDOM

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
        found = _block_index(label, prefix)
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
            for pos, (a, b) in enumerate(zip(_walk_values(op.args), _walk_values(f.ops[p].args))):
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
        found = _block_index(label, prefix)
        if found is None:
            return label
        offset = found[0] - ch.traced_index[region]
        if region in ("head", "tail") and abs(offset) > 1:
            raise NotRepeatable(f"the {what}'s {region} names {label}, {abs(offset)} blocks from its own")
        return _relabel(label, prefix, built + offset)

    ops: list[Op] = []
    info: dict[str, ValueInfo] = {}
    where: dict[Any, str] = {}

    def emit(i: int, region: Any, built: int, read: Callable[[int, int, Value], str], suffix: str) -> None:
        """Op ``i`` of ``region`` as block ``built``'s: operand ``pos`` renamed ``read(i, pos, value)``."""
        op = f.ops[i]
        pos = iter(range(len(op.operands)))
        outs = tuple(_renamed(v, v.name + suffix) for v in op.outputs)
        ops.append(Op(op.kind, _map_args(op.args, lambda v: _renamed(v, read(i, next(pos), v))), outs))
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
            outs.extend(_renamed(v, f"{v.name}#{c}") for c in range(1, ch.copies + 1))
    # The head's values that are "block -1's" copies of first-unit values: those the first block reads
    # as carries, and up from them the ops alike on both sides (the layer norm statistics of the
    # embedding that the backward of block 0 reads as the backward of block 1 reads those of block 0's output).
    todo = [(name, _walk_values(f.ops[p].args)[pos].name) for (p, pos), (how, name) in use.items() if how == "carry"]
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
        for va, vb in zip(_walk_values(pa.args), _walk_values(pb.args)):
            if ch.region[ch.producer[va.name]] == 1 and ch.region[ch.producer[vb.name]] == "head" and va.name not in seen:
                todo.append((va.name, vb.name))
    for a, b in seen.items():
        where[(a, -1)] = b
    return ops, outs, info, where, tid


def _canonical(name: str, ops: list[Op], outputs: list[Value], info: dict[str, ValueInfo], base: Fusion) -> tuple[Fusion, dict[str, str]]:
    """The fusion with inputs first and values renamed T0, T1, S2, ... in op order."""
    ordered = [op for op in ops if defines_input(op)] + [op for op in ops if not defines_input(op)]
    rename: dict[str, str] = {}
    for op in ordered:
        for v in op.outputs:
            rename[v.name] = f"{'S' if isinstance(v, ScalarValue) else 'T'}{len(rename)}"

    def fix(v: Value) -> Value:
        return _renamed(v, rename[v.name])

    new_ops = tuple(Op(op.kind, _map_args(op.args, fix), tuple(fix(v) for v in op.outputs)) for op in ordered)
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
            found = _block_index(info.label, prefix) if info and info.role == "parameter" else None
            return found[0] if found else None
        return seed

    def param_grad_block(f: Fusion) -> Callable[[str], int | None]:
        def seed(name: str) -> int | None:
            found = _block_index(f.grad_of(name), prefix) if f.grad_of(name) else None
            return found[0] if found else None
        return seed

    ftag = _random_to_consumers(forward, _ancestor_tags(forward, param_block(forward)))
    fch = _chain(forward, ftag, True, traced, layers)
    fops, fouts, finfo, fwhere, ftid = _splice(fch, prefix, None, None, "forward")
    fwd, frename = _canonical(forward.name, fops, fouts, finfo, forward)
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
    bwd, _ = _canonical(backward.name, bops, bouts, binfo, backward)
    return fwd, bwd


# -- capture ---------------------------------------------------------------------------------------

def capture_regional(module: torch.nn.Module, *args: Any, traced: int = TRACED, **kwargs: Any):
    """``capture(module, *args)``, by splicing a trace of ``traced`` blocks when ``module`` has
    more repeated blocks than that; else (or when the splice fails) the whole trace. The returned
    ``Captured.regional`` says which, and why."""
    from nvtp.frontend.capture import capture

    try:
        rep = find_repeated(module)
    except NotRepeatable as e:
        return replace(capture(module, *args, **kwargs), regional=f"whole trace: {e}")
    if rep.count <= traced:
        return replace(capture(module, *args, **kwargs), regional=f"whole trace: {rep.count} blocks in {rep.prefix}, no more than the {traced} a splice traces")
    start = time.perf_counter()
    reasons = []
    # Block 0's backward may differ from the others' (Thunder recomputes the embedding for it): then
    # trace a 4th block and keep block 0's backward whole.
    for blocks, first_in_tail in ((traced, False), (traced + 1, True)):
        if blocks >= rep.count:
            break
        try:
            part = capture(truncated(module, rep.prefix, blocks), *args, **kwargs)
            fwd, bwd = splice(part.forward, part.backward, rep.prefix, blocks, rep.count, first_in_tail)
        except NotRepeatable as e:
            reasons.append(str(e))
            if not str(e).startswith("the backward"):
                break
        except Exception as e:  # noqa: BLE001 - the cut model may not trace (e.g. a forward indexing block n-1): trace it whole
            reasons.append(f"the model cut to {blocks} blocks of {rep.prefix} did not trace ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})")
            break
        else:
            verify(fwd)  # a splice that broke the graph is nvtp's bug: say so here, not in a pass later
            if bwd is not None:
                verify(bwd)
            seconds = time.perf_counter() - start
            kept = "; block 0's backward kept whole" if first_in_tail else ""
            return replace(part, forward=fwd, backward=bwd, trace_seconds=seconds,
                           regional=f"spliced: {rep.count} blocks of {rep.prefix} from a trace of {blocks}{kept} ({seconds:.1f} s)")
    reason = "whole trace: " + "; with a 4th block: ".join(reasons)
    return replace(capture(module, *args, **kwargs), regional=reason)
