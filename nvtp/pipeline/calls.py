"""A pipeline's call at the model's boundary: its loss, its arguments, and what it returns.

A pipeline trains from one scalar, the loss: its backward starts from the last stage's loss alone
(1/M per microbatch). A transformers model returns an output object holding the loss and the
logits (``CausalLMOutputWithPast``) and is called ``model(input_ids, labels=labels)``, ``.loss``
taken. ``loss_only`` keeps the loss as the program's one output (the logits' incoming gradient,
which eager's ``out.loss.backward()`` never gives, is zero); ``result`` gives the caller the
model's own object with the loss in it (the other fields None); ``arguments`` names a
microbatch's arguments as the traced program reads them (the FX route's leaves by name, and its
folded constants). A forward returning several tensors none of which is named the loss
(nanoGPT's ``(logits, loss)``) is refused, saying how to wrap it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.utils._pytree as pytree

from nvtp.errors import InputError
from nvtp.ir.build import make_op
from nvtp.ir.graph import Fusion
from nvtp.ir.simplify import dead_code
from nvtp.ir.verify import verify
from nvtp.frontend.fx import without_cache

_LOSS_LABELS = ("y['loss']", "y.loss")


def loss_only(traced: Any, model: str) -> Any:
    """``traced`` (``nvtp.driver.Traced``) with its loss as the forward's one user output, or the
    ``InputError`` that says what to return instead."""
    f = traced.forward
    outs = [v for v in f.outputs if f.role(v.name) == "output"]
    if len(outs) == 1 and len(outs[0].shape) == 0:
        return traced
    loss = _loss_output(traced, outs)
    if loss is None:
        got = ", ".join(f"{f.label(v.name)} {list(v.shape)}" for v in outs)
        raise InputError(f"a pipeline (a mesh with a 'pp' axis) trains a model whose forward returns its loss alone, one scalar, "
                         f"or an output object with a .loss (a transformers model called with labels=); {model}.forward returns "
                         f"{len(outs)} tensor(s): {got}; return only the loss (e.g. wrap the model: class LossOnly(nn.Module): "
                         "def forward(self, idx, targets): return self.model(idx, targets)[1])")
    others = {v.name for v in outs if v.name != loss.name}
    backward = traced.backward
    read = set()
    if backward is not None:
        read = {i.source for i in backward.info.values() if i.role == "saved"}
        backward = _zero_gradients(backward, others)
    info = dict(f.info)
    for name in others & read:  # still read by the backward: a saved value, no longer the caller's
        info[name] = replace(info[name], role="saved", label="")
    outputs = tuple(v for v in f.outputs if v.name not in others or v.name in read)
    forward = dead_code(replace(f, outputs=outputs, info=info))
    return replace(traced, forward=verify(forward), backward=backward)


def _loss_output(traced: Any, outs: list) -> Any:
    """The scalar user output that is the model's loss: labelled ``y['loss']``/``y.loss``, or the
    FX route's output object's ``loss`` field."""
    f = traced.forward
    named = [v for v in outs if f.label(v.name) in _LOSS_LABELS and len(v.shape) == 0]
    if named:
        return named[0]
    call = traced.call
    leaf = _loss_index(call) if call is not None else None
    if leaf is None or call.output_map[leaf][0] != "out":
        return None
    v = outs[call.output_map[leaf][1]]
    return v if len(v.shape) == 0 else None


def _zero_gradients(b: Fusion, of: set[str]) -> Fusion:
    """The backward with the incoming gradients of the forward outputs ``of`` made zeros (a full,
    not an input): eager's ``loss.backward()`` gives those outputs none."""
    ops = []
    for op in b.ops:
        v = op.outputs[0] if op.outputs else None
        if op.kind == "define_tensor" and v is not None and b.role(v.name) == "grad" and b.info[v.name].source in of:
            ops.append(make_op("full", (), {"shape": tuple(v.shape), "fill_value": 0.0, "dtype": v.dtype}, [v.name]))
        else:
            ops.append(op)
    zeroed = {op.outputs[0].name for op, old in zip(ops, b.ops) if op is not old}
    info = {n: i for n, i in b.info.items() if n not in zeroed}
    return verify(replace(b, ops=tuple(ops), info=info))


def arguments(traced: Any, module: torch.nn.Module, args: tuple) -> dict[str, Any]:
    """A microbatch's arguments by the labels of the program's inputs: positions on Thunder's
    route; on the FX route the call's leaves by name (as ``driver.bind_call`` gives the call; its
    folded constants are the stage's state: ``constants``)."""
    call = traced.call
    if call is None:
        return {label: a for label, a in zip(traced.arguments, args) if isinstance(a, torch.Tensor)}

    args, kwargs = without_cache(module, args, {})  # what driver.bind_call gives on the FX route
    return {k: v for k, v in call.bind(args, kwargs).items() if isinstance(v, torch.Tensor)}


def constants(traced: Any) -> dict[str, torch.Tensor]:
    """The FX route's folded constants (a causal mask, positions) by label: state every stage that
    reads them holds, like a buffer."""
    return dict(traced.call.constants) if traced.call is not None else {}


def result(traced: Any, loss: torch.Tensor) -> Any:
    """What the pipeline returns: the loss, or on the FX route the model's output object holding
    it (``out.loss``; the other fields None: only the loss crosses the pipeline)."""
    call = traced.call
    if call is None:
        return loss
    leaf = _loss_index(call)
    if leaf is None:
        return loss
    leaves = [loss if i == leaf else None for i in range(len(call.output_map))]
    return pytree.tree_unflatten(leaves, call.out_spec)


def _loss_index(call: Any) -> int | None:
    """Which leaf of the FX route's output object is its ``loss`` field, if it has one."""
    try:
        tree = pytree.tree_unflatten(list(range(len(call.output_map))), call.out_spec)
        leaf = tree["loss"] if hasattr(tree, "keys") else getattr(tree, "loss", None)
    except (KeyError, AttributeError, TypeError, ValueError):
        return None
    return leaf if isinstance(leaf, int) else None
