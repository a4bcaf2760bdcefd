"""The model's own code means what it says: what a traced program cannot repeat is refused, in the user's terms.

    user_code.check_module(model)      # at nvtp.jit / nvtp.plan: Python randomness in forward, hooks
    user_code.check_hooks(model)       # at every call: a hook registered since
    user_code.state_update_message(model, unclaimed)  # the trace left an in-place update of the model's state

nvtp traces a model's forward once and runs the traced program at every call. Three kinds of
Python would then silently stop meaning what they say, so each is refused, naming the module,
the file and line, and what to write instead (never nvtp's own internals):

* Python's random numbers (``random.random()``, ``np.random.rand()``) in forward, or in the
  methods and functions of the model's own files it calls: drawn once at trace time, the same for
  every later call. Found by reading the code (``ast``), before anything is traced.
* hooks on the model or its parts (``register_forward_hook``, ``..._pre_hook``, backward hooks):
  a part's computation is fused, so a hook on it cannot run at each call; one registered after
  ``nvtp.jit`` would never fire. Hooks from torch itself (``weight_norm``) are traced as part of
  the model (by the FX route: ``reparametrized``; Thunder's refuses them, ``thunder_refusal``).
  A hook on the object ``nvtp.jit`` returns runs at every call, as on any module.
* in-place updates of the model's state (``self.count += 1`` on a buffer, ``p.mul_()`` on a
  parameter, BatchNorm's running statistics in training mode): the program computes outputs and
  does not write state back. Found in the trace (the operations nvtp could not fuse), and said as
  the module and line that does it.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import linecache
import os
import random
import textwrap
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.nn.modules import module as nn_module
from torch.nn.utils.weight_norm import WeightNorm

from nvtp.errors import InputError

HOOK_DICTS = {"_forward_hooks": "a forward hook", "_forward_pre_hooks": "a forward pre-hook",
              "_backward_hooks": "a backward hook", "_backward_pre_hooks": "a backward pre-hook"}
GLOBAL_HOOKS = {"_global_forward_hooks": "a global forward hook (register_module_forward_hook)",
                "_global_forward_pre_hooks": "a global forward pre-hook (register_module_forward_pre_hook)",
                "_global_backward_hooks": "a global backward hook (register_module_full_backward_hook)",
                "_global_backward_pre_hooks": "a global backward pre-hook (register_module_full_backward_pre_hook)"}
# Operations that write a module's state in place (Thunder's names for them in a trace)
IN_PLACE = ("copy_", "update_aliases", "copy_with_setitem", "setitem_")
_TORCH_DIR = os.path.dirname(torch.__file__)


class UserCodeError(InputError):
    """Python in a model's forward that a traced program cannot repeat (bad input: refused before
    any work); says the module, the line and what to write instead."""


# ---------------------------------------------------------------------------------------------
# Python randomness in forward, read from the code


def check_module(module: torch.nn.Module) -> None:
    """Refuse Python randomness in the forward code of ``module`` and its parts, and hooks on
    them (see the module docstring). Reads code and module attributes only; touches nothing."""
    seen: set[Any] = set()
    for name, m in module.named_modules():
        forward = getattr(type(m), "forward", None)
        if forward is None or forward in seen or _is_torch(forward):
            continue
        seen.add(forward)
        for fn, line, what in _random_calls(forward):
            where = _location(fn, line)
            part = f" ({type(module).__name__}.{name})" if name else ""
            raise UserCodeError(
                f"{type(m).__name__}.forward{part} calls {what} at {where}: Python's random numbers are drawn when nvtp traces "
                "the model, once, and the traced program reuses that draw at every call (eager PyTorch draws anew each time). "
                "Draw them with torch inside forward (torch.rand, torch.bernoulli: e.g. keep = torch.rand(()) < p, then "
                "torch.where(keep, a, b) instead of an if), or draw in the training loop and pass the result in as a tensor "
                "argument")
    check_hooks(module, registered_after=False)


def _is_torch(fn: Callable) -> bool:
    return (getattr(fn, "__module__", "") or "").startswith("torch.")


def _random_calls(fn: Callable, depth: int = 3, seen: set | None = None) -> Iterator[tuple[Callable, int, str]]:
    """(function, line, what) of each Python random call in ``fn``, and in the methods
    (``self.m(...)``) and same-file functions it calls, ``depth`` deep."""
    seen = set() if seen is None else seen
    fn = inspect.unwrap(fn)
    if fn in seen or not inspect.isfunction(fn):
        return
    seen.add(fn)
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return
    first = fn.__code__.co_firstlineno
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = _resolve(node.func, fn.__globals__)
        what = _python_random(target)
        if what is not None:
            yield fn, node.lineno + first - 1, what
        elif depth > 1:
            inner = _callee(node.func, fn, target)
            if inner is not None:
                yield from _random_calls(inner, depth - 1, seen)


def _resolve(expr: ast.expr, scope: dict[str, Any]) -> Any:
    """The object a dotted name (``random.random``, ``np.random.rand``) names in ``scope``; None otherwise."""
    if isinstance(expr, ast.Name):
        return scope.get(expr.id, getattr(builtins, expr.id, None))
    if isinstance(expr, ast.Attribute):
        base = _resolve(expr.value, scope)
        if base is not None and inspect.ismodule(base):
            return getattr(base, expr.attr, None)
    return None


def _python_random(obj: Any) -> str | None:
    """``random.random()`` or ``numpy.random.rand()`` when ``obj`` draws Python's or NumPy's
    random numbers (not torch's), else None."""
    if obj is None:
        return None
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if isinstance(owner, random.Random):
        return f"random.{name}()"
    modules = (getattr(obj, "__module__", None) or "", type(owner).__module__ if owner is not None else "")
    if any(m.startswith("numpy.random") for m in modules):
        return f"numpy.random.{name}()"
    return None


def _callee(expr: ast.expr, fn: Callable, target: Any) -> Callable | None:
    """What a call in ``fn`` runs that is the model's own code: a plain function of the same
    file, or a method of the class ``fn`` belongs to (``self.helper(...)``)."""
    if inspect.isfunction(target) and target.__code__.co_filename == fn.__code__.co_filename:
        return target
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
        owner = _owner_class(fn)
        method = getattr(owner, expr.attr, None) if owner is not None else None
        if inspect.isfunction(method) and not _is_torch(method):
            return method
    return None


def _owner_class(fn: Callable) -> type | None:
    qual = fn.__qualname__.split(".")
    if len(qual) < 2 or "<locals>" in qual:
        return None
    obj: Any = inspect.getmodule(fn)
    for part in qual[:-1]:
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def _location(fn: Callable, line: int) -> str:
    text = linecache.getline(fn.__code__.co_filename, line).strip()
    return f"{_short(fn.__code__.co_filename)}:{line}" + (f" (`{text}`)" if text else "")


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


# ---------------------------------------------------------------------------------------------
# hooks


def hooks(module: torch.nn.Module) -> list[tuple[str, str, Any]]:
    """(the part's name, which kind, the hook) of every hook on ``module``'s parts, and the
    global module hooks; hooks from torch itself (``weight_norm``'s) left out, and transformers'
    output-capturing hooks (installed by its first eager call that asks for router logits or
    hidden states): the trace records what they record (``nvtp.frontend.moe.install_output_hooks``)."""
    found = []
    for name, m in module.named_modules():
        for attr, kind in HOOK_DICTS.items():
            for fn in (getattr(m, attr, None) or {}).values():
                if not _from_torch(fn) and not _captures_outputs(fn):
                    found.append((name, kind, fn))
    for attr, kind in GLOBAL_HOOKS.items():
        for fn in (getattr(nn_module, attr, None) or {}).values():
            if not _from_torch(fn):
                found.append(("", kind, fn))
    return found


def _captures_outputs(fn: Any) -> bool:
    return getattr(fn, "__name__", "") == "output_capturing_hook" and (getattr(fn, "__module__", "") or "").startswith("transformers.")


def _from_torch(fn: Any) -> bool:
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return (module or "").startswith("torch.")


def check_hooks(module: torch.nn.Module, registered_after: bool = True) -> None:
    """Refuse hooks on ``module``'s parts (``registered_after``: at a call of the compiled model,
    so the hook was registered after ``nvtp.jit``). A walk over the parts' hook dicts."""
    found = hooks(module)
    if not found:
        return
    name, kind, fn = found[0]
    part = f"{type(module).__name__}" + (f".{name}" if name else "")
    hook = getattr(fn, "__name__", None) or type(fn).__name__
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    where = f" ({_short(code.co_filename)}:{code.co_firstlineno})" if code is not None else ""
    on = "the module nvtp.jit returned (sharded.register_forward_hook(...))"
    when = "was registered after nvtp.jit, and would never fire" if registered_after else "cannot run at each call"
    target = "every module" if kind.startswith("a global") else part
    raise UserCodeError(
        f"{kind} {hook}{where} on {target} {when}: nvtp compiles the "
        "model's forward and backward into one program, so its parts' own calls (and their hooks) do not happen when it runs. "
        f"Remove the hook (handle.remove()); to see the model's outputs register it on {on}, whose hooks run at every call; "
        "to see a part's activations, return them from forward")


def reparametrized(module: torch.nn.Module) -> list[tuple[str, str]]:
    """(where, how) of each weight of ``module``'s parts that is computed from others at each call:
    a parametrization (``torch.nn.utils.parametrize``: ``parametrizations.weight_norm``, ...) or
    the hook of ``torch.nn.utils.weight_norm``. Thunder's interpreter cannot read the first (the
    parametrized property fails inside it) and takes the second's write of the weight for an
    output; TorchDynamo traces both (``nvtp.driver.route`` takes the FX route for them)."""
    found = []
    for name, m in module.named_modules():
        prefix = f"{name}." if name else ""
        for attr, plist in (getattr(m, "parametrizations", None) or {}).items():
            kinds = [type(p).__name__ for p in plist]
            how = ("weight normalisation (torch.nn.utils.parametrizations.weight_norm)" if kinds == ["_WeightNorm"]
                   else f"a parametrization ({', '.join(kinds)}: torch.nn.utils.parametrize)")
            found.append((f"{prefix}{attr}", how))
        for fn in (getattr(m, "_forward_pre_hooks", None) or {}).values():
            if isinstance(fn, WeightNorm):
                found.append((f"{prefix}{fn.name}", "weight normalisation (torch.nn.utils.weight_norm)"))
    return found


def thunder_refusal(module: torch.nn.Module, fix: str) -> UserCodeError | None:
    """The error for a module Thunder's interpreter cannot read because of a reparametrized weight
    (``reparametrized``), ``fix`` saying the route that can; None when there is none."""
    found = reparametrized(module)
    if not found:
        return None
    where, how = found[0]
    *path, attr = where.split(".")
    target = "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path)  # model.blocks[0].fc
    undo = (f"torch.nn.utils.remove_weight_norm({target}, {attr!r})" if "utils.weight_norm" in how
            else f"torch.nn.utils.parametrize.remove_parametrizations({target}, {attr!r})")
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return UserCodeError(f"{type(module).__name__}.{where} is computed at each call by {how}{more}, which Thunder's interpreter "
                         f"cannot trace: {fix}. Or fold it into a plain weight, which then trains as one: {undo}")


# ---------------------------------------------------------------------------------------------
# what the trace left


def state_update_message(module: torch.nn.Module, unclaimed: Sequence[Any]) -> str | None:
    """The refusal for a BatchNorm in training mode, whose running statistics are written in place
    inside torch (``unclaimed``: the operations nvtp could not compile, ``name``, ``source``
    "file:line"), said in the user's terms with the three fixes; None otherwise (the capture's
    own message names each write and its line: ``capture.missing_ops_message``)."""
    writes = [u for u in unclaimed if u.name.split(" ")[0] in IN_PLACE]  # "copy_ (writes into ...)"
    in_torch = [u for u in writes if getattr(u, "source", "").rpartition(":")[0].startswith(_TORCH_DIR) or not u.source]
    norms = [(n, m) for n, m in module.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats]
    if not (norms and in_torch):
        return None
    name, m = norms[0]
    return (f"{type(module).__name__}.{name} ({type(m).__name__}) is in training mode, where it updates its running statistics "
            "(running_mean, running_var) in place at every call; nvtp's compiled program computes outputs and does not write "
            f"the model's buffers back, so they would stay as they are. Call model.{name}.eval() (fixed statistics), build it "
            f"with track_running_stats=False (batch statistics, nothing to update), or use nn.LayerNorm or nn.GroupNorm")


def _where(module: torch.nn.Module, source: str) -> str:
    """``Counter.forward at model.py:12 (`self.n += 1`)`` for a "file:line" in the model's code."""
    path, _, line = source.rpartition(":")
    if not line.isdigit():
        return f"{type(module).__name__}.forward"
    if path.startswith("<"):  # generated code (dynamo's graph): the FX route names the model's line in its place
        return f"the model's forward at {source}"
    text = linecache.getline(path, int(line)).strip()
    at = f"{_short(path)}:{line}" + (f" (`{text}`)" if text else "")
    for m in module.modules():
        fn = getattr(type(m), "forward", None)
        code = getattr(fn, "__code__", None)
        if code is None or os.path.abspath(code.co_filename) != os.path.abspath(path):
            continue
        try:
            lines, start = inspect.getsourcelines(fn)
        except (OSError, TypeError):
            continue
        if start <= int(line) < start + len(lines):
            return f"{type(m).__name__}.forward at {at}"
    return f"{type(module).__name__}'s forward at {at}"


__all__ = ["UserCodeError", "check_module", "check_hooks", "hooks", "state_update_message", "reparametrized", "thunder_refusal"]
