"""The reference backend's ``set``: a reshard, run as the step the program planned for it
(kind and mesh axis); and how a scheduled program starts a group of them at once
(``start_for``) or runs a collective matmul's ring (``ring_for``)."""

from __future__ import annotations

from typing import Any, Callable

from nvtp.execute.buckets import Bucket
from nvtp.execute.collectives import Communication, on_axis, reshard, start_reshards
from nvtp.execute.impls import Context, ExecutionError, impl
from nvtp.execute.impls_nn import bias_applies
from nvtp.ir.graph import Fusion, Op
from nvtp.sharding.placements import Placement, axis_split, held, induced
from nvtp.sharding.reshard import reshard_kind
from nvtp.execute import ring_matmul


@impl("set")
def _set(ctx: Context, op: Op, a):
    """A reshard: the step the program planned for this ``set`` (``ctx.steps``: its kind and mesh
    axis), run as given; a set a program's steps do not hold is an ``ExecutionError``. A fusion run
    without any steps (``reference.run`` of a bare sharded fusion, in tests) takes each axis whose
    placement changes, by ``reshard_kind``, the one place a step's kind is decided."""
    out = a["arg"]
    if set_is_local(ctx, op):
        return out
    for axis, kind, s, d, size in _reshards(ctx, op):
        out = reshard(out, kind, s, d, size, on_axis(ctx.comm, axis))
        ctx.log.append(Communication(kind, op.outputs[0].name, op.outputs[0].nbytes, axis))
    return out


def _reshards(ctx: Context, op: Op) -> list[tuple[int, str, Placement, Placement, list[int]]]:
    """(mesh axis, kind, src, dst, size as that axis's group sees the value) of each axis a ``set`` changes."""
    v = op.outputs[0]
    src, dst = ctx.sharding(op.operands[0]), ctx.sharding(v)
    step = ctx.steps.get(v.name) if ctx.steps is not None else None
    if ctx.steps is not None and step is None:  # a program's run: the backend decides no communication itself
        raise ExecutionError(f"set {v.name} ({src} -> {dst}) moves data but the program planned no step for it: a bug in nvtp "
                             "(every communication of a program is a step of Program.steps()); please report it with the model")
    axes = [step.axis] if step is not None else [axis for axis, (s, d) in enumerate(zip(src, dst)) if s != d]
    out = []
    for axis in axes:
        s, d = src[axis], dst[axis]
        kind = step.kind if step is not None else reshard_kind(s, d)
        size = list(v.shape)
        if len(src) > 1:  # as this axis's process group sees the value: other axes' splits of a shared axis taken out
            others = held(v.shape, src, ctx.mesh, [ctx.coord(a) for a in range(ctx.mesh.ndim)], skip=axis)
            n = ctx.mesh.shape[axis]
            for dim, o in enumerate(others):  # each of s and d is induced on the tensor axis it splits only
                if o is None or not (_splits(s, dim) or _splits(d, dim)):
                    continue
                size[dim] = o.numel()
                s = induced(s, v.shape[dim], o, n)[0] if _splits(s, dim) else s
                d = induced(d, v.shape[dim], o, n)[0] if _splits(d, dim) else d
        out.append((axis, kind, s, d, size))
    return out


def _splits(p: Placement, dim: int) -> bool:
    split = axis_split(p)
    return split is not None and split[0] == dim


def start_for(issue: Any, ops: list[Op], keep: bool = False) -> Callable[..., list[Any]]:
    """How a scheduled program starts the ``set`` ops of one ``Issue`` (nvtp.sharding.overlap): one
    collective on their concatenated buffers, begun now, waited for where each ``set`` stood. With
    ``keep`` (``keeps_bucket``), an all-reduce's buffer is this node's ``Bucket``, kept between steps."""
    bucket = Bucket() if keep else None

    def start(ctx: Context, *xs: Any) -> list[Any]:
        items = []
        for op, x in zip(ops, xs):
            (axis, kind, s, d, size), = _reshards(ctx, op)  # a scheduled set changes one mesh axis
            items.append((x, kind, s, d, size))
            ctx.log.append(Communication(kind, op.outputs[0].name, op.outputs[0].nbytes, axis))
        return start_reshards(items, on_axis(ctx.comm, issue.axis), bucket)

    start.bucket = bucket  # type: ignore[attr-defined]

    start.__name__ = start.__qualname__ = f"start_{issue.kind}"
    return start


def keeps_bucket(fusion: Fusion, issue: Any) -> bool:
    """Whether a scheduled collective keeps its buffer between steps (``nvtp.execute.buckets``): an
    all-reduce in a backward (a fusion that reads incoming gradients) with a result among the
    fusion's outputs, the gradients it returns: DDP's buckets of weight gradients, which the
    caller holds to the next step's ``zero_grad`` anyway (a member the fusion reads on, e.g. a
    reduced sum that a returned gradient is a product of, is a slice of the same bucket). Other
    all-reduces (activations, the backward's activation gradients) take a fresh buffer each step:
    kept, they would hold memory between steps that nothing needs then."""
    backward = any(fusion.role(v.name) == "grad" for v in fusion.inputs)
    returned = {v.name for v in fusion.outputs}
    return backward and issue.kind == "allreduce" and any(name in returned for name in issue.sets)


def ring_for(ring: Any, op: Op, products: list[Op]) -> Callable[..., Any]:
    """How a scheduled program runs one collective matmul (``nvtp.sharding.overlap.Ring``):
    ``nvtp.execute.ring_matmul``, each ``linear``'s bias added where its op would add it."""
    name = op.outputs[0].name

    def run(ctx: Context, x: Any, *weights: Any) -> Any:
        uses = [(p.kind, weights[2 * k], weights[2 * k + 1] if p.kind == "linear" and bias_applies(ctx, p) else None)
                for k, p in enumerate(products)]
        if ring.kind == "allgather-linear":
            return ring_matmul.allgather_linear(ctx, ring.axis, ring.dim, name, x, uses)
        (use,) = uses
        return ring_matmul.linear_reducescatter(ctx, ring.axis, ring.dim, name, x, use)

    run.__name__ = run.__qualname__ = ring.kind.replace("-", "_")
    return run


def set_is_local(ctx: Context, op: Op) -> bool:
    """True when a ``set`` moves nothing: no placements, the same ones on every mesh axis of more
    than one rank, or one device (on which every placement is the whole tensor): a tp axis of one
    rank reduces nothing."""
    src, dst = ctx.acting_sharding(op.operands[0]), ctx.acting_sharding(op.outputs[0])
    return src is None or dst is None or src == dst or ctx.comm.size == 1
