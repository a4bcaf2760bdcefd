"""The body of a fusion definition function, read statement by statement with ``ast`` (never
run): ``fd.define_tensor`` / ``fd.define_scalar`` / ``fd.ops.*`` become ops built from the op table
(``nvtp.ir.build.make_op``), ``fd.add_output`` the outputs, integer bookkeeping and loops over
literal lists are evaluated, and the device-schedule calls go to ``ScheduleReader``
(``nvtp/ir/schedule_calls.py``). Anything else is refused with its line and what was expected."""

from __future__ import annotations

import ast
from typing import Any, Iterable

from nvtp.ir import ops as opstable
from nvtp.ir.build import make_op, normalize
from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Fusion, Op, ScheduleStep, Value, is_value
from nvtp.ir.ops import IRError
from nvtp.ir.reading import DumpError, InputExample, dotted, snippet
from nvtp.ir.schedule_calls import MESH_CALLS, ScheduleReader
from nvtp.ir.verify import verify


class DefinitionReader:
    """Reads a definition function's body statement by statement into ops and (``ScheduleReader``)
    schedule steps."""

    def __init__(self, path: str | None, inputs: list[InputExample] | None, per_rank: bool = False):
        self.path = path
        self.per_rank = per_rank  # the inputs list holds one rank's shards, not whole tensors
        self.examples = list(inputs) if inputs is not None else None
        self.n_inputs = 0
        self.ops: list[Op] = []
        self.outputs: list[Value] = []
        self.made: dict[str, tuple[Op, int]] = {}  # value -> the op making it and its result index
        self.line_shift = 0  # added to a node's line: a statement parsed on its own (a large file, streamed)
        self.schedule = ScheduleReader(self.fail, self.expr, self._origin)
        self.env: dict[str, Any] = {}
        self.names: set[str] = set()
        self.enums: set[str] = set()

    def fail(self, node: ast.AST, message: str) -> DumpError:
        line = getattr(node, "lineno", None)
        return DumpError(message, self.path, None if line is None else line + self.line_shift)

    def read(self, fn: ast.FunctionDef, bindings: dict[str, int], body: Iterable[tuple[ast.stmt, int]] | None = None
             ) -> tuple[Fusion, list[ScheduleStep]]:
        """The fusion and schedule ``fn`` defines. ``body``: its statements, each with what to add to
        its nodes' line numbers, when the parser reads a large file's body one statement at a time
        (else ``fn.body``)."""
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
        for stmt, self.line_shift in ((stmt, 0) for stmt in fn.body) if body is None else body:
            self.statement(stmt)
        self.line_shift = 0
        if self.examples is not None and len(self.examples) != self.n_inputs:
            raise DumpError(f"the inputs list has {len(self.examples)} entries but {fn.name} defines {self.n_inputs} inputs", self.path)
        self.schedule.check()
        fusion = Fusion(tuple(self.ops), tuple(self.outputs), fn.name)
        try:
            verify(fusion, typed=True)  # each op was built by make_op and its dtypes checked (add_op)
        except IRError as e:
            raise DumpError(str(e), self.path) from None
        return fusion, self.schedule.steps

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
            if arg.annotation is not None and dotted(arg.annotation) is None:
                raise self.fail(arg, f"parameter {arg.arg} has annotation `{snippet(arg.annotation)}`; expected a type name "
                                     f"such as FusionDefinition or int")
        if fn.returns is not None and not (isinstance(fn.returns, ast.Constant) and fn.returns.value is None):
            raise self.fail(fn, f"{fn.name} is annotated to return `{snippet(fn.returns)}`; expected -> None")

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
        raise self.fail(stmt, f"unexpected statement `{snippet(stmt)}` in a fusion definition; expected `x = fd.ops.<op>(...)`, "
                        "`fd.add_output(x)` or a device-schedule call")

    def assign(self, target: ast.expr, value: ast.expr, stmt: ast.stmt) -> None:
        if isinstance(value, ast.Call):
            func = dotted(value.func)
            if func in ("fd.define_tensor", "fd.define_scalar") or (func or "").startswith("fd.ops."):
                kind = func.split(".")[-1]
                names = self._target_names(target)
                self.add_op(kind, value, names, stmt)
                return
            if func in MESH_CALLS:
                if not isinstance(target, ast.Name):
                    raise self.fail(stmt, "a device mesh must be assigned to a name")
                self.env[target.id] = ("mesh", self.schedule.mesh(value))
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
            raise self.fail(stmt, f"unexpected assignment `{snippet(stmt)}`")

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
            raise self.fail(call, f"fd.ops.{kind} is not an op nvtp knows; see nvtp/ir/ops.py for the {len(opstable.OPS)} it does")
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
        for r, (py_name, v) in enumerate(zip(names, op.outputs)):
            self.names.add(v.name)
            self.made[v.name] = (op, r)
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
        if dotted(func) == "fd.add_output":
            if len(call.args) != 1 or call.keywords:
                raise self.fail(call, "fd.add_output takes exactly one value")
            v = self.expr(call.args[0])
            if not is_value(v):
                raise self.fail(call, f"fd.add_output of {snippet(call.args[0])}, which is not a fusion value")
            self.outputs.append(v)
            return
        if self.schedule.call(call):
            return
        raise self.fail(call, f"unexpected call `{snippet(call)}`; a definition may call only fd.define_*, fd.ops.*, fd.add_output "
                        "and device-schedule methods of its tensors")

    def _origin(self, name: str) -> tuple[Op | None, int]:
        op, result = self.made[name]
        return (None if op.kind == "define_tensor" else op), result

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
            name = dotted(node)
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
            raise self.fail(node, f"unexpected attribute access `{snippet(node)}`")
        if isinstance(node, ast.Call):
            func = dotted(node.func)
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
            raise self.fail(node, f"unexpected call `{snippet(node)}`; a definition may not call other functions")
        raise self.fail(node, f"unexpected expression `{snippet(node)}`")


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
