"""Regional compilation: trace a deep model's repeated block once, not once per layer.

Thunder's trace costs seconds a layer (its bytecode interpreter: about 2 s for a GPT-2 block on
this CPU), so ``nvtp.jit`` of a 12-layer GPT would spend most of its start-up tracing twelve copies
of one block. Instead, ``capture_regional`` finds the repeated blocks (an ``nn.ModuleList`` whose
children have one class and the same parameters) and builds the L-layer forward and backward
fusions by splicing dataflow graphs: still ONE forward and ONE backward fusion, which nvtp shards
and runs as any other. Two ways, the first that fits:

1. **One traced block** (``capture_template``): the model is first run eagerly on its meta copy
   (nothing is computed) to check that its blocks are a chain, ``x = block(x)`` each once, in
   order, on one tensor, and that nothing outside the chain reads a block's output but the last
   (``observe_chain``). Then two traces that do not grow with depth: the *skeleton*, the model with
   its chain replaced by ``_Boundary`` (``x * 1.0``, a marker found again in the forward and, as
   ``1.0 * grad``, in the backward), and block 0 alone. The L-layer forward is the skeleton's with
   the marker replaced by L copies of the block's forward (parameters named ``<prefix>.<i>.*``,
   the carry chained); the backward the skeleton's with its marker replaced by the L copies of the
   block's backward in reverse, each reading the values its own forward copy saved. A skeleton
   backward that recomputes the marker (Thunder rematerialising ``x * 1.0``) reads the last
   block's output instead. With dropout each copy draws its own masks, in the whole trace's order:
   tests/test_regional.py compares the loss and every gradient with a whole trace, bit for bit.
2. **A trace of ``TRACED`` blocks (3)**, for chains the first way does not take (a block called
   with more than the carry, a model reading block outputs outside the chain), described next.

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

The FX route (``nvtp.frontend.fx_regional``) builds its skeleton and block from dynamo's graph
instead, and splices them with the same ``splice_template``.

Anything that does not fit (no repeated ModuleList, blocks that differ, a region that reads a
block other than its neighbour, a unit whose second copy does not match the first) raises
``NotRepeatable`` with the reason; ``capture_regional`` then tries the next way, and at last
traces the whole model, saying why in ``Captured.regional``. When only block 0's backward differs
(Thunder recomputes the embedding for a Llama-style block 0 whose RMSNorm needs its input, and
saves the other blocks' inputs), the model is traced again at 4 blocks and block 0's backward kept
whole in the tail. The 3-block way cannot take a backward that recomputes the residual stream
through every block (a residual block of one linear and a GELU), whose recomputation is a chain of
its own; the one-block way can (each copy recomputes its own). Assumed, not checked, by both: the
model's forward does not depend on the number of blocks other than by running them (a forward
that reads ``len(self.h)`` would see 1 in the skeleton, 3 in the cut model).
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from nvtp.ir.graph import Fusion, Op, ScalarValue, Value, ValueInfo, defines_input, is_value, renamed_value
from nvtp.ir.simplify import dead_code
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


def _every_block(labels: tuple[str, ...], prefix: str, count: int) -> tuple[str, ...]:
    """``labels`` with each label of a block (``h.1.mlp.c_fc.weight``) repeated for all ``count``
    blocks: what a model of ``count`` blocks differentiates, from a trace of fewer."""
    out: dict[str, None] = {}
    for label in labels:
        if _block_index(label, prefix) is None:
            out[label] = None
        else:
            out.update(dict.fromkeys(_relabel(label, prefix, i) for i in range(count)))
    return tuple(out)


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


def _live(ops: list[Op], outputs) -> list[Op]:
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


def _canonical(name: str, ops: list[Op], outputs: list[Value], info: dict[str, ValueInfo], base: Fusion) -> tuple[Fusion, dict[str, str]]:
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


# -- one traced block (the template splice) --------------------------------------------------------

class _Boundary(torch.nn.Module):
    """Stands for the whole chain of blocks in the skeleton: ``x * 1.0``, one multiplication (cast
    to float and back for a low-precision ``x``) that marks where the chain's input leaves the head
    and its output enters the tail, in the forward and, as ``1.0 * grad``, in the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


@dataclass(frozen=True)
class Chain:
    """What running the model on meta tensors says of its blocks: each is called once, in order,
    as ``x = block(x)`` on one tensor (the carry), and nothing outside the chain reads a block's
    output but the last. ``carry`` is block 0's input (meta)."""

    carry: torch.Tensor


def observe_chain(module: torch.nn.Module, rep: Repeated, args: tuple, kwargs: dict) -> Chain:
    """Run ``module`` eagerly (its meta copy: nothing is computed) and check that its blocks form
    the chain the template splice builds; ``NotRepeatable`` says what differs."""
    from torch.overrides import TorchFunctionMode

    blocks = list(module.get_submodule(rep.prefix))
    calls: list[tuple[int, tuple, dict, Any]] = []
    depth = [0]
    used_outside: dict[int, torch.Tensor] = {}  # kept alive: a freed tensor's id may be a block output's later

    class Uses(TorchFunctionMode):
        def __torch_function__(self, func, types, a=(), kw=None):
            kw = kw or {}
            if depth[0] == 0:
                for t in torch.utils._pytree.tree_leaves((a, kw)):
                    if isinstance(t, torch.Tensor):
                        used_outside[id(t)] = t
            return func(*a, **kw)

    def pre(i):
        def hook(m, a, kw):
            depth[0] += 1
            calls.append((i, a, kw, None))
        return hook

    def post(i):
        def hook(m, a, kw, out):
            depth[0] -= 1
            j = max(k for k, c in enumerate(calls) if c[0] == i)
            calls[j] = (i, a, kw, out)
        return hook

    handles = [b.register_forward_pre_hook(pre(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(post(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad(), Uses():
            module(*args, **kwargs)
    except NotRepeatable:
        raise
    except Exception as e:  # noqa: BLE001 - a model that does not run on meta tensors: the other splice decides
        raise NotRepeatable(f"the model did not run on meta tensors ({type(e).__name__})") from e
    finally:
        for h in handles:
            h.remove()
    if [c[0] for c in calls] != list(range(len(blocks))):
        raise NotRepeatable(f"the blocks of {rep.prefix} are not each called once, in order")
    for i, a, kw, out in calls:
        if kw or len(a) != 1 or not isinstance(a[0], torch.Tensor) or not isinstance(out, torch.Tensor):
            raise NotRepeatable(f"block {i} of {rep.prefix} is not called as x = block(x) on one tensor")
        if out.shape != a[0].shape or out.dtype != a[0].dtype:
            raise NotRepeatable(f"block {i} of {rep.prefix} changes its input's shape or dtype")
        if i and a[0] is not calls[i - 1][3]:
            raise NotRepeatable(f"block {i} of {rep.prefix} does not read block {i - 1}'s output")
        if i < len(blocks) - 1 and id(out) in used_outside:
            raise NotRepeatable(f"the model reads block {i}'s output outside the chain of {rep.prefix}")
    return Chain(calls[0][1][0])


def _marker(f: Fusion, carry: torch.Tensor, forward: bool, mark: float = 1.0) -> tuple[set[int], str, str]:
    """The ops of ``_Boundary`` in a skeleton fusion: (their indices, the value entering, the value
    leaving). Forward: ``x * 1.0``; backward: ``1.0 * g``; each with a cast to float before and a
    cast back after when the carry is of lower precision."""
    found = _markers(f, carry, forward, mark)
    if len(found) != 1:
        raise NotRepeatable(f"the skeleton's {'forward' if forward else 'backward'} has {len(found)} places where the chain of "
                            "blocks could be, not 1")
    return found[0]


def _markers(f: Fusion, carry: torch.Tensor, forward: bool, mark: float = 1.0) -> list[tuple[set[int], str, str]]:
    """Every op group of ``f`` that ``_marker`` would take (a backward that recomputes the forward's
    ``x * 1.0`` has one of the forward's form too)."""
    from nvtp.ir.dtypes import DType

    shape, dtype = tuple(carry.shape), DType.from_torch(carry.dtype)
    users = f.consumers()
    at = {v.name: i for i, op in enumerate(f.ops) for v in op.outputs}
    outputs = {v.name for v in f.outputs}
    found = []
    for i, op in enumerate(f.ops):
        if op.kind != "mul":
            continue
        lhs, rhs = op.arg("lhs"), op.arg("rhs")
        value, const = (lhs, rhs) if forward else (rhs, lhs)
        if not is_value(value) or is_value(const) or const != mark or tuple(value.shape) != shape:
            continue
        drop, entering, leaving = {i}, value.name, op.outputs[0].name
        producer = f.ops[at[entering]]
        if producer.kind == "cast" and producer.operands[0].dtype == dtype and len(users[entering]) == 1 and entering not in outputs:
            drop.add(at[entering])
            entering = producer.operands[0].name
        after = users.get(leaving, [])
        if len(after) == 1 and after[0].kind == "cast" and after[0].outputs[0].dtype == dtype and leaving not in outputs:
            drop.add(at[after[0].outputs[0].name])
            leaving = after[0].outputs[0].name
        if f.value(entering).dtype == dtype and f.value(leaving).dtype == dtype:
            found.append((drop, entering, leaving))
    return found


def _copied(f: Fusion, name: Callable[[str], str]) -> list[Op]:
    """``f``'s compute ops with every value renamed ``name(old)``: one copy of a block."""
    return [op.renamed(lambda v: name(v.name), lambda v: name(v.name)) for op in f.compute_ops()]


def _reading(op: Op, read: dict[str, str]) -> Op:
    """``op`` reading ``read[name]`` where ``read`` renames an operand (the boundary's output)."""
    return op.renamed(lambda v: read.get(v.name, v.name))


def _outputs_read(f: Fusion, values: dict[str, Value], read: dict[str, str], info: dict[str, ValueInfo], role: str) -> dict[str, Value]:
    """``f``'s outputs as the spliced fusion has them (renamed by ``read``), their info carried over
    into ``info`` (``role`` where ``f`` has none)."""
    outs: dict[str, Value] = {}
    for v in f.outputs:
        name = read.get(v.name, v.name)
        outs.setdefault(name, values[name])
        info.setdefault(name, f.info.get(v.name, ValueInfo(role)))
    return outs


@dataclass
class Spliced:
    """The L-layer fusions ``splice_template`` built, and where the skeleton's outputs went."""

    forward: Fusion
    backward: Fusion | None
    renamed: dict[str, str]  # a skeleton forward output kept -> its name in ``forward``
    layer: dict[str, int]  # each value of ``forward`` a copy of the block computes (or its parameter) -> the copy's index


def splice_template(skeleton_fwd: Fusion, skeleton_bwd: Fusion | None, block_fwd: Fusion, block_bwd: Fusion | None,
                    carry: torch.Tensor, prefix: str, layers: int, *, carry_label: str | None = None,
                    reads: dict[str, str] | None = None, shared: dict[str, str] | None = None,
                    extras: frozenset[str] | set[str] = frozenset(), mark: float = 1.0) -> Spliced:
    """The L-layer forward and backward: the skeleton's (the model with its chain of blocks
    replaced by ``_Boundary``), with the boundary replaced by L copies of the block's own fusions,
    chained through the carry; each copy's parameters named ``<prefix>.<i>.<name>``.

    For blocks that read more than their carry (the FX route, ``nvtp.frontend.fx_regional``):
    ``carry_label`` labels the block's carry input (default: its one input that is not a
    parameter); ``reads``: each other such input's label -> the skeleton forward's value every copy
    reads in its place (an *invariant*: rotary tables, a mask); ``shared``: each other input's
    label (a parameter's too) -> the label of one input that every copy reads in its place, not
    one per layer (a constant: the block folded it, or the skeleton gives it but does not read it
    itself); ``extras``: skeleton forward outputs that are there only for the blocks (the
    invariants), dropped but where a block's backward saves them; ``mark``: the boundary's factor
    (``x * mark``; the backward's ``mark * grad``). Returns the fusions, where the skeleton's
    outputs went, and which layer each forward value belongs to (``Spliced``)."""
    reads, shared = dict(reads or {}), dict(shared or {})
    fb_inputs = [op for op in block_fwd.ops if defines_input(op)]
    acts = [op.outputs[0] for op in fb_inputs if block_fwd.role(op.outputs[0].name) != "parameter"]
    carried = [v for v in acts if (block_fwd.label(v.name) == carry_label if carry_label else True)]
    if len(carried) != 1:
        raise NotRepeatable(f"the block's forward reads {len(carried)} inputs that are not its parameters, not 1 (the carry)")
    x = carried[0].name
    unread = [block_fwd.label(v.name) for v in acts if v.name != x and block_fwd.label(v.name) not in reads | shared]
    if unread:
        raise NotRepeatable(f"the block's forward reads {', '.join(unread)}, which the skeleton does not give")
    invariant = {v.name: reads[block_fwd.label(v.name)] for v in acts if block_fwd.label(v.name) in reads}  # block input -> skeleton value
    common = {op.outputs[0].name for op in fb_inputs if block_fwd.label(op.outputs[0].name) in shared}
    ys = [v for v in block_fwd.outputs if block_fwd.role(v.name) == "output"]
    if len(ys) != 1:
        raise NotRepeatable(f"the block's forward has {len(ys)} outputs, not 1")
    y = ys[0].name

    def label(f: Fusion, name: str, i: int) -> str:
        return f"{prefix}.{i}.{f.label(name)}"

    # Forward.
    drop, entering, leaving = _marker(skeleton_fwd, carry, True, mark)
    ops: list[Op] = [op for op in skeleton_fwd.ops if defines_input(op)]
    info: dict[str, ValueInfo] = {n: i for n, i in skeleton_fwd.info.items()}
    for op in fb_inputs:  # one input for all copies
        v = op.outputs[0]
        if v.name in common:
            ops.append(Op(op.kind, op.args, (renamed_value(v, f"{v.name}#shared"),)))
            info[f"{v.name}#shared"] = ValueInfo("parameter", shared[block_fwd.label(v.name)])
    for i in range(layers):
        for op in fb_inputs:
            v = op.outputs[0]
            if v.name != x and v.name not in invariant and v.name not in common:
                ops.append(Op(op.kind, op.args, (renamed_value(v, f"{v.name}#{i}"),)))
                info[f"{v.name}#{i}"] = ValueInfo("parameter", label(block_fwd, v.name, i))
    inputs = {v.name for op in ops for v in op.outputs}
    read: dict[str, str] = {}
    carries = []  # the carry entering each copy (forward names)
    layer_of = {f"{op.outputs[0].name}#{i}": i for i in range(layers) for op in fb_inputs}

    def fname(name: str, i: int) -> str:
        if name == x:
            return carries[i]
        if name in invariant:
            return invariant[name]
        return f"{name}#shared" if name in common else f"{name}#{i}"

    for j, op in enumerate(skeleton_fwd.ops):
        if defines_input(op):
            continue
        if j in drop:
            if j == min(drop):
                defined = {v.name for o in ops for v in o.outputs}
                late = sorted(set(invariant.values()) - defined)
                if late:
                    raise NotRepeatable(f"the skeleton's forward computes {', '.join(late)}, which the blocks read, after them")
                carry_in = read.get(entering, entering)
                for i in range(layers):
                    carries.append(carry_in)
                    copy_ops = _copied(block_fwd, lambda name, i=i: fname(name, i))
                    layer_of.update((v.name, i) for op in copy_ops for v in op.outputs)
                    ops += copy_ops
                    carry_in = fname(y, i)
                read[leaving] = carry_in
            continue
        ops.append(_reading(op, read))
    values = {v.name: v for op in ops for v in op.outputs}
    outs = _outputs_read(skeleton_fwd, values, read, info, "saved")
    skeleton_saved = {i.source for i in skeleton_bwd.info.values() if i.role == "saved"} if skeleton_bwd is not None else set()
    for name in extras:
        if name in outs and name not in inputs:
            if name in skeleton_saved:
                info[name] = ValueInfo("saved")
            else:
                del outs[name]
                info.pop(name, None)
    saved_sources = [block_bwd.info[op.outputs[0].name].source for op in block_bwd.ops
                     if defines_input(op) and block_bwd.role(op.outputs[0].name) == "saved"] if block_bwd is not None else []
    # A backward that recomputes the boundary (Thunder rematerialising ``x * 1.0`` from the head's
    # output) reads the last block's output instead: the forward saves it.
    recomputed = _markers(skeleton_bwd, carry, True, mark) if skeleton_bwd is not None else []
    if recomputed and read[leaving] not in outs:
        outs[read[leaving]] = values[read[leaving]]
        info[read[leaving]] = ValueInfo("saved")
    inputs = {op.outputs[0].name for op in ops if defines_input(op)}
    for i in range(layers):
        for s in saved_sources:
            name = fname(s, i)
            if name not in outs and name not in inputs:  # block 0's carry may be an argument: the backward reads it as it is
                outs[name] = values[name]
                info[name] = ValueInfo("saved")
    kept = {v.name: read.get(v.name, v.name) for v in skeleton_fwd.outputs if read.get(v.name, v.name) in outs}
    fwd, frename = _canonical(skeleton_fwd.name, _live(ops, outs), list(outs.values()), {n: i for n, i in info.items() if n in values},
                              skeleton_fwd)
    renamed = {old: frename[new] for old, new in kept.items()}
    layer = {frename[n]: i for n, i in layer_of.items() if n in frename}
    if skeleton_bwd is None or block_bwd is None:
        return Spliced(fwd, None, renamed, layer)

    # Backward: the copies in reverse, the incoming gradient of each the outgoing one of the copy after.
    bb_inputs = [op for op in block_bwd.ops if defines_input(op)]
    gys = [op.outputs[0].name for op in bb_inputs if block_bwd.role(op.outputs[0].name) == "grad"]
    gxs = [v.name for v in block_bwd.outputs if block_bwd.grad_of(v.name) == block_fwd.label(x)]
    if len(gys) != 1 or len(gxs) != 1:
        raise NotRepeatable(f"the block's backward takes {len(gys)} gradients and gives {len(gxs)} for its input, not 1 and 1")
    gy, gx = gys[0], gxs[0]
    bdrop, bentering, bleaving = _marker(skeleton_bwd, carry, False, mark)
    bops: list[Op] = []
    binfo: dict[str, ValueInfo] = {}

    def saved(src: str) -> str:
        return frename[read.get(src, src)]

    for op in skeleton_bwd.ops:
        if defines_input(op):
            bops.append(op)
            old = skeleton_bwd.info.get(op.outputs[0].name)
            if old is not None:
                # a saved value, or an incoming gradient (of which forward output): named as the spliced forward names it
                binfo[op.outputs[0].name] = replace(old, source=saved(old.source)) if old.role in ("saved", "grad") and old.source else old
    # A block's backward input that is the same for every copy: a shared constant, or a saved invariant.
    bcommon = {op.outputs[0].name for op in bb_inputs if
               (block_bwd.role(op.outputs[0].name) == "parameter" and block_bwd.label(op.outputs[0].name) in shared)
               or (block_bwd.role(op.outputs[0].name) == "saved" and block_bwd.info[op.outputs[0].name].source in common | set(invariant))}
    for op in bb_inputs:
        v = op.outputs[0]
        if v.name in bcommon:
            bops.append(Op(op.kind, op.args, (renamed_value(v, f"{v.name}#shared"),)))
            old = block_bwd.info[v.name]
            binfo[f"{v.name}#shared"] = ValueInfo("parameter", shared[old.label]) if old.role == "parameter" else \
                ValueInfo("saved", "", frename[fname(old.source, 0)])
    for i in range(layers):
        for op in bb_inputs:
            v = op.outputs[0]
            role = block_bwd.role(v.name)
            if v.name == gy or v.name in bcommon:
                continue
            bops.append(Op(op.kind, op.args, (renamed_value(v, f"{v.name}#{i}"),)))
            binfo[f"{v.name}#{i}"] = ValueInfo("parameter", label(block_bwd, v.name, i)) if role == "parameter" else \
                ValueInfo("saved", "", frename[fname(block_bwd.info[v.name].source, i)])
    bread: dict[str, str] = {}
    grads: list[tuple[str, str]] = []
    skip: set[int] = set()
    if recomputed:
        define_x = next(op for op in fb_inputs if op.outputs[0].name == x)
        last = renamed_value(define_x.outputs[0], "carry_out")
        bops.append(Op(define_x.kind, define_x.args, (last,)))
        binfo[last.name] = ValueInfo("saved", "", frename[read[leaving]])
        for drop_r, _, leaving_r in recomputed:
            skip |= drop_r
            bread[leaving_r] = last.name

    for j, op in enumerate(skeleton_bwd.ops):
        if defines_input(op) or j in skip:
            continue
        if j in bdrop:
            if j == min(bdrop):
                g = bread.get(bentering, bentering)
                for i in reversed(range(layers)):
                    def bname(name: str, i: int = i, g: str = g) -> str:
                        return g if name == gy else f"{name}#shared" if name in bcommon else f"{name}#{i}"
                    bops += _copied(block_bwd, bname)
                    grads += [(bname(v.name), f"{prefix}.{i}.{block_bwd.grad_of(v.name)}") for v in block_bwd.outputs if v.name != gx]
                    g = bname(gx)
                bread[bleaving] = g
            continue
        bops.append(_reading(op, bread))
    bvalues = {v.name: v for op in bops for v in op.outputs}
    bouts = _outputs_read(skeleton_bwd, bvalues, bread, binfo, "grad")
    for name, of in sorted(grads, key=lambda g: g[1]):
        bouts[name] = bvalues[name]
        binfo[name] = ValueInfo("grad", f"grad({of})", grad_of=of)
    bwd, _ = _canonical(skeleton_bwd.name, _live(bops, bouts), list(bouts.values()), {n: i for n, i in binfo.items() if n in bvalues},
                        skeleton_bwd)
    return Spliced(fwd, bwd, renamed, layer)


def capture_template(module: torch.nn.Module, rep: Repeated, *args: Any, **kwargs: Any):
    """The model's fusions from two traces that do not grow with depth: the skeleton (the model with
    its chain of blocks replaced by ``_Boundary``) and block 0 alone; ``NotRepeatable`` if the
    model is not such a chain."""
    from nvtp.frontend.capture import MissingOpError, capture

    chain = observe_chain(module, rep, args, kwargs)
    skeleton = truncated(module, rep.prefix, 0)
    parent = skeleton.get_submodule(rep.prefix.rpartition(".")[0]) if "." in rep.prefix else skeleton
    parent._modules[rep.prefix.rpartition(".")[2]] = torch.nn.ModuleList([_Boundary()])
    try:
        skel = capture(skeleton, *args, **kwargs)
        lent: list[str] = []
        reaches = skel.backward is not None and _markers(skel.backward, chain.carry, False)
        if not reaches and _has_parameters(module.get_submodule(f"{rep.prefix}.0")):
            # Nothing before the blocks needs a gradient (no embedding: the chain starts at a
            # floating argument), so the skeleton's backward, if any, stops short of the chain and
            # cannot bring the loss's gradient to the blocks. Trace it with its floating arguments
            # needing a gradient, so it reaches the chain, and drop their gradients after the splice.
            args, kwargs, lent = _needing_grad(module, args, kwargs)
            if lent:
                skel = capture(skeleton, *args, **kwargs)
    except MissingOpError:  # the whole model holds the same op: no other trace would do
        raise
    except Exception as e:  # noqa: BLE001 - a forward that needs its blocks (indexes them, reads their attributes)
        raise NotRepeatable(f"the model without its blocks did not trace ({type(e).__name__})") from e
    carry = torch.empty_like(chain.carry, device="meta").requires_grad_(skel.backward is not None)
    try:
        block = capture(module.get_submodule(f"{rep.prefix}.0"), carry)
    except MissingOpError:
        raise
    except Exception as e:  # noqa: BLE001 - a block that does not trace alone: the other splice decides
        raise NotRepeatable(f"block 0 of {rep.prefix} did not trace alone ({type(e).__name__})") from e
    if skel.backward is None and block.backward is not None:
        # A splice into no backward would give the blocks' parameters no gradient at all.
        raise NotRepeatable("the model without its blocks has no backward (only the blocks have parameters, and no "
                            "floating argument carries a gradient to them), so it cannot carry the blocks' gradients")
    params = [block.forward.label(v.name) for v in block.forward.inputs if block.forward.role(v.name) == "parameter"]
    differentiable = skel.differentiable + _every_block(tuple(f"{rep.prefix}.0.{label}" for label in block.differentiable
                                                             if label in params), rep.prefix, rep.count)
    spliced = splice_template(skel.forward, skel.backward, block.forward, block.backward, chain.carry, rep.prefix, rep.count)
    bwd = spliced.backward
    if lent and bwd is not None:  # the arguments' gradients were only lent to the trace: eager computes none
        bwd = dead_code(bwd.with_ops(bwd.ops, tuple(v for v in bwd.outputs if bwd.grad_of(v.name) not in lent)))
        differentiable = tuple(label for label in differentiable if label not in lent)
    return replace(skel, differentiable=differentiable), replace(spliced, backward=bwd)


def _has_parameters(block: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in block.parameters())


def _needing_grad(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[str]]:
    """``args``/``kwargs`` with each floating tensor that needs no gradient replaced by a meta
    tensor that does, and the argument names (the fusions' labels) of those replaced."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return args, kwargs, []
    lent: list[str] = []

    def lend(name: str, a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and not a.requires_grad:
            lent.append(name)
            return torch.empty_like(a, device="meta").requires_grad_()
        return a

    args = tuple(lend(n, a) for n, a in zip(names, args)) + tuple(args[len(names):])
    kwargs = {k: lend(k, a) for k, a in kwargs.items()}
    return args, kwargs, lent


# -- capture ---------------------------------------------------------------------------------------

def capture_regional(module: torch.nn.Module, *args: Any, traced: int = TRACED, template: bool = True, **kwargs: Any):
    """``capture(module, *args)``, by splicing one traced block (``template``) or a trace of
    ``traced`` blocks when ``module`` has a chain of repeated blocks; else (or when the splices do
    not fit) the whole trace. The returned ``Captured.regional`` says which, and why."""
    from nvtp.gcpause import paused

    with paused():
        return _capture_regional(module, args, kwargs, traced, template)


def _capture_regional(module: torch.nn.Module, args: tuple, kwargs: dict, traced: int, template: bool):
    from nvtp.frontend.capture import MissingOpError, capture, check_gradients

    try:
        rep = find_repeated(module)
    except NotRepeatable as e:
        return replace(capture(module, *args, **kwargs), regional=f"whole trace: {e}")
    start = time.perf_counter()
    reasons = []
    if template:
        try:
            skel, spliced = capture_template(module, rep, *args, **kwargs)
        except NotRepeatable as e:
            reasons.append(str(e))
        else:
            verify(spliced.forward)
            if spliced.backward is not None:
                verify(spliced.backward)
            check_gradients(spliced.backward, skel.differentiable, "spliced from one block")
            seconds = time.perf_counter() - start
            return replace(skel, forward=spliced.forward, backward=spliced.backward, trace_seconds=seconds, layers=spliced.layer,
                           regional=f"spliced: {rep.count} blocks of {rep.prefix} from one traced block ({seconds:.1f} s)")
    if rep.count <= traced:
        reasons.append(f"{rep.count} blocks in {rep.prefix}, no more than the {traced} a splice of several traced blocks traces")
    # Block 0's backward may differ from the others' (Thunder recomputes the embedding for it): then
    # trace a 4th block and keep block 0's backward whole.
    for blocks, first_in_tail in ((traced, False), (traced + 1, True)):
        if blocks >= rep.count:
            break
        try:
            part = capture(truncated(module, rep.prefix, blocks), *args, **kwargs)
            fwd, bwd = splice(part.forward, part.backward, rep.prefix, blocks, rep.count, first_in_tail)
        except NotRepeatable as e:
            reasons.append(str(e) if not first_in_tail else f"with a 4th block: {e}")
            if not str(e).startswith("the backward"):
                break
        except MissingOpError:
            raise
        except Exception as e:  # noqa: BLE001 - the cut model may not trace (e.g. a forward indexing block n-1): trace it whole
            reasons.append(f"the model cut to {blocks} blocks of {rep.prefix} did not trace ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})")
            break
        else:
            verify(fwd)  # a splice that broke the graph is nvtp's bug: say so here, not in a pass later
            if bwd is not None:
                verify(bwd)
            differentiable = _every_block(part.differentiable, rep.prefix, rep.count)
            check_gradients(bwd, differentiable, f"spliced from {blocks} blocks")
            seconds = time.perf_counter() - start
            kept = "; block 0's backward kept whole" if first_in_tail else ""
            why = f"; not from one traced block: {reasons[0]}" if template and reasons else ""
            return replace(part, forward=fwd, backward=bwd, trace_seconds=seconds, differentiable=differentiable,
                           regional=f"spliced: {rep.count} blocks of {rep.prefix} from a trace of {blocks}{kept} ({seconds:.1f} s){why}")
    reason = "whole trace: " + "; ".join(reasons)
    return replace(capture(module, *args, **kwargs), regional=reason)
