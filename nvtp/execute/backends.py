"""The backend seam: what a ``Program`` runs on.

    backend = resolve("auto", device="cuda")       # nvFuser where it can run, else the reference backend
    backend.target                                 # the facts the sharding passes shard for (nvtp.sharding.target)
    run = backend.lower(program, comm)             # this rank's runner of the program's fusions
    outputs = run("forward", inputs, seed=seed)    # this rank's shards in, this rank's shards out

A backend owns its target's facts and lowers a ``Program`` to something that runs the program's
steps as given: each ``set`` op does what its ``ReshardStep`` says (the reference backend's
``_set``; nvFuser's multidevice executor lowers the same ``set`` ops it reads from the
definition), never a collective worked out again. Two backends sit behind the seam:

* ``reference``: torch ops lowered to a torch.fx module per fusion and mesh position, collectives
  by torch.distributed (or a simulated ``Comm``); runs anywhere, CPU gloo meshes included.
* ``nvfuser``: nvfuser_direct's ``FusionDefinition`` of each fusion (with its device schedule on
  a mesh of several ranks: nvFuser's multidevice executor, one process per GPU), built once per
  rank and fusion, executed on the rank's GPU. Needs CUDA.

``resolve`` refuses, in one line and before any work, a backend that cannot run here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from nvtp.sharding import axes
from nvtp.errors import InputError
from nvtp.sharding.target import TARGETS, Target

if TYPE_CHECKING:  # pragma: no cover
    from nvtp.execute.collectives import Comm
    from nvtp.program import Program

# One rank's runner of a program: (phase, this rank's inputs of that phase's fusion, seed) -> outputs.
Runner = Callable[..., list[Any]]


@dataclass(frozen=True)
class Backend:
    name: str
    target: Target
    describe: str

    def check(self, device: str) -> None:
        """Raise ``InputError`` if this backend cannot run a model whose parameters are on ``device``."""

    def lower(self, program: "Program", comm: "Comm", *, compile: str = "kernels") -> Runner:
        """This rank's runner of ``program``; ``compile`` (``nvtp.execute.kernels.MODES``): how the
        reference backend runs a rank's fusions (nvFuser compiles its own)."""
        raise NotImplementedError


# -- the reference backend -------------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceBackend(Backend):
    def lower(self, program: "Program", comm: "Comm", *, compile: str = "kernels") -> Runner:
        from nvtp.execute import reference  # lazy: kept off nvtp --help's path

        kernels = compile != "none"  # "none": every op by its own implementation
        inductor = compile in ("inductor", "auto")  # "auto": reference.run decides (nvtp/execute/precompile.py)
        phases = dict(program.phases())
        rings = ring_attentions(program.steps(), program.mesh)

        def run(phase: str, inputs: Sequence[Any], *, seed: int = 0, log: list | None = None, take: bool = False) -> list[Any]:
            sharded = phases[phase]
            out = reference.run(sharded.fusion, inputs, shardings=sharded.shardings, mesh=sharded.mesh, comm=comm, seed=seed,
                                log=log, steps=sharded.set_steps, schedule=program.schedules.get(phase), rings=rings.get(phase),
                                compiled=kernels, axis_options=sharded.options, inductor=inductor, ahead=compile == "auto",
                                take=take)
            if inductor:  # the first call's report: what compiling took (nvtp/execute/inductor.py)
                program.seconds["compile"] = sum(reference.compiled_pieces(s.fusion)["seconds"] for _, s in phases.items())
            return out

        return run


def ring_attentions(steps, mesh) -> dict[str, dict[str, int]]:
    """phase -> {op (its first result) -> mesh axis index} of the ops that run their own
    exchanges among ``steps`` (``Program.steps()``): cp's ring attentions (a collective matmul's
    ring is not one) and ep's dispatched experts (their all-to-alls)."""
    out: dict[str, dict[str, int]] = {}
    for s in steps:
        if (s.kind == "sendrecv" and not s.ring) or s.kind == "alltoall":
            out.setdefault(s.phase, {})[s.value] = mesh.names.index(s.axis)
    return out


# -- the nvFuser backend ---------------------------------------------------------------------


def nvfuser_loads() -> str | None:
    """None if nvfuser_direct imports here, else why not (one line)."""
    try:
        import nvfuser_direct  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to load means: not here
        return f"nvfuser_direct does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


@dataclass(frozen=True)
class NvFuserBackend(Backend):  # compile= is the reference backend's: nvFuser fuses and compiles each fusion itself
    def check(self, device: str) -> None:
        if not torch.cuda.is_available():
            raise InputError("backend='nvfuser' runs nvFuser's kernels on CUDA GPUs, and torch sees none on this machine "
                             "(torch.cuda.is_available() is False); use backend='reference' (or 'auto') to run here, "
                             "or nvtp.plan(..., backend='nvfuser') / nvtp explain --backend nvfuser to plan for GPUs")
        why = nvfuser_loads()
        if why is not None:
            raise InputError(f"backend='nvfuser': {why}; install nvFuser (the nvfuser-cu128-torch210 wheel nvtp pins) or "
                             "use backend='reference'")
        if device != "cuda":
            raise InputError(f"backend='nvfuser' runs on CUDA tensors, and the model's parameters are on {device}; "
                             "move the model with model.to('cuda') before nvtp.jit, or use backend='reference'")

    def lower(self, program: "Program", comm: "Comm", *, compile: str = "kernels") -> Runner:
        axes.check(program.mesh, backend=self.name)  # an axis nvFuser does not run (cp's ring: no point-to-point step in a fusion)
        from nvtp.execute import nvfuser  # optional: nvfuser_direct (the nvFuser backend only)
        from nvtp.sharding.schedule import schedule_steps  # lazy: kept off nvtp --help's path

        built: dict[str, Any] = {}
        multi = program.mesh.size > 1
        rank = comm.rank
        if multi:
            import nvfuser_direct  # optional: nvfuser_direct (the nvFuser backend only)

            world = nvfuser_direct.multidevice.Communicator.instance().size()
            if world != program.mesh.size:
                raise InputError(f"nvFuser's multidevice Communicator sees {world} process(es), the mesh {program.mesh.size}; "
                                 "launch one process per GPU with torchrun or mpirun (nvFuser reads RANK / WORLD_SIZE, or "
                                 "OMPI_COMM_WORLD_*), or run the mesh on backend='reference'")
            if torch.cuda.device_count() < program.mesh.size:
                raise InputError(f"nvFuser's multidevice executor runs one rank per GPU: the mesh has {program.mesh.size} ranks "
                                 f"and this machine {torch.cuda.device_count()} GPU(s); use a mesh of at most "
                                 f"{torch.cuda.device_count()}, or backend='reference'")
        device = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
        phases = dict(program.phases())

        def run(phase: str, inputs: Sequence[Any], *, seed: int = 0, log: list | None = None, take: bool = False) -> list[Any]:
            sharded = phases[phase]
            fd = built.get(phase)
            if fd is None:  # once per rank and fusion
                fd = built[phase] = nvfuser.build_definition(sharded.fusion, schedule_steps(sharded) if multi else ())
            prepared = nvfuser.prepare_inputs(sharded.fusion, inputs, device)
            if take:  # the caller's list: nvFuser holds what it reads until the fusion ends
                inputs.clear()
            outputs = fd.execute(prepared) if multi else fd.execute(prepared, device=device)
            return nvfuser.as_declared(sharded.fusion, list(outputs))

        return run


REFERENCE = ReferenceBackend("reference", TARGETS["reference"],
                             "torch ops and torch.distributed collectives (any device, CPU gloo meshes included)")
NVFUSER = NvFuserBackend("nvfuser", TARGETS["nvfuser"],
                         "nvFuser's FusionDefinitions (multidevice on a mesh of GPUs)")
BACKENDS: dict[str, Backend] = {b.name: b for b in (REFERENCE, NVFUSER)}
CHOICES = ("auto", *BACKENDS)


def default_name(device: str = "cpu") -> str:
    """The backend ``auto`` picks for a model on ``device``: nvFuser for CUDA models where
    nvfuser_direct loads and a GPU is visible, the reference backend otherwise."""
    if device == "cuda":
        if torch.cuda.is_available() and nvfuser_loads() is None:
            return "nvfuser"
    return "reference"


def resolve(name: str, device: str = "cpu", *, run: bool = True) -> Backend:
    """The backend ``name`` ("auto", "reference", "nvfuser") for a model on ``device``; with
    ``run`` (nvtp.jit) it must be able to run here, else ``InputError`` says why and what to use.
    Planning (``run=False``) for any backend works anywhere."""
    if name == "auto":
        name = default_name(device)
    backend = BACKENDS.get(name)
    if backend is None:
        raise InputError(f"unknown backend {name!r}; choose one of {', '.join(map(repr, CHOICES))}")
    if run:
        backend.check(device)
    return backend


__all__ = ["Backend", "BACKENDS", "CHOICES", "REFERENCE", "NVFUSER", "resolve", "default_name", "nvfuser_loads"]
