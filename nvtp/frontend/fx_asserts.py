"""Checks on values read from the data: proven from the graph and dropped, or refused saying so.

Python's ``assert`` on a value a model reads back from a tensor (XLM's ``get_masks``:
``assert lengths.max().item() <= slen``) is kept by TorchDynamo as a runtime check,
``aten._assert_scalar(cond, msg)`` on a data-dependent integer (``item``). It has no output, and
Thunder cannot run it (``aten::_assert_scalar() Expected a value of type 'number' ... found type
'IntegerProxy'``). Many such checks hold for every input by construction: ``lengths`` is a sum of
16 booleans, so its maximum is at most 16. ``drop_proven`` proves them from the graph alone, by the
range of values each node can take, read from a table of ops (``RANGES``: a comparison gives 0 or
1, a sum of ``n`` values in ``[lo, hi]`` lies in ``[n*lo, n*hi]``, a maximum, an element, a
conversion or ``item`` keeps its input's range), drops each proven check and the nodes only it
read. A check on the data that it cannot prove is refused before Thunder sees it
(``CaptureError`` naming the model's line and the expression), since nvtp compiles one program of
fixed shapes and a value read from a tensor is known only when that program runs. Checks that
read no argument are left to constant folding (``nvtp.frontend.fx_constants``).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.fx as fx

from nvtp.frontend.failures import CaptureError

Range = tuple[float, float]

CHECKS = (torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range.default,
          torch.ops.aten.sym_constrain_range_for_size.default)
_COMPARE = {"lt", "le", "gt", "ge", "eq", "ne"}


def _value(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else node


def _name(node: fx.Node) -> str:
    """The op's name: ``le`` for ``operator.le``, ``torch.le`` and ``x.le(...)``; ``sum`` for ``x.sum``."""
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _same(ranges: dict, node: fx.Node) -> Range | None:
    """A value taken from its first input's values (a maximum, an element, a conversion, ``item``)."""
    return ranges.get(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None


def _sum(ranges: dict, node: fx.Node) -> Range | None:
    """A sum of ``n`` values in ``[lo, hi]``: ``n`` the input's elements over the result's."""
    inner = _same(ranges, node)
    x, out = _value(node.args[0]), _value(node)
    if inner is None or not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or out.numel() == 0:
        return None
    n = x.numel() // out.numel()
    return (min(0, n * inner[0]), max(0, n * inner[1]))


def _compared(ranges: dict, node: fx.Node) -> Range | None:
    """A comparison of tensors is 0 or 1 (a bool tensor)."""
    out = _value(node)
    return (0, 1) if isinstance(out, torch.Tensor) and out.dtype == torch.bool else None


def _tensor_only(rule: Callable) -> Callable:
    """``rule`` where the node's value is a tensor or a number (not a tuple of values and indices)."""
    return lambda ranges, node: rule(ranges, node) if isinstance(_value(node), (torch.Tensor, int, float, torch.SymInt)) else None


# op name -> the range of its result from its inputs' ranges (None: unknown)
RANGES: dict[str, Callable[[dict, fx.Node], Range | None]] = {
    **{name: _compared for name in _COMPARE},
    "sum": _sum,
    **{name: _tensor_only(_same) for name in ("max", "min", "amax", "amin", "_max", "_min", "item", "getitem",
                                              "long", "int", "to", "clone", "contiguous")},
}


def _ranges(g: fx.Graph) -> dict[fx.Node, Range]:
    ranges: dict[fx.Node, Range] = {}
    for node in g.nodes:
        rule = RANGES.get(_name(node)) if node.op in ("call_function", "call_method") else None
        found = rule(ranges, node) if rule else None
        if found is not None:
            ranges[node] = found
    return ranges


def _holds(cond: Any, ranges: dict[fx.Node, Range]) -> bool:
    """Whether the condition ``cond`` (a comparison node) holds for every input, by the ranges."""
    if not isinstance(cond, fx.Node) or _name(cond) not in _COMPARE or len(cond.args) != 2:
        return cond is True
    a, b = (ranges.get(x) if isinstance(x, fx.Node) else (x, x) if isinstance(x, (int, float)) else None for x in cond.args)
    if a is None or b is None:
        return False
    return {"le": a[1] <= b[0], "lt": a[1] < b[0], "ge": a[0] >= b[1], "gt": a[0] > b[1],
            "eq": a[0] == a[1] == b[0] == b[1], "ne": a[1] < b[0] or a[0] > b[1]}[_name(cond)]


def _reads_an_argument(node: fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _erase_unused(node: fx.Node) -> None:
    """Erase ``node`` and then each input it alone read, while they are ops of the range table (pure)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.users or getattr(n, "_erased", False):
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        todo.extend(i for i in inputs if i.op in ("call_function", "call_method") and _name(i) in RANGES)


def drop_proven(g: fx.Graph, model: str) -> int:
    """Drop every check on data (``CHECKS``) that the graph proves (the module docstring); returns how
    many. Raises ``CaptureError`` for one it cannot prove that reads an argument."""
    ranges = _ranges(g)
    dropped = 0
    for node in [n for n in g.nodes if n.op == "call_function" and n.target in CHECKS]:
        if node.target is torch.ops.aten._assert_scalar.default:
            proven = _holds(node.args[0], ranges)
        else:  # sym_constrain_range(x, min=, max=): x within [min, max]
            r = ranges.get(node.args[0])
            lo, hi = node.kwargs.get("min"), node.kwargs.get("max")
            proven = r is not None and (lo is None or r[0] >= lo) and (hi is None or r[1] <= hi)
        if proven:
            _erase_unused(node)
            dropped += 1
        elif _reads_an_argument(node):
            raise CaptureError(_refusal(node, model))
    return dropped


def _refusal(node: fx.Node, model: str) -> str:
    message = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], str) else ""
    expression = m.group(1) if (m := re.search(r"expression (.*) on node", message)) else str(node.args[0])
    frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)', node.meta.get("stack_trace") or "")
    where = f" at {frames[-1][0]}:{frames[-1][1]} (`{frames[-1][2].strip()}`)" if frames else ""
    return (f"{model}.forward checks a value it reads from the data{where}: TorchDynamo keeps it as a runtime check "
            f"({expression}, where u0, u1, ... are values read back from tensors with .item() or .tolist()), which nvtp can "
            "neither prove from the graph nor run: it compiles one program of fixed shapes, and such a value is known only "
            "when the program runs. What to do: compute it without reading it back into Python (a mask instead of a split "
            "by counts, a tensor comparison instead of an assert), or remove the assert if it always holds")


__all__ = ["drop_proven", "RANGES", "CHECKS"]
