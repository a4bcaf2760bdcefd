"""What Thunder's interpreter needs to read models it otherwise fails on, as lookasides.

``nvtp.ShardingTransform`` replaces the computation Thunder traces with nvtp's program, but
Thunder must first interpret the model's forward to build its prologue (which parameters and
arguments a call reads) and its return. On transformers 5.23 that fails before any transform runs:
the forward's output-capturing decorator stores its collector in a module-level
``CompileableContextVar`` whose ``set`` writes ``self.global_var`` when it believes it is being
compiled, and Thunder refuses to trace a write into a global object ("trying to set .global_var
of ProvenanceRecord"). The collector only matters when the call asks for hidden states or
attentions (``output_hidden_states=True``): then these lookasides refuse, saying so; otherwise it
is empty and the lookasides are what the context variable does with nothing to collect.

torch's ``nn.MultiheadAttention`` is written with ops Thunder traces (``nvtp.frontend.mha``), and
``torch.minimum`` as ``-maximum(-a, -b)`` (Thunder has no gradient for ``minimum``). nvtp's executor
(``nvtp.jit``'s Thunder route) and ``nvtp.ShardingTransform`` both give Thunder these lookasides.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import thunder.torch as ltorch

from nvtp.errors import InputError
from nvtp.frontend import mha


def cache_off(module: torch.nn.Module) -> bool:
    """Turn a transformers model's KV cache off (``config.use_cache = False``); True if it was on.

    nvtp trains and returns no cache: ``nvtp.jit`` calls such a model with ``use_cache=False``
    (``nvtp.frontend.fx_calls.without_cache``). Thunder interprets the call as the user makes it,
    so with transformers' default config its forward builds a ``DynamicCache``, which Thunder's
    interpreter fails on deep inside transformers ("'_PerLayerConfigView' object has no attribute
    '_config'"). The module ``nvtp.ShardingTransform`` takes is the one it consumes (its weights
    are released after the first call), so its config is where the cache is turned off."""
    config = getattr(module, "config", None)
    if not getattr(config, "use_cache", False):
        return False
    config.use_cache = False
    return True


def lookasides() -> dict[Callable, Callable]:
    """torch or transformers function -> what Thunder's interpreter runs in its place."""
    found: dict[Callable, Callable] = dict(mha.functions(mha.thunder_ops())) | {torch.minimum: _minimum}
    try:
        from transformers.utils import output_capturing  # optional: transformers (pip install nvtp[hf])
    except ImportError:
        return found
    var = output_capturing.CompileableContextVar
    found.update({var.set: _collector_set, var.get: _collector_get, var.reset: _collector_reset})
    try:
        from transformers.cache_utils import DynamicCache  # optional: transformers (pip install nvtp[hf])
    except ImportError:
        return found
    found[DynamicCache.__init__] = _no_cache
    return found


def _no_cache(self: Any, *args: Any, **kwargs: Any) -> None:
    """A call that asks for a KV cache (``use_cache=True``): refused, as ``nvtp.jit`` refuses it."""
    raise InputError("nvtp does not return KV caches (past_key_values) under thunder.jit; call the model with "
                     "use_cache=False (training does not use the cache)")


def _minimum(a: Any, b: Any) -> Any:
    """``torch.minimum`` as ``-maximum(-a, -b)``: Thunder 0.2.6 has no gradient for ``minimum`` (it has
    one for ``maximum``); the values are the same, the gradient torch's (half each on a tie)."""
    return ltorch.neg(ltorch.maximum(ltorch.neg(a), ltorch.neg(b)))


def _collector_set(self: Any, value: Any) -> None:
    if value:
        raise NotImplementedError(f"nvtp does not collect {', '.join(value)} under thunder.jit; call the model without "
                                  "output_hidden_states / output_attentions, or use nvtp.jit(model, ...)")
    return None


def _collector_get(self: Any) -> None:
    return None  # nothing is collected: the capturing hooks do nothing


def _collector_reset(self: Any, token: Any) -> None:
    return None
