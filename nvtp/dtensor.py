"""An ``nvtp.jit`` module's parameters as torch ``DTensor``s.

On a mesh of processes (torch.distributed initialised, no ``comm=``) every parameter of the
wrapped module becomes a ``DTensor`` on torch's ``DeviceMesh``: ``Shard(dim)`` for a split one,
``Replicate()`` for the rest (all of them, as torchtitan does, so torch's utilities never mix
DTensors and plain tensors). ``clip_grad_norm_``, ``torch.optim`` and
``torch.distributed.checkpoint`` then work on them as on any DTensor model.

The fused QKV projection's weight is split *inside* each of its k = 3 chunks: rank r holds the
r-th slice of q, of k and of v, stacked. Its placement is torch's ``_StridedShard(dim,
split_factor=k)``, but torch 2.10's ``full_tensor``/``redistribute`` fail on it on a 1-D mesh
(an assertion in ``_redistribute``), and DCP describes a DTensor's part as one box per rank, so
``dcp.save`` refuses it. ``FusedShard`` is a DTensor subclass that knows the layout:

* ``full_tensor``/``redistribute(Replicate)``: the local part viewed as ``[k, piece, ...]`` is a
  plain ``Shard(dim + 1)`` DTensor of the ``[k, n/k, ...]`` view; torch gathers that.
* ``__create_chunk_list__``, ``__create_write_items__``, ``__get_tensor_shard__`` (the hooks DCP's
  planner calls, ``torch/distributed/checkpoint/planner_helpers.py``): k boxes per rank, each a
  view of the local tensor, so DCP saves, loads and reshards (2 ranks -> 4) it like any tensor.
* ``__torch_function__`` re-wraps a DTensor result that still carries ``_StridedShard`` into
  ``FusedShard``, so ``torch.zeros_like(p)`` (AdamW's moments, SGD's momentum) and other tensors
  made from the parameter are ``FusedShard`` too. Elementwise ops and norms run as torch's
  ``_StridedShard`` rules give them (they are layout-blind, so correct).

A fused projection whose parts differ in size (Phi-3's ``qkv_proj``, Falcon multi-query's
``query_key_value``: ``nvtp.frontend.fused``) is placed ``FusedParts`` by nvtp: a rank holds its
rows of each part, one part after the other, a part split or whole. Its DTensor placement is
``PartsShard``, a ``Shard`` of the rows (so torch's rules treat it as row-split) that carries the
parts; ``FusedShard`` gathers it part by part, gives DCP one box per part (a whole part's box is
the same on every rank, which DCP's planner writes once), and for norms counts a whole part's rows
once over the ranks, not once per rank (``clip_grad_norm_``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_map_only
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import _foreach_supported_types as optim_types
from torch.utils._foreach_utils import _foreach_supported_types as util_types
import torch.distributed as dist

from nvtp.sharding.placements import FusedParts, axis_split

__all__ = ["FusedShard", "OnStage", "PartsShard", "as_dtensor", "grad_like", "local", "torch_mesh"]


class OnStage(Shard):
    """A pipeline's placement of a parameter on the stage axis: the one stage ``stage`` holds it
    (its local part under the other mesh axes), every other stage holds nothing of it (a local
    tensor with ``dim`` of size 0: no memory).

    To torch it is a ``Shard(dim)`` whose pieces are all on one rank, so the rules that need no
    data movement (elementwise ops, the optimizers' updates, ``linalg.vector_norm`` giving a
    partial norm) run on each rank's part, and a norm is reduced over the stage axis:
    ``torch.nn.utils.clip_grad_norm_(model.parameters())`` sees the whole model's gradients, each
    once. ``full_tensor`` broadcasts from the holding stage; DCP's planner asks each rank's box
    (``_local_shard_size_and_offset``): the holder's is the whole extent, the others' empty, so a
    pipeline's checkpoint loads on any mesh.
    """

    def __init__(self, dim: int, stage: int):
        super().__init__(dim)
        self.stage = stage

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        return (curr_local_size, 0) if rank == self.stage else (0, curr_local_size)

    def _split_tensor(self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True, contiguous: bool = True):
        pieces, pads = [], []
        for r in range(num_chunks):
            t = tensor if r == self.stage else tensor.narrow(self.dim, 0, 0)
            pad = tensor.size(self.dim) - t.size(self.dim) if with_padding else 0
            if pad:
                shape = list(t.shape)
                shape[self.dim] = pad
                t = torch.cat([t, t.new_zeros(shape)], self.dim)
            pieces.append(t.contiguous() if contiguous else t)
            pads.append(pad)
        return pieces, pads

    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        group = mesh.get_group(mesh_dim)
        held = mesh.get_local_rank(mesh_dim) == self.stage
        buf = local_tensor.contiguous().clone() if held else local_tensor.new_zeros(list(current_logical_shape))
        dist.broadcast(buf, dist.get_global_rank(group, self.stage), group=group)
        return buf

    def __eq__(self, other) -> bool:
        # Equal to its own kind on the same stage, and to plain Shard(dim) (torch's DTensorSpec checks
        # each Shard against Shard(dim)); nvtp never mixes it with a plain Shard on the stage axis.
        if isinstance(other, OnStage):
            return other.dim == self.dim and other.stage == self.stage
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self) -> int:
        return hash((OnStage, self.dim, self.stage))

    def __repr__(self) -> str:
        return f"OnStage({self.dim}, stage={self.stage})"

    def __str__(self) -> str:
        return f"stage {self.stage}"


class PartsShard(Shard):
    """torch's placement for nvtp's ``FusedParts`` on a 1-D mesh: rows split (``Shard(dim)`` to
    torch's rules), ``parts`` ((start, stop, split?) per part) saying which rows a rank holds."""

    def __init__(self, dim: int, parts: tuple[tuple[int, int, bool], ...]):
        super().__init__(dim)
        self.parts = tuple(parts)

    def __eq__(self, other) -> bool:
        # Equal to its own kind with the same parts, and to plain Shard(dim) (torch's DTensorSpec checks
        # each Shard against Shard(dim)); nvtp never mixes it with a plain Shard of the same tensor.
        if isinstance(other, PartsShard):
            return other.dim == self.dim and other.parts == self.parts
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self) -> int:
        return hash((PartsShard, self.dim, self.parts))

    def __repr__(self) -> str:
        return f"PartsShard({self.dim}, {self.parts})"

    def __str__(self) -> str:
        return "parts(" + ", ".join(f"[{a}:{b}] {'S' if split else 'R'}" for a, b, split in self.parts) + ")"

    def local_rows(self, n: int, rank: int) -> list[tuple[int, int]]:
        """Per part, the global rows ``[a, b)`` rank ``rank`` of ``n`` holds."""
        out = []
        for a, b, split in self.parts:
            w = (b - a) // n if split else b - a
            out.append((a + rank * w, a + (rank + 1) * w) if split else (a, b))
        return out


def _torch_placement(p):
    """nvtp's placement as torch's (``FusedParts`` -> ``PartsShard``)."""
    if isinstance(p, FusedParts):
        return PartsShard(p.dim, tuple((a, b, axis_split(q) is not None) for a, b, q in p.parts))
    return p


def torch_mesh(mesh, device_type: str = "cpu"):
    """torch's ``DeviceMesh`` for nvtp's ``mesh`` (ranks of the default group; its shape and axis names)."""
    devices = torch.tensor(list(mesh.devices)).reshape(mesh.shape)
    return DeviceMesh(device_type, devices, mesh_dim_names=tuple(mesh.names) if mesh.ndim > 1 else None)


def _contiguous_stride(shape) -> tuple[int, ...]:
    return torch.empty(tuple(shape), device="meta").stride()


def as_dtensor(local_part: torch.Tensor, placement, mesh, shape) -> DTensor:
    """The DTensor whose part on this rank is ``local_part`` (no copy, no communication)."""
    placements = [_torch_placement(p) for p in (placement if isinstance(placement, (tuple, list)) else [placement])]
    d = DTensor.from_local(local_part, mesh, placements, shape=torch.Size(shape), stride=_contiguous_stride(shape),
                           run_check=False)
    return _rewrap(d)


def grad_like(param: DTensor, local_grad: torch.Tensor | None) -> DTensor | None:
    """``local_grad`` (this rank's part) as the gradient of ``param``: a DTensor placed like it."""
    if local_grad is None:
        return None
    return _rewrap(DTensor(local_grad, param._spec, requires_grad=False))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (``t`` itself when it is no DTensor), detached."""
    return t._local_tensor.detach() if isinstance(t, DTensor) else t.detach()


def _strided(t: DTensor) -> bool:
    return any(isinstance(p, (_StridedShard, PartsShard)) for p in t.placements)


def _parts(t: DTensor) -> PartsShard | None:
    return next((p for p in t.placements if isinstance(p, PartsShard)), None)


def _rewrap(t):
    if type(t) is DTensor and _strided(t):
        return FusedShard(t._local_tensor, t._spec, requires_grad=t.requires_grad)
    return t


class FusedShard(DTensor):
    """A DTensor placed ``_StridedShard(dim, split_factor=k)`` on one mesh axis (the fused QKV's
    inner split over tp; on a 2-D mesh the other axis is Replicate or a plain Shard of another dim)
    that ``full_tensor`` and DCP handle; see the module docstring."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _NORMS:  # a whole part is on every rank: count its rows once, not once per rank
            args = tree_map_only(FusedShard, lambda t: t._for_norm(_norm_order(func, args, kwargs)), args)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return tree_map_only(DTensor, _rewrap, out)

    def _for_norm(self, order) -> DTensor:
        """This tensor with its whole parts' rows scaled by n^(-1/order) (n ranks), so a p-norm
        summed over the ranks counts them once; itself when it has no whole part."""
        parts = _parts(self)
        if parts is None or all(split for _, _, split in parts.parts) or order in (float("inf"), float("-inf")):
            return self
        n = self.device_mesh.size()
        scale = torch.ones(self._local_tensor.shape[parts.dim], dtype=self._local_tensor.dtype)
        at = 0
        for (a, b), (_, _, split) in zip(parts.local_rows(n, 0), parts.parts):
            if not split:
                scale[at:at + b - a] = n ** (-1.0 / float(order))
            at += b - a
        shape = [1] * self._local_tensor.ndim
        shape[parts.dim] = -1
        local = self._local_tensor * scale.to(self._local_tensor.device).reshape(shape)
        return DTensor(local, self._spec, requires_grad=False)

    def _split(self) -> tuple[int, int, int, int]:
        """(mesh axis, dim, k, piece): on mesh axis ``axis`` tensor axis ``dim`` is ``[k, n/k]`` and each
        rank holds ``piece`` of each chunk. The other mesh axes split other dims plainly (or not)."""
        axis, p = next((a, q) for a, q in enumerate(self.placements) if isinstance(q, _StridedShard))
        chunk = self.shape[p.dim] // p.split_factor
        return axis, p.dim, p.split_factor, chunk // self.device_mesh.size(axis)

    def _held_elsewhere(self) -> bool:
        """Whether another pipeline stage holds this tensor (``OnStage``): this rank's part is empty."""
        return any(isinstance(q, OnStage) and self.device_mesh.get_local_rank(a) != q.stage for a, q in enumerate(self.placements))

    def _boxes(self) -> list[tuple[torch.Size, torch.Size, torch.Tensor]]:
        """This rank's k boxes of the whole tensor: (offsets, sizes, view of the local tensor)."""
        if self._held_elsewhere():
            return []
        parts = _parts(self)
        if parts is not None:  # one box per part (1-D mesh)
            boxes, at = [], 0
            for a, b in parts.local_rows(self.device_mesh.size(), self.device_mesh.get_local_rank()):
                offsets, sizes = [0] * self.ndim, list(self._local_tensor.shape)
                offsets[parts.dim], sizes[parts.dim] = a, b - a
                boxes.append((torch.Size(offsets), torch.Size(sizes), self._local_tensor.narrow(parts.dim, at, b - a)))
                at += b - a
            return boxes
        axis, dim, k, piece = self._split()
        chunk = self.shape[dim] // k
        sizes = list(self._local_tensor.shape)
        sizes[dim] = piece
        base = [0] * self.ndim
        for a, q in enumerate(self.placements):  # the plain splits of the other mesh axes (a stage's holder starts at 0)
            if a != axis and isinstance(q, Shard) and not isinstance(q, OnStage):
                base[q.dim] = self.device_mesh.get_local_rank(a) * self._local_tensor.shape[q.dim]
        rank = self.device_mesh.get_local_rank(axis)
        boxes = []
        for c in range(k):
            offsets = list(base)
            offsets[dim] = c * chunk + rank * piece
            boxes.append((torch.Size(offsets), torch.Size(sizes), self._local_tensor.narrow(dim, c * piece, piece)))
        return boxes

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        held = next(((a, q) for a, q in enumerate(self.placements) if isinstance(q, OnStage)), None)
        if held is not None:  # the holding stage's part to every stage first, then as on a mesh without stages
            a, q = held
            local = q._to_replicate_tensor(self._local_tensor, self.device_mesh, a, self._holder_shape(a))
            placements = [Replicate() if i == a else p for i, p in enumerate(self.placements)]
            spec = DTensor.from_local(local, self.device_mesh, placements, shape=self.shape, stride=self.stride(), run_check=False)
            return FusedShard(spec._local_tensor, spec._spec, requires_grad=False).full_tensor()
        parts = _parts(self)
        if parts is not None:  # every rank's rows (all ranks hold as many), put back where they belong
            n, dim = self.device_mesh.size(), parts.dim
            local = self._local_tensor
            shape = list(local.shape)
            shape[dim] *= n
            gathered = DTensor.from_local(local, self.device_mesh, [Shard(dim)], shape=torch.Size(shape),
                                          stride=_contiguous_stride(shape), run_check=False).full_tensor()
            whole = local.new_empty(tuple(self.shape))
            for r, chunk in enumerate(gathered.chunk(n, dim)):
                at = 0
                for a, b in parts.local_rows(n, r):
                    whole.narrow(dim, a, b - a).copy_(chunk.narrow(dim, at, b - a))
                    at += b - a
            return whole
        axis, dim, k, piece = self._split()
        part = self._local_tensor.unflatten(dim, (k, piece))  # [k, piece, ...]: a plain Shard(dim + 1)
        shape = list(self.shape)
        shape[dim:dim + 1] = [k, self.shape[dim] // k]
        placements = []
        for a, q in enumerate(self.placements):
            if a == axis:
                placements.append(Shard(dim + 1))
            elif isinstance(q, Shard):
                placements.append(Shard(q.dim + 1 if q.dim > dim else q.dim))
            else:
                placements.append(q)
        whole = DTensor.from_local(part, self.device_mesh, placements, shape=torch.Size(shape),
                                   stride=_contiguous_stride(shape), run_check=False).full_tensor()
        return whole.flatten(dim, dim + 1)

    def _holder_shape(self, stage_axis: int) -> list[int]:
        """The local shape the holding stage has (this rank's part, were it the holder)."""
        shape = list(self.shape)
        for a, q in enumerate(self.placements):
            if a == stage_axis:
                continue
            if isinstance(q, _StridedShard):
                shape[q.dim] //= self.device_mesh.size(a)
            elif isinstance(q, Shard):
                shape[q.dim] //= self.device_mesh.size(a)
        return shape

    def redistribute(self, device_mesh=None, placements=None, *, async_op: bool = False, **kwargs) -> DTensor:
        if placements is None or not all(isinstance(p, Replicate) for p in placements):
            raise NotImplementedError(f"FusedShard (placements {self.placements}) redistributes only to Replicate(); "
                                      "take full_tensor() and distribute_tensor it where you need it")
        return DTensor.from_local(self.full_tensor(), self.device_mesh, [Replicate()] * self.device_mesh.ndim, run_check=False)

    # -- torch.distributed.checkpoint: k boxes per rank -----------------------------------------

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in self._boxes()]

    def __create_write_items__(self, fqn: str, object):
        props = TensorProperties.create_from_tensor(self._local_tensor)
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=o, sizes=s), properties=props,
                                                      size=self.size()))
                for o, s, _ in self._boxes()]

    def __get_tensor_shard__(self, index):
        for offsets, _, view in self._boxes():
            if offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn}: this rank holds no box at offset {list(index.offset)}")


_NORMS = {torch.linalg.vector_norm, torch._foreach_norm, torch.norm, torch.Tensor.norm, torch.linalg.norm}


def _norm_order(func, args, kwargs) -> float:
    kwargs = kwargs or {}
    order = kwargs.get("ord", kwargs.get("p", args[1] if len(args) > 1 and isinstance(args[1], (int, float)) else 2))
    return float(order)


def _allow_foreach(cls: type) -> None:
    """Let torch.optim and clip_grad_norm_ take their foreach paths with ``cls`` among the tensors,
    as torch/distributed/tensor/__init__.py does for DTensor (a type missing from these lists sends
    every optimizer of the model down the one-tensor-at-a-time loop)."""
    for types in (optim_types, util_types):
        if cls not in types:
            types.append(cls)


_allow_foreach(FusedShard)
