"""Per-op tables: the reference backend's implementations, the nvFuser emitters, the sharding
rules and the Thunder translators are each a dict from op kind to function, filled by a
decorator made here, so that every table refuses a kind registered twice in the same words."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def registrar(table: dict[Any, Any], what: str) -> Callable[..., Callable[[F], F]]:
    """``register = registrar(TABLE, "sharding rule")``; then ``@register("add", "sub")`` files
    the function under each kind and raises if a kind already has one."""

    def register(*keys: Any) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            for k in keys:
                if k in table:
                    raise ValueError(f"{what} for {k} registered twice")
                table[k] = fn
            return fn

        return deco

    return register
