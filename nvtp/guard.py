"""The first-call check: a compiled program must compute what the model computes, run eagerly.

nvtp's passes are tested, and the splice proves what it copies (``nvtp.frontend.variants``), but a
compiler that trains silently wrong is the worst failure it can have. So, by default, the first
call of each compiled program is checked against the model run eagerly in PyTorch on the same
inputs, independently of nvtp's code path, and a program that differs is refused before the
user's step runs, on every rank, with the first value that differs:

    MiscompileError: nvtp's compiled program differs from the model run eagerly on the same inputs
    (the first call's check): gradient of h.3.attn.q.weight: max abs error 0.021, relative 0.87
    (tolerance 0.001 relative) ...

What is compared, on each rank: the module's outputs, and the gradients of a sample of the
parameters (``SAMPLE``, spread from the first to the last, so every block's region of a deep
model is seen) after a backward from a fixed pseudo-random gradient of each output. A value
passes when ``max |got - eager| <= rtol * max |eager| + atol`` (``TOLERANCE`` by dtype; fp32:
1e-3 relative, bf16: 5e-2; ``verify=<float>`` sets the relative tolerance).

What "the same inputs" is, per runtime:

* ``nvtp.jit`` (``check_module``): the parameters gathered whole from the ranks' parts; the call
  as the user made it, and on a mesh with a "dp" axis the whole batch (every dp rank's batch
  gathered, in rank order): a rank's outputs are then its batch's rows of the eager outputs where
  the program splits them over dp, and the eager gradient is of the mean of the dp ranks' losses
  (the output gradients 1/dp), as DDP averages. Tensor-parallel and cp boundaries are whole.
* ``nvtp.ShardingTransform`` (``check_transform``): the same, on its 1-D mesh; the module's own
  parameters are meta by then (released), so the gathered ones stand in for them.
* a pipeline (``check_pipeline``): the parameters gathered whole (``full_parameters``), the dp
  group's batch cut into the step's microbatches (eager runs each; the loss is their mean, as the
  step's is); the loss on every rank, and each rank's part of the sampled gradients of the weights
  its stage holds (a weight tied across stages: on its holder, after the sum over stages).

The check leaves training as it would be without it, bit for bit (tests/test_guard.py): it runs
the program's forward and backward directly (not through autograd: no ``.grad`` is touched), the
eager model on gathered copies of the weights by ``torch.func.functional_call`` (buffers cloned:
running statistics are not updated), under ``torch.random.fork_rng`` (no random state is
consumed), before the user's call runs. A program that draws random numbers (dropout in training
mode) cannot be compared with eager, which draws its own: it is not checked, with a warning.
Cost (measured, docs/usage.md): one more forward and backward of the program and one of the
model in eager PyTorch, once per compiled program, and transiently a whole copy of the
parameters and the eager activations on every rank.
"""

from __future__ import annotations

import json
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
import torch.distributed as dist

from nvtp import dtensor as _dt
from nvtp.execute import spmd
from nvtp.execute.collectives import on_axis
from nvtp.ir.ops import RANDOM
from nvtp.errors import InputError
from nvtp.sharding.placements import REPLICATE, Shard, axis_split, is_partial
from nvtp.sharding import axes

SAMPLE = 8  # parameters whose gradients are compared
TOLERANCE = {torch.float64: (1e-6, 1e-9), torch.float32: (1e-3, 1e-6), torch.bfloat16: (5e-2, 1e-3), torch.float16: (1e-2, 1e-4)}


class MiscompileError(RuntimeError):
    """nvtp's compiled program computes something else than the model does eagerly: a bug in nvtp.
    ``first``: the first value that differs (e.g. "gradient of h.0.attn.weight: max abs error ...")."""

    def __init__(self, first: str, message: str):
        super().__init__(message)
        self.first = first


@dataclass
class Outcome:
    """What the check of one program found on this rank."""

    failures: list[str] = field(default_factory=list)
    compared: int = 0
    seconds: float = 0.0
    skipped: str = ""


# The outcome of each check, by the module checked (tests and ``outcomes`` read it).
_OUTCOMES: "weakref.WeakKeyDictionary[Any, list[Outcome]]" = weakref.WeakKeyDictionary()


def outcomes(owner: Any) -> list[Outcome]:
    """The checks run for ``owner`` (an ``nvtp.jit`` module, a ShardingTransform, a pipeline module), in order."""
    return _OUTCOMES.get(owner, [])


# -- nvtp.jit ----------------------------------------------------------------------------------------

def check_module(sm: Any, compiled: Any, args: tuple, kwargs: dict, verify: bool | float = True) -> Outcome | None:
    """The first call of ``compiled`` (a ``RankProgram``) of ``nvtp.jit`` module ``sm`` with
    ``args``/``kwargs`` (bound as the program takes them): checked against ``sm.module`` run
    eagerly (the module docstring); every rank calls it. Raises ``MiscompileError`` on every rank
    when a value differs. Once per program: later calls return None at once; the first returns
    what it found."""
    seen = _checked(sm)
    if verify is False or id(compiled) in seen:
        return None
    seen.add(id(compiled))
    start = time.perf_counter()
    outcome = Outcome(skipped=_unchecked(compiled.program.forward.source, sm) or _planned_apart(compiled.program))
    if not outcome.skipped:
        with torch.random.fork_rng(devices=_devices(sm.module)):
            _module_step(sm, compiled, args, kwargs, _rtol(verify), outcome)
    _finish(sm, outcome, start, lambda obj: _gather_json(sm.comm, obj))
    return outcome


def will_check_pipeline(forward: Any, verify: bool | float) -> bool:
    """Whether ``check_pipeline`` will compare a pipeline traced as ``forward`` against eager."""
    return verify is not False and not _unchecked(forward, None)


def will_check(forward: Any, mesh: Any, axis_options: dict, verify: bool | float) -> bool:
    """Whether ``check_module`` will compare a program traced as ``forward`` (a Fusion), sharded
    over ``mesh`` with ``axis_options``, against eager (``verify`` on, no random draws, nothing
    planned to differ)."""
    return verify is not False and not _unchecked(forward, None) and not _apart(mesh, axis_options)


def _module_step(sm, compiled, args, kwargs, rtol, outcome: Outcome) -> None:
    """The program's step first (kept: its outputs and the sampled gradients), then the eager
    model's: the two sets of activations are never held at once."""
    comm, mesh, rank = sm.comm, sm.mesh, sm.rank
    dp = sm._dp_axis()
    named = compiled.module_state(sm.module)
    call = compiled.call
    user = call.bind(args, kwargs) | call.constants if call else dict(zip(compiled.arg_names, args))
    inputs = named | {k: user[k] for k in compiled.traced_args}
    train = torch.is_grad_enabled() and compiled.backward_fusion is not None
    f = compiled.forward_fusion
    splits = [axis_split(f.sharding(v.name)[dp]) if dp is not None else None for v in compiled.output_values()]
    dp_size = mesh.shape[dp] if dp is not None else 1

    def view(t: torch.Tensor, k: int) -> torch.Tensor:  # this rank's rows of a whole-batch tensor the program splits over dp
        return _dp_rows(t, f.sharding(compiled.output_values()[k].name), mesh, rank, dp) if splits[k] else t

    with torch.no_grad():
        outs, values = compiled.forward(inputs, seed=0)
    paths = _paths(compiled.rebuild(outs), outs)
    got_grads, grads = {}, []
    if train:
        grads = _output_grads([_whole_shape(t, splits[k], dp_size) for k, t in enumerate(outs)], outs)
        params = {label: _dt.local(named[label]) for label in named}
        by_grad = compiled.backward(values, params, [None if g is None else view(g, k) for k, g in enumerate(grads)],
                                    device=_device(sm.module))
        sample = _sample([n for n, p in sm.module.named_parameters() if p.requires_grad and n in by_grad])
        got_grads = {n: _dt.local(by_grad[n]) for n in sample}
    del values
    whole = {n: _gathered(p, sm.placement(n), sm.global_shape(n), comm, mesh) for n, p in sm.module.named_parameters()}
    if dp is not None:
        args, kwargs = _whole_batch((args, kwargs), on_axis(comm, dp))
    eager = _Eager(sm.module, whole, args, kwargs, train)
    wants = eager.outputs(paths)
    for k, (path, got) in enumerate(zip(paths, outs)):
        if not isinstance(wants[k], torch.Tensor):  # a container torch's pytree does not open (a plain dataclass): not compared
            continue
        _compare(outcome, _output_name(path), got, view(wants[k], k), rtol)
    if not train or outcome.failures or not all(isinstance(w, torch.Tensor) for w in wants):
        return  # gradients through an output eager's pytree cannot open would be compared with none: not checked
    # the program's loss is the mean of the dp ranks' (DDP): an output it splits over dp gets 1/dp of its gradient
    expected = eager.gradients(list(got_grads), [None if g is None else g / dp_size if splits[k] else g for k, g in enumerate(grads)])
    for (name, got), want in zip(got_grads.items(), expected):
        _compare(outcome, f"gradient of {name}", got, spmd.shard_tensor(want, sm.placement(name), mesh, rank), rtol)


def _whole_shape(t: torch.Tensor, split: tuple[int, int] | None, dp_size: int) -> tuple[int, ...]:
    """The whole batch's shape of a rank's output ``t`` (its rows: dim ``split[0]`` is 1/dp of the whole)."""
    shape = list(t.shape)
    if split is not None:
        shape[split[0]] *= dp_size
    return tuple(shape)


# -- nvtp.ShardingTransform --------------------------------------------------------------------------

def check_transform(transform: Any, rp: Any, labels: list[str], tensors: Sequence[torch.Tensor], module: torch.nn.Module,
                    train: bool) -> None:
    """The first call of program ``rp`` of ``transform``: its inputs ``tensors`` by ``labels``
    (parameters this rank's parts, arguments whole), checked against ``module`` run eagerly on the
    gathered parameters (its own are meta, released). Every rank calls it."""
    verify = getattr(transform, "verify", True)
    seen = _checked(transform)
    if verify is False or id(rp) in seen:
        return
    seen.add(id(rp))
    start = time.perf_counter()
    outcome = Outcome(skipped=_unchecked(rp.program.forward.source, transform))
    named = dict(zip(labels, tensors))
    constants = rp.call.constants if rp.call is not None else {}  # the FX route's folded constants: the program's own
    missing = [n for n in rp.arg_names if n not in named and n not in constants]
    if missing and not outcome.skipped:
        outcome.skipped = f"the program does not read argument(s) {', '.join(missing)}, so the call cannot be made again eagerly"
    if not outcome.skipped:
        with torch.random.fork_rng(devices=_devices(module, tensors)):
            _transform_step(transform, rp, named, module, train and rp.backward_fusion is not None, _rtol(verify), outcome)
    _finish(transform, outcome, start, lambda obj: _gather_json(transform.comm, obj))


def _transform_step(transform, rp, named, module, train, rtol, outcome: Outcome) -> None:
    comm, mesh = transform.comm, transform.mesh
    with torch.no_grad():
        constants = rp.call.constants if rp.call is not None else {}  # the FX route's folded constants (a causal mask)
        outs, values = rp.forward(named | constants, seed=0)
    paths = _paths(rp.rebuild(outs), outs)
    got_grads, grads = {}, []
    if train:
        grads = _output_grads([tuple(t.shape) for t in outs], outs)
        params = {label: t.detach() for label, t in named.items() if label not in rp.arg_names}
        device = next((t.device for t in named.values()), torch.device("cpu"))
        by_grad = rp.backward(values, params, grads, device=device)
        sample = _sample([n for n, _ in module.named_parameters() if n in by_grad and n in transform._whole_shapes])
        got_grads = {n: by_grad[n] for n in sample}
    del values
    whole = {n: _gathered(named[n], transform._placements.get(n, REPLICATE), transform._whole_shapes[n], comm, mesh)
             for n, _ in module.named_parameters() if n in named and n in transform._whole_shapes}
    if rp.call is not None:  # the FX route: the call's own structure, keywords included (labels=...)
        args, kwargs = pytree.tree_unflatten([named[n] for n in rp.call.arg_names], rp.call.in_spec)
    else:
        args, kwargs = tuple(named[n] for n in rp.arg_names), {}
    eager = _Eager(module, whole, args, kwargs, train)
    for path, got, want in zip(paths, outs, eager.outputs(paths)):
        _compare(outcome, _output_name(path), got, want, rtol)
    if not train or outcome.failures:
        return
    for (name, got), want in zip(got_grads.items(), eager.gradients(list(got_grads), grads)):
        placement = transform._placements.get(name, REPLICATE)
        _compare(outcome, f"gradient of {name}", got, spmd.shard_tensor(want, placement, mesh, comm.rank), rtol)


# -- pipelines --------------------------------------------------------------------------------------

def check_pipeline(pm: Any, args: tuple, train: bool) -> None:
    """The first call of pipeline module ``pm`` (``nvtp.pipeline.runtime.PipelineModule``, compiled)
    with this dp rank's batch ``args``: one step of the schedule run for the check (its loss and
    gradients), against the model run eagerly on the whole batch with every parameter whole.
    Every rank calls it (before the step it checks)."""
    verify = getattr(pm, "verify", True)
    seen = _checked(pm)
    if verify is False or id(pm.program) in seen:
        return
    seen.add(id(pm.program))
    start = time.perf_counter()
    outcome = Outcome(skipped=next((why for p in pm.program.programs if (why := _unchecked(p.forward.source, pm))), ""))
    if not outcome.skipped:
        with torch.random.fork_rng(devices=_devices(pm.module)):
            _pipeline_step(pm, args, train, _rtol(verify), outcome)

    def gather(obj):
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    _finish(pm, outcome, start, gather)


def _pipeline_step(pm, args, train, rtol, outcome: Outcome) -> None:
    loss, grads = pm._step(args, train)
    whole = pm.full_parameters()
    lay = pm.layout
    if lay.dp > 1:
        def gathered(t):
            if not isinstance(t, torch.Tensor):
                return t
            parts = [torch.empty_like(t) for _ in range(lay.dp)]
            dist.all_gather(parts, t.contiguous(), group=pm._groups["data"])
            return torch.cat(parts)
        args = tuple(gathered(a) for a in args)
    # The step's loss is the mean of its microbatches' losses (a loss that is not a mean over rows, an
    # MoE load-balancing term, differs from the whole batch's): eager runs each microbatch, the rows
    # of every dp rank's microbatch i together, as the program runs them.
    m = pm.microbatches
    runs = [_Eager(pm.module, whole, tuple(_microbatch(a, i, m, lay.dp) for a in args), {}, train) for i in range(m)]
    losses = [_loss_of(e) for e in runs]
    want = torch.stack(losses).mean()
    _compare(outcome, "the loss", loss, want, rtol)
    if not train or outcome.failures:
        return
    mine = pm.program.programs[pm.stage]
    held = _held_here(pm)
    names = [name for name in grads if grads[name] is not None and name in whole and name in held]
    crossing = [name for name in names if name in pm._tie_groups]  # summed across stages: always compared
    sample = crossing + _sample([name for name in names if name not in crossing])
    per_run = [e.gradients(sample, [torch.full_like(w, 1.0 / m)]) for e, w in zip(runs, losses)]
    expected = [sum(gs) for gs in zip(*per_run)]
    for name, w in zip(sample, expected):
        _compare(outcome, f"gradient of {name}", grads[name], spmd.shard_tensor(w, mine.parameters[held[name]], mine.mesh, pm._pos), rtol)


def _microbatch(a: Any, i: int, m: int, dp: int) -> Any:
    """Microbatch ``i`` of ``m`` of the dp group's batch ``a`` (each of the ``dp`` ranks' rows in
    turn): every rank's ``i``-th chunk, as the pipeline runtime cuts its own batch."""
    if not isinstance(a, torch.Tensor) or not a.ndim:
        return a
    return torch.cat([part.chunk(m)[i] for part in a.chunk(dp)])


def _loss_of(eager: "_Eager") -> torch.Tensor:
    """The loss ``eager``'s model returned: itself, or the ``loss`` of its output object (a
    transformers model called with ``labels=``); its gradients are then taken from it."""
    out = eager.outputs([""])[0]
    if not isinstance(out, torch.Tensor):
        out = out["loss"] if hasattr(out, "keys") else out.loss
        eager.leaves = [out]
    return out


def _held_here(pm) -> dict[str, str]:
    """The parameters whose whole gradient this rank's stage ends a step with, by first name: the
    label its stage program places it under. A weight several stages read (an embedding tied to
    the last stage's head) has its gradient summed on the stage that holds it (``_join_tied``), where
    it is compared; another stage's copy is not the sum."""
    labels = pm.program.stages[pm.stage].parameters
    out: dict[str, str] = {}
    for label in labels:
        name = pm._tied.get(label, label)
        if name not in out and min(pm._holders.get(name, {pm.stage})) == pm.stage:
            out[name] = label
    return out


# -- the eager side ---------------------------------------------------------------------------------

class _Eager:
    """The model run in eager PyTorch on whole weights (``functional_call``: the module's own
    parameters, shards or meta, are not read; its buffers are cloned, so none is updated)."""

    def __init__(self, module: torch.nn.Module, whole: dict[str, torch.Tensor], args: tuple, kwargs: dict, train: bool):
        self.weights = {n: t.detach().requires_grad_(train and t.is_floating_point()) for n, t in whole.items()}
        state = self.weights | {n: b.detach().clone() for n, b in module.named_buffers()}
        with torch.enable_grad() if train else torch.no_grad():
            self.result = torch.func.functional_call(module, state, tuple(args), dict(kwargs))
        self.leaves: list[torch.Tensor] = []

    def outputs(self, paths: list[str]) -> list[torch.Tensor]:
        """The eager output at each of ``paths`` (``pytree.keystr`` of the model's output object; "" the object itself)."""
        found = {pytree.keystr(p): leaf for p, leaf in pytree.tree_flatten_with_path(self.result)[0]}
        self.leaves = [found[p] if p in found else self.result for p in paths]
        return self.leaves

    def gradients(self, names: list[str], grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """d(sum of <grads[k], output k>)/d(weight) for each weight of ``names`` (zeros where it does not reach)."""
        pairs = [(t, g) for t, g in zip(self.leaves, grads) if g is not None and isinstance(t, torch.Tensor) and t.requires_grad]
        weights = [self.weights[n] for n in names]
        if not pairs:
            return [torch.zeros_like(w) for w in weights]
        got = torch.autograd.grad([t for t, _ in pairs], weights, [g for _, g in pairs], allow_unused=True)
        return [torch.zeros_like(w) if g is None else g for w, g in zip(weights, got)]


def _output_grads(shapes: list[tuple[int, ...]], like: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """A fixed pseudo-random gradient of each floating output (of ``shapes``, the dtype and device of
    ``like``), from a generator of its own: no random state is consumed."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(t.dtype).to(t.device) if t.is_floating_point() else None
            for shape, t in zip(shapes, like)]


def _output_name(path: str) -> str:
    return f"output{path}" if path else "the output"


def _paths(tree: Any, outs: Sequence[torch.Tensor]) -> list[str]:
    """Where each of the program's outputs ``outs`` sits in the model's output object ``tree``."""
    where = {id(leaf): pytree.keystr(p) for p, leaf in pytree.tree_flatten_with_path(tree)[0]}
    if all(id(t) in where for t in outs):
        return [where[id(t)] for t in outs]
    leaves = [pytree.keystr(p) for p, leaf in pytree.tree_flatten_with_path(tree)[0] if isinstance(leaf, torch.Tensor)]
    return leaves if len(leaves) == len(outs) else [""] * len(outs)


# -- comparing --------------------------------------------------------------------------------------

def _compare(outcome: Outcome, what: str, got: Any, want: torch.Tensor, rtol: float | None) -> None:
    outcome.compared += 1
    if outcome.failures:
        return  # the first differing value is the one named
    got = _dt.local(got) if isinstance(got, torch.Tensor) else torch.as_tensor(got)
    if tuple(got.shape) != tuple(want.shape):
        outcome.failures.append(f"{what}: shape {list(got.shape)}, eager {list(want.shape)}")
        return
    if not want.is_floating_point():
        if not torch.equal(got.to(want.device), want.detach()):
            outcome.failures.append(f"{what}: {int((got.to(want.device) != want.detach()).sum())} of {want.numel()} elements differ")
        return
    r, atol = TOLERANCE.get(want.dtype, TOLERANCE[torch.float32])
    r = rtol if rtol is not None else r
    compute = torch.float64 if want.dtype == torch.float64 else torch.float32  # a 16-bit value compared in fp32
    g, w = got.detach().to(device=want.device, dtype=compute), want.detach().to(compute)
    if not torch.equal(torch.isnan(g), torch.isnan(w)):
        outcome.failures.append(f"{what}: NaN where eager has a number, or a number where eager has NaN")
        return
    g, w = torch.nan_to_num(g), torch.nan_to_num(w)
    err = float((g - w).abs().max()) if w.numel() else 0.0
    scale = float(w.abs().max()) if w.numel() else 0.0
    if err > r * scale + atol:
        outcome.failures.append(f"{what}: max abs error {err:.3g}, relative {err / scale if scale else float('inf'):.3g} "
                                f"(tolerance {r:g} relative, {atol:g} absolute)")


def _finish(owner: Any, outcome: Outcome, start: float, gather: Callable[[Any], list]) -> None:
    """Every rank's outcome gathered (so all raise together, none waits in a collective); raises on the first failure."""
    outcome.seconds = time.perf_counter() - start
    _OUTCOMES.setdefault(owner, []).append(outcome)
    if outcome.skipped:
        warnings.warn(f"nvtp: the first-call check of the compiled program was skipped: {outcome.skipped}", stacklevel=4)
        return
    per_rank = gather(outcome.failures)
    for rank, failures in enumerate(per_rank):
        if failures:
            where = f" (rank {rank})" if len(per_rank) > 1 else ""
            raise MiscompileError(f"{failures[0]}{where}", f"nvtp's compiled program differs from the model run eagerly on the same inputs (the first call's "
                                  f"check){where}: {failures[0]}. Unless the ranks' models differ (each process must build "
                                  "its model with the same weights: seed them alike, or load one checkpoint; nvtp.jit(..., "
                                  "check_replicas=True) checks it), this is a bug in nvtp: please report it with the model. "
                                  "regional=False (every block traced) may avoid it; verify=False skips this check")


def option(verify: Any) -> bool | float:
    """``verify`` as given, or ``InputError``: True (the default tolerances), False (no check), or a relative tolerance."""
    if isinstance(verify, bool) or (isinstance(verify, (int, float)) and 0 < verify < 1):
        return verify
    raise InputError(f"verify={verify!r}: give True (check the first call against eager PyTorch), False (skip the check), "
                     "or a relative tolerance between 0 and 1 (e.g. 1e-2)")


def _rtol(verify: bool | float) -> float | None:
    return None if isinstance(verify, bool) else float(verify)


def _unchecked(forward: Any, owner: Any) -> str:
    """Why a program cannot be checked against eager (it draws random numbers), or ''."""
    drawn = sorted({op.kind for op in forward.ops if op.kind in RANDOM and _draws(op)})
    if drawn:
        return (f"the program draws random numbers ({', '.join(drawn)}: dropout in training mode), which eager PyTorch draws "
                "otherwise; check it with the model in eval mode, or set the dropout to 0 (verify=False silences this)")
    return ""


def _planned_apart(program: Any) -> str:
    """Why ``program`` computes, by design, something else than eager (an axis's option: ep's
    capacity factor drops tokens), or ''."""
    return _apart(program.mesh, program.forward.options)


def _apart(mesh: Any, options: dict) -> str:
    for st, _ in axes.passes(mesh):
        why = st.changes_result(options)
        if why:
            return why
    return ""


def _draws(op: Any) -> bool:
    """Whether a random op draws: an attention's ``dropout_p`` of 0 (or None) draws nothing."""
    p = dict(op.args).get("dropout_p", True)
    return not (p is None or (isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0))


def _sample(names: list[str]) -> list[str]:
    """Up to ``SAMPLE`` of ``names``, spread evenly from the first to the last."""
    if len(names) <= SAMPLE:
        return names
    return [names[round(i * (len(names) - 1) / (SAMPLE - 1))] for i in range(SAMPLE)]


# -- collectives ------------------------------------------------------------------------------------

def _gathered(t: torch.Tensor, placement: Any, shape: Sequence[int], comm: Any, mesh: Any) -> torch.Tensor:
    """The whole tensor of which ``t`` is this rank's part under ``placement`` (every rank calls it)."""
    local = _dt.local(t)
    sharding = placement if isinstance(placement, tuple) else (placement,)
    if all(axis_split(p) is None and not is_partial(p) for p in sharding):
        return local
    return spmd.assemble(_all_parts(local.contiguous(), comm, mesh.ndim), placement, shape, mesh)


def _all_parts(t: torch.Tensor, comm: Any, ndim: int) -> list[torch.Tensor]:
    """Every rank's ``t``, in mesh order (row-major), gathered axis by axis."""
    if ndim == 1:
        return list(comm.all_gather(t))
    stacked = t[None]
    for axis in reversed(range(ndim)):
        stacked = torch.stack(list(on_axis(comm, axis).all_gather(stacked)))
        stacked = stacked.reshape(-1, *t.shape)
    return list(stacked)


def _whole_batch(call: tuple, dp_comm: Any) -> tuple:
    """Each tensor of a call gathered over dp, in rank order along its first (batch) dimension."""
    return pytree.tree_map_only(torch.Tensor, lambda t: torch.cat(list(dp_comm.all_gather(t.contiguous()))) if t.ndim else t, call)


def _dp_rows(t: torch.Tensor, sharding: tuple, mesh: Any, rank: int, dp: int) -> torch.Tensor:
    """This rank's part of ``t`` along dp alone (whole on the other axes, as the caller holds it):
    its own batch, the dp rank's contiguous block of the whole batch gathered in rank order, also
    where the program splits it inside another axis's parts (``_StridedShard`` on dp under ep: a
    relabelling of the rows, which row-wise ops and means do not see)."""
    only = tuple(Shard(axis_split(p)[0]) if a == dp and axis_split(p) is not None else p if a == dp else REPLICATE
                 for a, p in enumerate(sharding))
    return spmd.shard_tensor(t, only, mesh, rank)


def _gather_json(comm: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in mesh order, with the tensor collectives a Comm has."""
    axes = getattr(comm, "axes", None)
    if axes is None:
        return _gather_json_1d(comm, obj)
    out = [obj]
    for axis in reversed(range(len(axes))):
        out = [x for part in _gather_json_1d(axes[axis], out) for x in part]
    return out


def _gather_json_1d(comm: Any, obj: Any) -> list[Any]:
    if comm.size == 1:
        return [obj]
    payload = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [int(n) for n in comm.all_gather(torch.tensor([payload.numel()]))]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    return [json.loads(bytes(p[:n].tolist()).decode()) for p, n in zip(comm.all_gather(padded), sizes)]


def _checked(owner: Any) -> set[int]:
    return _SEEN.setdefault(owner, set())


_SEEN: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()


def _devices(module: torch.nn.Module, tensors: Sequence[torch.Tensor] = ()) -> list[int]:
    """The CUDA devices whose random state ``fork_rng`` keeps (none on CPU)."""
    found = {t.device.index or 0 for t in [*module.parameters(), *tensors] if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
    return sorted(found)


def _device(module: torch.nn.Module) -> str:
    return next((p.device.type for p in module.parameters()), "cpu")
