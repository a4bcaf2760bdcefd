"""Activation recomputation: the backward re-runs forward ops instead of reading what the forward saved.

    plan = plan_recompute(traced.forward, traced.backward, "selective", layers, sequence=T)
    traced = recompute(traced, "block")      # a Traced whose backward recomputes each block from its input

A traced program keeps, for its backward, the forward values the backward reads (the forward's
outputs of role ``saved``). Recomputation trades memory for time: some of those values are not
kept; the backward computes them again, from values it keeps, right before it first needs them.
Two modes, as Korthikanti et al. (2022) define them:

* ``"selective"``: the attention core. The ``[B, h, T, T]`` scores and probabilities of an
  attention written out (saved values on the path from the product q kᵀ to the product with v,
  each of shape [.., T, T]) are recomputed from the query and key; a flash attention
  (``sdpfa_fwd``) keeps none, so there this is a no-op.
* ``"block"``: every value a block computes (``Captured.layers``: a spliced trace's record of
  which block copy computes each forward value) is recomputed from the block's input and
  weights; the forward keeps only the values that cross blocks (each block's input) and what
  the ops outside blocks save. Peak memory for activations is then one block's.

The plan is data (``Recompute``): which saved values are dropped, which forward ops the backward
re-runs, which values it keeps instead. ``recompute`` rewrites the fusions: the forward's
outputs change (its ops do not); the backward gets the kept values as inputs (a parameter by its
label, a forward value as ``saved`` with its ``source``) and the re-run ops, each a renamed copy
of its forward op placed right before the first op that needs it (so only one block's
recomputed values are alive at once). A random op (dropout) is never re-run: its result is
kept (re-running would draw other numbers); a flash attention without dropout is re-run.
The rewritten pair computes what the original computes: the same ops on the same values.
A plan that would keep as many activation bytes as it drops is empty: nothing to gain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from nvtp.errors import InputError
from nvtp.ir.graph import Fusion, Op, TensorValue, ValueInfo, defines_input, fresh_names
from nvtp.ir.ops import OPS

MODES = ("none", "selective", "block")


@dataclass(frozen=True)
class Recompute:
    """What a recompute mode does to one forward/backward pair (names are the forward's)."""

    mode: str
    dropped: tuple[str, ...]  # saved forward values the backward recomputes instead of reading
    ops: tuple[int, ...]  # indices of the forward ops the backward re-runs, in forward order
    kept: tuple[str, ...]  # forward values the recomputation starts from, not saved before (now saved)

    @property
    def empty(self) -> bool:
        return not self.dropped


def check_mode(mode: Any) -> str:
    """``mode`` if it is one nvtp knows; else an ``InputError`` naming them."""
    if mode is None or mode is False:
        return "none"
    if not isinstance(mode, str) or mode not in MODES:
        raise InputError(f"recompute={mode!r}: choose one of {', '.join(map(repr, MODES))} (none: keep every activation; "
                         "selective: recompute attention's core, as Korthikanti et al.; block: recompute each block from its input)")
    return mode


def _deterministic(op: Op) -> bool:
    """Whether re-running ``op`` gives what it gave: not a random op, unless it is an attention without dropout."""
    if op.kind not in OPS or not OPS[op.kind].random:
        return True
    if op.kind == "sdpfa_fwd":
        p = op.arg("dropout_p")
        return p is None or (isinstance(p, (int, float)) and p == 0)
    return False


def _saved(forward: Fusion, backward: Fusion) -> list[str]:
    """The forward values the backward reads as ``saved`` inputs (forward outputs and forward inputs)."""
    return [backward.info[v.name].source for v in backward.inputs if backward.role(v.name) == "saved"]


PRODUCTS = frozenset({"matmul"})  # an attention's two products of activations: q kᵀ (the scores) and p v (the output)


def _square(forward: Fusion, name: str, sequence: int) -> bool:
    v = forward.value(name)
    return isinstance(v, TensorValue) and v.ndim >= 2 and v.shape[-1] == v.shape[-2] == sequence


def _attention_core(forward: Fusion, saved: list[str], sequence: int | None) -> tuple[list[str], set[str]]:
    """(the saved values to recompute, the attention core): the core is every [.., T, T] value
    between an attention's two products, back from a product's first operand (the probabilities)
    through [.., T, T] values to the product that made the scores. The shape alone is not enough:
    where a head size or the hidden size equals the sequence, q, v, the attention's output and
    [B, T, C] values have two last axes of the sequence too."""
    if sequence is None:
        return [], set()
    producer = {v.name: k for k, op in enumerate(forward.ops) if not defines_input(op) for v in op.outputs}
    core: set[str] = set()
    for op in forward.ops:
        if op.kind not in PRODUCTS or not _square(forward, op.operands[0].name, sequence):
            continue
        first = op.operands[0].name
        seen, stack, scores = {first}, [first], False
        while stack:
            k = producer.get(stack.pop())
            if k is None:
                continue
            if forward.ops[k].kind in PRODUCTS:  # the scores' product: its operands (q, kᵀ) are outside
                scores = True
                continue
            for u in forward.ops[k].operands:
                if u.name not in seen and _square(forward, u.name, sequence):
                    seen.add(u.name)
                    stack.append(u.name)
        if scores:
            core |= seen
    wanted = [n for n in saved if n in core and n in producer and forward.value(n).ndim >= 3]
    return wanted, core


def plan_recompute(forward: Fusion, backward: Fusion | None, mode: str, layers: Mapping[str, int] | None = None,
                   sequence: int | None = None) -> Recompute:
    """The plan of ``mode`` for this pair (see the module docstring). ``layers``: forward value ->
    the block computing it (``block`` needs it); ``sequence``: the sequence length (``selective``
    recomputes saved values whose last two axes are it)."""
    mode = check_mode(mode)
    if mode == "none" or backward is None:
        return Recompute(mode, (), (), ())
    layers = dict(layers or {})
    saved = list(dict.fromkeys(_saved(forward, backward)))
    producer = {v.name: k for k, op in enumerate(forward.ops) if not defines_input(op) for v in op.outputs}
    if mode == "selective":
        wanted, core = _attention_core(forward, saved, sequence)

        def inside(name: str, root: str) -> bool:  # the attention core: the [.., T, T] values, back to q and k
            return name in core
    else:
        if not layers:
            raise InputError("recompute='block' recomputes each block from its input, which needs a model of repeated blocks "
                             "traced once and spliced (regional=True, an nn.ModuleList of blocks alike); this program was traced "
                             "whole: use recompute='selective' or 'none'")
        wanted = [n for n in saved if n in layers and n in producer]

        def inside(name: str, root: str) -> bool:  # a value of the same block
            return layers.get(name) == layers[root]
    # Grow each wanted value's cone back to its frontier: values outside its block, forward inputs,
    # results of random ops, and values kept anyway. A frontier value is kept, so never dropped
    # itself: repeat until the kept set stops growing (it only grows).
    kept_set: set[str] = set()
    while True:
        frontier: set[str] = set()
        cones: dict[str, set[int]] = {}
        for root in wanted:
            if root in kept_set:
                continue
            ops: set[int] = set()
            stack, seen = [root], {root}
            while stack:
                name = stack.pop()
                k = producer.get(name)
                if k is None or (name != root and (name in kept_set or not inside(name, root))) or not _deterministic(forward.ops[k]):
                    frontier.add(name)
                    continue
                ops.add(k)
                for u in forward.ops[k].operands:
                    if u.name not in seen:
                        seen.add(u.name)
                        stack.append(u.name)
            cones[root] = ops
        grown = kept_set | (frontier & set(wanted))
        if grown == kept_set:
            break
        kept_set = grown
    dropped = [n for n in wanted if n not in kept_set]
    have = set(saved) - set(dropped)
    chosen = set().union(*(cones[n] for n in dropped)) if dropped else set()
    # A value the recomputation starts from that is a view of one the backward has (q and k, a
    # slice and permute of the saved fused projection) is re-made from it, not kept besides it.
    for k in list(chosen):
        for u in forward.ops[k].operands:
            chosen |= set(_view_of_saved(forward, producer, u.name, have) or ())
    ops = sorted(chosen)
    recomputed = {v.name for k in ops for v in forward.ops[k].outputs}
    needed = {u.name for k in ops for u in forward.ops[k].operands if u.name not in recomputed}
    kept = tuple(sorted(n for n in needed if n not in have and n not in _backward_reads(forward, backward)))
    activations = [n for n in kept if forward.role(n) != "parameter"]
    if sum(forward.value(n).nbytes for n in activations) >= sum(forward.value(n).nbytes for n in dropped):
        return Recompute(mode, (), (), ())  # keeping what the recomputation starts from would take as much: nothing to gain
    return Recompute(mode, tuple(dropped), tuple(ops), kept)


def _view_of_saved(forward: Fusion, producer: Mapping[str, int], name: str, have: set[str]) -> list[int] | None:
    """The forward ops that make ``name`` from a value in ``have`` by layout ops alone (a slice, a
    reshape, a permute: ``OpSpec.layout``, each of one operand), or None where there is no such chain."""
    chain, at = [], name
    while at not in have:
        k = producer.get(at)
        if k is None:
            return None
        op = forward.ops[k]
        if op.kind not in OPS or not OPS[op.kind].layout or len(op.operands) != 1 or not isinstance(op.operands[0], TensorValue):
            return None
        chain.append(k)
        at = op.operands[0].name
    return chain


def _backward_reads(forward: Fusion, backward: Fusion) -> set[str]:
    """Forward inputs the backward reads already as parameters (by label)."""
    labels = {backward.label(v.name) for v in backward.inputs if backward.role(v.name) == "parameter"}
    return {v.name for v in forward.inputs if forward.role(v.name) == "parameter" and forward.label(v.name) in labels}


def apply(forward: Fusion, backward: Fusion, plan: Recompute) -> tuple[Fusion, Fusion]:
    """The pair rewritten by ``plan`` (see the module docstring)."""
    if plan.empty:
        return forward, backward
    dropped = set(plan.dropped)
    f_inputs = {v.name for v in forward.inputs}
    # forward: drop the recomputed outputs, keep the new frontier (forward values, not inputs)
    outputs = [v for v in forward.outputs if v.name not in dropped]
    present = {v.name for v in outputs}
    info = dict(forward.info)
    for name in plan.kept:
        if name not in f_inputs and name not in present:
            outputs.append(forward.value(name))
            info[name] = ValueInfo("saved")
    new_forward = replace(forward.with_ops(forward.ops, tuple(outputs)), info=info)
    # backward: inputs for the kept values, the dropped inputs' readers read the recomputed copies
    names = fresh_names(backward)
    b_info = dict(backward.info)
    bname: dict[str, str] = {}  # forward name -> the backward's value holding it
    drop_inputs: set[str] = set()
    for v in backward.inputs:
        i = backward.info.get(v.name)
        if i is not None and i.role == "saved":
            if i.source in dropped:
                drop_inputs.add(v.name)
            else:
                bname.setdefault(i.source, v.name)
        elif i is not None and i.role == "parameter":
            for u in forward.inputs:
                if forward.role(u.name) == "parameter" and forward.label(u.name) == i.label:
                    bname.setdefault(u.name, v.name)
    defines: list[Op] = [op for op in backward.ops if defines_input(op) and op.outputs[0].name not in drop_inputs]
    define_op = {op.outputs[0].name: op for op in forward.ops if defines_input(op)}
    for name in sorted({u.name for k in plan.ops for u in forward.ops[k].operands} | set(plan.kept)):
        if name in bname or any(name == v.name for k in plan.ops for v in forward.ops[k].outputs):
            continue
        new = next(names)
        bname[name] = new
        v = forward.value(name)
        src_define = define_op.get(name)
        if src_define is not None and forward.role(name) == "parameter":
            defines.append(src_define.renamed(lambda x: x.name, lambda x: new))
            b_info[new] = ValueInfo("parameter", forward.label(name))
        else:
            defines.append(_define(v, new))
            b_info[new] = ValueInfo("saved", source=name)
    by_output = {v.name: k for k in plan.ops for v in forward.ops[k].outputs}
    dropped_input_source = {v.name: backward.info[v.name].source for v in backward.inputs if v.name in drop_inputs}
    emitted: set[int] = set()
    body: list[Op] = []

    def emit(k: int) -> None:
        if k in emitted:
            return
        for u in forward.ops[k].operands:
            if u.name in by_output:
                emit(by_output[u.name])
        emitted.add(k)
        op = forward.ops[k]
        spare = {}  # a result the backward already holds (a flash attention's log-sum-exp, saved beside the
        for v in op.outputs:  # output it re-makes): the re-run's copy gets a name of its own, read by nothing
            if v.name in bname:
                spare[v.name] = next(names)
            else:
                bname[v.name] = next(names)
        body.append(op.renamed(lambda x: bname[x.name], lambda x: spare.get(x.name) or bname[x.name]))

    for op in backward.ops:
        if defines_input(op):
            continue
        reads = {}
        for u in op.operands:
            src = dropped_input_source.get(u.name)
            if src is not None:
                emit(by_output[src])
                reads[u.name] = bname[src]
        body.append(op.renamed(lambda x: reads.get(x.name, x.name)) if reads else op)
    outputs_b = tuple(backward.outputs)
    for v in backward.inputs:
        if v.name in drop_inputs:
            b_info.pop(v.name, None)
    new_backward = replace(backward.with_ops(tuple(defines) + tuple(body), outputs_b), info=b_info)
    return new_forward, new_backward


def _define(v: TensorValue, name: str) -> Op:
    """A ``define_tensor`` of ``v``'s shape and dtype named ``name`` (as the stage cutter defines received values)."""
    n = len(v.shape)
    return Op("define_tensor", (("shape", tuple(v.shape)), ("contiguity", tuple(None if d == 1 else True for d in v.shape)),
                                ("dtype", v.dtype), ("is_cpu", False), ("stride_order", tuple(range(n - 1, -1, -1)))),
              (TensorValue(name, tuple(v.shape), v.dtype),))


def sequence_of(traced: Any) -> int | None:
    """The sequence length of a traced module: axis 1 of its first argument of two or more axes."""
    f = traced.forward
    for v in f.inputs:
        if isinstance(v, TensorValue) and f.label(v.name) in traced.arguments and v.ndim >= 2:
            return v.shape[1]
    return None


def layers_of(traced: Any) -> dict[str, int]:
    return dict(getattr(traced.captured, "layers", None) or {})


def recompute(traced: Any, mode: str, layers: Mapping[str, int] | None = None, sequence: int | None = None) -> Any:
    """``traced`` (an ``nvtp.driver.Traced``) with its backward recomputing what ``mode`` says;
    ``traced`` itself for "none" or a program without a backward. ``layers`` and ``sequence``:
    the block of each forward value and the sequence length, when ``traced`` is a part of a
    model (a pipeline stage) that does not know them itself."""
    mode = check_mode(mode)
    if mode == "none" or traced.backward is None:
        return traced
    layers = layers_of(traced) if layers is None else layers
    plan = plan_recompute(traced.forward, traced.backward, mode, layers, sequence_of(traced) if sequence is None else sequence)
    if plan.empty:  # said, not silent: the program is the one without recomputation
        why = ("the backward reads no [.., T, T] attention values (a flash attention keeps none)" if mode == "selective"
               else "keeping each block's input would take as many bytes as it drops")
        return replace(traced, how=f"{traced.how}; recompute={mode}: nothing recomputed, {why}")
    forward, backward = apply(traced.forward, traced.backward, plan)
    return replace(traced, forward=forward, backward=backward, how=f"{traced.how}; recompute={mode}: "
                   f"{len(plan.dropped)} saved values recomputed by {len(plan.ops)} forward ops in the backward")


__all__ = ["MODES", "Recompute", "check_mode", "plan_recompute", "apply", "recompute", "sequence_of", "layers_of"]
