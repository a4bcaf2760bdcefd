"""dynamo's graph in the forms Thunder traces and nvtp's plans read (the FX route, ``nvtp.frontend.fx``):
torch calls Thunder runs only opaquely written as the calls they compute (``DECOMPOSITIONS``), and
``x @ W.T`` of a 2-D parameter as ``F.linear(x, W)`` (``linears``); torch calls nvtp has no op for
refused before Thunder traces anything (``refuse_lacking``)."""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx

from nvtp.frontend import decompose as decompositions
from nvtp.frontend import mha
from nvtp.frontend.executor import Unclaimed, one_index_as_slice
from nvtp.frontend.failures import MissingOpError, missing_ops_message
from nvtp.frontend.fx_inplace import example


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


def minimum(input, other):
    """``torch.minimum`` as ``-maximum(-a, -b)``: the same values (negation is exact), and the
    gradient of Thunder's ``maximum`` (it has none for ``minimum``): each operand where it is the
    smaller, half each where they tie, as torch's."""
    return -torch.maximum(-input, -other)


def _along(input, largest: bool, dim, keepdim=False):
    """``torch.max(x, dim)`` / ``torch.min(x, dim)``: (values, indices), the index of the first
    extreme along ``dim`` as torch gives it, written with ops nvtp compiles (Thunder has no argmax):
    the extreme (``amax``/``amin``), the least position holding it, and the value read there (so
    the gradient reaches that one position, as torch's does)."""
    n = input.shape[dim]
    best = input.amax(dim, keepdim=True) if largest else input.amin(dim, keepdim=True)
    shape = [1] * input.dim()
    shape[dim] = n
    positions = torch.arange(n, device=input.device).reshape(shape)
    index = torch.where(input == best, positions, n).amin(dim, keepdim=True)
    values = torch.take_along_dim(input, index, dim)
    if not keepdim:
        values, index = values.squeeze(dim), index.squeeze(dim)
    return values, index


def _reduced(input, args, kwargs, largest: bool):
    """The (values, indices) form, or None for the others (the whole tensor's extreme, two tensors)."""
    dim = args[0] if args else kwargs.get("dim")
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None
    keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
    return _along(input, largest, dim, keepdim)


def _min(input, *args, **kwargs):
    """``torch.min(x, other)`` with a tensor ``other`` is ``minimum`` (Apertus's xIELU: ``min(x, eps)``);
    Thunder runs the two-tensor form only opaquely. ``torch.min(x, dim)`` is ``_along``. Any other
    form is torch.min itself."""
    other = args[0] if args else kwargs.get("other")
    if isinstance(other, torch.Tensor):
        return minimum(input, other)
    along = _reduced(input, args, kwargs, largest=False)
    return along if along is not None else torch.min(input, *args, **kwargs)


def _max(input, *args, **kwargs):
    """``torch.max(x, other)`` with a tensor ``other`` is ``torch.maximum``; ``torch.max(x, dim)`` is ``_along``."""
    other = args[0] if args else kwargs.get("other")
    if isinstance(other, torch.Tensor):
        return torch.maximum(input, other)
    along = _reduced(input, args, kwargs, largest=True)
    return along if along is not None else torch.max(input, *args, **kwargs)


DECOMPOSITIONS: dict[Any, Any] = {torch.addmm: _addmm, torch.baddbmm: _baddbmm, torch.min: _min, torch.max: _max, torch.minimum: minimum,
                                  torch.histc: decompositions.histc,  # the load-balancing loss's count (nvtp/frontend/decompose.py)
                                  torch._weight_norm: decompositions.weight_norm,  # torch.nn.utils' weight_norm, both forms
                                  # nn.RMSNorm (DiffLlama's groupnorm): dynamo writes torch.rms_norm, which Thunder 0.2.6
                                  # does not know (NotImplementedError); F.rms_norm, the same call, it decomposes to prims
                                  torch.rms_norm: torch.nn.functional.rms_norm,
                                  **mha.functions(mha.torch_ops()),  # nn.MultiheadAttention (nvtp/frontend/mha.py)
                                  # unbiased= as correction= (nvtp/frontend/decompose.py: xLSTM's norm)
                                  **{getattr(torch, n): f for n, f in decompositions.VARIANCES.items()}}
_METHOD_DECOMPOSITIONS = {"addmm": _addmm, "baddbmm": _baddbmm, "min": _min, "max": _max, "minimum": minimum,
                          "histc": decompositions.histc, **decompositions.CONVERSIONS,  # MoE code's (nvtp/frontend/decompose.py)
                          **decompositions.CREATIONS,  # x.new_zeros(shape) and its kin
                          **decompositions.VARIANCES}  # x.var(unbiased=False) and its kin


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


def linears(g: fx.Graph, attrs: dict[str, Any]) -> int:
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
        ex = example(x)
        if w is None or not isinstance(ex, torch.Tensor) or ex.ndim < 1:
            continue
        node.op, node.target, node.args = "call_function", torch.nn.functional.linear, (x, w)
        count += 1
    return count


def _needless_detach(node: fx.Node) -> bool:
    """``x.detach()`` (or ``torch.detach(x)``) of a value that needs no gradient: the value itself. XGLM's
    sinusoidal positions are a buffer's rows under ``torch.no_grad()``, detached; nvtp has no op for detach, which
    a value needing a gradient keeps (a stop-gradient: refused, ``MissingOpError``)."""
    is_detach = (node.op == "call_method" and node.target == "detach") or (node.op == "call_function" and node.target is torch.detach)
    value = example(node.args[0]) if is_detach and len(node.args) == 1 and not node.kwargs else None
    return isinstance(value, torch.Tensor) and not value.requires_grad


def decompose(g: fx.Graph) -> None:
    for node in list(g.nodes):
        if _needless_detach(node):
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
            continue
        if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
            node.args = (node.args[0], one_index_as_slice(node.args[1]))  # x[..., [k], :] a slice, as on the Thunder route
        if node.op == "call_function" and node.target is torch.cat:
            _skip_empty(node)
        if _bool_compared(g, node):
            continue
        if node.op == "call_function" and node.target in DECOMPOSITIONS:
            node.target = DECOMPOSITIONS[node.target]
        elif node.op == "call_method" and node.target in _METHOD_DECOMPOSITIONS:
            node.op, node.target = "call_function", _METHOD_DECOMPOSITIONS[node.target]


_EQ = {operator.eq, torch.eq, "eq", "__eq__"}
_NE = {operator.ne, torch.ne, "ne", "__ne__"}


def _bool_compared(g: fx.Graph, node: fx.Node) -> bool:
    """``mask == 0`` of a bool tensor (XLM's attention) is ``~mask``, ``mask != 0`` and ``mask == 1`` are
    ``mask``: Thunder compares a bool tensor with a number as int8, which nvFuser has no type for.
    Returns whether ``node`` was rewritten (erased, when it was the mask itself)."""
    if node.op not in ("call_function", "call_method") or len(node.args) != 2 or node.kwargs or node.target not in _EQ | _NE:
        return False
    x, k = node.args
    v = x.meta.get("example_value", x.meta.get("val")) if isinstance(x, fx.Node) else None
    if not (isinstance(v, torch.Tensor) and v.dtype == torch.bool and type(k) in (int, bool) and k in (0, 1)):
        return False
    if (node.target in _NE) == (k == 0):  # mask != 0, mask == 1: the mask itself
        node.replace_all_uses_with(x)
        g.erase_node(node)
    else:
        node.op, node.target, node.args = "call_function", torch.bitwise_not, (x,)
    return True


def _skip_empty(node: fx.Node) -> None:
    """``torch.cat`` skips a 1-D operand with no elements whatever the others' shapes (transformers'
    ``DynamicCache`` starts as ``torch.tensor([])`` and concatenates keys ``[B, H, T, D]`` onto it
    along dim -2: XLM); Thunder refuses the dimension. The operand is left out of the list."""
    def empty(t: Any) -> bool:
        v = t.meta.get("example_value", t.meta.get("val")) if isinstance(t, fx.Node) else None
        return isinstance(v, torch.Tensor) and v.ndim == 1 and v.shape[0] == 0

    tensors = node.args[0] if node.args else None
    if isinstance(tensors, (list, tuple)):
        kept = [t for t in tensors if not empty(t)]
        if kept and len(kept) < len(tensors):
            node.args = (kept, *node.args[1:])


# -- torch calls nvtp has no op for, refused at once -------------------------------------------------
# capture would name them too (MissingOpError), but only after Thunder has traced the whole graph,
# which took 10 minutes and more for the Mamba-like families (their causal conv1d and chunked scans).
LACKING = {torch.conv1d: "convolution", torch.conv2d: "convolution", torch.conv3d: "convolution",
           torch.convolution: "convolution", torch.conv_transpose1d: "convolution", torch.conv_transpose2d: "convolution"}


def refuse_lacking(g: fx.Graph, model: str) -> None:
    """Raises ``MissingOpError`` naming each call of ``LACKING`` in ``g`` with the model's line."""
    found = []
    for node in g.nodes:
        name = LACKING.get(node.target) if node.op == "call_function" else None
        if name:
            frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
            found.append(Unclaimed(name, f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""))
    if found:
        raise MissingOpError(missing_ops_message(model, found, 0, 0))
