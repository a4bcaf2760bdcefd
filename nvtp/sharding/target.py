"""What the sharding passes need to know of the machine a program will run on: a ``Target``.

Each backend (``nvtp.execute.backends``) names the target it runs; the passes read the target's
facts, never a backend's name. The reference backend runs every op on torch, so a partial sum may
flow through linear ops and an embedding table may be split along the vocabulary (a lookup then
gives a partial sum). nvFuser holds partial sums only on reduction axes, so they are resolved
where they are made, and embedding tables stay whole.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    partial_through_linear: bool  # a partial sum may flow through linear ops (resolved later, once)
    vocab_parallel: bool  # an embedding lookup may read a table split along the vocabulary
    # An expert's gather_mm may contract a split axis (row-parallel experts), leaving a partial sum.
    # nvFuser's gather_mm is written as grouped_mm between row gathers (nvtp/ir/composites.py): its
    # contraction is not the result's, so nothing can hold the partial sum there; experts stay whole.
    split_experts: bool = True
    # Attention in any float dtype (float32 too) traced as sdpfa_fwd / sdpfa_bwd, saving its output and
    # logsumexp: the reference backend runs them by torch's CPU flash kernels; nvFuser's flash
    # attention takes half precision only (there Thunder's decomposition stays for float32).
    flash_attention: bool = False


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("reference", partial_through_linear=True, vocab_parallel=True, flash_attention=True),
    Target("nvfuser", partial_through_linear=False, vocab_parallel=False, split_experts=False),
)}


def as_target(target: "str | Target") -> Target:
    """``target`` itself, or the target named (the backend of that name runs it)."""
    if isinstance(target, Target):
        return target
    found = TARGETS.get(target)
    if found is None:
        raise ValueError(f"unknown backend {target!r}; choose one of {', '.join(map(repr, TARGETS))}")
    return found
