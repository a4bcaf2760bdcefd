"""Communication scheduling: when each collective of a sharded fusion starts, and which go together.

    plan = schedulecollectives_of(sharded)           # a Schedule: data, kept in the Program
    plan.issues                                    # [Issue(after="T41", sets=("T57", "T58"), axis=1, kind="allreduce", ...), ...]

A ``set`` op sits where its value is first needed. Run as written, each collective blocks the
rank from the moment its input exists to the moment the collective is done. The schedule moves
the *start* of every collective as early as its input allows and leaves the *wait* where the
value is needed, so the ops in between run while the data moves (the reference backend starts
torch.distributed collectives with ``async_op=True``: ``nvtp.execute.collectives.start_reshards``):

* **As soon as the input exists.** A collective starts right after the op that makes its input:
  gradient reductions start while the rest of the backward runs, as DDP's and FSDP's do.
* **Prefetch, one bucket ahead.** Gathers of inputs (FSDP's all-gathers of the weights a rank
  holds a part of) would all start before the first op, holding every weight whole at once; as
  FSDP2 does, they go in buckets of consecutive uses of one block (``block_of``: the weights of
  ``blocks.3``, as FSDP2 gathers each ``fully_shard`` unit), and a bucket starts where the
  previous bucket's first gather is waited for: a rank holds the weights of the block it runs
  and of the next, in the forward and again in the backward.
* **Buckets.** Collectives of one kind, mesh axis, dtype and reduction that can start at the same
  point go as one collective on a concatenated buffer, up to ``bucket_bytes`` (default 25 MiB,
  DDP's ``bucket_cap_mb``): many small gradient all-reduces become one. A bucket never starts
  after one of its members is needed, so it waits for no later value than a member would alone.
  The reference backend keeps a backward's gradient buckets between steps, the gradients views
  of them (``nvtp.execute.buckets``).
  Reduce-scatters of weight gradients (FSDP's) go by block too, and only one is under way at a
  time, as in FSDP2: a bucket is waited for where the next one starts (``Issue.done``), so its
  buffers (every rank's chunk of the block's gradients) are freed a block later, not at the end
  of the backward where the gradients are needed.

The schedule is data (``Issue``s) computed from the sharded fusion's ``ReshardStep``s: it changes
no op and no collective, only when collectives start and how they are grouped, so the scheduled
program computes what the unscheduled one does (elementwise reductions of concatenated buffers
sum each element over the same ranks: bitwise on two ranks). ``nvtp.jit(..., overlap=False)``
runs the fusion as written.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from nvtp.ir.graph import TensorValue
from nvtp.sharding.placements import is_partial
from nvtp.sharding.report import weight_of
from nvtp.sharding.sharded import ShardedFusion

BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


@dataclass(frozen=True)
class Issue:
    """Collectives started together, right after the op making ``after`` (None: before the first op)."""

    after: str | None
    at: int  # the index of that op in the fusion (-1: before the first)
    sets: tuple[str, ...]  # the results of the ``set`` ops it starts, in the order they are waited for
    waits: tuple[int, ...]  # where each is waited for: its set op's index
    axis: int
    kind: str
    bytes: int  # sent per rank, all of them together
    done: int | None = None  # the op after which it is waited for as a whole, its buffers freed (None: at its first wait)


@dataclass(frozen=True)
class Ring:
    """A collective decomposed with the matmuls beside it into ring steps (collective matmul):

    * ``"allgather-linear"``: the ``set`` ``name`` gathers a tensor split along ``dim`` over mesh
      axis ``axis`` and the products ``linears`` (op indices: ``linear``, or ``matmul`` between
      reshapes to rows and back, ``chains``) multiply it. Each of the n steps multiplies the
      block at hand while it travels to the next rank: n - 1 point-to-point steps of one block,
      each overlapped with a block's matmuls.
    * ``"linear-reducescatter"``: the ``set`` ``name`` reduce-scatters the partial sum the
      ``linear`` ``linears[0]`` makes. Each step computes one block of the product and adds it to
      the running sum that arrives from the previous rank: n - 1 steps, each overlapped with the
      next block's matmul.

    The result is the same product, summed in another order (within rounding)."""

    kind: str
    name: str  # the set's result
    at: int  # the index of the op whose place the ring takes (the set for allgather, the set for reduce-scatter)
    linears: tuple[int, ...]
    axis: int
    dim: int  # the split dimension of the gathered input (allgather) or the scattered output (reduce-scatter)
    steps: int  # point-to-point steps
    step_bytes: int  # bytes each step sends
    why: str = ""  # the cost model's figures
    x: str = ""  # the value the ring reads: the gathered block, or the rows of the product it reduce-scatters
    chains: tuple[tuple[int, ...], ...] = ()  # per product, the ops the ring computes: (linear,) or (reshape, matmul, reshape) (a gather's), (matmul, reshape) (a reduce-scatter's)


@dataclass
class Schedule:
    issues: list[Issue] = field(default_factory=list)
    bucket_bytes: int = BUCKET_BYTES
    rings: list[Ring] = field(default_factory=list)

    def ring_of(self, name: str) -> Ring | None:
        return next((r for r in self.rings if r.name == name), None)

    def issue_of(self, name: str) -> Issue | None:
        return next((i for i in self.issues if name in i.sets), None)

    def by_position(self) -> dict[int, list[Issue]]:
        """Issues by the index of the op after which they start (-1: before the first op)."""
        out: dict[int, list[Issue]] = {}
        for i in self.issues:
            out.setdefault(i.at, []).append(i)
        return out


@dataclass
class _Comm:
    name: str  # the set's result
    ready: int  # index of the op making its input (-1: a fusion input)
    wait: int  # index of the set op
    axis: int
    kind: str
    key: tuple  # what must agree to share one collective
    bytes: int
    tensor_bytes: int
    gathers_input: bool
    block: str | None = None  # the block of the weight it moves (``block_of``), None: it moves no weight


def block_of(label: str) -> str:
    """The block a parameter belongs to, by its label: its path up to the first index into a list
    of modules (``blocks.3.attn.wq.weight`` and ``grad(blocks.3.mlp.w1.weight)`` -> ``blocks.3``,
    ``model.layers.0.experts.1.w`` -> ``model.layers.0``); "" for one outside every list (an
    embedding, the final norm, the head). FSDP2's unit, as torchtitan wraps a model: each block,
    then the model itself."""
    inner = label[5:-1] if label.startswith("grad(") and label.endswith(")") else label
    parts = inner.split(".")
    first = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return "" if first is None else ".".join(parts[:first + 1])


def collectives_of(sharded: ShardedFusion) -> list[_Comm]:
    """Each communicating ``set`` of ``sharded``: where its input is ready, where it is waited for, its kind and bytes."""
    f = sharded.fusion
    index = {v.name: i for i, op in enumerate(f.ops) for v in op.outputs}
    inputs = {v.name for v in f.inputs}
    users = f.consumers()  # once: weight_of per collective would make it quadratic in the ops
    out = []
    for i, op in enumerate(f.ops):
        if op.kind != "set" or not op.outputs:
            continue
        name = op.outputs[0].name
        step = sharded.set_steps.get(name)
        if step is None or not step.is_communication:
            continue
        v = op.outputs[0]
        operand = op.operands[0].name
        ready = -1 if operand in inputs else index[operand]
        reduce = step.src.reduce_op if is_partial(step.src) else ""
        dtype = v.dtype.value if isinstance(v, TensorValue) else ""
        weight = weight_of(sharded, name, step, users) if step.kind in ("allgather", "reduce_scatter") else ""
        out.append(_Comm(name, ready, i, step.axis, step.kind, (step.axis, step.kind, dtype, reduce), step.bytes,
                         step.tensor_bytes, operand in inputs and step.kind == "allgather", block_of(weight) if weight else None))
    return out


def schedule_collectives(sharded: ShardedFusion, bucket_bytes: int = BUCKET_BYTES, rings: Sequence[Ring] = ()) -> Schedule:
    """The start point and bucket of every collective of ``sharded`` (see the module docstring);
    the ``set``s of ``rings`` (``plan_rings``) run as their rings instead.
    Ensures: every issue starts after its inputs exist and before its first member is waited for
    (and is done, where ``done`` says, after its start and before that wait); members share kind,
    mesh axis, dtype and reduction, and the block of the weights they move; a bucket holds at
    most ``bucket_bytes`` of tensor (or one collective larger than that)."""
    in_rings = {r.name for r in rings}
    comms = [c for c in collectives_of(sharded) if c.name not in in_rings]
    f = sharded.fusion
    names = [op.outputs[0].name if op.outputs else "" for op in f.ops]
    issues: list[Issue] = []

    # Gathers of inputs: buckets of consecutive uses, each started where the previous one's first is waited for.
    gathers = sorted((c for c in comms if c.gathers_input), key=lambda c: c.wait)
    rest = [c for c in comms if not c.gathers_input]
    previous_first_wait: dict[tuple, int] = {}
    for bucket in _consecutive_buckets(gathers, bucket_bytes):
        key = bucket[0].key
        at = previous_first_wait.get(key, -1)
        at = min(at, bucket[0].wait - 1)
        previous_first_wait[key] = bucket[0].wait
        issues.append(_issue(bucket, at, names))

    # Everything else: as soon as the input exists, in buckets that never start after a member is needed.
    open_buckets: dict[tuple, list[_Comm]] = {}
    for c in sorted(rest, key=lambda c: (c.ready, c.wait)):
        bucket = open_buckets.get((c.key, c.block))
        if bucket is not None:
            start = max(c.ready, max(b.ready for b in bucket))
            fits = start < min(c.wait, min(b.wait for b in bucket)) and \
                sum(b.tensor_bytes for b in bucket) + c.tensor_bytes <= bucket_bytes
            if fits:
                bucket.append(c)
                continue
            issues.append(_issue(bucket, max(b.ready for b in bucket), names))
        open_buckets[(c.key, c.block)] = [c]
    for bucket in open_buckets.values():
        issues.append(_issue(bucket, max(b.ready for b in bucket), names))
    issues.sort(key=lambda i: (i.at, min(i.waits)))
    return Schedule(_one_at_a_time(issues, comms), bucket_bytes, list(rings))


def _one_at_a_time(issues: list[Issue], comms: list[_Comm]) -> list[Issue]:
    """``issues`` (in start order) with each reduce-scatter of weight gradients done where the
    next one of its kind and axis starts, when that is before its first wait (FSDP2 keeps one
    under way: its buffers are freed a block later)."""
    moves_weights = {c.name for c in comms if c.kind == "reduce_scatter" and c.block is not None}
    previous: dict[tuple, int] = {}
    out = list(issues)
    for k, issue in enumerate(out):
        if issue.sets[0] not in moves_weights:
            continue
        link = (issue.axis, issue.kind)
        before = previous.get(link)
        if before is not None and out[before].at < issue.at < min(out[before].waits):
            out[before] = replace(out[before], done=issue.at)
        previous[link] = k
    return out


def _consecutive_buckets(comms: list[_Comm], bucket_bytes: int) -> list[list[_Comm]]:
    """``comms`` (in wait order) cut into runs of one key and block of at most ``bucket_bytes``."""
    out: list[list[_Comm]] = []
    for c in comms:
        last = out[-1] if out else None
        if last is not None and (last[0].key, last[0].block) == (c.key, c.block) and \
                sum(b.tensor_bytes for b in last) + c.tensor_bytes <= bucket_bytes:
            last.append(c)
        else:
            out.append([c])
    return out


def _issue(bucket: list[_Comm], at: int, names: list[str]) -> Issue:
    bucket = sorted(bucket, key=lambda c: c.wait)
    return Issue(names[at] if at >= 0 else None, at, tuple(c.name for c in bucket), tuple(c.wait for c in bucket),
                 bucket[0].axis, bucket[0].kind, sum(c.bytes for c in bucket))
