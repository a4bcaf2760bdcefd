"""A candidate plan: how many devices each mesh axis spans, the axes' options, and the recompute mode.

    c = Candidate.of({"pp": 1, "dp": 2, "cp": 1, "tp": 2}, {"plan": "megatron-sp", "fsdp": True}, "none")
    c.mesh()          # the layout over every device, outer axes first (Megatron's pp, dp, cp, tp)
    c.program_mesh()  # what one program is sharded over: the mesh, or a pipeline stage's sub-mesh
    c.text()          # "dp2 tp2 megatron-sp fsdp"

The axes, their order in the layout and their options come from the axis strategies
(``nvtp.sharding.axes``): this module names none of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from nvtp.sharding import axes
from nvtp.sharding.placements import DeviceMesh


def layout() -> list[Any]:
    """Every strategy, in the order the planner lays axes out: outer (slower links) first."""
    return sorted(axes.AXES.values(), key=lambda s: s.layout)


@dataclass(frozen=True)
class Candidate:
    extents: tuple[tuple[str, int], ...]  # every axis nvtp knows, in layout order, with its extent (1: absent)
    options: tuple[tuple[str, Any], ...]  # keyword arguments of nvtp.jit: the plan, and each axis's options
    recompute: str = "none"

    @staticmethod
    def of(extents: Mapping[str, int], options: Mapping[str, Any], recompute: str = "none") -> "Candidate":
        return Candidate(tuple((s.name, int(extents.get(s.name, 1))) for s in layout()), tuple(sorted(options.items())), recompute)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.extents)

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def devices(self) -> int:
        return math.prod(n for _, n in self.extents)

    def used(self) -> list[tuple[Any, int]]:
        """(strategy, extent) of each axis spanning more than one device, in layout order."""
        return [(axes.AXES[name], n) for name, n in self.extents if n > 1]

    @property
    def stages(self) -> int:
        return math.prod(n for s, n in self.used() if s.cuts_stages)

    @property
    def pipelined(self) -> bool:
        return self.stages > 1

    @property
    def microbatches(self) -> int:
        return int(self.opts.get("microbatches", 1))

    def mesh(self) -> DeviceMesh:
        """The layout over every device: the axes spanning more than one, outer first."""
        used = self.used()
        if not used:
            return DeviceMesh.of_size(1)
        if len(used) == 1 and used[0][0].runs_plan:
            return DeviceMesh.of_size(used[0][1])
        return DeviceMesh.of_shape(tuple(n for _, n in used), tuple(s.name for s, _ in used))

    def program_mesh(self) -> DeviceMesh:
        """What one program is sharded over: the mesh, or (a pipeline) a stage's: the other axes."""
        used = [(s, n) for s, n in self.used() if not s.cuts_stages]
        if not used:
            return DeviceMesh.of_size(1)
        if len(used) == 1 and used[0][0].runs_plan:
            return DeviceMesh.of_size(used[0][1])
        return DeviceMesh.of_shape(tuple(n for _, n in used), tuple(s.name for s, _ in used))

    def shard_options(self) -> dict[str, Any]:
        """The options one program is sharded with (the stage axis's own options left out)."""
        staged = set().union(*(s.options for s in axes.AXES.values() if s.cuts_stages))
        return {k: v for k, v in self.options if k not in staged}

    def stage_options(self) -> dict[str, Any]:
        staged = set().union(*(s.options for s in axes.AXES.values() if s.cuts_stages))
        return {k: v for k, v in self.options if k in staged}

    def text(self) -> str:
        """``pp2 dp2 tp2 megatron-sp ring M=8 1f1b recompute=block``: the axes spanning more than one
        device, then the options that differ from the defaults."""
        parts = [f"{name}{n}" for name, n in self.extents if n > 1] or ["1 device"]
        o = self.opts
        if any(s.runs_plan and n > 1 for s, n in self.used()):
            parts.append(str(o.get("plan")))
        for k, v in sorted(o.items()):
            if k == "plan" or v is False or v is None:
                continue
            parts.append(_option_text(k, v))
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        return " ".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {"mesh": {name: n for name, n in self.extents}, "options": self.opts, "recompute": self.recompute, "text": self.text()}


def _option_text(key: str, value: Any) -> str:
    if value is True:
        return key.replace("_", " ")
    return f"{key}={value}"


__all__ = ["Candidate", "layout"]
