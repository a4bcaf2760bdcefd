"""What the sharding passes need to know of the machine a program will run on: a ``Target``.

A backend (``nvtp.execute.backends``) owns the facts of its target and declares them here as
one ``Target``; the passes read the facts, never a backend's name. The reference backend runs
every op on torch, so a partial sum may flow through linear ops and an embedding table may be
split along the vocabulary (a lookup then gives a partial sum). nvFuser holds partial sums only
on reduction axes, so they are resolved where they are made, and embedding tables stay whole.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    partial_through_linear: bool  # a partial sum may flow through linear ops (resolved later, once)
    vocab_parallel: bool  # an embedding lookup may read a table split along the vocabulary


def as_target(target: "str | Target") -> Target:
    """``target`` itself, or the target of the backend it names (``nvtp.execute.backends``)."""
    if isinstance(target, Target):
        return target
    from nvtp.execute.backends import BACKENDS

    backend = BACKENDS.get(target)
    if backend is None:
        raise ValueError(f"unknown backend {target!r}; choose one of {', '.join(map(repr, BACKENDS))}")
    return backend.target
