"""``nvtp.jit``, the entry point: checks the options, then builds the runtime the plan and the mesh
call for: ``ShardedModule`` (``nvtp.parallel``), ``PipelineModule`` on a mesh with a pp axis
(``nvtp.pipeline.runtime``), or ``AutoModule`` for ``plan="auto"`` (``nvtp.auto.runtime``, which
builds one of the other two). A module of its own, above the three runtimes, so that none of them
imports another through it."""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from nvtp import options
from nvtp.auto.runtime import AutoModule
from nvtp.execute import kernels
from nvtp.execute.collectives import Comm
from nvtp.frontend import user_code
from nvtp.parallel import ShardedModule
from nvtp.pipeline.runtime import PipelineModule
from nvtp.sharding import axes
from nvtp.sharding.placements import DeviceMesh

__all__ = ["jit"]


def jit(module: torch.nn.Module, plan: str | Mapping[str, Any] = "megatron", mesh: DeviceMesh | None = None, *,
        comm: Comm | None = None, dynamic: bool = False, timeout: float | None = 60.0, check_replicas: bool = False,
        frontend: str = "auto", fsdp: bool = False, regional: bool = True, backend: str = "auto",
        overlap: bool = True, collective_matmul: bool | str = "auto", microbatches: int | None = None, schedule: str | None = None,
        cut: Any = None, verify: bool | float = True, compile: str = kernels.DEFAULT, recompute: str = "none", machine: Any = None,
        memory: Any = None, capacity_factor: float | None = None) -> ShardedModule:
    """Shard ``module`` over ``mesh`` (default: every rank of the default process group) by
    ``plan`` ("megatron", "megatron-sp", or an explicit plan); see the module docstring.
    ``dynamic`` compiles again for new argument shapes instead of refusing them. ``timeout``:
    seconds a rank waits for a silent peer before the watchdog stops it (None: no watchdog).
    ``check_replicas``: before each call, check that replicated inputs agree across ranks.
    ``frontend``: how the model is traced: "thunder" (``thunder.jit``), "fx" (TorchDynamo's graph
    of the whole forward, then Thunder: ``nvtp/frontend/fx.py``), or "auto": "fx" for Hugging
    Face transformers models, "thunder" otherwise. ``regional``: a model whose blocks form a chain
    (an ``nn.ModuleList`` of 2 or more blocks alike, each called once in order on the output of
    the one before) is traced as block 0 and the model without its blocks, and the fusions are
    spliced to full depth (``nvtp/frontend/regional.py`` on the "thunder" route,
    ``nvtp/frontend/fx_regional.py`` on the "fx" route: a transformers model's decoder layers;
    ``model.last.traced.how`` says so, or why it traced the model another way); False traces every block. ``backend``: what runs the
    program (``nvtp.execute.backends``): "nvfuser" (nvFuser's kernels; CUDA models), "reference"
    (torch ops and torch.distributed; anywhere), or "auto": nvFuser for a CUDA model where
    nvfuser_direct loads, the reference backend otherwise. A backend that cannot run here is
    refused at once. ``model.last`` is the ``nvtp.program.Program`` of the latest call: what
    ``nvtp.plan`` reports for the same model, mesh and backend. ``overlap`` (default on): the
    program's collectives start as soon as their inputs exist and small ones go together
    (``nvtp.sharding.overlap``); False runs each where it stands, blocking. ``collective_matmul``
    (with ``overlap``): an all-gather before a matmul, or a reduce-scatter after one (Megatron-SP's
    projections), runs as ring steps, each beside one block of the matmul: "auto" (default) where
    the cost model says it pays on the backend's machine (``cost.default_machine``), True
    wherever it applies, False never. ``verify`` (default on): the first call of each compiled
    program is checked against the model run eagerly on the same inputs (outputs, and a sample of
    gradients) and refused with ``nvtp.guard.MiscompileError`` naming the first value that differs
    (``nvtp/guard.py``); False skips it, a number sets the relative tolerance. ``compile``: how the
    reference backend runs each rank's fusions (``nvtp.execute.kernels``): "kernels" (default)
    lowers the groups that have a fused torch kernel (cross-entropy, embedding gradient, layer and
    RMS norm, softmax, GELU, SiLU) to it and runs the rest op by op; "none" runs every op by its
    own implementation. ``recompute``: "none", "selective", "block" (``nvtp.frontend.recompute``).
    On a 2-D mesh ``init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))`` the plan
    shards over "tp" and the batch over "dp": each rank passes its own batch, gradients are
    averaged over dp as DDP does; ``fsdp=True`` also splits the weights over dp (ZeRO-3:
    gathered before use, gradients reduce-scattered), see ``nvtp.sharding.compose``.
    On a mesh with a "pp" axis, ``init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp",
    "dp", "tp"))`` (dp, tp may be absent), the model is cut into pp stages at block boundaries and
    each step runs ``microbatches`` microbatches by ``schedule`` ("1f1b" (default) or "gpipe"); ``cut``: the
    first block of each stage after the first, instead of the balanced cut (``nvtp.pipeline``).
    ``plan="auto"`` (with a ``machine`` and a ``memory`` budget per device): nvtp chooses the
    mesh's axes, FSDP, the plan and the pipeline's options (``nvtp.auto``). ``capacity_factor``
    (a mesh with an "ep" axis): each expert takes at most ceil(capacity_factor x tokens x top_k /
    experts) of each rank's routed tokens, the later ones dropped (``nvtp.sharding.axes.ep``);
    default None: dropless.
    Every option is checked first (``nvtp.options``): one the mesh does not use is refused, never dropped."""
    if isinstance(plan, str) and plan == "auto" or machine is not None or memory is not None:  # the planner's (machine=, memory=)
        return AutoModule.of_jit(locals(), inspect.signature(jit).parameters)
    options.check("jit", module=module, plan=plan, mesh=mesh, comm=comm, dynamic=dynamic, timeout=timeout, check_replicas=check_replicas,
                  frontend=frontend, fsdp=fsdp, regional=regional, backend=backend, overlap=overlap,
                  collective_matmul=collective_matmul, microbatches=microbatches, schedule=schedule, cut=cut, verify=verify,
                  compile=compile, recompute=recompute, capacity_factor=capacity_factor)
    user_code.check_module(module)  # Python randomness in forward, hooks: refused before anything is traced
    if axes.pipelined(mesh):
        return PipelineModule(module, plan, mesh, microbatches=microbatches or 1, schedule=schedule or "1f1b", cut=cut,
                              backend=backend, frontend=frontend, timeout=timeout, verify=verify, compile=compile, recompute=recompute)
    return ShardedModule(module, plan, mesh, comm, dynamic, timeout=timeout, check_replicas=check_replicas, frontend=frontend,
                         fsdp=fsdp, regional=regional, backend=backend, overlap=overlap, collective_matmul=collective_matmul,
                         verify=verify, compile=compile, recompute=recompute, capacity_factor=capacity_factor)
