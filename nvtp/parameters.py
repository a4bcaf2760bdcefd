"""How the parameters of an nvtp module are held. ``nvtp.jit`` replaces each by a DTensor
parameter (``replace_parameter``; an optimizer made before holds the old object and is pointed at
the new one before its first step: ``retarget``). A plain tensor holding this rank's part (the
Thunder transform's) is recorded by ``hold_part``, so ``full_tensor`` gathers it, and its gradient,
whole."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary
from torch.optim.optimizer import register_optimizer_step_pre_hook

from nvtp import dtensor as _dt
from nvtp.errors import InputError
from nvtp.execute import spmd
from nvtp.execute.collectives import Comm, DistComm, MeshComm
from nvtp.sharding.placements import Placement, axis_split

# Each parameter of an nvtp.jit module -> (placement, whole shape, comm), for full_tensor; weak,
# so a module and its parameters are freed as usual (the entry holds no reference to either).
_PLACED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


# A parameter replaced by its DTensor form at the first call -> that DTensor parameter. An optimizer
# made before the first call holds the old objects: before its first step it is pointed at the new
# ones (``_retarget_optimizer``; torch's swap_tensors cannot turn a Parameter into a DTensor in place).
_REPLACED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
_RETARGET_HOOK: list = []


def replace_parameter(root: torch.nn.Module, old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
    """Put ``new`` wherever ``root`` holds ``old`` (every owner of a tied parameter)."""
    for module in root.modules():
        for attr, q in list(module._parameters.items()):
            if q is old:
                module._parameters[attr] = new
    retarget(old, new)


def retarget(old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
    """An optimizer holding ``old`` steps ``new`` instead (it is pointed at ``new`` before its first step)."""
    _REPLACED[old] = new
    if not _RETARGET_HOOK:  # installed on the first replacement, not on import
        _RETARGET_HOOK.append(register_optimizer_step_pre_hook(_retarget_optimizer))


def _retarget_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Before a step: swap parameters nvtp.jit replaced by DTensors for their replacements."""
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            new = _REPLACED.get(p)
            if new is None:
                continue
            if p in optimizer.state:
                raise InputError(f"{type(optimizer).__name__} holds state for a parameter that nvtp.jit has since made a DTensor "
                                 "(it stepped before the module's first call); make the optimizer after model.compile(*inputs)")
            if p.grad is not None and new.grad is None:  # DCP's _init_optim_state gave the old one zeros: so does the new
                new.grad = torch.zeros_like(new)
            params[i] = new


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter of an ``nvtp.jit`` module, or of its gradient (a collective:
    every rank calls it). A DTensor's is ``t.full_tensor()``; a plain tensor not of an nvtp module is itself."""
    if isinstance(t, _dt.DTensor):
        return t.full_tensor().detach().clone()
    owner = _PLACED.get(t)
    if owner is None:
        owner = next((o for p, o in list(_PLACED.items()) if p.grad is t), None)
    if owner is None:
        return t
    return gather(t, *owner)


def on_process_group(comm: Comm | None, size: int) -> bool:
    """Whether a runtime on ``comm`` (None: the default group's) over ``size`` devices holds its
    parameters as DTensors: on torch.distributed's own groups, not a simulated ``comm`` (ranks as
    threads) and not one process. ``nvtp.jit`` and ``nvtp.ShardingTransform`` decide alike."""
    on_groups = comm is None or isinstance(comm, DistComm) or (
        isinstance(comm, MeshComm) and all(isinstance(c, DistComm) for c in comm.axes))
    return size > 1 and on_groups and dist.is_available() and dist.is_initialized()


def place(p: torch.nn.Parameter, part: torch.Tensor, placement: Placement | tuple, shape: tuple[int, ...],
          comm: Comm | None, torch_mesh=None) -> torch.nn.Parameter:
    """Parameter ``p`` made this rank's ``part`` of it (whole ``shape``, placed ``placement``, one per
    axis of ``torch_mesh``): a new DTensor parameter on ``torch_mesh`` (an optimizer holding ``p`` is
    pointed at it; ``nvtp.jit``, the Thunder transform and pipelines alike), or, with no torch mesh,
    ``p`` itself holding the part as a plain tensor whose ``comm`` gathers it (``hold_part``).
    Returns the parameter."""
    if torch_mesh is not None:
        new = torch.nn.Parameter(_dt.as_dtensor(part, placement, torch_mesh, shape), requires_grad=p.requires_grad)
        retarget(p, new)
        return new
    with torch.no_grad():
        p.data = part
    hold_part(p, placement, shape, comm)
    return p


def hold_part(p: torch.Tensor, placement: Placement, shape: tuple[int, ...], comm: Comm) -> None:
    """Record that plain tensor ``p`` holds this rank's part (``placement``) of a parameter of
    ``shape`` on ``comm``'s ranks, so that ``full_tensor`` gathers it (and its gradient) whole."""
    _PLACED[p] = (placement, tuple(shape), comm)


def gather(t: torch.Tensor, placement: Placement, shape: tuple[int, ...], comm: Comm) -> torch.Tensor:
    """The whole tensor of which ``t`` is this rank's part (a collective on ``comm``: every rank calls it)."""
    if axis_split(placement) is None:
        return t.detach().clone()
    parts = comm.all_gather(t.detach().contiguous())
    return spmd.assemble(parts, placement, shape)
