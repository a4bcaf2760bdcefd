"""Trace a module with Thunder and nvtp's executor, and label the fusions it gives.

``capture(module, *args)`` runs ``thunder.jit`` once (on meta tensors too, so a GPT-3 layer is
traced without being computed) and returns the forward and backward ``Fusion``s with what
nvtp knows of each input and output: which inputs are parameters (by their module name), which
backward inputs are forward values saved for backward (and which forward value), which are
incoming gradients, and which parameter each backward output is the gradient of.
"""

from __future__ import annotations

import inspect
import os
import re
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from nvtp.frontend.executor import FusionCallable, Runtime, Unclaimed, executor, use_runtime
from nvtp.gcpause import paused
from nvtp.ir.graph import Fusion, ValueInfo


class CaptureError(RuntimeError):
    """Tracing did not give nvtp the fusions it needs; says which operations were left out."""


@dataclass
class Captured:
    forward: Fusion
    backward: Fusion | None
    jitted: Any
    runtime: Runtime
    forward_callable: FusionCallable
    backward_callable: FusionCallable | None
    trace_seconds: float
    unclaimed: list[Unclaimed]
    regional: str = ""  # how nvtp.frontend.regional built the fusions ("spliced: ..." or "whole trace: <why>"); "" when not asked
    layers: dict[str, int] = field(default_factory=dict)  # spliced: each forward value a block's copy computes -> its block


def fusion_callables(trace) -> list[FusionCallable]:
    """The nvtp fusion callables a Thunder execution trace calls, in order."""
    found = []
    for bsym in trace.bound_symbols:
        if bsym.sym.is_fusion and bsym._call_ctx:
            for fn in bsym._call_ctx.values():
                if isinstance(fn, FusionCallable):
                    found.append(fn)
    return found


def parameter_names(jitted) -> dict[str, str]:
    """Thunder proxy name -> module parameter (or buffer) name, from the prologue trace."""
    import thunder
    from thunder.core.prims import PrimIDs

    names: dict[str, str] = {}
    for trace in thunder.last_prologue_traces(jitted)[-1:]:
        for bsym in trace.bound_symbols:
            if bsym.sym.id in (PrimIDs.UNPACK_PARAMETER, PrimIDs.UNPACK_BUFFER) and len(bsym.args) > 1:
                names[bsym.output.name] = str(bsym.args[1])
    return names


def label_fusions(fwd: FusionCallable, bwd: FusionCallable | None, fwd_trace, params: dict[str, str]) -> tuple[Fusion, Fusion | None]:
    """Attach roles and names to the inputs and outputs of a forward/backward pair."""
    ret = fwd_trace.bound_symbols[-1]
    result = ret.args[0]
    flat_args = [a.name for a in result.get("flat_args", []) if hasattr(a, "name")] if isinstance(result, dict) else []
    from thunder.core.pytree import tree_flatten

    # A trace with a backward returns {"output": ..., "flat_args": ...}; without one (nothing
    # needs a gradient), the output itself.
    output = result.get("output") if isinstance(result, dict) else result
    user_outputs = {p.name for p in tree_flatten(output)[0] if hasattr(p, "name")}
    tensor_outputs = [p.name for p in tree_flatten(output)[0] if hasattr(p, "name") and hasattr(p, "shape")]

    f = fwd.fusion
    info: dict[str, ValueInfo] = {}
    proxy_to_fwd_value: dict[str, str] = {}
    for v, proxy in zip(f.inputs, fwd.input_proxies):
        role = "parameter" if proxy in params else "activation"
        info[v.name] = ValueInfo(role, params.get(proxy, proxy))
        proxy_to_fwd_value[proxy] = v.name
    for v, proxy in zip(f.outputs, fwd.output_proxies):
        if v.name not in info:
            info[v.name] = ValueInfo("output" if proxy in user_outputs else "saved", "y" if proxy in user_outputs else "")
        proxy_to_fwd_value.setdefault(proxy, v.name)
    forward = replace(f, info=info, attrs={**f.attrs, "role": "forward"})

    backward = None
    if bwd is not None:
        b = bwd.fusion
        binfo: dict[str, ValueInfo] = {}
        # Cotangent i is the gradient of the forward's i-th tensor output: its source says which
        # forward value that is, so a model with several outputs (loss, logits) gets each its own.
        cotangents = bwd.extra.get("cotangents", [])
        cotangent_of = dict(zip(cotangents, (proxy_to_fwd_value.get(p, "") for p in tensor_outputs))) \
            if len(cotangents) == len(tensor_outputs) else {}
        for v, proxy in zip(b.inputs, bwd.input_proxies):
            if proxy in params:
                binfo[v.name] = ValueInfo("parameter", params[proxy])
            elif proxy in proxy_to_fwd_value:
                binfo[v.name] = ValueInfo("saved", "", proxy_to_fwd_value[proxy])
            else:
                binfo[v.name] = ValueInfo("grad", "grad(y)", cotangent_of.get(proxy, ""))
        bret = _flat(bwd_trace_return(bwd))  # one entry per forward flat arg; None where no gradient
        grads_of = {}
        for proxy_name, arg in zip(bret, flat_args):
            if proxy_name is not None:
                grads_of[proxy_name] = params.get(arg, arg)
        for v, proxy in zip(b.outputs, bwd.output_proxies):
            of = grads_of.get(proxy, "")
            binfo.setdefault(v.name, ValueInfo("grad", f"grad({of})" if of else "", grad_of=of))
        backward = replace(b, info=binfo, attrs={**b.attrs, "role": "backward"})
    return forward, backward


def _cotangents(trace) -> list[str]:
    """The backward trace's incoming gradients, in the order of the forward's tensor outputs."""
    from thunder.core.prims import PrimIDs

    for bsym in trace.bound_symbols:
        if bsym.sym.id == PrimIDs.UNPACK_SEQUENCE and getattr(bsym.args[0], "name", None) == "cotangents":
            return [getattr(o, "name", None) for o in bsym.output]
    return []


def bwd_trace_return(bwd: FusionCallable) -> list:
    return bwd.extra.get("trace_return", [])


def _flat(x) -> list:
    from thunder.core.pytree import tree_flatten

    return [p.name if hasattr(p, "name") else None for p in tree_flatten(x)[0]]


def capture(module: torch.nn.Module, *args: Any, backward: bool = True, strict: bool = True, **kwargs: Any) -> Captured:
    """Trace ``module(*args)`` with Thunder and nvtp's executor; return its labelled fusions.

    With meta-device ``args`` and module, nothing is computed. ``strict`` raises when an op
    was left outside nvtp's fusions, naming it and its source line.
    """
    import thunder

    runtime = Runtime()
    start = time.perf_counter()
    saved_grads = {p: p.grad for p in module.parameters()}
    try:
        with use_runtime(runtime), paused():  # nvtp/gcpause.py: the collector walking Thunder's objects
            jitted = thunder.jit(module, executors=[executor()])
            out = jitted(*args, **kwargs)
            if backward:
                outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    except Exception as e:  # Thunder's own exceptions: say whose fault it is (the arguments, or the module)
        explained = trace_failure(module, args, kwargs, e)
        if explained is None:
            raise
        raise explained from e
    for p, grad in saved_grads.items():  # tracing must not leave gradients behind
        p.grad = grad
    seconds = time.perf_counter() - start
    fwd_trace = thunder.last_traces(jitted)[-1]
    fwd = fusion_callables(fwd_trace)
    bwd_traces = thunder.last_backward_traces(jitted) if backward else []
    bwd = fusion_callables(bwd_traces[-1]) if bwd_traces else []
    if strict and (runtime.unclaimed or len(fwd) != 1 or len(bwd) > 1):
        names = ", ".join(str(u) for u in runtime.unclaimed) or "none"
        raise CaptureError(
            f"nvtp fused the forward into {len(fwd)} fusion(s) and the backward into {len(bwd)}; it needs one each. "
            f"Operations left to other executors: {names}. Add translators for them in nvtp/frontend/translate.py."
        )
    if not fwd:
        raise CaptureError("Thunder's trace of the module contains no operation nvtp can fuse")
    if bwd:
        bwd[0].extra["trace_return"] = bwd_traces[-1].bound_symbols[-1].args[0]
        bwd[0].extra["cotangents"] = _cotangents(bwd_traces[-1])
    forward, backward_fusion = label_fusions(fwd[0], bwd[0] if bwd else None, fwd_trace, parameter_names(jitted))
    return Captured(forward, backward_fusion, jitted, runtime, fwd[0], bwd[0] if bwd else None, seconds, list(runtime.unclaimed))


# -- when Thunder cannot trace ---------------------------------------------------------------------

_THUNDER_CHECKS = ("baseutils.py", "utils.py")  # thunder.core's check(): Thunder's checks of operand shapes and dtypes


def _package_dir(name: str) -> str:
    import importlib

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
    from nvtp.errors import InputError, bad_input_types

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
            module(*args, **kwargs)
        eager = None
    except Exception as e:  # noqa: BLE001 - any failure of eager PyTorch says the arguments do not fit
        eager = e
    if eager is not None and not (isinstance(eager, NotImplementedError) or "meta" in str(eager).lower()):
        at = _where(traceback.extract_tb(eager.__traceback__), library)
        return InputError(f"{name}.forward does not accept {given}: eager PyTorch fails too{' at ' + at if at else ''}: "
                          f"{type(eager).__name__}: {_first_line(eager)}; pass arguments of the shapes and dtypes the module expects")
    op = _op(error, frames, thunder_dir, torch_dir)
    at = _where(frames, library)
    where = (f" in {op}" if op else "") + (f" at {at}" if at else "")
    if frames and os.path.basename(frames[-1].filename) in _THUNDER_CHECKS and isinstance(error, (RuntimeError, ValueError, TypeError)):
        return InputError(f"{name}.forward does not accept {given}: Thunder's check{where} refused them: {_first_line(error)}; "
                          "pass arguments of the shapes and dtypes the module expects")
    hint = "rewrite that part of the model with operations Thunder supports"
    mha = [n or "(the module itself)" for n, m in module.named_modules() if isinstance(m, torch.nn.MultiheadAttention)]
    if mha and ("multi_head_attention" in str(error) or any(f.filename.endswith(os.path.join("modules", "activation.py")) for f in frames)):
        hint = (f"nn.MultiheadAttention ({', '.join(mha)}) is such a part: write the attention with your own q, k, v and output "
                "nn.Linear projections and F.scaled_dot_product_attention (as nvtp.models.gpt does), which nvtp traces and shards")
    return CaptureError(f"Thunder cannot trace {name}.forward{where}: {type(error).__name__}: {_first_line(error)}. Eager PyTorch "
                        f"runs the module with these arguments ({given}), so it is the module nvtp cannot take, not the arguments: "
                        f"{hint}")


def forward_inputs(fusion: Fusion, named: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The forward fusion's inputs, looked up by label (parameter names, ``x``)."""
    out = []
    for v in fusion.inputs:
        label = fusion.label(v.name)
        if label not in named:
            raise KeyError(f"no tensor given for input {v.name} ({label})")
        out.append(named[label])
    return out


def backward_inputs(fusion: Fusion, named: dict[str, torch.Tensor], forward_values: dict[str, torch.Tensor],
                    grad: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The backward fusion's inputs: parameters by name, saved values from the forward run
    (forward value name -> tensor), and the incoming gradient(s) in order."""
    grads = [grad] if isinstance(grad, torch.Tensor) else list(grad)
    out = []
    for v in fusion.inputs:
        info = fusion.info.get(v.name)
        if info is None:
            raise KeyError(f"backward input {v.name} has no role")
        if info.role == "parameter":
            out.append(named[info.label])
        elif info.role == "saved":
            out.append(forward_values[info.source])
        elif info.role == "grad":
            out.append(grads.pop(0))
        else:
            raise KeyError(f"backward input {v.name} has role {info.role}")
    return out


def run_pair(captured_forward: Fusion, captured_backward: Fusion, named: dict[str, torch.Tensor], grad: torch.Tensor,
             run) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run forward then backward with ``run(fusion, inputs) -> outputs``; returns
    (forward values by name, gradients by label such as ``grad(attn.c_attn.weight)``)."""
    f_in = forward_inputs(captured_forward, named)
    f_out = run(captured_forward, f_in)
    values = {v.name: t for v, t in zip(captured_forward.inputs, f_in)}
    values.update({v.name: t for v, t in zip(captured_forward.outputs, f_out)})
    b_in = backward_inputs(captured_backward, named, values, grad)
    b_out = run(captured_backward, b_in)
    grads = {captured_backward.label(v.name): t for v, t in zip(captured_backward.outputs, b_out)}
    return values, grads


def output_value(fusion: Fusion) -> str:
    """Name of the forward fusion's user-visible output."""
    outs = [v.name for v in fusion.outputs if fusion.role(v.name) == "output"]
    if len(outs) != 1:
        raise KeyError(f"{fusion.name} has {len(outs)} user outputs")
    return outs[0]
