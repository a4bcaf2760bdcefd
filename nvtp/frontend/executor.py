"""nvtp's Thunder executor: claims the ops of a trace and fuses them into nvtp fusions.

It is a ``thunder.extend.FusionExecutor`` like Thunder's nvFuser and torch.compile executors:
``fusion_pass`` groups the claimable bound symbols (via Thunder's data-dependent partitioner),
``fuse`` flattens each group to prims and translates them (``translate.TRANSLATORS``) into one
``Fusion``. Unlike Thunder's nvFuser executor it claims tensors on any device, so a CPU trace of
a transformer block fuses into one forward and one backward fusion.

The fusion's callable runs through a ``Runtime``: the reference backend by default, or the
sharded runtime of ``nvtp.jit``. The runtime in effect when Thunder compiles is the one the
callable keeps (``use_runtime``), so forward and backward of one jitted module share it.

Bound symbols the executor cannot claim stay in the trace for Thunder's other executors; each
one is recorded in ``Runtime.unclaimed`` with its source line, never dropped silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from thunder.core import prims, utils
from thunder.core.dtypes import is_complex_dtype
from thunder.core.prims import PrimIDs
from thunder.core.proxies import NumberProxy, Proxy, TensorProxy, unvariableify, variableify
from thunder.core.pytree import tree_flatten
from thunder.core.rematerialization import rematerialize
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace
from thunder.core.transform_common import dce
from thunder.executors.passes import update_fusion_call_ctx
from thunder.executors.utils import Region
from thunder.extend import FusionExecutor, register_executor
from thunder.executors.data_dependent_partition import Node, fuse_bound_symbols
from thunder.torch import _torch_to_thunder_function_map as thunder_of
import thunder.torch as ltorch

from nvtp.frontend import attention, extremes, interpret, moe, setitem
from nvtp.frontend.translate import CHECKS, COMPLEX_OK, TRANSLATORS, input_type, supports_dtype, to_dtype
from nvtp.ir.build import FusionBuilder, make_op
from nvtp.ir.graph import Fusion, TensorValue, ValueInfo
from nvtp.ir.simplify import common_subexpressions, fold_casts, unpad_gathers
from nvtp.ir.verify import verify
from nvtp.execute import reference
import nvtp


@dataclass
class Unclaimed:
    """An operation left to Thunder's other executors, with where it came from."""

    name: str
    source: str

    def __str__(self) -> str:
        return f"{self.name} ({self.source})" if self.source else self.name


class Runtime:
    """Runs fusion callables. The base class runs the reference backend on one device."""

    def __init__(self):
        self.fusions: list["FusionCallable"] = []
        self.unclaimed: list[Unclaimed] = []
        self.seed_generator: torch.Generator | None = None

    def next_seed(self) -> int:
        """A seed for one execution's random ops, drawn from torch's RNG so ``torch.manual_seed`` governs it."""
        return int(torch.randint(0, 2**62, (1,), generator=self.seed_generator).item())

    def run(self, fc: "FusionCallable", args: Sequence[Any]) -> tuple:
        if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args):
            return fc.meta_outputs()
        outs = reference.run(fc.fusion, args, seed=self.next_seed())
        return tuple(outs)


_RUNTIME: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("nvtp_runtime", default=None)
_DEFAULT_RUNTIME = Runtime()


@contextlib.contextmanager
def use_runtime(runtime: Runtime):
    """Fusions that Thunder compiles inside this block run through ``runtime``."""
    token = _RUNTIME.set(runtime)
    try:
        yield runtime
    finally:
        _RUNTIME.reset(token)


def current_runtime() -> Runtime:
    return _RUNTIME.get() or _DEFAULT_RUNTIME


_REMATERIALIZE: contextvars.ContextVar[bool] = contextvars.ContextVar("nvtp_rematerialize", default=True)


@contextlib.contextmanager
def rematerializing(on: bool):
    """Whether the fusion pass inside this block lets Thunder's rematerialization move forward
    values into the backward (recomputed there from others the forward saves). A pipeline's trace
    turns it off: recomputing Gemma 2's residual stream from every block's saved pieces put a
    stage's forward values in another stage's backward (``StageError``)."""
    token = _REMATERIALIZE.set(on)
    try:
        yield
    finally:
        _REMATERIALIZE.reset(token)


@dataclass
class FusionCallable:
    """What Thunder calls for an nvtp fusion: ``nvtpFusion0(*inputs) -> outputs``."""

    fusion: Fusion
    input_proxies: tuple[str, ...]
    output_proxies: tuple[str, ...]
    runtime: Runtime
    build_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def __call__(self, *args):
        outs = self.runtime.run(self, args)
        return outs

    def meta_outputs(self) -> tuple:
        outs = []
        for v in self.fusion.outputs:
            if isinstance(v, TensorValue):
                outs.append(torch.empty(v.shape, dtype=v.dtype.torch, device="meta"))
            else:
                outs.append(0)
        return tuple(outs)

    def __repr__(self) -> str:
        return f"<nvtp fusion {self.fusion.name}: {len(list(self.fusion.compute_ops()))} ops>"


def _source(bsym: BoundSymbol) -> str:
    if bsym.source_filename and bsym.source_positions is not None:
        return f"{bsym.source_filename}:{bsym.source_positions.lineno}"
    return bsym.source_filename or ""


_BOOKKEEPING = {
    PrimIDs.RETURN, PrimIDs.DEL, PrimIDs.COMMENT, PrimIDs.PRINT, PrimIDs.UNPACK_TRIVIAL, PrimIDs.UNPACK_SEQUENCE,
    PrimIDs.UNPACK_KEY, PrimIDs.UNPACK_ATTR, PrimIDs.UNPACK_TUPLE, PrimIDs.UNPACK_LIST, PrimIDs.UNPACK_EMPTY_DICT,
    PrimIDs.CONSTRUCT_TUPLE, PrimIDs.PACK_LIST, PrimIDs.GET_GRAD, PrimIDs.PUT_GRAD, PrimIDs.SINK,
}


def _is_bookkeeping(bsym: BoundSymbol) -> bool:
    if bsym.sym.id in _BOOKKEEPING or bsym.sym.name in ("clear_mutable_collection", "python_del", "unpack_sequence"):
        return True
    return not any(isinstance(p, TensorProxy) for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs))


def _tensors_supported(*args, complex_ok: bool = False) -> bool:
    flat, _ = tree_flatten((args,))
    for x in flat:
        if isinstance(x, TensorProxy):
            if x.device.type not in ("cpu", "cuda", "meta") or not supports_dtype(x.dtype):
                return False
            if is_complex_dtype(x.dtype) and not complex_ok:  # complex reaches a fusion only as a pair input
                return False
    return True


def _checker(extra, complex_ok: bool = False):
    def check(*args, **kwargs) -> bool:
        return _tensors_supported(args, kwargs, complex_ok=complex_ok) and (extra is None or bool(extra(*args, **kwargs)))

    return check


class NvtpExecutor(FusionExecutor):
    """Thunder executor that fuses whole regions of a trace into nvtp fusions."""

    def __init__(self):
        super().__init__("nvtp", version=nvtp.__version__)
        for prim_id in TRANSLATORS:
            check = CHECKS.get(prim_id)
            self.register_supported(prim_id, _checker(check, complex_ok=prim_id in COMPLEX_OK))
        extremes.register(self)  # amax/amin: torch's gradient, not Thunder's
        attention.register(self)
        moe.register(self)
        # Thunder calls _getitem, with proxies, in place of x[key] (the tensor's, or its proxy's, while tracing).
        self._lookasides.update({torch.Tensor.__getitem__: _getitem, TensorProxy.__getitem__: _getitem})
        # x.bool() and its kin, which Thunder runs only opaquely, as x.to(dtype) (the FX route: fx._METHOD_DECOMPOSITIONS)

        for method, dtype in _CONVERSIONS.items():  # the method, and the symbol a proxy's attribute resolves to
            self._lookasides.update({m: _converter(dtype) for m in (method, thunder_of.get(method)) if m is not None})
        self._lookasides.update(interpret.lookasides())  # nn.MultiheadAttention, torch.minimum, transformers' collector (interpret.py)

    def can_execute_or_fuse(self, bsym: BoundSymbol) -> bool:
        # Thunder asks this before using an executor's grad transform; for ops claimed with a
        # checker (attention) the checker must decide, not whether the decomposition fuses.
        if bsym.sym.id in attention.CHECKED:
            return self.can_execute(bsym)
        return super().can_execute_or_fuse(bsym)

    def get_fuel(self, amount: int = 1, /) -> bool:
        return True

    def set_fuel(self, value) -> None:
        pass

    # -- fusion pass --------------------------------------------------------------------------

    def fusion_pass(self, trace: TraceCtx) -> TraceCtx:
        fresh, why = setitem.fresh_targets(trace)  # copy_ claimed only into tensors no one else sees
        with setitem.writable(fresh):
            return self._fusion_pass(trace, why)

    def _fusion_pass(self, trace: TraceCtx, why: dict[str, str]) -> TraceCtx:
        start = time.perf_counter_ns()
        runtime = current_runtime()
        fused: TraceCtx = from_trace(trace)
        producers, consumers = utils.producers_and_consumers(trace)

        def can_fuse(n: Node) -> bool:
            return len(n.group_bsyms) > 1 or self.can_fuse(n.group_bsyms[0])

        groups = fuse_bound_symbols(trace, lambda a, b: can_fuse(a) and can_fuse(b))
        bsyms: list[BoundSymbol] = []
        counter = 0
        for group in groups:
            if len(group) == 1 and not self.can_fuse(group[0]):
                bsym = group[0]
                if not _is_bookkeeping(bsym) and not bsym.sym.is_fusion:
                    target = getattr(bsym.args[1], "name", None) if bsym.sym.name == "copy_" else None
                    name = f"{bsym.sym.name} ({why[target]})" if target in why else bsym.sym.name
                    runtime.unclaimed.append(Unclaimed(name, _source(bsym)))
                bsyms.append(bsym)
                continue
            if all(_is_bookkeeping(b) for b in group):
                bsyms.extend(group)
                continue
            bsyms.append(self.fuse(Region(producers, consumers, group), counter))
            counter += 1
        fused.bound_symbols = bsyms
        if _REMATERIALIZE.get():
            fused = rematerialize(fused)
        fused = dce(fused)
        fused = update_fusion_call_ctx(fused)
        elapsed = (time.perf_counter_ns() - start) // 1_000_000
        fused.set_provenance(TraceProvenance(f"nvtp fusion pass (took {elapsed} milliseconds)"))
        return fused

    def flatten(self, bsym: BoundSymbol) -> list[BoundSymbol]:
        if self.can_execute(bsym):
            return [bsym]
        out: list[BoundSymbol] = []
        for sub in bsym.subsymbols:
            out.extend(self.flatten(sub))
        return out

    def fuse(self, region: Region, fusion_counter: int) -> BoundSymbol:
        start = time.perf_counter()
        inputs: list[Proxy] = [unvariableify(x) for x in region.inputs]
        outputs: list[Proxy] = [unvariableify(x) for x in region.outputs]
        flat: list[BoundSymbol] = []
        for bsym in region.bound_symbols:
            flat.extend(self.flatten(bsym))
        flat = _dce(inputs, outputs, flat)
        fusion = translate_region(f"nvtpFusion{fusion_counter}", inputs, outputs, flat)
        runtime = current_runtime()
        fc = FusionCallable(fusion, tuple(p.name for p in inputs), tuple(p.name for p in outputs), runtime,
                            time.perf_counter() - start)
        runtime.fusions.append(fc)
        return self.register_temporary_operation(f"nvtpFusion{fusion_counter}", fc, inputs=inputs, outputs=outputs, bsyms=flat)


def _dce(inputs: list[Proxy], outputs: list[Proxy], bsyms: list[BoundSymbol]) -> list[BoundSymbol]:
    """Drop ops whose results are unused, and inputs nothing reads (as Thunder's nvFuser executor does)."""
    trace = TraceCtx(None)
    trace.bound_symbols = list(bsyms) + [prims.python_return.bind(outputs, output=None)]
    needed: set = set()
    trace = dce(trace, needed)
    inputs[:] = [x for x in inputs if variableify(x) in needed]
    return [b for b in trace.bound_symbols if b.sym.id != PrimIDs.RETURN]


def translate_region(name: str, inputs: Sequence[Proxy], outputs: Sequence[Proxy], bsyms: Sequence[BoundSymbol]) -> Fusion:
    """Build the nvtp fusion of a region: its inputs, its ops (translated prim by prim) and outputs."""
    b = FusionBuilder(name)
    env: dict[str, Any] = {}
    for p in inputs:
        if isinstance(p, TensorProxy):
            shape, dtype = input_type(p)  # a complex input is its real pair [*s, 2] (nvtp/frontend/complex.py)
            env[p.name] = b.define_tensor(shape, dtype, info=ValueInfo("input", p.name))
        elif isinstance(p, NumberProxy):
            env[p.name] = b.define_scalar(None, to_dtype(p.python_type))
        else:
            raise TypeError(f"unsupported fusion input {p!r}")

    def lookup(x: Any) -> Any:
        if isinstance(x, Proxy):
            if x.name in env:
                return env[x.name]
            if isinstance(x, NumberProxy) and x.value is not None:
                return x.value
            raise KeyError(f"{x.name} is used before it is defined in the fusion")
        if isinstance(x, (list, tuple)):
            return type(x)(lookup(e) for e in x)
        return x

    for bsym in bsyms:
        fn = TRANSLATORS.get(bsym.sym.id)
        if fn is None:
            raise NotImplementedError(f"nvtp has no translation for {bsym.sym.name}")
        args = [lookup(a) for a in bsym.args]
        kwargs = {k: lookup(v) for k, v in bsym.kwargs.items()}
        result = fn(b, *args, **kwargs)
        outs = [o for o in (bsym.output if isinstance(bsym.output, (tuple, list)) else (bsym.output,))]
        results = result if isinstance(result, tuple) else (result,)
        if len(outs) != len(results):
            raise AssertionError(f"{bsym.sym.name}: {len(outs)} outputs, translator gave {len(results)}")
        for o, r in zip(outs, results):
            if isinstance(o, Proxy):
                env[o.name] = _match_dtype(b, r, o)

    for p in outputs:
        v = env[p.name]
        if not hasattr(v, "name"):
            v = b.op("full", [], v, to_dtype(type(v)))  # a constant result
        b.add_output(v)
    fusion = common_subexpressions(unpad_gathers(fold_casts(b.build())))
    return verify(_outputs_are_results(fusion))


def _outputs_are_results(fusion: Fusion) -> Fusion:
    """nvFuser outputs are values the fusion computes: an output that is an input gets a ``set``."""
    inputs = {v.name for v in fusion.inputs}
    taken = set(fusion.values)
    ops, outputs = list(fusion.ops), []
    for v in fusion.outputs:
        if v.name in inputs:
            k = len(taken)
            while f"T{k}" in taken:
                k += 1
            op = make_op("set", (v,), {}, [f"T{k}"])
            taken.add(f"T{k}")
            ops.append(op)
            v = op.outputs[0]
        outputs.append(v)
    return fusion.with_ops(tuple(ops), tuple(outputs))


def _match_dtype(b: FusionBuilder, value: Any, proxy: Proxy) -> Any:
    """Cast when nvFuser's type promotion would differ from Thunder's (e.g. where on two numbers)."""
    if isinstance(proxy, TensorProxy) and isinstance(value, TensorValue):
        want = to_dtype(proxy.dtype)
        if value.shape != tuple(proxy.shape):
            raise AssertionError(f"{proxy.name}: nvtp inferred shape {list(value.shape)}, Thunder has {list(proxy.shape)}")
        if value.dtype != want:
            return b.op("cast", value, dtype=want)
    return value


def one_index_as_slice(index: Any) -> Any:
    """``x[:, [k], :]``, a list of one int as the only advanced index: the slice ``k:k+1`` (the same
    values, the axis kept; nanoGPT's ``x[:, [-1], :]``), which Thunder traces as a slice, not as a
    gather from an index tensor it makes. Any other index is returned as it is (with two lists,
    ``x[[0], [1]]``, indexing pairs them up, which slices would not)."""
    items = index if isinstance(index, tuple) else (index,)
    advanced = [i for i in items if isinstance(i, (list, torch.Tensor, TensorProxy))]
    if len(advanced) != 1 or not isinstance(advanced[0], list) or len(advanced[0]) != 1 or type(advanced[0][0]) is not int:
        return index
    k = advanced[0][0]
    one = slice(k, k + 1 if k != -1 else None)
    return tuple(one if i is advanced[0] else i for i in items) if isinstance(index, tuple) else one


def _getitem(a: Any, key: Any) -> Any:
    """``a[key]`` as Thunder's own ``getitem``, a one-element list index written as a slice first."""
    return ltorch.getitem(a, one_index_as_slice(key))


_CONVERSIONS = {torch.Tensor.bool: torch.bool, torch.Tensor.int: torch.int32, torch.Tensor.double: torch.float64,
                torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.byte: torch.uint8, torch.Tensor.char: torch.int8}


def _converter(dtype: torch.dtype):
    def convert(a: Any, memory_format: Any = None) -> Any:
        return ltorch.to(a, dtype)

    return convert


_EXECUTOR: NvtpExecutor | None = None


def executor() -> NvtpExecutor:
    """The nvtp executor, registered with Thunder on first use."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = NvtpExecutor()
        register_executor(_EXECUTOR)
    return _EXECUTOR
