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

from nvtp.frontend import parts, user_code
from nvtp.frontend.complex import ComplexAsReal
from nvtp.frontend.executor import FusionCallable, Runtime, Unclaimed, executor, use_runtime
from nvtp.frontend.outputs import Leaf, structure as output_structure, tensors as output_tensors
from nvtp.gcpause import paused
from nvtp.ir.graph import Fusion, ValueInfo
from nvtp.ir.verify import verify


class CaptureError(RuntimeError):
    """Tracing did not give nvtp the fusions it needs; says which operations were left out."""


class MissingOpError(CaptureError):
    """The model uses operations nvtp cannot compile into its fusions (named with the model's lines).

    A part of the model (one block, a model cut short) that raises this is not traced again
    whole: the whole model holds the same operation (``nvtp.frontend.regional``, ``fx_regional``)."""


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
    # Labels of the forward inputs (parameters, arguments) Thunder's backward gives a gradient: each
    # has one output of ``backward`` (``check_gradients``).
    differentiable: tuple[str, ...] = ()
    # The model's output object with each tensor a ``Leaf`` naming its forward output (nvtp.frontend.outputs).
    output_tree: Any = None
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
    """Thunder proxy name -> the module's name for it (a parameter, a buffer or a plain tensor
    attribute), from the last prologue trace (``module_state``)."""
    import thunder

    return {proxy: path for trace in thunder.last_prologue_traces(jitted)[-1:] for proxy, (_, path) in module_state(trace).items()}


def module_state(prologue_trace) -> dict[str, tuple[str, str]]:
    """Thunder proxy name -> (kind, path) of each tensor a prologue takes from the module: kind
    "parameter", "buffer" or "attribute", path the module's name for it (``h.0.attn.c_attn.weight``).

    A plain tensor attribute the forward reads (``self.freqs_cis``, kept as an attribute or
    reassigned in ``forward`` as ``self.freqs = self.freqs.to(h.device)``) is module state like a
    buffer: it is named by its path too (``layers.0.freqs``), and the caller passes the module's
    tensor at each call (``nvtp.jit``: ``RankProgram.module_state``; ``ShardingTransform``: Thunder's prologue)."""
    from thunder.core.prims import PrimIDs
    from thunder.core.proxies import TensorProxy

    found: dict[str, tuple[str, str]] = {}
    modules: dict[str, str] = {}  # proxy of a (sub)module -> its path ("" for the module traced)
    for bsym in prologue_trace.bound_symbols:
        if bsym.sym.id in (PrimIDs.UNPACK_PARAMETER, PrimIDs.UNPACK_BUFFER) and len(bsym.args) > 1:
            found[bsym.output.name] = ("parameter" if bsym.sym.id == PrimIDs.UNPACK_PARAMETER else "buffer", str(bsym.args[1]))
        elif bsym.sym.id == PrimIDs.UNPACK_THUNDER_MODULE:
            modules[bsym.output.name] = ""
        elif bsym.sym.id in (PrimIDs.UNPACK_SUBMODULE, PrimIDs.UNPACK_ATTR) and len(bsym.args) > 1:
            base = modules.get(getattr(bsym.args[0], "name", None))
            if base is None:
                continue
            path = f"{base}.{bsym.args[1]}" if base else str(bsym.args[1])
            if bsym.sym.id == PrimIDs.UNPACK_SUBMODULE:
                modules[bsym.output.name] = path
            elif isinstance(bsym.output, TensorProxy):
                found.setdefault(bsym.output.name, ("attribute", path))
    return found


def label_fusions(fwd: FusionCallable, bwd: FusionCallable | None, fwd_trace, params: dict[str, str]) -> tuple[Fusion, Fusion | None]:
    """Attach roles and names to the inputs and outputs of a forward/backward pair.

    Every forward input Thunder gives a gradient gets a backward output of its own, labelled
    ``grad_of`` it, even where gradients coincide as values (``_own_gradient_outputs``)."""
    ret = fwd_trace.bound_symbols[-1]
    result = ret.args[0]
    # One entry per flat argument, aligned with the backward's return (None for a non-tensor).
    flat_args = [getattr(a, "name", None) for a in result.get("flat_args", [])] if isinstance(result, dict) else []
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
        returned = tree_flatten(bwd_trace_return(bwd))[0]  # one entry per forward flat arg; None where no gradient
        if len(returned) != len(flat_args):
            raise CaptureError(f"Thunder's backward returns {len(returned)} gradients for {len(flat_args)} forward arguments; "
                               "nvtp cannot tell which gradient is whose")
        wanted = [(p, params.get(arg, arg)) for p, arg in zip(returned, flat_args) if arg is not None and hasattr(p, "name")]
        b, input_proxies, grad_of = _own_gradient_outputs(bwd.fusion, list(bwd.input_proxies), list(bwd.output_proxies), wanted)
        binfo: dict[str, ValueInfo] = {}
        # Cotangent i is the gradient of the forward's i-th tensor output: its source says which
        # forward value that is, so a model with several outputs (loss, logits) gets each its own.
        cotangents = bwd.extra.get("cotangents", [])
        cotangent_of = dict(zip(cotangents, (proxy_to_fwd_value.get(p, "") for p in tensor_outputs))) \
            if len(cotangents) == len(tensor_outputs) else {}
        for v, proxy in zip(b.inputs, input_proxies):
            if proxy in params:
                binfo[v.name] = ValueInfo("parameter", params[proxy])
            elif proxy in proxy_to_fwd_value:
                binfo[v.name] = ValueInfo("saved", "", proxy_to_fwd_value[proxy])
            else:
                binfo[v.name] = ValueInfo("grad", "grad(y)", cotangent_of.get(proxy, ""))
        for v in b.outputs:
            of = grad_of.get(v.name, "")
            binfo.setdefault(v.name, ValueInfo("grad", f"grad({of})" if of else "", grad_of=of))
        backward = replace(b, info=binfo, attrs={**b.attrs, "role": "backward"})
    return forward, backward


def _own_gradient_outputs(b: Fusion, input_proxies: list[str], output_proxies: list[str],
                          wanted: list[tuple[Any, str]]) -> tuple[Fusion, list[str], dict[str, str]]:
    """The backward fusion with one output per gradient in ``wanted`` ((Thunder proxy, label of
    the forward input it is the gradient of), in the order of the forward's arguments).

    Thunder returns a gradient as a proxy, and one proxy may be the gradient of several inputs
    (the biases of two projections added into one residual), or an input of the backward passed
    straight through (a bias as large as the output gets the incoming gradient itself); nvtp's
    simplification may also merge two equal outputs into one value. Labels live on values, so
    each such gradient gets its own value: a ``set`` (a copy) of the shared one, a new input where
    the fusion did not read the proxy. Returns the fusion, its input proxies (with any new one)
    and value name -> label for the gradient outputs."""
    from nvtp.ir.build import make_op
    from nvtp.ir.graph import defines_input, fresh_names
    from nvtp.frontend.translate import to_dtype

    ops, outputs = list(b.ops), list(b.outputs)
    names = fresh_names(b)

    def copy(v) -> Any:
        op = make_op("set", (v,), {}, [next(names)])
        ops.append(op)
        return op.outputs[0]

    inputs = dict(zip(input_proxies, b.inputs))

    def input_value(proxy) -> Any:
        """The backward's input for ``proxy``: one it has, or a new one (an incoming gradient or a
        saved value the fusion itself did not read)."""
        if proxy.name not in inputs:
            shape = tuple(int(n) for n in proxy.shape)
            op = make_op("define_tensor", (), dict(shape=shape, contiguity=tuple(None if n == 1 else True for n in shape),
                                                dtype=to_dtype(proxy.dtype), is_cpu=False,
                                                stride_order=tuple(range(len(shape) - 1, -1, -1))), [next(names)])
            last = max((i for i, o in enumerate(ops) if defines_input(o)), default=-1)
            ops.insert(last + 1, op)  # after the fusion's other inputs, in the order of input_proxies
            inputs[proxy.name] = op.outputs[0]
            input_proxies.append(proxy.name)
        return inputs[proxy.name]

    seen: set[str] = set()
    for i, v in enumerate(outputs):  # one value output twice (two proxies merged by common_subexpressions): a copy
        if v.name in seen:
            outputs[i] = copy(v)
        seen.add(outputs[i].name)
    first = {}
    for i, p in enumerate(output_proxies):
        first.setdefault(p, i)
    grad_of: dict[str, str] = {}
    for proxy, label in wanted:
        i = first.get(proxy.name)
        if i is not None and outputs[i].name not in grad_of:  # the first gradient a value is: that output
            grad_of[outputs[i].name] = label
            continue
        if i is None and not hasattr(proxy, "shape"):
            continue  # a number: no tensor gradient
        # A value that is already a gradient (one proxy for two inputs) or an input of the backward: a copy of its own.
        v = copy(outputs[i] if i is not None else input_value(proxy))
        outputs.append(v)
        grad_of[v.name] = label
    if len(ops) == len(b.ops) and outputs == list(b.outputs):
        return b, input_proxies, grad_of
    return verify(b.with_ops(tuple(ops), tuple(outputs))), input_proxies, grad_of


def check_gradients(backward: Fusion | None, differentiable: Sequence[str], where: str = "") -> None:
    """Every label in ``differentiable`` (the forward inputs Thunder's backward gives a gradient)
    has exactly one output of ``backward``: never a silently missing gradient (``p.grad`` None
    where eager PyTorch gives one) or two values claiming one parameter. A fused projection's
    parts (``nvtp.frontend.parts``) each have an output, which together are their weight's."""
    outs = [backward.grad_of(v.name) for v in backward.outputs] if backward is not None else []
    whole = set(outs) | {parts.owner(label) for label in outs}  # a part's gradient, and its weight's
    missing = [label for label in differentiable if label not in whole]
    twice = sorted({label for label in outs if label and outs.count(label) > 1})
    if missing or twice:
        what = (f"no gradient output for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}" if missing else "") + \
            ("; " if missing and twice else "") + (f"two gradient outputs for {', '.join(twice[:5])}" if twice else "")
        raise CaptureError(f"nvtp's backward fusion{' (' + where + ')' if where else ''} has {what}, though the traced backward "
                           "differentiates them: a bug in nvtp's capture; trace with nvtp.jit(..., regional=False) to see "
                           "whether the splice is at fault, and report the model")


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


def capture(module: torch.nn.Module, *args: Any, backward: bool = True, strict: bool = True, outputs: bool = True,
            **kwargs: Any) -> Captured:
    """Trace ``module(*args)`` with Thunder and nvtp's executor; return its labelled fusions.

    With meta-device ``args`` and module, nothing is computed. ``strict`` raises when an op
    was left outside nvtp's fusions, naming it and its source line. ``outputs``: label the
    forward's outputs by their place in the returned object (``y[0]``, ``y['loss']``), which
    refuses a returned input; off for a piece of a model that hands inputs on (the FX route's
    skeleton returns the invariants its blocks read, some of them its own inputs).
    """
    import thunder

    runtime = _Recording()
    start = time.perf_counter()
    saved_grads = {p: p.grad for p in module.parameters()}
    try:
        with use_runtime(runtime), paused():  # nvtp/gcpause.py: the collector walking Thunder's objects
            # Complex arithmetic (rotary tables) as real, before Thunder differentiates it (nvtp/frontend/complex.py);
            # fused projections of unequal parts, one per part, when asked (nvtp/frontend/parts.py)
            transforms = [ComplexAsReal()] + ([parts.SplitFusedLinears()] if parts.enabled() else [])
            jitted = thunder.jit(module, executors=[executor()], transforms=transforms)
            out = jitted(*args, **kwargs)
            if backward:  # every tensor of the output object (a tuple, dict, dataclass) that needs a gradient
                outs = [o for _, o in output_tensors(out) if o.requires_grad]
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
        state = user_code.state_update_message(module, runtime.unclaimed)  # BatchNorm's statistics, a counter: the user's terms
        raise MissingOpError(state or missing_ops_message(type(module).__name__, runtime.unclaimed, len(fwd), len(bwd)))
    if not fwd:
        raise CaptureError("Thunder's trace of the module contains no operation nvtp can fuse")
    if bwd_traces and not bwd and any(g is not None for g in _flat(bwd_traces[-1].bound_symbols[-1].args[0])):
        # Gradients with no computation (``x + bias``: each is the incoming gradient itself): an
        # empty fusion, which label_fusions gives an output per gradient.
        bwd = [FusionCallable(Fusion((), (), "nvtpFusion1"), (), (), runtime)]
    if bwd:
        bwd[0].extra["trace_return"] = bwd_traces[-1].bound_symbols[-1].args[0]
        bwd[0].extra["cotangents"] = _cotangents(bwd_traces[-1])
    params = parameter_names(jitted)
    forward, backward_fusion = label_fusions(fwd[0], bwd[0] if bwd else None, fwd_trace, params)
    tree = None
    if outputs:
        forward, backward_fusion, tree = label_outputs(type(module).__name__, out, runtime.returned.get(id(fwd[0]), ()), forward,
                                                       backward_fusion, _forward_location(module))
    differentiable = differentiable_inputs(fwd_trace, bwd[0] if bwd else None, params)
    check_gradients(backward_fusion, differentiable, "as traced")
    if parts.enabled():  # their parts become inputs of their own (nvtp/frontend/parts.py)
        forward, backward_fusion = parts.lift_parts(forward, backward_fusion)
    return Captured(forward, backward_fusion, jitted, runtime, fwd[0], bwd[0] if bwd else None, seconds, list(runtime.unclaimed),
                    differentiable=differentiable, output_tree=tree)


class _Recording(Runtime):
    """The reference runtime, keeping what each fusion callable last returned (by the callable's
    id): the forward's output tensors, which the model's output object holds by identity."""

    def __init__(self):
        super().__init__()
        self.returned: dict[int, tuple] = {}

    def run(self, fc: FusionCallable, args: Sequence[Any]) -> tuple:
        outs = super().run(fc, args)
        self.returned[id(fc)] = outs
        return outs


def label_outputs(model: str, out: Any, returned: Sequence[torch.Tensor], forward: Fusion,
                  backward: Fusion | None, where: str = "") -> tuple[Fusion, Fusion | None, Any]:
    """Label each of the forward's user outputs by its place in the model's output object ``out``
    (``y``, ``y[0]``, ``y['loss']``; nvtp.frontend.outputs), and each incoming gradient of the
    backward ``grad(<place>)``; returns the fusions and the object's structure (``Leaf`` per tensor).
    ``returned``: the tensors the forward fusion returned, one per output, in order; ``where``: the
    forward's file:line, for the error."""
    position = {id(t): i for i, t in enumerate(returned)}
    labels: dict[str, str] = {}  # forward value -> its place

    def leaf(place: str, t: torch.Tensor) -> Leaf:
        i = position.get(id(t))
        if i is None or i >= len(forward.outputs) or forward.role(forward.outputs[i].name) != "output":
            raise CaptureError(f"{model}.forward{' (' + where + ')' if where else ''} returns {place}, a tensor nvtp's forward fusion "
                               "does not compute (an argument, "
                               "a buffer or a parameter returned as it is); return a value the model computes from it "
                               "(e.g. x.clone()) or leave it out of the output")
        return Leaf(labels.setdefault(forward.outputs[i].name, place))

    tree = output_structure(out, leaf)
    info = dict(forward.info)
    for name, place in labels.items():
        info[name] = replace(info[name], label=place)
    forward = replace(forward, info=info)
    if backward is not None:
        binfo = dict(backward.info)
        for name, i in backward.info.items():
            if i.role == "grad" and i.source in labels:
                binfo[name] = replace(i, label=f"grad({labels[i.source]})")
        backward = replace(backward, info=binfo)
    return forward, backward, tree


def differentiable_inputs(fwd_trace, bwd: FusionCallable | None, params: dict[str, str]) -> tuple[str, ...]:
    """Labels of the forward's arguments (parameters by module name) whose gradient Thunder's
    backward returns as a tensor: what eager autograd would give a ``.grad``."""
    result = fwd_trace.bound_symbols[-1].args[0]
    if bwd is None or not isinstance(result, dict):
        return ()
    from thunder.core.pytree import tree_flatten

    args = [getattr(a, "name", None) for a in result.get("flat_args", [])]
    returned = tree_flatten(bwd_trace_return(bwd))[0]
    return tuple(dict.fromkeys(params.get(a, a) for a, g in zip(args, returned) if a is not None and hasattr(g, "shape")))


# -- when Thunder cannot trace ---------------------------------------------------------------------

_IN_PLACE = ("copy_", "update_aliases")


def missing_ops_message(model: str, unclaimed: Sequence[Unclaimed], forward: int, backward: int) -> str:
    """What ``MissingOpError`` says: each operation nvtp left out once, with how often and the
    model's lines (``file:line `code```), and what the user can do about it."""
    import linecache

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
    from nvtp.frontend.outputs import _children

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
