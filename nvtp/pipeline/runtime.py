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

from typing import Any

import torch

from nvtp import driver, precheck
from nvtp.errors import InputError
from nvtp.execute import backends, collectives, spmd
from nvtp.execute.collectives import DistComm, MeshComm, SoloComm
from nvtp.execute.launch import start_watchdog
from nvtp.execute.step import RankProgram
from nvtp.frontend import user_code
from nvtp.frontend.tied import aliases
from nvtp.pipeline import schedule as sched
from nvtp.pipeline.layout import layout_of
from nvtp.sharding.axes import MeshError
from nvtp.sharding.placements import local_shape

FORWARD_TAG, BACKWARD_TAG = 11, 12


class PipelineModule(torch.nn.Module):
    """``module`` pipelined over a (pp, dp, tp) mesh; call it as you would call ``module``."""

    def __init__(self, module: torch.nn.Module, plan: Any = "megatron", mesh: Any = None, *, microbatches: int = 1,
                 schedule: str = "1f1b", cut: Any = None, backend: str = "auto", frontend: str = "auto",
                 timeout: float | None = 60.0):
        super().__init__()
        import torch.distributed as dist

        self.module = module
        self.plan = plan
        self.layout = layout_of(mesh)
        self.microbatches = microbatches
        self.schedule = sched.check(schedule)
        self.cut = cut
        self.frontend = frontend
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self.layout.size != world:
            lay = self.layout
            raise MeshError(f"the mesh pp={lay.pp} x dp={lay.dp} x tp={lay.tp} has {lay.size} devices but the process group has "
                            f"{world} rank(s); start {lay.size} processes (torchrun --nproc-per-node {lay.size}) or pick pp*dp*tp = {world}")
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise InputError(f"microbatches={microbatches!r}: give a positive number of microbatches per step")
        from nvtp.sharding.plans import check_plan

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
        import torch.distributed as dist

        if self.layout.size == 1:
            return
        lay = self.layout
        stage_groups = [[lay.rank(s, d, t) for d in range(lay.dp) for t in range(lay.tp)] for s in range(lay.pp)]
        for axis, groups in (("pp", lay.groups("pp")), ("dp", lay.groups("dp")), ("tp", lay.groups("tp")), ("stage", stage_groups)):
            for ranks in groups:
                g = dist.new_group(ranks)
                if self.rank in ranks:
                    self._groups[axis] = g

    def _stage_comm(self):
        lay = self.layout
        if lay.dp > 1:
            pos = lay.position(self.rank)
            return MeshComm(pos, lay.dp * lay.tp, [DistComm(self._groups["dp"]), DistComm(self._groups["tp"])])
        return DistComm(self._groups["tp"]) if lay.tp > 1 else SoloComm()

    # -- compile ----------------------------------------------------------------------------

    def compile(self, *args: Any) -> "PipelineModule":
        """Plan and lower for arguments like ``args`` (this rank's batch), without running."""
        if self.program is None:
            with collectives.PROGRESS.busy("tracing and sharding the model"):
                self._compile(args)
        return self

    def _compile(self, args: tuple) -> None:
        import torch.distributed as dist

        device = next((p.device.type for p in self.module.parameters()), "cpu")
        for a in args:
            if isinstance(a, torch.Tensor) and a.device.type != device:
                raise InputError(f"an argument is on {a.device}, the module's parameters on {device}; move it with .to({device!r})")
        precheck.check_call(self.module, None, args)  # what the arguments already tell, before tracing
        self.program = pp = driver.compile_pipeline(self.module, *args, plan=self.plan, mesh=self.layout,
                                                    microbatches=self.microbatches, schedule=self.schedule, cut=self.cut,
                                                    backend=self.backend, frontend=self.frontend)
        self._arg_shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        mine = pp.programs[self.stage]
        self._comm = self._stage_comm()
        self._pos = self.layout.position(self.rank)
        self._runner = RankProgram(mine, backends.BACKENDS[self.backend].lower(mine, self._comm), self._pos)
        # which stages hold each parameter (by any of its names): tied weights across stages get a group
        params = dict(self.module.named_parameters(remove_duplicate=False))
        first = {n: self._tied.get(n, n) for n in params}
        holders: dict[str, set[int]] = {}
        for s in pp.stages:
            for label in s.parameters:
                if label in first:
                    holders.setdefault(first[label], set()).add(s.index)
        self._holders = holders
        self._tie_groups: dict[str, Any] = {}
        lay = self.layout
        for name in sorted(n for n, st in holders.items() if len(st) > 1):
            for d in range(lay.dp):
                for t in range(lay.tp):
                    ranks = [lay.rank(s, d, t) for s in sorted(holders[name])]
                    g = dist.new_group(ranks) if lay.size > 1 else None
                    if self.rank in ranks:
                        self._tie_groups[name] = g
        # this rank's parameters: its part of each it holds; the others' storage freed
        self._labels = [label for label in pp.stages[self.stage].parameters if label in params]
        placed: dict[int, Any] = {}
        for label in self._labels:
            p, placement = params[label], mine.parameters[label]
            if id(p) in placed:
                if placed[id(p)] != placement:
                    raise MeshError(f"{label} and {first[label]} are one tied parameter placed {placement} and {placed[id(p)]} in "
                                    f"stage {self.stage}; plan both names alike")
                continue
            placed[id(p)] = placement
            with torch.no_grad():
                p.data = spmd.shard_tensor(p.data, placement, mine.mesh, self._pos)
        held = set(placed)
        for name, p in self.module.named_parameters():
            if id(p) not in held:
                with torch.no_grad():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None
        self._params = {label: params[label] for label in self._labels}
        self._buffers = self._stage_buffers(params)
        seen: set[int] = set()  # one label per parameter object: a tie inside a stage is one autograd input
        self._unique = [lab for lab in self._labels if not (id(params[lab]) in seen or seen.add(id(params[lab])))]
        self._p2p = pp.p2p()
        self.sent: list[dict[str, Any]] = []  # what the last step sent: phase, label, bytes (tests count it against p2p())
        self.moved: list[dict[str, Any]] = []  # the last step's sends and recvs in order (tests count it against steps(stage))

    def _stage_buffers(self, params: dict[str, Any]) -> dict[str, torch.Tensor]:
        """What this stage reads of the module that is not a parameter (a rotary table: a buffer or
        a tensor attribute), by label; whole, as every stage that reads it holds it."""
        from nvtp.driver import tensor_attributes

        wanted = [label for label in self.program.stages[self.stage].parameters if label not in params]
        if not wanted:
            return {}
        held = dict(self.module.named_buffers()) | tensor_attributes(self.module)
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
        params = [self._params[label] for label in self._unique]
        if not first:
            return _PipeRun.apply(self, args, train, *params)
        with collectives.PROGRESS.busy("running its first step"):  # the first run lowers what it runs: given time too
            return _PipeRun.apply(self, args, train, *params)

    def _step(self, args: tuple, train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run this rank's actions for one step: (the step's loss on every rank, gradient by label)."""
        pp, lay, m = self.program, self.layout, self.microbatches
        rp = self._runner
        mine = pp.programs[self.stage]
        f = mine.forward.source
        b = mine.backward.source if mine.backward is not None else None
        micro = [tuple(a.chunk(m)[i] if isinstance(a, torch.Tensor) and a.ndim else a for a in args) for i in range(m)]
        arg_labels = [n for n in pp.traced.arguments]
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
        self.moved = []  # every send and recv on the pp axis, in the order this rank ran them
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
                named: dict[str, Any] = dict(self._params) | self._buffers
                named |= {label: a for label, a in zip(arg_labels, micro[i]) if isinstance(a, torch.Tensor)}
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
                    inputs.append(self._params[info.label].data if info.label in self._params else self._buffers[info.label])
                elif info.role == "saved":
                    inputs.append(vals[info.source])
                elif info.label in received:
                    inputs.append(received[info.label])
                else:  # the loss's gradient: the step's loss is the mean over microbatches
                    shape = local_shape(v.shape, mine.backward.sharding(v.name), mine.mesh)
                    inputs.append(torch.full(shape, 1.0 / m, dtype=v.dtype.torch))
            outs = rp.run("backward", inputs, seed=_seed(base, self.stage, i))
            by_name = {v.name: t for v, t in zip(b.outputs, outs)}
            for p in send_b:
                send(by_name[p["value"]], p, BACKWARD_TAG)
            for v in b.outputs:
                label = b.grad_of(v.name)
                if label in self._params:
                    g = by_name[v.name]
                    grads[label] = g if label not in grads else grads[label] + g
        for h in handles:
            collectives.wait_sent(h)
        # the loss: the mean over microbatches, from the last stage to every rank of this pp group
        loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32)
        if lay.pp > 1:
            loss = loss.detach().clone().contiguous()
            DistComm(self._groups["pp"]).broadcast(loss, peer(lay.pp - 1))
        if train:
            grads = self._join_tied(grads)
        return loss, grads

    def _join_tied(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One gradient per parameter object: names of one tied parameter summed in a stage, then
        over the stages that hold it (Megatron's embedding group)."""
        first = {label: self._tied.get(label, label) for label in self._labels}
        by_first: dict[str, torch.Tensor] = {}
        for label, g in grads.items():
            k = first[label]
            by_first[k] = g if k not in by_first else by_first[k] + g
        for name in sorted(self._tie_groups):
            g = by_first.get(name)
            if g is None:
                g = torch.zeros_like(next(self._params[lab] for lab in self._labels if first[lab] == name).data)
            g = DistComm(self._tie_groups[name]).all_reduce(g, "sum")
            by_first[name] = g
        return {label: by_first.get(first[label]) for label in self._unique}

    # -- whole parameters -----------------------------------------------------------------

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on every rank (collectives: every rank calls it): gathered over
        its stage's sub-mesh, then broadcast from the first stage holding it over the pp axis."""
        import torch.distributed as dist

        if self.program is None:
            return {n: p.detach().clone() for n, p in self.module.named_parameters()}
        pp, lay = self.program, self.layout
        out = {}
        for name, p in self.module.named_parameters():
            owner = min(self._holders.get(name, {0}))
            shape = self._shapes[name]
            whole = torch.empty(shape, dtype=p.dtype)
            if self.stage == owner:
                label = next(lab for lab in pp.stages[owner].parameters if self._tied.get(lab, lab) == name)
                program = pp.programs[owner]
                placement = program.parameters[label]
                if lay.dp * lay.tp > 1:
                    parts = [torch.empty(local_shape(shape, placement if isinstance(placement, tuple) else (placement,), program.mesh), dtype=p.dtype) for _ in range(lay.dp * lay.tp)]
                    dist.all_gather(parts, p.detach().contiguous(), group=self._groups["stage"])
                    whole = spmd.assemble(parts, placement, shape, program.mesh)
                else:
                    whole = p.detach().clone()
            if lay.pp > 1:
                whole = whole.contiguous()
                dist.broadcast(whole, lay.rank(owner, self.dp_index, self.tp_index), group=self._groups["pp"])
            out[name] = whole
        return out

    # -- checkpoints (torch.distributed.checkpoint) ---------------------------------------------

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """This rank's stage parameters under the model's own names, each a DTensor on the stage's
        (dp, tp) sub-mesh of torch's (pp, dp, tp) DeviceMesh whose local part is the parameter's
        storage (no copy): ``dcp.save`` writes each part once, ``dcp.load`` reads into it in place,
        whatever shape the checkpoint was saved on. A weight tied across stages is under its first
        name in both stages (equal; DCP writes it once). Every rank calls it (the first call makes
        the mesh's process groups, in one order)."""
        from nvtp import dtensor as _dt

        if self.program is None:
            raise InputError("compile the pipeline before a checkpoint (model.compile(*inputs), or one training step): "
                             "until then no rank knows its stage's parameters")
        mine = self.program.programs[self.stage]
        sub = self._torch_mesh()[tuple(mine.mesh.names)] if self.layout.size > 1 else None
        out = {}
        for label in self._unique:
            name = self._tied.get(label, label)
            p = self._params[label]
            out[name] = _dt.as_dtensor(p.data, mine.parameters[label], sub, self._shapes[name]) if sub is not None else p.data
        return out

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        """Take ``state`` (``checkpoint_state()``'s keys, as ``dcp.load`` filled them) into this
        rank's parameters; a no-op for parts DCP read in place."""
        from nvtp import dtensor as _dt

        with torch.no_grad():
            for label in self._unique:
                p, t = self._params[label], _dt.local(state[self._tied.get(label, label)])
                if t.data_ptr() != p.data.data_ptr():
                    p.data.copy_(t)

    def _torch_mesh(self):
        """torch's DeviceMesh over the whole (pp, dp, tp) layout (rank = (pp*dp + d)*tp + t); made once."""
        if getattr(self, "_torch_global", None) is None:
            from torch.distributed.device_mesh import DeviceMesh

            lay = self.layout
            self._torch_global = DeviceMesh("cpu", torch.arange(lay.size).reshape(lay.pp, lay.dp, lay.tp),
                                            mesh_dim_names=("pp", "dp", "tp"))
        return self._torch_global


def _seed(base: int, stage: int, microbatch: int) -> int:
    """The seed of a stage's fusions for one microbatch of a call: distinct per stage and microbatch."""
    import hashlib

    digest = hashlib.sha256(repr((base, stage, microbatch)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)


class _PipeRun(torch.autograd.Function):
    """Forward: the whole schedule (forwards and, when training, backwards). Backward: its gradients."""

    @staticmethod
    def forward(ctx, module: PipelineModule, args: tuple, train: bool, *params):
        loss, grads = module._step(args, train)
        ctx.grads = [grads.get(label) for label in module._unique]
        return loss

    @staticmethod
    def backward(ctx, g):
        return (None, None, None, *[None if x is None else x * g for x in ctx.grads])


__all__ = ["PipelineModule"]
