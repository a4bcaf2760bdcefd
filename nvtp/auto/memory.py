"""The bytes one rank holds while a sharded program runs, as nvtp's runtime allocates them.

    peak = live_peak(sharded, schedule, factor, exclude=saved, weight=weight, label=label)
    peak.bytes, peak.parts      # the fullest moment, and what is alive then, by label

A value lives from the op making it to its last reader (the reference backend drops each value
after its last use: ``nvtp.execute.lower``); an output to the end. A value made as a torch view
of its operand (``VIEWS``) holds no bytes and keeps the operand alive as long as it is read.
A backward's saved activations live from its start to their last reader: the runtime hands them
to the backward in a list it empties (``nvtp.parallel._Run``, ``lower.taking_list``), so each is
freed where it was last read, as any value; its incoming gradients live to its end (the caller
holds them while it runs). A scheduled collective
(``nvtp.sharding.overlap``) reads its operands where it starts, not where its ``set`` stands,
and its buffers live from its start: ``BUFFERS`` says what the runtime allocates for one
(``nvtp.execute.collectives.start_reshards``, ``_dist_async``), per kind, in terms of B, this
rank's bytes of the bucket's operands, and n, the ranks of its axis:

* all-reduce: the operands copied into one flat buffer (B) reduced in place, whose slices are the
  results: it lives as long as any result does (a gradient: to the end of the step; a backward's
  gradient bucket is kept between steps, ``nvtp.execute.buckets``, the gradients' own bytes);
* all-gather: the operands concatenated (B, several members; the collective holds it until it
  is waited for, at its first member) and every rank's part (n B), alive until the last member
  is waited for; each member's whole result is made where it is waited for (a value of its own,
  from there to its last reader);
* reduce-scatter: every rank's chunk, packed into one buffer per rank (B, several members), and
  the other ranks' chunks copied again by gloo's reduce-scatter (``c10d::reduce_scatter_`` clones
  them: (n - 1) B / n, seen in torch's profiler on 4 gloo processes), until it is waited for:
  where the schedule says it is done (FSDP's weight gradients: where the next block's starts,
  ``Issue.done``), else at its first member's wait; the results (B / n) are values.

A ``set`` the schedule does not start (blocking, as ``collectives.reshard`` runs it) holds its
gathered parts (n B, all-gather) only while it runs.

``block`` (per op index: the planner's sample block) and ``mult`` (per sample block: how many
model blocks it stands for) scale what accumulates over the model's depth: a collective's
buffer that spans several blocks holds each member ``mult`` times (one bucket of every block's
gradients), and so does a
value that outlives its block until a collective starts or the program ends (a gradient waiting
for its bucket); a value that dies in its block counts once (the next block reuses its room).
``label(kind, axis, parameter)`` names a collective's buffers (the axis strategy's term), and a
``set``'s result, when the strategy names it (FSDP's gathered weights)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

from nvtp.ir.graph import TensorValue, defines_input
from nvtp.sharding.placements import local_shape

VALUES = "values"  # the label of the op results that no strategy names
ACTIVATIONS = "activations"  # the label of the ``held`` inputs

# kind -> (held while the collective runs, in units of B; momentary at its start; the same unscheduled)
# with B this rank's bytes of the bucket's operands and n the ranks of the axis (see the module docstring)
BUFFERS: dict[str, Callable[[float, int, int], tuple[float, float]]] = {
    "allreduce": lambda b, n, members: (b, 0.0),
    "allgather": lambda b, n, members: (n * b, 0.0),  # and the operands concatenated, to the first wait (SENT)
    "reduce_scatter": lambda b, n, members: ((b if members > 1 else 0.0) + b * (n - 1) / n, 0.0),
}
SENT = frozenset({"allgather"})  # kinds whose operands, concatenated (B, several members), live until the first wait
UNSCHEDULED: dict[str, Callable[[float, int], float]] = {
    "allgather": lambda b, n: n * b,
}


# Ops the reference backend runs as a view of their one operand (``nvtp/execute/impls_tensor.py``:
# torch's reshape, permute, expand, narrow): no bytes of their own; the operand's storage lives
# as long as any view of it. A reshape of a non-contiguous view (a permuted or expanded one:
# ``STRIDED``) copies, as torch's reshape does.
VIEWS = frozenset({"broadcast_in_dim", "broadcast", "expand", "reshape", "permute", "squeeze", "stride_order", "slice"})
STRIDED = frozenset({"broadcast_in_dim", "expand", "permute", "slice"})


def view_roots(ops: Sequence[Any]) -> dict[str, str]:
    """Each value the reference backend makes as a view -> the value whose storage it shares (see ``VIEWS``)."""
    root: dict[str, str] = {}
    strided: set[str] = set()
    for op in ops:
        if op.kind not in VIEWS or len(op.outputs) != 1 or len(op.operands) != 1 or not isinstance(op.operands[0], TensorValue):
            continue
        u, v = op.operands[0].name, op.outputs[0].name
        if op.kind == "reshape" and u in strided:
            continue  # a copy
        root[v] = root.get(u, u)
        if op.kind in STRIDED or u in strided:
            strided.add(v)
    return root


@dataclass
class Peak:
    bytes: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    at: int = -1  # the op index of the fullest moment (-1: before the first op)


def local_bytes(sharded: Any, v: TensorValue, factor: Any) -> float:
    """This rank's bytes of ``v`` (its part under the program's sharding), times ``factor(v)`` (microbatches)."""
    sharding = sharded.shardings.get(v.name)
    shape = v.shape if sharding is None else local_shape(v.shape, sharding, sharded.mesh)
    return math.prod(shape) * v.dtype.itemsize * (factor(v.name) if factor is not None else 1.0)


def live_peak(sharded: Any, schedule: Any, factor: Any, *, exclude: Collection[str] = frozenset(),
              block: Sequence[int] | None = None, mult: Sequence[int] | None = None,
              label: Callable[[str, int, bool], str | None] | None = None, cap: float | None = None,
              held: Mapping[str, float] | None = None, kept: float = 0.0) -> Peak:
    """The most bytes alive at once while ``sharded`` runs under ``schedule`` (None: every
    collective blocking), leaving out its inputs and ``exclude`` (an all-reduce whose results are
    all excluded holds nothing of its own: its buffer is its results); with what is alive then, by label. ``cap``: the most
    bytes one collective's buffer may hold (a bucket's limit). ``held``: inputs alive from the
    start to their last reader (a backward's saved activations: the runtime's autograd function
    hands them over in a list the backward empties, ``nvtp.parallel._Run``), each that many copies
    (the blocks of the model its sample block stands for; all of them to the last reader in the
    sample, as at the first of those blocks the backward reaches), labelled ``ACTIVATIONS``. ``kept``: other
    bytes alive throughout (a backward's incoming gradients, the forward's outputs it does not
    read), labelled ``VALUES``."""
    f = sharded.fusion
    ops = f.ops
    n_ops = len(ops)
    src = sharded.source
    issues = {} if schedule is None else {name: issue for issue in schedule.issues for name in issue.sets}
    outputs = {v.name for v in f.outputs}
    made = {v.name: i for i, op in enumerate(ops) for v in op.outputs}

    def parameter(name: str) -> bool:
        while name in made and ops[made[name]].kind == "set" and ops[made[name]].operands:
            name = ops[made[name]].operands[0].name
        return name in src.values and src.role(name) == "parameter"

    last_use: dict[str, int] = {}
    for i, op in enumerate(ops):
        for v in op.operands:
            issue = issues.get(op.outputs[0].name) if op.kind == "set" and op.outputs else None
            at = i if issue is None else issue.at
            last_use[v.name] = max(last_use.get(v.name, -1), at)
    for name in outputs:
        last_use[name] = n_ops
    views = view_roots(ops)  # a view holds no bytes; its root lives until the view's last reader
    for name, root in views.items():
        if name not in exclude:
            last_use[root] = max(last_use.get(root, -1), last_use.get(name, -1))
    read_by_start = {op.operands[0].name: issues[op.outputs[0].name].at for op in ops
                     if op.kind == "set" and op.outputs and op.outputs[0].name in issues and op.operands}

    def weight(name: str) -> float:
        if block is None or mult is None or name not in made:
            return 1.0
        return float(mult[block[made[name]]])

    def lasting(name: str, i: int) -> bool:
        """Outlives its block: an output, or read last by a collective that starts in another block."""
        if block is None or mult is None:
            return False
        end = last_use.get(name, i)
        if end >= n_ops:
            return True
        return read_by_start.get(name) == end and block[min(end, n_ops - 1)] != block[i]
    events: dict[int, list[tuple[str, float]]] = {}  # op index -> (label, bytes) freed after it

    live: dict[str, float] = {}
    peak = Peak()

    done: dict[int, list[tuple[str, float]]] = {}  # op index -> (label, bytes) of collectives done there, before what starts there

    def add(key: str, nbytes: float, end: int, now: int, at_done: bool = False) -> None:
        live[key] = live.get(key, 0.0) + nbytes
        (done if at_done else events).setdefault(max(end, now), []).append((key, nbytes))

    now = -1

    def check(extra: dict[str, float] | None = None) -> None:
        total = sum(live.values()) + sum((extra or {}).values())
        if total > peak.bytes:
            peak.bytes, peak.at = total, now
            peak.parts = {k: v for k, v in live.items() if v}
            for k, v in (extra or {}).items():
                peak.parts[k] = peak.parts.get(k, 0.0) + v

    def buffer_label(kind: str, axis: int, param: bool) -> str:
        return (label(kind, axis, param) if label is not None else None) or f"{kind} buffers"

    starts: dict[int, list[Any]] = {}
    if schedule is not None:
        for issue in schedule.issues:
            starts.setdefault(issue.at, []).append(issue)
    steps = sharded.set_steps

    def start(at: int) -> None:
        for key, nbytes in done.pop(at, ()):  # the runtime waits for these before it starts the next (lower.py)
            live[key] -= nbytes
        for issue in starts.get(at, ()):
            members = [ops[made[name]] for name in issue.sets]
            kind = steps[issue.sets[0]].kind

            spans = block is not None and len({block[made[name]] for name in issue.sets}) > 1  # one bucket of several blocks

            def bucket(keep: Callable[[str], bool]) -> float:
                b = sum(local_bytes(sharded, op.operands[0], factor) * (weight(op.outputs[0].name) if spans else 1.0) for op in members
                        if isinstance(op.operands[0], TensorValue) and keep(op.outputs[0].name))
                one = sum(local_bytes(sharded, op.operands[0], factor) for op in members if isinstance(op.operands[0], TensorValue))
                return b if cap is None else min(b, max(cap, one))

            n = sharded.mesh.shape[issue.axis]
            rule = BUFFERS.get(kind, lambda b, n, m: (0.0, 0.0))
            held, momentary = rule(bucket(lambda name: True), n, len(members))
            if kind == "allreduce":  # the reduced buffer is its results: those the caller excludes it counts itself
                held = rule(bucket(lambda name: name not in exclude), n, len(members))[0]
            key = buffer_label(kind, issue.axis, parameter(issue.sets[0]))
            if kind == "allreduce":  # its reduced buffer is its results
                end = max(last_use.get(name, n_ops) for name in issue.sets)
            elif kind == "reduce_scatter":  # its buffers go when it is waited for: where it is done, or its first wait
                end = issue.done if issue.done is not None else min(issue.waits)
            else:  # every rank's part, until the last member is made whole
                end = max(issue.waits)
            if held:
                add(key, held, end, at, at_done=issue.done is not None)
            if kind in SENT and len(members) > 1:
                add(key, bucket(lambda name: True), min(issue.waits), at)
            check({key: momentary} if momentary else None)

    for v in f.inputs:
        if isinstance(v, TensorValue) and held and v.name in held:
            add(ACTIVATIONS, local_bytes(sharded, v, factor) * held[v.name], last_use.get(v.name, n_ops), -1)
    if kept:
        add(VALUES, kept, n_ops, -1)
    start(-1)
    for i, op in enumerate(ops):
        now = i
        if not defines_input(op):
            for v in op.outputs:
                if not isinstance(v, TensorValue) or v.name in exclude or v.name in views:
                    continue
                step = steps.get(v.name) if op.kind == "set" else None
                issue = issues.get(v.name)
                if issue is not None and step is not None and step.kind == "allreduce":
                    continue  # a slice of the reduced buffer, counted from its start
                key = VALUES
                if step is not None and step.is_communication and label is not None:
                    key = label(f"{step.kind} result", step.axis, parameter(v.name)) or VALUES
                times = weight(v.name) if lasting(v.name, i) else 1.0
                add(key, local_bytes(sharded, v, factor) * times, last_use.get(v.name, i), i)
                if step is not None and step.is_communication and issue is None and step.kind in UNSCHEDULED:
                    b = local_bytes(sharded, op.operands[0], factor) if isinstance(op.operands[0], TensorValue) else 0.0
                    check({buffer_label(step.kind, step.axis, parameter(v.name)): UNSCHEDULED[step.kind](b, sharded.mesh.shape[step.axis])})
        check()
        start(i)
        for key, nbytes in events.pop(i, ()):
            live[key] -= nbytes
    return peak


__all__ = ["ACTIVATIONS", "BUFFERS", "Peak", "SENT", "STRIDED", "VALUES", "VIEWS", "live_peak", "local_bytes", "view_roots"]
