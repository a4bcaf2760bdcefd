"""What a capture that fails says, in the user's terms: ``CaptureError`` and ``MissingOpError``
(operations nvtp cannot compile, each once with its count and the model's lines, and what to
do), and ``trace_failure``, which tells arguments that do not fit the model (``InputError``)
from what Thunder cannot trace (``CaptureError``)."""

from __future__ import annotations

import inspect
import os
import re
import traceback
from typing import Any, Sequence
import importlib
import linecache

import torch

from nvtp.frontend.executor import Unclaimed
from nvtp.errors import InputError, bad_input_types
from nvtp.frontend.outputs import _children

class CaptureError(RuntimeError):
    """Tracing did not give nvtp the fusions it needs; says which operations were left out."""


class MissingOpError(CaptureError):
    """The model uses operations nvtp cannot compile into its fusions (named with the model's lines).

    A part of the model (one block, a model cut short) that raises this is not traced again
    whole: the whole model holds the same operation (``nvtp.frontend.regional``, ``fx_regional``)."""


# -- when Thunder cannot trace ---------------------------------------------------------------------

_IN_PLACE = ("copy_", "update_aliases")


def missing_ops_message(model: str, unclaimed: Sequence[Unclaimed], forward: int, backward: int) -> str:
    """What ``MissingOpError`` says: each operation nvtp left out once, with how often and the
    model's lines (``file:line `code```), and what the user can do about it."""
    seen: dict[str, list[str]] = {}
    for u in unclaimed:
        seen.setdefault(u.name, [])
        if u.source and u.source not in seen[u.name]:
            seen[u.name].append(u.source)
    counts = {name: sum(u.name == name for u in unclaimed) for name in seen}

    def where(source: str) -> str:
        m = re.fullmatch(r"(.+):(\d+)", source)
        code = linecache.getline(m.group(1), int(m.group(2))).strip() if m and not source.startswith("<") else ""
        return f"{source} `{code}`" if code else source

    parts = []
    for name, sources in seen.items():
        times = f" ({counts[name]} uses)" if counts[name] > 1 else ""
        at = "; ".join(where(s) for s in sources[:2]) + (f"; and {len(sources) - 2} more lines" if len(sources) > 2 else "")
        parts.append(f"{name}{times}{' at ' + at if at else ''}")
    what = ", ".join(parts) if parts else f"none named, but the forward became {forward} fusion(s) and the backward {backward}"
    advice = ("rewrite those lines with operations nvtp compiles (elementwise math, matmul and linear, reductions, softmax, "
              "layout changes, slicing, indexing with a tensor: docs/models.md lists what nvtp takes), or compute such a value "
              "once outside forward (e.g. a constant mask registered as a buffer in __init__)")
    if any(n.startswith(_IN_PLACE) for n in seen):
        advice = ("write the in-place update out of place (`x = x + y` instead of `x += y`; `torch.where(mask, value, x)` instead of "
                  "`x[mask] = value`), or update only tensors forward itself made and reads by one name; " + advice)
    if any("an argument, parameter or buffer of the model" in n for n in seen):
        advice = ("a write into the model's own parameters or buffers would be lost: nvtp's compiled program computes outputs and "
                  "does not write the model's state back, where eager PyTorch makes the change at every call, so keep state updates "
                  "(counters, running statistics, weight decay) out of forward, in the training loop; " + advice)
    return (f"{model}.forward uses operations nvtp cannot compile, so nvtp cannot shard the model (it runs only its own fusions, "
            f"never an op outside them): {what}. What to do: {advice}; if the operation is in a library's code, report it to nvtp")


_THUNDER_CHECKS = ("baseutils.py", "utils.py")  # thunder.core's check(): Thunder's checks of operand shapes and dtypes


def _package_dir(name: str) -> str:
    return os.path.dirname(importlib.import_module(name).__file__)


def _describe_args(module: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        names = []
    names = (names + [f"argument {i}" for i in range(len(names), len(args))])[: len(args)]

    def one(a: Any) -> str:
        if isinstance(a, torch.Tensor):
            return f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}"
        return repr(a) if len(repr(a)) <= 40 else type(a).__name__

    return ", ".join([f"{n}: {one(a)}" for n, a in zip(names, args)] + [f"{k}: {one(a)}" for k, a in kwargs.items()]) or "no arguments"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0].rstrip(".") if text else type(e).__name__
    return line if len(line) <= 400 else line[:400] + " ..."


def _where(frames: list[traceback.FrameSummary], library: tuple[str, ...]) -> str:
    """The innermost line of the model's own code (not Thunder's, torch's or nvtp's tracer), as
    ``file:line (`code`)``; empty if none."""
    for f in reversed(frames):
        path = os.path.abspath(f.filename)
        if not any(path.startswith(d + os.sep) for d in library) and not f.filename.startswith("<"):
            return f"{f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"
    return ""


def _op(e: BaseException, frames: list[traceback.FrameSummary], thunder_dir: str, torch_dir: str) -> str:
    """The operation Thunder failed on, when it can be told: a function it could not register, the
    op whose meta function refused its operands, or the innermost torch function it was running."""
    m = re.search(r"<function (\w+) at 0x", str(e))
    if m:
        return m.group(1)
    inner = [f for f in frames if os.path.abspath(f.filename).startswith((thunder_dir + os.sep, torch_dir + os.sep))]
    for f in reversed(inner):
        if f.name.endswith("_meta"):
            return f.name[: -len("_meta")]
    for f in reversed(inner):
        path = os.path.abspath(f.filename)
        if path.startswith(torch_dir + os.sep):
            module = os.path.relpath(path, os.path.dirname(torch_dir))[:-3].replace(os.sep, ".")
            return f"{module}.{f.name}"
    return ""


def trace_failure(module: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], error: Exception) -> Exception | None:
    """Why Thunder could not trace ``module(*args, **kwargs)``, as one error saying whose fault it is:

    * ``InputError``: the arguments do not fit the module. Eager PyTorch fails on them too (run
      on the same, usually meta, tensors: nothing is computed), or one of Thunder's checks of an
      op's operands refused them (meta tensors do not check dtypes; Thunder does).
    * ``CaptureError``: eager PyTorch runs the module with these arguments, Thunder cannot trace
      it (an op it cannot differentiate or interpret): the module is what nvtp cannot take.

    Each names the module, the arguments, the op and the model's source line when they can be
    told. None when the failure is inside nvtp's own tracer (a bug, re-raised as it is) or is
    already one of nvtp's errors."""
    if isinstance(error, bad_input_types()):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    thunder_dir, torch_dir, frontend_dir = _package_dir("thunder"), _package_dir("torch"), os.path.dirname(__file__)
    if frames and os.path.abspath(frames[-1].filename).startswith(frontend_dir + os.sep) and len(frames) > 1:
        return None  # raised by nvtp's executor or translators themselves
    library = (thunder_dir, torch_dir, frontend_dir)
    name = type(module).__name__
    given = _describe_args(module, args, kwargs)
    try:
        with torch.no_grad():
            output = module(*args, **kwargs)
        eager = None
    except Exception as e:  # noqa: BLE001 - any failure of eager PyTorch says the arguments do not fit
        eager, output = e, None
    if eager is not None and not (isinstance(eager, NotImplementedError) or "meta" in str(eager).lower()):
        at = _where(traceback.extract_tb(eager.__traceback__), library)
        return InputError(f"{name}.forward does not accept {given}: eager PyTorch fails too{' at ' + at if at else ''}: "
                          f"{type(eager).__name__}: {_first_line(eager)}; pass arguments of the shapes and dtypes the module expects")
    op = _op(error, frames, thunder_dir, torch_dir)
    at = _where(frames, library)
    where = (f" in {op}" if op else "") + (f" at {at}" if at else "")
    text = str(error)
    if "type='meta'" in text and ("type='cpu'" in text or "type='cuda'" in text):
        # nvtp traces a meta copy of the module: a real tensor here is one the copy does not own.
        return CaptureError(f"{name}.forward reads a tensor{where} that is not the module's state (a parameter, a buffer or "
                            f"a tensor attribute of one of its modules), so nvtp's meta copy of the model still holds it on a "
                            f"real device: {_first_line(error)}; keep it on a module (register_buffer, or an attribute of the "
                            "module that uses it) rather than in a global or a closure over something the model does not hold")
    no_grad = re.search(r"Failed to find a gradient transform for bound symbol bsym=\S+ = (?:prims\.)?([\w.]+)\(", text)
    if no_grad:  # Thunder's autodiff has no rule for an op of the model: the module, not its arguments
        return MissingOpError(f"{name}.forward uses {no_grad.group(1)}, which Thunder cannot differentiate (it has no gradient rule "
                              f"for it{where and ', ' + where.strip()}), so nvtp cannot train the model. What to do: rewrite that "
                              "part with operations Thunder differentiates (e.g. x - torch.floor(x / y) * y for remainder), or "
                              "run it without gradients (torch.no_grad()); if the operation is in a library's code, report it to nvtp")
    if frames and os.path.basename(frames[-1].filename) in _THUNDER_CHECKS and isinstance(error, (RuntimeError, ValueError, TypeError)):
        return InputError(f"{name}.forward does not accept {given}: Thunder's check{where} refused them: {_first_line(error)}; "
                          "pass arguments of the shapes and dtypes the module expects")
    hint = "rewrite that part of the model with operations Thunder supports"
    named_tuple = next((type(x).__name__ for x in _containers(output) if isinstance(x, tuple) and hasattr(type(x), "_fields")), None)
    if named_tuple is not None and "__new__()" in str(error):
        at = _forward_location(module)
        hint = (f"the forward{' (' + at + ')' if at else ''} returns a NamedTuple ({named_tuple}), which Thunder cannot rebuild: "
                "return a tuple, a dict or a dataclass instead")
    return CaptureError(f"Thunder cannot trace {name}.forward{where}: {type(error).__name__}: {_first_line(error)}. Eager PyTorch "
                        f"runs the module with these arguments ({given}), so it is the module nvtp cannot take, not the arguments: "
                        f"{hint}")


def _containers(x: Any) -> list[Any]:
    """``x`` and every tuple, list, dict or dataclass inside it."""
    children = _children(x)
    return [x] + [c for _, child in (children or []) for c in _containers(child)] if children is not None else []


def _forward_location(module: torch.nn.Module) -> str:
    """``file:line`` of the module's ``forward``, or "" when Python cannot tell."""
    try:
        forward = type(module).forward
        path = inspect.getsourcefile(forward)
        return f"{path}:{inspect.getsourcelines(forward)[1]}" if path else ""
    except (TypeError, OSError):
        return ""
