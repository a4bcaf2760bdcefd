"""Trace a module with Thunder and nvtp's executor, and label the fusions it gives.

``capture(module, *args)`` runs ``thunder.jit`` once (on meta tensors too, so a GPT-3 layer is
traced without being computed) and returns the forward and backward ``Fusion``s with what
nvtp knows of each input and output: which inputs are parameters (by their module name), which
backward inputs are forward values saved for backward (and which forward value), which are
incoming gradients, and which parameter each backward output is the gradient of.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
from thunder.core.prims import PrimIDs
from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
import thunder
import thunder.core.update_aliases as update_aliases

from nvtp.frontend import parts, user_code
from nvtp.frontend.complex import ComplexAsReal
from nvtp.frontend.executor import FusionCallable, Runtime, Unclaimed, executor, use_runtime
from nvtp.frontend.failures import CaptureError, MissingOpError, _forward_location, missing_ops_message, trace_failure
from nvtp.frontend.outputs import Leaf, structure as output_structure, tensors as output_tensors
from nvtp.gcpause import paused
from nvtp.ir.graph import defines_input, fresh_names, Fusion, ValueInfo
from nvtp.ir.verify import verify
from nvtp.frontend.translate import to_dtype
from nvtp.ir.build import make_op


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
    return {proxy: path for trace in thunder.last_prologue_traces(jitted)[-1:] for proxy, (_, path) in module_state(trace).items()}


def module_state(prologue_trace) -> dict[str, tuple[str, str]]:
    """Thunder proxy name -> (kind, path) of each tensor a prologue takes from the module: kind
    "parameter", "buffer" or "attribute", path the module's name for it (``h.0.attn.c_attn.weight``).

    A plain tensor attribute the forward reads (``self.freqs_cis``, kept as an attribute or
    reassigned in ``forward`` as ``self.freqs = self.freqs.to(h.device)``) is module state like a
    buffer: it is named by its path too (``layers.0.freqs``), and the caller passes the module's
    tensor at each call (``nvtp.jit``: ``RankProgram.module_state``; ``ShardingTransform``: Thunder's prologue)."""
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
    for bsym in trace.bound_symbols:
        if bsym.sym.id == PrimIDs.UNPACK_SEQUENCE and getattr(bsym.args[0], "name", None) == "cotangents":
            return [getattr(o, "name", None) for o in bsym.output]
    return []


def bwd_trace_return(bwd: FusionCallable) -> list:
    return bwd.extra.get("trace_return", [])


def _flat(x) -> list:
    return [p.name if hasattr(p, "name") else None for p in tree_flatten(x)[0]]


@contextlib.contextmanager
def _plain_call(module: torch.nn.Module):
    """An FX graph module called as any module is while Thunder interprets it. Its class's ``__call__``
    (``torch.fx.graph_module._WrappedCall``) catches an error raised in the graph's code and formats it with
    ``traceback.format_exc`` under ``torch._dynamo.disable``, which Thunder's interpreter then interprets too:
    that failed with ``IndexError: list index out of range`` or crashed the process (a segmentation fault)
    instead of raising the error, such as Thunder's "Trying to call function torch.rms_norm, but it is not
    yet supported" (DiffLlama, before ``fx_forms.DECOMPOSITIONS`` wrote it as ``F.rms_norm``)."""
    cls = type(module)
    wrapped = isinstance(module, torch.fx.GraphModule) and "__call__" in vars(cls)
    if wrapped:
        call = vars(cls)["__call__"]
        cls.__call__ = torch.nn.Module.__call__
    try:
        yield
    finally:
        if wrapped:
            cls.__call__ = call


_ALIASES = threading.Lock()
_DISTINCT: list[Any] = []  # the captures inside ``_distinct_arguments`` now (threads: a simulated mesh's ranks)
_GROUPED = update_aliases.replace_args_with_alias_map


def _no_groups(trace, alias_tensor_indices):
    return _GROUPED(trace, [])


@contextlib.contextmanager
def _distinct_arguments():
    """While inside, Thunder takes a call's tensor arguments for distinct tensors. Thunder groups them
    by storage pointer and, in a trace with an in-place update, reads every argument of a group as
    (a reshape of) its first (``update_aliases.replace_args_with_alias_map``). nvtp traces on meta
    tensors, whose storage pointer is 0 for every one, so a model with an in-place update (a setitem,
    ``nvtp.frontend.setitem``) read its ``labels`` as its ``input_ids`` where their shapes agreed (a
    wrong loss, silently) and failed where they did not ("reshape (2, 16, 64) to (1, 16, 8)"). The
    inputs of nvtp's fusions are distinct values; a write into one is refused (``setitem``)."""
    with _ALIASES:
        if not _DISTINCT:
            update_aliases.replace_args_with_alias_map = _no_groups
        _DISTINCT.append(None)
    try:
        yield
    finally:
        with _ALIASES:
            _DISTINCT.pop()
            if not _DISTINCT:
                update_aliases.replace_args_with_alias_map = _GROUPED


def capture(module: torch.nn.Module, *args: Any, backward: bool = True, strict: bool = True, outputs: bool = True,
            **kwargs: Any) -> Captured:
    """Trace ``module(*args)`` with Thunder and nvtp's executor; return its labelled fusions.

    With meta-device ``args`` and module, nothing is computed. ``strict`` raises when an op
    was left outside nvtp's fusions, naming it and its source line. ``outputs``: label the
    forward's outputs by their place in the returned object (``y[0]``, ``y['loss']``), which
    refuses a returned input; off for a piece of a model that hands inputs on (the FX route's
    skeleton returns the invariants its blocks read, some of them its own inputs).
    """
    runtime = _Recording()
    start = time.perf_counter()
    saved_grads = {p: p.grad for p in module.parameters()}
    try:
        with use_runtime(runtime), paused():  # nvtp/gcpause.py: the collector walking Thunder's objects
            # Complex arithmetic (rotary tables) as real, before Thunder differentiates it (nvtp/frontend/complex.py);
            # fused projections of unequal parts, one per part, when asked (nvtp/frontend/parts.py)
            transforms = [ComplexAsReal()] + ([parts.SplitFusedLinears()] if parts.enabled() else [])
            jitted = thunder.jit(module, executors=[executor()], transforms=transforms)
            with _plain_call(module), _distinct_arguments():
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

    args = [getattr(a, "name", None) for a in result.get("flat_args", [])]
    returned = tree_flatten(bwd_trace_return(bwd))[0]
    return tuple(dict.fromkeys(params.get(a, a) for a, g in zip(args, returned) if a is not None and hasattr(g, "shape")))


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
