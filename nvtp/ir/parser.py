"""Read fusion definitions written in nvFuser's Python format, with ``ast`` and never ``exec``.

A dump may contain only what nvFuser's repro scripts and nvtp's dumps contain: imports of torch
and nvfuser_direct, an ``nvtp_info`` dict literal, the definition function (``fd.define_tensor``,
``fd.define_scalar``, ``fd.ops.*``, ``fd.add_output`` and device-schedule calls on its tensors),
``with FusionDefinition() as fd: <function>(fd)``, an ``inputs = [...]`` list of example tensors
and ``fd.execute(inputs)``. Anything else is refused with the file, the line and what was expected.

The module level is read here; the definition's body by ``nvtp/ir/definition.py`` and its device
schedule by ``nvtp/ir/schedule_calls.py`` (each call checked where it stands); ``DumpError``
(``nvtp/ir/reading.py``) names the file and line of anything refused.

``parse_function`` reads one definition function out of any Python source (e.g. NVIDIA/Fuser's
``tests/python/multidevice/test_transformer.py``), binding its extra integer parameters.
"""

from __future__ import annotations

import ast
import io
import os
import tokenize
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from nvtp.gcpause import paused
from nvtp.ir.definition import DefinitionReader
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Fusion, ScheduleStep, ValueInfo
from nvtp.ir.reading import DumpError, InputExample, dotted, snippet

__all__ = ["Dump", "DumpError", "InputExample", "leading_comments", "load", "parse", "parse_function"]

ALLOWED_MODULES = ("torch", "nvfuser_direct", "nvfuser")
# The only other statements a dump may hold: how a sharded dump picks its rank's GPU.
PREAMBLE = (
    "rank = nvfuser_direct.multidevice.Communicator.instance().rank()",
    "torch.cuda.set_device(rank)",
)
_TORCH_DTYPES = {
    "float64": DType.Double, "double": DType.Double, "float32": DType.Float, "float": DType.Float,
    "float16": DType.Half, "half": DType.Half, "bfloat16": DType.BFloat16, "int64": DType.Int,
    "long": DType.Int, "int32": DType.Int32, "int": DType.Int32, "bool": DType.Bool, "uint64": DType.UInt64,
    "complex64": DType.ComplexFloat, "complex128": DType.ComplexDouble,
}


@dataclass
class Dump:
    """A parsed dump: the fusion, its device schedule (if any) and the example inputs (if any)."""

    fusion: Fusion
    schedule: list[ScheduleStep] = field(default_factory=list)
    inputs: list[InputExample] | None = None
    path: str | None = None
    header: list[str] = field(default_factory=list)


def parse(text: str, path: str | None = None) -> Dump:
    """Parse a whole dump file (nvtp's, or an nvFuser repro script)."""
    with paused():  # nvtp/gcpause.py: a 10^5-op file makes ~10^6 objects that all live on
        streamed = _streamed(text, path) if len(text) > STREAMED_ABOVE else None
        tree, bodies = streamed if streamed is not None else (_parse_module(text, path), {})
        dump = _ModuleReader(path, bodies).read(tree)
    dump.header = leading_comments(text)
    return dump


def leading_comments(text: str) -> list[str]:
    """The comment lines at the top of a file, without their ``# `` (a dump's header)."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[2:] if line.startswith("# ") else line[1:])
    return lines


def parse_function(text: str, name: str, bindings: Mapping[str, int] | None = None, path: str | None = None, inputs: list[InputExample] | None = None) -> Dump:
    """Parse the definition function ``name`` out of any Python source; other code is ignored,
    never run. ``bindings`` gives values to the function's parameters after ``fd``."""
    tree = _parse_module(text, path)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            fusion, schedule = DefinitionReader(path, inputs).read(node, dict(bindings or {}))
            return Dump(fusion, schedule, inputs, path)
    raise DumpError(f"no function named {name!r} at the top level", path)


def _parse_module(text: str, path: str | None) -> ast.Module:
    try:
        return ast.parse(text, filename=path or "<dump>")
    except SyntaxError as e:
        raise DumpError(f"not valid Python: {e.msg}", path, e.lineno) from None
    except ValueError as e:  # e.g. null bytes
        raise DumpError(f"not valid Python: {e}", path) from None
    except (RecursionError, MemoryError):
        raise DumpError("not a fusion definition: nested too deeply to read", path) from None


# Above this many characters a file is read statement by statement (``_streamed``): the ast of a
# whole 10^5-op file took 15 KiB per op (1.7 GB for a 12 MB file), the fusion it describes 1 KiB.
STREAMED_ABOVE = 1 << 20
_CONTINUES = ("else", "elif", "except", "finally")  # lines that continue a compound statement


def _statements(logical: list[tuple[int, int, int, str]], depth: int) -> list[tuple[int, int, int]]:
    """Group logical lines (first line, last line, depth, first token) into the statements at
    ``depth``: (first line, last line, index of its first logical line). Deeper lines, ``else:``
    and the like belong to the statement before; a decorator to the one after."""
    out: list[list[int]] = []
    glued = False
    for k, (first, last, d, token) in enumerate(logical):
        if d == depth and not glued and not (out and token in _CONTINUES):
            out.append([first, last, k])
        elif out:
            out[-1][1] = last
        glued = d == depth and token == "@"
    return [tuple(x) for x in out]  # type: ignore[misc]


def _logical_lines(text: str) -> list[tuple[int, int, int, str]]:
    """(first line, last line, indentation depth, first token) of each logical line, by Python's tokenizer."""
    out, depth, start = [], 0, None
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        kind = tok.type
        if kind == tokenize.INDENT:
            depth += 1
        elif kind == tokenize.DEDENT:
            depth -= 1
        elif kind == tokenize.NEWLINE:
            if start is not None:
                out.append((start[0], tok.start[0], start[1], start[2]))
            start = None
        elif kind not in (tokenize.NL, tokenize.COMMENT, tokenize.ENCODING, tokenize.ENDMARKER) and start is None:
            start = (tok.start[0], depth, tok.string)
    return out


def _streamed(text: str, path: str | None) -> tuple[ast.Module, dict[str, Callable[[], Iterator[tuple[ast.stmt, int]]]]] | None:
    """The module with each large function's body left out, and for those functions their body
    statements parsed one at a time, each with what to add to its nodes' line numbers; None if the
    tokenizer refuses the text (the whole-file parse then says where)."""
    try:
        logical = _logical_lines(text)
    except (tokenize.TokenError, SyntaxError):
        return None
    lines = text.splitlines(keepends=True)

    def parsed(first: int, last: int, nested: bool) -> list[ast.stmt]:
        chunk = "".join(lines[first - 1:last])
        source, shift = ("if 1:\n" + chunk, first - 2) if nested else (chunk, first - 1)
        try:
            tree = ast.parse(source, filename=path or "<dump>")
        except SyntaxError as e:
            raise DumpError(f"not valid Python: {e.msg}", path, (e.lineno or 1) + shift) from None
        except ValueError as e:
            raise DumpError(f"not valid Python: {e}", path) from None
        except (RecursionError, MemoryError):
            raise DumpError("not a fusion definition: nested too deeply to read", path) from None
        if nested:  # the definition reader adds the shift to the lines it names (a walk over every node costs)
            return [(node, shift) for node in tree.body[0].body]
        for node in tree.body:
            ast.increment_lineno(node, shift)
        return tree.body

    module: list[ast.stmt] = []
    bodies: dict[str, Callable[[], Iterator[tuple[ast.stmt, int]]]] = {}
    for first, last, k in _statements(logical, 0):
        header_first, header_last, _, token = logical[k]
        if token != "def" or last - header_last < 1000:
            module.extend(parsed(first, last, False))
            continue
        header = "".join(lines[first - 1:header_last]) + "\n    pass\n"
        try:
            fn = ast.parse(header, filename=path or "<dump>").body[0]
        except SyntaxError as e:
            raise DumpError(f"not valid Python: {e.msg}", path, (e.lineno or 1) + first - 1) from None
        ast.increment_lineno(fn, first - 1)
        inner = [x for x in logical if header_last < x[0] <= last]
        spans = _statements(inner, 1)
        bodies[fn.name] = lambda spans=spans: (item for a, b, _ in spans for item in parsed(a, b, True))
        module.append(fn)
    return ast.Module(body=module, type_ignores=[]), bodies


class _ModuleReader:
    def __init__(self, path: str | None, bodies: Mapping[str, Callable[[], Iterator[tuple[ast.stmt, int]]]] | None = None):
        self.path = path
        self.bodies = bodies or {}  # a large function's body, statement by statement (``_streamed``)

    def fail(self, node: ast.AST | None, message: str) -> DumpError:
        return DumpError(message, self.path, getattr(node, "lineno", None))

    def read(self, tree: ast.Module) -> Dump:
        functions: dict[str, ast.FunctionDef] = {}
        called: list[tuple[str, ast.AST]] = []
        info: dict | None = None
        inputs: list[InputExample] | None = None
        for i, node in enumerate(tree.body):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str) and i == 0:
                continue  # module docstring
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self._check_import(node)
            elif isinstance(node, ast.FunctionDef):
                if node.name in functions:
                    raise self.fail(node, f"function {node.name} is defined twice")
                functions[node.name] = node
            elif isinstance(node, ast.Assign) and _target_name(node) == "nvtp_info":
                info = self._literal(node.value, "nvtp_info must be a dict literal")
                if not isinstance(info, dict):
                    raise self.fail(node, "nvtp_info must be a dict literal")
            elif isinstance(node, ast.Assign) and _target_name(node) == "inputs":
                inputs = self._inputs(node.value)
            elif isinstance(node, ast.With):
                called.extend(self._with_block(node))
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and dotted(node.value.func) == "fd.execute":
                continue
            elif isinstance(node, (ast.Assign, ast.Expr)) and ast.unparse(node) in PREAMBLE:
                continue
            else:
                raise self.fail(node, f"unexpected statement `{snippet(node)}`; a fusion dump holds only imports, the definition function, "
                                "`with FusionDefinition() as fd:`, `inputs = [...]` and `fd.execute(inputs)`")
        if not called:
            if info is not None:  # nvtp writes the `with` block last in every dump it makes
                last = tree.body[-1].end_lineno if tree.body else 1
                raise DumpError("the file ends here, without the `with FusionDefinition() as fd:` block that ends every nvtp "
                                "dump; it looks truncated: dump or copy it again", self.path, last)
            if len(functions) != 1:
                raise DumpError("no `with FusionDefinition() as fd: <function>(fd)` block says which function is the fusion", self.path)
            called = [(next(iter(functions)), tree)]
        if len(called) != 1:
            raise DumpError(f"the `with FusionDefinition()` block calls {len(called)} functions; nvtp reads one definition per file", self.path)
        name, where = called[0]
        if name not in functions:
            raise self.fail(where, f"the `with` block calls {name}(fd), which the file does not define")
        for other, node in functions.items():
            if other != name:
                raise self.fail(node, f"function {other} is not the fusion definition ({name}); a dump holds only that one")
        fn = functions[name]
        per_rank = isinstance(info, dict) and isinstance(info.get("fusion"), dict) and info["fusion"].get("inputs") == "per rank"
        body = self.bodies[name]() if name in self.bodies else None
        fusion, schedule = DefinitionReader(self.path, inputs, per_rank).read(fn, {}, body)
        if info:
            fusion = _apply_info(fusion, info, self.path)
        return Dump(fusion, schedule, inputs, self.path)

    def _check_import(self, node: ast.Import | ast.ImportFrom) -> None:
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        for m in modules:
            if m.split(".")[0] not in ALLOWED_MODULES:
                raise self.fail(node, f"import of {m!r} is not allowed in a fusion dump; a dump may import only torch and nvfuser_direct")

    def _literal(self, node: ast.AST, message: str) -> Any:
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise self.fail(node, message) from None

    def _with_block(self, node: ast.With) -> list[tuple[str, ast.AST]]:
        if len(node.items) != 1:
            raise self.fail(node, "expected `with FusionDefinition() as fd:`")
        item = node.items[0]
        ctx = item.context_expr
        if not (isinstance(ctx, ast.Call) and dotted(ctx.func) in ("FusionDefinition", "nvfuser_direct.FusionDefinition", "nvfuser.FusionDefinition")
                and not ctx.args and not ctx.keywords and isinstance(item.optional_vars, ast.Name) and item.optional_vars.id == "fd"):
            raise self.fail(node, "expected `with FusionDefinition() as fd:`")
        calls = []
        for stmt in node.body:
            if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
                    and len(stmt.value.args) == 1 and isinstance(stmt.value.args[0], ast.Name) and stmt.value.args[0].id == "fd"
                    and not stmt.value.keywords):
                calls.append((stmt.value.func.id, stmt))
            else:
                raise self.fail(stmt, f"unexpected `{snippet(stmt)}` in the `with FusionDefinition()` block; expected `<function>(fd)`")
        return calls

    def _inputs(self, node: ast.AST) -> list[InputExample]:
        if not isinstance(node, (ast.List, ast.Tuple)):
            raise self.fail(node, "`inputs` must be a list of example tensors")
        return [self._input(e) for e in node.elts]

    def _input(self, node: ast.AST) -> InputExample:
        if isinstance(node, ast.Constant) and isinstance(node.value, (bool, int, float)):
            return InputExample(None, None, number=node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            return InputExample(None, None, number=-node.operand.value)
        if not isinstance(node, ast.Call):
            raise self.fail(node, f"unexpected input `{snippet(node)}`; expected torch.testing.make_tensor(...) or a number")
        func = dotted(node.func)
        if func == "torch.testing.make_tensor":
            shape = self._literal(node.args[0], "make_tensor's shape must be a literal tuple") if node.args else None
            return InputExample(tuple(shape), self._dtype_kw(node), None)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "as_strided" and isinstance(node.func.value, ast.Call):
            inner = dotted(node.func.value.func)
            if inner not in ("torch.randn", "torch.randint", "torch.empty", "torch.zeros", "torch.ones"):
                raise self.fail(node, f"unexpected input `{snippet(node)}`")
            if len(node.args) != 2:
                raise self.fail(node, "as_strided needs (size, stride)")
            shape = self._literal(node.args[0], "as_strided's size must be a literal tuple")
            strides = self._literal(node.args[1], "as_strided's stride must be a literal tuple")
            return InputExample(tuple(shape), self._dtype_kw(node.func.value), tuple(strides))
        raise self.fail(node, f"unexpected input `{snippet(node)}`; expected torch.testing.make_tensor(...) or a number")

    def _dtype_kw(self, call: ast.Call) -> DType | None:
        for kw in call.keywords:
            if kw.arg == "dtype":
                name = dotted(kw.value)
                if not name or not name.startswith("torch.") or name[6:] not in _TORCH_DTYPES:
                    raise self.fail(kw.value, f"unknown dtype `{snippet(kw.value)}`")
                return _TORCH_DTYPES[name[6:]]
        return DType.Float


def _target_name(node: ast.Assign) -> str | None:
    if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def _apply_info(fusion: Fusion, info: dict, path: str | None) -> Fusion:
    attrs = info.get("fusion", {})
    values = info.get("values", {})
    if not isinstance(attrs, dict) or not isinstance(values, dict):
        raise DumpError("nvtp_info must hold dicts under 'fusion' and 'values'", path)
    known = fusion.values
    parsed: dict[str, ValueInfo] = {}
    for name, fields in values.items():
        if name not in known:
            raise DumpError(f"nvtp_info describes {name!r}, which the definition does not define", path)
        if not isinstance(fields, dict) or not isinstance(fields.get("role"), str):
            raise DumpError(f"nvtp_info entry for {name!r} needs a 'role'", path)
        extra = set(fields) - {"role", "label", "source"}
        if extra:
            raise DumpError(f"nvtp_info entry for {name!r} has unknown keys {sorted(extra)}", path)
        parsed[name] = ValueInfo(fields["role"], str(fields.get("label", "")), str(fields.get("source", "")))
    return replace(fusion, info=parsed, attrs={str(k): str(v) for k, v in attrs.items()})


def load(path: str | os.PathLike) -> Dump:
    """Parse a dump file; ``DumpError`` names the file and line of anything wrong."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise DumpError("no such file", str(p)) from None
    except (UnicodeDecodeError, IsADirectoryError, PermissionError) as e:
        raise DumpError(f"cannot read: {e}", str(p)) from None
    return parse(text, str(p))
