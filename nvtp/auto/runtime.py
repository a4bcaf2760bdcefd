"""``nvtp.jit(model, plan="auto")``: plan on the first call, then train with the choice; every rank passes the whole batch.

    sm = nvtp.jit(model, plan="auto")                # after init_process_group; mesh: the world (or a 1-D mesh of it)
    loss = sm(idx, targets); loss.backward(); opt.step()   # idx: the whole batch, on every rank
    sm.candidate.text(), sm.choice.as_text()        # what was chosen (the table on rank 0)

On the first call rank 0 plans (``nvtp.auto.search``) for the world's devices, the machine model
and the memory budget, and broadcasts the choice; every rank then builds the module the choice
names (``ShardedModule`` on its mesh, or ``PipelineModule`` on its (pp, dp, tp) layout). The
user's loop does not change with the choice: every rank passes the same whole batch, and this
module hands the wrapped one this rank's rows of it along the data-parallel axis (a pipeline
splits them into microbatches itself); the loss the model returns is then the whole batch's (the
data-parallel program's loss is its mean over every rank's rows). An output that carries the
batch (logits) comes back whole: gathered over the data-parallel ranks, and its gradient, for a
loss over the whole batch, routed back to each rank's rows.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping
import copy

import torch
import torch.distributed as dist

from nvtp.errors import EXIT_BAD_INPUT, InputError, RankFailure, exit_code_for
from nvtp.sharding import axes
from nvtp.auto.candidate import Candidate
from nvtp.auto.sample import whole_batch
from nvtp.auto.search import AutoError, machine_of, parse_memory, search
from nvtp.execute import backends, spmd
from nvtp.execute.collectives import on_axis
from nvtp.parallel import ShardedModule
from nvtp.pipeline.runtime import PipelineModule
from nvtp.sharding.axes.pp import Layout, STAGE_AXES


PLAN_TIMEOUT_S = 3600.0  # how long the other ranks wait for rank 0's plan


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _devices(mesh: Any, world: int) -> int:
    """The devices to plan for: the world, checked against ``mesh`` (None, a count, or a 1-D mesh of the world)."""
    if mesh is None:
        return world
    if isinstance(mesh, bool):
        raise InputError(f"mesh={mesh!r}: plan='auto' takes the world (mesh=None) or a 1-D mesh of it")
    if isinstance(mesh, int):
        n = mesh
    else:
        shape = tuple(int(x) for x in getattr(mesh, "shape", ()))
        if len(shape) != 1:
            raise InputError(f"plan='auto' chooses the mesh's shape itself: pass mesh=None or a 1-D mesh of the world "
                             f"(init_device_mesh(device, ({world},))), not a mesh of shape {list(shape)}")
        n = shape[0]
    if n != world:
        raise InputError(f"plan='auto' plans for the world's devices: the mesh has {n} but the process group has {world} rank(s); "
                         f"start {n} processes or pass mesh=None")
    return n


@dataclass(frozen=True)
class Failure:
    """What rank 0 sends when planning fails: the class every rank raises (module and name) and its message."""

    module: str
    name: str
    message: str


def failure(e: Exception) -> Failure:
    """Bad input (``nvtp.errors.exit_code_for``: an ``AutoError``, an ``InputError``, a model nvtp
    cannot trace) keeps its nvtp class and message; anything else becomes a ``RankFailure`` naming it."""
    cls = type(e)
    if exit_code_for(e) == EXIT_BAD_INPUT and cls.__module__.split(".")[0] == "nvtp":
        return Failure(cls.__module__, cls.__qualname__, str(e))
    return Failure(RankFailure.__module__, RankFailure.__qualname__,
                   f"rank 0 failed while planning plan='auto': {cls.__name__}: {e}")


def received(f: Failure) -> Exception:
    """The error a rank raises for rank 0's ``Failure``: of the class and with the message rank 0 sent."""
    try:
        cls = getattr(importlib.import_module(f.module), f.name)
        error = cls(f.message)
    except Exception:  # a class that takes other arguments: the message, as an AutoError
        error = None
    if not isinstance(error, Exception) or str(error) != f.message:
        error = AutoError(f.message)
    error.add_note("(raised while rank 0 planned plan='auto'; every rank raises this error)")
    return error


def _broadcast(payload: list[Any]) -> list[Any]:
    """Rank 0's ``payload`` on every rank. The others wait while rank 0 plans (a minute or more for a
    large model): a group of its own with a long timeout (``PLAN_TIMEOUT_S``)."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PLAN_TIMEOUT_S))
    dist.broadcast_object_list(payload, src=0, group=group)
    dist.destroy_process_group(group)
    return payload


class _Gather(torch.autograd.Function):
    """This rank's rows along dim 0 -> every data-parallel rank's rows, in order. Backward: this
    rank's rows of the gradient, times the ranks (the wrapped program divides a batch-split
    output's gradient by them, as DDP averages each rank's own loss; a loss over the whole
    gathered batch needs no averaging)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Any, index: int, n: int) -> torch.Tensor:
        ctx.index, ctx.n, ctx.rows = index, n, t.shape[0]
        return torch.cat([p.to(t.dtype) for p in comm.all_gather(t.detach().contiguous())], dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine = grad[ctx.index * ctx.rows:(ctx.index + 1) * ctx.rows] * ctx.n
        return mine, None, None, None


class AutoModule(torch.nn.Module):
    """``module`` planned and sharded by ``plan="auto"``; call it as you would call ``module``, with the whole batch."""

    def __init__(self, module: torch.nn.Module, mesh: Any = None, *, machine: Any = None, memory: Any = None, backend: str = "auto",
                 frontend: str = "auto", timeout: float | None = 60.0, given: Mapping[str, Any] | None = None,
                 candidate: Any = None, comm: Any = None):
        super().__init__()

        chosen = dict(given or {})
        if chosen:
            raise InputError(f"plan='auto' chooses the layout and its options itself; leave out {', '.join(f'{k}={v!r}' for k, v in chosen.items())}, "
                             "or give a plan (megatron, megatron-sp) and the options yourself")
        self.module = module
        self.comm = comm
        if comm is not None:  # a simulated rank of the candidate's mesh (``simulated``)
            if candidate is None:
                raise InputError("a simulated rank (comm=) runs a candidate already chosen: pass candidate= (nvtp.auto.search(...).candidate)")
            self.world, self.rank = candidate.devices, comm.rank  # its position on the mesh
        else:
            self.world, self.rank = _world()
        self.devices = _devices(mesh, self.world)
        device = next((p.device.type for p in module.parameters()), "cpu")
        self.backend = backends.resolve(backend, device).name
        self.machine = machine_of(machine, self.backend)  # an unknown name refused now
        self.memory = parse_memory(memory, self.machine)
        self.frontend, self.timeout = frontend, timeout
        self.choice = None  # nvtp.auto.Choice (rank 0)
        self.candidate = candidate  # nvtp.auto.Candidate (every rank); given: run it without planning (the benchmarks)
        self.inner: torch.nn.Module | None = None
        self._dp = (0, 1)  # (this rank's index along the data axis, its extent)

    @staticmethod
    def of_jit(call: Mapping[str, Any], defaults: Mapping[str, inspect.Parameter]) -> "AutoModule":
        """``nvtp.jit(module, plan="auto", ...)``'s module, from the call's arguments (``call``: their names and values;
        ``defaults``: ``nvtp.jit``'s parameters, so what the caller chose is what differs from them);
        ``machine=`` or ``memory=`` with another plan is refused (they are what plan="auto" plans for)."""
        if not (isinstance(call["plan"], str) and call["plan"] == "auto"):
            raise InputError("machine= and memory= are what plan='auto' plans for; with the plan given, leave them out")
        own = ("module", "mesh", "machine", "memory", "backend", "frontend", "timeout")
        return AutoModule(*(call[k] for k in own[:2]), **{k: call[k] for k in own[2:]},
                          given={k: v for k, v in call.items() if k not in own and k != "plan" and v != defaults[k].default})

    # -- planning ------------------------------------------------------------------------------

    def plan(self, *args: Any, **kwargs: Any) -> Any:
        """Plan for a call like this one (the whole batch), without running; returns the candidate."""
        if self.candidate is None:
            self._plan(args, kwargs)
        return self.candidate

    def _plan(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        """Rank 0 searches and sends the choice; if it fails, it sends the error instead and every
        rank raises that error (``failure``, ``received``), none waits for a choice that never comes."""
        payload: list[Any] = [None]
        failed: Exception | None = None
        if self.rank == 0:
            try:
                self.choice = search(self.module, args, kwargs, devices=self.devices, machine=self.machine, memory=self.memory,
                                     backend=self.backend, frontend=self.frontend)
                c = self.choice.candidate
                payload = [(c.extents, c.options, c.recompute)]
            except Exception as e:
                failed, payload = e, [failure(e)]
        if self.world > 1:
            payload = _broadcast(payload)
        if isinstance(payload[0], Failure):
            error = received(payload[0])
            if failed is not None and type(error) is type(failed) and str(error) == str(failed):
                raise failed  # rank 0: its own error, with its traceback
            raise error from failed
        extents, options, recompute = payload[0]
        self.candidate = c = Candidate(tuple(extents), tuple(options), recompute)
        self.inner = self._build(c)

    def _build(self, c: Any) -> torch.nn.Module:
        options = c.opts
        if c.pipelined:
            sizes = c.sizes
            stage = next(s.name for s, _ in c.used() if s.cuts_stages)
            layout = Layout(sizes[stage], *(sizes.get(a, 1) for a in STAGE_AXES))
            self._dp = (layout.coords(self.rank)[1], layout.dp)
            return PipelineModule(self.module, options.pop("plan", "megatron"), layout, backend=self.backend, frontend=self.frontend,
                                  recompute=c.recompute, **c.stage_options())
        mesh = c.mesh()
        axis = axes.batch_axis(mesh)
        if axis is not None:
            self._dp = (mesh.coords(self.rank)[axis], mesh.shape[axis])
        shard = c.shard_options()
        plan = shard.pop("plan", "megatron")
        return ShardedModule(self.module, plan, mesh, self.comm, backend=self.backend, frontend=self.frontend,
                             timeout=None if self.comm is not None else self.timeout, recompute=c.recompute, **shard)

    # -- running -------------------------------------------------------------------------------

    def _rows(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
        """This rank's rows of every argument that carries the whole batch."""
        i, n = self._dp
        if n == 1:
            return args, dict(kwargs)

        batch = whole_batch(args, kwargs)

        def part(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and a.ndim and a.shape[0] == batch:
                rows = batch // n
                return a[i * rows:(i + 1) * rows]
            return a
        return tuple(part(a) for a in args), {k: part(a) for k, a in kwargs.items()}

    def _whole(self, out: Any, rows: int) -> Any:
        """Outputs that carry this rank's rows, gathered over the data-parallel ranks."""
        i, n = self._dp
        if n == 1:
            return out

        def whole(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == rows:
                return _Gather.apply(t, self._data_comm(), i, n)
            return t
        if isinstance(out, torch.Tensor):
            return whole(out)
        if isinstance(out, tuple):
            return type(out)(whole(t) for t in out) if not hasattr(out, "_fields") else type(out)(*(whole(t) for t in out))
        if isinstance(out, list):
            return [whole(t) for t in out]
        if isinstance(out, dict):  # a transformers ModelOutput is an OrderedDict
            for k in list(out.keys()):
                out[k] = whole(out[k])
            return out
        return out

    def _data_comm(self) -> Any:
        inner = self.inner
        axis = axes.batch_axis(inner.mesh)
        return on_axis(inner.comm, axis)

    def _ready(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        if self.inner is None:
            if self.candidate is not None:
                self.inner = self._build(self.candidate)
            else:
                self._plan(args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._ready(args, kwargs)
        mine, mine_kw = self._rows(args, kwargs)
        out = self.inner(*mine, **mine_kw)

        return self._whole(out, whole_batch(mine, mine_kw))

    def compile(self, *args: Any, **kwargs: Any) -> "AutoModule":
        """Plan and compile for a call like this one (the whole batch), without running."""
        self._ready(args, kwargs)
        mine, mine_kw = self._rows(args, kwargs)
        self.inner.compile(*mine, **mine_kw)
        return self

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The program the choice runs for a call like this one (``Program`` or ``PipelineProgram``)."""
        self.compile(*args, **kwargs)
        return getattr(self.inner, "last", None) or getattr(self.inner, "program", None)

    def share_compiled(self, other: "AutoModule") -> "AutoModule":
        """Take ``other``'s compiled programs (the same model and candidate on another simulated rank)."""
        self._ready((), {})
        self.inner.share_compiled(other.inner)
        return self

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def simulated(module: torch.nn.Module, candidate: Any, *args: Any, backend: str = "auto", timeout: float = 120.0, **kwargs: Any):
    """(one ``AutoModule`` per rank of ``candidate``'s mesh, the threads' mesh): ``candidate`` run on
    simulated ranks in this process (threads, ``nvtp.execute.spmd``), each holding its own copy of
    ``module``, compiled once for a call like ``args`` (the whole batch). A pipeline's candidate
    runs on processes only (``nvtp.pipeline``)."""
    if candidate.pipelined:
        raise InputError(f"{candidate.text()}: a pipeline runs on torch.distributed's processes, not on simulated ranks")
    threads = spmd.ThreadMesh(candidate.mesh(), timeout=timeout)
    ranks = [AutoModule(copy.deepcopy(module), candidate.devices, backend=backend, candidate=candidate, comm=threads.comm(r))
             for r in range(candidate.devices)]
    ranks[0].compile(*args, **kwargs)
    for m in ranks[1:]:
        m.share_compiled(ranks[0])
    return ranks, threads


__all__ = ["AutoModule", "Failure", "failure", "received", "simulated"]
