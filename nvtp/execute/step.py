"""One rank's training step of a ``Program`` at a module's boundary.

    rp = RankProgram(program, backend.lower(program, comm), comm.rank, part_rows)
    outputs, values = rp.forward(named, seed)       # named: label -> parameter (this rank's part) or whole argument
    grads = rp.backward(values, params, out_grads)  # label -> this rank's gradient (a parameter's part, an argument whole)

What a module's caller holds and what a rank's fusions take differ: the caller passes whole
arguments and each rank holds its part of each parameter; a fused projection's weight is held
as one tensor whose rows are the parts the fusions read separately (``part_rows``); on a mesh
with a "dp" axis the caller passes its own batch. ``RankProgram`` turns one into the other,
runs the backend's runner (``nvtp.execute.backends``) on the forward and backward fusions, and
turns the gradients back into what the caller holds. It is the whole of that step: ``nvtp.jit``
(``nvtp.parallel._Run``, a ``torch.autograd.Function``) and ``nvtp.ShardingTransform``
(``nvtp.transform``, through Thunder's autograd) both run it, so both run the same program the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Mapping, Sequence

import torch

from nvtp import dtensor as _dt
from nvtp.sharding import axes
from nvtp.execute import spmd
from nvtp.ir.graph import TensorValue
from nvtp.program import Program
from nvtp.sharding.placements import REPLICATE, FusedParts, Placement, axis_split, held
from nvtp.sharding.sharded import ShardedFusion
from nvtp.errors import InputError
from nvtp.frontend.fused import part_label
from nvtp.frontend.outputs import rebuild

# A part's label -> (its parameter's label, first row, end row) in this rank's tensor of that parameter.
PartRows = Mapping[str, tuple[str, int, int]]


@dataclass
class RankProgram:
    """The driver's ``Program`` for one call shape, and this rank's runner of it (the backend's lowering)."""

    program: Program
    run: Callable[..., list[Any]]
    rank: int
    part_rows: PartRows = field(default_factory=dict)  # the owner's, shared: later compiles add parts
    signature: tuple = ()
    call: Any = None  # the FX route's binder (nvtp.frontend.fx.Program): binds a call's arguments, rebuilds the outputs

    @property
    def forward_fusion(self) -> ShardedFusion:
        return self.program.forward

    @property
    def backward_fusion(self) -> ShardedFusion | None:
        return self.program.backward

    @property
    def arg_names(self) -> list[str]:
        return self.program.source.arguments

    @property
    def parts(self) -> dict[str, Any]:
        """Inputs that are rows of a parameter (label -> ``nvtp.frontend.fused.Part``)."""
        return self.program.source.parts

    @property
    def dp_axis(self) -> int | None:
        return axes.batch_axis(self.program.mesh)

    @cached_property
    def traced_args(self) -> list[str]:
        """The arguments the forward fusion reads (tensors; an argument the model ignores is not
        one): the tensors a step takes after the parameters, and returns gradients for."""
        labels = {self.forward_fusion.source.label(v.name) for v in self.forward_fusion.source.inputs}
        return [n for n in self.arg_names if n in labels]

    def holder(self, label: str) -> str:
        """The label of what the caller holds for forward input ``label``: a part's parameter, else itself."""
        return self.part_rows[label][0] if label in self.part_rows else label

    def callers(self, sharded: ShardedFusion, name: str) -> tuple[Placement, ...]:
        """The sharding of a module argument (or an output's gradient) relative to what the caller
        holds: whole on one mesh; on a mesh with a dp axis the caller already holds its own batch."""
        sharding = sharded.sharding(name)
        dp = self.dp_axis
        if dp is None:
            return sharding
        return tuple(REPLICATE if a == dp else p for a, p in enumerate(sharding))

    # -- forward ------------------------------------------------------------------------------

    def inputs(self, named: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's inputs of the forward fusion, from ``named``: each parameter (this rank's
        part, a DTensor or not) and buffer by its label, each argument whole by its name."""
        fwd = self.forward_fusion
        f = fwd.source
        out = []
        for v in f.inputs:
            label = f.label(v.name)
            if label in self.part_rows:  # rows of a fused projection's weight: a view of this rank's part
                weight, lo, hi = self.part_rows[label]
                t = _dt.local(named[weight])[lo:hi]
            else:
                t = _dt.local(named[label])
            if label in self.arg_names and isinstance(v, TensorValue):  # the caller's tensor: take our part
                t = spmd.shard_tensor(t, self.callers(fwd, v.name), fwd.mesh, self.rank)
            out.append(t)
        return out

    def module_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What the forward fusion reads of ``module`` (label -> tensor, in the fusion's order):
        each parameter (a fused projection's parts as their parameter) and buffer, and each plain
        tensor attribute (``self.freqs_cis``) as the module holds it now. Raises ``InputError``
        for an input that is neither the module's nor an argument (naming it)."""
        from nvtp.driver import tensor_attributes  # lazy: loads Thunder; CLI file commands load this module without it

        f = self.forward_fusion.source
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())
        attributes = None
        named = {}
        for v in f.inputs:
            label = self.holder(f.label(v.name))
            if label in params:
                named[label] = params[label]
            elif label in buffers:
                named[label] = buffers[label]
            elif label not in self.arg_names:
                attributes = tensor_attributes(module) if attributes is None else attributes
                if label not in attributes:
                    raise InputError(f"the program reads {label} ({v.describe()}), which {type(module).__name__} holds neither as a "
                                     "parameter, a buffer nor a tensor attribute; keep it on the module at every call (or register it with "
                                     "self.register_buffer)")
                named[label] = attributes[label]
        return named

    def rebuild(self, outs: Sequence[Any]) -> Any:
        """The model's own output object from the module's outputs ``outs`` (in order): the FX
        route's pytree (e.g. ``CausalLMOutputWithPast``), or on Thunder's route the tuple, dict or
        dataclass the forward returned, with None and numbers where it had them
        (``nvtp.frontend.outputs``), each tensor found by its output's label."""
        if self.call is not None:
            return self.call.rebuild(outs)
        tree = self.program.source.output_tree
        if tree is None:
            return outs[0] if len(outs) == 1 else tuple(outs)

        f = self.forward_fusion.source
        return rebuild(tree, {f.label(v.name): t for v, t in zip(self.output_values(), outs)})

    def forward(self, named: Mapping[str, torch.Tensor], seed: int) -> tuple[list[Any], dict[str, Any]]:
        """Run the forward fusion: (the module's outputs, whole; every forward value by name, this
        rank's: what ``backward`` reads)."""
        f = self.forward_fusion.source
        inputs = self.inputs(named)
        outputs = self.run("forward", inputs, seed=seed)
        values = {v.name: t for v, t in zip(f.inputs, inputs)}
        values.update({src.name: t for src, t in zip(f.outputs, outputs)})
        user = [t for v, t in zip(f.outputs, outputs) if f.role(v.name) == "output"]
        return user, values

    def output_values(self) -> list[TensorValue]:
        """The forward fusion's outputs that are the module's (in order)."""
        f = self.forward_fusion.source
        return [v for v in f.outputs if f.role(v.name) == "output"]

    # -- backward -----------------------------------------------------------------------------

    def backward(self, values: Mapping[str, Any], params: Mapping[str, torch.Tensor], grads: Sequence[torch.Tensor | None],
                 device: str | torch.device = "cpu", take: bool = False) -> dict[str, torch.Tensor]:
        """Run the backward fusion: ``values`` from ``forward``, ``params`` each parameter's local
        tensor by label, ``grads`` the gradient of each module output (whole; None: zeros). Returns
        label -> gradient: a parameter's placed like this rank's part (a fused projection's parts
        joined), an argument's whole. Empty without a backward fusion. ``take``: ``values`` is a
        dict this call empties, so that the backward frees each saved value after its last use
        (the caller holds none of them elsewhere)."""
        bwd = self.backward_fusion
        if bwd is None:
            return {}
        b = bwd.source
        grad_inputs = [v for v in b.inputs if b.role(v.name) == "grad"]
        grads = self._grads_by_output(grad_inputs, grads)
        local_grads = []
        dp = self.dp_axis
        for v, g in zip(grad_inputs, grads):
            if g is None:  # an output the loss does not use: zeros of this rank's part (on a dp axis the caller's
                # output is its own rows, not the whole batch's), never the whole output's (logits: batch x vocabulary)
                coords = bwd.mesh.coords(bwd.mesh.devices[self.rank])
                shape = [n if ix is None else ix.numel() for n, ix in zip(v.shape, held(v.shape, bwd.sharding(v.name), bwd.mesh, coords))]
                local_grads.append(torch.zeros(shape, dtype=v.dtype.torch, device=device))
                continue
            local = spmd.shard_tensor(g.detach(), self.callers(bwd, v.name), bwd.mesh, self.rank)
            if dp is not None and axis_split(bwd.sharding(v.name)[dp]) is not None:
                # Each rank's loss is over its own batch and DDP averages gradients over dp: the
                # whole-batch program's loss is their mean, so a batch-split output's gradient is 1/dp of the rank's.
                local = local / bwd.mesh.shape[dp]
            local_grads.append(local)
        from nvtp.frontend.capture import backward_inputs  # lazy: loads Thunder; CLI file commands load this module without it

        params = dict(params)
        f = self.forward_fusion.source  # inputs the backward reads by label that are not parameters (the FX
        params |= {f.label(v.name): values[v.name] for v in f.inputs if f.label(v.name) not in params}  # route's constants): this rank's part
        inputs = backward_inputs(b, params, dict(values), local_grads)
        if take:
            values.clear()
            local_grads = grads = g = local = None
        outs = self.run("backward", inputs, seed=0, take=take)
        by_grad = {b.grad_of(v.name): t for v, t in zip(b.outputs, outs)}
        by_grad |= joined_grads(self.part_rows, by_grad, params)
        return by_grad

    def _grads_by_output(self, grad_inputs: list[TensorValue], grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The backward's incoming gradients in the order it reads them, each the gradient of its
        own forward output (its ``source``), from ``grads`` (one per module output, in order; None
        for an output the loss does not use). Never by position among several outputs: a
        gradient in another output's slot would train silently wrong."""
        b = self.backward_fusion.source
        user = [v.name for v in self.output_values()]
        by_output = dict(zip(user, grads))
        sources = [b.info[v.name].source for v in grad_inputs]
        if all(s in by_output for s in sources):
            return [by_output[s] for s in sources]
        if len(grad_inputs) == len(user) == 1:
            return list(grads)
        unknown = ", ".join(f"{v.name} (source {s!r})" for v, s in zip(grad_inputs, sources) if s not in by_output)
        raise RuntimeError(f"nvtp cannot tell whose gradient the backward's input {unknown} is: the forward's outputs are "
                           f"{', '.join(user)}; a bug in nvtp's capture (the gradient would land in another output's slot)")

    def gradient_labels(self) -> set[str]:
        """Labels the backward gives a gradient for (a fused projection's parts as their parameter)."""
        bwd = self.backward_fusion
        if bwd is None:
            return set()
        got = {bwd.source.grad_of(v.name) for v in bwd.source.outputs}
        return got | {self.part_rows[g][0] for g in got if g in self.part_rows}


def part_rows(weight: str, placement: FusedParts, num_devices: int) -> dict[str, tuple[str, int, int]]:
    """Each part's label -> (weight, first row, end row) in a rank's tensor of ``weight``."""
    rows, at = {}, 0
    for (start, stop, _), n in zip(placement.parts, placement.local_sizes(num_devices)):
        rows[part_label(weight, start, stop)] = (weight, at, at + n)
        at += n
    return rows


def joined_grads(part_rows: PartRows, by_grad: Mapping[str, Any], params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fused projection's weight gradient on this rank: its parts' gradients one after the other
    (zeros for a part that got none)."""
    grads: dict[str, list] = {}
    for label, (weight, lo, hi) in part_rows.items():
        grads.setdefault(weight, []).append((lo, by_grad.get(label), hi - lo))
    out = {}
    for weight, pieces in grads.items():
        if weight not in params or all(g is None for _, g, _ in pieces):
            continue
        like = params[weight]
        out[weight] = torch.cat([g if g is not None else like.new_zeros((n, *like.shape[1:])) for _, g, n in sorted(pieces, key=lambda t: t[0])])
    return out


__all__ = ["RankProgram", "PartRows", "part_rows", "joined_grads"]
