"""The package's structure, read from its source: what a mesh axis means lives in its strategy
module (``nvtp/sharding/axes/``), and nothing else compares or indexes by an axis's name.

A module outside the axes package that writes ``"cp" in mesh.names``, ``if axis == "dp"`` or
``mesh.names.index("tp")`` branches on an axis name: it must ask the mesh's strategies instead
(``axes.batch_axis(mesh)``, ``axes.find(mesh, "runs_plan")``, a strategy's own method). The test
reads every module's syntax tree, so an alias or a new file cannot slip past it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from nvtp.sharding import axes

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nvtp"
AXES_PACKAGE = PACKAGE / "sharding" / "axes"
NAMES = set(axes.AXES) | {"fsdp", "ep"}
# The one default a lower layer must name: a 1-D mesh without names is tensor parallel (placements.DeviceMesh).
ALLOWED = {("nvtp/sharding/placements.py", "tp")}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body:
            b = n.body[0]
            if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                out.add(id(b.value))
    return out


def axis_name_uses(path: Path) -> list[str]:
    """Each place ``path`` writes an axis name as a string (outside docstrings): ``file:line: code``."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in NAMES and id(n) not in docs:
            if (rel, n.value) not in ALLOWED:
                out.append(f"{rel}:{n.lineno}: {lines[n.lineno - 1].strip()}")
    return out


def test_no_module_outside_the_axes_package_names_an_axis():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if AXES_PACKAGE in path.parents:
            continue
        found += axis_name_uses(path)
    assert not found, "ask the mesh's strategies (nvtp.sharding.axes) instead of naming an axis:\n" + "\n".join(found)


def test_the_check_sees_a_comparison_by_name(tmp_path):
    """The check above fails on a module that branches on an axis name, in any spelling."""
    for code in ('ring = "cp" in mesh.names\n', 'if axis == "dp":\n    pass\n', 'i = mesh.names.index("tp")\n',
                 'kind = {"pp": 1}\n'):
        bad = ROOT / "nvtp" / "_probe_structure.py"
        try:
            bad.write_text(code)
            assert axis_name_uses(bad), code
        finally:
            bad.unlink()


def test_every_registered_strategy_is_one_module_of_the_axes_package():
    """Each axis name selects one strategy, defined in its own module of the package, registered once."""
    modules = {type(s).__module__ for s in axes.AXES.values()}
    assert len(modules) == len(axes.AXES)
    assert all(m.startswith("nvtp.sharding.axes.") for m in modules), modules
    assert all(axes.AXES[name].name == name for name in axes.AXES)
