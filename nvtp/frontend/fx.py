"""The FX route: a whole model's forward as one torch.fx graph, then traced by Thunder with nvtp's executor.

Thunder's interpreter (``thunder.jit`` on the module) cannot trace Hugging Face ``transformers``
models on this stack (it fails inside the interpreter on their Python), but TorchDynamo can: it
captures the forward as one FX ``GraphModule`` of plain torch calls, which Thunder then traces
like any small function. ``export_program`` does the capture and makes the graph fit nvtp:

1. ``torch._dynamo.export`` with static shapes captures the whole forward as one graph (no graph
   break allowed: a break is a ``GraphBreakError`` naming it and its source line). It also gives
   the pytree specs of the arguments (``(args, kwargs)``) and of the output (e.g. a
   ``CausalLMOutputWithPast``), so calls take keyword arguments and return the model's own object.
2. Parameters and buffers are ``get_attr`` nodes under dynamo's mangled names; each is renamed to
   the model's own name (``model.layers.0.self_attn.q_proj.weight``; a tied weight under the
   first name ``named_parameters`` gives), so plans and parameter sharding see the model's names.
3. Nodes that depend on no argument and no parameter (position ids, causal masks, the packed-
   sequence check of transformers' masking code) are computed once here: constant tensors become
   inputs labelled ``nvtp_constant_N`` (replicated), constant numbers are written into the graph. So
   integer bookkeeping such as ``cumsum`` over positions never reaches the fusion.
4. The argument placeholders take their names from the call (``input_ids``, ``labels``), the
   labels nvtp uses for the fusion's inputs.
5. In-place updates of tensors the graph makes (``x += y``, ``relu(x, inplace=True)``) are written
   out of place (``_functionalize``; Thunder would leave ``copy_``/``update_aliases`` outside any
   fusion), and ``x @ W.T`` of a 2-D parameter is ``F.linear(x, W)`` (``_linears``), the form the
   plans read as a projection. A fused projection read as parts of different widths (Phi-3's
   ``qkv_proj`` with grouped-query attention) becomes one projection per part, each reading its
   own input ``<weight>[start:stop]`` (``nvtp.frontend.fused``).

``trace`` then runs ``nvtp.frontend.capture.capture`` on the graph module (on meta tensors), which
gives one forward and one backward ``Fusion`` or raises ``CaptureError`` naming each op nvtp
cannot fuse: nothing falls back to eager silently, since nvtp runs only its own fusions.

Which route ``nvtp.jit`` takes: ``wants_fx`` picks this one for ``transformers`` models (any
class in the module's MRO defined in a ``transformers`` package); nvtp's own models and plain
``nn.Module`` blocks keep the ``thunder.jit`` route, which needs no dynamo and keeps Thunder's
source lines. ``nvtp.jit(..., frontend="fx" | "thunder")`` overrides the choice.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from nvtp.errors import InputError
from nvtp.frontend.attention import ring_claim_active
from nvtp.frontend.capture import CaptureError, Captured, capture
from nvtp.frontend.executor import one_index_as_slice
from nvtp.frontend.fused import split_fused_projections


class GraphBreakError(CaptureError):
    """TorchDynamo could not capture the whole forward as one graph; names the break and its line."""


def wants_fx(module: torch.nn.Module) -> bool:
    """True for models the FX route is for: any class of a ``transformers`` package in the MRO."""
    return any(c.__module__.split(".")[0] == "transformers" for c in type(module).__mro__)


@dataclass
class Program:
    """One exported forward: the graph module Thunder traces and how calls map onto it."""

    graph_module: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    arg_names: list[str]                 # one per flat argument leaf: the placeholder's name
    constants: dict[str, torch.Tensor]   # label -> value (whole, on the CPU)
    export_seconds: float = 0.0
    output_map: list[Any] = field(default_factory=list)  # per output leaf: ("out", i) or ("const", v)
    parts: dict[str, Any] = field(default_factory=dict)  # label -> nvtp.frontend.fused.Part: inputs that are rows of a parameter

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by placeholder name (the labels of the fusion's argument inputs)."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise ValueError(f"the call's arguments {spec} differ from the exported ones {self.in_spec}")
        return dict(zip(self.arg_names, leaves))

    def rebuild(self, outputs: tuple) -> Any:
        """The model's own output object (e.g. ``CausalLMOutputWithPast``) from the fusion's user outputs."""
        leaves = [outputs[i] if kind == "out" else i for kind, i in self.output_map]
        return pytree.tree_unflatten(leaves, self.out_spec)


def without_cache(module: torch.nn.Module, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's keyword arguments with ``use_cache=False`` added when the model's config asks for
    a KV cache (transformers' default) and the call does not say: nvtp trains, and a cache is an
    output nvtp would return and feed back (``past_key_values``), as transformers itself turns the
    cache off for gradient checkpointing. ``use_cache=True`` passed explicitly is refused."""
    kwargs = dict(kwargs)
    if "use_cache" not in inspect.signature(module.forward).parameters:
        return kwargs
    if kwargs.get("use_cache"):
        raise InputError(f"{type(module).__name__}: nvtp.jit does not return KV caches (past_key_values); "
                         "call it with use_cache=False (training does not use the cache)")
    if "use_cache" not in kwargs and getattr(getattr(module, "config", None), "use_cache", False):
        kwargs["use_cache"] = False
    return kwargs


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


# -- torch calls Thunder runs only opaquely, written as the ops they are ---------------------------
# Thunder 0.2.6 has no decomposition for these (they run as "default torch ops", outside any
# fusion); each is replaced in the graph by the torch calls it computes, which Thunder traces to
# prims. Add an entry here when capture names an op with no prims (e.g. GPT-2's Conv1D: addmm).


def _addmm(input, mat1, mat2, *, beta=1, alpha=1):
    product = torch.matmul(mat1, mat2)
    product = product if alpha == 1 else product * alpha
    return product + (input if beta == 1 else input * beta)


def _baddbmm(input, batch1, batch2, *, beta=1, alpha=1):
    return _addmm(input, batch1, batch2, beta=beta, alpha=alpha)


DECOMPOSITIONS: dict[Any, Any] = {torch.addmm: _addmm, torch.baddbmm: _baddbmm}
_METHOD_DECOMPOSITIONS = {"addmm": _addmm, "baddbmm": _baddbmm}


# -- in-place updates, written out of place ----------------------------------------------------------
# Dynamo's graph keeps the model's in-place ops (Falcon's ``mlp_output += attention_output``,
# ``F.relu(x, inplace=True)``, ``x.masked_fill_(...)``). Thunder traces each as the op plus a
# ``copy_`` into the old tensor and ``update_aliases`` for its views, which nvtp's executor does
# not fuse (its fusions return new tensors), so capture would refuse the model. nvtp's fusions are functional: an update of a tensor
# the graph itself made, with no earlier view of it read afterwards, is the out-of-place op whose
# result takes the old tensor's place for every later use. Which nodes alias is told by dynamo's
# fake example values (a view shares its base's storage), so reshape-that-copies and
# reshape-that-views are told apart exactly as eager does. An update nvtp cannot write so (of an
# argument, a parameter or a buffer, or of a tensor an earlier view still reads) is a CaptureError
# naming the op and the model's line.

_INPLACE_OPERATORS = {getattr(operator, f"i{n.rstrip('_')}"): getattr(operator, n) for n in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and_", "or_", "xor", "lshift", "rshift", "matmul")}
# In-place methods whose out-of-place namesake computes something else (random fills use self as
# shape only; bernoulli() reads self as probabilities) or that change no values.
_NOT_OUT_OF_PLACE = {"requires_grad_", "share_memory_", "set_", "resize_", "resize_as_", "uniform_", "normal_",
                     "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_", "retain_grad_"}


def _example(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _storage(node: Any) -> int | None:
    value = _example(node)
    if isinstance(value, torch.Tensor):
        try:
            return value.untyped_storage()._cdata
        except Exception:  # noqa: BLE001 - a tensor without storage (sparse, nested): no alias facts
            return None
    return None


def _out_of_place(node: fx.Node) -> tuple[str, Any, dict] | None:
    """(op, target, kwargs) of the out-of-place form of an in-place ``node``, or None if it is none."""
    if not node.args or not isinstance(_example(node.args[0]), torch.Tensor):
        return None
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return "call_function", _INPLACE_OPERATORS[node.target], dict(node.kwargs)
    if node.op == "call_method" and isinstance(node.target, str):
        name = node.target
        if name.endswith("_") and not name.startswith("_") and name not in _NOT_OUT_OF_PLACE and callable(getattr(torch.Tensor, name[:-1], None)):
            return "call_method", name[:-1], dict(node.kwargs)
        return None
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", "")
    if node.kwargs.get("inplace") is True:  # F.relu(x, inplace=True), F.dropout(..., inplace=True)
        return "call_function", node.target, {**node.kwargs, "inplace": False}
    if name.endswith("_") and not name.startswith("_") and name not in _NOT_OUT_OF_PLACE and getattr(torch, name, None) is node.target \
            and callable(getattr(torch, name[:-1], None)):  # torch.relu_ -> torch.relu
        return "call_function", getattr(torch, name[:-1]), dict(node.kwargs)
    return None


def _inplace_positional(node: fx.Node) -> bool:
    """``F.dropout(x, 0.1, True, True)``: ``inplace`` given by position."""
    if node.op != "call_function" or "inplace" in node.kwargs:
        return False
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return False
    return bound.arguments.get("inplace") is True


def _node_line(node: fx.Node) -> str:
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', node.meta.get("stack_trace") or "")
    if not frames:
        return f"node {node.name}"
    path, line, fn, text = frames[-1]
    return f"{path}:{line} in {fn}: `{text.strip()}`"


def _functionalize(g: fx.Graph, model: str) -> int:
    """Write each in-place update out of place (see above); returns how many were rewritten."""
    order = {n: i for i, n in enumerate(g.nodes)}
    rewritten = 0
    for node in list(g.nodes):
        if _inplace_positional(node):
            params = list(inspect.signature(node.target).parameters)
            k = params.index("inplace")
            node.args = node.args[:k] + (False,) + node.args[k + 1:]
            new = ("call_function", node.target, dict(node.kwargs))
        else:
            new = _out_of_place(node)
            if new is None:
                continue
        base = node.args[0]
        storage = _storage(base)
        if storage is None:
            continue
        aliases = [n for n in g.nodes if order[n] < order[node] and _storage(n) == storage]
        what = f"{node.target if isinstance(node.target, str) else getattr(node.target, '__name__', node.target)}"
        for a in aliases:
            if a.op in ("placeholder", "get_attr"):
                kind = "argument" if a.op == "placeholder" else "parameter or buffer"
                raise CaptureError(
                    f"{model}: {what} at {_node_line(node)} updates the {kind} {a.target} (or a view of it) in place; nvtp's "
                    "fusions compute new tensors and cannot write into their inputs: write the update out of place "
                    "(e.g. `x = x + y` instead of `x += y`)")
            if a is base:
                continue
            late = [u for u in a.users if u is not node and order[u] > order[node]]
            if late:
                raise CaptureError(
                    f"{model}: {what} at {_node_line(node)} updates a tensor in place that {a.name} (from {_node_line(a)}) "
                    f"aliases and {late[0].name} (at {_node_line(late[0])}) reads afterwards; nvtp's fusions are "
                    "functional and cannot update both: write the update out of place")
        node.op, node.target, node.kwargs = new
        for user in list(base.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(base, node)
        if _keep_dtype(g, node, base):
            order = {n: i for i, n in enumerate(g.nodes)}
        rewritten += 1
    return rewritten


def _keep_dtype(g: fx.Graph, node: fx.Node, base: fx.Node) -> bool:
    """An in-place result keeps the updated tensor's dtype; the out-of-place op may promote (an int
    tensor += a float): cast back where it would, computed on dynamo's fake values."""
    from torch._guards import detect_fake_mode

    want = _example(base).dtype
    fake = detect_fake_mode([_example(base)])
    if fake is None:
        return False
    try:
        with fake:
            args = fx.node.map_arg(node.args, _example)
            kwargs = fx.node.map_arg(node.kwargs, _example)
            got = (getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method"
                   else node.target(*args, **kwargs))
    except Exception:  # noqa: BLE001 - no fake run: Thunder will check the op's dtypes itself
        return False
    if not isinstance(got, torch.Tensor) or got.dtype == want:
        return False
    users = list(node.users)
    with g.inserting_after(node):
        cast = g.call_method("to", (node, want))
    cast.meta = dict(node.meta)
    for u in users:
        u.replace_input_with(node, cast)
    return True


_MATMULS = (operator.matmul, torch.matmul)


def _transposed_weight(node: Any, attrs: dict[str, Any]) -> fx.Node | None:
    """The ``get_attr`` node of a 2-D parameter if ``node`` is its transpose (``w.T``, ``w.t()``,
    ``w.transpose(0, 1)``, ``w.permute(1, 0)``, ``torch.t(w)``), else None."""
    if not isinstance(node, fx.Node) or not node.args:
        return None
    w = node.args[0]
    if not (isinstance(w, fx.Node) and w.op == "get_attr" and isinstance(attrs.get(w.target), torch.Tensor)
            and attrs[w.target].ndim == 2):
        return None
    rest = tuple(node.args[1:])
    if node.op == "call_function" and node.target is getattr and rest in (("T",), ("mT",)):
        return w
    if (node.op == "call_method" and node.target == "t") or (node.op == "call_function" and node.target is torch.t):
        return w if not rest else None
    if (node.op == "call_method" and node.target == "transpose") or (node.op == "call_function" and node.target is torch.transpose):
        return w if len(rest) == 2 and {d % 2 for d in rest} == {0, 1} else None
    if node.op == "call_method" and node.target == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        return w if tuple(d % 2 for d in dims) == (1, 0) else None
    return None


def _linears(g: fx.Graph, attrs: dict[str, Any]) -> int:
    """``x @ W.T`` with ``W`` a 2-D parameter is ``F.linear(x, W)`` (a weight ``[out, in]``): the
    form the plans read as a projection (Falcon's ``FalconLinear``, any hand-written linear). The
    transpose stays for its other users, if any."""
    count = 0
    for node in list(g.nodes):
        is_matmul = (node.op == "call_function" and node.target in _MATMULS) or (node.op == "call_method" and node.target == "matmul")
        if not is_matmul or len(node.args) != 2 or node.kwargs:
            continue
        x, wt = node.args
        w = _transposed_weight(wt, attrs)
        ex = _example(x)
        if w is None or not isinstance(ex, torch.Tensor) or ex.ndim < 1:
            continue
        node.op, node.target, node.args = "call_function", torch.nn.functional.linear, (x, w)
        count += 1
    return count


def _decompose(g: fx.Graph) -> None:
    for node in g.nodes:
        if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
            node.args = (node.args[0], one_index_as_slice(node.args[1]))  # x[..., [k], :] a slice, as on the Thunder route
        if node.op == "call_function" and node.target in DECOMPOSITIONS:
            node.target = DECOMPOSITIONS[node.target]
        elif node.op == "call_method" and node.target in _METHOD_DECOMPOSITIONS:
            node.op, node.target = "call_function", _METHOD_DECOMPOSITIONS[node.target]


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


def _export(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    import torch._dynamo as dynamo

    # A fresh cache: after several models in one process dynamo's recompile limit would otherwise
    # be hit (export raises rather than falling back, but there is no reason to get near it).
    dynamo.reset()
    try:
        with _quiet_torch_logs():  # dynamo logs failures with tracebacks; nvtp raises one line instead
            return dynamo.export(module, assume_static_by_default=True)(*args, **kwargs)
    except dynamo.exc.TorchRuntimeError as e:  # an op failed on the (fake) arguments: they do not fit the model
        text = str(e)
        op = re.search(r"call_(?:function|method|module) (?:<built-in function |<function )?([\w.]+)", text)
        why = re.search(r"got (\w+)\((['\"])(.*?)\2\)", text, re.S)
        what = f"{op.group(1) if op else 'an op'} fails: {why.group(3) if why else text.strip().splitlines()[0]}"
        raise InputError(f"{type(module).__name__}.forward cannot run on the given arguments ({what}); pass arguments "
                         "of the shapes and dtypes the model expects") from None
    except (dynamo.exc.Unsupported, dynamo.exc.UserError, dynamo.exc.InternalTorchDynamoError, NotImplementedError) as e:
        raise GraphBreakError(_graph_break_message(module, e)) from None


@contextlib.contextmanager
def _quiet_torch_logs():
    import logging

    loggers = [logging.getLogger(n) for n in ("torch._dynamo", "torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_RANDOM = re.compile(r"rand|dropout|bernoulli|normal|multinomial|uniform|seed", re.I)


def _is_constant_foldable(node: fx.Node) -> bool:
    if node.op != "call_function" and node.op != "call_method":
        return False
    name = getattr(node.target, "__name__", str(node.target))
    return not _RANDOM.search(name) and node.target is not torch._C._set_grad_enabled


def _on_cpu(x: Any) -> Any:
    """Arguments of a constant computation with the meta device (the model was exported on meta) made CPU."""
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    if isinstance(x, str) and x == "meta":
        return "cpu"
    return x


def _constant_values(g: fx.Graph, values: dict[str, torch.Tensor]) -> dict[fx.Node, Any]:
    """The value of every node that depends on no placeholder and no parameter (``values``: the
    ``get_attr`` tensors known), computed on the CPU; a node that fails to compute is left out."""
    known: dict[fx.Node, Any] = {}
    for node in g.nodes:
        if node.op == "get_attr" and node.target in values:
            known[node] = values[node.target]
            continue
        if not _is_constant_foldable(node):
            continue
        if not all(a in known for a in node.all_input_nodes):
            continue
        args = fx.node.map_arg(node.args, lambda n: known[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: known[n])
        args = pytree.tree_map(_on_cpu, args)
        kwargs = pytree.tree_map(_on_cpu, kwargs)
        try:
            if node.op == "call_method":
                known[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                known[node] = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - not foldable here: it stays in the graph for Thunder
            continue
    return known


def _fold_constants(gm: fx.GraphModule, values: dict[str, torch.Tensor], first: int = 0) -> dict[str, torch.Tensor]:
    """Compute the nodes that depend on no placeholder and no parameter; write numbers into the
    graph and turn tensors into ``get_attr`` inputs labelled ``nvtp_constant_<first + k>``.
    Returns the constant tensors by label."""
    g = gm.graph
    known = _constant_values(g, values)
    constants: dict[str, torch.Tensor] = {}
    for node in list(g.nodes):
        if node not in known or node.op == "get_attr":
            continue
        users = [u for u in node.users if u not in known]
        if not users:
            continue
        value = known[node]
        if isinstance(value, torch.Tensor):
            label = f"nvtp_constant_{first + len(constants)}"
            constants[label] = value.detach()
            gm.register_buffer(label, value.detach().to("meta"))
            with g.inserting_before(node):
                new = g.get_attr(label)
            node.replace_all_uses_with(new)
        elif isinstance(value, (int, float, bool, torch.dtype, torch.device, type(None))) or (
                isinstance(value, (tuple, list)) and all(isinstance(v, (int, float, bool)) for v in value)):
            node.replace_all_uses_with(value)
        # anything else (a tuple holding tensors) stays computed in the graph
    g.eliminate_dead_code()
    gm.recompile()
    return constants


# -- causal masks, for the ring -------------------------------------------------------------------
# transformers' attention passes its causal mask as a tensor (``attn_mask``), built from positions
# (``kv_idx <= q_idx`` of aranges, an all-true padding term when the call passes no
# ``attention_mask``). The ring of a cp axis (``nvtp.sharding.axes.cp``) runs causal or full
# attention only; a mask that depends on no argument and no parameter and whose value is exactly
# the causal pattern ``tril(ones(L, S))`` (booleans, or 0 and -inf) is that attention, so it is
# written ``is_causal=True`` without the mask. Any other mask stays, and the cp axis refuses it.

_SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def is_causal_mask(mask: torch.Tensor, q_len: int, k_len: int) -> bool:
    """Whether ``mask`` (as ``attn_mask`` of attention of ``q_len`` queries on ``k_len`` keys) is
    what ``is_causal=True`` applies: key j visible to query i exactly when j <= i."""
    if mask.ndim < 2 or tuple(mask.shape[-2:]) != (q_len, k_len):
        return False
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril().expand(mask.shape)
    if mask.dtype == torch.bool:
        return torch.equal(mask, causal)
    if not mask.is_floating_point():
        return False
    hidden = mask[~causal]
    return bool((mask[causal] == 0).all()) and bool((torch.isneginf(hidden) | (hidden <= torch.finfo(mask.dtype).min)).all())


def causal_masks(g: fx.Graph) -> int:
    """Rewrite each attention whose mask is the causal pattern computed from positions alone as
    ``is_causal=True`` without a mask (see above); returns how many. The mask's nodes go when no
    one else reads them."""
    known = None
    count = 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        bound = dict(zip(_SDPA_ARGS, node.args)) | dict(node.kwargs)
        mask = bound.get("attn_mask")
        if not isinstance(mask, fx.Node) or bound.get("is_causal"):
            continue
        if known is None:
            known = _constant_values(g, {})
        value, q, k = known.get(mask), _example(bound["query"]), _example(bound["key"])
        if not (isinstance(value, torch.Tensor) and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
            continue
        if not is_causal_mask(value, q.shape[-2], k.shape[-2]):
            continue
        bound.update(attn_mask=None, is_causal=True)
        node.args, node.kwargs = tuple(bound[n] for n in _SDPA_ARGS[:3]), {n: v for n, v in bound.items() if n not in _SDPA_ARGS[:3]}
        count += 1
    for node in reversed(list(g.nodes)):  # the masks' computations no one reads now
        if count and node in known and not node.users and node.op in ("call_function", "call_method"):
            g.erase_node(node)
    return count


def export_program(module: torch.nn.Module, args: tuple, kwargs: dict, *, split_parts: bool = True) -> Program:
    """Capture ``module(*args, **kwargs)`` (a meta-device module and arguments) as one graph; see
    the module docstring. Raises ``GraphBreakError`` when dynamo cannot capture it whole.
    ``split_parts``: fused projections read as parts of different widths become one projection
    per part (``nvtp.frontend.fused``)."""
    start = time.perf_counter()
    exported = export_graph(module, args, kwargs)
    new = exported.module()
    # The model's buffers are state (the model is on meta here): only what depends on nothing folds.
    constants = _fold_constants(new, {})
    new, parts = _split_parts(new) if split_parts else (new, {})
    return Program(new, exported.in_spec, exported.out_spec, exported.arg_names, constants, time.perf_counter() - start, parts=parts)


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
            raise CaptureError(f"{type(module).__name__}: the exported graph reads a tensor that is neither a parameter "
                               f"nor a buffer of the model ({node.target}, {tuple(value.shape)}); nvtp cannot place it")

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
    _functionalize(g, type(module).__name__)
    _linears(g, attrs)
    _decompose(g)
    if ring_claim_active():  # traced for a cp axis: attention masks that are causal, read as is_causal=True
        causal_masks(g)
    return Exported(g, attrs, in_spec, out_spec, leaf_names)


def trace(module: torch.nn.Module, args: tuple, kwargs: dict, *, split_parts: bool = True) -> tuple[Program, Captured]:
    """Export ``module`` (meta) for this call and capture its forward and backward fusions."""
    program = export_program(module, args, kwargs, split_parts=split_parts)
    leaves = pytree.tree_flatten((tuple(args), dict(kwargs)))[0]
    try:
        captured = capture(program.graph_module, *leaves)
    except CaptureError as e:  # Thunder names lines of the generated graph code: name the model's instead
        raise type(e)(_model_lines(program.graph_module, str(e))) from None
    program.output_map = _output_map(captured)
    return program, captured


def _model_lines(gm: fx.GraphModule, message: str) -> str:
    """``<eval_with_key>.5:23`` (a line of the graph module's code) replaced by the model's source
    line the node came from (dynamo's ``stack_trace``)."""
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

    return re.sub(r"<eval_with_key>\.\d+:(\d+)", where, message)


def _output_map(captured: Captured) -> list[Any]:
    """For each leaf the graph returns: which of the forward fusion's user outputs it is, or its constant value."""
    import thunder

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
