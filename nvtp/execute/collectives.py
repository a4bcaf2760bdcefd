"""Collectives and resharding on local tensors.

``Comm`` is the small interface the reference backend needs: all-reduce, all-gather and
reduce-scatter on this rank's tensor. ``DistComm`` wraps torch.distributed (gloo on CPU, NCCL on
GPU); ``ThreadComm`` runs the ranks of one process as threads for the fast simulated tier.
``reshard`` turns a local tensor from one placement into another with those collectives.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from nvtp.execute.buckets import Bucket, views
from nvtp.sharding.placements import Placement, Zigzag, axis_split, is_partial, local_indices


class Comm(Protocol):
    rank: int  # position on the mesh
    size: int

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...

    def reduce_scatter(self, chunks: Sequence[torch.Tensor], op: str) -> torch.Tensor: ...


class SoloComm:
    """One rank, no communication."""

    rank, size = 0, 1

    def all_reduce(self, t, op):
        return t

    def all_gather(self, t):
        return [t]

    def reduce_scatter(self, chunks, op):
        return chunks[0]

    def all_reduce_(self, t, op):
        return t


def _reduce(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    out = tensors[0].clone()
    for t in tensors[1:]:
        if op == "sum":
            out += t
        elif op == "max":
            out = torch.maximum(out, t)
        elif op == "min":
            out = torch.minimum(out, t)
        else:
            raise ValueError(f"unsupported reduction {op!r}")
    return out


class MeshComm:
    """One rank of a mesh of several axes: ``rank`` is its position on the mesh (row-major),
    ``axes[a]`` the collectives of its process group along mesh axis ``a``."""

    def __init__(self, rank: int, size: int, axes: Sequence[Comm]):
        self.rank, self.size, self.axes = rank, size, list(axes)

    def _whole(self, name: str):
        raise TypeError(f"{name} on a mesh of several axes needs an axis: use on_axis(comm, axis)")

    def all_reduce(self, t, op):
        self._whole("all_reduce")

    def all_gather(self, t):
        self._whole("all_gather")

    def reduce_scatter(self, chunks, op):
        self._whole("reduce_scatter")


def on_axis(comm: Comm, axis: int) -> Comm:
    """The collectives along mesh axis ``axis`` (on a 1-D mesh, ``comm`` itself)."""
    axes = getattr(comm, "axes", None)
    if axes is None:
        if axis != 0:
            raise ValueError(f"a 1-D comm has no mesh axis {axis}")
        return comm
    return axes[axis]


@dataclass
class Communication:
    """A collective that ran: its kind, the value it produced and the bytes of that value."""

    kind: str
    value: str
    nbytes: int
    axis: int = 0  # the mesh axis it ran on


class ThreadGroup:
    """Shared state of ranks simulated as threads of one process."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list = [None] * size

    def exchange(self, rank: int, item):
        self.slots[rank] = item
        self.barrier.wait()
        items = list(self.slots)
        self.barrier.wait()
        return items

    def abort(self) -> None:
        self.barrier.abort()


class ThreadComm:
    """Collectives between threads of one process (deterministic: reductions run in rank order)."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce(self, t, op):
        return _reduce(self.group.exchange(self.rank, t), op)

    def all_reduce_(self, t, op):
        """``all_reduce`` into ``t`` itself, once every rank has read it."""
        out = self.all_reduce(t, op)
        self.group.barrier.wait()
        return t.copy_(out)

    def all_gather(self, t):
        return [x.clone() for x in self.group.exchange(self.rank, t)]

    def reduce_scatter(self, chunks, op):
        everything = self.group.exchange(self.rank, list(chunks))
        return _reduce([c[self.rank] for c in everything], op)


class Progress:
    """How many communications this process has started, since when it waits in the current one
    (None between them), and on which ranks (``peers``: global ranks; None: every rank of the
    default group, which all run the same collectives): the watchdog (``nvtp.execute.watchdog``)
    names the rank that never reaches a communication another rank waits in. ``on_failure``, set
    by a running watchdog, hears of a communication that raised (a peer gone), to name the peer.

        with PROGRESS:                                   # a collective on the default group
        with PROGRESS.on((0,), "a receive from rank 0"):  # a receive, a collective on a sub-group
    """

    def __init__(self) -> None:
        self.count = 0
        self.since: float | None = None
        self.peers: tuple[int, ...] | None = None
        self.what = ""
        self.on_failure: Callable[[BaseException], None] | None = None
        self.busy_with: tuple[float, str] | None = None  # (since, in wall-clock seconds; what): compiling

    def __enter__(self) -> "Progress":
        self.count += 1
        self.since = time.monotonic()
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:  # a collective that raised never completed: keep when it started
            self.since, self.peers, self.what = None, None, ""
        elif self.on_failure is not None and isinstance(value, Exception):
            self.on_failure(value)  # may stop this process, naming the peer that failed

    @contextlib.contextmanager
    def on(self, peers: Sequence[int] | None, what: str = ""):
        """A communication that waits on ``peers`` (None: every rank), described by ``what``."""
        with self:
            self.peers, self.what = (tuple(peers) if peers is not None else None), what
            yield self

    @contextlib.contextmanager
    def busy(self, what: str):
        """Work a peer may wait on for longer than the timeout without this rank being hung
        (tracing and sharding a model: the watchdog allows it ``COMPILE_S``)."""
        saved = self.busy_with
        self.busy_with = (time.time(), what)
        try:
            yield self
        finally:
            self.busy_with = saved

    def published(self) -> str:
        """What the watchdog publishes for the others: the count; while waiting ``|`` and the ranks
        waited on (``*``: every rank); while busy ``|~`` when it started (wall clock) ``~`` and what."""
        if self.since is None:
            if self.busy_with is not None:
                return f"{self.count}|~{self.busy_with[0]:.3f}~{self.busy_with[1]}"
            return str(self.count)
        return f"{self.count}|" + ("*" if self.peers is None else ",".join(map(str, self.peers)))


PROGRESS = Progress()


class DistComm:
    """torch.distributed collectives on a process group (gloo or NCCL)."""

    _OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}

    def __init__(self, group=None):
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        # the global ranks a collective here waits on (None: the whole default group, as every rank runs it)
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        self.ranks = ranks if ranks is not None else list(range(dist.get_world_size()))
        whole = ranks is None or len(ranks) == dist.get_world_size()
        self.peers = None if whole else tuple(r for r in ranks if r != dist.get_rank())

    def _waiting(self, kind: str):
        return PROGRESS.on(self.peers, "" if self.peers is None else f"{kind} over ranks {self.ranks}")

    def _op(self, op):
        return getattr(self.dist.ReduceOp, self._OPS[op])

    def all_reduce(self, t, op):
        return self.all_reduce_(t.contiguous().clone(), op)

    def all_reduce_(self, t, op):
        """``all_reduce`` into ``t`` itself (contiguous)."""
        with self._waiting("an all-reduce"):
            self.dist.all_reduce(t, op=self._op(op), group=self.group)
        return t

    def all_gather(self, t):
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        with self._waiting("an all-gather"):
            self.dist.all_gather(parts, t, group=self.group)
        return parts

    def reduce_scatter(self, chunks, op):
        chunks = [c.contiguous() for c in chunks]
        out = torch.empty_like(chunks[self.rank])
        with self._waiting("a reduce-scatter"):
            self.dist.reduce_scatter(out, chunks, op=self._op(op), group=self.group)
        return out

    def reduce(self, t: torch.Tensor, dst: int, op: str = "sum") -> torch.Tensor:
        """``t`` summed (``op``) over this group into global rank ``dst``'s ``t`` (in place)."""
        with self._waiting(f"a reduce to rank {dst}"):
            self.dist.reduce(t, dst, op=self._op(op), group=self.group)
        return t

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """``t`` from global rank ``src`` of this group, on every rank of it (in place)."""
        with self._waiting(f"a broadcast from rank {src}"):
            self.dist.broadcast(t, src, group=self.group)
        return t


# ---------------------------------------------------------------------------------------------
# point to point (a pipeline's activations and gradients): communications the watchdog watches


def recv(buf: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
    """Receive ``buf`` from global rank ``src`` (blocking); a rank that never sends is named by
    the watchdog after its timeout, one that died at once."""
    with PROGRESS.on((src,), f"a receive from rank {src}"):
        dist.recv(buf, src, tag=tag)
    return buf


def isend(t: torch.Tensor, dst: int, tag: int = 0):
    """Start sending ``t`` to global rank ``dst``; ``wait_sent`` the handle it returns."""
    with PROGRESS.on((dst,), f"a send to rank {dst}"):
        return dist.isend(t, dst, tag=tag), dst


def wait_sent(handle) -> None:
    """Wait for a send ``isend`` started, as a communication the watchdog watches."""
    work, dst = handle
    with PROGRESS.on((dst,), f"a send to rank {dst}"):
        work.wait()


def take(t: torch.Tensor, dim: int, index: torch.Tensor | None) -> torch.Tensor:
    """``t``'s entries ``index`` along ``dim`` (a narrow when the index is a contiguous range)."""
    if index is None:
        return t
    n = index.numel()
    with disable_proxy_modes_tracing():  # the index is fixed by the mesh position: read, not traced (inductor.py)
        first = int(index[0]) if n and int(index[-1]) - int(index[0]) == n - 1 else None
    if first is not None:
        return t.narrow(dim, first, n)
    return t.index_select(dim, index)


def gather_axis(t: torch.Tensor, dim: int, split_factor: int, comm: Comm) -> torch.Tensor:
    """All-gather the shards of axis ``dim`` back into the whole axis (any split factor)."""
    return joined(comm.all_gather(t), dim, split_factor)


def joined(parts: Sequence[torch.Tensor], dim: int, split_factor: int, placement: Placement | None = None) -> torch.Tensor:
    """Every rank's shard of axis ``dim`` (in rank order), joined into the whole axis."""
    if isinstance(placement, Zigzag):  # each rank's pieces put where local_indices says they are
        size = parts[0].shape[dim] * len(parts)
        whole = torch.empty(*parts[0].shape[:dim], size, *parts[0].shape[dim + 1:], dtype=parts[0].dtype)
        for r, part in enumerate(parts):
            whole.index_copy_(dim, local_indices(size, placement, len(parts), r), part)
        return whole
    if split_factor == 1:
        return torch.cat(parts, dim)
    pieces = [p.unflatten(dim, (split_factor, -1)) for p in parts]  # [.., k, c, ..]
    return torch.stack(pieces, dim + 1).flatten(dim, dim + 2)  # [.., k, d, c, ..] -> [.., k*d*c, ..]


def reshard(t: torch.Tensor, kind: str, src: Placement, dst: Placement, global_size: Sequence[int], comm: Comm) -> torch.Tensor:
    """This rank's part of a tensor placed ``src``, re-placed as ``dst`` on one mesh axis, by the
    step ``kind`` the program planned (``nvtp.sharding.reshard.reshard_kind``): it is run as
    given, never worked out again here."""
    op = src.reduce_op if is_partial(src) else "sum"
    if kind == "allgather":
        dim, factor = axis_split(src)
        return _from_whole(joined(comm.all_gather(t), dim, factor, src), dst, global_size, comm)
    if kind == "allreduce":
        return _from_whole(comm.all_reduce(t, op), dst, global_size, comm)
    if kind == "reduce_scatter":
        dim, _ = axis_split(dst)
        chunks = [take(t, dim, local_indices(global_size[dim], dst, comm.size, r)) for r in range(comm.size)]
        return comm.reduce_scatter(chunks, op)
    if kind in ("slice", "partition"):
        return _from_whole(t, dst, global_size, comm)
    raise ValueError(f"no reshard step {kind!r} (from {src} to {dst}); nvtp.sharding.reshard.reshard_kind names the steps")


def _from_whole(t: torch.Tensor, dst: Placement, global_size: Sequence[int], comm: Comm) -> torch.Tensor:
    """This rank's part, placed ``dst``, of ``t``, a whole value every rank holds."""
    split = axis_split(dst)
    if split is not None:
        dim, _ = split
        return take(t, dim, local_indices(global_size[dim], dst, comm.size, comm.rank))
    if is_partial(dst):  # rank 0 keeps the value and the others hold zeros: their sum is the value, exactly
        return t if comm.rank == 0 else torch.zeros_like(t)
    return t


# ---------------------------------------------------------------------------------------------
# started now, waited for later: the scheduled program's collectives (nvtp.sharding.overlap)


class Done:
    """A collective that completed when it was started: ``wait`` gives its result."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value

    def complete(self) -> None:
        pass


class _Work:
    """A torch.distributed collective under way (``async_op=True``): ``wait`` blocks until it is done."""

    def __init__(self, work, value, comm: "DistComm", kind: str):
        self.work, self.value, self.comm, self.kind = work, value, comm, kind

    def wait(self):
        if self.work is not None:
            with self.comm._waiting(self.kind), torch.profiler.record_function(f"nvtp: waiting for {self.kind}"):  # named in profiles
                self.work.wait()
            self.work = None
        return self.value


def start(comm: Comm, kind: str, arg, op: str = "sum"):
    """Start ``comm``'s collective ``kind`` ("all_reduce", "all_gather", "reduce_scatter") on
    ``arg``; a handle whose ``wait()`` gives what the blocking call returns. A ``Comm`` without an
    asynchronous form (threads of one process, one rank) completes it here."""
    method = getattr(comm, f"{kind}_async", None)
    if method is not None:
        return method(arg, op) if kind != "all_gather" else method(arg)
    return Done(getattr(comm, kind)(arg, op) if kind != "all_gather" else getattr(comm, kind)(arg))


def start_all_reduce_(comm: Comm, t: torch.Tensor, op: str = "sum"):
    """Start ``comm``'s all-reduce of the contiguous ``t`` into ``t`` itself: a handle whose
    ``wait()`` gives ``t``, reduced; None for a comm with no in-place form (one that wraps another,
    as the tests' counting comms do), which the caller reduces out of place."""
    method = getattr(comm, "all_reduce_async_", None)
    if method is not None:
        return method(t, op)
    method = getattr(comm, "all_reduce_", None)
    return Done(method(t, op)) if method is not None else None


def _dist_async(self, kind: str, arg, op: str = "sum"):
    if kind in ("all_reduce", "all_reduce_"):  # out of place: a contiguous copy reduced in place
        t = arg if kind == "all_reduce_" else arg.contiguous().clone()
        return _Work(self.dist.all_reduce(t, op=self._op(op), group=self.group, async_op=True), t, self, "an all-reduce")
    if kind == "all_gather":
        t = arg.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        return _Work(self.dist.all_gather(parts, t, group=self.group, async_op=True), parts, self, "an all-gather")
    chunks = [c.contiguous() for c in arg]
    out = torch.empty_like(chunks[self.rank])
    return _Work(self.dist.reduce_scatter(out, chunks, op=self._op(op), group=self.group, async_op=True), out, self,
                 "a reduce-scatter")


DistComm.all_reduce_async = lambda self, t, op: _dist_async(self, "all_reduce", t, op)  # type: ignore[attr-defined]
DistComm.all_reduce_async_ = lambda self, t, op: _dist_async(self, "all_reduce_", t, op)  # type: ignore[attr-defined]
DistComm.all_gather_async = lambda self, t: _dist_async(self, "all_gather", t)  # type: ignore[attr-defined]
DistComm.reduce_scatter_async = lambda self, chunks, op: _dist_async(self, "reduce_scatter", chunks, op)  # type: ignore[attr-defined]


class _Shared:
    """One collective several reshards share: waited for once."""

    def __init__(self, handle):
        self.handle, self.done, self.value = handle, False, None

    def wait(self):
        if not self.done:
            self.value, self.done = self.handle.wait(), True
        return self.value


class _Share:
    """One reshard's part of a (possibly shared) collective: ``wait`` gives its resharded tensor."""

    def __init__(self, shared: _Shared, finish):
        self.shared, self.finish = shared, finish

    def wait(self):
        return self.finish(self.shared.wait())

    def complete(self) -> None:
        """Wait for the collective, not yet for this reshard's result: the collective's buffers go."""
        self.shared.wait()


def _packed(chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``chunks`` one after the other in one flat buffer, each copied once (a strided chunk too:
    no contiguous copy of it first); one contiguous chunk is its own buffer."""
    if len(chunks) == 1 and chunks[0].is_contiguous():
        return chunks[0].reshape(-1)
    flat = torch.empty(sum(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device)
    at = 0
    for c in chunks:
        flat[at:at + c.numel()].view(c.shape).copy_(c)
        at += c.numel()
    return flat


def start_reshards(items: Sequence[tuple], comm: Comm, bucket: Bucket | None = None) -> list:
    """Start the reshards ``items`` ((local tensor, kind, src, dst, global size), all of one kind,
    reduction and dtype, on one mesh axis) as ONE collective on flattened, concatenated buffers;
    returns one handle per item whose ``wait()`` gives what ``reshard`` gives for it. Reductions
    are elementwise, so each element is summed over the same ranks as alone (bitwise equal on
    two ranks; gloo may order a sum of more ranks differently for another buffer size).

    An all-reduce copies its members into one flat buffer, reduces it in place and gives each
    member's result as a view of it: ``bucket``'s, kept between steps (``nvtp.execute.buckets``:
    a gradient bucket, reused while nothing holds a view of it), else a fresh one."""
    kind = items[0][1]
    if kind in ("slice", "partition"):
        return [Done(_from_whole(t, dst, size, comm)) for t, _, _, dst, size in items]
    src0 = items[0][2]
    op = src0.reduce_op if is_partial(src0) else "sum"
    if kind == "allreduce":
        return _start_all_reduce(items, comm, op, bucket)
    if kind == "allgather":
        flats = [t.contiguous().reshape(-1) for t, *_ in items]
        shared = _Shared(start(comm, "all_gather", torch.cat(flats) if len(flats) > 1 else flats[0]))
        out, at = [], 0
        for (t, _, src, dst, size), flat in zip(items, flats):
            n = flat.numel()
            dim, factor = axis_split(src)

            def finish(parts, at=at, n=n, shape=t.shape, dim=dim, factor=factor, dst=dst, size=size, src=src):
                return _from_whole(joined([p[at:at + n].view(shape) for p in parts], dim, factor, src), dst, size, comm)

            out.append(_Share(shared, finish))
            at += n
        return out
    if kind == "reduce_scatter":
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(comm.size)]  # views of the operands
        mine = []
        for t, _, _, dst, size in items:
            dim, _ = axis_split(dst)
            for r in range(comm.size):
                chunk = take(t, dim, local_indices(size[dim], dst, comm.size, r))
                per_rank[r].append(chunk)
                if r == comm.rank:
                    mine.append(chunk.shape)
        chunks = [_packed(c) for c in per_rank]
        del per_rank
        shared = _Shared(start(comm, "reduce_scatter", chunks, op))
        out, at = [], 0
        for shape in mine:
            n = math.prod(shape)
            out.append(_Share(shared, lambda flat, at=at, n=n, shape=shape: flat[at:at + n].view(shape)))
            at += n
        return out
    raise ValueError(f"no reshard step {kind!r}; nvtp.sharding.reshard.reshard_kind names the steps")


def _start_all_reduce(items: Sequence[tuple], comm: Comm, op: str, bucket: Bucket | None) -> list:
    """``start_reshards`` of all-reduces: each member copied into its slice of one flat buffer
    (``bucket``'s where the tensors are plain, a fresh one otherwise), the buffer reduced in
    place, each result the member's view of it (a comm with no in-place form reduces a copy)."""
    t0 = items[0][0]
    shapes = [t.shape for t, *_ in items]
    if bucket is not None and all(type(t) is torch.Tensor for t, *_ in items) and t0.device.type != "meta":
        buffer, slices = bucket.take(shapes, t0.dtype, t0.device)
    else:  # a fake or traced tensor, or a bucket not kept: this step's own buffer (the type of the tensors')
        buffer = t0.new_empty(sum(t.numel() for t, *_ in items))
        slices = views(buffer, shapes)
    for (t, *_), mine in zip(items, slices):
        mine.copy_(t)
    handle = start_all_reduce_(comm, buffer, op)
    in_place = handle is not None
    shared = _Shared(handle if in_place else start(comm, "all_reduce", buffer, op))  # out of place: slices of its result

    def finish(whole, k, dst, size):
        return _from_whole(slices[k] if in_place else views(whole, shapes)[k], dst, size, comm)

    return [_Share(shared, functools.partial(finish, k=k, dst=dst, size=size)) for k, (_, _, _, dst, size) in enumerate(items)]
