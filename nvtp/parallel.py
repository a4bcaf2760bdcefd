"""``nvtp.jit``'s module (``nvtp.entry.jit`` builds it): a module whose forward and backward run sharded
fusions on a mesh.

    model = nvtp.jit(GPT(cfg), plan="megatron")          # after torch.distributed.init_process_group
    loss = model(idx, targets); loss.backward(); opt.step()

On the first call nvtp traces the module with ``thunder.jit`` and nvtp's executor (on meta
tensors: the parameters are not touched), shards the forward and backward fusions with the plan,
and makes every parameter a ``torch.distributed.tensor.DTensor`` on torch's ``DeviceMesh``
(``Shard(dim)`` when split, ``Replicate()`` otherwise; the fused QKV's inner split is
``nvtp.dtensor.FusedShard``), so each rank holds 1/d of a split weight. An optimizer made before
the first call holds the old parameter objects; it is pointed at the DTensor ones before its
first step (``_retarget_optimizer``). Calls run the sharded forward fusion on the reference backend with torch.distributed
collectives inside a ``torch.autograd.Function`` whose backward runs the sharded backward fusion;
gradients are DTensors placed like their parameters, so ``torch.optim``,
``torch.nn.utils.clip_grad_norm_`` and ``torch.distributed.checkpoint`` work as on any DTensor
model, and ``p.full_tensor()`` gives a parameter or gradient whole. On a simulated mesh (``comm=``,
ranks as threads in one process: no process group, so no DTensor) parameters are plain tensors
holding this rank's part, and ``nvtp.full_tensor(t)`` gathers them whole (it also takes DTensors).

Inputs and outputs at the module's boundary are whole tensors on every rank (each rank slices
what its shards need; outputs and the gradients of inputs are gathered or reduced to whole).
Bad input is refused on every rank before any collective: a mesh unlike the process group, a
plan that does not divide, an argument of the wrong shape, dtype or device, a module Thunder
cannot trace or an op nvtp cannot fuse (named with its line). ``check_replicas=True`` (a debug
option) compares checksums of every replicated parameter, buffer and argument across ranks
before each call and names any that differ. On a mesh of processes a watchdog stops this rank, naming the culprit, when another
rank fails or stays silent for ``timeout`` seconds (``nvtp.execute.launch``, docs/faults.md).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import time
import types
import warnings
from typing import Any, Mapping

import torch
import torch.distributed as dist

from nvtp import driver, generation, guard, precheck, tracecache
from nvtp import dtensor as _dt
from nvtp.errors import InputError
from nvtp.execute import backends, kernels, spmd
from nvtp.execute.step import RankProgram, part_rows
from nvtp.execute.collectives import Comm, DistComm, MeshComm, on_axis, PROGRESS, SoloComm
from nvtp.frontend import fx, recompute as recomputation, user_code
from nvtp.frontend.lengths import Lengths, horizon
from nvtp.frontend.tied import aliases
from nvtp.mesh import check_world, make_mesh
from nvtp.parameters import full_tensor, gather, hold_part, on_process_group, place, replace_parameter, retarget
from nvtp.program import Program
from nvtp.sharding import axes
from nvtp.sharding.placements import REPLICATE, DeviceMesh, FusedParts, Placement, is_replicate
from nvtp.sharding.plans import check_plan
from nvtp.sharding.propagate import ShardingError
from nvtp.execute.launch import start_watchdog
from nvtp.sharding.collective_matmul import check_mode
from nvtp.sharding.target import as_target

__all__ = ["ShardedModule", "full_tensor", "InputError", "retarget", "hold_part", "gather"]  # the last four: nvtp/parameters.py


class ShardedModule(torch.nn.Module):
    """``module`` sharded over ``mesh`` by ``plan``; call it as you would call ``module``."""

    def __init__(self, module: torch.nn.Module, plan: str | Mapping[str, Any] = "megatron", mesh: DeviceMesh | None = None,
                 comm: Comm | None = None, dynamic: bool = False, *, timeout: float | None = 60.0, check_replicas: bool = False,
                 frontend: str = "auto", fsdp: bool = False, regional: bool = True, backend: str = "auto",
                 overlap: bool = True, collective_matmul: bool | str = "auto", verify: bool | float = True,
                 compile: str = kernels.DEFAULT, recompute: str = "none", capacity_factor: float | None = None):
        super().__init__()
        # Everything a user can get wrong is refused here, before anything is traced: the route,
        # the mesh and its axis names, the plan's names, and a backend that cannot run here.
        self._route = driver.route(module, frontend)
        self._fx = self._route == "fx"
        self.module = module
        self.dynamic = dynamic
        self.plan = plan
        world = comm.size if comm is not None else None
        self.mesh = make_mesh(mesh, fsdp=fsdp, world=world if world is not None else _world())
        self.fsdp = fsdp
        self._torch_mesh = None if mesh is None or isinstance(mesh, DeviceMesh) else mesh  # torch's, when given
        self.check_replicas = check_replicas
        self.regional = regional
        self._comm = comm
        check_world(self.mesh, comm)
        check_plan(plan, driver.plan_names(module), type(module).__name__)  # an unknown plan or unmatched glob
        self.backend = backends.resolve(backend, _device_of(module)).name
        axes.check(self.mesh, fsdp=fsdp, backend=self.backend)  # every axis's own checks, before tracing

        self.overlap, self.collective_matmul, self.recompute = overlap, check_mode(collective_matmul), recomputation.check_mode(recompute)  # refused now
        self.axis_options = {} if capacity_factor is None else {"capacity_factor": capacity_factor}  # the ep axis's (checked by nvtp.options)
        self.verify = guard.option(verify)  # the first call of each program checked against eager (nvtp/guard.py)
        self.compile_mode = kernels.check_mode(compile)  # how the reference backend runs each rank's fusions
        if timeout is not None and comm is None and self.mesh.size > 1:
            start_watchdog(timeout)  # once per process; init_group may have started it already
        # Not a submodule: the meta copy Thunder traces is no part of the model's state.
        object.__setattr__(self, "_meta", driver.meta_copy(module))
        self._global_shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        self._tied = aliases(module)  # a tied parameter's other names -> its first (nvtp/frontend/tied.py)
        self._placements: dict[str, Placement] = {}
        self._part_rows: dict[str, tuple[str, int, int]] = {}  # a part's label -> (its parameter, rows in this rank's tensor)
        self.notes: list[str] = []  # what the plan left whole, and why (e.g. fsdp on a bias tp splits)
        self._compiled: dict[tuple, RankProgram] = {}
        self._lengths = Lengths(horizon(module))  # traces by call structure: a new sequence length derived from two (nvtp/frontend/lengths.py)
        self.last: Program | None = None  # the program of the latest compile() or call (nvtp.program)
        self._ready = True  # from here on, setting an attribute only the model has sets it on the model

    # -- state: the wrapped module's own keys ------------------------------------------------

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (its own keys; split parameters hold this rank's shard)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint's contract for a module whose state dict leaves out a child's
        prefix (ours: the wrapped module's keys, as DDP's and FSDP's are): each top-level name of
        the wrapped module lives under ``module``. So ``get_model_state_dict(sharded)`` and
        ``set_model_state_dict`` work on the object ``nvtp.jit`` returns."""
        inner = self.module
        return {n: "module" for n in (*inner._modules, *inner._parameters, *inner._buffers)}

    # -- the wrapped model's own interface ----------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """What the wrapped model has and this wrapper has not (``model.config``, ``model.generate``),
        as DDP users reach through ``.module``. A method of the model comes bound to this wrapper,
        so a ``self(idx)`` inside it (nanoGPT's ``generate``) runs the sharded program, and what it
        reads of ``self`` comes from the model."""
        # No caught exception is kept in a local: it would hold this frame through its traceback, and
        # the frame its callers' (a training step's activations, through zero_grad's getattr), in a
        # cycle that only the garbage collector frees (docs/benchmarks.md, issue 37 item 3).
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        inner = self.__dict__.get("_modules", {}).get("module")
        if inner is None or name.startswith("__"):
            return super().__getattr__(name)  # raises torch's own AttributeError again
        try:
            value = getattr(inner, name)
        except AttributeError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}, nor has the model it wraps "
                                 f"({type(inner).__name__})") from None
        if name == "generate" and generation.is_transformers_generator(inner):  # transformers' loop, on a view (nvtp/generation.py)
            return functools.partial(generation.generate, self)
        if inspect.ismethod(value) and value.__self__ is inner:
            return types.MethodType(value.__func__, self)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        """An attribute the wrapped model has (and this wrapper not) is set on the model, so a model's
        method bound here (``init_weights`` setting ``self.freqs_cis``) changes the model."""
        inner = self.__dict__.get("_modules", {}).get("module")
        if (inner is not None and self.__dict__.get("_ready") and name not in self.__dict__ and not hasattr(type(self), name)
                and name not in self._parameters and name not in self._buffers and name not in self._modules and hasattr(inner, name)):
            setattr(inner, name, value)
            return
        super().__setattr__(name, value)

    # -- where things are ---------------------------------------------------------------------

    @property
    def comm(self) -> Comm:
        if self._comm is None:
            if self.mesh.ndim > 1:  # one process group per mesh axis, from torch's DeviceMesh
                groups = [DistComm(self._device_mesh().get_group(a)) for a in range(self.mesh.ndim)]
                self._comm = MeshComm(self.mesh.index(dist.get_rank()), self.mesh.size, groups)
            else:
                self._comm = DistComm() if self.mesh.size > 1 else SoloComm()
        return self._comm

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def uses_dtensor(self) -> bool:
        """Whether parameters become DTensors: on torch.distributed's own group (not a simulated ``comm``)."""
        return on_process_group(self._comm, self.mesh.size)

    def _device_mesh(self):
        """torch's DeviceMesh the DTensor parameters live on (the one given, or one over the default group)."""
        if self._torch_mesh is None:
            device = next((p.device.type for p in self.module.parameters()), "cpu")
            self._torch_mesh = _dt.torch_mesh(self.mesh, device)
        return self._torch_mesh

    def placement(self, name: str) -> Placement | tuple[Placement, ...]:
        """Where parameter ``name`` lives (Replicate until the first call has sharded it); on a
        mesh of several axes, one placement per axis. A tied parameter has one placement, under each of its names."""
        name = self._tied.get(name, name)
        return self._placements.get(name, REPLICATE if self.mesh.ndim == 1 else (REPLICATE,) * self.mesh.ndim)

    def _dp_axis(self) -> int | None:
        return axes.batch_axis(self.mesh)

    def global_shape(self, name: str) -> tuple[int, ...]:
        return self._global_shapes[self._tied.get(name, name)]

    # -- compile ------------------------------------------------------------------------------

    def _mode(self) -> tuple[bool, bool]:
        """What a program depends on besides the arguments: training mode (dropout) and whether
        autograd records (a backward is traced only then: ``torch.no_grad()`` inference has none)."""
        return (self.module.training, torch.is_grad_enabled())

    def _signature(self, args: tuple, kwargs: Mapping[str, Any] | None = None) -> tuple:
        if self._fx:
            return (self._mode(), *fx.call_structure(args, kwargs or {}))
        sig = [self._mode()]
        for a in args:
            sig.append((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else ("value", repr(a)))
        return tuple(sig)

    def _compile(self, args: tuple, kwargs: Mapping[str, Any] | None = None) -> RankProgram:
        """The driver's program for this call shape (``nvtp.driver``: the route, the passes for this
        backend's target), this rank's parameters made its shards, and the backend's runner.
        Raises InputError when the arguments do not fit the module, CaptureError when Thunder
        cannot trace it or nvtp cannot fuse an op (each naming the op and the source line)."""
        precheck.check_call(self.module, self.mesh, args, kwargs)  # what the arguments already tell, before tracing
        options = dict(frontend=self._route, regional=self.regional,
                       flash=as_target(self.backend).flash_attention,  # the backend's attention (sdpfa on the reference's)
                       **axes.trace_options(self.mesh, self.plan))  # what the mesh's axes need
        checked = lambda t: guard.will_check(t.forward, self.mesh, self.axis_options, self.verify)  # noqa: E731
        traced = self._lengths.trace(args, kwargs, self._mode(), lambda: tracecache.trace(  # a new length: derived when it can be
            self.module, args, kwargs, options,  # kept on disk: the job's other ranks and later runs read it (nvtp/tracecache.py)
            lambda: driver.trace(self._meta, args, kwargs, on_meta=False, like=self.module, **options), checked),
            eager=checked)  # the forward's check stands behind a derived or a cached program
        program = driver.shard(traced, self.plan, self.mesh, self.backend, fsdp=self.fsdp, placed=self._placements,
                               overlap=self.overlap, collective_matmul=self.collective_matmul, recompute=self.recompute,
                               axis_options=self.axis_options)
        self.notes = list(program.notes)
        self._shard_parameters(program)
        start = time.perf_counter()
        run = backends.BACKENDS[self.backend].lower(program, self.comm, compile=self.compile_mode)
        program.seconds["lower"] = time.perf_counter() - start  # the first call's report: trace, shard, lower, check
        return RankProgram(program, run, self.rank, self._part_rows, self._signature(args, kwargs), program.source.call)

    def _check_batches(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        """Every dp rank must pass batches of one shape (each traces the whole step as dp times its
        own): one small all-gather over dp before anything is traced, and one clear error on every rank."""
        shapes = [list(a.shape) if isinstance(a, torch.Tensor) else None for a in (*args, *kwargs.values())]
        per_rank = _all_gather_json(on_axis(self.comm, self._dp_axis()), shapes)
        if any(p != per_rank[0] for p in per_rank):
            seen = "; ".join(f"dp rank {r}: {p}" for r, p in enumerate(per_rank))
            raise InputError(f"the dp ranks pass arguments of different shapes ({seen}); on a (dp, tp) mesh every rank passes "
                             "its own batch of the same shape, as with DDP: split the global batch evenly over dp")

    def _shard_parameters(self, program: Program) -> None:
        """Make each parameter this rank's part of it, as ``program`` places it (a DTensor on a
        mesh of processes); a parameter placed by an earlier compile must be placed alike."""
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        for label, placement in program.parameters.items():
            label = program.traced.tied.get(label, label)  # a tied parameter, under its first name
            if label in params:
                p = params[label]
                if label in self._placements:
                    if self._placements[label] != placement:
                        raise ShardingError(f"{label} is placed {self._placements[label]} but a new trace wants {placement}")
                    continue
                self._placements[label] = placement
                if isinstance(placement, FusedParts):  # where each part's rows lie in this rank's tensor
                    self._part_rows.update(part_rows(label, placement, self.mesh.size))
                part = p.data if _whole(placement) else spmd.shard_tensor(p.data, placement, self.mesh, self.rank)
                new = place(p, part, placement, self._global_shapes[label], self.comm,
                            self._device_mesh() if self.uses_dtensor else None)
                if new is not p:
                    replace_parameter(self.module, p, new)
            elif not _whole(placement) and (label in buffers or label in driver.tensor_attributes(self.module)):
                raise ShardingError(f"buffer {label} would be split ({placement}); nvtp keeps buffers (and tensor attributes) whole")

    # -- run ----------------------------------------------------------------------------------

    def compile(self, *args, **kwargs) -> "ShardedModule":
        """Trace and shard for arguments like ``args`` now (the parameters become shards), without
        running anything: before loading a checkpoint, or to fail fast on a bad plan."""
        args, kwargs = self._call(args, kwargs)
        self.last = self._compiled_for(args, kwargs).program  # ``last.traced.how``: how it was traced
        return self

    def lower(self, *args, **kwargs) -> Program:
        """The ``Program`` a call with arguments like these runs, before any step (as
        ``jax.jit(f).lower(x)``): traced and sharded now if it was not yet, the parameters made
        their shards. ``.as_text()`` is what ``nvtp explain`` prints, ``.steps()`` every
        communication of a training step, ``.write_nvfuser(dir)`` the files nvFuser runs."""
        return self.compile(*args, **kwargs).last

    def _call(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
        """A call's arguments as the compiled programs take them (``nvtp.driver.bind_call``)."""
        return driver.bind_call(self.module, self._route, args, kwargs)

    def share_compiled(self, other: "ShardedModule") -> "ShardedModule":
        """Take ``other``'s traced and sharded programs instead of tracing again: ``other`` is the
        same model with the same plan and mesh on another rank (a simulated mesh, one module per
        rank in one process). This rank's parameters become its shards."""
        for key, compiled in other._compiled.items():  # the same program; this rank's runner of it
            run = backends.BACKENDS[self.backend].lower(compiled.program, self.comm, compile=self.compile_mode)
            self._compiled[key] = RankProgram(compiled.program, run, self.rank, self._part_rows, compiled.signature, compiled.call)
            self._shard_parameters(compiled.program)
        self.last = other.last
        return self

    def _compiled_for(self, args: tuple, kwargs: Mapping[str, Any] | None = None) -> RankProgram:
        key = self._signature(args, kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            self._check_new_signature(args, kwargs)
            with PROGRESS.busy("tracing and sharding the model"):  # not hung: the watchdog gives it time (COMPILE_S)
                compiled = self._compile(args, kwargs)
            self._compiled[key] = compiled
        return compiled

    def _checked_for(self, args: tuple, kwargs: Mapping[str, Any]) -> RankProgram:
        """``_compiled_for``'s program, its first call checked against eager (``nvtp.guard``: raises
        MiscompileError); a program derived at a new length that fails the check is traced instead
        (``Lengths.settle``), with a warning, and that one checked."""
        compiled = self._compiled_for(args, kwargs)
        start = time.perf_counter()
        try:
            outcome = guard.check_module(self, compiled, args, kwargs, self.verify)
            compiled.program.seconds.setdefault("check", time.perf_counter() - start)
        except guard.MiscompileError as e:
            why = self._lengths.settle(args, kwargs, self._mode(), e.first)
            if not why:
                raise
            warnings.warn(f"nvtp: {why}; traced instead, as every new length of these calls will be", stacklevel=3)
            del self._compiled[self._signature(args, kwargs)]
            compiled = self._compiled_for(args, kwargs)
            guard.check_module(self, compiled, args, kwargs, self.verify)
            return compiled
        if outcome is not None:
            self._lengths.settle(args, kwargs, self._mode(), "" if outcome.compared else "the check compared no value")
        return compiled

    def _check_new_signature(self, args: tuple, kwargs: Mapping[str, Any] | None = None) -> None:
        """Refuse arguments unlike those compiled for (unless ``dynamic``), before any work."""
        device = next((p.device.type for p in self.module.parameters()), "cpu")
        if self._fx:
            have = self._compiled_alike(self._signature(args, kwargs))
            fx.check_call(type(self.module).__name__, device, args, kwargs or {}, None if have is None else have.signature[1:])
            return
        names = list(inspect.signature(self.module.forward).parameters)
        if len(args) > len(names):
            raise InputError(f"{type(self.module).__name__}.forward takes {len(names)} arguments ({', '.join(names)}), got {len(args)}")
        for name, a in zip(names, args):
            if isinstance(a, torch.Tensor) and a.device.type != device:
                raise InputError(f"argument {name} is on {a.device}, the module's parameters on {device}; move it with .to({device!r})")
        have = self._compiled_alike(self._signature(args, kwargs))
        if have is not None:
            for name, a, old in zip(names, args, have.signature[1:]):
                new = (tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else ("value", repr(a))
                if new != old:
                    raise InputError(f"argument {name}: the module was compiled for {_describe(old)}, got {_describe(new)}; "
                                     "pass the same shapes and dtypes, or nvtp.jit(..., dynamic=True) to compile each new one")

    def _compiled_alike(self, signature: tuple) -> RankProgram | None:
        """A program compiled for calls of the same kind as ``signature`` (mode, and which optional
        arguments are given), whose shapes a training call must match unless ``dynamic``; None when
        a new program is expected: the first of its kind (``model.eval()``, ``model(idx)`` without
        targets), or inference (``torch.no_grad()``: a forward-only program per shape, as
        ``generate`` calls the model on ever longer prompts)."""
        if self.dynamic or not signature[0][1]:
            return None

        def kind(sig: tuple) -> tuple:
            if self._fx:  # the mode and the call's tree of arguments (keys, Nones)
                return sig[:2]
            return (sig[0], len(sig), tuple(i for i, a in enumerate(sig) if a == ("value", "None")))

        return next((c for c in self._compiled.values() if kind(c.signature) == kind(signature)), None)

    def forward(self, *args, **kwargs):
        user_code.check_hooks(self.module)  # a hook registered since nvtp.jit would never fire: refused
        args, kwargs = self._call(args, kwargs)
        if self._dp_axis() is not None and self._signature(args, kwargs) not in self._compiled:
            self._check_batches(args, kwargs)  # every rank's first call with these shapes (compile() skips it)
        compiled = self._checked_for(args, kwargs)
        self.last = compiled.program
        named = compiled.module_state(self.module)  # parameters (a part: its parameter), buffers, tensor attributes
        call = compiled.call
        user = call.bind(args, kwargs) | call.constants if call else dict(zip(compiled.arg_names, args))
        if self.check_replicas and self.mesh.size > 1:
            self._check_replicas(named, user)
        tensors = [named[k] for k in named] + [user[k] for k in compiled.traced_args]
        seed = int(torch.randint(0, 2**62, (1,)).item())
        outs = _Run.apply(self, compiled, list(named), seed, *tensors)
        return compiled.rebuild(outs)  # the model's own output object: (logits, loss), a dict, CausalLMOutputWithPast


    def _check_replicas(self, named: Mapping[str, torch.Tensor], user: Mapping[str, Any]) -> None:
        """Raise ``InputError`` on every rank if a replicated parameter, buffer or argument differs
        between ranks (one all-gather of checksums), naming it and the ranks on each side."""
        mine = {}
        for label, t in named.items():
            if _whole(self.placement(label)):
                mine[label] = _checksum(t)
        for name, a in user.items():
            mine[f"argument {name}"] = _checksum(a) if isinstance(a, torch.Tensor) else repr(a)
        per_rank = _all_gather_json(self.comm, mine)
        names = sorted(set().union(*per_rank), key=lambda n: (not n.startswith("argument"), n))
        differ = []
        for name in names:
            groups: dict[str, list[int]] = {}
            for r, sums in enumerate(per_rank):
                groups.setdefault(sums.get(name, "(absent)"), []).append(r)
            if len(groups) > 1:
                sides = sorted(groups.values(), key=len, reverse=True)
                differ.append(f"{name}: " + " / ".join(f"rank{'s' if len(g) > 1 else ''} {', '.join(map(str, g))}" for g in sides))
        if differ:
            more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
            raise InputError(f"replicated inputs differ between ranks: {'; '.join(differ[:5])}{more}. Every rank must hold the "
                             "same replicated parameters and the same whole arguments: seed every rank alike "
                             "(torch.manual_seed) before building the model, and give every rank the same batch")


def _checksum(t: torch.Tensor) -> str:
    """A checksum of a tensor's shape, dtype and bytes."""
    t = _dt.local(t).contiguous().cpu()
    h = hashlib.blake2b(f"{str(t.dtype)}{list(t.shape)}".encode(), digest_size=8)
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _all_gather_json(comm: Comm, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), with the tensor collectives any ``Comm`` has."""
    payload = torch.tensor(list(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)
    sizes = [int(n) for n in comm.all_gather(torch.tensor([payload.numel()]))]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    parts = comm.all_gather(padded)
    return [json.loads(bytes(p[:n].tolist()).decode()) for p, n in zip(parts, sizes)]


def _world() -> int:
    """Ranks of the default process group (1 without one): the default mesh's size."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _device_of(module: torch.nn.Module) -> str:
    return next((p.device.type for p in module.parameters()), "cpu")


def _describe(sig) -> str:
    if sig[0] == "value":
        return sig[1]
    shape, dtype, device = sig
    return f"{str(dtype).replace('torch.', '')}{list(shape)} on {device}"


class _Run(torch.autograd.Function):
    """Forward: the sharded forward fusion. Backward: the sharded backward fusion (``RankProgram``)."""

    @staticmethod
    def forward(ctx, module: ShardedModule, compiled: RankProgram, param_labels: list[str], seed: int, *tensors):
        n_params = len(param_labels)
        named = dict(zip(param_labels, tensors[:n_params])) | dict(zip(compiled.traced_args, tensors[n_params:]))
        user_outputs, values = compiled.forward(named, seed)
        # The tensors the backward reads are saved the autograd way: an output kept on ctx itself would
        # hold its own node (output -> grad_fn -> ctx -> output), a cycle that keeps the whole step's
        # saved activations alive until the garbage collector runs (docs/benchmarks.md, issue 37 item 3);
        # and autograd checks each one's version, so an input changed in place before the backward
        # raises as in eager PyTorch instead of giving gradients of other values.
        ctx.saved_names = [k for k, t in values.items() if isinstance(t, torch.Tensor)]
        ctx.save_for_backward(*(values[k] for k in ctx.saved_names))
        values = {k: t for k, t in values.items() if not isinstance(t, torch.Tensor)}
        ctx.module, ctx.compiled, ctx.values, ctx.named, ctx.n_params = module, compiled, values, named, n_params
        ctx.param_labels = param_labels
        for t in user_outputs:
            ctx.mark_non_differentiable(t) if not t.is_floating_point() else None
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None (zeros in RankProgram.backward)
        return tuple(user_outputs)

    @staticmethod
    def backward(ctx, *grads):
        compiled: RankProgram = ctx.compiled
        if compiled.backward_fusion is None:
            return (None,) * (4 + ctx.n_params + len(compiled.traced_args))
        if ctx.values is None:
            raise RuntimeError("Trying to backward through an nvtp module's step a second time: its saved values were freed "
                               "after the first backward, as they were read. Pass retain_graph=True to the first backward "
                               "(loss.backward(retain_graph=True)) to keep them")
        params = {label: _dt.local(ctx.named[label]) for label in ctx.param_labels}
        values = ctx.values | dict(zip(ctx.saved_names, ctx.saved_tensors))
        # Unless the graph is kept (retain_graph=True), the backward takes the saved values: each is
        # freed after its last use, as eager autograd frees a node's saved tensors when it has run,
        # not all at the end (torch's compiled autograd and Thunder clear them the same way).
        take = not torch._C._autograd._get_current_graph_task_keep_graph()
        if take:
            ctx.values = None
            ctx.maybe_clear_saved_tensors()
        by_grad = compiled.backward(values, params, grads, device=_device_of(ctx.module.module), take=take)
        result = [None, None, None, None]
        for label in ctx.param_labels:  # a DTensor parameter's gradient is a DTensor placed like it
            g = by_grad.get(label)
            result.append(_dt.grad_like(ctx.named[label], g) if isinstance(ctx.named[label], _dt.DTensor) else g)
        result += [by_grad.get(name) for name in compiled.traced_args]
        return tuple(result)


def _whole(placement) -> bool:
    """Whether a placement (or a sharding, one per mesh axis) leaves the tensor whole on every rank."""
    return all(is_replicate(p) for p in placement) if isinstance(placement, tuple) else is_replicate(placement)
