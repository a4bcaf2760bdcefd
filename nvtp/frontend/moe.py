"""Mixture-of-experts layers as ops nvtp understands: ``gather_mm`` and ``gather_mm_wgrad``.

A top-k MoE layer sends each token to k of E experts and adds their outputs, weighted by the
router. Its experts' matmuls are *gathered*: row s of the layer's [S, K] input (S = tokens x k,
each token once per expert it chose) multiplies the weight of its expert ``index[s]``:

    gather_mm(x[S, K], w[E, K, N], index[S]) -> y[S, N]      y[s] = x[s] @ w[index[s]]
    gather_mm_wgrad(x[S, K], g[S, N], index[S], E) -> [E, K, N]   sum over the rows s of expert e of x[s]^T g[s]

Both are token-wise in S (a sharded batch or sequence splits S and nothing else), so the
sharding rules stay factor rules (``nvtp.sharding.rules``); the grouping by expert (a stable
sort by expert, per-expert counts on the device, a grouped matmul) is how a backend runs them,
with no host synchronisation (``nvtp.execute.moe``). ``gather_mm``'s gradients are a
``gather_mm`` with the weight transposed and a ``gather_mm_wgrad``.

Where the ops come from:

* transformers' experts (every class decorated with ``use_experts_implementation``: Mixtral,
  Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss, ...) are exported with their forward swapped for
  ``experts_forward`` (``gather_mm_experts``), which computes what every experts implementation
  computes (transformers' contract: the implementations are interchangeable), through the torch
  custom op ``nvtp::gather_mm``. So the default ``grouped_mm`` implementation (whose
  ``transformers.grouped_mm_fallback`` Thunder does not know) and ``experts_implementation=
  "eager"`` (a loop over the experts hit, with data-dependent indexing TorchDynamo cannot capture
  as one graph) both become one graph of plain torch ops and ``nvtp::gather_mm``.
* nvtp's own models call ``gather_mm`` (the torch function below) directly.
* Thunder traces ``nvtp::gather_mm`` as an operator of nvtp's executor (``register``), with its
  gradient rule, and the translators write the two IR ops.

A router's ``torch.topk`` is Thunder's ``topk`` prim (IR ``topk``); its gradient, and
``F.one_hot`` of a load-balancing loss, are Thunder's ``scatter_add``, which nvtp writes as a
one-hot sum (nvFuser has no scatter-add): ``numel(index) x size(dim)`` compares, small for a
router's [tokens, k] indices over E experts.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.torch import _torch_to_thunder_function_map
import thunder.torch as ltorch

from nvtp.execute import moe as backend
from nvtp.frontend.translate import TRANSLATORS

# -- the torch ops ---------------------------------------------------------------------------------


_LIBRARY: list[Any] = []
_DEFINING = threading.Lock()  # the ranks of a simulated mesh trace at once, each on its thread


def torch_ops() -> Any:
    """``torch.ops.nvtp`` with ``gather_mm`` and ``gather_mm_wgrad`` defined (once, on first use:
    importing nvtp defines nothing in torch; two threads at once define them once). The lock is
    taken only while they are not defined: ``gather_mm`` calls this inside dynamo's export, which
    cannot enter a lock ("Unsupported context manager": a graph break, every transformers MoE
    family refused); ``gather_mm_experts`` defines them before the export."""
    if not _LIBRARY:
        with _DEFINING:
            _define()
    return torch.ops.nvtp


def _define() -> None:
    if not _LIBRARY:
        lib = torch.library.Library("nvtp", "FRAGMENT")
        _LIBRARY.append(lib)
        lib.define("gather_mm(Tensor x, Tensor w, Tensor index) -> Tensor")
        lib.define("gather_mm_wgrad(Tensor x, Tensor g, Tensor index, int experts) -> Tensor")
        lib.impl("gather_mm", backend.gather_mm, "CompositeExplicitAutograd")
        lib.impl("gather_mm_wgrad", backend.gather_mm_wgrad, "CompositeExplicitAutograd")
        torch.library.register_fake("nvtp::gather_mm", _gather_mm_fake, lib=lib)
        torch.library.register_fake("nvtp::gather_mm_wgrad", _wgrad_fake, lib=lib)
        torch.library.register_autograd("nvtp::gather_mm", _gather_mm_backward, setup_context=_gather_mm_setup, lib=lib)


def _gather_mm_fake(x, w, index):
    return x.new_empty(x.shape[0], w.shape[-1], dtype=torch.promote_types(x.dtype, w.dtype))


def _wgrad_fake(x, g, index, experts):
    return x.new_empty(experts, x.shape[-1], g.shape[-1], dtype=torch.promote_types(x.dtype, g.dtype))


def _gather_mm_setup(ctx, inputs, output):
    x, w, index = inputs
    ctx.save_for_backward(x, w, index)


def _gather_mm_backward(ctx, grad):
    x, w, index = ctx.saved_tensors
    ops = torch.ops.nvtp
    gx = ops.gather_mm(grad, w.transpose(1, 2), index) if ctx.needs_input_grad[0] else None
    gw = ops.gather_mm_wgrad(x, grad, index, w.shape[0]) if ctx.needs_input_grad[1] else None
    return gx, gw, None


def gather_mm(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``y[s] = x[s] @ w[index[s]]`` for ``x [S, K]``, ``w [E, K, N]``, ``index [S]`` (integers in
    [0, E)): the matmul of each row with its expert's weight, differentiable in ``x`` and ``w``."""
    return torch_ops().gather_mm(x, w, index)


# -- transformers' experts -------------------------------------------------------------------------


def is_transformers_experts(module: torch.nn.Module) -> bool:
    """A module of a class transformers decorates with ``use_experts_implementation``: 3-D expert
    weights (``gate_up_proj`` or ``up_proj``, and ``down_proj``) whose forward
    ``(hidden_states, top_k_index, top_k_weights)`` dispatches on ``config._experts_implementation``."""
    down = getattr(module, "down_proj", None)
    return (isinstance(down, torch.Tensor) and down.ndim == 3 and hasattr(module, "has_gate") and hasattr(module, "is_transposed")
            and hasattr(getattr(module, "config", None), "_experts_implementation"))


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward written with ``gather_mm``: what its ``eager``,
    ``batched_mm`` and ``grouped_mm`` implementations compute (gated or not, biases, transposed
    weights, a post-expert norm), in static shapes. Requires ``hidden_states [N, H]``,
    ``top_k_index [N, k]``, ``top_k_weights [N, k]``; returns ``[N, H]``."""
    n, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    rows = hidden_states.unsqueeze(1).expand(n, k, hidden).reshape(n * k, hidden)  # [S, H]: each token once per chosen expert
    index = top_k_index.reshape(n * k)
    up = self.gate_up_proj if self.has_gate else self.up_proj
    out = gather_mm(rows, up if self.is_transposed else up.transpose(1, 2), index)  # [S, (2) I]
    if self.has_bias:
        out = out + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[index]
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)  # [S, I]
    out = gather_mm(out, self.down_proj if self.is_transposed else self.down_proj.transpose(1, 2), index)  # [S, H]
    if self.has_bias:
        out = out + self.down_proj_bias[index]
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(n * k, 1).to(out.dtype)
    return out.reshape(n, k, hidden).sum(dim=1).to(hidden_states.dtype)


@contextlib.contextmanager
def gather_mm_experts(model: torch.nn.Module) -> Iterator[int]:
    """While inside, every transformers experts module of ``model`` runs ``experts_forward``
    (set on the instance, so nothing global changes); yields how many were swapped."""
    swapped = [m for m in model.modules() if is_transformers_experts(m)]
    if swapped:
        torch_ops()  # defined before dynamo traces a call of it
    for m in swapped:
        m.forward = experts_forward.__get__(m)
    try:
        yield len(swapped)
    finally:
        for m in swapped:
            del m.forward


def install_output_hooks(module: torch.nn.Module, kwargs: dict) -> None:
    """transformers records the outputs a call or config asks for (``output_router_logits``, a
    MoE's router logits for its load-balancing loss; ``output_hidden_states``) with forward hooks
    it installs on first use, under a ``threading.Lock`` TorchDynamo cannot enter: install them
    before the export, as transformers' first eager call would (they record only when asked)."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, maybe_install_capturing_hooks  # optional: transformers (pip install nvtp[hf])
    except ImportError:  # another transformers: nothing to install
        return
    for m in module.modules():
        keys = _CAN_RECORD_REGISTRY.get(m) or ()  # transformers 5.17 answers None for a module that records nothing
        config = getattr(m, "config", None)
        if not any(kwargs.get(f"output_{k}") or getattr(config, f"output_{k}", False) for k in keys):
            continue
        # A shallow copy of the model (the regional route's first blocks) shares hooked layers
        # with the model: mark it installed rather than hooking those layers twice.
        if any(getattr(h, "__name__", "") == "output_capturing_hook" for sub in m.modules() for h in sub._forward_hooks.values()):
            m._output_capturing_hooks_installed = True
        maybe_install_capturing_hooks(m)


# -- Thunder -------------------------------------------------------------------------------------

_SYMBOLS: dict[str, Any] = {}


def _gather_mm_meta(x, w, index):
    return TensorProxy(like=x, shape=(x.shape[0], w.shape[-1]))


def _wgrad_meta(x, g, index, experts):
    return TensorProxy(like=x, shape=(experts, x.shape[-1], g.shape[-1]))


def _gather_mm_grad(x, w, index):
    out = _SYMBOLS["gather_mm"](x, w, index)
    g = get_grad(out)
    gx = _SYMBOLS["gather_mm"](g, ltorch.transpose(w, 1, 2), index)
    gw = _SYMBOLS["gather_mm_wgrad"](x, g, index, w.shape[0])
    put_grads((x, w), (gx, gw))
    return out


def register(ex) -> None:
    """Register ``nvtp::gather_mm`` and ``nvtp::gather_mm_wgrad`` as operators of nvtp's executor
    ``ex``, with ``gather_mm``'s gradient rule and the translators to the IR ops; Thunder's
    interpreter then maps calls of the torch ops to them."""
    ops = torch_ops()
    fwd = ex.register_operator("nvtp_gather_mm", meta=_gather_mm_meta)
    wgrad = ex.register_operator("nvtp_gather_mm_wgrad", meta=_wgrad_meta)
    _SYMBOLS.update(gather_mm=fwd, gather_mm_wgrad=wgrad)
    ex.register_supported(fwd, grad_transform=_gather_mm_grad)
    ex.register_supported(wgrad)
    for target, sym in ((ops.gather_mm, fwd), (ops.gather_mm_wgrad, wgrad)):
        _torch_to_thunder_function_map[target] = sym
        _torch_to_thunder_function_map[target.default] = sym
    TRANSLATORS[fwd.id] = lambda b, x, w, index: b.op("gather_mm", x, w, index)
    TRANSLATORS[wgrad.id] = lambda b, x, g, index, experts: b.op("gather_mm_wgrad", x, g, index, experts)
