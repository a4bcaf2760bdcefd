"""Print fusions in nvFuser's own Python format.

``format_definition`` gives the ``def nvfuser_fusion_id0(fd : FusionDefinition) -> None :``
function; ``format_file`` wraps it the way nvFuser's ``repro_script_for`` does (imports, the
``with FusionDefinition() as fd:`` block, an ``inputs`` list and ``fd.execute(inputs)``), plus an
inert ``nvtp_info`` dict with what nvtp knows beyond nvFuser (input roles and names). Numbers
print at full precision (``repr``), so a printed fusion is exactly the fusion.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from nvtp.ir import composites, ops as opstable
from nvtp.ir.dtypes import DType, promote
from nvtp.ir.graph import FORMAT, Fusion, Op, ScalarValue, ScheduleStep, TensorValue, is_value

INDENT = "    "


def format_literal(x: Any) -> str:
    if is_value(x):
        return x.name
    if isinstance(x, DType):
        return str(x)
    if isinstance(x, bool) or x is None:
        return repr(x)
    if isinstance(x, float):
        if math.isnan(x):
            return 'float("nan")'
        if math.isinf(x):
            return 'float("inf")' if x > 0 else '-float("inf")'
        return repr(x)
    if isinstance(x, (int, complex)):
        return repr(x)
    if isinstance(x, (tuple, list)):
        return "[" + ", ".join(format_literal(e) for e in x) + "]"
    raise TypeError(f"cannot print argument {x!r}")


# Parameters nvFuser (nvfuser_direct 0.2.36) takes only as a ``Val``, never as a Python number
# ("incompatible function arguments" otherwise): a number there prints as an inline
# ``fd.define_scalar(number, dtype=...)``, which the parser reads back as the number.
VAL_ONLY = {
    *(("embedding_fwd", p) for p in ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")),
    *((op, p) for op in ("uniform", "normal") for p in ("rng_seed", "rng_offset")),
    ("scatter", "src"),
    ("topk", "k"),
}


def format_argument(kind: str, name: str, value: Any) -> str:
    """``value`` as op ``kind``'s argument ``name`` in nvFuser's Python."""
    if (kind, name) in VAL_ONLY and isinstance(value, (bool, int, float, complex)):
        return f"fd.define_scalar({format_literal(value)}, dtype={promote(value)})"
    return format_literal(value)


def format_call(op: Op) -> str:
    s = opstable.spec(op.kind)
    parts = []
    for i, (p, (name, value)) in enumerate(zip(s.params, op.args)):
        if i < s.positional:
            parts.append(format_argument(op.kind, name, value))
        elif (
            op.kind == "define_tensor"
            or value != p.default
            or type(value) is not type(p.default)
            or (p.kind.startswith("dtype") and value not in (None, DType.Null))
        ):
            parts.append(f"{name}={format_argument(op.kind, name, value)}")
    if op.kind in composites.COMPOSITES:  # nvtp's op nvFuser lacks: a method of the dump's nvtp_ops class
        return f"{composites.NAME}.{op.kind}({', '.join(['fd', *parts])})"
    prefix = "fd." if op.kind in ("define_tensor", "define_scalar") else "fd.ops."
    return f"{prefix}{op.kind}({', '.join(parts)})"


def format_op(op: Op) -> str:
    lhs = ", ".join(v.name for v in op.outputs)
    return f"{lhs} = {format_call(op)}"


def format_mesh_devices(args: tuple) -> str:
    """A mesh step's devices as nvFuser's DeviceMesh takes them: a list on a 1-D mesh, a
    ``torch.tensor`` of nested lists on a mesh of several axes (DeviceMesh refuses nested lists)."""
    def as_list(x):
        return [as_list(i) for i in x] if isinstance(x, tuple) else x

    if args and isinstance(args[0], tuple):
        return f"torch.tensor({as_list(args)})"
    return str(list(args))


def format_schedule(steps: Sequence["ScheduleStep"]) -> list[str]:
    """A device schedule as the statements that end a definition, in nvFuser's multidevice
    Python: a ``mesh = ...DeviceMesh([...])`` line before the first tensor put on that mesh (a mesh
    of several axes, whose step holds nested devices: ``DeviceMesh(torch.tensor([[0, 1], [2, 3]]))``),
    then ``T.set_device_mesh(mesh)``, ``T.outer_split(axis, factor)``, ``T.axis(i).parallelize(...)``."""
    lines, mesh = [], None
    for step in steps:
        name, args = step.tensor, step.args
        if step.kind == "mesh" and args != mesh:
            mesh = args
            lines.append(f"mesh = nvfuser_direct.multidevice.DeviceMesh({format_mesh_devices(args)})")
        if step.kind == "mesh":
            lines.append(f"{name}.set_device_mesh(mesh)")
        elif step.kind == "split":
            lines.append(f"{name}.{'inner' if args[2] else 'outer'}_split({args[0]}, {args[1]})")
        elif step.kind == "parallelize":
            lines.append(f"{name}.axis({args[0]}).parallelize(ParallelType.{args[1]})")
        else:
            raise ValueError(f"unknown schedule step kind {step.kind!r} in {step}; the printer knows mesh, split, parallelize")
    return lines


def format_definition(fusion: Fusion, extra_body: Sequence[str] = (), comments: dict[str, str] | None = None) -> str:
    """The definition function. ``extra_body`` lines (e.g. a device schedule) go after the outputs;
    ``comments`` maps a value name to a trailing comment on the line that defines it."""
    comments = comments or {}
    lines = [f"def {fusion.name}(fd : FusionDefinition) -> None :"]
    for op in fusion.ops:
        line = INDENT + format_op(op)
        note = comments.get(op.outputs[0].name) if op.outputs else None
        if note:
            line += f"  # {note}"
        lines.append(line)
    for v in fusion.outputs:
        lines.append(f"{INDENT}fd.add_output({v.name})")
    lines.extend(INDENT + line if line else "" for line in extra_body)
    return "\n".join(lines) + "\n"


def strides_for(shape: Sequence[int], stride_order: Sequence[int] | None) -> tuple[int, ...]:
    """Strides of a dense tensor laid out by nvFuser's ``stride_order`` (rank - 1 = outermost)."""
    n = len(shape)
    order = list(stride_order) if stride_order else list(range(n - 1, -1, -1))
    strides = [0] * n
    running = 1
    # nvFuser: stride_order[i] is the position of axis i from the innermost (0 = innermost).
    for axis in sorted(range(n), key=lambda i: order[i]):
        strides[axis] = running
        running *= max(shape[axis], 1)
    return tuple(strides)


def format_input_example(op: Op, device: str = "cuda:0", shape: Sequence[int] | None = None) -> str:
    """One entry of the ``inputs = [...]`` list, as nvFuser's repro scripts write it."""
    value = op.outputs[0]
    if isinstance(value, ScalarValue):
        example = {DType.Bool: "True", DType.Int: "1", DType.Int32: "1"}.get(value.dtype, "1.0")
        return example
    shape = tuple(value.shape if shape is None else shape)
    strides = strides_for(shape, op.arg("stride_order"))
    tdtype = value.dtype.torch
    if strides == strides_for(shape, None):
        return f"torch.testing.make_tensor({shape!r}, dtype={tdtype}, device='{device}')"
    size = 1 + sum((n - 1) * st for n, st in zip(shape, strides)) if all(shape) else 0
    if tdtype.is_floating_point:
        return f"torch.randn({size}, dtype={tdtype}, device='{device}').as_strided({shape!r}, {strides!r})"
    upper = 2 if tdtype.is_floating_point is False and value.dtype is DType.Bool else 10
    return f"torch.randint(0, {upper}, ({size},), dtype={tdtype}, device='{device}').as_strided({shape!r}, {strides!r})"


def format_info(fusion: Fusion) -> list[str]:
    lines = ["nvtp_info = {"]
    lines.append(f"{INDENT}\"fusion\": {{" + ", ".join(f"{k!r}: {v!r}" for k, v in fusion.attrs.items()).replace("'", '"') + "},")
    lines.append(f"{INDENT}\"values\": {{")
    for name, info in fusion.info.items():
        fields = {"role": info.role}
        if info.label:
            fields["label"] = info.label
        if info.source:
            fields["source"] = info.source
        body = ", ".join(f'"{k}": "{v}"' for k, v in fields.items())
        lines.append(f'{INDENT * 2}"{name}": {{{body}}},')
    lines.append(f"{INDENT}}},")
    lines.append("}")
    return lines


def format_file(
    fusion: Fusion,
    *,
    header: Iterable[str] = (),
    extra_imports: Iterable[str] = (),
    extra_body: Sequence[str] = (),
    input_shapes: dict[str, Sequence[int]] | None = None,
    device: str = "cuda:0",
    preamble: Iterable[str] = (),
    notes: dict[str, str] | None = None,
) -> str:
    """A whole dump: header comments, imports, ``nvtp_info``, the definition, and how to run it.

    ``input_shapes`` overrides the example shapes of the ``inputs`` list (a sharded fusion's
    per-rank shards); ``preamble`` lines go before ``inputs`` (e.g. picking the rank's device).
    """
    input_shapes = input_shapes or {}
    out = [f"# {line}" if line else "#" for line in header]
    out.append("import torch")
    out.append("from nvfuser_direct import FusionDefinition, DataType")
    out.extend(extra_imports)
    out.append("")
    if fusion.info or fusion.attrs:
        out.extend(format_info(fusion))
        out.append("")
    comments = {}
    for name, info in fusion.info.items():
        note = info.role + (f" {info.label}" if info.label else "") + (f" (forward {info.source})" if info.source else "")
        comments[name] = note
    comments.update(notes or {})
    if any(op.kind in composites.COMPOSITES for op in fusion.ops):  # written with nvFuser's ops, verbatim
        out.append(composites.source())
    out.append(format_definition(fusion, extra_body, comments))
    out.append("with FusionDefinition() as fd:")
    out.append(f"{INDENT}{fusion.name}(fd)")
    out.append("")
    preamble = list(preamble)
    out.extend(preamble)
    if preamble:
        out.append("")
    out.append("inputs = [")
    for op in fusion.ops:
        if op.kind == "define_tensor" or (op.kind == "define_scalar" and op.arg("value") is None):
            out.append(f"{INDENT}{format_input_example(op, device, input_shapes.get(op.outputs[0].name))},")
    out.append("]")
    out.append("fd.execute(inputs)")
    return "\n".join(out) + "\n"


def tensor_summary(v: TensorValue) -> str:
    return v.describe()


FORMAT["op"], FORMAT["fusion"] = format_op, format_definition
