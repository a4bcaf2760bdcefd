"""In-place updates in dynamo's graph, written out of place (the FX route, ``nvtp.frontend.fx``)."""

from __future__ import annotations

import inspect
import operator
import re
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from nvtp.frontend.capture import CaptureError


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


def example(node: Any) -> Any:
    """dynamo's fake value of ``node`` (a tensor with its shape, dtype and storage), or None."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _storage(node: Any) -> int | None:
    value = example(node)
    if isinstance(value, torch.Tensor):
        try:
            return value.untyped_storage()._cdata
        except Exception:  # noqa: BLE001 - a tensor without storage (sparse, nested): no alias facts
            return None
    return None


def _out_of_place(node: fx.Node) -> tuple[str, Any, dict] | None:
    """(op, target, kwargs) of the out-of-place form of an in-place ``node``, or None if it is none."""
    if not node.args or not isinstance(example(node.args[0]), torch.Tensor):
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


def updates_in_place(node: fx.Node) -> bool:
    """Whether ``node`` writes into a tensor it reads (``x.copy_(y)``, ``x.add_(y)``, ``x += y``,
    ``x[i] = y``, ``F.relu(x, inplace=True)``): its effect is the write, whether or not its result
    is read, so dead-code elimination must keep it. torch.fx's own ``Node.is_impure`` calls every
    ``call_method`` pure, so ``key[..., :d].copy_(k_nope)`` of a tensor filled through views (HY-V4's
    ``expand_kv``), whose result nobody reads, would be dropped and the tensor left unfilled."""
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        if node.target in _INPLACE_OPERATORS or node.target is operator.setitem:
            return True
        if node.kwargs.get("inplace") is True or _inplace_positional(node):
            return True
        name = getattr(node.target, "__name__", "")
    else:
        return False
    return isinstance(name, str) and name.endswith("_") and not name.startswith("_")


def _node_line(node: fx.Node) -> str:
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', node.meta.get("stack_trace") or "")
    if not frames:
        return f"node {node.name}"
    path, line, fn, text = frames[-1]
    return f"{path}:{line} in {fn}: `{text.strip()}`"


def copies_into_items(g: fx.Graph) -> int:
    """Write each ``x[key].copy_(src)`` as ``x[key] = src`` (``operator.setitem``), which is what it
    does (``src`` broadcast to ``x[key]``'s shape, cast to its dtype, written into ``x``), and which
    Thunder functionalizes into a ``copy_with_setitem`` of ``x`` that nvtp writes for keys of
    integers, slices and an ellipsis (``nvtp.frontend.setitem``); a ``copy_`` into a view Thunder
    leaves as a write through the view, which no fusion can do. Only where the item is read by
    nothing else; a read of the copy's result reads ``x[key]`` again where it is read, as eager's
    view would (later writes into ``x`` included). Returns how many were rewritten."""
    rewritten = 0
    for node in list(g.nodes):
        if not (node.op == "call_method" and node.target == "copy_" and len(node.args) == 2 and not node.kwargs):
            continue
        item, src = node.args
        if not (isinstance(item, fx.Node) and item.op == "call_function" and item.target is operator.getitem
                and list(item.users) == [node] and _storage(item) is not None and _storage(item) == _storage(item.args[0])):
            continue
        base, key = item.args
        with g.inserting_before(node):
            write = g.call_function(operator.setitem, (base, key, src))
        write.meta = {k: v for k, v in node.meta.items() if k != "example_value"}
        for user in list(node.users):  # the view read where it is read: what eager's view holds then
            with g.inserting_before(user):
                again = g.call_function(operator.getitem, (base, key))
            again.meta = dict(item.meta)
            user.replace_input_with(node, again)
        g.erase_node(node)
        g.erase_node(item)
        rewritten += 1
    return rewritten


def functionalize(g: fx.Graph, model: str) -> int:
    """Write each in-place update out of place (see above), a copy into an item as a setitem
    (``copies_into_items``); returns how many were rewritten."""
    rewritten = copies_into_items(g)
    order = {n: i for i, n in enumerate(g.nodes)}
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
        if keep_dtype(g, node, base):
            order = {n: i for i, n in enumerate(g.nodes)}
        rewritten += 1
    return rewritten


def keep_dtype(g: fx.Graph, node: fx.Node, base: fx.Node) -> bool:
    """An in-place result keeps the updated tensor's dtype; the out-of-place op may promote (an int
    tensor += a float): cast back where it would, computed on dynamo's fake values."""
    want = example(base).dtype
    fake = detect_fake_mode([example(base)])
    if fake is None:
        return False
    try:
        with fake:
            args = fx.node.map_arg(node.args, example)
            kwargs = fx.node.map_arg(node.kwargs, example)
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
