"""Tied parameters: one parameter under several names, as one input of the fusions.

GPT-2 and nanoGPT tie the output head to the token embedding (``self.lm_head.weight =
self.wte.weight``): one ``nn.Parameter`` owned by two modules. Thunder unpacks it under each
name, so a trace has two inputs (``wte.weight``, ``lm_head.weight``) and two gradients for one
tensor. ``merge_tied`` makes them what the model means: one forward input (labelled with the
name ``named_parameters()`` gives, the first), read by both uses; one backward output, the sum
of both uses' gradients (what eager autograd accumulates into ``.grad``). The sharding plan then
places the one value once, so the tie cannot break: a placement another use wants is a reshard
inside the fusion, not a second copy of the weight. The other names are kept in the fusion's
``attrs["tied"]`` (``alias=name,...``) so an explicit plan may name the weight by any of them.

One tie mechanism for every route: ``nvtp.driver.trace`` takes ``aliases`` of the module (kept
as ``Traced.tied``, which reports and ``ShardingTransform`` read) and applies ``merge_tied`` to
whatever the route traced (the FX route already reads the weight once, under its first name;
there the ``attrs["tied"]`` record is all it adds). A pipeline traces with ``tie=False``, one input
per name; on the FX route from a meta copy with the names untied (``untie``).
"""

from __future__ import annotations

from typing import Mapping

import torch

from nvtp.ir.build import make_op
from nvtp.ir.graph import Fusion, Op, ValueInfo, defines_input, fresh_names


def aliases(module: torch.nn.Module) -> dict[str, str]:
    """Each second (third, ...) name of a tied parameter of ``module`` -> its first name."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def untie(module: torch.nn.Module) -> None:
    """Each second (third, ...) name of a tied parameter of ``module`` (a meta copy, traced) given a
    parameter of its own, alike: dynamo reads a tied weight once, under its first name, so the FX
    route traces one input per name only from a copy whose names hold distinct parameters (a
    pipeline's stages hold each use: ``driver.trace(tie=False)``)."""
    weights = dict(module.named_parameters(remove_duplicate=False))
    for alias in aliases(module):
        owner, _, attr = alias.rpartition(".")
        p = weights[alias]
        setattr(module.get_submodule(owner), attr,
                torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad))


def aliases_text(tied: Mapping[str, str]) -> str:
    """``attrs["tied"]``: ``alias=name,...`` (read back by ``nvtp.sharding.plans``)."""
    return ",".join(f"{a}={n}" for a, n in tied.items())


def _merge_inputs(f: Fusion, key) -> tuple[list[Op], dict[str, ValueInfo], dict[str, str]]:
    """``f``'s ops with inputs of one ``key(name)`` (None: keep) merged into the first; returns
    the ops, the info, and dropped value -> kept value."""
    kept: dict = {}
    rename: dict[str, str] = {}
    for v in f.inputs:
        k = key(v.name)
        if k is None:
            continue
        if k in kept:
            rename[v.name] = kept[k]
        else:
            kept[k] = v.name
    ops = []
    for op in f.ops:
        if defines_input(op) and op.outputs[0].name in rename:
            continue
        ops.append(op.renamed(lambda v: rename.get(v.name, v.name)) if any(v.name in rename for v in op.operands) else op)
    info = {n: i for n, i in f.info.items() if n not in rename}
    return ops, info, rename


def merge_tied(forward: Fusion, backward: Fusion | None, tied: Mapping[str, str]) -> tuple[Fusion, Fusion | None]:
    """The fusions with each tied parameter one input and (backward) one gradient; see the module
    docstring. ``tied``: alias -> name (``aliases``)."""
    if not tied:
        return forward, backward

    def canon(label: str) -> str:
        return tied.get(label, label)

    ops, info, frename = _merge_inputs(forward, lambda n: canon(forward.label(n)) if forward.role(n) == "parameter" else None)
    for name, i in list(info.items()):
        if i.role == "parameter" and i.label in tied:
            info[name] = ValueInfo("parameter", canon(i.label))
    outputs = tuple(forward.value(frename.get(v.name, v.name)) if v.name in frename else v for v in forward.outputs)
    fwd = Fusion(tuple(ops), tuple(dict.fromkeys(outputs)), forward.name, info, {**forward.attrs, "tied": aliases_text(tied)})
    if backward is None:
        return fwd, None

    b = backward

    def bkey(n: str):
        i = b.info.get(n)
        if i is None:
            return None
        if i.role == "parameter":
            return ("parameter", canon(i.label))
        if i.role == "saved":
            return ("saved", frename.get(i.source, i.source))
        return None

    ops, info, _ = _merge_inputs(b, bkey)
    for name, i in list(info.items()):
        if i.role == "parameter" and i.label in tied:
            info[name] = ValueInfo("parameter", canon(i.label))
        elif i.role == "saved" and i.source in frename:
            info[name] = ValueInfo("saved", i.label, frename[i.source])
    names = fresh_names(b)
    grads: dict[str, list] = {}
    for v in b.outputs:
        if b.grad_of(v.name):
            grads.setdefault(canon(b.grad_of(v.name)), []).append(v)
    outputs = []
    for v in b.outputs:
        of = b.grad_of(v.name)
        if not of:
            outputs.append(v)
            continue
        label = canon(of)
        parts = grads.pop(label, None)
        if parts is None:
            continue  # summed into the first use's output
        total = parts[0]
        for g in parts[1:]:  # eager autograd accumulates every use's gradient into the one .grad
            op = make_op("add", (total, g), {}, [next(names)])
            ops.append(op)
            total = op.outputs[0]
        info[total.name] = ValueInfo("grad", f"grad({label})", grad_of=label)
        outputs.append(total)
    return fwd, Fusion(tuple(ops), tuple(outputs), b.name, info, {**b.attrs, "tied": aliases_text(tied)})
