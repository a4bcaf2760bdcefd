"""What in dynamo's graph depends on no argument and no parameter, computed once (the FX route, ``nvtp.frontend.fx``).

Position ids, causal masks and transformers' packed-sequence check are folded: constant tensors
become inputs labelled ``nvtp_constant_N`` (replicated), constant numbers are written into the
graph (``fold_constants``). A cp axis reads a folded causal mask as ``is_causal=True``
(``causal_masks``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from nvtp.frontend.fx_inplace import example, updates_in_place


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


def constant_values(g: fx.Graph, values: dict[str, torch.Tensor]) -> dict[fx.Node, Any]:
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


def fold_constants(gm: fx.GraphModule, values: dict[str, torch.Tensor], first: int = 0) -> dict[str, torch.Tensor]:
    """Compute the nodes that depend on no placeholder and no parameter; write numbers into the
    graph and turn tensors into ``get_attr`` inputs labelled ``nvtp_constant_<first + k>``.
    Returns the constant tensors by label."""
    g = gm.graph
    known = constant_values(g, values)
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
    g.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or updates_in_place(n))  # a write's result may go unread
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
            known = constant_values(g, {})
        value, q, k = known.get(mask), example(bound["query"]), example(bound["key"])
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
