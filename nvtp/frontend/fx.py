"""The FX route: a whole model's forward as one torch.fx graph, then traced by Thunder with nvtp's executor.

Thunder's interpreter (``thunder.jit`` on the module) cannot trace Hugging Face ``transformers``
models on this stack (it fails inside the interpreter on their Python), but TorchDynamo can: it
captures the forward as one FX ``GraphModule`` of plain torch calls, which Thunder then traces
like any small function. ``export_program`` does the capture and makes the graph fit nvtp:

1. ``torch._dynamo.export`` with static shapes captures the whole forward as one graph (no graph
   break allowed: a break is a ``GraphBreakError`` naming it and its source line). It also gives
   the pytree specs of the arguments (``(args, kwargs)``) and of the output (e.g. a
   ``CausalLMOutputWithPast``), so calls take keyword arguments and return the model's own object.
2. Parameters, buffers and plain tensor attributes are ``get_attr`` nodes under dynamo's mangled
   names; each is renamed to the model's own name (``model.layers.0.self_attn.q_proj.weight``; a
   tied weight under the first name ``named_parameters`` gives), so plans and parameter sharding
   see the model's names. State that ``forward`` reassigns (CTRL's ``self.pos_encoding =
   self.pos_encoding.to(...)``) is put back after the export, which would leave its fake tensor.
3. Nodes that depend on no argument and no parameter (position ids, causal masks, the packed-
   sequence check of transformers' masking code) are computed once here (``nvtp.frontend.fx_constants``):
   constant tensors become inputs labelled ``nvtp_constant_N`` (replicated), constant numbers are
   written into the graph. So integer bookkeeping such as ``cumsum`` over positions never reaches the fusion.
4. The argument placeholders take their names from the call (``input_ids``, ``labels``), the
   labels nvtp uses for the fusion's inputs.
5. In-place updates of tensors the graph makes (``x += y``, ``relu(x, inplace=True)``) are written
   out of place (``nvtp.frontend.fx_inplace``; Thunder would leave ``copy_``/``update_aliases``
   outside any fusion), and ``x @ W.T`` of a 2-D parameter is ``F.linear(x, W)``, torch calls
   Thunder runs only opaquely the calls they compute (``nvtp.frontend.fx_forms``), the forms the
   plans read as a projection. A fused projection read as parts of different widths (Phi-3's
   ``qkv_proj`` with grouped-query attention) becomes one projection per part, each reading its
   own input ``<weight>[start:stop]`` (``nvtp.frontend.fused``).

``trace`` then runs ``nvtp.frontend.capture.capture`` on the graph module (on meta tensors), which
gives one forward and one backward ``Fusion`` or raises ``CaptureError`` naming each op nvtp
cannot fuse: nothing falls back to eager silently, since nvtp runs only its own fusions.

Which route ``nvtp.jit`` takes: ``wants_fx`` picks this one for ``transformers`` models (any
class in the module's MRO defined in a ``transformers`` package); nvtp's own models and plain
``nn.Module`` blocks keep the ``thunder.jit`` route, which needs no dynamo and keeps Thunder's
source lines. ``nvtp.jit(..., frontend="fx" | "thunder")`` overrides the choice. What a call's
structure is, and what is refused before any work, is ``nvtp.frontend.fx_calls``.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any
import logging

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import thunder
import torch._dynamo as dynamo

from nvtp.errors import InputError
from nvtp.frontend.attention import flash_claim_active, ring_claim_active
from nvtp.frontend.capture import CaptureError, Captured, capture
from nvtp.frontend.fused import split_fused_projections
from nvtp.frontend.fx_calls import call_structure, check_call, without_cache  # noqa: F401 - the route's call API
from nvtp.frontend.fx_constants import causal_masks, fold_constants
from nvtp.frontend.fx_asserts import drop_proven
from nvtp.frontend.fx_forms import decompose, linears, refuse_lacking
from nvtp.frontend.fx_inplace import functionalize
from nvtp.frontend.moe import gather_mm_experts, install_output_hooks


class GraphBreakError(CaptureError):
    """TorchDynamo could not capture the whole forward as one graph; names the break and its line."""


def wants_fx(module: torch.nn.Module) -> bool:
    """True for models the FX route is for: any class of a ``transformers`` package in the MRO."""
    return any(c.__module__.split(".")[0] == "transformers" for c in type(module).__mro__)


@dataclass
class Binding:
    """How a call maps onto an exported forward, as plain data (no graph): the argument leaves'
    names, the output object's structure, the folded constants and the fused parts. A Program's
    ``Source.call`` (``nvtp.program``): runtimes bind calls and rebuild outputs by it."""

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    arg_names: list[str]                 # one per flat argument leaf: the placeholder's name
    constants: dict[str, torch.Tensor]   # label -> value (whole, on the CPU)
    output_map: list[Any] = field(default_factory=list)  # per output leaf: ("out", i) or ("const", v)
    parts: dict[str, Any] = field(default_factory=dict)  # label -> nvtp.frontend.fused.Part: inputs that are rows of a parameter

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by placeholder name (the labels of the fusion's argument inputs)."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise ValueError(f"the call's arguments {spec} differ from the exported ones {self.in_spec}")
        return dict(zip(self.arg_names, leaves))

    def binding(self) -> "Binding":
        """The plain part (itself; a ``Program`` drops its graph)."""
        return self

    def rebuild(self, outputs: tuple) -> Any:
        """The model's own output object (e.g. ``CausalLMOutputWithPast``) from the fusion's user outputs."""
        leaves = [outputs[i] if kind == "out" else i for kind, i in self.output_map]
        return pytree.tree_unflatten(leaves, self.out_spec)


@dataclass
class Program(Binding):
    """One exported forward: the graph module Thunder traces, and (``Binding``) how calls map onto it."""

    graph_module: fx.GraphModule | None = None
    export_seconds: float = 0.0

    def binding(self) -> Binding:
        """The plain part: how calls map onto the forward, without the graph."""
        return Binding(self.in_spec, self.out_spec, self.arg_names, self.constants, self.output_map, self.parts)


# -- capture --------------------------------------------------------------------------------------


def _graph_break_message(module: torch.nn.Module, e: BaseException) -> str:
    """dynamo's error reworded: what broke the graph and the user's source line, no traceback."""
    text = str(e)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    first = re.sub(r"\s+", " ", first)
    where = ""
    if "from user code:" in text:
        tail = text.split("from user code:", 1)[1]
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', tail)
        if frames:
            path, line, fn, code = frames[-1]
            where = f" at {path}:{line} in {fn}: `{code.strip()}`"
    explanation = ""
    m = re.search(r"Explanation: (.*)", text)
    if m:
        explanation = f" ({m.group(1).strip()})"
    return (f"TorchDynamo cannot capture {type(module).__name__}.forward as one graph: {first}{explanation}{where}. "
            "nvtp needs the whole forward in one graph: remove the data-dependent Python (e.g. .item(), "
            "print, a branch on a tensor's value) from the forward, or pass arguments that avoid it")


_EXPORTING = threading.Lock()


def _export(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    # A fresh cache: after several models in one process dynamo's recompile limit would otherwise
    # be hit (export raises rather than falling back, but there is no reason to get near it).
    install_output_hooks(module, kwargs)  # transformers' router-logit recorders, installed outside dynamo (nvtp/frontend/moe.py)
    try:
        # One export at a time: the ranks of a simulated mesh (threads) trace each on its own, and
        # TorchDynamo is not thread-safe (two exports at once crashed the process). transformers'
        # experts run as nvtp's gather_mm (nvtp/frontend/moe.py), whichever implementation the config names.
        with _EXPORTING, _quiet_torch_logs(), gather_mm_experts(module), _state_kept(module):  # dynamo logs failures with tracebacks; nvtp raises one line
            dynamo.reset()
            return dynamo.export(module, assume_static_by_default=True)(*args, **kwargs)
    except dynamo.exc.TorchRuntimeError as e:  # an op failed on the (fake) arguments: they do not fit the model
        text = str(e)
        op = re.search(r"call_(?:function|method|module) (?:<built-in function |<function )?([\w.]+)", text)
        why = re.search(r"got (\w+)\((['\"])(.*?)\2\)", text, re.S)
        what = f"{op.group(1) if op else 'an op'} fails: {why.group(3) if why else text.strip().splitlines()[0]}"
        if re.search(r"found two different devices meta, cpu|found two different devices cpu, meta", text):
            raise InputError(f"{type(module).__name__}.forward makes a tensor without device= ({what}): nvtp traces the model on "
                             "the meta device, where a tensor made in the forward without device= (torch.arange(n), torch.ones(n)) "
                             "lands on the CPU beside meta tensors; make it on the input's device (torch.arange(n, device=x.device)), "
                             "or trace through Thunder (frontend='thunder')") from None
        raise InputError(f"{type(module).__name__}.forward cannot run on the given arguments ({what}); pass arguments "
                         "of the shapes and dtypes the model expects") from None
    except (dynamo.exc.Unsupported, dynamo.exc.UserError, dynamo.exc.InternalTorchDynamoError, NotImplementedError) as e:
        raise GraphBreakError(_graph_break_message(module, e)) from None


@contextlib.contextmanager
def _state_kept(module: torch.nn.Module):
    """``module``'s buffers and plain tensor attributes as they were before the block, put back
    after it. A forward that reassigns its state (CTRL's ``self.pos_encoding =
    self.pos_encoding.to(device, dtype)``, the same tensor when nothing changes) has dynamo's export
    replay the assignment with its fake tensor, so afterwards the module would hold a
    ``FakeTensor`` the exported graph does not read, and neither would be known by its name."""
    kept = [(m, k, v) for m in module.modules() for k, v in [*m._buffers.items(), *vars(m).items()]
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]
    try:
        yield
    finally:
        for m, k, v in kept:
            if getattr(m, k, None) is not v:
                setattr(m, k, v)


@contextlib.contextmanager
def _quiet_torch_logs():
    loggers = [logging.getLogger(n) for n in ("torch._dynamo", "torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_program(module: torch.nn.Module, args: tuple, kwargs: dict, *, split_parts: bool = True) -> Program:
    """Capture ``module(*args, **kwargs)`` (a meta-device module and arguments) as one graph; see
    the module docstring. Raises ``GraphBreakError`` when dynamo cannot capture it whole.
    ``split_parts``: fused projections read as parts of different widths become one projection
    per part (``nvtp.frontend.fused``)."""
    start = time.perf_counter()
    exported = export_graph(module, args, kwargs)
    new = exported.module()
    # The model's buffers are state (the model is on meta here): only what depends on nothing folds.
    constants = fold_constants(new, {})
    new, parts = _split_parts(new) if split_parts else (new, {})
    return Program(exported.in_spec, exported.out_spec, exported.arg_names, constants, parts=parts, graph_module=new,
                   export_seconds=time.perf_counter() - start)


@dataclass
class Exported:
    """dynamo's graph of one call, rewritten for nvtp (steps 1, 2, 4-7 of the module docstring),
    before constants are folded and fused projections split: what ``export_program`` finishes,
    and what the regional FX route (``nvtp.frontend.fx_regional``) cuts into a skeleton and a block."""

    graph: fx.Graph
    attrs: dict[str, Any]  # get_attr target -> tensor (meta): the model's parameters and buffers by their names
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    arg_names: list[str]

    def module(self, graph: fx.Graph | None = None) -> fx.GraphModule:
        """A graph module of ``graph`` (default: the whole graph) over the tensors it reads."""
        g = self.graph if graph is None else graph
        read = {n.target: self.attrs[n.target] for n in g.nodes if n.op == "get_attr" and n.target in self.attrs}
        return fx.GraphModule(read, g) if read else fx.GraphModule(torch.nn.Module(), g)


def _split_parts(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[str, Any]]:
    """After folding: the shapes a model reads off a fused output (``fused_qkv.shape``) are numbers now."""
    tensors = {n.target: operator.attrgetter(n.target)(gm) for n in gm.graph.nodes if n.op == "get_attr"}
    parts = split_fused_projections(gm.graph, tensors)
    return (fx.GraphModule(tensors, gm.graph) if parts else gm), parts


def export_graph(module: torch.nn.Module, args: tuple, kwargs: dict) -> Exported:
    """dynamo's graph of ``module(*args, **kwargs)`` with the model's names, the call's argument
    names, in-place updates written out of place, ``x @ W.T`` as linears and decompositions."""
    exported = _export(module, args, kwargs)
    gm = exported.graph_module
    in_spec, out_spec = gm._in_spec, gm._out_spec

    names: dict[int, str] = {}
    for n, p in module.named_parameters(remove_duplicate=True):
        names.setdefault(id(p), n)
    for n, b in module.named_buffers(remove_duplicate=True):
        names.setdefault(id(b), n)
    for prefix, m in module.named_modules():  # plain tensor attributes (gpt-fast's freqs_cis): module state, passed whole
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                names.setdefault(id(v), f"{prefix}.{k}" if prefix else k)
    g = gm.graph
    attrs: dict[str, Any] = {}  # new get_attr target -> tensor (meta) for the new graph module
    for node in g.nodes:
        if node.op != "get_attr":
            continue
        value = operator.attrgetter(node.target)(gm)
        if id(value) in names:
            node.target = names[id(value)]
            attrs[node.target] = value
        elif isinstance(value, torch.nn.Module):  # a higher-order op's subgraph: kept as it is
            attrs[node.target] = value
        else:
            raise CaptureError(f"{type(module).__name__}: the exported graph reads a tensor that is neither a parameter, "
                               f"a buffer nor a tensor attribute of the model ({node.target}, {tuple(value.shape)}), such as a "
                               "tensor in a list, a dict or a global; nvtp cannot place it: register it with self.register_buffer")

    # Placeholders: one per leaf of (args, kwargs), named after the argument.
    leaves = pytree.tree_flatten((tuple(args), dict(kwargs)))[0]
    positional = [p for p in inspect.signature(module.forward).parameters]
    leaf_names = []
    for i, path in enumerate(pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]):
        keys = path[0]
        if isinstance(keys[1], pytree.SequenceKey) and keys[0].idx == 0:
            base = positional[keys[1].idx] if keys[1].idx < len(positional) else f"arg{keys[1].idx}"
        else:
            base = str(keys[1].key)
        rest = "".join(f"_{getattr(k, 'key', getattr(k, 'idx', ''))}" for k in keys[2:])
        leaf_names.append(re.sub(r"\W", "_", base + rest))
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    if len(placeholders) != len(leaves):
        raise CaptureError(f"{type(module).__name__}: the exported graph has {len(placeholders)} inputs for {len(leaves)} arguments")
    for node, name in zip(placeholders, leaf_names):
        node.target = name  # the signature's name (the node keeps its own, which may be taken)
    g._codegen = fx.graph.CodeGen()  # flat arguments in, flat outputs out; the specs live in Program
    functionalize(g, type(module).__name__)
    linears(g, attrs)
    decompose(g)
    drop_proven(g, type(module).__name__)  # checks on values read from the data: proven and dropped, or refused (fx_asserts)
    refuse_lacking(g, type(module).__name__)
    if ring_claim_active() or flash_claim_active():  # attention claimed whole (a cp axis's ring, the reference
        # backend's flash kernels): attention masks that are causal, read as is_causal=True
        causal_masks(g)
    return Exported(g, attrs, in_spec, out_spec, leaf_names)


def trace(module: torch.nn.Module, args: tuple, kwargs: dict, *, split_parts: bool = True) -> tuple[Program, Captured]:
    """Export ``module`` (meta) for this call and capture its forward and backward fusions."""
    program = export_program(module, args, kwargs, split_parts=split_parts)
    leaves = pytree.tree_flatten((tuple(args), dict(kwargs)))[0]
    try:
        captured = capture(program.graph_module, *leaves)
    except CaptureError as e:  # Thunder names lines of the generated graph code: name the model's instead
        raise type(e)(model_lines(program.graph_module, str(e), type(module).__name__)) from None
    program.output_map = _output_map(captured)
    return program, captured


def model_lines(gm: fx.GraphModule, message: str, model: str = "") -> str:
    """``<eval_with_key>.5:23`` (a line of the graph module's code) replaced by the model's source
    line the node came from (dynamo's ``stack_trace``); "GraphModule" by the model's name."""
    lines = gm.code.splitlines()
    nodes = {n.name: n for n in gm.graph.nodes}

    def where(m: re.Match) -> str:
        k = int(m.group(1)) - 1
        code = lines[k] if 0 <= k < len(lines) else ""
        target = re.match(r"\s*(\w+)", code)
        node = nodes.get(target.group(1)) if target else None
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', (node.meta.get("stack_trace") or "") if node else "")
        if not frames:
            return m.group(0)
        path, line, fn, text = frames[-1]
        return f"{path}:{line} in {fn}: `{text.strip()}`"

    message = re.sub(r"<eval_with_key>\.\d+:(\d+)", where, message)
    return message.replace("GraphModule.forward", f"{model}.forward" if model else "the model's forward")


def _output_map(captured: Captured) -> list[Any]:
    """For each leaf the graph returns: which of the forward fusion's user outputs it is, or its constant value."""
    ret = thunder.last_traces(captured.jitted)[-1].bound_symbols[-1].args[0]
    output = ret.get("output") if isinstance(ret, dict) else ret
    leaves = pytree.tree_flatten(output)[0] if not isinstance(output, (tuple, list)) else list(output)
    f = captured.forward
    user = [p for v, p in zip(f.outputs, captured.forward_callable.output_proxies) if f.role(v.name) == "output"]
    out = []
    for leaf in leaves:
        name = getattr(leaf, "name", None)
        if name is None:
            out.append(("const", leaf))
        elif name in user:
            out.append(("out", user.index(name)))
        else:
            raise CaptureError(f"the model returns {name}, which is not computed by the forward fusion (an argument "
                               "returned as it is?); nvtp can return only values its fusion computes")
    return out
