"""The package's structure, read from its source: what a mesh axis means lives in its strategy
module (``nvtp/sharding/axes/``), and nothing else compares or indexes by an axis's name.

A module outside the axes package that writes ``"cp" in mesh.names``, ``if axis == "dp"`` or
``mesh.names.index("tp")`` branches on an axis name: it must ask the mesh's strategies instead
(``axes.batch_axis(mesh)``, ``axes.find(mesh, "runs_plan")``, a strategy's own method). The test
reads every module's syntax tree, so an alias or a new file cannot slip past it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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


# ---------------------------------------------------------------------------------------------
# Imports at module level. An import inside a function is allowed only for one of these reasons.

# Modules any function may import when it runs: optional dependencies, absent on some installs.
OPTIONAL = {
    "transformers": "optional extra (pip install nvtp[hf])",
    "nvfuser_direct": "only the nvFuser backend needs it; a CPU install may lack it",
    "nvtp.execute.nvfuser": "imports nvfuser_direct",
    "torch._inductor": "only compile='inductor' / 'auto' need it: 1.5 s of imports kept off every other path",
}
# Modules that load Thunder (3+ s), imported inside a function only by the files on the CLI's lazy path.
THUNDER = {"thunder", "nvtp.driver", "nvtp.auto.cli", "nvtp.auto.search", "nvtp.frontend.capture"}
# Files `nvtp --help` and the file commands (`nvtp replay/shard/explain FILE`) load: they must not load
# Thunder before a command needs it. nvtp/cli.py and nvtp/__init__.py also load each command's own module
# (``import nvtp`` loads no torch; ``nvtp --help`` none of the commands' modules, about 0.6 s).
LAZY_PATH = {
    "nvtp/__init__.py": "any", "nvtp/cli.py": "any",
    # loaded by `nvtp --help` itself: the nvtp modules their functions need (the reference backend, the
    # cost model, the pipeline's schedules, ...) load when those run, so the help loads 51 of nvtp's modules
    "nvtp/errors.py": ("nvtp",), "nvtp/execute/backends.py": ("nvtp",), "nvtp/options.py": ("nvtp",),
    "nvtp/sharding/axes/ring.py": ("nvtp",), "nvtp/sharding/reshard.py": ("nvtp",),
    "nvtp/dump/__init__.py": THUNDER, "nvtp/dump/mesh.py": THUNDER, "nvtp/execute/step.py": THUNDER,
    "nvtp/explain.py": THUNDER, "nvtp/pipeline/__init__.py": THUNDER,
    "nvtp/pipeline/demo.py": THUNDER,
}
# Import cycles still broken by an import inside a function (to be removed: move the shared piece lower).
CYCLES: set[tuple[str, str]] = set()


def imports_inside_functions(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each import inside a function of ``path`` (``from a.b import c``: ``a.b``;
    ``from nvtp import driver``: ``nvtp.driver``)."""
    out = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Import):
                out += [(n.lineno, a.name) for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                for a in n.names:  # a submodule by its own name: `from nvtp.execute import nvfuser`
                    sub = ROOT.joinpath(*f"{base}.{a.name}".split("."))
                    out.append((n.lineno, f"{base}.{a.name}" if sub.with_suffix(".py").exists() or sub.is_dir() else base))
    return sorted(set(out))


def misplaced_imports(path: Path) -> list[str]:
    """Each import inside a function of ``path`` that has none of the reasons above."""
    rel = path.relative_to(ROOT).as_posix()
    lazy = LAZY_PATH.get(rel, ())
    out = []
    for line, mod in imports_inside_functions(path):
        under = lambda names: any(mod == n or mod.startswith(n + ".") for n in names)  # noqa: E731
        if under(OPTIONAL) or lazy == "any" or under(lazy) or (rel, mod) in CYCLES:
            continue
        out.append(f"{rel}:{line}: import of {mod} inside a function")
    return out


def test_imports_are_at_module_level():
    found = [m for path in sorted(PACKAGE.rglob("*.py")) for m in misplaced_imports(path)]
    assert not found, ("import these at the top of the module (an import inside a function is for an optional dependency, "
                       "or for Thunder on the CLI's lazy path: OPTIONAL, LAZY_PATH above):\n" + "\n".join(found))


def test_the_import_check_sees_an_import_inside_a_function():
    bad = ROOT / "nvtp" / "_probe_imports.py"
    try:
        bad.write_text("def f():\n    import json\n    from nvtp import driver\n    return json, driver\n")
        assert misplaced_imports(bad) == ["nvtp/_probe_imports.py:2: import of json inside a function",
                                          "nvtp/_probe_imports.py:3: import of nvtp.driver inside a function"]
    finally:
        bad.unlink()


def test_the_cli_and_its_file_commands_load_no_thunder():
    """`nvtp --help` loads the parser and no backend; `nvtp replay/shard/explain FILE` load the modules
    below; none loads Thunder, transformers or nvfuser_direct (a command that needs them imports them
    when it runs)."""
    code = ("import sys, nvtp.cli; print('nvtp.execute.reference' in sys.modules); "
            "import nvtp.dump, nvtp.dump.mesh, nvtp.dump.sharded, nvtp.explain, nvtp.sharding.report; "
            "print(sorted(m for m in ('thunder', 'transformers', 'nvfuser_direct') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "[]"], out.stdout
