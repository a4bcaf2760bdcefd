"""``model.generate`` of a transformers model sharded by ``nvtp.jit``.

transformers' ``GenerationMixin.generate`` looks its decoding loop up on the model's class
(``getattr(type(self), "_sample")``) and calls the model as ``self(**inputs)``. Bound to the
``ShardedModule`` wrapper, the first fails (the wrapper's class has no ``_sample``). Here it runs
on a *view* of the wrapped model: an object of a subclass of the model's own class made for this
sharded module, holding the model's attributes (the same ``__dict__``: config, generation config,
submodules), whose ``forward`` is the sharded module's. So everything ``generate`` reads is the
model's, and every forward it runs is nvtp's sharded program.

nvtp returns no KV cache (``nvtp.frontend.fx_calls.without_cache``), so ``generate`` runs with
``use_cache=False`` unless told otherwise (``use_cache=True`` is refused, saying so): each step
calls the model on the whole sequence, one token longer, and each new length gets a program
derived from the traced ones (``nvtp.frontend.lengths``) rather than a new trace.
"""

from __future__ import annotations

from typing import Any

from nvtp.errors import InputError


def is_transformers_generator(model: Any) -> bool:
    """Whether ``model`` generates with transformers' ``GenerationMixin``."""
    try:
        from transformers import GenerationMixin  # optional: transformers (pip install nvtp[hf])
    except ImportError:
        return False
    return isinstance(model, GenerationMixin)


def generate(sharded: Any, *args: Any, **kwargs: Any) -> Any:
    """``type(model).generate`` on a view of ``sharded.module`` whose forward is ``sharded``'s."""
    model = sharded.module
    if kwargs.get("use_cache"):
        raise InputError(f"{type(model).__name__}.generate on an nvtp.jit model: nvtp returns no KV cache, so each step runs the "
                         "whole sequence; leave use_cache out (or pass use_cache=False)")
    kwargs["use_cache"] = False
    return type(model).generate(view(sharded), *args, **kwargs)


def view(sharded: Any) -> Any:
    """An object of a subclass of the wrapped model's class, sharing its attributes, whose forward
    runs ``sharded`` (see the module docstring)."""
    model = sharded.module
    cls = type(model)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return sharded(*args, **kwargs)

    sub = type(f"Sharded{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__})
    obj = object.__new__(sub)
    obj.__dict__ = model.__dict__  # the same dict: what generate reads or sets is the model's
    return obj
