"""``nvtp.jit`` on a mesh with a "pp" axis: a pipeline of stages, each sharded over its (dp, tp) sub-mesh.

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    model = nvtp.jit(GPT(cfg), plan="megatron", mesh=mesh, microbatches=4)   # schedule="1f1b" (default) or "gpipe"
    loss = model(idx, targets); loss.backward(); opt.step()                  # idx: this dp rank's batch

On the first call every rank asks the driver for the same ``PipelineProgram``
(``nvtp.driver.compile_pipeline``), lowers only its own stage's Program for the backend, and
keeps only its stage's parameters: each becomes this rank's part of it (plain tensors, placed by
the stage's plan), every other parameter's storage is freed (``p.data`` empty, its ``.grad``
stays None, so optimizers skip it; ``full_parameters()`` gathers every parameter whole). A buffer
(a rotary table) is read by every stage that needs it. ``checkpoint_state()`` views the stage's
parameters as DTensors on its (dp, tp) sub-mesh, for ``nvtp.save_checkpoint`` / ``load_checkpoint``.

A call runs the whole step's schedule inside one ``torch.autograd.Function``: the forwards and
backwards of every microbatch in the schedule's order (GPipe or 1F1B, ``nvtp.pipeline.schedule``),
activations sent and their gradients received point-to-point on the pp axis as the program's
``p2p()`` lists them, parameter gradients summed over microbatches; ``loss.backward()`` then hands
them to autograd. The loss returned is the mean of the microbatches' losses (the whole batch's),
broadcast from the last stage to every rank. A weight tied across stages (an embedding and the
output head) has its gradient summed over the stages holding it (Megatron's embedding group), so
both copies take the same step and stay equal. Under ``torch.no_grad()`` only the forwards run.
Random ops (dropout) draw from a seed taken from torch's generator each call (seed every rank
alike, as for ``nvtp.jit``), made distinct per stage and microbatch.
"""

from __future__ import annotations

import contextlib
from typing import Any
import hashlib

import torch
import torch.distributed as dist

from nvtp import driver, guard, precheck
from nvtp import dtensor as _dt
from nvtp.errors import InputError
from nvtp.execute import backends, collectives, kernels, spmd
from nvtp.execute.collectives import DistComm, MeshComm, SoloComm
from nvtp.execute.launch import start_watchdog
from nvtp.execute.step import RankProgram
from nvtp.frontend import user_code
from nvtp.frontend.recompute import check_mode as recompute_mode
from nvtp.parameters import full_tensor, place, replace_parameter
from nvtp.frontend.tied import aliases
from nvtp.pipeline import calls, schedule as sched
from nvtp.sharding.axes.pp import layout_of
from nvtp.sharding.axes import MeshError
from nvtp.sharding.placements import local_shape, REPLICATE
from nvtp.driver import tensor_attributes
from nvtp.sharding.plans import check_plan

FORWARD_TAG, BACKWARD_TAG = 11, 12


class PipelineModule(torch.nn.Module):
    """``module`` pipelined over a (pp, dp, tp) mesh; call it as you would call ``module``."""

    def __init__(self, module: torch.nn.Module, plan: Any = "megatron", mesh: Any = None, *, microbatches: int = 1,
                 schedule: str = "1f1b", cut: Any = None, backend: str = "auto", frontend: str = "auto",
                 timeout: float | None = 60.0, verify: bool | float = True, compile: str = "kernels", recompute: str = "none"):
        super().__init__()

        self.module = module
        self.plan = plan
        self.layout = layout_of(mesh)
        self.microbatches = microbatches
        self.schedule = sched.check(schedule)
        self.compile_mode = kernels.check_mode(compile)
        self.cut = cut
        self.frontend = frontend
        self.verify = guard.option(verify)  # the first step checked against eager (nvtp/guard.py)
        self.recompute = recompute_mode(recompute)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self.layout.size != world:
            lay = self.layout
            raise MeshError(f"the mesh pp={lay.pp} x dp={lay.dp} x tp={lay.tp} has {lay.size} devices but the process group has "
                            f"{world} rank(s); start {lay.size} processes (torchrun --nproc-per-node {lay.size}) or pick pp*dp*tp = {world}")
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise InputError(f"microbatches={microbatches!r}: give a positive number of microbatches per step")

        check_plan(plan, driver.plan_names(module), type(module).__name__)
        self.backend = backends.resolve(backend, next((p.device.type for p in module.parameters()), "cpu")).name
        self.rank = dist.get_rank() if world > 1 else 0
        if timeout is not None and world > 1:  # names a dead or silent rank and stops this one (nvtp.execute.watchdog)
            start_watchdog(timeout)
        self.stage, self.dp_index, self.tp_index = self.layout.coords(self.rank)
        self.program = None  # the PipelineProgram, after the first call
        self._groups: dict[str, Any] = {}
        self._shapes = {n: tuple(p.shape) for n, p in module.named_parameters(remove_duplicate=False)}
        self._tied = aliases(module)
        self._make_groups()

    # -- process groups ---------------------------------------------------------------------

    def _make_groups(self) -> None:
        """Every rank creates every group, in one order (torch.distributed's rule); keeps its own."""
        if self.layout.size == 1:
            return
        lay = self.layout
        stage_groups = [[lay.rank(s, d, t) for d in range(lay.dp) for t in range(lay.tp)] for s in range(lay.pp)]
        for axis, groups in (("pipeline", lay.pipeline_groups()), ("data", lay.data_groups()), ("tensor", lay.tensor_groups()),
                             ("stage", stage_groups)):
            for ranks in groups:
                g = dist.new_group(ranks)
                if self.rank in ranks:
                    self._groups[axis] = g

    def _stage_comm(self):
        lay = self.layout
        if lay.dp > 1:
            pos = lay.position(self.rank)
            return MeshComm(pos, lay.dp * lay.tp, [DistComm(self._groups["data"]), DistComm(self._groups["tensor"])])
        return DistComm(self._groups["tensor"]) if lay.tp > 1 else SoloComm()

    # -- compile ----------------------------------------------------------------------------

    def compile(self, *args: Any) -> "PipelineModule":
        """Plan and lower for arguments like ``args`` (this rank's batch), without running."""
        if self.program is None:
            with collectives.PROGRESS.busy("tracing and sharding the model"):
                self._compile(args)
        return self

    def lower(self, *args: Any):
        """The ``PipelineProgram`` a call with arguments like these runs, before any step (as
        ``jax.jit(f).lower(x)``): ``.steps(stage)``, ``.as_text()``, ``.programs[stage]``."""
        return self.compile(*args).program

    @property
    def last(self):
        """This rank's stage ``Program`` (None before the first call), as ``ShardedModule.last``
        is the whole one's: ``last.seconds["compile"]`` with ``compile="inductor"`` is what this
        rank spent compiling its stage's pieces (``nvtp.execute.inductor``)."""
        return None if self.program is None else self.program.programs[self.stage]

    def _compile(self, args: tuple) -> None:
        device = next((p.device.type for p in self.module.parameters()), "cpu")
        for a in args:
            if isinstance(a, torch.Tensor) and a.device.type != device:
                raise InputError(f"an argument is on {a.device}, the module's parameters on {device}; move it with .to({device!r})")
        precheck.check_call(self.module, None, args)  # what the arguments already tell, before tracing
        self.program = pp = driver.compile_pipeline(self.module, *args, plan=self.plan, mesh=self.layout,
                                                    microbatches=self.microbatches, schedule=self.schedule, cut=self.cut,
                                                    backend=self.backend, frontend=self.frontend, recompute=self.recompute,
                                                    cached=lambda t: guard.will_check_pipeline(t.forward, self.verify))
        self._arg_shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        mine = pp.programs[self.stage]
        self._comm = self._stage_comm()
        self._pos = self.layout.position(self.rank)
        self._runner = RankProgram(mine, backends.BACKENDS[self.backend].lower(mine, self._comm, compile=self.compile_mode), self._pos)
        # which stages read each parameter (by its first name): a weight several stages read gets a group
        params = dict(self.module.named_parameters(remove_duplicate=False))
        first = {n: self._tied.get(n, n) for n in params}
        self._holders = {name: set(stages) for name, stages in pp.holders().items()}
        self._tie_groups: dict[str, Any] = {}
        lay = self.layout
        for name in sorted(n for n, st in self._holders.items() if len(st) > 1):
            for d in range(lay.dp):
                for t in range(lay.tp):
                    ranks = [lay.rank(s, d, t) for s in sorted(self._holders[name])]
                    g = dist.new_group(ranks) if lay.size > 1 else None
                    if self.rank in ranks:
                        self._tie_groups[name] = g
        # every parameter a DTensor on torch's (pp, dp, tp) mesh, held by its first stage (OnStage)
        self._labels = [label for label in pp.stages[self.stage].parameters if label in params]
        self._place_parameters(params, first)
        self._buffers = self._stage_buffers(params)
        self._p2p = pp.p2p()
        self.sent: list[dict[str, Any]] = []  # what the last step sent: phase, label, bytes (tests count it against p2p())
        self.moved: list[dict[str, Any]] = []  # the last step's sends and recvs in order (tests count it against steps(stage))

    def _place_parameters(self, params: dict[str, torch.nn.Parameter], first: dict[str, str]) -> None:
        """Each parameter of the module becomes a DTensor on torch's (pp, dp, tp) mesh, placed
        ``OnStage(0, s)`` on the stage axis for ``s`` the first stage that reads it (the whole model
        has one copy of each parameter; a stage that reads none of it holds an empty part) and as
        that stage's program places it on dp and tp. So ``model.parameters()``, ``state_dict()``,
        ``clip_grad_norm_`` and DCP see the whole model, each parameter once, on every rank alike.
        A weight tied across stages (an embedding read again by the last stage's head) is held by
        its first stage; every later stage that reads it keeps a replica, refreshed from the holder
        at the start of each step (``_refresh_replicas``), its gradient reduced to the holder."""
        pp, lay = self.program, self.layout
        mesh3 = self._torch_mesh() if lay.size > 1 else None
        owner_of: dict[str, int] = {}
        for name in dict.fromkeys(first.values()):
            owner_of[name] = min(self._holders.get(name, {0}))
        placed: dict[int, Any] = {}
        self._params: dict[str, torch.nn.Parameter] = {}  # every parameter object once, under its first name
        self._replicas: dict[str, torch.Tensor] = {}  # first name -> this rank's replica of a weight another stage holds
        for label, p in params.items():
            name = first[label]
            if id(p) in placed:
                continue
            owner = owner_of[name]
            program = pp.programs[owner]
            stage_label = next((lab for lab in pp.stages[owner].parameters if first.get(lab) == name), None)
            placement = program.parameters[stage_label] if stage_label is not None else None
            sharding = self._per_axis(placement)
            whole = p.detach()
            mine = self._part(whole, placement, program) if placement is not None else whole
            if name in self._tie_groups and self.stage != owner and any(first.get(lab) == name for lab in self._labels):
                self._replicas[name] = mine.clone()  # this stage reads a weight an earlier stage holds
            if self.stage != owner:
                mine = mine.narrow(0, 0, 0).clone() if mine.ndim else mine.clone()
            if mesh3 is not None:
                if not whole.ndim:
                    raise InputError(f"{name}: a 0-dimensional parameter cannot be held by one pipeline stage; make it a "
                                     "1-element tensor (shape [1])")
                new = place(p, mine.contiguous(), (_dt.OnStage(0, owner), *sharding), tuple(whole.shape), None, mesh3)
                replace_parameter(self.module, p, new)
            else:
                with torch.no_grad():
                    p.data = mine
                new = p
            placed[id(p)] = new
            self._params[name] = new
        self._all = list(self._params.values())  # every parameter once, in one order on every rank

    def _per_axis(self, placement: Any) -> tuple:
        """A stage program's placement on its (dp, tp) or (tp,) sub-mesh, one per axis of (dp, tp)."""
        if placement is None:
            return (REPLICATE, REPLICATE)
        if isinstance(placement, tuple):
            return placement if len(placement) == 2 else (REPLICATE, *placement)
        return (REPLICATE, placement)

    def _part(self, whole: torch.Tensor, placement: Any, program: Any) -> torch.Tensor:
        """This rank's part of ``whole`` as ``program`` (any stage's) places it, at this rank's (dp, tp) position."""
        return spmd.shard_tensor(whole, placement, program.mesh, self.layout.position(self.rank))

    def local(self, label: str) -> torch.Tensor:
        """What this stage's fusions read for parameter ``label``: its part, or its replica of a weight another stage holds."""
        name = self._tied.get(label, label)
        if name in self._replicas:
            return self._replicas[name]
        return _dt.local(self._params[name])

    def _stage_buffers(self, params: dict[str, Any]) -> dict[str, torch.Tensor]:
        """What this stage reads of the module that is not a parameter (a rotary table: a buffer or
        a tensor attribute), by label; whole, as every stage that reads it holds it."""
        wanted = [label for label in self.program.stages[self.stage].parameters if label not in params]
        if not wanted:
            return {}
        held = dict(self.module.named_buffers()) | tensor_attributes(self.module) | calls.constants(self.program.traced)
        missing = [label for label in wanted if label not in held]
        if missing:
            raise InputError(f"stage {self.stage} reads {', '.join(missing)}, which {type(self.module).__name__} holds neither as a "
                             "parameter, a buffer nor a tensor attribute; keep it on the module (or register it with self.register_buffer)")
        mine = self.program.programs[self.stage]
        return {label: spmd.shard_tensor(held[label], mine.parameters[label], mine.mesh, self._pos) if label in mine.parameters
                else held[label] for label in wanted}  # this rank's part, as its parameters are (a table: whole)

    # -- run --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        user_code.check_hooks(self.module)  # a hook registered since nvtp.jit would never fire: refused
        if kwargs:
            args, _ = driver.bind_call(self.module, "thunder", args, kwargs)
        first = self.program is None
        if first:
            with collectives.PROGRESS.busy("tracing and sharding the model"):  # not hung: the watchdog gives it COMPILE_S
                self._compile(args)
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        if shapes != self._arg_shapes:
            raise InputError(f"the pipeline was compiled for arguments of shapes {list(self._arg_shapes)}, got {list(shapes)}; "
                             "pass the same shapes every step")
        train = torch.is_grad_enabled()
        if train and self.program.programs[self.stage].backward is None:
            raise InputError("this pipeline was compiled by a call under torch.no_grad(), forward only, and cannot train; make "
                             "the first call a training step, or call model.compile(*inputs) with gradients enabled first")
        with collectives.PROGRESS.busy("running its first step") if first else contextlib.nullcontext():  # lowers what it runs
            guard.check_pipeline(self, args, train)  # once: a step run for the check, raises MiscompileError
            loss = _PipeRun.apply(self, args, train, *self._all)
        return calls.result(self.program.traced, loss)  # the loss, or the model's object holding it

    def _step(self, args: tuple, train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run this rank's actions for one step: (the step's loss on every rank, gradient by label)."""
        pp, lay, m = self.program, self.layout, self.microbatches
        rp = self._runner
        self.moved = []  # every send, recv, broadcast and reduce on the pp axis, in the order this rank ran them
        if self._tie_groups:
            self._refresh_replicas()
        mine = pp.programs[self.stage]
        f = mine.forward.source
        b = mine.backward.source if mine.backward is not None else None
        micro = [tuple(a.chunk(m)[i] if isinstance(a, torch.Tensor) and a.ndim else a for a in args) for i in range(m)]
        recv_f = [p for p in self._p2p if p["phase"] == "forward" and p["dst"] == self.stage]
        send_f = [p for p in self._p2p if p["phase"] == "forward" and p["src"] == self.stage]
        recv_b = [p for p in self._p2p if p["phase"] == "backward" and p["dst"] == self.stage]
        send_b = [p for p in self._p2p if p["phase"] == "backward" and p["src"] == self.stage]
        values: dict[int, dict[str, Any]] = {}
        grads: dict[str, torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        handles = []
        # random ops (dropout) draw from a seed fresh each call, as nvtp.jit's do, different per stage and
        # microbatch; every rank draws it alike from torch's generator (seed every rank alike)
        base = int(torch.randint(0, 2**62, (1,)).item())
        self.sent = []
        self.seeds = []  # the seed of each forward this call ran (tests: distinct per stage and microbatch)
        loss_outputs = [v.name for v in rp.output_values() if not f.label(v.name).startswith("stage")]

        def peer(stage: int) -> int:
            return lay.rank(stage, self.dp_index, self.tp_index)

        def send(t: torch.Tensor, p: dict, tag: int) -> None:
            t = t.detach().contiguous()
            if list(t.shape) != p["local_shape"]:
                raise RuntimeError(f"nvtp: stage {self.stage} would send {p['label']} of shape {list(t.shape)}, planned "
                                   f"{p['local_shape']} (a bug in nvtp's pipeline plan)")
            handles.append(collectives.isend(t, peer(p["dst"]), tag))
            self.sent.append({"phase": p["phase"], "label": p["label"], "bytes": t.numel() * t.element_size()})
            self.moved.append({"kind": "send", "phase": p["phase"], "label": p["label"], "peer": p["dst"], "bytes": t.numel() * t.element_size()})

        def recv(p: dict, dtype: torch.dtype, tag: int) -> torch.Tensor:
            buf = torch.empty(p["local_shape"], dtype=dtype)
            collectives.recv(buf, peer(p["src"]), tag)
            self.moved.append({"kind": "recv", "phase": p["phase"], "label": p["label"], "peer": p["src"], "bytes": buf.numel() * buf.element_size()})
            return buf

        for action in sched.actions(self.schedule, self.stage, lay.pp, m, backward=train):
            i = action.microbatch
            if action.kind == "F":
                named: dict[str, Any] = {label: self.local(label) for label in self._labels} | self._buffers
                named |= calls.arguments(pp.traced, self.module, micro[i])  # by label (nvtp/pipeline/calls.py)
                for p in recv_f:
                    v = f.value(p["value"])
                    named[p["label"]] = recv(p, v.dtype.torch, FORWARD_TAG)
                self.seeds.append(_seed(base, self.stage, i))
                user, vals = rp.forward(named, seed=self.seeds[-1])
                by_name = {v.name: t for v, t in zip(rp.output_values(), user)}
                for p in send_f:
                    send(by_name[p["value"]], p, FORWARD_TAG)
                losses += [by_name[n] for n in loss_outputs]
                if train:
                    values[i] = vals
                continue
            # backward of microbatch i
            received = {}
            for p in recv_b:  # defined in this stage's backward under the sender's name
                received[p["label"]] = recv(p, b.value(p["value"]).dtype.torch, BACKWARD_TAG)
            vals = values.pop(i)
            inputs = []
            for v in b.inputs:
                info = b.info[v.name]
                if info.role == "parameter":
                    inputs.append(self.local(info.label) if info.label in self._labels else self._buffers[info.label])
                elif info.role == "saved":
                    inputs.append(vals[info.source])
                elif info.label in received:
                    inputs.append(received[info.label])
                else:  # the loss's gradient: the step's loss is the mean over microbatches
                    shape = local_shape(v.shape, mine.backward.sharding(v.name), mine.mesh)
                    inputs.append(torch.full(shape, 1.0 / m, dtype=v.dtype.torch))
            vals = received = None  # the run takes the list: each saved value freed after its last use
            outs = rp.run("backward", inputs, seed=_seed(base, self.stage, i), take=True)
            by_name = {v.name: t for v, t in zip(b.outputs, outs)}
            for p in send_b:
                send(by_name[p["value"]], p, BACKWARD_TAG)
            for v in b.outputs:
                label = b.grad_of(v.name)
                if label in self._labels:
                    g = by_name[v.name]
                    grads[label] = g if label not in grads else grads[label] + g
        for h in handles:
            collectives.wait_sent(h)
        if train:
            grads = self._join_tied(grads)
        # the loss: the mean over microbatches, from the last stage to every rank of this pp group
        loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32)
        if lay.pp > 1:
            loss = loss.detach().clone().contiguous()
            DistComm(self._groups["pipeline"]).broadcast(loss, peer(lay.pp - 1))
            self.moved.append({"kind": "broadcast", "phase": "forward", "label": "loss", "peer": lay.pp - 1,
                               "bytes": loss.numel() * loss.element_size()})
        return loss, grads

    def _join_tied(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One gradient per parameter, by its first name: names of one tied parameter summed in a
        stage, then a weight several stages read reduced to the stage that holds it (Megatron's
        embedding group sums it there)."""
        by_first: dict[str, torch.Tensor] = {}
        for label, g in grads.items():
            k = self._tied.get(label, label)
            by_first[k] = g if k not in by_first else by_first[k] + g
        for name in sorted(self._tie_groups):
            owner = min(self._holders[name])
            g = by_first.get(name)
            if g is None:
                g = torch.zeros_like(self.local(name))
            g = g.contiguous().clone()
            DistComm(self._tie_groups[name]).reduce(g, self.layout.rank(owner, self.dp_index, self.tp_index))
            self.moved.append({"kind": "reduce", "phase": "backward", "label": f"grad of {name}", "peer": owner,
                               "bytes": g.numel() * g.element_size()})
            by_first[name] = g
        return by_first

    def _refresh_replicas(self) -> None:
        """At the start of a step: each replica of a weight an earlier stage holds takes the
        holder's value (the optimizer stepped the holder's only)."""
        for name in sorted(self._tie_groups):
            owner = min(self._holders[name])
            buf = self._replicas.get(name)
            if buf is None:
                buf = _dt.local(self._params[name]).contiguous()
            DistComm(self._tie_groups[name]).broadcast(buf, self.layout.rank(owner, self.dp_index, self.tp_index))
            self.moved.append({"kind": "broadcast", "phase": "forward", "label": name, "peer": owner,
                               "bytes": buf.numel() * buf.element_size()})

    def _gradients(self, grads: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradient of each parameter in ``self._all``'s order: this rank's part (DTensors placed
        like their parameters; an empty part where another stage holds it), so every rank hands
        every parameter a gradient and torch's utilities see the same list everywhere."""
        out = []
        for name, p in self._params.items():
            g = grads.get(name)
            part = _dt.local(p)
            if g is None or part.numel() == 0 and g.numel() != 0:
                g = torch.zeros_like(part)
            out.append(_dt.grad_like(p, g) if isinstance(p, _dt.DTensor) else g)
        return out

    # -- whole parameters -----------------------------------------------------------------

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on every rank (collectives: every rank calls it, as ``full_tensor`` is)."""
        return {n: full_tensor(p) for n, p in self.module.named_parameters()}

    # -- state: the wrapped module's own keys, as on every other mesh ----------------------------

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict under its own keys: each parameter a DTensor held by its stage."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _fqn_modifiers(self) -> dict[str, str]:
        """DCP's contract for a wrapper whose state dict leaves out its child's prefix (as
        ``nvtp.jit``'s module, DDP's and FSDP's): ``get_model_state_dict(model)`` works on it."""
        inner = self.module
        return {n: "module" for n in (*inner._modules, *inner._parameters, *inner._buffers)}

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The state DCP saves and loads for this pipeline: the module's parameters under their own
        names (DTensors: each rank's part is the parameter's storage, so ``dcp.load`` reads in place)."""
        if self.program is None:
            raise InputError("compile the pipeline before a checkpoint (model.compile(*inputs), or one training step): "
                             "until then no rank knows its stage's parameters")
        return dict(self.module.named_parameters())

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        """Take ``state`` (``checkpoint_state()``'s keys, as ``dcp.load`` filled them) into the
        parameters (a no-op where DCP read in place), and refresh the replicas of tied weights."""
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                t, mine = _dt.local(state[name]), _dt.local(p)
                if t.data_ptr() != mine.data_ptr() and t.numel():
                    mine.copy_(t)

    def _torch_mesh(self):
        """torch's DeviceMesh over the whole (pp, dp, tp) layout (rank = (pp*dp + d)*tp + t); made once."""
        if getattr(self, "_torch_global", None) is None:
            self._torch_global = self.layout.torch_mesh("cpu")
        return self._torch_global


def _seed(base: int, stage: int, microbatch: int) -> int:
    """The seed of a stage's fusions for one microbatch of a call: distinct per stage and microbatch."""
    digest = hashlib.sha256(repr((base, stage, microbatch)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)


class _PipeRun(torch.autograd.Function):
    """Forward: the whole schedule (forwards and, when training, backwards). Backward: its gradients."""

    @staticmethod
    def forward(ctx, module: PipelineModule, args: tuple, train: bool, *params):
        loss, grads = module._step(args, train)
        ctx.grads = module._gradients(grads) if train else [None] * len(params)
        return loss

    @staticmethod
    def backward(ctx, g):
        return (None, None, None, *[None if x is None else x * _dt.local(g) if isinstance(x, _dt.DTensor) else x * g
                                    for x in ctx.grads])


__all__ = ["PipelineModule"]
