"""Collective matmul: a gather before a matmul, or a reduce-scatter after one, as ring steps.

    rings = plan_rings(sharded, MACHINES["h100-nvlink"])   # [Ring("allgather-linear", "T237", ...), ...]

Megatron-SP gathers the sequence-split activations before each column-parallel projection and
reduce-scatters the row-parallel projection's partial sums back to sequence-split; each
collective sits on the critical path, since the projection needs it, so starting it early
(``nvtp.sharding.overlap``) hides nothing. Decomposed, the matmul runs block by block beside the
transfers (Wang et al.'s collective matmul; torchtitan's async TP, Megatron's
``--tp-comm-overlap``): n blocks of matmul, n - 1 point-to-point steps of one block each.

``find_rings`` finds where this applies (the forward's ``linear``s and the backward's reshape ->
``matmul`` -> reshape products by a weight), ``ring_seconds`` prices both forms on a
``Machine``, ``plan_rings`` keeps what pays ("auto") or everything (True). The rings are data in
the ``Schedule``; the reference backend runs them (``nvtp.execute.ring_matmul``), and
``collective_matmul_fusions`` writes them as nvFuser expresses the same overlap: the product's
split dimension parallelized over streams (``ParallelType.stream``), next to the device split.
"""

from __future__ import annotations

import dataclasses
import math

from torch.distributed.tensor.placement_types import Shard, _StridedShard

from nvtp.sharding.cost import Machine, ring_seconds
from nvtp.sharding.overlap import Ring
from nvtp.sharding.sharded import ShardedFusion
from nvtp.errors import InputError
from nvtp.ir.build import FusionBuilder
from nvtp.ir.graph import ScheduleStep
from nvtp.sharding.placements import REPLICATE, axis_split, local_shape


SPELLED = {"auto": "auto", "on": True, "off": False}  # the command lines' --collective-matmul


def check_mode(mode: bool | str) -> bool | str:
    """``mode`` as ``plan_rings`` takes it, or ``InputError`` naming the choices."""
    if mode not in (True, False, "auto"):
        raise InputError(f"collective_matmul={mode!r}: pass True, False or 'auto'")
    return mode


def _plain_shard(p) -> int | None:
    """The dimension of a plain contiguous split (torch's ``Shard``, not strided), else None."""
    return p.dim if isinstance(p, Shard) and not isinstance(p, _StridedShard) else None


def find_rings(sharded: ShardedFusion) -> list[Ring]:
    """Every place ``sharded`` could run as a collective matmul (``Ring``), each collective at
    most once; ``why`` empty (``plan_rings`` decides which pay). Taken:

    * an all-gather of a plain split along a leading dimension, whose users include products
      by a weight ready before the gather: ``linear(x, w, b)``, or ``reshape`` to rows ->
      ``matmul(rows, w)`` -> ``reshape`` back (the backward's form of the same product);
    * a reduce-scatter, to a plain split of a leading dimension, of the partial sum such a product
      makes and nothing else uses.

    The split dimension must be split by no other mesh axis and divide evenly."""
    f = sharded.fusion
    index = {v.name: i for i, op in enumerate(f.ops) for v in op.outputs}
    outputs = {v.name for v in f.outputs}
    users: dict[str, list[int]] = {}
    for i, op in enumerate(f.ops):
        for v in op.operands:
            users.setdefault(v.name, []).append(i)

    def local(v):
        return local_shape(v.shape, sharded.shardings[v.name], sharded.mesh)

    def only_use(v, k: int) -> bool:
        return users.get(v.name) == [k] and v.name not in outputs

    def product_of(x, at: int) -> tuple[int, ...] | None:
        """The ops of a product ``x`` feeds as its rows (``at``: the op making x), or None."""
        chains = []
        for u in users.get(x.name, ()):
            op = f.ops[u]
            if op.kind == "linear" and op.arg("arg1").name == x.name and all(index.get(v.name, -1) < at for v in op.operands[1:]):
                chains.append((u,))
            elif op.kind == "reshape" and len(op.outputs[0].shape) == 2 and op.outputs[0].shape[-1] == x.shape[-1]:
                rows = op.outputs[0]
                if len(users.get(rows.name, ())) != 1 or rows.name in outputs:
                    continue
                m = users[rows.name][0]
                mm = f.ops[m]
                if mm.kind != "matmul" or mm.operands[0].name != rows.name or len(mm.operands[1].shape) != 2 \
                        or index.get(mm.operands[1].name, -1) >= at or len(users.get(mm.outputs[0].name, ())) != 1:
                    continue
                back = users[mm.outputs[0].name][0]
                r2 = f.ops[back]
                if only_use(mm.outputs[0], back) and r2.kind == "reshape" and tuple(r2.outputs[0].shape[:-1]) == tuple(x.shape[:-1]):
                    chains.append((u, m, back))
        return tuple(chains) or None

    rings = []
    for i, op in enumerate(f.ops):
        if op.kind != "set" or not op.outputs:
            continue
        out = op.outputs[0]
        step = sharded.set_steps.get(out.name)
        if step is None or not step.is_communication or out.name not in sharded.shardings:
            continue
        n = sharded.mesh.shape[step.axis]
        x = op.operands[0]
        src = sharded.shardings[x.name]
        if step.kind == "allgather":
            dim = _plain_shard(step.src)
            if dim is None or dim >= len(x.shape) - 1 or _split_elsewhere(src, step.axis, dim) or x.shape[dim] % n:
                continue
            chains = product_of(out, i)
            if chains:
                rings.append(Ring("allgather-linear", out.name, i, tuple(c[len(c) // 2] for c in chains), step.axis, dim, n - 1,
                                  math.prod(local(x)) * x.dtype.itemsize, chains=chains, x=x.name))
        elif step.kind == "reduce_scatter":
            dim = _plain_shard(step.dst)
            maker = index.get(x.name)
            if dim is None or maker is None or dim >= len(x.shape) - 1 or _split_elsewhere(src, step.axis, dim) \
                    or x.shape[dim] % n or not only_use(x, i):
                continue
            last = f.ops[maker]
            if last.kind == "linear":
                chain, rows = (maker,), last.arg("arg1")
            elif last.kind == "reshape" and last.operands[0].name in index and only_use(last.operands[0], maker):
                m = index[last.operands[0].name]
                rows = f.ops[m].operands[0] if f.ops[m].kind == "matmul" else None
                flat = f.ops[index[rows.name]] if rows is not None and rows.name in index else None
                if flat is None or flat.kind != "reshape" or tuple(flat.operands[0].shape[:-1]) != tuple(x.shape[:-1]):
                    continue
                chain, rows = (m, maker), flat.operands[0]
            else:
                continue
            rings.append(Ring("linear-reducescatter", out.name, i, (chain[0],), step.axis, dim, n - 1,
                              math.prod(local(out)) * out.dtype.itemsize, chains=(chain,), x=rows.name))
    return rings


def _split_elsewhere(sharding, axis: int, dim: int) -> bool:
    return any(a != axis and (axis_split(p) or (None,))[0] == dim for a, p in enumerate(sharding))


def plan_rings(sharded: ShardedFusion, machine: Machine | None, mode: bool | str = "auto") -> list[Ring]:
    """The collective matmuls to run: ``mode`` True every candidate (``find_rings``), False none,
    "auto" those the cost model (``ring_seconds`` on ``machine``) says are faster as a ring."""
    if mode is False or sharded.mesh.size == 1:
        return []
    out = []
    for ring in find_rings(sharded):
        if machine is None:
            if mode is True:
                out.append(ring)
            continue
        blocking, ringed = ring_seconds(sharded, ring, machine)
        why = f"{blocking * 1e6:.1f} us blocking, {ringed * 1e6:.1f} us as {ring.steps + 1} ring steps on {machine.name}"
        if mode is True or ringed < blocking:
            out.append(dataclasses.replace(ring, why=why))
    return out


# ---------------------------------------------------------------------------------------------
# as nvFuser expresses the same overlap


def collective_matmul_fusions(sharded: ShardedFusion, rings: list[Ring]) -> list[tuple[str, object, list]]:
    """For the first ring of each kind in ``rings`` (of ``sharded``), the product as nvFuser's
    multidevice schedule writes a communication overlapped with a matmul, as in nvFuser's own
    overlap tests (``tests/python/multidevice/test_overlap.py``): the device split of the
    gathered input (``mesh_x``) and a split of the product's rows over streams
    (``ParallelType.stream``): nvFuser's host IR runs one stream per block, each block's
    communication beside the matmul of another. For a reduce-scatter the contraction is split
    over devices (a partial sum, ``rdeviceIdx.x``), the rows over streams, and the ``set`` after
    it reduce-scatters each block. [(name, Fusion, schedule steps)], one tp group of ``n``
    devices; shapes are the values' shapes as that group sees them (other mesh axes' splits
    taken out)."""
    f = sharded.fusion
    out, seen = [], set()
    for ring in rings:
        if ring.kind in seen:
            continue
        seen.add(ring.kind)
        n = ring.steps + 1
        devices = tuple(range(n))
        product = f.ops[ring.linears[0]]
        w = product.operands[1]
        axis = ring.axis

        def group_shape(v):  # the value as the ring's axis's group sees it: other axes' splits taken out
            whole = [p if a != axis else REPLICATE for a, p in enumerate(sharded.shardings[v.name])]
            return local_shape(v.shape, whole, sharded.mesh)

        b = FusionBuilder(f"collective_matmul_{ring.kind.replace('-', '_')}")
        if ring.kind == "allgather-linear":
            x_shape = group_shape(f.ops[ring.at].outputs[0])
            x = b.define_tensor(x_shape, f.values[ring.x].dtype)
            wt = b.define_tensor(group_shape(w), w.dtype)
            y = b.op("linear", x, wt) if product.kind == "linear" else b.op("matmul", x, wt)
            b.add_output(y)
            fusion = b.build()
            xs, ws, ys = (v.name for v in (fusion.inputs[0], fusion.inputs[1], fusion.outputs[0]))
            steps = [ScheduleStep(t, "mesh", devices) for t in (xs, ws, ys)]
            steps += [ScheduleStep(xs, "split", (ring.dim, n, False)), ScheduleStep(xs, "parallelize", (ring.dim, "mesh_x"))]
            w_dim = _plain_shard(sharded.shardings[w.name][axis])
            if w_dim is not None:  # a column-parallel weight: its output features split over the devices too
                last = len(fusion.outputs[0].shape) - 1
                steps += [ScheduleStep(ws, "split", (w_dim, n, False)), ScheduleStep(ws, "parallelize", (w_dim, "mesh_x")),
                          ScheduleStep(ys, "split", (last, n, False)), ScheduleStep(ys, "parallelize", (last, "mesh_x"))]
            steps += [ScheduleStep(ys, "split", (ring.dim, n, False)), ScheduleStep(ys, "parallelize", (ring.dim, "stream"))]
        else:
            rows = f.values[ring.x]
            x_shape = group_shape(rows)
            x = b.define_tensor(x_shape, rows.dtype)
            wt = b.define_tensor(group_shape(w), w.dtype)
            y = b.op("linear", x, wt) if product.kind == "linear" else b.op("matmul", x, wt)
            z = b.op("set", y)
            b.add_output(z)
            fusion = b.build()
            xs, ws = fusion.inputs[0].name, fusion.inputs[1].name
            ys, zs = fusion.ops[-2].outputs[0].name, fusion.outputs[0].name
            k_of_w = 1 if product.kind == "linear" else 0  # the weight's contracted axis
            red = len(x_shape)  # the product's loop domain: its dims, then the contraction
            steps = [ScheduleStep(t, "mesh", devices) for t in (xs, ws, ys, zs)]
            steps += [ScheduleStep(xs, "split", (len(x_shape) - 1, n, False)), ScheduleStep(xs, "parallelize", (len(x_shape) - 1, "mesh_x")),
                      ScheduleStep(ws, "split", (k_of_w, n, False)), ScheduleStep(ws, "parallelize", (k_of_w, "mesh_x")),
                      ScheduleStep(ys, "split", (red, n, False)), ScheduleStep(ys, "parallelize", (red, "mesh_x")),
                      ScheduleStep(ys, "split", (ring.dim, n, False)), ScheduleStep(ys, "parallelize", (ring.dim, "stream")),
                      ScheduleStep(zs, "split", (ring.dim, n, False)), ScheduleStep(zs, "parallelize", (ring.dim, "mesh_x"))]
        out.append((f"collective_matmul_{'allgather' if ring.kind == 'allgather-linear' else 'reducescatter'}", fusion, steps))
    return out
