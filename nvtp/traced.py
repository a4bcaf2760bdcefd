"""``Traced``: what tracing a module gave (``nvtp.driver.trace``), the forward and backward fusions
and how the module's boundary maps onto them. Its own module, below the driver, so that what builds
one (the driver, a pipeline's stages: ``nvtp.pipeline.stages``) imports it without importing the
driver."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nvtp.frontend.parts import parts_of
from nvtp.ir.graph import Fusion
from nvtp.program import Source


@dataclass
class Traced:
    """What tracing gave: the fusions, and how the module's boundary maps onto them."""

    forward: Fusion
    backward: Fusion | None
    route: str  # "thunder", "fx" or "dump"
    how: str = ""  # how the fusions were made (regional's or fx_regional's "spliced: ..." / "whole trace: <why>"), or the file
    captured: Any = None  # nvtp.frontend.capture.Captured (None for a dump)
    call: Any = None  # the FX route's nvtp.frontend.fx.Program: binds a call's arguments, rebuilds the outputs
    arguments: list[str] = field(default_factory=list)  # labels of the inputs that are the caller's arguments
    weights: frozenset[str] | None = None  # labels of the module's parameters (FSDP may split them); None: every parameter input
    boundary: bool = True  # a module: outputs and argument gradients whole on the model-parallel axis
    # A tied parameter's other names -> its first name (nvtp.frontend.tied.aliases); the fusions
    # hold it as one input under the first name, its gradient the sum of its uses (merge_tied).
    tied: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    split_parts: bool = False  # fused projections of unequal parts were split into their parts
    declined: list[str] = field(default_factory=list)  # traced for a cp axis (ring=True): attentions not claimed whole, and why

    def record(self) -> Source:
        """This trace as plain data, for the Program (``nvtp.program.Source``): no tracer object."""
        captured = self.captured
        return Source(self.forward, self.backward, self.route, self.how, tuple(self.arguments), self.weights, dict(self.tied),
                      dict(self.parts), self.boundary, tuple(self.declined), self.seconds,
                      dict(getattr(captured, "layers", None) or {}), getattr(captured, "output_tree", None),
                      self.call.binding() if self.call is not None else None)

    @property
    def parts(self) -> dict[str, Any]:
        """Inputs that are rows of a parameter (label -> ``nvtp.frontend.fused.Part``)."""
        if self.call is not None:
            return self.call.parts
        if not self.split_parts:
            return {}

        return parts_of(self.forward)
