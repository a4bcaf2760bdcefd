"""Explain a whole model before you have the machines: the program ``nvtp.jit`` would run, reported.

    report = nvtp.plan(model, idx, targets, plan="megatron", devices=8)     # any module nvtp.jit takes
    report = explain_gpt(gpt.config("gpt3"), layers=96, plan="megatron", devices=8)
    print(report.as_text()); report.as_json()

Both go through the compile driver (``nvtp.driver``), for the backend ``nvtp.jit`` would run the
model on here (or the one asked for), so what is planned is what runs. ``plan`` traces the module
as ``nvtp.jit`` does (a chain of repeated blocks traced as block 0 and the model without its
blocks, then spliced to full depth). ``explain_gpt`` traces one transformer block and the model
without its blocks and counts the block ``layers`` times, as torch.compile's regional compilation
does: exact, because a block's input arrives as the plan places activations and it hands its
output back the same way (tests/test_explain.py checks it against the whole model, figure for
figure). The report is ``nvtp.report.ModelReport``.

On a 2-D (dp, tp) mesh (``mesh=(dp, tp)``, ``fsdp``) the plan runs on tp and the data plan on dp
(nvtp.sharding.compose); every communication names its mesh axis; the traced batch is dp times one
rank's (``batch``, or the config's, or the example arguments'); ``dp_traffic`` sets the dp bytes
against DDP's 2W(dp-1)/dp and FSDP's 3Psi(dp-1)/dp + 2R(dp-1)/dp.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any
from dataclasses import replace
import time

import torch

from nvtp.report import ModelReport, Region, report_of  # noqa: F401 - the report's types, where users found them
from nvtp.sharding import axes
from nvtp.sharding.placements import DeviceMesh
from nvtp import options, pipeline, precheck
from nvtp.errors import InputError
from nvtp.execute import backends, expert_load
from nvtp.frontend import user_code
from nvtp.mesh import make_mesh
from nvtp.models import gpt
from nvtp.sharding.cost import MACHINES
from nvtp.sharding.moe import moe_layers
from nvtp.sharding.plans import check_plan
from nvtp.sharding.target import as_target


# ---------------------------------------------------------------------------------------------
# entry points: every program comes from the compile driver (nvtp.driver)


def _mesh(devices: int | None, mesh: Any, fsdp: bool, default: int) -> DeviceMesh:
    """The mesh to plan for: ``devices`` (1-D) or ``mesh`` ((dp, tp), "DPxTP" or a DeviceMesh), else ``default`` devices."""
    return make_mesh(mesh, devices=devices if devices is not None or mesh is not None else default, fsdp=fsdp)


def _nothing_checks(traced) -> bool:
    """Whether a check against eager stands behind a trace ``plan`` reads from the trace cache: no,
    nothing here runs it (``nvtp.tracecache.trace`` then reads it only while the user's code is unchanged)."""
    return False


def plan(model: torch.nn.Module, *example_args, plan: str = "megatron", devices: int | None = None, backend: str | None = None,
         mesh: "tuple[int, int] | DeviceMesh | None" = None, fsdp: bool = False, regional: bool = True, machine: Any = None,
         collective_matmul: bool | str = "auto", memory: Any = None, compile: str = "kernels",
         capacity_factor: float | None = None, **example_kwargs) -> ModelReport:
    """The program ``nvtp.jit(model, plan=plan, mesh=..., backend=backend)`` runs for these
    arguments, made by the same driver (``nvtp.driver.compile``) on meta tensors (nothing is
    computed, the parameters are not touched), and reported (``ModelReport``): every tensor's
    placement, every communication with its bytes, the memory per rank. ``devices`` (default 2)
    or ``mesh`` = (dp, tp) (the plan on tp, the batch split over dp; ``fsdp`` splits the weights
    over dp too); on a dp mesh ``example_args`` are one rank's batch, as ``nvtp.jit`` takes them.
    ``backend``: the backend to plan for (default: the one ``nvtp.jit`` would run this model on
    here, ``nvtp.execute.backends.default_name``); "nvfuser" plans for GPUs on any machine.
    Takes every model ``nvtp.jit`` takes (the FX route for transformers models included).
    ``machine`` (an ``nvtp.sharding.cost.Machine`` or its name): plan the collective matmuls
    for it (default: the backend's machine, as ``nvtp.jit`` does) and estimate what the schedule
    hides there; ``collective_matmul``: as ``nvtp.jit`` takes it. ``plan="auto"``: the choice of
    ``nvtp.auto.search`` (an ``nvtp.auto.Choice``: the plan, and the candidates ranked) for
    ``mesh`` = N devices (or ``devices``), ``machine`` and a ``memory`` budget per device; the
    example arguments are then the whole batch. ``compile``: as ``nvtp.jit`` takes it, checked by
    the same rule; it says how each rank runs its fusions on the reference backend (torch's fused
    kernels, or op by op), not what they compute or send, so the plan is the same for every value
    (``plan="auto"`` takes it too). ``capacity_factor``: as ``nvtp.jit`` takes it (an "ep" axis's;
    the all-to-all bytes are then the capped buffers')."""
    from nvtp import driver  # lazy: loads Thunder; CLI file commands load this module without it

    if isinstance(plan, str) and plan == "auto":
        from nvtp.auto.search import plan_auto  # lazy: loads Thunder; CLI file commands load this module without it

        options.check("plan", compile=compile)  # the one option auto takes as given (it changes no layout)

        given = {k: v for k, v in locals().items() if k in _CHOSEN and v != _CHOSEN[k]}
        return plan_auto(model, example_args, example_kwargs, devices=devices, mesh=mesh, machine=machine, memory=memory,
                         backend=backend, given=given)
    if memory is not None:
        raise InputError(f"memory={memory!r} is the budget plan='auto' plans for; with plan={plan!r} leave it out")
    options.check("plan", module=model, plan=plan, devices=devices, backend=backend or "auto", mesh=mesh, fsdp=fsdp, regional=regional,
                  machine=machine, collective_matmul=collective_matmul, compile=compile, capacity_factor=capacity_factor,
                  **options.pipeline_options(model, example_kwargs))
    user_code.check_module(model)  # Python randomness in forward, hooks: what nvtp.jit refuses, refused here too
    if mesh is not None and axes.pipelined(mesh):  # a (pp, dp, tp) mesh: the pipeline's program (nvtp.pipeline.PipelineProgram)
        pipelined = {k: example_kwargs.pop(k) for k in ("microbatches", "schedule", "cut") if k in example_kwargs}
        return pipeline.plan(model, *example_args, plan=plan, mesh=mesh, backend=backend or "reference", **pipelined,
                             **example_kwargs)
    mesh = _mesh(devices, mesh, fsdp, 2)
    if backend is None:
        backend = backends.default_name(next((p.device.type for p in model.parameters()), "cpu"))
    backends.resolve(backend, run=False)
    args, kwargs = driver.bind_call(model, driver.route(model), example_args, example_kwargs)
    precheck.check_call(model, mesh, args, kwargs)  # what the arguments already tell, before tracing
    program = driver.compile(model, *args, plan=plan, mesh=mesh, backend=backend, fsdp=fsdp, regional=regional,
                             machine=machine, collective_matmul=collective_matmul,
                             axis_options={} if capacity_factor is None else {"capacity_factor": capacity_factor},
                             cached=_nothing_checks,  # read from the trace cache while the user's code is unchanged
                             **kwargs)
    batch = ""
    if mesh.ndim > 1 and example_args and isinstance(example_args[0], torch.Tensor) and example_args[0].ndim:
        batch = f"traced batch = dp x each rank's batch (the example arguments') = {axes.extent(mesh, 'splits_batch')} x {example_args[0].shape[0]}"
    t = axes.extent(mesh, "runs_plan")
    report = report_of(program, type(model).__name__, batch=batch, shape=_transformer_shape(model, args, kwargs, t))
    report.machine = _machine(machine)
    _count_expert_load(report, program, model, args, kwargs)
    return report


def _count_expert_load(report: ModelReport, program: Any, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The example batch's tokens per expert, per rank (``nvtp.execute.expert_load``), on a model
    with MoE layers: one unsharded forward on the example arguments (on a dp mesh, every dp rank
    passing them)."""
    if not moe_layers(program.source.forward):
        return
    why = expert_load.not_computed(model, args, kwargs)
    if why:
        report.expert_load_note = f"not counted: {why}"
        return
    if axes.batch_axis(program.mesh) is not None:  # the program is the whole step's: the dp ranks' batches
        report.expert_load_note = "every data-parallel rank passing the example arguments"
    try:
        report.expert_load = expert_load.of_batch(program, model, args, kwargs)
    except Exception as e:  # noqa: BLE001 - the plan stands without the counts; the report says why they are missing
        report.expert_load_note = f"not counted: running the forward on the example batch failed ({type(e).__name__}: {e})"


_AUTO_TAKES = ("model", "example_args", "plan", "devices", "backend", "mesh", "machine", "memory", "compile", "example_kwargs")
_CHOSEN = {k: p.default for k, p in inspect.signature(plan).parameters.items() if k not in _AUTO_TAKES}  # what plan="auto" chooses

def _machine(machine: Any):
    return MACHINES[machine] if isinstance(machine, str) else machine


def _transformer_shape(model: torch.nn.Module, args: tuple, kwargs: dict, tp: int) -> dict[str, int]:
    """s, b, h, a, t, L of a transformers model for Korthikanti et al.'s formula: hidden size, heads
    and layers from its config, batch and sequence from its token ids (one rank's); {} for other models."""
    config = getattr(model, "config", None)
    h, a, layers = (getattr(config, k, None) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers"))
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not all(isinstance(x, int) for x in (h, a, layers)) or not isinstance(ids, torch.Tensor) or ids.ndim != 2 \
            or ids.dtype.is_floating_point:
        return {}
    return {"s": ids.shape[1], "b": ids.shape[0], "h": h, "a": a, "t": tp, "L": layers}


def explain_gpt(cfg, *, layers: int, plan: str = "megatron", devices: int | None = None, dtype: torch.dtype = torch.bfloat16,
                backend: str = "nvfuser", regional: bool = True, mesh: "tuple[int, int] | DeviceMesh | None" = None,
                fsdp: bool = False, batch: int | None = None, machine: Any = None,
                collective_matmul: bool | str = "auto") -> ModelReport:
    """nvtp's GPT with ``cfg`` at ``layers`` layers, traced on meta tensors, on ``devices``
    devices (default 8) or ``mesh`` = (dp, tp) (``fsdp``: weights split over dp too), for
    ``backend`` (default nvFuser: a model of this size is planned for GPUs). ``batch`` is each
    rank's batch (default the config's); on a dp mesh the traced batch is dp times it.
    ``regional`` (the default) traces one block and the model without blocks through the compile
    driver, and counts the block ``layers`` times: exact, because a block's input arrives as the
    plan places activations and it hands its output back the same way (the program ``nvtp.jit``
    splices to full depth has the same placements and steps: tests/test_driver.py);
    ``regional=False`` traces the whole model (seconds a layer). ``machine``: as ``plan`` takes it."""
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch={batch!r}: each rank's batch must be a positive integer")
    check_plan(plan, [])  # a misspelt plan name, before any tracing
    mesh = _mesh(devices, mesh, fsdp, 8)
    dp, tp = axes.extent(mesh, "splits_batch"), axes.extent(mesh, "runs_plan")
    per_rank = batch or cfg.batch
    cfg = replace(cfg, batch=per_rank * dp)
    start = time.perf_counter()
    shape = {"s": cfg.seq_len, "b": per_rank, "h": cfg.n_embd, "a": cfg.n_head, "t": tp, "L": layers}
    name = f"GPT ({layers} layers, hidden {cfg.n_embd}, {cfg.n_head} heads, sequence {cfg.seq_len}, batch {cfg.batch}, {str(dtype).replace('torch.', '')})"
    extra = {"backend": backend} | ({"machine": _machine(machine)} if machine is not None else {})
    ring = axes.trace_options(mesh, plan)["ring"]  # attention claimed whole, for a ring (a cp axis)
    flash = as_target(backend).flash_attention  # or for the backend's flash kernels
    if not axes.plain(mesh):
        extra |= {"mesh": mesh, "data": axes.data_mode(fsdp),
                  "batch": f"traced batch {cfg.batch} = dp {dp} x {per_rank} per rank ({'--batch' if batch else 'the config' + chr(39) + 's batch'})"}
    if not regional:
        whole = _shard_gpt(_trace_gpt(cfg, layers, dtype, ring, flash), plan, mesh, backend, fsdp, machine, collective_matmul)
        traced = time.perf_counter() - start
        return ModelReport(name, plan, mesh.size, [Region("model", 1, whole.forward, whole.backward, whole.schedules)],
                           {"trace": traced, "shard": whole.seconds["shard"]}, shape, notes=whole.notes, **extra)
    outer_t, block_t = _trace_gpt(cfg, 0, dtype, ring, flash), _trace_gpt(cfg, None, dtype, ring, flash)
    traced = time.perf_counter() - start
    outer, block = (_shard_gpt(t, plan, mesh, backend, fsdp, machine, collective_matmul) for t in (outer_t, block_t))
    regions = [Region("outer", 1, outer.forward, outer.backward, outer.schedules),
               Region("block", layers, block.forward, block.backward, block.schedules)]
    return ModelReport(name, plan, mesh.size, regions, {"trace": traced, "shard": time.perf_counter() - start - traced}, shape,
                       notes=outer.notes + [f"block: {n}" for n in block.notes], **extra)


def _shard_gpt(traced, plan: str, mesh: DeviceMesh, backend: str, fsdp: bool, machine: Any = None,
               collective_matmul: bool | str = "auto"):
    from nvtp import driver  # lazy: loads Thunder; CLI file commands load this module without it

    return driver.shard(traced, plan, mesh, backend, fsdp=fsdp, machine=machine, collective_matmul=collective_matmul)


@functools.lru_cache(maxsize=8)
def _trace_gpt(cfg, n_layer: int | None, dtype: torch.dtype, ring: bool = False, flash: bool = False):
    """The traced fusions of GPT(cfg) with ``n_layer`` layers, or of one Block (None: its output
    is the next block's input, so no module boundary), on meta tensors; kept, so that
    explaining several plans traces once. ``ring``, ``flash``: as ``driver.trace`` takes them."""
    from nvtp import driver  # lazy: loads Thunder; CLI file commands load this module without it

    with torch.device("meta"):
        if n_layer is None:
            block = gpt.Block(cfg).to(dtype)
            return driver.trace(block, (gpt.example_input(cfg, dtype=dtype, device="meta"),), regional=False, boundary=False,
                                ring=ring, flash=flash)
        model = gpt.GPT(replace(cfg, n_layer=n_layer)).to(dtype)
    tokens = tuple(torch.zeros(cfg.batch, cfg.seq_len, dtype=torch.long, device="meta") for _ in range(2))
    return driver.trace(model, tokens, regional=False, ring=ring, flash=flash)
