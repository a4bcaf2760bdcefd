"""A deep model's repeated blocks: which list they are, how a label names one, the model cut to fewer.

Regional compilation (``nvtp.frontend.regional`` on Thunder's route, ``nvtp.frontend.fx_regional``
on the FX route) and the pipeline's cut (``nvtp.pipeline``) find the blocks here, by the module
tree alone (no model-specific names). Whether the blocks compute the same program is another
question, answered by a run of the model (``nvtp.frontend.variants``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


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
    """The model's repeated blocks: an ``nn.ModuleList`` of 2 or more children of one class and
    parameter shapes that own their parameters (none tied to another part of the model). Only
    outermost lists count: a list inside a block of another list of 2 or more of one class
    (StableLM's per-head norms ``self_attn.q_layernorm.norms`` inside each decoder layer) is a part
    of that block, never the blocks. Of several, the one holding the most parameter elements (then the longest): the
    decoder layers, not a list of small heads beside them. Raises ``NotRepeatable`` naming why
    none fits."""
    best: tuple[int, int, str] | None = None
    why = f"{type(module).__name__} has no nn.ModuleList of 2 or more blocks alike"
    lists = [(name, m) for name, m in module.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and name]
    repeated = [name for name, m in lists if len({type(c) for c in m}) == 1]
    for name, m in lists:
        if any(name.startswith(f"{outer}.") for outer in repeated):
            continue  # inside a block of an outer list
        sigs = {_signature(c) for c in m}
        if len(sigs) != 1:
            why = f"the blocks of {name} differ (class or parameter shapes)"
            continue
        inside = {id(p) for p in m.parameters()}
        outside = [n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in inside and not n.startswith(name + ".")]
        if outside:
            why = f"a parameter of {name} is tied to {outside[0]}"
            continue
        size = (sum(p.numel() for p in m.parameters()), len(m), name)
        if best is None or size[:2] > best[:2]:
            best = size
    if best is None:
        raise NotRepeatable(why)
    return Repeated(best[2], best[1])


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


# -- labels ----------------------------------------------------------------------------------------

def block_index(label: str, prefix: str) -> tuple[int, str] | None:
    """``h.3.attn.c_attn.weight`` -> (3, ``attn.c_attn.weight``); also inside ``grad(...)``."""
    inner = label[5:-1] if label.startswith("grad(") and label.endswith(")") else label
    if not inner.startswith(prefix + "."):
        return None
    idx, _, rest = inner[len(prefix) + 1:].partition(".")
    return (int(idx), rest) if idx.isdigit() else None


def relabel(label: str, prefix: str, index: int) -> str:
    found = block_index(label, prefix)
    if found is None:
        return label
    inner = f"{prefix}.{index}.{found[1]}"
    return f"grad({inner})" if label.startswith("grad(") else inner


def every_block(labels: tuple[str, ...], prefix: str, count: int) -> tuple[str, ...]:
    """``labels`` with each label of a block (``h.1.mlp.c_fc.weight``) repeated for all ``count``
    blocks: what a model of ``count`` blocks differentiates, from a trace of fewer."""
    out: dict[str, None] = {}
    for label in labels:
        if block_index(label, prefix) is None:
            out[label] = None
        else:
            out.update(dict.fromkeys(relabel(label, prefix, i) for i in range(count)))
    return tuple(out)
