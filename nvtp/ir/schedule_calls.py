"""The device-schedule calls a fusion definition ends with (nvFuser's multidevice API), read and
checked as the parser meets them: ``mesh = DeviceMesh(...)``, ``T.set_device_mesh(mesh)``,
``T.outer_split(axis, k)`` / ``T.inner_split(axis, k)`` / ``T.split(axis, k)`` and
``T.axis(i).parallelize(ParallelType.mesh_x)`` (``mesh_y`` on a 2-D mesh, ``stream``).

Each call is checked where it stands, so a wrong one is refused with its line and what is legal
instead of being read as something else: the axis exists in the tensor's loop domain as the
splits before it left it (``nvtp.ir.loops``: the logical axes, then the reduced or contracted
ones); a split divides its axis; a parallel type is used on one iteration axis of a tensor (and
on one reduction axis beside it: nvFuser's reduce-scatter); and, once the
definition is read (``check``), an axis parallelized over the devices has as many entries as the
tensor's mesh has devices along that parallel type, and a tensor parallelized over devices has a
mesh when any tensor has one.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Callable

from nvtp.ir.graph import Op, ScheduleStep, TensorValue
from nvtp.ir.loops import loop_axes, loop_extents
from nvtp.ir.reading import DumpError, dotted, snippet

MESH_CALLS = ("DeviceMesh", "multidevice.DeviceMesh", "nvfuser_direct.multidevice.DeviceMesh", "nvfuser.multidevice.DeviceMesh")
PARALLEL_TYPES = ("mesh_x", "mesh_y", "stream")
_MESH_FORM = "`DeviceMesh([0, 1, ...])` (1-D) or `DeviceMesh(torch.tensor([[0, 1], [2, 3]]))` (2-D)"
_SPLITS = ("outer_split", "inner_split", "split")


@dataclass
class _Parallel:
    """One ``T.axis(i).parallelize(...)``: where it stands, for the checks at the end."""

    tensor: str
    axis: int
    extent: int
    kind: str
    reduction: bool  # a reduced or contracted loop axis (a partial sum: nvFuser's reduce-scatter has one of each)
    node: ast.AST


@dataclass
class ScheduleReader:
    """The schedule of one definition: ``fail(node, message)`` makes a ``DumpError`` at a node's
    line; ``expr`` evaluates an argument; ``origin(name)`` gives the op making a tensor and the
    result's index (None for an input, whose loop domain is its logical axes)."""

    fail: Callable[[ast.AST, str], DumpError]
    expr: Callable[[ast.expr], Any]
    origin: Callable[[str], tuple[Op | None, int]]
    steps: list[ScheduleStep] = field(default_factory=list)
    meshes: dict[str, tuple] = field(default_factory=dict)  # tensor -> the devices of the mesh it was put on
    loops: dict[str, list[tuple[int, bool]]] = field(default_factory=dict)  # tensor -> (extent, reduction?) per loop axis, as split so far
    parallel: list[_Parallel] = field(default_factory=list)

    def mesh(self, call: ast.Call) -> tuple:
        """A DeviceMesh's devices: ``DeviceMesh([0, 1])`` (1-D) or ``DeviceMesh(torch.tensor([[0, 1], [2, 3]]))``
        (2-D: the devices nested by the mesh's shape, as nested tuples)."""
        if len(call.args) != 1 or call.keywords:
            raise self.fail(call, f"DeviceMesh takes one argument: {_MESH_FORM}")
        arg = call.args[0]
        if isinstance(arg, ast.Call) and dotted(arg.func) == "torch.tensor":
            if len(arg.args) != 1 or arg.keywords:
                raise self.fail(arg, f"torch.tensor in a DeviceMesh takes one (nested) list of device ids: {_MESH_FORM}")
            devices = self.expr(arg.args[0])
            if isinstance(devices, (list, tuple)) and devices and all(isinstance(r, (list, tuple)) for r in devices):
                rows = [tuple(r) for r in devices]
                if not all(len(r) == len(rows[0]) and r and all(isinstance(d, int) and not isinstance(d, bool) for d in r) for r in rows):
                    raise self.fail(arg, f"a 2-D DeviceMesh needs rows of integer device ids, all of one length; got {snippet(arg.args[0])}")
                flat = [d for r in rows for d in r]
                if len(set(flat)) != len(flat):
                    raise self.fail(arg, f"DeviceMesh {snippet(arg.args[0])} repeats a device")
                return tuple(rows)
        else:
            try:
                devices = self.expr(arg)  # a list, or a call nvtp evaluates (nvFuser's tests write range(num_devices))
            except DumpError:
                if not isinstance(arg, ast.Call):
                    raise
                raise self.fail(arg, f"DeviceMesh({snippet(arg)}): nvtp reads a mesh written {_MESH_FORM}") from None
            if isinstance(devices, (list, tuple)) and any(isinstance(d, (list, tuple)) for d in devices):
                raise self.fail(arg, f"nvFuser's DeviceMesh refuses a nested list; write a 2-D mesh as {_MESH_FORM}")
        if not (isinstance(devices, (list, tuple)) and devices and all(isinstance(d, int) and not isinstance(d, bool) for d in devices)):
            raise self.fail(call, f"DeviceMesh needs integer device ids: {_MESH_FORM}")
        if len(set(devices)) != len(devices):
            raise self.fail(call, f"DeviceMesh {list(devices)} repeats a device")
        return tuple(devices)

    def call(self, call: ast.Call) -> bool:
        """Read ``call`` if it is a schedule call (and check it); False if it is none."""
        func = call.func
        if not isinstance(func, ast.Attribute):
            return False
        if func.attr == "parallelize" and isinstance(func.value, ast.Call) and isinstance(func.value.func, ast.Attribute) \
                and func.value.func.attr == "axis":
            self._parallelize(call, func.value)
            return True
        if func.attr == "set_device_mesh":
            tensor = self._tensor(func.value)
            values = [self.expr(a) for a in call.args]
            if len(values) != 1 or call.keywords or not (isinstance(values[0], tuple) and values[0][:1] == ("mesh",)):
                raise self.fail(call, "set_device_mesh takes a DeviceMesh defined earlier")
            self.steps.append(ScheduleStep(tensor.name, "mesh", values[0][1]))
            self.meshes[tensor.name] = values[0][1]
            return True
        if func.attr in _SPLITS:
            self._split(call, func.attr, self._tensor(func.value))
            return True
        return False

    def _tensor(self, node: ast.expr) -> TensorValue:
        v = self.expr(node)
        if not isinstance(v, TensorValue):
            raise self.fail(node, f"{snippet(node)} is not a tensor of this fusion")
        return v

    def _loop(self, v: TensorValue) -> list[tuple[int, bool]]:
        if v.name not in self.loops:
            op, result = self.origin(v.name)
            reduced = [kind == "reduce" for kind, _ in loop_axes(op, result)] if op is not None else [False] * v.ndim
            self.loops[v.name] = list(zip(loop_extents(op, result, v), reduced))
        return self.loops[v.name]

    def _axis(self, node: ast.AST, v: TensorValue, axis: Any, what: str) -> int:
        """``axis`` of ``v``'s loop domain as it stands, normalized; refused if out of range."""
        loop = self._loop(v)
        if not isinstance(axis, int) or isinstance(axis, bool) or not -len(loop) <= axis < len(loop):
            raise self.fail(node, f"{what}: {v.name} has {len(loop)} loop axes here ({_extents([n for n, _ in loop])}: its {v.ndim} axes"
                                  f"{self._after(v)}), so the axis must be in 0..{len(loop) - 1} (or -{len(loop)}..-1); "
                                  f"got {axis!r}")
        return axis % len(loop)

    def _after(self, v: TensorValue) -> str:
        op, result = self.origin(v.name)
        n = len(loop_extents(op, result, v))
        splits = sum(1 for s in self.steps if s.tensor == v.name and s.kind == "split")
        more = [f"{n - v.ndim} reduction axis(es)"] if n > v.ndim else []
        more += [f"{splits} split(s) so far"] if splits else []
        return f", then {' and '.join(more)}" if more else ""

    def _split(self, call: ast.Call, method: str, v: TensorValue) -> None:
        values = [self.expr(a) for a in call.args]
        kw = {k.arg: self.expr(k.value) for k in call.keywords}
        if method == "split":
            inner = kw.pop("inner_split", values[2] if len(values) > 2 else True)
            values = values[:2]
        else:
            inner = method == "inner_split"
        if kw or len(values) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in values) or not isinstance(inner, bool):
            raise self.fail(call, f"expected `{v.name}.{method}(axis, factor)` with integer arguments")
        axis = self._axis(call, v, values[0], f"{v.name}.{method}({values[0]}, {values[1]})")
        loop, factor = self._loop(v), values[1]
        extent, reduction = loop[axis]
        if factor < 1 or extent % factor:
            raise self.fail(call, f"{v.name}.{method}({values[0]}, {factor}): loop axis {axis} has {extent} entries, which "
                                  f"{factor} does not divide; nvtp reads even splits only (a factor dividing {extent})")
        outer = extent // factor if inner else factor
        loop[axis:axis + 1] = [(outer, reduction), (extent // outer, reduction)]
        self.steps.append(ScheduleStep(v.name, "split", (values[0], factor, inner)))

    def _parallelize(self, call: ast.Call, axis_call: ast.Call) -> None:
        v = self._tensor(axis_call.func.value)  # type: ignore[attr-defined]
        ptype = dotted(call.args[0]) if len(call.args) == 1 and not call.keywords else None
        kind = ptype.rsplit(".", 1)[-1] if ptype is not None and ptype.split(".")[-2:-1] == ["ParallelType"] else None
        if len(axis_call.args) != 1 or axis_call.keywords or kind not in PARALLEL_TYPES:
            raise self.fail(call, f"expected `{v.name}.axis(i).parallelize(ParallelType.mesh_x)` (or `ParallelType.mesh_y` "
                                  "on a 2-D mesh, or `ParallelType.stream`)"
                                  + (f"; got ParallelType.{kind or ptype}" if ptype and kind not in PARALLEL_TYPES else ""))
        written = self.expr(axis_call.args[0])
        axis = self._axis(call, v, written, f"{v.name}.axis({written!r}).parallelize(ParallelType.{kind})")
        mesh = self.meshes.get(v.name)
        if kind == "mesh_y" and mesh is not None and not (mesh and isinstance(mesh[0], tuple)):
            raise self.fail(call, f"{v.name} is parallelized with ParallelType.mesh_y, but its mesh {list(mesh)} has one axis "
                                  "(mesh_x); mesh_y needs a 2-D mesh: DeviceMesh(torch.tensor([[0, 1], [2, 3]]))")
        extent, reduction = self._loop(v)[axis]
        twice = next((p for p in self.parallel if p.tensor == v.name and p.kind == kind and p.reduction == reduction), None)
        if twice is not None:
            what = "reduction" if reduction else "iteration"
            raise self.fail(call, f"{v.name} is parallelized with ParallelType.{kind} twice, on {what} loop axes {twice.axis} and "
                                  f"{axis}; nvFuser allows one {what} axis per parallel type (and one reduction axis beside it: a "
                                  "reduce-scatter): split one axis instead")
        self.parallel.append(_Parallel(v.name, axis, extent, kind, reduction, call))
        self.steps.append(ScheduleStep(v.name, "parallelize", (written, kind)))

    def check(self) -> None:
        """The checks that need the whole schedule: each device-parallel axis has as many entries as
        its mesh has devices along its parallel type; a tensor parallelized over devices has a mesh
        where any tensor has one."""
        for p in self.parallel:
            if p.kind == "stream":
                continue
            mesh = self.meshes.get(p.tensor)
            if mesh is None:
                if self.meshes:
                    raise self.fail(p.node, f"{p.tensor} is parallelized with ParallelType.{p.kind} but has no device mesh; "
                                            f"add `{p.tensor}.set_device_mesh(mesh)` (the other tensors have one)")
                continue
            two_d = isinstance(mesh[0], tuple)
            devices = len(mesh[0]) if two_d and p.kind == "mesh_x" else len(mesh)  # mesh_x: the last axis; mesh_y: the rows
            if p.extent != devices:
                raise self.fail(p.node, f"{p.tensor}.axis({p.axis}).parallelize(ParallelType.{p.kind}): the axis has {p.extent} "
                                        f"entries but the mesh has {devices} devices along {p.kind}; split it so the "
                                        f"parallelized axis has {devices} entries (`{p.tensor}.outer_split({p.axis}, {devices})`, "
                                        f"then parallelize the outer axis)")


def _extents(loop: list[int]) -> str:
    return "[" + ", ".join(map(str, loop)) + "]"
