"""The "cp" axis: context parallelism. The sequence of every activation is split; attention runs by ring.

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))     # or ("cp", "tp"), ("dp", "cp", "tp")
    sm = nvtp.jit(model, plan="megatron", mesh=mesh)                 # each rank passes the whole batch
    loss = sm(idx, targets)                                          # and gets the whole loss

The cp pass runs after tp's and dp's: it shards their result with the unchanged 1-D pipeline over
cp's extent, starting from the module's arguments split along their sequence axis (dimension 1:
``[B, T]`` tokens) and weights whole. Propagation carries the split through every op; a
contraction over the sequence (a weight's gradient, the loss's mean) leaves a partial sum over
cp, which the output hints resolve by all-reduce: weights stay whole across cp and their
gradients are summed over it, as in Megatron. Positions made inside the model (``arange(T)``, a
rotary table sliced to ``T``) are whole values the propagation slices to each rank's tokens.

Attention is the one op whose sequences the propagation may not split on other axes (the key
sequence is read whole by every query). On the cp axis (``rules.RING``) a self-attention's query
and key/value sequences are one factor that may split, and the attention runs by ring
(``nvtp.sharding.axes.ring``, run by ``nvtp.execute.ring``). The model is traced with every
causal or full attention claimed whole (``trace_options``: ``ring``); an attention the ring
cannot run (an arbitrary mask, dropout) is refused before any work, naming the fix.

Layout: balanced (``placements.Zigzag``): of a sequence of 2·cp pieces rank r holds pieces r
and 2·cp-1-r, one from each end, so every rank does the same causal work every ring step. With
tp the sequence is seen as tp's chunks (megatron-sp splits it contiguously over tp; two mesh axes
may split one tensor axis only along different factors), each pair of chunks a zigzag over cp
(``Zigzag(1, tp)``, ``chunks``): at tp = 2 Megatron-Core's layout. With ``fsdp`` each weight dp
splits at rest is split over cp too, along a dimension tp and dp leave whole (``at_rest``).
"""

from __future__ import annotations

from typing import Any, Mapping

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.sharding.axes.dp import split_at_rest
from nvtp.sharding.axes.ring import NAME, ring_records, ring_seconds
from nvtp.sharding.axes.strategy import AxisPass, Strategy, register
from nvtp.sharding.passes import backward_annotations, shard
from nvtp.sharding.placements import ZIGZAG, DeviceMesh, Placement, is_replicate, make_shard
from nvtp.sharding.propagate import ShardingError
from nvtp.sharding.rules import RING
from nvtp.sharding.sharded import ShardedFusion

SEQUENCE_DIM = 1  # of each module argument: [B, T, ...] (batch first, as nanoGPT and transformers models take tokens)
SEQUENCE_SPLITTER = "tp"  # the axis whose sequence parallelism (megatron-sp) splits the sequence contiguously


class ContextError(ShardingError):
    """A model or input the cp axis cannot split; says what to change (before any work)."""


def chunks(mesh: DeviceMesh) -> int:
    """The chunks each sequence is seen as, each split over cp, each pair of chunks a zigzag
    (``Zigzag``): 2 without tp; with tp the chunks tp's sequence parallelism makes, its extent
    (doubled when odd, so the chunks pair up)."""
    tp = mesh.shape[mesh.names.index(SEQUENCE_SPLITTER)] if SEQUENCE_SPLITTER in mesh.names else 1
    return tp if tp % 2 == 0 else 2 * tp


def sequence_inputs(fusion: Fusion, arguments: Any, cp: int, parts: int = 1) -> dict[str, Placement]:
    """The forward inputs the cp axis splits: each module argument of 2 or more dimensions, along
    its sequence (in ``parts`` strided pieces: ``_StridedShard``)."""
    out = {}
    for v in fusion.inputs:
        if isinstance(v, TensorValue) and fusion.label(v.name) in arguments and v.ndim > SEQUENCE_DIM \
                and v.shape[SEQUENCE_DIM] % (cp * parts) == 0:
            out[v.name] = make_shard(SEQUENCE_DIM, parts)
    if not out:
        raise ContextError(f"the cp axis of size {cp} splits the sequence of the module's arguments ([B, T, ...]), but none has "
                           "one (arguments: " + ", ".join(sorted(map(str, arguments))) + ")")
    return out


def at_rest(f: Fusion, run: AxisPass, cp: int) -> tuple[dict[str, Placement], list[str]]:
    """FSDP over dp x cp (as Megatron's distributed optimizer shards over the dp and cp ranks):
    each weight an earlier pass splits at rest is split over cp too, along the first dimension no
    earlier pass splits that cp divides, so every rank holds 1/(dp·cp) of it; (placements, notes
    for the weights that stay whole over cp, and why)."""
    out, notes = {}, []
    split = dict.fromkeys(name for placed in run.at_rest.values() for name, p in placed.items() if not is_replicate(p))
    for name in split:
        v = f.value(name)
        taken = run.taken(name)
        dim = next((d for d, n in enumerate(v.shape) if d not in taken and n % cp == 0), None)
        if dim is None:
            notes.append(f"fsdp: {f.label(name) or name} stays whole on cp: no dimension of {list(v.shape)} that tp and dp "
                         f"leave whole is a multiple of {cp}")
        else:
            out[name] = make_shard(dim)
    return out, notes


class _ring:
    """The attention rules of a cp pass (``rules.RING``), and its layout (``placements.ZIGZAG``), while it runs."""

    def __enter__(self):
        self.tokens = (RING.set(True), ZIGZAG.set(True))

    def __exit__(self, *exc):
        RING.reset(self.tokens[0])
        ZIGZAG.reset(self.tokens[1])


@register
class ContextParallel(Strategy):
    name = NAME
    summary = "context parallel: the sequence of every activation split, attention by ring; weights whole"
    order = 30
    backends = frozenset({"reference"})  # nvFuser has no ring: it would run each rank's attention on its own block only

    def trace_options(self, mesh: DeviceMesh, axis: int, plan: Any) -> dict[str, Any]:
        return {"ring": True}  # every causal or full attention claimed whole, float32 too (nvtp.frontend.attention)

    def check_arguments(self, mesh: DeviceMesh, axis: int, arguments: list[tuple[str, Any]]) -> None:
        """A sequence cp cannot split, refused before tracing: token ids and targets ([B, T]) and
        activations ([B, T, C]); a mask's shape is left to ``check_traced``, whose refusal of the
        mask itself says more."""
        cp, parts = mesh.shape[axis], chunks(mesh)
        for name, a in arguments:
            if a.ndim in (2, 3) and str(a.dtype) != "torch.bool" and a.shape[SEQUENCE_DIM] % (cp * parts):
                n = a.shape[SEQUENCE_DIM]
                raise ContextError(f"argument {name} {list(a.shape)}: its sequence (dimension {SEQUENCE_DIM}) of length {n} cannot "
                                   f"be split over the cp axis of size {cp}: the balanced layout cuts it into {cp * parts} pieces "
                                   f"({cp} ranks x {parts}); pass a sequence length that is a multiple of {cp * parts} (e.g. pad "
                                   f"to {-(-n // (cp * parts)) * cp * parts})")

    def check_traced(self, traced: Any, mesh: DeviceMesh, axis: int, fsdp: bool) -> None:
        """Refuse, before any work, what the ring cannot run: an attention Thunder would not claim
        whole (an arbitrary mask, dropout: ``traced.declined``), a sequence cp does not divide."""
        cp = mesh.shape[axis]
        parts = chunks(mesh)
        layout = (f"{cp} x 2: the balanced layout gives each rank a piece from each end of the sequence" if parts == 2 else
                  f"{cp} x {parts}: the balanced layout gives each cp rank a piece from each end of every pair of the {parts} "
                  "chunks tp's sequence parallelism sees")
        declined = getattr(traced, "declined", [])
        if declined:
            raise ContextError(f"the cp axis runs attention by ring, which needs causal or full attention without a mask; the model "
                               f"calls {declined[0]}. Call F.scaled_dot_product_attention(q, k, v, is_causal=True) (or with no mask), "
                               "with dropout_p=0, or shard this model without a 'cp' axis (tp, dp)"
                               + ("; a transformers model's mask is read as causal when it is computed from positions alone "
                                  "and is exactly the causal one: call the model without an attention_mask (padding)"
                                  if getattr(traced, "route", "") == "fx" else ""))
        f = traced.forward
        for op in f.ops:
            if op.kind == "sdpfa_fwd":
                q, k = op.arg("query"), op.arg("key")
                if q.shape[2] != k.shape[2]:
                    raise ContextError(f"{op}: the cp axis splits self-attention, whose queries and keys have one sequence; this one "
                                       f"has {q.shape[2]} queries and {k.shape[2]} keys: shard it without a 'cp' axis")
                if q.shape[2] % (cp * parts):
                    raise ContextError(f"sequence length {q.shape[2]} cannot be split over the cp axis of size {cp} "
                                       f"({op.outputs[0].name} = attention of q{list(q.shape)}): pass a sequence length that is a "
                                       f"multiple of {cp * parts} ({layout})")
        for v in f.inputs:
            if isinstance(v, TensorValue) and f.label(v.name) in traced.arguments and v.ndim > SEQUENCE_DIM:
                n = v.shape[SEQUENCE_DIM]
                if n % (cp * parts):
                    raise ContextError(f"argument {f.label(v.name)} {list(v.shape)}: its sequence axis (dimension {SEQUENCE_DIM}) of "
                                       f"length {n} cannot be split over the cp axis of size {cp}; pass a sequence length that is a "
                                       f"multiple of {cp * parts} ({layout})")

    def forward(self, run: AxisPass, axis: int) -> ShardedFusion:
        traced, f = run.traced, run.traced.forward
        cp = run.mesh.shape[axis]
        placed: dict[str, Placement] = {}
        if run.fsdp:
            placed, notes = at_rest(f, run, cp)
            run.notes += notes
        for n, p in run.placed_on(axis).items():  # parameters already placed stay where they are
            if not is_replicate(p):
                placed[n] = p
        run.at_rest[axis] = dict(placed)
        with _ring():
            seq = sequence_inputs(f, traced.arguments, cp, chunks(run.mesh))
            return shard(run.current(f), "replicate", run.sub(axis), annotations=seq, output_hints=run.remap(run.output_hints, f),
                         target=run.target, at_rest=placed, hoist=False, keep_splits=True)

    def backward(self, run: AxisPass, axis: int, forward: ShardedFusion) -> ShardedFusion:
        b = run.traced.backward
        inputs, hints = backward_annotations(b, forward.view(axis))
        hints.update(run.grad_hints)  # each rank passed the whole arguments: their gradients whole
        annotations, placed = split_at_rest(inputs, b)  # FSDP over cp
        with _ring():
            return shard(run.current(b), "replicate", run.sub(axis), annotations=annotations, output_hints=run.remap(hints, b),
                         target=run.target, at_rest=placed, hoist=False, keep_splits=True)

    def extra_steps(self, phase: str, sharded: ShardedFusion, axis: int) -> list[dict[str, Any]]:
        return ring_records(phase, sharded)

    layout = 2  # inside dp, outside tp

    def refuse(self, extent: int, facts: Any) -> str | None:
        if facts.sequence is None:
            return "the model's arguments have no sequence axis ([B, T, ...]) for cp to split"
        if facts.sequence % (2 * extent):
            return f"the sequence of {facts.sequence} does not split into the balanced layout's 2 x {extent} pieces"
        return super().refuse(extent, facts)

    def conflicts(self, extents: Mapping[str, int], options: Mapping[str, Any], facts: Any) -> str | None:
        if extents[self.name] == 1:
            return None
        mesh = DeviceMesh.of_shape(tuple(extents.values()), tuple(extents))
        pieces = extents[self.name] * chunks(mesh)
        if facts.sequence is not None and facts.sequence % pieces:
            return f"the sequence of {facts.sequence} does not split into the {pieces} pieces cp={extents[self.name]} takes with tp"
        return None

    def cost_terms(self, costed: Any) -> dict[str, float]:
        """What the step waits for cp's collectives (the weights' gradients), and the ring
        attention's steps: each attention runs n blocks of its queries against the travelling
        K/V, one step beside each block but the last: (n - 1) max(step, block) more than one block
        (the op's own time, counted with the ops)."""
        ring = 0.0
        for phase, sharded, factor, times in costed.programs():
            ring += times * ring_seconds(phase, sharded, factor, costed.machine)
        return {f"{self.name} communication": costed.waited(self.name), f"{self.name} ring attention": ring}

    def headline(self, report: Any, axis: int) -> str:
        return ("the sequence split over cp (attention by ring: K/V blocks passed by point-to-point steps, no all-gather of K or V)"
                + ("" if SEQUENCE_SPLITTER in report.mesh.names else ", weights whole (no tp axis)"))


def check_arguments(mesh: DeviceMesh, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Before tracing: each argument's sequence axis divides into the balanced layout's pieces."""
    if NAME not in mesh.names:
        return
    cp, parts = mesh.shape[mesh.names.index(NAME)], chunks(mesh)
    for name, shape in shapes.items():
        if len(shape) > SEQUENCE_DIM and shape[SEQUENCE_DIM] % (cp * parts):
            raise ContextError(f"argument {name} {list(shape)}: its sequence axis (dimension {SEQUENCE_DIM}) of length "
                               f"{shape[SEQUENCE_DIM]} cannot be split over the cp axis of size {cp}; pass a sequence length "
                               f"that is a multiple of {cp * parts}")
