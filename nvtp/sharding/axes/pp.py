"""The "pp" axis: pipeline parallelism. The model is cut into stages of blocks along it
(``nvtp.pipeline``), before any sharding pass; each stage is sharded over the rest of the mesh
(its (dp, tp) sub-mesh) by the other axes' strategies. Here: the strategy, and the ranks of a
(pp, dp, tp) mesh laid out as Megatron-LM lays them out.

    lay = Layout(pp=4, dp=2, tp=2)     # 16 ranks: rank = (pp_i * dp + dp_i) * tp + tp_i
    lay.groups("tp")   # [[0, 1], [2, 3], ...]            Megatron's tensor groups
    lay.groups("dp")   # [[0, 2], [1, 3], [4, 6], ...]    data groups
    lay.groups("pp")   # [[0, 4, 8, 12], [1, 5, 9, 13], ...] pipeline groups
    lay.submesh(1)     # stage 1's (dp, tp) mesh: ranks 4..7
    lay.embedding_groups()  # first and last stage of each pipeline group (Megatron's embedding group)

Megatron's ``initialize_model_parallel`` puts tp fastest, then dp, then pp (its default order
"tp-dp-pp" read from the fastest): so a row-major mesh of shape (pp, dp, tp) is exactly its
layout, and ``init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))`` gives
the same groups. Any axis may be absent (size 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchMesh

from nvtp.sharding.axes.strategy import AXES, MeshError, Strategy, register
from nvtp.sharding.placements import DeviceMesh

ORDER = ("pp", "dp", "tp")
NAME = ORDER[0]


SCHEDULES = ("1f1b", "gpipe")  # nvtp.pipeline.schedule's, the planner's order (1F1B holds fewer microbatches)
STAGE_AXES = ORDER[1:]  # the axes a stage's sub-mesh has


@register
class PipelineParallel(Strategy):
    name = NAME
    summary = "pipeline parallel: stages of blocks, cut by nvtp.pipeline; each stage sharded over its (dp, tp) sub-mesh"
    order = 0
    options = frozenset({"microbatches", "schedule", "cut"})
    refuses = {
        "fsdp": "a pipeline's dp axis is DDP-style (each stage's weights whole over dp); shard without a 'pp' axis for FSDP",
        "comm": "a pipeline runs on torch.distributed's processes, not a simulated mesh; call it in processes after "
                "torch.distributed.init_process_group",
        "dynamic": "a pipeline is compiled for one batch shape, cut into microbatches; pass the same shapes every step, or shard "
                   "without a 'pp' axis to compile each new shape",
        "check_replicas": "a pipeline does not compare replicated inputs across ranks; leave it out, or check without a 'pp' axis",
        "regional": "a pipeline traces a chain of repeated blocks once and splices it, as its stages are cut at block boundaries; "
                    "leave regional at its default",
        "overlap": "a pipeline's stages start each collective as soon as its input exists (the default schedule); leave overlap "
                   "at its default, or shard without a 'pp' axis to run each collective where it stands",
        "collective_matmul": "a pipeline's stages plan collective matmuls where the cost model says they pay (the default, "
                             "'auto'); leave it at its default, or shard without a 'pp' axis to force it on or off",
        "machine": "a pipeline's report does not estimate overlap on a machine model; leave machine out",
    }
    cuts_stages = True
    crosses_nodes = True
    layout = 0  # outermost

    def refuse(self, extent: int, facts: Any) -> str | None:
        if extent > facts.blocks:
            return f"pp={extent} stages, but the model has {facts.blocks} block(s): each stage holds one or more"
        if not facts.loss_only:
            return "a pipeline trains a forward that returns its loss alone (one scalar); this model returns more"
        return super().refuse(extent, facts)

    def conflicts(self, extents: Mapping[str, int], options: Mapping[str, Any], facts: Any) -> str | None:
        if extents[self.name] == 1:
            return None
        others = [a for a, n in extents.items() if n > 1 and a != self.name and a not in STAGE_AXES]
        if others:
            return f"a pipeline shards each stage over ({', '.join(STAGE_AXES)}); it does not take {', '.join(others)}"
        if options.get("fsdp"):
            return "a pipeline's stages keep their weights whole over dp (DDP): no FSDP"
        return None

    def choices(self, extent: int, extents: Mapping[str, int], facts: Any) -> list[dict[str, Any]]:
        """Microbatches that divide each data-parallel rank's batch: from pp (a bubble of about half)
        by doubling to the whole batch (a row each), and both schedules."""
        if extent == 1:
            return [{}]
        rows = facts.batch // math.prod(n for a, n in extents.items() if AXES[a].splits_batch)
        counts = sorted({m for m in [rows] + [extent * 2 ** i for i in range(12)] if m <= rows and rows % m == 0})
        return [{"microbatches": m, "schedule": s} for m in counts for s in SCHEDULES]

    def in_flight(self, stage: int, stages: int, microbatches: int, schedule: str) -> int:
        """Microbatches whose activations ``stage`` holds at once: 1F1B at most stages - stage, GPipe all of them."""
        return min(stages - stage, microbatches) if schedule == SCHEDULES[0] else microbatches

    def cost_terms(self, costed: Any) -> dict[str, float]:
        """The pipeline's own time: per microbatch each stage's forward and backward (``costed.stage_seconds``)
        and its point-to-point transfers; a step of m microbatches on p stages takes
        (m - 1) t_max + sum_s t_s (the fill and drain: the bubble, (p - 1) t_max for equal stages).
        The terms are what the step adds to m t_max of the slowest stage (counted by the other terms)."""
        m = costed.microbatches
        base = costed.stage_seconds
        sends = [costed.transfer_seconds(s) for s in range(len(base))]
        t = [b + x for b, x in zip(base, sends)]
        slowest = max(range(len(t)), key=lambda s: t[s])
        step = (m - 1) * t[slowest] + sum(t)
        return {f"{self.name} transfers": m * sends[slowest], f"{self.name} bubble": step - m * t[slowest]}

    def memory_terms(self, costed: Any) -> dict[str, float]:
        return {f"{self.name}: activations of in-flight microbatches": costed.in_flight_bytes, **super().memory_terms(costed)}


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int = 1
    tp: int = 1

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def groups(self, axis: str) -> list[list[int]]:
        """Every process group along ``axis`` ("pp", "dp" or "tp"), in Megatron's order."""
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        others = [a for a in ORDER if a != axis]
        out = []
        for i in range(sizes[others[0]]):
            for j in range(sizes[others[1]]):
                ranks = []
                for k in range(sizes[axis]):
                    c = {axis: k, others[0]: i, others[1]: j}
                    ranks.append(self.rank(c["pp"], c["dp"], c["tp"]))
                out.append(ranks)
        if axis == "dp":  # Megatron lists data groups by pipeline stage, then tensor rank
            out.sort(key=lambda g: (self.coords(g[0])[0], self.coords(g[0])[2]))
        return out

    def pipeline_groups(self) -> list[list[int]]:
        return self.groups("pp")

    def data_groups(self) -> list[list[int]]:
        return self.groups("dp")

    def tensor_groups(self) -> list[list[int]]:
        return self.groups("tp")

    def torch_mesh(self, device: str = "cpu"):
        """torch's DeviceMesh of the whole (pp, dp, tp) layout, over every rank in order."""
        return TorchMesh(device, torch.arange(self.size).reshape(self.pp, self.dp, self.tp), mesh_dim_names=ORDER)

    def as_json(self) -> dict:
        return {"mesh": {"pp": self.pp, "dp": self.dp, "tp": self.tp, "world": self.size},
                "groups": {"tp": self.groups("tp"), "dp": self.groups("dp"), "pp": self.groups("pp"),
                           "embedding": self.embedding_groups()}}

    def group_lines(self) -> list[tuple[str, str, list[list[int]]]]:
        """(axis, what it holds, its groups) of each axis, for the plan's text."""
        return [(axis, what, self.groups(axis)) for axis, what in (("tp", "tensor"), ("dp", "data"), ("pp", "pipeline"))]

    def group_of(self, axis: str, rank: int) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)

    def embedding_groups(self) -> list[list[int]]:
        """The first and last stage of each pipeline group: where a weight tied across the first
        and last stage (embedding and head) has its gradients summed, as in Megatron."""
        return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self.groups("pp")]

    def stage_names(self) -> tuple[str, ...]:
        """The axes of a stage's sub-mesh: ("tp",) without dp, else ("dp", "tp")."""
        return ("dp", "tp") if self.dp > 1 else ("tp",)

    def submesh(self, stage: int) -> DeviceMesh:
        """Stage ``stage``'s mesh for the sharding passes: its ranks (global ids), 1-D tp, or (dp, tp)."""
        ranks = tuple(self.rank(stage, d, t) for d in range(self.dp) for t in range(self.tp))
        if self.dp > 1:
            return DeviceMesh(ranks, (self.dp, self.tp), ("dp", "tp"))
        return DeviceMesh(ranks, (self.tp,), ("tp",))

    def position(self, rank: int) -> int:
        """``rank``'s position in its stage's sub-mesh (row-major)."""
        _, d, t = self.coords(rank)
        return d * self.tp + t

    def text(self) -> str:
        return f"{self.pp}x{self.dp}x{self.tp}"


def parse(text: str) -> Layout:
    """``--mesh PPxDPxTP`` (``4x2x2``)."""
    parts = str(text).lower().split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise MeshError(f"--mesh {text!r}: a pipeline mesh is PPxDPxTP, three positive integers joined by x (e.g. --mesh 4x2x2: "
                        "pp=4 stages, dp=2, tp=2 on 16 devices)")
    return Layout(*(int(p) for p in parts))


def layout_of(mesh: Any) -> Layout:
    """The layout of a mesh with a "pp" axis: torch's ``DeviceMesh`` with ``mesh_dim_names``
    among ("pp", "dp", "tp") in that order (any but pp absent), nvtp's ``DeviceMesh``, a
    ``Layout``, a (pp, dp, tp) tuple or "PPxDPxTP". Raises ``MeshError`` naming what to pass."""
    if isinstance(mesh, Layout):
        return mesh
    if isinstance(mesh, str):
        return parse(mesh)
    if isinstance(mesh, tuple) and len(mesh) == 3 and all(isinstance(n, int) and n >= 1 for n in mesh):
        return Layout(*mesh)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or getattr(mesh, "names", ()) or ())
    shape = tuple(int(n) for n in getattr(mesh, "shape", ()))
    known = [n for n in ORDER if n in names]
    if "pp" not in names or len(known) != len(names) or list(names) != known:
        raise MeshError(f"a pipeline mesh names its axes from ('pp', 'dp', 'tp'), in that order (any but 'pp' may be absent); "
                        f"got {list(names)}: init_device_mesh('cpu', (pp, dp, tp), mesh_dim_names=('pp', 'dp', 'tp'))")
    sizes = dict(zip(names, shape))
    if hasattr(mesh, "mesh"):  # torch's: ranks in order
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        if ranks != list(range(math.prod(shape))):
            raise MeshError(f"the mesh holds ranks {ranks}; nvtp's pipeline lays out ranks 0..{math.prod(shape) - 1} in order "
                            "(Megatron's layout): pass init_device_mesh over every rank")
    return Layout(sizes.get("pp", 1), sizes.get("dp", 1), sizes.get("tp", 1))


def has_pp(mesh: Any) -> bool:
    """Whether ``mesh`` (anything ``nvtp.jit`` takes) has a "pp" axis, or is spelt PPxDPxTP."""
    if isinstance(mesh, Layout):
        return True
    if isinstance(mesh, str):
        return mesh.lower().count("x") == 2
    names = getattr(mesh, "mesh_dim_names", None) or getattr(mesh, "names", None) or ()
    return "pp" in tuple(names)


__all__ = ["Layout", "PipelineParallel", "layout_of", "parse", "has_pp"]
