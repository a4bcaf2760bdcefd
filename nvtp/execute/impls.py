"""The reference backend's op table: ``IMPLS`` (op kind -> its torch implementation, registered
by ``@impl``) and the ``Context`` an implementation may ask beyond its arguments (placements,
this rank's global indices, dtypes, a seeded generator). The implementations live in
``impls_tensor.py`` (elementwise, reductions, shapes), ``impls_nn.py`` (matmuls, attention,
factories, indexing) and ``sets.py`` (resharding); ``reference.py`` runs a fusion with them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from nvtp.execute.collectives import Comm, Communication, SoloComm, take
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Fusion, Op, TensorValue, Value
from nvtp.registry import registrar
from nvtp.sharding.placements import DeviceMesh, Placement, held, local_shape


class ExecutionError(RuntimeError):
    """An op failed while running; names the op."""


def positional():
    """A context for index arithmetic that depends on the mesh position alone (which global indices
    a rank holds): while a piece of a rank's program is traced to an aten graph
    (``nvtp/execute/inductor.py``) its results are constants of the graph, not traced ops, so a
    check that reads them (``bool(...)``) is no data-dependent read. Nothing changes otherwise."""
    return disable_proxy_modes_tracing()


Impl = Callable[["Context", Op, dict[str, Any]], Any]
IMPLS: dict[str, Impl] = {}


impl = registrar(IMPLS, "reference impl")


@dataclass
class Context:
    """What an implementation may know beyond its arguments: placements, rank and randomness."""

    fusion: Fusion
    shardings: Mapping[str, tuple[Placement, ...]] | None = None
    mesh: DeviceMesh | None = None
    comm: Comm = field(default_factory=SoloComm)
    seed: int = 0
    compute_dtype: torch.dtype | None = None
    op: Op | None = None
    rng_count: int = 0
    log: list[Communication] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # local shapes by value name, as asked
    held: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)  # indices(v) by value name, as asked
    steps: Mapping[str, Any] | None = None  # a set's result -> its ReshardStep (nvtp.sharding.reshard), as planned
    rings: Mapping[str, int] = field(default_factory=dict)  # an attention run by ring (its first result) -> its mesh axis, as planned
    options: Mapping[str, Any] = field(default_factory=dict)  # the axis options the program was planned with (ShardedFusion.options)
    experts: Any = None  # an ep program's expert rows (nvtp.execute.ep.Experts): the ops they run, on them

    # -- placements -----------------------------------------------------------------------
    def sharding(self, v: Value) -> tuple[Placement, ...] | None:
        if self.shardings is None or not isinstance(v, TensorValue):
            return None
        return self.shardings.get(v.name)

    def acting_sharding(self, v: Value) -> tuple[Placement, ...] | None:
        """``sharding(v)`` with None on each mesh axis of one rank: a placement there says nothing,
        the rank holds the whole value (a tp axis of one rank splits and reduces nothing)."""
        ps = self.sharding(v)
        if ps is None:
            return None
        extents = self.mesh.shape if self.mesh is not None else ()
        return tuple(p if i >= len(extents) or extents[i] > 1 else None for i, p in enumerate(ps))

    def indices(self, v: Value) -> list[torch.Tensor | None]:
        """Per axis, the global indices this rank holds of ``v`` (None: all of them); worked out
        once per value and mesh position (``held``), the list not to be changed."""
        got = self.held.get(v.name)
        if got is None:
            sharding = self.sharding(v)
            if sharding is None or self.mesh is None:
                got = [None] * len(v.shape)
            else:
                with positional():
                    got = held(v.shape, sharding, self.mesh, [self.coord(a) for a in range(self.mesh.ndim)])
                    got = [None if i is not None and i.numel() == n and bool((i == torch.arange(n)).all()) else i  # all, in order
                           for i, n in zip(got, v.shape)]
            self.held[v.name] = got
        return got

    def coord(self, axis: int) -> int:
        """This rank's coordinate on mesh axis ``axis``."""
        if self.mesh is None or self.mesh.ndim == 1:
            return self.comm.rank
        return self.mesh.coords(self.mesh.devices[self.comm.rank])[axis]

    def local_shape(self, v: Value) -> tuple[int, ...]:
        shape = self.shapes.get(v.name)
        if shape is None:
            sharding = self.sharding(v)
            shape = tuple(v.shape) if sharding is None or self.mesh is None else local_shape(v.shape, sharding, self.mesh)
            self.shapes[v.name] = shape
        return shape

    def take_local(self, full: torch.Tensor, v: Value) -> torch.Tensor:
        """This rank's part of ``full``, a whole (global) value of ``v``."""
        for axis, index in enumerate(self.indices(v)):
            full = take(full, axis, index)
        return full

    def dtype(self, dt: DType) -> torch.dtype:
        t = dt.torch
        if self.compute_dtype is not None and t.is_floating_point:
            return self.compute_dtype
        return t

    def generator(self, *keys: Any) -> torch.Generator:
        """A generator for the next random op, the same on every rank and in every run with ``seed``."""
        self.rng_count += 1
        text = repr((self.seed, self.rng_count) + tuple(keys)).encode()
        g = torch.Generator()
        g.manual_seed(int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1))
        return g


def as_number(x: Any) -> Any:
    """Python numbers stay numbers; 0-dim tensors (scalar values) become numbers for torch APIs that need them."""
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        return x.item()
    return x


def as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, bool):
        return torch.tensor(x)
    if isinstance(x, int):
        return torch.tensor(x, dtype=torch.int64)
    if isinstance(x, complex):
        return torch.tensor(x, dtype=torch.complex128)
    return torch.tensor(x, dtype=torch.float64)
