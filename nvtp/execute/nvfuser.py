"""The nvFuser backend: turn an nvtp ``Fusion`` into a real ``nvfuser_direct.FusionDefinition``
and, on a CUDA machine, execute it.

Emission is one call per op. Most ops need no knowledge beyond the op table: the generic emitter
calls ``fd.ops.<kind>`` with the spec's first ``positional`` arguments positionally and the rest
as keywords, leaving out keywords that are None (nvFuser's way of saying "not given"; several of
its overloads reject an explicit None). Ops that need more get an entry in ``EMITTERS``.

``compare_definition`` checks that what nvFuser built is nvtp's fusion: inputs, outputs, and the
dataflow between the nvFuser values that stand for nvtp's values (see its docstring).

``nvfuser_direct`` is imported lazily, so the rest of nvtp never needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence
import ast
import sys

import torch

from nvtp.ir import composites, ops as opstable
from nvtp.ir.dtypes import DType, as_input, promote
from nvtp.ir.graph import Fusion, Op, ScalarValue, TensorValue, Value, is_value
from nvtp.ir.printer import strides_for
from nvtp.registry import registrar
from nvtp.ir.parser import parse
from nvtp.sharding.placements import local_shape
from nvtp.sharding.schedule import schedule_steps

if TYPE_CHECKING:  # pragma: no cover
    import nvfuser_direct

    from nvtp.ir.graph import ScheduleStep
    from nvtp.sharding.sharded import ShardedFusion


class NvFuserError(RuntimeError):
    """nvFuser could not build (or run) a fusion; names the op and says what to do."""


# The attribute of a FusionDefinition built here that maps nvtp value names to nvFuser values.
VALUES_ATTR = "nvtp_values"

NO_GPU_MESSAGE = (
    "nvFuser execution needs a CUDA GPU, and torch sees none on this machine; "
    "build_definition() still works here, and `--backend reference` (nvtp.execute.reference) runs anywhere"
)

# An emitter gets the FusionDefinition, the op, and its arguments with nvtp values replaced by
# nvFuser values, tuples by lists and DTypes by DataTypes; it returns one nvFuser value or a
# tuple of them (one per result of the op).
Emitter = Callable[["nvfuser_direct.FusionDefinition", Op, dict[str, Any]], Any]
EMITTERS: dict[str, Emitter] = {}


emitter = registrar(EMITTERS, "nvFuser emitter")


def data_type(dt: DType) -> "nvfuser_direct.DataType":
    """nvtp's ``DType`` as nvFuser's ``DataType`` (they share names)."""
    from nvfuser_direct import DataType  # optional: nvfuser_direct (the nvFuser backend only)

    return getattr(DataType, dt.value)


def emit_generic(fd, op: Op, args: dict[str, Any]):
    """``fd.ops.<kind>(positional..., keyword=...)``, keywords that are None left out."""
    s = opstable.spec(op.kind)
    fn = getattr(fd.ops, op.kind, None)
    if fn is None:
        raise NvFuserError(
            f"nvFuser's Python API (nvfuser_direct {_version()}) has no fd.ops.{op.kind}; "
            f"add an emitter for {op.kind} to EMITTERS in nvtp/execute/nvfuser.py"
        )
    positional = [args[p.name] for p in s.params[: s.positional]]
    keywords = {p.name: args[p.name] for p in s.params[s.positional:] if args[p.name] is not None}
    return fn(*positional, **keywords)


# ---------------------------------------------------------------------------------------------
# ops that need more than the generic call


@emitter("define_tensor")
def _define_tensor(fd, op: Op, a):
    # Not through fd.ops; contiguity and stride_order None mean nvFuser's defaults.
    optional = {k: a[k] for k in ("contiguity", "stride_order") if a[k] is not None}
    return fd.define_tensor(shape=a["shape"], dtype=a["dtype"], is_cpu=a["is_cpu"], **optional)


@emitter("define_scalar")
def _define_scalar(fd, op: Op, a):
    # value None declares a symbolic input. The dtype is always given: without one nvFuser
    # makes True an Int, where nvtp (and Python) see a Bool.
    return fd.define_scalar(a["value"], dtype=data_type(op.outputs[0].dtype))


@emitter(*sorted(opstable.REDUCTION))
def _reduction(fd, op: Op, a):
    # nvtp's dims=None means every axis; nvFuser's overloads without dims take no keepdim.
    if a["dims"] is None:
        a = {**a, "dims": list(range(op.operands[0].ndim))}
    return emit_generic(fd, op, a)


@emitter("sdpfa_bwd")
def _sdpfa_bwd(fd, op: Op, a):
    # nvFuser's sdpfa_bwd has no defaults: every argument, None included, must be passed.
    s = opstable.spec(op.kind)
    positional = [a[p.name] for p in s.params[: s.positional]]
    return fd.ops.sdpfa_bwd(*positional, **{p.name: a[p.name] for p in s.params[s.positional:]})


@emitter("slice")
def _slice(fd, op: Op, a):
    # nvFuser 0.2.36 accepts a `strides` argument but only stride 1 ("All slice operation strides
    # must be of const size 1"); say so in nvtp's terms instead of failing deep inside nvFuser.
    strides = a["strides"]
    if strides is not None and any(st != 1 for st in strides):
        raise NvFuserError(
            f"{op}: nvFuser supports only slices with stride 1, this one has strides {list(strides)}; "
            "slice with stride 1 and reshape/slice again, or run it with the reference backend"
        )
    return emit_generic(fd, op, a)


@emitter(*sorted(composites.COMPOSITES))
def _composite(fd, op: Op, a):
    # nvtp's ops nvFuser lacks, written with nvFuser's ops (the same code a dump carries)
    s = opstable.spec(op.kind)
    return getattr(composites.nvtp_ops, op.kind)(fd, *(a[p.name] for p in s.params))


# ---------------------------------------------------------------------------------------------
# building


def _version() -> str:
    try:
        import nvfuser_direct  # optional: nvfuser_direct (the nvFuser backend only)

        return str(nvfuser_direct.version())
    except Exception:  # noqa: BLE001 - only for messages
        return "?"


def _first_line(e: BaseException) -> str:
    """nvFuser's C++ errors carry a stack dump; the first lines say what went wrong."""
    text = str(e).split("\nException raised from", 1)[0].strip()
    return " ".join(line.strip() for line in text.splitlines()[:6])


# Parameter kinds (ops.Param.kind) that nvFuser takes as a Val: Python numbers there become
# constants, as Thunder's nvFuser executor makes them (several overloads, e.g. embedding_fwd's
# padding_idx or scatter's scalar src, accept only a Val).
SCALAR_KINDS = {"operand", "scalar", "scalar?"}


def _to_nvfuser(fd, x: Any, kind: str, values: dict[str, Any]) -> Any:
    if is_value(x):
        return values[x.name]
    if isinstance(x, DType):
        return data_type(x)
    if isinstance(x, tuple):
        return [_to_nvfuser(fd, e, kind, values) for e in x]
    if kind in SCALAR_KINDS and isinstance(x, (bool, int, float, complex)):
        return fd.define_scalar(x, dtype=data_type(promote(x)))  # nvFuser alone would make True an Int
    return x


def _emit(fd, op: Op, values: dict[str, Any]) -> None:
    fn = EMITTERS.get(op.kind, emit_generic)
    s = opstable.spec(op.kind)
    args = {p.name: _to_nvfuser(fd, v, p.kind, values) for p, (_, v) in zip(s.params, op.args)}
    try:
        result = fn(fd, op, args)
    except NvFuserError:
        raise
    except Exception as e:  # name the op in IR syntax, keep nvFuser's message and the cause
        raise NvFuserError(
            f"nvFuser rejected `{op}`: {type(e).__name__}: {_first_line(e)}\n"
            f"(if nvFuser needs this op called differently, add an emitter for {op.kind} to EMITTERS in nvtp/execute/nvfuser.py)"
        ) from e
    results = result if isinstance(result, (tuple, list)) else (result,)
    if len(results) != len(op.outputs):
        raise NvFuserError(
            f"fd.ops.{op.kind} gave {len(results)} result(s) in nvFuser, nvtp's `{op}` expects {len(op.outputs)}; "
            f"fix the emitter for {op.kind} in EMITTERS (nvtp/execute/nvfuser.py) or the op table (nvtp/ir/ops/)"
        )
    for v, r in zip(op.outputs, results):
        values[v.name] = r


def build_definition(fusion: Fusion, schedule: Sequence["ScheduleStep"] = ()) -> "nvfuser_direct.FusionDefinition":
    """An ``nvfuser_direct.FusionDefinition`` holding ``fusion``; works without a GPU.

    Requires a verified fusion whose outputs are tensors (nvFuser has no scalar outputs).
    Ensures the definition's inputs and outputs are ``fusion``'s, in order, and records on it
    (``fd.nvtp_values``) which nvFuser value stands for each nvtp value, for ``compare_definition``.
    ``schedule`` (``schedule_steps(sharded)``, or a parsed dump's) is applied after the outputs, as nvFuser's
    multidevice tests do: meshes (1-D or 2-D), splits and ``mesh_x`` / ``mesh_y`` parallelization.
    """
    from nvfuser_direct import FusionDefinition  # optional: nvfuser_direct (the nvFuser backend only)

    for v in fusion.outputs:
        if not isinstance(v, TensorValue):
            raise NvFuserError(
                f"{fusion.name}: output {v.describe()} is a scalar, and nvFuser fusions output only tensors; "
                "turn it into a tensor inside the fusion (e.g. fd.ops.full([], value, dtype)) or drop the output"
            )
    values: dict[str, Any] = {}
    error: BaseException | None = None
    # FusionDefinition.__exit__ prints any exception that passes through it; keep ours inside.
    with FusionDefinition() as fd:
        try:
            for op in fusion.ops:
                _emit(fd, op, values)
            for v in fusion.outputs:
                fd.add_output(values[v.name])
            for step in schedule:
                _apply_step(step, values)
        except Exception as e:  # noqa: BLE001 - re-raised below, outside the with block
            error = e
    if error is not None:
        if isinstance(error, NvFuserError):
            raise error
        raise NvFuserError(f"{fusion.name}: nvFuser rejected the outputs: {type(error).__name__}: {_first_line(error)}") from error
    setattr(fd, VALUES_ATTR, values)
    return fd


def build_from_text(text: str, path: str | None = None) -> "nvfuser_direct.FusionDefinition":
    """The ``FusionDefinition`` nvFuser itself builds from a dump's text, as a user runs the file.

    ``nvtp.ir.parser.parse`` first checks the file (it refuses anything but imports of torch and
    nvfuser_direct, the definition function and nvFuser's run scaffolding, with file:line); then
    only the file's imports and function definitions are executed, and each definition function
    that takes ``fd`` is called inside ``with FusionDefinition() as fd:``. No nvtp code builds
    anything: what nvFuser holds is what the text says. The function's local variables (``T0``,
    ``S3``, ...: nvFuser's values by the file's names) are recorded as ``fd.nvtp_values``, so
    ``compare_definition(parse(text).fusion, fd)`` compares nvFuser's reading with nvtp's.
    Raises ``DumpError`` for a file nvtp refuses, ``NvFuserError`` naming the line nvFuser rejects.
    """
    from nvfuser_direct import FusionDefinition  # optional: nvfuser_direct (the nvFuser backend only)

    filename = path or "<dump>"
    parse(text, path)
    tree = ast.parse(text, filename)
    kept = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef))
            or (isinstance(n, ast.ClassDef) and n.name == composites.NAME)]  # verbatim nvtp's (checked by parse)
    namespace: dict[str, Any] = {"__name__": "nvtp_dump"}
    exec(compile(ast.Module(body=kept, type_ignores=[]), filename, "exec"), namespace)  # noqa: S102 - checked by parse above
    defs = [n.name for n in kept if isinstance(n, ast.FunctionDef) and n.args.args and n.args.args[0].arg == "fd"]
    codes = {namespace[name].__code__ for name in defs}
    values: dict[str, Any] = {}

    def record_locals(frame, event, arg):  # the definition's locals as it returns
        if event == "return" and frame.f_code in codes:
            values.update((k, v) for k, v in frame.f_locals.items() if k != "fd")

    error: BaseException | None = None
    previous = sys.getprofile()
    with FusionDefinition() as fd:  # its __exit__ prints any exception passing through: keep ours inside
        sys.setprofile(record_locals)
        try:
            for name in defs:
                namespace[name](fd)
        except Exception as e:  # noqa: BLE001 - re-raised below with the line nvFuser rejected
            error = e
        finally:
            sys.setprofile(previous)
    if error is not None:
        tb = error.__traceback__
        line = None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == filename:
                line = tb.tb_lineno
            tb = tb.tb_next
        where = f"{filename}:{line}" if line else filename
        source = text.splitlines()[line - 1].strip() if line else ""
        raise NvFuserError(f"{where}: nvFuser rejects `{source}`: {type(error).__name__}: {_first_line(error)}") from error
    setattr(fd, VALUES_ATTR, values)
    return fd


def _apply_step(step: "ScheduleStep", values: dict[str, Any]) -> None:
    """One device-schedule call (``nvtp.ir.graph.ScheduleStep``) on the tensor it names."""
    import nvfuser_direct  # optional: nvfuser_direct (the nvFuser backend only)

    tv = values.get(step.tensor)
    if tv is None:
        raise NvFuserError(f"schedule step {step} names {step.tensor}, which the fusion does not define")
    try:
        if step.kind == "mesh":  # devices nested by the mesh's shape on a mesh of several axes
            nested = bool(step.args) and isinstance(step.args[0], tuple)
            devices = torch.tensor(step.args) if nested else list(step.args)
            tv.set_device_mesh(nvfuser_direct.multidevice.DeviceMesh(devices))
        elif step.kind == "split":
            axis, factor, inner = step.args
            (tv.inner_split if inner else tv.outer_split)(axis, factor)
        elif step.kind == "parallelize":
            axis, ptype = step.args
            tv.axis(axis).parallelize(getattr(nvfuser_direct.ParallelType, ptype))
        else:
            raise NvFuserError(f"unknown schedule step kind {step.kind!r} in {step}; nvtp/execute/nvfuser.py knows mesh, split, parallelize")
    except NvFuserError:
        raise
    except Exception as e:  # noqa: BLE001 - named and re-raised
        raise NvFuserError(f"nvFuser rejected schedule step {step}: {type(e).__name__}: {_first_line(e)}") from e


# ---------------------------------------------------------------------------------------------
# execution


def prepare_inputs(fusion: Fusion, inputs: Sequence[Any], device: torch.device | str) -> list[Any]:
    """``inputs`` on ``device`` with the dtype and memory layout each ``define_tensor`` declares."""
    fusion_inputs = [op for op in fusion.ops if op.kind == "define_tensor" or (op.kind == "define_scalar" and op.arg("value") is None)]
    if len(inputs) != len(fusion_inputs):
        raise NvFuserError(f"{fusion.name} takes {len(fusion_inputs)} inputs, got {len(inputs)}")
    prepared: list[Any] = []
    for op, x in zip(fusion_inputs, inputs):
        v = op.outputs[0]
        if isinstance(v, ScalarValue):
            prepared.append(x.item() if isinstance(x, torch.Tensor) else x)
            continue
        x = as_input(x, v.shape, v.dtype)  # a complex tensor for a real pair input: its view_as_real
        if not isinstance(x, torch.Tensor):
            raise NvFuserError(f"input {v.describe()} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != v.shape or x.dtype != v.dtype.torch:
            raise NvFuserError(f"input {v.describe()} got a tensor of shape {list(x.shape)} and dtype {x.dtype}")
        if not op.arg("is_cpu"):
            x = x.to(device)
        want = strides_for(v.shape, op.arg("stride_order"))
        if not _same_layout(x, want):
            x = torch.empty_strided(v.shape, want, dtype=x.dtype, device=x.device).copy_(x)
        prepared.append(x)
    return prepared


def _same_layout(x: torch.Tensor, strides: Sequence[int]) -> bool:
    # Size-1 axes may have any stride.
    return all(n == 1 or s == w for n, s, w in zip(x.shape, x.stride(), strides))


def execute(fusion: Fusion, inputs: Sequence[Any], *, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """Run ``fusion`` with nvFuser on a CUDA device (default: the current one) and return its outputs.

    CPU tensors are moved to the device and laid out as their ``define_tensor`` says. Raises
    ``RuntimeError`` at once on a machine without a CUDA GPU.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(NO_GPU_MESSAGE)
    device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
    fd = build_definition(fusion)
    prepared = prepare_inputs(fusion, inputs, device)
    return as_declared(fusion, list(fd.execute(prepared, device=device)))


def as_declared(fusion: Fusion, outputs: list[Any]) -> list[Any]:
    """``outputs`` with every integer tensor in the dtype ``fusion`` declares it.

    nvFuser types welford's count with the kernel's index type, which is int32 whenever the
    indexing fits (seen on an H100: ``T3: Int[2, 16]`` came out torch.int32); nvtp, like
    Thunder, declares it Int (int64), so the count is widened here, where the value is exact.
    Any other mismatch is left for the caller's dtype check to report."""
    out = []
    for v, x in zip(fusion.outputs, outputs):
        if (isinstance(v, TensorValue) and isinstance(x, torch.Tensor) and v.dtype is DType.Int
                and x.dtype == torch.int32):
            x = x.to(torch.int64)
        out.append(x)
    return out


# ---------------------------------------------------------------------------------------------
# checking what nvFuser holds against nvtp's fusion

# nvFuser prints a non-constant scalar as <letter><number>; the letter is its kind of dtype.
_SCALAR_LETTER = {
    DType.Double: "d", DType.Float: "f", DType.Half: "f", DType.BFloat16: "f", DType.Int: "i", DType.Int32: "i",
    DType.UInt64: "i", DType.Bool: "b", DType.ComplexFloat: "c", DType.ComplexDouble: "c",
}


def _describe_nv(x: Any) -> str:
    if x.is_tensor():
        return f"{x.dtype().name}{_nv_shape(x)}"
    return f"scalar {x}"


def _nv_shape(tv: Any) -> list[int | str]:
    """A TensorView's logical shape (reduced axes dropped, expanded broadcasts at their expanded size)."""
    out: list[int | str] = []
    for extent in tv.shape():
        text = str(extent)
        out.append(int(text) if text.lstrip("-").isdigit() else text)
    return out


def _compare_value(where: str, v: Value, x: Any) -> str | None:
    """How nvFuser value ``x`` differs from nvtp value ``v`` (None: it does not)."""
    if isinstance(v, TensorValue):
        if not x.is_tensor():
            return f"{where}: nvtp has tensor {v.describe()}, nvFuser has {_describe_nv(x)}"
        shape, dtype = _nv_shape(x), x.dtype().name
        if dtype == "Index":
            dtype = "Int"  # nvFuser's index type (welford's count) runs as int64
        if shape != list(v.shape) or dtype != v.dtype.value:
            return f"{where}: nvtp has {v.describe()}, nvFuser has {dtype}{shape}"
        return None
    if x.is_tensor():
        return f"{where}: nvtp has {v.describe()}, nvFuser has tensor {_describe_nv(x)}"
    text = str(x)
    letter = _SCALAR_LETTER.get(v.dtype)
    if x.is_symbolic() and letter and text[:1].isalpha() and text[1:].isdigit() and text[0] != letter:
        return f"{where}: nvtp has {v.describe()}, nvFuser has scalar {text} of another dtype"
    return None


def _inputs(x: Any) -> list[Any]:
    out, i = [], 0
    while True:
        try:
            out.append(x.input(i))
        except IndexError:
            return out
        i += 1


def compare_definition(fusion: Fusion, fd: "nvfuser_direct.FusionDefinition") -> list[str]:
    """How the FusionDefinition ``fd`` (from ``build_definition``) differs from ``fusion``; [] if not at all.

    Compared, each difference one message naming the value or op:

    * inputs and outputs: the same number, and in order the same kind, shape and dtype, read
      from ``fd.fusion.inputs()`` / ``outputs()``;
    * every nvtp value: the nvFuser value built for it has nvtp's shape and dtype;
    * the dataflow, op by op: walking back from the nvFuser results of each nvtp op reachable from
      the outputs, the first values met that stand for nvtp values must be that op's operands
      (nvFuser may drop a constant scalar operand such as ``is_causal``), and each nvFuser
      expression reachable from the outputs must lie on such a walk, so none is unaccounted for.

    Expression counts are not compared one for one: nvFuser decomposes some ops into several
    (``var_mean`` into ``welford`` and a ``mul``, ``cat`` into ``pad``s and a ``cat``) and folds
    others into their operand (a ``reshape`` to the same shape); the walk per op compares what
    stays exact. An op computed wrongly from the right operands (``exp`` for ``log``) passes.
    """
    values = getattr(fd, VALUES_ATTR, None)
    if values is None:
        raise ValueError("compare_definition needs a FusionDefinition made by nvtp.execute.nvfuser.build_definition "
                         "(it records which nvFuser value stands for each nvtp value)")
    found: list[str] = []
    nv_fusion = fd.fusion
    for what, ours, theirs in (("input", fusion.inputs, nv_fusion.inputs()), ("output", fusion.outputs, nv_fusion.outputs())):
        if len(ours) != len(theirs):
            found.append(f"{fusion.name}: nvtp has {len(ours)} {what}s, nvFuser has {len(theirs)}")
        for i, (v, x) in enumerate(zip(ours, theirs)):
            diff = _compare_value(f"{what} {i} ({v.name})", v, x)
            if diff:
                found.append(diff)
    for op in fusion.ops:
        for v in op.outputs:
            x = values.get(v.name)
            if x is None:
                found.append(f"`{op}`: nvFuser has no value for {v.name}")
                continue
            diff = _compare_value(f"`{op}`", v, x)
            if diff:
                found.append(diff)
    found.extend(_compare_dataflow(fusion, nv_fusion, values))
    return found


def _compare_dataflow(fusion: Fusion, nv_fusion: Any, values: dict[str, Any]) -> list[str]:
    # Landmarks: the nvFuser values standing for nvtp tensors and non-constant scalars (constants
    # may be shared or made anew by nvFuser). One nvFuser value may stand for several nvtp values
    # when nvFuser folds an op (a reshape to the same shape returns its operand).
    producers = fusion.producers()
    constants = {op.outputs[0].name for op in fusion.ops if op.kind == "define_scalar" and op.arg("value") is not None}
    names: dict[int, list[str]] = {}
    keep_alive = list(values.values())  # ids stay valid while the wrappers live
    for name, x in values.items():
        if name not in constants and name in producers:
            names.setdefault(id(x), []).append(name)

    def walk(start: list[Any], stop_at_landmarks: bool) -> tuple[set[int], set[str]]:
        """The landmarks first met walking back from ``start``, and the expressions passed (by text)."""
        met: set[int] = set()
        exprs: set[str] = set()
        stack = list(start)
        while stack:
            x = stack.pop()
            e = x.definition()
            if e is None:
                continue
            key = str(e)
            if key in exprs:
                continue
            exprs.add(key)
            for y in _inputs(e):
                keep_alive.append(y)
                if stop_at_landmarks and id(y) in names:
                    met.add(id(y))
                else:
                    stack.append(y)
        return met, exprs

    def label(ids: set[int]) -> str:
        return ", ".join(sorted("/".join(names[i]) for i in ids))

    found: list[str] = []
    owned: set[str] = set()
    for op in _reachable_ops(fusion):
        results = [values[v.name] for v in op.outputs]
        operands = {id(values[v.name]) for v in op.operands if v.name not in constants}
        tensor_operands = {id(values[v.name]) for v in op.operands if isinstance(v, TensorValue)}
        if any(id(x) in operands for x in results):
            continue  # folded by nvFuser into its operand: no expression of its own
        met, exprs = walk(results, True)
        owned |= exprs
        # nvFuser may use a scalar operand at definition time (is_causal) rather than read it.
        missing, extra = (tensor_operands - met), (met - operands)
        if missing or extra:
            parts = ([f"does not read {label(missing)}"] if missing else []) + ([f"reads {label(extra)}, which nvtp's op does not"] if extra else [])
            found.append(f"`{op}`: in nvFuser it " + " and ".join(parts))
        if not exprs:
            found.append(f"`{op}`: nvFuser computes nothing for it")
    _, reachable = walk(list(nv_fusion.outputs()), False)
    for key in sorted(reachable - owned):
        found.append(f"nvFuser computes `{' '.join(key.split())}`, which no nvtp op accounts for")
    return found


def _reachable_ops(fusion: Fusion) -> list[Op]:
    """The compute ops the outputs depend on, in order."""
    live = {v.name for v in fusion.outputs}
    needed: list[Op] = []
    for op in reversed(fusion.ops):
        if any(v.name in live for v in op.outputs):
            live.update(v.name for v in op.operands)
            if op.kind not in ("define_tensor", "define_scalar"):
                needed.append(op)
    return list(reversed(needed))


def execute_sharded(sharded: "ShardedFusion", local_inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Run this rank's part of a sharded fusion with nvFuser's multidevice executor.

    One process per GPU, launched by ``mpirun`` or ``torchrun`` (nvFuser's Communicator reads
    their environment); ``local_inputs`` are this rank's shards. The definition is the fusion
    with its resharding ``set`` ops and its device schedule (``schedule_steps``, the data that
    ``nvtp shard`` prints). Raises at once without a GPU.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(NO_GPU_MESSAGE)
    import nvfuser_direct  # optional: nvfuser_direct (the nvFuser backend only)

    fd = build_definition(sharded.fusion, schedule_steps(sharded))
    rank = nvfuser_direct.multidevice.Communicator.instance().rank()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    prepared = []
    for v, x in zip(sharded.fusion.inputs, local_inputs):
        if isinstance(v, TensorValue):
            want = local_shape(v.shape, sharded.shardings[v.name], sharded.mesh)
            if tuple(x.shape) != tuple(want):
                raise NvFuserError(f"input {v.name} of rank {rank}: expected its shard {list(want)}, got {list(x.shape)}")
            x = x.to(device).contiguous()
        prepared.append(x)
    return list(fd.execute(prepared))
