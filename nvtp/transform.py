"""``nvtp.ShardingTransform``: ``thunder.jit`` with a sharding plan, as a Thunder transform.

    jm = thunder.jit(model, transforms=[nvtp.ShardingTransform(plan="megatron", mesh=mesh)])
    opt = torch.optim.AdamW(jm.parameters())
    loss = jm(idx, targets); loss.backward(); opt.step()

It works the way Thunder's own ``fsdp`` and ``column_parallel`` transforms do
(``thunder/distributed/transforms/fsdp_v2.py``, ``thunder/distributed/tensor_parallel/common.py``):
the ThunderModule's parameters (``_overrides_parameters``) hold this rank's shards, and
``transform_traces_pre_prologue`` rewrites the prologue's ``check_tensor_shape_and_metadata``
of each parameter to the shard's shape, so the prologue accepts the sharded parameters on
every call instead of missing the cache. Where Thunder's transforms then insert collectives into
Thunder's computation trace, this one replaces the computation with one call into the program
nvtp's compile driver made for the same call:

* ``transform_module`` (at ``thunder.jit``): every parameter gets a ThunderModule parameter of
  its own (sharing the storage until the first call), so an optimizer made from
  ``jm.parameters()`` steps the objects that will hold the shards; nvtp's executor for the
  program's symbols joins the jit's executors.
* ``transform_traces_pre_prologue`` (each trace, i.e. each new call shape): the call is read off
  the prologue (its tensors as meta tensors), ``nvtp.driver.compile`` traces and shards the
  module for it (the same driver, plan, mesh and backend ``nvtp.jit`` uses: one Program), each
  ThunderModule parameter becomes this rank's part as the Program places it, the module's own
  parameters are released (meta: the whole weights are freed), the prologue's checks take the
  shards' shapes, and the computation becomes ``nvtp_program_N(params..., args...)``.
* Thunder's autograd differentiates that symbol by the grad transform registered with it:
  ``nvtp_forward_N`` (the forward fusion, returning what the backward reads) and
  ``nvtp_backward_N`` (the backward fusion), so ``thunder.last_traces(jm)`` and
  ``thunder.last_backward_traces(jm)`` show the two calls. Both run the backend's runner
  (``nvtp.execute.backends``) through ``nvtp.execute.step.RankProgram``, the step ``nvtp.jit``
  runs.

On a mesh of processes (after ``init_process_group``) each ThunderModule parameter becomes a
``torch.distributed.tensor.DTensor`` on torch's ``DeviceMesh`` holding this rank's part, as under
``nvtp.jit``: ``torch.nn.utils.clip_grad_norm_(jm.parameters(), ...)`` clips by the whole model's
norm, ``jm.state_dict()`` holds DTensors, ``jm.original_state_dict()`` whole tensors. Thunder's
interpreter never sees them: it reads the module's own (meta) parameters, the prologue unpacks the
DTensors and checks their whole shapes, and the program's symbols take their local parts and give
DTensor gradients. On a simulated mesh (``comm=``, ranks as threads, no process group) and on one
process parameters are plain tensors holding this rank's part (``nvtp.full_tensor`` gathers one);
``share`` lets simulated ranks compile once.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from thunder.core import devices, dtypes
from thunder.core.prims import PrimIDs
from thunder.core.proxies import NumberProxy, Proxy, TensorProxy, variableify
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceProvenance, from_trace, tracectx
from thunder.core.transform_common import Transform
from thunder.core.transforms import get_grad, put_grad
from thunder.extend import OperatorExecutor
import thunder
import torch.distributed as dist

from nvtp import driver, guard, options
from nvtp import dtensor as _dt
from nvtp.errors import InputError
from nvtp.execute import backends, spmd
from nvtp.execute.launch import start_watchdog
from nvtp.execute.collectives import Comm, DistComm, SoloComm
from nvtp.execute.step import RankProgram, part_rows
from nvtp.frontend import interpret, user_code
from nvtp.frontend.capture import module_state
from nvtp.mesh import MeshError, check_world, make_mesh
from nvtp.parameters import gather, on_process_group, place, retarget
from nvtp.program import Program
from nvtp.sharding.placements import FusedParts, Placement, is_replicate, local_shape
from nvtp.sharding.plans import check_plan
from nvtp.sharding.propagate import ShardingError

__all__ = ["ShardingTransform"]


@dataclass
class _Programs:
    """Programs by call signature, shared by the ranks of a simulated mesh (``share``)."""

    by_signature: dict[tuple, Program] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Call:
    """What the prologue says about a call: the arguments (tensors as meta tensors), and where
    each computation input comes from."""

    args: tuple
    kwargs: dict[str, Any]
    # Per computation input: ("parameter" | "buffer" | "attribute", name), ("arg", position), ("kwarg", key), ("other", None)
    sources: list[tuple[str, Any]]


class ShardingTransform(Transform):
    """Shard the module ``thunder.jit`` compiles over ``mesh`` by ``plan`` with nvtp (see the module docstring).

    ``plan``: "megatron", "megatron-sp", or an explicit plan (as ``nvtp.jit`` takes). ``mesh``:
    a 1-D mesh (a number of devices, torch's ``DeviceMesh``, nvtp's ``DeviceMesh``; default:
    every rank of the default process group). ``comm``: a simulated mesh's communicator for this
    rank (tests; ranks as threads). ``backend``: "auto", "reference" or "nvfuser", as in
    ``nvtp.jit``. ``regional``: trace a chain of repeated blocks once (``nvtp.jit``'s option).
    ``timeout``: on a mesh of processes, seconds a rank waits for a silent peer before the watchdog
    stops it, naming the peer (None: no watchdog), as ``nvtp.jit`` takes it.
    ``verify``: check each program's first call against the model run eagerly (``nvtp.jit``'s option).
    Bad input (a mesh unlike the process group, an unknown plan, a backend that cannot run here)
    is refused when the transform is made or applied, before anything is traced."""

    def __init__(self, plan: str | Mapping[str, Any] = "megatron", mesh: Any = None, *, comm: Comm | None = None,
                 backend: str = "auto", regional: bool = True, timeout: float | None = 60.0, verify: bool | float = True):
        options.check("transform", plan=plan, mesh=mesh, comm=comm, backend=backend, regional=regional, timeout=timeout,
                      verify=verify)
        world = comm.size if comm is not None else _world()
        self.mesh = make_mesh(mesh, world=world)
        if self.mesh.ndim != 1:
            raise MeshError(f"nvtp.ShardingTransform shards over a 1-D tensor-parallel mesh; got axes {list(self.mesh.names)} of "
                            f"shape {list(self.mesh.shape)}. For a (dp, tp) mesh use nvtp.jit(model, mesh=mesh)")
        check_world(self.mesh, comm)
        if isinstance(plan, str) and "=" not in plan:  # a plan's name; globs are checked against the module's names
            check_plan(plan, [])
        backends.resolve(backend, run=False)  # an unknown name now; whether it runs here once the module's device is known
        if timeout is not None and comm is None and self.mesh.size > 1:  # names a dead or silent rank (nvtp.execute.watchdog)
            start_watchdog(timeout)
        self.plan = plan
        self.backend = backend
        self.regional = regional
        self.verify = guard.option(verify)  # each program's first call checked against eager (nvtp/guard.py)
        self._comm = comm
        self._programs = _Programs()
        self._module: weakref.ref | None = None
        self._executor: OperatorExecutor | None = None
        self._placements: dict[str, Placement] = {}
        self._part_rows: dict[str, tuple[str, int, int]] = {}
        self._whole_shapes: dict[str, tuple[int, ...]] = {}
        self._released = False
        self._torch_mesh = None  # torch's DeviceMesh of the DTensor parameters, made at the first sharding
        self._count = 0
        self.last: Program | None = None  # the Program of the latest compile (what nvtp.plan reports for it)

    def __repr__(self) -> str:
        return f"nvtp.ShardingTransform(plan={self.plan!r}, mesh={self.mesh.size}, backend={self.backend!r})"

    @property
    def comm(self) -> Comm:
        if self._comm is None:
            self._comm = DistComm() if self.mesh.size > 1 else SoloComm()
        return self._comm

    def share(self, other: "ShardingTransform") -> "ShardingTransform":
        """Take ``other``'s programs instead of compiling again: ``other`` shards the same model
        with the same plan and mesh on another rank of a simulated mesh (one ``thunder.jit`` per
        rank in one process). Whichever rank meets a call shape first compiles it."""
        self._programs = other._programs
        return self

    # -- at thunder.jit -----------------------------------------------------------------------

    def transform_module(self, model) -> None:
        """Give each parameter a ThunderModule parameter of its own (the one that will hold this
        rank's shard: optimizers made from ``jm.parameters()`` step it) and add nvtp's executor."""
        if self._module is not None:
            raise InputError("this nvtp.ShardingTransform is applied already; make one per thunder.jit")
        module = model._model
        check_plan(self.plan, driver.plan_names(module), type(module).__name__)
        user_code.check_module(module)  # Python randomness in forward, hooks: refused before anything is traced
        if refusal := user_code.thunder_refusal(module, "nvtp.jit(model, plan=..., mesh=...) takes such a model, by TorchDynamo"):
            raise refusal  # weight_norm, a parametrization: Thunder interprets forward before any transform runs
        interpret.cache_off(module)  # a transformers model trains without its KV cache, as under nvtp.jit
        device = next((p.device.type for p in module.parameters()), "cpu")
        self.backend = backends.resolve(self.backend, device).name
        self._module = weakref.ref(model)
        shared = model._get_shared_names()
        done: set[int] = set()
        for name, p in list(model.named_parameters()):
            if id(p) in done:
                continue
            done.add(id(p))
            own = torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad)  # the same storage, for now
            for alias in shared[name]:
                model._overrides_parameters[alias] = own
                self._whole_shapes[alias] = tuple(p.shape)
        self._executor = OperatorExecutor(f"nvtp_sharded_{id(self)}")
        cd = thunder.compile_data(model)
        cd.executors_list = (self._executor, *cd.executors_list)
        cd.executor_lookasides.update(interpret.lookasides())  # transformers models, nn.MultiheadAttention (nvtp/frontend/interpret.py)

    # -- at each trace ------------------------------------------------------------------------

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        model = self._module() if self._module is not None else None
        if model is None:
            raise InputError("nvtp.ShardingTransform applies to a module: thunder.jit(module, transforms=[...])")
        _check_no_updates(epilogue_trace)
        call = _call_of(prologue_trace, computation_trace)
        program = self._compile(model._model, call)
        placed = self._new_placements(program)
        rows = dict(self._part_rows)
        for label, placement in placed.items():
            if isinstance(placement, FusedParts):  # where each part's rows lie in this rank's tensor
                rows.update(part_rows(label, placement, self.mesh.size))
        rp = RankProgram(program, backends.BACKENDS[self.backend].lower(program, self.comm), self.comm.rank, rows,
                         call=program.source.call)
        labels, proxies = self._inputs(computation_trace, call, rp)
        ret, matched = _outputs(computation_trace, rp)
        # Everything is checked: only now do the ThunderModule's parameters become this rank's parts.
        self._shard_parameters(model, placed)
        self._part_rows.update(rows)
        self._rewrite_checks(model, prologue_trace, computation_trace, call)
        new = self._computation(computation_trace, rp, labels, proxies, ret, matched, model)
        return prologue_trace, new, epilogue_trace

    def _compile(self, module: torch.nn.Module, call: _Call) -> Program:
        """The driver's Program for this call (compiled once per signature, shared by ``share``d ranks):
        keywords bound to their positions first, as ``nvtp.jit`` binds them, so ``jm(idx, targets=t)``
        runs the program of ``jm(idx, t)``."""
        way = driver.route(module)  # transformers models: the FX route, as nvtp.jit takes them
        args, kwargs = driver.bind_call(module, way, call.args, call.kwargs)
        signature = (module.training, _describe(args), _describe(tuple(sorted(kwargs.items()))))
        with self._programs.lock:  # no collective inside: a rank waiting here holds up no other
            program = self._programs.by_signature.get(signature)
            if program is None:
                program = driver.compile(module, *args, plan=self.plan, mesh=self.mesh, backend=self.backend,
                                         frontend=way, regional=self.regional, placed=self._placements or None, **kwargs)
                self._programs.by_signature[signature] = program
        self.last = program
        return program

    def _new_placements(self, program: Program) -> dict[str, Placement]:
        """Each ThunderModule parameter ``program`` places that no earlier program placed -> its
        placement; raises ``ShardingError`` if it places one elsewhere than an earlier program did."""
        out = {}
        for label, placement in program.parameters.items():
            label = program.traced.tied.get(label, label)
            if label not in self._whole_shapes:
                continue  # an argument or a buffer (nvtp keeps buffers whole: the passes refuse to split one)
            if label in self._placements:
                if self._placements[label] != placement:
                    raise ShardingError(f"{label} is placed {self._placements[label]} but a new trace wants {placement}")
                continue
            out[label] = placement
        return out

    def _shard_parameters(self, model, placed: Mapping[str, Placement]) -> None:
        """Make each ThunderModule parameter in ``placed`` this rank's part, then release the
        module's own (whole) parameters: they become meta tensors of their shapes, which is all
        Thunder's interpreter needs to trace a later call shape."""
        for label, placement in placed.items():
            self._placements[label] = placement
            p = model._overrides_parameters[label]
            part = p.data if is_replicate(placement) else spmd.shard_tensor(p.data, placement, self.mesh, self.comm.rank)
            new = place(p, part, placement, self._whole_shapes[label], self.comm, self._mesh_of(part) if self._uses_dtensor() else None)
            for alias, q in list(model._overrides_parameters.items()):  # every name of a tied parameter
                if q is p:
                    model._overrides_parameters[alias] = new
        if self._released:
            return
        self._released = True
        module = model._model
        names = {id(q): n for n, q in module.named_parameters(remove_duplicate=False)}
        metas: dict[int, torch.nn.Parameter] = {}
        for owner in module.modules():
            for attr, q in list(owner._parameters.items()):
                if q is None or q.device.type == "meta":
                    continue
                if id(q) not in metas:  # a tied parameter: one meta parameter for all its owners
                    metas[id(q)] = torch.nn.Parameter(torch.empty(q.shape, dtype=q.dtype, device="meta"), requires_grad=q.requires_grad)
                    retarget(q, model._overrides_parameters[names[id(q)]])  # an optimizer made from model.parameters()
                owner._parameters[attr] = metas[id(q)]

    def _uses_dtensor(self) -> bool:
        """Whether parameters become DTensors (``nvtp.parameters.on_process_group``, as under ``nvtp.jit``)."""
        return on_process_group(self.comm, self.mesh.size)

    def _mesh_of(self, part: torch.Tensor):
        """torch's DeviceMesh of the DTensor parameters (made once, on ``part``'s device type)."""
        if self._torch_mesh is None:
            self._torch_mesh = _dt.torch_mesh(self.mesh, part.device.type)
        return self._torch_mesh

    def _rewrite_checks(self, model, prologue_trace, computation_trace, call: _Call) -> None:
        """The prologue checks each parameter against what the ThunderModule holds now (this
        rank's part, on the module's device), and the computation's proxies say so too."""
        producers = {}
        for bsym in prologue_trace.bound_symbols:
            for out in bsym.flat_proxy_outs:
                producers.setdefault(out.name, bsym)
        for (kind, name), proxy in zip(call.sources, computation_trace.args):
            if kind == "parameter":
                p = model._overrides_parameters[name]
                _reshape(proxy, p)
        for bsym in prologue_trace.bound_symbols:
            if bsym.sym.id != PrimIDs.CHECK_TENSOR_SHAPE_AND_METADATA:
                continue
            t = bsym.args[0]
            src = producers.get(t.name)
            if src is None or src.sym.id != PrimIDs.UNPACK_PARAMETER:
                continue
            p = model._overrides_parameters[src.args[1]]
            _reshape(t, p)
            _, _, _, *rest = bsym.args
            bsym.args = (t, tuple(p.shape), devices.to_device(p.device).device_str(), *rest)

    def _computation(self, computation_trace, rp: RankProgram, labels: list[str], proxies: list[TensorProxy], ret,
                     matched: list[tuple[TensorProxy, int]], model):
        """Thunder's computation with its body replaced by one call of the sharded program."""
        program_sym = self._register(rp, labels, proxies, model)
        new = from_trace(computation_trace)
        for bsym in computation_trace.bound_symbols:
            if bsym.sym.id != PrimIDs.UNPACK_TRIVIAL:
                break
            new.bound_symbols.append(bsym.from_bsym())
        with tracectx(new):
            outs = program_sym(*proxies)
        new.bound_symbols.append(ret.from_bsym_swap_proxies({variableify(p): outs[i] for p, i in matched}))
        new.set_provenance(TraceProvenance(f"nvtp.ShardingTransform: plan {rp.program.plan!r} on {self.mesh.size} device(s)"))
        return new

    def _inputs(self, computation_trace, call: _Call, rp: RankProgram) -> tuple[list[str], list[TensorProxy]]:
        """The program's inputs as the caller holds them (parameters and buffers by label, each
        argument by name) and the computation trace's proxy of each."""
        tied = rp.program.traced.tied
        by_label: dict[str, Any] = {}
        names = rp.arg_names
        for (kind, key), proxy in zip(call.sources, computation_trace.args):
            if kind in ("parameter", "buffer", "attribute"):
                by_label.setdefault(tied.get(key, key), proxy)
            elif kind == "arg" and key < len(names):
                by_label.setdefault(names[key], proxy)
            elif kind == "kwarg":
                by_label.setdefault(key, proxy)
        labels: list[str] = []
        constants = rp.call.constants if rp.call is not None else {}  # the FX route's folded constants: the program's own
        for v in rp.forward_fusion.source.inputs:
            label = rp.holder(rp.forward_fusion.source.label(v.name))
            label = tied.get(label, label)
            if label in labels or label in constants:
                continue
            if label not in by_label:
                raise ShardingError(f"nvtp's program reads {label}, which Thunder's trace of the same call does not pass to its "
                                    "computation; nvtp.jit(model, ...) runs this model")
            labels.append(label)
        return labels, [by_label[label] for label in labels]

    # -- the program's symbols ----------------------------------------------------------------

    def _register(self, rp: RankProgram, labels: list[str], proxies: list[TensorProxy], model):
        """Register ``nvtp_program_N`` (forward only), ``nvtp_forward_N`` and ``nvtp_backward_N``
        with nvtp's executor for this program, and the grad transform that joins the last two."""
        ex = self._executor
        n = self._count
        self._count += 1
        f = rp.forward_fusion.source
        fwd = rp.forward_fusion
        device = devices.to_device(next((p.device for p in model._overrides_parameters.values()), torch.device("cpu")))
        user = [i for i, v in enumerate(f.outputs) if f.role(v.name) == "output"]
        bwd = rp.backward_fusion
        read = set() if bwd is None else {bwd.source.info[v.name].source for v in bwd.source.inputs if bwd.source.role(v.name) == "saved"}
        saved = [i for i, v in enumerate(f.outputs) if v.name in read]
        with_grad = rp.gradient_labels()
        differentiable = [i for i, (label, p) in enumerate(zip(labels, proxies))
                          if label in with_grad and p.requires_grad and dtypes.is_float_dtype(p.dtype)]
        user_float = [k for k, i in enumerate(user) if f.outputs[i].dtype.torch.is_floating_point]

        def out_proxy(v, requires_grad: bool) -> TensorProxy:
            shape = local_shape(v.shape, fwd.sharding(v.name), fwd.mesh)
            grad = requires_grad and v.dtype.torch.is_floating_point
            return TensorProxy(shape=shape, device=device, dtype=dtypes.to_dtype(v.dtype.torch), requires_grad=grad)

        def any_grad(args) -> bool:
            return any(isinstance(a, TensorProxy) and a.requires_grad for a in args)

        def program_meta(*args):
            return tuple(out_proxy(f.outputs[i], any_grad(args)) for i in user)

        def forward_meta(*args):
            return tuple(out_proxy(v, any_grad(args)) for v in f.outputs)

        def backward_meta(*args):
            return tuple(TensorProxy(like=args[i], requires_grad=False) for i in differentiable)

        def seed() -> int:
            return int(torch.randint(0, 2**62, (1,)).item())

        constants = rp.call.constants if rp.call is not None else {}

        def run_program(*given):
            tensors = tuple(_dt.local(t) for t in given)  # a DTensor parameter: this rank's part
            guard.check_transform(self, rp, labels, tensors, model._model, train=False)  # once: raises MiscompileError
            outs, _ = rp.forward(dict(zip(labels, tensors)) | constants, seed())
            return tuple(outs)

        def run_forward(*given):
            tensors = tuple(_dt.local(t) for t in given)
            guard.check_transform(self, rp, labels, tensors, model._model, train=True)  # once: raises MiscompileError
            _, values = rp.forward(dict(zip(labels, tensors)) | constants, seed())
            return tuple(values[v.name] for v in f.outputs)

        def run_backward(*given):
            tensors = tuple(_dt.local(t) for t in given)
            k = len(labels)
            named = dict(zip(labels, tensors[:k])) | constants
            values = {v.name: t for v, t in zip(f.inputs, rp.inputs(named))}
            values |= {f.outputs[i].name: t for i, t in zip(saved, tensors[k:k + len(saved)])}
            incoming = list(tensors[k + len(saved):])
            grads = [incoming.pop(0) if j in user_float else None for j in range(len(user))]
            params = {label: t.detach() for label, t in named.items() if label not in rp.arg_names}  # and buffers
            by_grad = rp.backward(values, params, grads, device=device.device_str())
            return tuple(_grad_like(by_grad.get(labels[i]), given[i]) for i in differentiable)

        program_sym = ex.register_operator(f"nvtp_program_{n}", meta=program_meta, fn=run_program)
        forward_sym = ex.register_operator(f"nvtp_forward_{n}", meta=forward_meta, fn=run_forward)
        backward_sym = ex.register_operator(f"nvtp_backward_{n}", meta=backward_meta, fn=run_backward)

        def grad_transform(*args):
            results = forward_sym(*args)
            outs = [results[i] for i in user]
            cotangents = [get_grad(outs[k]) for k in user_float]
            grads = backward_sym(*args, *(results[i] for i in saved), *cotangents)
            for i, g in zip(differentiable, grads):
                put_grad(args[i], g)
            return tuple(outs)

        ex.register_implementation(program_sym, program_sym, grad_transform=grad_transform)
        ex.register_implementation(forward_sym, forward_sym)
        ex.register_implementation(backward_sym, backward_sym)
        return program_sym

    # -- state dicts --------------------------------------------------------------------------

    def transform_state_dict_for_submodule(self, model, submodule_name: str, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Whole tensors (``jm.load_original_state_dict``) -> this rank's parts, for parameters placed already."""
        prefix = f"{submodule_name}." if submodule_name else ""
        out = {}
        for k, v in state_dict.items():
            placement = self._placements.get(prefix + k)
            if placement is not None and not is_replicate(placement):
                v = spmd.shard_tensor(v, placement, self.mesh, self.comm.rank)
            if placement is not None and self._uses_dtensor():
                v = _dt.as_dtensor(v, placement, self._mesh_of(v), self._whole_shapes[prefix + k])
            out[k] = v
        return out

    def reverse_transform_state_dict_for_submodule(self, model, submodule_name: str, state_dict: dict[str, Any]) -> dict[str, Any]:
        """This rank's parts -> whole tensors (``jm.original_state_dict()``; a collective: every rank calls it)."""
        prefix = f"{submodule_name}." if submodule_name else ""
        out = {}
        for k, v in state_dict.items():
            placement = self._placements.get(prefix + k)
            out[k] = v if placement is None else gather(_dt.local(v), placement, self._whole_shapes[prefix + k], self.comm)
        return out


# ---------------------------------------------------------------------------------------------
# reading Thunder's traces


def _call_of(prologue_trace, computation_trace) -> _Call:
    """The call the prologue unpacks: positional and keyword arguments (tensors as meta tensors,
    numbers and strings as they are, an argument the prologue never reads as None) and where each
    computation input comes from."""
    args_proxy = kwargs_proxy = None
    n_args = 0
    positional: dict[int, Any] = {}
    keywords: dict[str, Any] = {}
    origin: dict[str, tuple[str, Any]] = {}
    for bsym in prologue_trace.bound_symbols:
        sid = bsym.sym.id
        if sid == PrimIDs.UNPACK_TRIVIAL and isinstance(bsym.output, Proxy) and bsym.output.name in ("args", "kwargs"):
            if bsym.output.name == "args":
                args_proxy = bsym.output
            else:
                kwargs_proxy = bsym.output
        elif sid == PrimIDs.CHECK_LEN and bsym.args[0] is args_proxy:
            n_args = int(bsym.args[1])
        elif sid == PrimIDs.UNPACK_GETITEM and bsym.args[0] is args_proxy and args_proxy is not None:
            positional[int(bsym.args[1])] = _value(bsym.output)
            if isinstance(bsym.output, Proxy):
                origin[bsym.output.name] = ("arg", int(bsym.args[1]))
        elif sid == PrimIDs.UNPACK_GETITEM and bsym.args[0] is kwargs_proxy and kwargs_proxy is not None:
            keywords[str(bsym.args[1])] = _value(bsym.output)
            if isinstance(bsym.output, Proxy):
                origin[bsym.output.name] = ("kwarg", str(bsym.args[1]))
    for name, source in module_state(prologue_trace).items():  # parameters, buffers, tensor attributes by path
        origin.setdefault(name, source)
    sources = []
    for proxy in computation_trace.args:
        source = origin.get(proxy.name, ("other", None)) if isinstance(proxy, Proxy) else ("other", None)
        if source[0] == "other" and isinstance(proxy, TensorProxy):
            raise InputError(f"the computation reads tensor {proxy.name}, which the prologue does not take from the module or "
                             "straight from an argument (a tensor inside a list, tuple or dict argument?); "
                             "nvtp.ShardingTransform takes modules whose arguments are tensors, numbers and strings")
        sources.append(source)
    args = tuple(positional.get(i) for i in range(n_args))
    return _Call(args, keywords, sources)


def _value(x: Any) -> Any:
    """An unpacked argument as the driver traces it: a tensor as a meta tensor, a number as its value."""
    if isinstance(x, TensorProxy):
        return torch.empty(tuple(x.shape), dtype=dtypes.to_torch_dtype(x.dtype), device="meta", requires_grad=x.requires_grad)
    if isinstance(x, NumberProxy):
        return x.value
    return x


def _describe(args: tuple) -> tuple:
    return tuple((tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else ("value", repr(a)) for a in args)


def _check_no_updates(epilogue_trace) -> None:
    """Refuse a module that sets attributes or buffers when called (Thunder's epilogue does that):
    the program nvtp runs computes outputs and gradients only. (In-place updates inside the
    computation, a buffer's running statistics, nvtp's capture refuses, naming the op and line.)"""
    writes = (PrimIDs.PACK_BUFFER, PrimIDs.PACK_ATTR, PrimIDs.PACK_SETITEM)  # building the output object (a ModelOutput) is no write
    if epilogue_trace is not None and any(b.sym.id in writes for b in epilogue_trace.bound_symbols):
        raise InputError("the module sets attributes or buffers when called (Thunder's epilogue is not empty); "
                         "nvtp.ShardingTransform runs nvtp's program, which computes outputs and gradients only")


def _outputs(computation_trace, rp: RankProgram) -> tuple[Any, list[tuple[TensorProxy, int]]]:
    """The computation's return, and each tensor of the module's output it computes with the
    index of the program's output that is it: matched by shape and dtype, one each."""
    ret = computation_trace.bound_symbols[-1]
    if ret.sym.id != PrimIDs.RETURN:
        raise ShardingError(f"Thunder's computation trace ends in {ret.sym.name}, not a return; nvtp.ShardingTransform cannot replace it")
    result = ret.args[0]
    output = result["output"] if isinstance(result, dict) else result
    args = {p.name for p in computation_trace.args if isinstance(p, Proxy)}
    leaves = [p for p in tree_flatten(output)[0] if isinstance(p, TensorProxy) and p.name not in args]  # an argument passed through stays
    values = rp.output_values()
    if len(leaves) != len(values):
        raise ShardingError(f"Thunder's trace returns {len(leaves)} computed tensor(s), nvtp's program {len(values)}; "
                            "nvtp.jit(model, ...) runs this model")
    matched = []
    free = list(range(len(values)))
    for p in leaves:
        key = (tuple(p.shape), dtypes.to_torch_dtype(p.dtype))
        fits = [i for i in free if (tuple(values[i].shape), values[i].dtype.torch) == key]
        if len(fits) != 1:
            raise ShardingError(f"Thunder's output {p.name} ({list(key[0])}, {key[1]}) matches {len(fits)} of the outputs of nvtp's "
                                f"program ({', '.join(f'{list(v.shape)} {v.dtype.torch}' for v in values)}); nvtp.ShardingTransform "
                                "maps outputs by shape and dtype: return one tensor (the loss) or tensors of different shapes, "
                                "or use nvtp.jit(model, ...)")
        free.remove(fits[0])
        matched.append((p, fits[0]))
    return ret, matched


def _reshape(proxy: TensorProxy, t: torch.Tensor) -> None:
    """Make ``proxy`` describe ``t``: its shape (this rank's part) and device, as Thunder's fsdp and
    column_parallel transforms do with the proxies of the parameters they shard."""
    proxy._shape = tuple(t.shape)
    proxy._numel = t.numel()
    proxy._device = devices.to_device(t.device)


def _grad_like(g: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor:
    """Gradient ``g`` (this rank's part; None: zeros) as ``param`` holds it: a DTensor placed like a DTensor parameter."""
    if g is None:
        g = torch.zeros_like(_dt.local(param))
    return _dt.grad_like(param, g) if isinstance(param, _dt.DTensor) else g


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
