"""The gradient of ``amax`` and ``amin`` as torch computes it: shared evenly among tied elements.

Thunder's rule (``thunder.core.transforms.grad_chooser_backward``) divides the gradient by the
number of elements holding the extreme, but counts them with ``prims.sum`` of a boolean mask,
whose result keeps the mask's dtype: the count is ``True`` (1) however many elements tie, so each
tied element receives the whole gradient instead of its share (torch's ``amax`` backward,
``scale_grad_by_count``). A max over ``torch.cat([p, p])`` then doubles ``p``'s gradient. nvtp's
executor gives ``prims.amax`` and ``prims.amin`` this rule instead, counting in the gradient's dtype,
on every route that traces through Thunder (the FX route included): only programs nvtp compiles
see it. Where every element is distinct the two rules agree.
"""

from __future__ import annotations

from typing import Callable, Sequence

from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grad, restore_reduced_dims


def _rule(extreme: Callable) -> Callable:
    def grad(a: TensorProxy, /, dims: Sequence[int]) -> TensorProxy:
        out = extreme(a, dims)
        g = get_grad(out)
        at = prims.convert_element_type(a == restore_reduced_dims(out, dims, a.shape), g.dtype)
        count = restore_reduced_dims(prims.sum(at, dims), dims, a.shape)
        put_grad(a, restore_reduced_dims(g, dims, a.shape) * at / count)
        return out

    return grad


def register(ex) -> None:
    """Give ``prims.amax`` and ``prims.amin``, which nvtp's executor ``ex`` already claims (with
    their checkers), torch's gradient."""
    for prim in (prims.amax, prims.amin):
        ex.register_supported(prim.id, ex.implmap[prim.id].checker, grad_transform=_rule(prim))
