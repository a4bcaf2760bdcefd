"""A model's output object as a tree: which forward-fusion output each tensor in it is.

Models return more than one tensor: nanoGPT ``(logits, loss)``, ``(logits, None)`` without
targets, dicts, dataclasses. Thunder's trace returns the tensors flat; the object around them is
the model's. ``structure`` records that object once, at capture, with each tensor replaced by a
``Leaf`` naming the fusion output it is (found by identity: the tensor the fusion returned), and
everything else (None, numbers, strings) kept as it was. ``rebuild`` makes the object again from
the fusion's outputs on every call. Each fusion output is labelled by its place in the object
(``y`` for a lone tensor, ``y[0]``, ``y['loss']``, ``y.logits``), so an incoming gradient is
matched to its own output by that place, never by position among the outputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping
import copy

import torch


@dataclass(frozen=True)
class Leaf:
    """A tensor of the output object: the forward fusion's output labelled ``label``."""

    label: str


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _children(x: Any) -> list[tuple[str, Any]] | None:
    """(path suffix, child) of a container the walk enters; None for a leaf."""
    if isinstance(x, (tuple, list)):
        if _is_namedtuple(x):
            return [(f".{f}", v) for f, v in zip(type(x)._fields, x)]
        return [(f"[{i}]", v) for i, v in enumerate(x)]
    if isinstance(x, dict):
        return [(f"[{k!r}]", v) for k, v in x.items()]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [(f".{f.name}", getattr(x, f.name)) for f in dataclasses.fields(x)]
    return None


def tensors(out: Any, path: str = "y") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``out`` with its place (``y[1]``), in order."""
    if isinstance(out, torch.Tensor):
        yield path, out
        return
    for suffix, child in _children(out) or []:
        yield from tensors(child, path + suffix)


def structure(out: Any, leaf: Callable[[str, torch.Tensor], Leaf], path: str = "y") -> Any:
    """``out`` with each tensor replaced by ``leaf(place, tensor)``."""
    if isinstance(out, torch.Tensor):
        return leaf(path, out)
    children = _children(out)
    if children is None:
        return out
    return _remade(out, [structure(child, leaf, path + suffix) for suffix, child in children])


def rebuild(tree: Any, by_label: Mapping[str, torch.Tensor]) -> Any:
    """The output object of ``structure``, each ``Leaf`` replaced by ``by_label[leaf.label]``."""
    if isinstance(tree, Leaf):
        return by_label[tree.label]
    children = _children(tree)
    if children is None:
        return tree
    return _remade(tree, [rebuild(child, by_label) for _, child in children])


def _remade(x: Any, items: list[Any]) -> Any:
    """A container like ``x`` holding ``items`` (in the order of ``_children``)."""
    if _is_namedtuple(x):
        return type(x)(*items)
    if isinstance(x, (tuple, list)):
        return type(x)(items)
    if isinstance(x, dict) and not dataclasses.is_dataclass(x):
        try:
            return type(x)(zip(x.keys(), items))
        except TypeError:  # a dict subclass whose constructor takes something else
            return dict(zip(x.keys(), items))
    new = _copy(x)
    for f, v in zip(dataclasses.fields(x), items):
        try:
            setattr(new, f.name, v)
        except dataclasses.FrozenInstanceError:
            object.__setattr__(new, f.name, v)
    return new


def _copy(x: Any) -> Any:
    return copy.copy(x)
