"""Read fusion definitions written in nvFuser's Python format, with ``ast`` and never ``exec``.

A dump may contain only what nvFuser's repro scripts and nvtp's dumps contain: imports of torch
and nvfuser_direct, an ``nvtp_info`` dict literal, the definition function (``fd.define_tensor``,
``fd.define_scalar``, ``fd.ops.*``, ``fd.add_output`` and device-schedule calls on its tensors),
``with FusionDefinition() as fd: <function>(fd)``, an ``inputs = [...]`` list of example tensors
and ``fd.execute(inputs)``, and, where the fusion uses nvtp's ops nvFuser lacks, the class
``nvtp_ops`` verbatim (``nvtp/ir/composites.py``; ``nvtp_ops.gather_mm(fd, ...)`` reads as the op).
Anything else is refused with the file, the line and what was expected.

``parse_function`` reads one definition function out of any Python source (e.g. NVIDIA/Fuser's
``tests/python/multidevice/test_transformer.py``), binding its extra integer parameters.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from nvtp.ir import composites, ops as opstable
from nvtp.ir.build import make_op, normalize
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Fusion, Op, ScheduleStep, TensorValue, Value, ValueInfo, is_value
from nvtp.ir.ops import IRError
from nvtp.ir.verify import verify

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
    tree = _parse_module(text, path)
    reader = _ModuleReader(path)
    dump = reader.read(tree)
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
            fusion, schedule = _FunctionReader(path, inputs).read(node, dict(bindings or {}))
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


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attribute accesses on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


class _ModuleReader:
    def __init__(self, path: str | None):
        self.path = path

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
            elif isinstance(node, ast.ClassDef) and node.name == composites.NAME:
                if not composites.is_source(node):
                    raise self.fail(node, f"class {node.name} differs from nvtp's (nvtp/ir/composites.py); a dump may hold it only verbatim")
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
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and _dotted(node.value.func) == "fd.execute":
                continue
            elif isinstance(node, (ast.Assign, ast.Expr)) and ast.unparse(node) in PREAMBLE:
                continue
            else:
                raise self.fail(node, f"unexpected statement `{_snippet(node)}`; a fusion dump holds only imports, the definition function, "
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
        fusion, schedule = _FunctionReader(self.path, inputs, per_rank).read(fn, {})
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
        if not (isinstance(ctx, ast.Call) and _dotted(ctx.func) in ("FusionDefinition", "nvfuser_direct.FusionDefinition", "nvfuser.FusionDefinition")
                and not ctx.args and not ctx.keywords and isinstance(item.optional_vars, ast.Name) and item.optional_vars.id == "fd"):
            raise self.fail(node, "expected `with FusionDefinition() as fd:`")
        calls = []
        for stmt in node.body:
            if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
                    and len(stmt.value.args) == 1 and isinstance(stmt.value.args[0], ast.Name) and stmt.value.args[0].id == "fd"
                    and not stmt.value.keywords):
                calls.append((stmt.value.func.id, stmt))
            else:
                raise self.fail(stmt, f"unexpected `{_snippet(stmt)}` in the `with FusionDefinition()` block; expected `<function>(fd)`")
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
            raise self.fail(node, f"unexpected input `{_snippet(node)}`; expected torch.testing.make_tensor(...) or a number")
        func = _dotted(node.func)
        if func == "torch.testing.make_tensor":
            shape = self._literal(node.args[0], "make_tensor's shape must be a literal tuple") if node.args else None
            return InputExample(tuple(shape), self._dtype_kw(node), None)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "as_strided" and isinstance(node.func.value, ast.Call):
            inner = _dotted(node.func.value.func)
            if inner not in ("torch.randn", "torch.randint", "torch.empty", "torch.zeros", "torch.ones"):
                raise self.fail(node, f"unexpected input `{_snippet(node)}`")
            if len(node.args) != 2:
                raise self.fail(node, "as_strided needs (size, stride)")
            shape = self._literal(node.args[0], "as_strided's size must be a literal tuple")
            strides = self._literal(node.args[1], "as_strided's stride must be a literal tuple")
            return InputExample(tuple(shape), self._dtype_kw(node.func.value), tuple(strides))
        raise self.fail(node, f"unexpected input `{_snippet(node)}`; expected torch.testing.make_tensor(...) or a number")

    def _dtype_kw(self, call: ast.Call) -> DType | None:
        for kw in call.keywords:
            if kw.arg == "dtype":
                name = _dotted(kw.value)
                if not name or not name.startswith("torch.") or name[6:] not in _TORCH_DTYPES:
                    raise self.fail(kw.value, f"unknown dtype `{_snippet(kw.value)}`")
                return _TORCH_DTYPES[name[6:]]
        return DType.Float


def _target_name(node: ast.Assign) -> str | None:
    if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def _snippet(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # noqa: BLE001 - only for messages
        text = type(node).__name__
    text = text.splitlines()[0] if text else ""
    return text if len(text) <= 80 else text[:77] + "..."


_MESH_CALLS = ("DeviceMesh", "multidevice.DeviceMesh", "nvfuser_direct.multidevice.DeviceMesh", "nvfuser.multidevice.DeviceMesh")


class _FunctionReader:
    """Reads a definition function's body statement by statement into ops and schedule steps."""

    def __init__(self, path: str | None, inputs: list[InputExample] | None, per_rank: bool = False):
        self.path = path
        self.per_rank = per_rank  # the inputs list holds one rank's shards, not whole tensors
        self.examples = list(inputs) if inputs is not None else None
        self.n_inputs = 0
        self.ops: list[Op] = []
        self.outputs: list[Value] = []
        self.schedule: list[ScheduleStep] = []
        self.meshes: dict[str, tuple] = {}  # tensor -> the devices of the mesh it was put on
        self.env: dict[str, Any] = {}
        self.names: set[str] = set()
        self.enums: set[str] = set()

    def fail(self, node: ast.AST, message: str) -> DumpError:
        return DumpError(message, self.path, getattr(node, "lineno", None))

    def read(self, fn: ast.FunctionDef, bindings: dict[str, int]) -> tuple[Fusion, list[ScheduleStep]]:
        self._check_signature(fn)
        args = [a.arg for a in fn.args.args]
        if not args or args[0] != "fd":
            raise self.fail(fn, f"{fn.name} must take `fd` as its first parameter")
        for a in args[1:]:
            if a not in bindings:
                raise self.fail(fn, f"{fn.name} has parameter {a!r}; give its value (bindings={{{a!r}: ...}})")
            self.env[a] = bindings[a]
            if isinstance(bindings[a], str) and "." in bindings[a]:
                self.enums.add(bindings[a].split(".")[0])
        for stmt in fn.body:
            self.statement(stmt)
        if self.examples is not None and len(self.examples) != self.n_inputs:
            raise DumpError(f"the inputs list has {len(self.examples)} entries but {fn.name} defines {self.n_inputs} inputs", self.path)
        fusion = Fusion(tuple(self.ops), tuple(self.outputs), fn.name)
        try:
            verify(fusion)
        except IRError as e:
            raise DumpError(str(e), self.path) from None
        return fusion, self.schedule

    def _check_signature(self, fn: ast.FunctionDef) -> None:
        """``def name(fd: FusionDefinition, n: int, ...) -> None:`` and nothing a reader would run."""
        if fn.decorator_list:
            raise self.fail(fn.decorator_list[0], f"{fn.name} has a decorator; a fusion definition is a plain function")
        a = fn.args
        if a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults or a.kw_defaults:
            raise self.fail(fn, f"{fn.name} must take plain parameters (fd, then named integers), without defaults, * or **")
        for arg in a.args:
            # Annotations are never evaluated; a plain (dotted) type name is allowed, as nvFuser's own
            # tests write `parallelism: Parallelism`, and anything else (a call, an expression) refused.
            if arg.annotation is not None and _dotted(arg.annotation) is None:
                raise self.fail(arg, f"parameter {arg.arg} has annotation `{_snippet(arg.annotation)}`; expected a type name "
                                     f"such as FusionDefinition or int")
        if fn.returns is not None and not (isinstance(fn.returns, ast.Constant) and fn.returns.value is None):
            raise self.fail(fn, f"{fn.name} is annotated to return `{_snippet(fn.returns)}`; expected -> None")

    # -- statements ---------------------------------------------------------------------------

    def statement(self, stmt: ast.stmt) -> None:
        try:
            self._statement(stmt)
        except IRError as e:
            raise self.fail(stmt, str(e)) from None
        except DumpError:
            raise
        except RecursionError:
            raise self.fail(stmt, "expression nested too deeply") from None

    def _statement(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Pass):
            return
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            return  # docstring
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            self.assign(stmt.targets[0], stmt.value, stmt)
            return
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            self.call_statement(stmt.value)
            return
        if isinstance(stmt, ast.If):
            test = self.expr(stmt.test)
            if not isinstance(test, bool):
                raise self.fail(stmt, "an if in a definition must test a comparison of its parameters")
            for inner in stmt.body if test else stmt.orelse:
                self.statement(inner)
            return
        if isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name) and not stmt.orelse:
            items = self.expr(stmt.iter)
            if not isinstance(items, (list, tuple)):
                raise self.fail(stmt, "a for loop in a definition may only run over a literal list")
            for item in items:
                self.env[stmt.target.id] = item
                for inner in stmt.body:
                    if not (isinstance(inner, ast.Expr) and isinstance(inner.value, ast.Call)):
                        raise self.fail(inner, "a for loop in a definition may only hold schedule calls")
                    self.statement(inner)
            self.env.pop(stmt.target.id, None)
            return
        raise self.fail(stmt, f"unexpected statement `{_snippet(stmt)}` in a fusion definition; expected `x = fd.ops.<op>(...)`, "
                        "`fd.add_output(x)` or a device-schedule call")

    def assign(self, target: ast.expr, value: ast.expr, stmt: ast.stmt) -> None:
        if isinstance(value, ast.Call):
            func = _dotted(value.func)
            if func in ("fd.define_tensor", "fd.define_scalar") or (func or "").startswith("fd.ops."):
                kind = func.split(".")[-1]
                names = self._target_names(target)
                self.add_op(kind, value, names, stmt)
                return
            kind = (func or "").removeprefix(composites.NAME + ".")
            if kind != func and kind in composites.COMPOSITES:  # nvtp_ops.gather_mm(fd, ...): the op, its arguments after fd
                if not value.args or _dotted(value.args[0]) != "fd":
                    raise self.fail(value, f"{func} takes fd first: {func}(fd, ...)")
                call = ast.Call(func=value.func, args=value.args[1:], keywords=value.keywords)
                self.add_op(kind, ast.copy_location(call, value), self._target_names(target), stmt)
                return
            if func in _MESH_CALLS:
                if not isinstance(target, ast.Name):
                    raise self.fail(stmt, "a device mesh must be assigned to a name")
                self.env[target.id] = ("mesh", self._mesh_devices(value))
                return
        # Integer bookkeeping such as `b, s, h, e = batch, sequence, head, hidden`.
        result = self.expr(value)
        if isinstance(target, ast.Name):
            self._bind_const(target, result)
        elif isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
            if not isinstance(result, (list, tuple)) or len(result) != len(target.elts):
                raise self.fail(stmt, "cannot unpack the right-hand side into the names on the left")
            for t, r in zip(target.elts, result):
                self._bind_const(t, r)
        else:
            raise self.fail(stmt, f"unexpected assignment `{_snippet(stmt)}`")

    def _mesh_devices(self, call: ast.Call) -> tuple:
        """A DeviceMesh's devices: ``DeviceMesh([0, 1])`` (1-D) or ``DeviceMesh(torch.tensor([[0, 1], [2, 3]]))``
        (2-D: the devices nested by the mesh's shape, as nested tuples)."""
        form = "`DeviceMesh([0, 1, ...])` (1-D) or `DeviceMesh(torch.tensor([[0, 1], [2, 3]]))` (2-D)"
        if len(call.args) != 1 or call.keywords:
            raise self.fail(call, f"DeviceMesh takes one argument: {form}")
        arg = call.args[0]
        if isinstance(arg, ast.Call) and _dotted(arg.func) == "torch.tensor":
            if len(arg.args) != 1 or arg.keywords:
                raise self.fail(arg, f"torch.tensor in a DeviceMesh takes one (nested) list of device ids: {form}")
            devices = self.expr(arg.args[0])
            if isinstance(devices, (list, tuple)) and devices and all(isinstance(r, (list, tuple)) for r in devices):
                rows = [tuple(r) for r in devices]
                if not all(len(r) == len(rows[0]) and r and all(isinstance(d, int) and not isinstance(d, bool) for d in r) for r in rows):
                    raise self.fail(arg, f"a 2-D DeviceMesh needs rows of integer device ids, all of one length; got {_snippet(arg.args[0])}")
                flat = [d for r in rows for d in r]
                if len(set(flat)) != len(flat):
                    raise self.fail(arg, f"DeviceMesh {_snippet(arg.args[0])} repeats a device")
                return tuple(rows)
        else:
            try:
                devices = self.expr(arg)  # a list, or a call nvtp evaluates (nvFuser's tests write range(num_devices))
            except DumpError:
                if not isinstance(arg, ast.Call):
                    raise
                raise self.fail(arg, f"DeviceMesh({_snippet(arg)}): nvtp reads a mesh written {form}") from None
            if isinstance(devices, (list, tuple)) and any(isinstance(d, (list, tuple)) for d in devices):
                raise self.fail(arg, f"nvFuser's DeviceMesh refuses a nested list; write a 2-D mesh as {form}")
        if not (isinstance(devices, (list, tuple)) and devices and all(isinstance(d, int) and not isinstance(d, bool) for d in devices)):
            raise self.fail(call, f"DeviceMesh needs integer device ids: {form}")
        if len(set(devices)) != len(devices):
            raise self.fail(call, f"DeviceMesh {list(devices)} repeats a device")
        return tuple(devices)

    def _bind_const(self, target: ast.Name, value: Any) -> None:
        if is_value(value) or isinstance(value, (int, float, bool)) or (isinstance(value, (list, tuple))):
            self.env[target.id] = value
        else:
            raise self.fail(target, f"cannot assign {value!r} to {target.id}")

    def _target_names(self, target: ast.expr) -> list[str]:
        if isinstance(target, ast.Name):
            return [target.id]
        if _is_fd_attr(target):
            return ["fd." + target.attr]  # type: ignore[attr-defined]
        if isinstance(target, (ast.Tuple, ast.List)) and all(isinstance(t, ast.Name) for t in target.elts):
            return [t.id for t in target.elts]  # type: ignore[attr-defined]
        raise self.fail(target, "results must be assigned to plain names")

    def _fresh(self, name: str) -> str:
        if name not in self.names:
            return name
        k = 1
        while f"{name}_{k}" in self.names:
            k += 1
        return f"{name}_{k}"

    def add_op(self, kind: str, call: ast.Call, names: list[str], stmt: ast.stmt) -> None:
        if kind not in opstable.OPS:
            raise self.fail(call, f"fd.ops.{kind} is not an op nvtp knows; see the op table, nvtp/ir/ops/, for the {len(opstable.OPS)} it does")
        for a in call.args:
            if isinstance(a, ast.Starred):
                raise self.fail(a, "*args are not allowed in a fusion definition")
        if any(kw.arg is None for kw in call.keywords):
            raise self.fail(call, "**kwargs are not allowed in a fusion definition")
        args = [normalize(self.expr(a)) for a in call.args]
        kwargs = {kw.arg: normalize(self.expr(kw.value)) for kw in call.keywords}
        if kind == "define_tensor":
            args, kwargs = self._resolve_input_shape(args, kwargs, call)
        kwargs = _coerce_bools(kind, args, kwargs)
        ir_names = [self._fresh(n.removeprefix("fd.")) for n in names]
        op = make_op(kind, args, kwargs, ir_names)
        opstable.check_operand_dtypes(op)
        self.ops.append(op)
        if kind == "define_tensor" or (kind == "define_scalar" and op.arg("value") is None):
            self.n_inputs += 1
        for py_name, v in zip(names, op.outputs):
            self.names.add(v.name)
            self.env[py_name] = v

    def _resolve_input_shape(self, args: list, kwargs: dict, call: ast.Call) -> tuple[list, dict]:
        bound = dict(opstable.bind("define_tensor", tuple(args), kwargs))
        shape = bound["shape"]
        if not isinstance(shape, tuple) or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
            raise self.fail(call, f"define_tensor shape must be a list of integers, got {shape!r}")
        example = None
        if self.examples is not None:
            if self.n_inputs >= len(self.examples):
                raise self.fail(call, f"input {self.n_inputs} has no entry in the inputs list ({len(self.examples)} entries)")
            example = self.examples[self.n_inputs]
        if any(s < 0 for s in shape) or example is not None:
            if example is None or example.shape is None:
                raise self.fail(call, f"define_tensor has symbolic shape {list(shape)}; nvtp needs static sizes: add an `inputs = [...]` list "
                                "with example tensors, or write the sizes")
            if self.per_rank and all(s >= 0 for s in shape):
                if len(example.shape) != len(shape) or any(e <= 0 or s % e for s, e in zip(shape, example.shape)):
                    raise self.fail(call, f"define_tensor shape {list(shape)} has no shard of shape {list(example.shape)}")
            else:
                if len(example.shape) != len(shape) or any(s >= 0 and s != e for s, e in zip(shape, example.shape)):
                    raise self.fail(call, f"define_tensor shape {list(shape)} does not match the inputs list entry {list(example.shape)}")
                bound["shape"] = tuple(example.shape)
        if isinstance(bound["contiguity"], bool):
            # As nvFuser expands a single flag: size-1 (broadcast) axes get None.
            bound["contiguity"] = tuple(None if n == 1 else bound["contiguity"] for n in bound["shape"])
        if bound["stride_order"] is None or bound["stride_order"] == ():
            bound["stride_order"] = tuple(range(len(shape) - 1, -1, -1))
        return [], bound

    def call_statement(self, call: ast.Call) -> None:
        func = call.func
        if _dotted(func) == "fd.add_output":
            if len(call.args) != 1 or call.keywords:
                raise self.fail(call, "fd.add_output takes exactly one value")
            v = self.expr(call.args[0])
            if not is_value(v):
                raise self.fail(call, f"fd.add_output of {_snippet(call.args[0])}, which is not a fusion value")
            self.outputs.append(v)
            return
        if isinstance(func, ast.Attribute):
            method = func.attr
            # T.axis(i).parallelize(ParallelType.mesh_x); ParallelType.stream: a host loop over streams (collective matmul)
            if method == "parallelize" and isinstance(func.value, ast.Call) and isinstance(func.value.func, ast.Attribute) and func.value.func.attr == "axis":
                tensor = self._tensor_name(func.value.func.value)
                axis = self.expr(func.value.args[0]) if len(func.value.args) == 1 else None
                ptype = _dotted(call.args[0]) if len(call.args) == 1 else None
                kind = ptype.rsplit(".", 1)[-1] if ptype is not None and ptype.split(".")[-2:-1] == ["ParallelType"] else None
                if not isinstance(axis, int) or kind not in ("mesh_x", "mesh_y", "stream"):
                    raise self.fail(call, "expected `T.axis(i).parallelize(ParallelType.mesh_x)` (or `ParallelType.mesh_y` "
                                          "on a 2-D mesh, or `ParallelType.stream`)")
                mesh = self.meshes.get(tensor)
                if kind == "mesh_y" and mesh is not None and not (mesh and isinstance(mesh[0], tuple)):
                    raise self.fail(call, f"{tensor} is parallelized with ParallelType.mesh_y, but its mesh {list(mesh)} has one axis "
                                          "(mesh_x); mesh_y needs a 2-D mesh: DeviceMesh(torch.tensor([[0, 1], [2, 3]]))")
                self.schedule.append(ScheduleStep(tensor, "parallelize", (axis, kind)))
                return
            if method in ("set_device_mesh", "outer_split", "inner_split", "split"):
                tensor = self._tensor_name(func.value)
                values = [self.expr(a) for a in call.args]
                kw = {k.arg: self.expr(k.value) for k in call.keywords}
                if method == "set_device_mesh":
                    if len(values) != 1 or not (isinstance(values[0], tuple) and values[0][:1] == ("mesh",)):
                        raise self.fail(call, "set_device_mesh takes a DeviceMesh defined earlier")
                    self.schedule.append(ScheduleStep(tensor, "mesh", values[0][1]))
                    self.meshes[tensor] = values[0][1]
                    return
                if method == "split":
                    inner = kw.pop("inner_split", values[2] if len(values) > 2 else True)
                    values = values[:2]
                else:
                    inner = method == "inner_split"
                if kw or len(values) != 2 or not all(isinstance(v, int) for v in values) or not isinstance(inner, bool):
                    raise self.fail(call, f"expected `T.{method}(axis, factor)` with integer arguments")
                self.schedule.append(ScheduleStep(tensor, "split", (values[0], values[1], inner)))
                return
        raise self.fail(call, f"unexpected call `{_snippet(call)}`; a definition may call only fd.define_*, fd.ops.*, fd.add_output "
                        "and device-schedule methods of its tensors")

    def _tensor_name(self, node: ast.expr) -> str:
        v = self.expr(node)
        if not isinstance(v, TensorValue):
            raise self.fail(node, f"{_snippet(node)} is not a tensor of this fusion")
        return v.name

    # -- expressions --------------------------------------------------------------------------

    def expr(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (bool, int, float, complex, type(None))):
                return node.value
            raise self.fail(node, f"unexpected constant {node.value!r}")
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            if node.id in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[node.id]
            raise self.fail(node, f"{node.id} is not defined at this point of the definition")
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.expr(e) for e in node.elts]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = self.expr(node.operand)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise self.fail(node, "unary minus applies only to numbers here")
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            lhs, rhs = self.expr(node.left), self.expr(node.comparators[0])
            if is_value(lhs) or is_value(rhs):
                raise self.fail(node, "comparisons in a definition apply only to parameters and numbers")
            return (lhs == rhs) == isinstance(node.ops[0], ast.Eq)
        if isinstance(node, ast.BinOp):
            lhs, rhs = self.expr(node.left), self.expr(node.right)
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (lhs, rhs)):
                raise self.fail(node, "arithmetic in a definition applies only to numbers")
            ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                   ast.FloorDiv: lambda a, b: a // b, ast.Div: lambda a, b: a / b, ast.Mod: lambda a, b: a % b}
            fn = ops.get(type(node.op))
            if fn is None:
                raise self.fail(node, f"operator {type(node.op).__name__} is not allowed in a definition")
            try:
                result = fn(lhs, rhs)
            except ZeroDivisionError:
                raise self.fail(node, "division by zero") from None
            if isinstance(result, int) and abs(result) > 2**62:
                raise self.fail(node, "integer too large")
            return result
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name and name.startswith("fd.") and name.count(".") == 1:
                if name in self.env:
                    return self.env[name]
                raise self.fail(node, f"{name} is not defined at this point of the definition")
            if name and name.count(".") == 1 and name.split(".")[0] in self.enums:
                return name  # a member of an enum parameter, e.g. Parallelism.TENSOR_PARALLEL
            if name:
                head, _, attr = name.rpartition(".")
                if head in ("DataType", "nvfuser.DataType", "nvfuser_direct.DataType"):
                    try:
                        return DType(attr)
                    except ValueError:
                        raise self.fail(node, f"unknown data type DataType.{attr}") from None
            raise self.fail(node, f"unexpected attribute access `{_snippet(node)}`")
        if isinstance(node, ast.Call):
            func = _dotted(node.func)
            if func == "float" and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and node.args[0].value in ("inf", "-inf", "nan"):
                return float(node.args[0].value)
            if func in ("float", "int") and len(node.args) == 1 and not node.keywords:
                n = self.expr(node.args[0])
                if not isinstance(n, (int, float)) or isinstance(n, bool):
                    raise self.fail(node, f"{func}() applies only to numbers here")
                return float(n) if func == "float" else int(n)
            if func in ("range", "torch.arange") and len(node.args) == 1 and not node.keywords:
                n = self.expr(node.args[0])
                if not isinstance(n, int) or not 0 <= n <= 1 << 16:
                    raise self.fail(node, f"{func} needs a small non-negative integer")
                return list(range(n))
            if func == "list" and len(node.args) == 1:
                return list(self.expr(node.args[0]))
            if func == "fd.define_scalar" and len(node.args) == 1 and [k.arg for k in node.keywords] == ["dtype"]:
                # An inline constant, as nvtp prints a number where nvFuser takes only a Val
                # (nvtp.ir.printer.VAL_ONLY): the number itself.
                n, dt = self.expr(node.args[0]), self.expr(node.keywords[0].value)
                if not isinstance(n, (bool, int, float, complex)) or not isinstance(dt, DType):
                    raise self.fail(node, "an inline fd.define_scalar needs a number and dtype=DataType.<type>")
                return bool(n) if dt is DType.Bool else complex(n) if dt.is_complex else float(n) if dt.is_float else int(n)
            if func == "fd.fusion.inputs" and not node.args and not node.keywords:
                return [op.outputs[0] for op in self.ops if op.kind == "define_tensor" or (op.kind == "define_scalar" and op.arg("value") is None)]
            raise self.fail(node, f"unexpected call `{_snippet(node)}`; a definition may not call other functions")
        raise self.fail(node, f"unexpected expression `{_snippet(node)}`")


def _is_fd_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "fd"


def _coerce_bools(kind: str, args: list, kwargs: dict) -> dict:
    """nvFuser's printer writes some flags as 0/1 (``manual_normalization=0``)."""
    s = opstable.spec(kind)
    out = dict(kwargs)
    for p in s.params[len(args):]:
        if p.kind == "bool" and p.name in out and out[p.name] in (0, 1) and not isinstance(out[p.name], bool):
            out[p.name] = bool(out[p.name])
    return out


def _apply_info(fusion: Fusion, info: dict, path: str | None) -> Fusion:
    from dataclasses import replace

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
