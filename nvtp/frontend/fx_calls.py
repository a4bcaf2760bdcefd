"""A call of a model on the FX route: what a compiled program depends on, and what is refused before any work.

A program traced by TorchDynamo and Thunder holds one call's structure: which arguments, keyword
or positional, their shapes and dtypes (``call_structure``). A later call of another structure
is refused (``check_call``) unless the module compiles each new one, and a transformers model's
KV cache is turned off for training (``without_cache``).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch
import torch.utils._pytree as pytree

from nvtp.errors import InputError


def without_cache(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The call's arguments with the KV cache off: ``use_cache=False`` when the model's config asks
    for a KV cache (transformers' default) and the call does not say, whether the call gives it by
    keyword or by position (a pipeline binds keywords to positions, defaults included): nvtp trains,
    and a cache is an output nvtp would return and feed back (``past_key_values``), as transformers
    itself turns the cache off for gradient checkpointing. ``use_cache=True`` passed is refused."""
    args, kwargs = tuple(args), dict(kwargs)
    names = list(inspect.signature(module.forward).parameters)
    if "use_cache" not in names:
        return args, kwargs
    at = names.index("use_cache")
    given = args[at] if at < len(args) else kwargs.get("use_cache")
    if given:
        raise InputError(f"{type(module).__name__}: nvtp.jit does not return KV caches (past_key_values); "
                         "call it with use_cache=False (training does not use the cache)")
    if given is None and getattr(getattr(module, "config", None), "use_cache", False):
        if at < len(args):
            args = args[:at] + (False,) + args[at + 1:]
        else:
            kwargs["use_cache"] = False
    return args, kwargs


def call_structure(args: tuple, kwargs: dict) -> tuple:
    """What a compiled program depends on in a call: every leaf's kind, shape and dtype, and the keys."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    sig = []
    for a in leaves:
        sig.append((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else ("value", repr(a)))
    return (str(spec), *sig)


def check_call(model: str, device: str, args: tuple, kwargs: dict, compiled: tuple | None) -> None:
    """Refuse a call before any work: a tensor on another device than the parameters, or (when
    ``compiled`` holds the structure compiled for and the module is not dynamic) another structure."""
    paths = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]
    for path, a in paths:
        if isinstance(a, torch.Tensor) and a.device.type != device:
            raise InputError(f"{model}: argument {_path_name(path)} is on {a.device}, the model's parameters on {device}; "
                             f"move it with .to({device!r})")
    if compiled is not None:
        new = call_structure(args, kwargs)
        if new != compiled:
            raise InputError(f"{model} was compiled for a call {_describe_call(compiled)}, got {_describe_call(new)}; "
                             "pass the same arguments, shapes and dtypes, or nvtp.jit(..., dynamic=True) to compile each new one")


def _path_name(path) -> str:
    keys = path[1:] if path and getattr(path[0], "idx", None) in (0, 1) else path
    return "".join(f"[{k.idx}]" if hasattr(k, "idx") else f"{k.key}" for k in keys) or "?"


def _describe_call(structure: tuple) -> str:
    spec, *leaves = structure
    parts = [f"{str(d).replace('torch.', '')}{list(s)}" if d != "value" else s for s, d, *_ in
             [(leaf[0], leaf[1]) if leaf[0] != "value" else (leaf[1], "value") for leaf in leaves]]
    return f"with leaves ({', '.join(parts)})"
