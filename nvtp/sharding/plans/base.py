"""What the plans read off the graph, and what a plan gives: ``Projection`` (a ``linear``, an
``x @ W`` or an experts' ``gather_mm`` whose weight is a fusion input, with its bias and fused
parts: ``nvtp.sharding.projections``) and ``Annotations`` (input value -> placement, with the
plan's notes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from nvtp.sharding.placements import Placement
from nvtp.sharding.projections import Projection, fused_parts, projections  # noqa: F401 - the plans' view of the graph


@dataclass
class Annotations:
    """A plan applied to one fusion: input value -> placement, and what it decided and why."""

    placements: dict[str, Placement]
    notes: list[str] = field(default_factory=list)
    column: list[str] = field(default_factory=list)
    row: list[str] = field(default_factory=list)
    hints: dict[str, Placement] = field(default_factory=dict)  # soft wishes for values inside the fusion


def reshape_group(src: tuple[int, ...], dst: tuple[int, ...], axis: int) -> list[int] | None:
    """The output sizes axis ``axis`` of ``src`` becomes under a reshape to ``dst`` (None if it merges)."""
    i = j = 0
    while i < len(src) and j < len(dst):
        a, group, b = src[i], [dst[j]], dst[j]
        j += 1
        while b < a and j < len(dst):
            group.append(dst[j])
            b *= dst[j]
            j += 1
        if b != a:
            return None
        if i == axis:
            return group
        i += 1
    return None
