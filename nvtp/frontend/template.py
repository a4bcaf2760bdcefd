"""The template splice: the L-layer fusions from the model without its blocks and one traced block per variant.

Regional compilation's first way (``nvtp.frontend.regional``; the FX route's only one,
``nvtp.frontend.fx_regional``). Two traces that do not grow with depth: the *skeleton*, the model
with its chain of blocks replaced by ``Boundary`` (``x * 1.0``, a marker found again in the
forward and, as ``1.0 * grad``, in the backward), and one block of each *variant* alone (the blocks
grouped by what they compute, ``nvtp.frontend.variants``: one variant when all are alike). The
L-layer forward is the skeleton's with the marker replaced by L copies, each of its own variant's
block forward (parameters named ``<prefix>.<i>.*``, the carry chained); the backward the skeleton's
with its marker replaced by the L copies of the blocks' backwards in reverse, each reading the
values its own forward copy saved. A skeleton backward that recomputes the marker (Thunder
rematerialising ``x * 1.0``) reads the last block's output instead. With dropout each copy draws
its own masks, in the whole trace's order: tests/test_regional.py compares the loss and every
gradient with a whole trace, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from nvtp.frontend.blocks import NotRepeatable
from nvtp.frontend.splice import canonical, live
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Fusion, Op, Value, ValueInfo, defines_input, is_value, renamed_value


class Boundary(torch.nn.Module):
    """Stands for the whole chain of blocks in the skeleton: ``x * 1.0``, one multiplication (cast
    to float and back for a low-precision ``x``) that marks where the chain's input leaves the head
    and its output enters the tail, in the forward and, as ``1.0 * grad``, in the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


def _marker(f: Fusion, carry: torch.Tensor, forward: bool, mark: float = 1.0) -> tuple[set[int], str, str]:
    """The ops of ``Boundary`` in a skeleton fusion: (their indices, the value entering, the value
    leaving). Forward: ``x * 1.0``; backward: ``1.0 * g``; each with a cast to float before and a
    cast back after when the carry is of lower precision."""
    found = markers(f, carry, forward, mark)
    if len(found) != 1:
        raise NotRepeatable(f"the skeleton's {'forward' if forward else 'backward'} has {len(found)} places where the chain of "
                            "blocks could be, not 1")
    return found[0]


def markers(f: Fusion, carry: torch.Tensor, forward: bool, mark: float = 1.0) -> list[tuple[set[int], str, str]]:
    """Every op group of ``f`` that ``_marker`` would take (a backward that recomputes the forward's
    ``x * 1.0`` has one of the forward's form too)."""
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


@dataclass
class _Variant:
    """What the splice needs of one variant's traced block: its fusions and how they connect."""

    forward: Fusion
    backward: Fusion | None
    index: int
    inputs: list[Op]  # the forward's input definitions
    x: str  # the carry (forward input)
    y: str  # the block's one output
    invariant: dict[str, str]  # forward input -> the skeleton value every copy reads in its place
    common: set[str]  # forward inputs one for all copies (``shared``)

    @classmethod
    def of(cls, fwd: Fusion, bwd: Fusion | None, index: int, carry_label: str | None, reads: dict[str, str],
           shared: dict[str, str]) -> "_Variant":
        inputs = [op for op in fwd.ops if defines_input(op)]
        acts = [op.outputs[0] for op in inputs if fwd.role(op.outputs[0].name) != "parameter"]
        carried = [v for v in acts if (fwd.label(v.name) == carry_label if carry_label else True)]
        if len(carried) != 1:
            raise NotRepeatable(f"the block's forward reads {len(carried)} inputs that are not its parameters, not 1 (the carry)")
        x = carried[0].name
        unread = [fwd.label(v.name) for v in acts if v.name != x and fwd.label(v.name) not in reads | shared]
        if unread:
            raise NotRepeatable(f"the block's forward reads {', '.join(unread)}, which the skeleton does not give")
        invariant = {v.name: reads[fwd.label(v.name)] for v in acts if fwd.label(v.name) in reads}
        common = {op.outputs[0].name for op in inputs if fwd.label(op.outputs[0].name) in shared}
        ys = [v for v in fwd.outputs if fwd.role(v.name) == "output"]
        if len(ys) != 1:
            raise NotRepeatable(f"the block's forward has {len(ys)} outputs, not 1")
        return cls(fwd, bwd, index, inputs, x, ys[0].name, invariant, common)

    def shared_name(self, name: str) -> str:
        return f"{name}#shared{self.index}"

    @property
    def saved_sources(self) -> list[str]:
        """The forward values the backward reads (saved), by their forward names."""
        b = self.backward
        return [b.info[op.outputs[0].name].source for op in b.ops if defines_input(op) and b.role(op.outputs[0].name) == "saved"] \
            if b is not None else []


def splice_template(skeleton_fwd: Fusion, skeleton_bwd: Fusion | None, blocks: Sequence[tuple[Fusion, Fusion | None]],
                    variant_of: Sequence[int], carry: torch.Tensor, prefix: str, *, carry_label: str | None = None,
                    reads: dict[str, str] | None = None, shared: dict[str, str] | None = None,
                    extras: frozenset[str] | set[str] = frozenset(), mark: float = 1.0) -> Spliced:
    """The L-layer forward and backward (L = ``len(variant_of)``): the skeleton's (the model with
    its chain of blocks replaced by ``Boundary``), with the boundary replaced by L copies, copy i
    of ``blocks[variant_of[i]]``'s fusions (a traced block of each variant), chained through the
    carry; each copy's parameters named ``<prefix>.<i>.<name>``. Requires every block traced alone
    on a carry like ``carry``, and ``variant_of`` proven (``nvtp.frontend.variants``).

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
    layers = len(variant_of)
    kinds = [_Variant.of(f, b, k, carry_label, reads, shared) for k, (f, b) in enumerate(blocks)]
    first_layer = {k: variant_of.index(k) for k in range(len(kinds))}

    def label(f: Fusion, name: str, i: int) -> str:
        return f"{prefix}.{i}.{f.label(name)}"

    # Forward.
    drop, entering, leaving = _marker(skeleton_fwd, carry, True, mark)
    ops: list[Op] = [op for op in skeleton_fwd.ops if defines_input(op)]
    info: dict[str, ValueInfo] = {n: i for n, i in skeleton_fwd.info.items()}
    for kind in kinds:  # one input for all copies
        for op in kind.inputs:
            v = op.outputs[0]
            if v.name in kind.common:
                ops.append(Op(op.kind, op.args, (renamed_value(v, kind.shared_name(v.name)),)))
                info[kind.shared_name(v.name)] = ValueInfo("parameter", shared[kind.forward.label(v.name)])
    for i in range(layers):
        kind = kinds[variant_of[i]]
        for op in kind.inputs:
            v = op.outputs[0]
            if v.name != kind.x and v.name not in kind.invariant and v.name not in kind.common:
                ops.append(Op(op.kind, op.args, (renamed_value(v, f"{v.name}#{i}"),)))
                info[f"{v.name}#{i}"] = ValueInfo("parameter", label(kind.forward, v.name, i))
    inputs = {v.name for op in ops for v in op.outputs}
    read: dict[str, str] = {}
    carries = []  # the carry entering each copy (forward names)
    layer_of = {f"{op.outputs[0].name}#{i}": i for i in range(layers) for op in kinds[variant_of[i]].inputs}

    def fname(name: str, i: int) -> str:
        kind = kinds[variant_of[i]]
        if name == kind.x:
            return carries[i]
        if name in kind.invariant:
            return kind.invariant[name]
        return kind.shared_name(name) if name in kind.common else f"{name}#{i}"

    for j, op in enumerate(skeleton_fwd.ops):
        if defines_input(op):
            continue
        if j in drop:
            if j == min(drop):
                defined = {v.name for o in ops for v in o.outputs}
                late = sorted({s for kind in kinds for s in kind.invariant.values()} - defined)
                if late:
                    raise NotRepeatable(f"the skeleton's forward computes {', '.join(late)}, which the blocks read, after them")
                carry_in = read.get(entering, entering)
                for i in range(layers):
                    carries.append(carry_in)
                    copy_ops = _copied(kinds[variant_of[i]].forward, lambda name, i=i: fname(name, i))
                    layer_of.update((v.name, i) for op in copy_ops for v in op.outputs)
                    ops += copy_ops
                    carry_in = fname(kinds[variant_of[i]].y, i)
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
    # A backward that recomputes the boundary (Thunder rematerialising ``x * 1.0`` from the head's
    # output) reads the last block's output instead: the forward saves it.
    recomputed = markers(skeleton_bwd, carry, True, mark) if skeleton_bwd is not None else []
    if recomputed and read[leaving] not in outs:
        outs[read[leaving]] = values[read[leaving]]
        info[read[leaving]] = ValueInfo("saved")
    inputs = {op.outputs[0].name for op in ops if defines_input(op)}
    for i in range(layers):
        for s in kinds[variant_of[i]].saved_sources:
            name = fname(s, i)
            if name not in outs and name not in inputs:  # block 0's carry may be an argument: the backward reads it as it is
                outs[name] = values[name]
                info[name] = ValueInfo("saved")
    kept = {v.name: read.get(v.name, v.name) for v in skeleton_fwd.outputs if read.get(v.name, v.name) in outs}
    fwd, frename = canonical(skeleton_fwd.name, live(ops, outs), list(outs.values()), {n: i for n, i in info.items() if n in values},
                             skeleton_fwd)
    renamed = {old: frename[new] for old, new in kept.items()}
    layer = {frename[n]: i for n, i in layer_of.items() if n in frename}
    with_backward = [kind.backward is not None for kind in kinds]
    if any(with_backward) and not all(with_backward):
        raise NotRepeatable("some variants of the blocks have a backward and some not")
    if skeleton_bwd is None or not all(with_backward):
        return Spliced(fwd, None, renamed, layer)

    # Backward: the copies in reverse, the incoming gradient of each the outgoing one of the copy after.
    grads_in: dict[int, tuple[str, str, list[Op], set[str]]] = {}  # variant -> (gy, gx, its input definitions, one for all copies)
    for kind in kinds:
        b = kind.backward
        b_inputs = [op for op in b.ops if defines_input(op)]
        gys = [op.outputs[0].name for op in b_inputs if b.role(op.outputs[0].name) == "grad"]
        gxs = [v.name for v in b.outputs if b.grad_of(v.name) == kind.forward.label(kind.x)]
        if len(gys) != 1 or len(gxs) != 1:
            raise NotRepeatable(f"the block's backward takes {len(gys)} gradients and gives {len(gxs)} for its input, not 1 and 1")
        # A block's backward input that is the same for every copy: a shared constant, or a saved invariant.
        common = {op.outputs[0].name for op in b_inputs if
                  (b.role(op.outputs[0].name) == "parameter" and b.label(op.outputs[0].name) in shared)
                  or (b.role(op.outputs[0].name) == "saved" and b.info[op.outputs[0].name].source in kind.common | set(kind.invariant))}
        grads_in[kind.index] = (gys[0], gxs[0], b_inputs, common)
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
    for kind in kinds:
        _, _, b_inputs, common = grads_in[kind.index]
        for op in b_inputs:
            v = op.outputs[0]
            if v.name in common:
                bops.append(Op(op.kind, op.args, (renamed_value(v, kind.shared_name(v.name)),)))
                old = kind.backward.info[v.name]
                binfo[kind.shared_name(v.name)] = ValueInfo("parameter", shared[old.label]) if old.role == "parameter" else \
                    ValueInfo("saved", "", frename[fname(old.source, first_layer[kind.index])])
    for i in range(layers):
        kind = kinds[variant_of[i]]
        gy, _, b_inputs, common = grads_in[kind.index]
        for op in b_inputs:
            v = op.outputs[0]
            role = kind.backward.role(v.name)
            if v.name == gy or v.name in common:
                continue
            bops.append(Op(op.kind, op.args, (renamed_value(v, f"{v.name}#{i}"),)))
            binfo[f"{v.name}#{i}"] = ValueInfo("parameter", label(kind.backward, v.name, i)) if role == "parameter" else \
                ValueInfo("saved", "", frename[fname(kind.backward.info[v.name].source, i)])
    bread: dict[str, str] = {}
    grads: list[tuple[str, str]] = []
    skip: set[int] = set()
    if recomputed:
        define_x = next(op for op in kinds[0].inputs if op.outputs[0].name == kinds[0].x)
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
                    kind = kinds[variant_of[i]]
                    gy, gx, _, common = grads_in[kind.index]

                    def bname(name: str, i: int = i, g: str = g, kind: _Variant = kind, gy: str = gy, common: set[str] = common) -> str:
                        return g if name == gy else kind.shared_name(name) if name in common else f"{name}#{i}"
                    bops += _copied(kind.backward, bname)
                    grads += [(bname(v.name), f"{prefix}.{i}.{kind.backward.grad_of(v.name)}") for v in kind.backward.outputs if v.name != gx]
                    g = bname(gx)
                bread[bleaving] = g
            continue
        bops.append(_reading(op, bread))
    bvalues = {v.name: v for op in bops for v in op.outputs}
    bouts = _outputs_read(skeleton_bwd, bvalues, bread, binfo, "grad")
    for name, of in sorted(grads, key=lambda g: g[1]):
        bouts[name] = bvalues[name]
        binfo[name] = ValueInfo("grad", f"grad({of})", grad_of=of)
    bwd, _ = canonical(skeleton_bwd.name, live(bops, bouts), list(bouts.values()), {n: i for n, i in binfo.items() if n in bvalues},
                       skeleton_bwd)
    return Spliced(fwd, bwd, renamed, layer)
