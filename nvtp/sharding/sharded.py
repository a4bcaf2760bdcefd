"""``ShardedFusion``: what the sharding pipeline (nvtp.sharding.passes.shard) hands to every
consumer (the printer, the executors, ``nvtp explain``, ``nvtp.jit``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from nvtp.ir.graph import Fusion
from nvtp.sharding.placements import DeviceMesh, Placement
from nvtp.sharding.plans import Annotations
from nvtp.sharding.propagate import Propagation
from nvtp.sharding.reshard import ReshardStep


@dataclass
class ShardedFusion:
    """A fusion with its reshard ``set`` ops inserted and a placement for every tensor.

    ``source`` is the fusion before sharding; ``set_steps`` maps each inserted ``set``'s result
    to its reshard; ``seconds`` holds each pass's wall time."""

    fusion: Fusion
    source: Fusion
    mesh: DeviceMesh
    shardings: dict[str, tuple[Placement, ...]]
    set_steps: dict[str, ReshardStep]
    annotations: Annotations
    plan: str
    propagation: Propagation
    seconds: dict[str, float] = field(default_factory=dict)
    axes: tuple["ShardedFusion", ...] = ()  # on a mesh of several axes: each axis's own pass (nvtp.sharding.compose)
    options: dict[str, Any] = field(default_factory=dict)  # axis options the passes planned with (ep's capacity_factor), as run

    @property
    def communications(self) -> list[ReshardStep]:
        """Collectives in the order the sharded fusion runs them."""
        order = {op.outputs[0].name: i for i, op in enumerate(self.fusion.ops) if op.outputs}
        by_result = sorted(self.set_steps.items(), key=lambda kv: order.get(kv[0], 0))
        return [s for _, s in by_result if s.is_communication]

    def placement(self, name: str) -> Placement:
        """The placement of ``name`` on a 1-D mesh (``sharding`` gives one per axis on any mesh)."""
        if self.mesh.ndim != 1:
            raise ValueError(f"placement() is for 1-D meshes; this one is {self.mesh}: use sharding({name!r}) or view(axis)")
        return self.shardings[name][0]

    def sharding(self, name: str) -> tuple[Placement, ...]:
        return self.shardings[name]

    def view(self, axis: int) -> "ShardedFusion":
        """This fusion's placements on mesh axis ``axis`` alone, as a 1-D sharded fusion over that axis."""
        if self.mesh.ndim == 1:
            return self
        return replace(self, mesh=self.mesh.sub(axis), shardings={k: (s[axis],) for k, s in self.shardings.items()}, axes=())

    def output_placements(self) -> dict[str, Placement]:
        """Placement of each output, keyed by the *source* fusion's output names."""
        return {src.name: self.placement(out.name) for src, out in zip(self.source.outputs, self.fusion.outputs)}
