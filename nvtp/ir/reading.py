"""What reading a dump's Python shares: ``DumpError`` (the file, the line, what was expected),
``InputExample`` (an entry of its ``inputs`` list) and the ``ast`` helpers that name what was read."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from nvtp.ir.dtypes import DType


class DumpError(ValueError):
    """A file that is not a fusion definition nvtp can read; says where and what was expected."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None):
        self.message, self.path, self.line = message, path, line
        where = f"{path or '<dump>'}:{line}: " if line else (f"{path}: " if path else "")
        super().__init__(where + message)


@dataclass
class InputExample:
    """One entry of a dump's ``inputs`` list: a tensor's shape, dtype and strides, or a number."""

    shape: tuple[int, ...] | None
    dtype: DType | None
    strides: tuple[int, ...] | None = None
    number: Any = None


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attribute accesses on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def snippet(node: ast.AST) -> str:
    """The source of ``node`` on one line, at most 80 characters (for messages)."""
    try:
        text = ast.unparse(node)
    except Exception:  # noqa: BLE001 - only for messages
        text = type(node).__name__
    text = text.splitlines()[0] if text else ""
    return text if len(text) <= 80 else text[:77] + "..."
