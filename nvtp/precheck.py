"""Refusals before tracing, from what a call's arguments and the model's modules already tell.

    precheck.check_call(model, mesh, args, kwargs)   # before driver.trace, on every new call shape

A model is traced on its first call (and again for each new shape with ``dynamic=True``), which
takes seconds to minutes. What the arguments' shapes and the model's modules decide is refused
before that, in the user's terms:

* each mesh axis's strategy looks at the arguments' shapes (``Strategy.check_arguments``): the
  context-parallel axis refuses a sequence its balanced layout cannot split;
* a model with a learned table of positions (an ``nn.Embedding`` named for positions, ``wpe``
  or ``*pos*``, as nanoGPT, GPT-2 and BERT name theirs): a token sequence longer than the table,
  which would otherwise fail inside the trace's ``index_select``.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from nvtp.errors import InputError
from nvtp.sharding import axes
from nvtp.sharding.placements import DeviceMesh

SEQUENCE_DIM = 1  # of token ids [B, T], as nanoGPT and transformers models take them


def check_call(module: torch.nn.Module, mesh: DeviceMesh | None, args: tuple, kwargs: Mapping[str, Any] | None = None) -> None:
    """Refuse arguments the mesh or the model cannot take, before anything is traced (see the
    module docstring): the strategies' refusals (``ShardingError``), ``InputError`` for a sequence
    longer than the model's table of positions. Touches nothing."""
    named = _named(module, args, kwargs or {})
    if mesh is not None:
        for strategy, axis in axes.passes(mesh):
            strategy.check_arguments(mesh, axis, named)
    _check_positions(module, named)


def _named(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        names = []
    names += [f"argument {i}" for i in range(len(names), len(args))]
    out = [(n, a) for n, a in zip(names, args) if isinstance(a, torch.Tensor)]
    return out + [(k, a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)]


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
