"""Refusals before tracing, from what a call's arguments and the model's modules already tell.

    precheck.check_call(model, mesh, args, kwargs)   # before driver.trace, on every new call shape

A model is traced on its first call (and again for each new shape with ``dynamic=True``), which
takes seconds to minutes. What the arguments' shapes and the model's modules decide is refused
before that, in the user's terms:

* a mesh with a "cp" axis splits every argument of 2 or more dimensions along its sequence
  (dimension 1) into cp x chunks pieces (``nvtp.sharding.context``: 2 a rank without tp, for the
  balanced layout): token ids, targets ([B, T]) and activations ([B, T, C]) of a length they do
  not divide (a mask's shape is left to the cp pass, whose refusal of the mask itself says more);
* a model with a learned table of positions (an ``nn.Embedding`` named for positions, ``wpe``
  or ``*pos*``, as nanoGPT, GPT-2 and BERT name theirs): a token sequence longer than the table,
  which would otherwise fail inside the trace's ``index_select``.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from nvtp.errors import InputError
from nvtp.sharding.context import SEQUENCE_DIM, ContextError, chunks
from nvtp.sharding.placements import DeviceMesh


def check_call(module: torch.nn.Module, mesh: DeviceMesh | None, args: tuple, kwargs: Mapping[str, Any] | None = None) -> None:
    """Refuse arguments the mesh or the model cannot take, before anything is traced (see the
    module docstring): ``ContextError`` for a sequence cp cannot split, ``InputError`` for one
    longer than the model's table of positions. Touches nothing."""
    named = _named(module, args, kwargs or {})
    if mesh is not None and "cp" in mesh.names:
        _check_sequence_splits(mesh, named)
    _check_positions(module, named)


def _named(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        names = []
    names += [f"argument {i}" for i in range(len(names), len(args))]
    out = [(n, a) for n, a in zip(names, args) if isinstance(a, torch.Tensor)]
    return out + [(k, a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)]


def _check_sequence_splits(mesh: DeviceMesh, named: list[tuple[str, torch.Tensor]]) -> None:
    cp = mesh.shape[mesh.names.index("cp")]
    parts = chunks(mesh)
    for name, a in named:  # token ids and targets [B, T], activations [B, T, C]; a mask's refusal says more after the trace
        if a.ndim in (2, 3) and a.dtype != torch.bool and a.shape[SEQUENCE_DIM] % (cp * parts):
            n = a.shape[SEQUENCE_DIM]
            up = -(-n // (cp * parts)) * cp * parts
            raise ContextError(f"argument {name} {list(a.shape)}: its sequence (dimension {SEQUENCE_DIM}) of length {n} cannot be "
                               f"split over the cp axis of size {cp}: the balanced layout cuts it into {cp * parts} pieces "
                               f"({cp} ranks x {parts}); pass a sequence length that is a multiple of {cp * parts} (e.g. pad to "
                               f"{up})")


def position_table(module: torch.nn.Module) -> tuple[str, torch.nn.Embedding] | None:
    """The model's learned table of positions: an ``nn.Embedding`` (the class itself: subclasses
    such as OPT's shift their positions) whose name says positions (``wpe``, ``*pos*``)."""
    for name, m in module.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if type(m) is torch.nn.Embedding and (last == "wpe" or "pos" in last):
            return name, m
    return None


def _check_positions(module: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    table = position_table(module)
    if table is None:
        return
    tokens = next(((n, a) for n, a in named if a.ndim == 2 and not a.dtype.is_floating_point and not a.dtype.is_complex
                   and a.dtype != torch.bool), None)
    if tokens is None:
        return
    (where, emb), (name, a) = table, tokens
    n, length = emb.num_embeddings, a.shape[SEQUENCE_DIM]
    if length > n:
        raise InputError(f"argument {name} {list(a.shape)} is a sequence of {length} tokens, but {type(module).__name__}'s table of "
                         f"positions {where} (nn.Embedding({n}, {emb.embedding_dim})) holds {n}: pass at most {n} tokens "
                         f"(e.g. the last {n}, {name}[:, -{n}:], as nanoGPT's generate crops its context)")


__all__ = ["check_call", "position_table"]
