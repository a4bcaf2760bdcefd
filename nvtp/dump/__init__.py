"""Dump fusions to files in nvFuser's Python format, and replay them.

``dump_model`` traces a model's block with Thunder (on meta tensors: nothing is computed, so a
GPT-3 layer dumps in seconds) and writes the forward and backward fusions. ``replay`` runs a
dump on random inputs shaped as the file records them and, with ``check``, compares every output
with an independent evaluation of the same fusion in eager PyTorch, float64 (``nvtp.dump.eager``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence
import time

import torch

from nvtp.ir.dtypes import DType
from nvtp.ir.graph import Fusion, Op, ScalarValue, TensorValue, is_value
from nvtp.ir.parser import Dump, DumpError, load, parse  # noqa: F401 - load: nvtp.dump.load reads a file
from nvtp.ir.printer import format_file, strides_for
from nvtp.dump import eager
from nvtp.errors import InputError
from nvtp.execute import reference
from nvtp.ir import ops as opstable
from nvtp.models import gpt
import nvtp

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
MODELS = ("nanogpt",)

# Relative error (2-norm of the difference over 2-norm of the float64 result) a fusion passes
# with, by the least precise floating-point type it computes in: errors of a wrong op are O(1),
# rounding errors of a bf16 fusion a few units of bf16's 2^-8 after a hundred ops.
TOLERANCE = {DType.Double: 1e-12, DType.Float: 1e-5, DType.Half: 5e-3, DType.BFloat16: 2e-2}
_PRECISION_ORDER = [DType.BFloat16, DType.Half, DType.Float, DType.Double]


def tolerance(fusion: Fusion) -> float:
    """The check's tolerance: that of the least precise float type any value of ``fusion`` has."""
    present = {v.dtype for op in fusion.ops for v in op.outputs}
    for dt in _PRECISION_ORDER:
        if dt in present:
            return TOLERANCE[dt]
    return TOLERANCE[DType.Float]


def _versions() -> str:
    import thunder  # lazy: loads Thunder; CLI file commands load this module without it

    return f"nvtp {nvtp.__version__}, Thunder {thunder.__version__}, torch {torch.__version__}"


def dump_name(model: str, config: str, dtype: torch.dtype, role: str) -> str:
    return f"{model}_{config}_{SHORT[dtype]}_{'fwd' if role == 'forward' else 'bwd'}.py"


def header(fusion: Fusion, command: str) -> list[str]:
    a = fusion.attrs
    return [
        f"{a.get('role', 'fusion')} fusion of {a.get('model', '?')} config {a.get('config', '?')} ({a.get('dtype', '?')}), "
        f"traced by Thunder with nvtp's executor ({_versions()}).",
        f"Regenerate: {command}",
        "Runs as is with nvfuser_direct on a CUDA GPU; `nvtp replay FILE --check` runs it anywhere.",
    ]


def trace_block(model: str, config_name: str, dtype: torch.dtype, *, dropout: float | None = None, device: str = "meta"):
    """The forward and backward fusions of one transformer block (``nvtp.driver.trace``; a block
    has no module boundary: its output is the next block's input)."""
    from nvtp import driver  # lazy: loads Thunder; CLI file commands load this module without it

    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; nvtp dumps: {', '.join(MODELS)}")
    overrides = {} if dropout is None else {"dropout": dropout}
    cfg = gpt.config(config_name, **overrides)
    with torch.device(device):
        block = gpt.Block(cfg).to(dtype)
    x = gpt.example_input(cfg, dtype=dtype, device=device)
    return driver.trace(block, (x,), regional=False, boundary=False), cfg


def dump_model(model: str, config_name: str, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
               dropout: float | None = None) -> tuple[Path, Path]:
    """Write ``<model>_<config>_<dtype>_{fwd,bwd}.py`` into ``out_dir``; returns their paths."""
    captured, cfg = trace_block(model, config_name, dtype, dropout=dropout)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    attrs = {"model": model, "config": config_name, "dtype": SHORT[dtype], "batch": str(cfg.batch),
             "seq_len": str(cfg.seq_len), "n_embd": str(cfg.n_embd), "n_head": str(cfg.n_head),
             "dropout": str(cfg.dropout)}
    command = f"nvtp dump --model {model} --config {config_name} --dtype {SHORT[dtype]} --out {out_dir}"
    if dropout is not None:
        command += f" --dropout {dropout}"
    fwd_name, bwd_name = dump_name(model, config_name, dtype, "forward"), dump_name(model, config_name, dtype, "backward")
    fwd = replace(captured.forward, name="nvfuser_fusion_id0", attrs={**captured.forward.attrs, **attrs, "role": "forward", "backward": bwd_name})
    paths = [out / fwd_name]
    (out / fwd_name).write_text(format_file(fwd, header=header(fwd, command)))
    if captured.backward is not None:
        bwd = replace(captured.backward, name="nvfuser_fusion_id1", attrs={**captured.backward.attrs, **attrs, "role": "backward", "forward": fwd_name})
        (out / bwd_name).write_text(format_file(bwd, header=header(bwd, command)))
        paths.append(out / bwd_name)
    return paths[0], paths[-1]


# ---------------------------------------------------------------------------------------------
# replay


def random_inputs(fusion: Fusion, seed: int = 0, device: str = "cpu") -> list[Any]:
    """Random inputs shaped, typed and strided as the fusion's ``define_tensor`` ops record.

    Floats are standard normal, except matrices (weights), which are scaled by 1/sqrt(fan-in)
    as nn.Linear initialises them, so activations stay O(1) and the float64 check measures
    rounding rather than the chaos of saturated softmaxes. Integer tensors are 0 or 1 (indices in
    range of any axis), except 0-d ones, which are 1 as integer scalars are: a 0-d integer is
    often a count (a loss's number of tokens, the divisor of its gradient)."""
    g = torch.Generator().manual_seed(seed)
    out: list[Any] = []
    for op in fusion.ops:
        if op.kind == "define_tensor":
            v: TensorValue = op.outputs[0]  # type: ignore[assignment]
            dt = v.dtype.torch
            if dt.is_floating_point:
                t = torch.randn(v.shape, generator=g)
                if v.ndim == 2 and v.shape[-1] > 0:
                    t = t / math.sqrt(v.shape[-1])
                t = t.to(dt)
            elif dt == torch.bool:
                t = torch.rand(v.shape, generator=g) < 0.5
            else:
                t = torch.randint(0, 2, v.shape, generator=g).to(dt)
                if v.ndim == 0:  # a count (a mean's divisor) of 0 made every gradient NaN, and NaN == NaN checks nothing
                    t = torch.ones_like(t)  # drawn all the same, so the later inputs stay as they were
            strides = strides_for(v.shape, op.arg("stride_order"))
            if strides != strides_for(v.shape, None) and v.numel:
                t = torch.empty_strided(v.shape, strides, dtype=dt).copy_(t)
            out.append(t.to(device))
        elif op.kind == "define_scalar" and op.arg("value") is None:
            dt = op.outputs[0].dtype
            out.append(True if dt is DType.Bool else (1 if dt.is_int else 0.5))
    return out


# Why an output is not compared: it is not a number a CPU can recompute (nvFuser's run only).
RNG_STATE = "RNG state"
RANDOM = "depends on nvFuser's random numbers"
# ... or its independent evaluation holds no finite number: NaN against NaN compares nothing (a
# random 0 count dividing a gradient made a whole backward NaN on both sides, and a check passed)
NOT_FINITE = "no finite value in the evaluation"


@dataclass
class OutputCheck:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    rel_error: float
    max_abs: float
    tolerance: float
    not_compared: str = ""  # why the output was left out of the check (RNG_STATE, RANDOM, NOT_FINITE); "" if compared

    @property
    def compared(self) -> bool:
        return not self.not_compared

    @property
    def ok(self) -> bool:
        return not self.compared or self.rel_error <= self.tolerance


@dataclass
class ReplayReport:
    outputs: list[Any]
    checks: list[OutputCheck] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every compared output is within tolerance (outputs not compared fail nothing)."""
        return all(c.ok for c in self.checks)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(‖actual − expected‖₂ / ‖expected‖₂, max |actual − expected|); NaN against NaN and equal
    infinities count as equal, any other non-finite difference is an infinite error."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    diff = torch.where(same, 0.0, a - e)
    if not bool(torch.isfinite(diff).all()):
        return math.inf, math.inf
    norm = float(torch.where(torch.isfinite(e), e, 0.0).norm())
    err = float(diff.norm())
    rel = err / norm if norm > 0 else (0.0 if err == 0 else math.inf)
    return rel, float(diff.abs().max()) if diff.numel() else 0.0


# Random numbers on nvFuser come from its own Philox stream, not torch's generator, so no CPU
# evaluation reproduces them (the reference backend and nvtp.dump.eager share a stream of their
# own instead). Per op: (results that carry random numbers, results that are the stream's state:
# the philox seed and offset). Every op with OpSpec.random has an entry; so has sdpfa_bwd, which
# with dropout regenerates the forward's mask from the seed and offset it is given.
def _attention_dropout(op: Op, producers: dict[str, Op]) -> bool:
    """Whether an attention op's dropout_p may be non-zero (a fusion input counts as may)."""
    p = op.arg("dropout_p")
    if is_value(p):
        definition = producers.get(p.name)
        p = definition.arg("value") if definition is not None and definition.kind == "define_scalar" else None
        if p is None:
            return True
    return bool(p)


RANDOM_RESULTS: dict[str, Callable[[Op, dict[str, Op]], tuple[tuple[int, ...], tuple[int, ...]]]] = {
    "uniform": lambda op, producers: ((0,), ()),
    "normal": lambda op, producers: ((0,), ()),
    # (out, lse, seed, offset): the logsumexp is taken before dropout, so it never sees the mask
    "sdpfa_fwd": lambda op, producers: ((0,) if _attention_dropout(op, producers) else (), (2, 3)),
    "sdpfa_bwd": lambda op, producers: ((0, 1, 2) if _attention_dropout(op, producers) else (), ()),
}


def random_dependence(fusion: Fusion) -> tuple[set[str], set[str]]:
    """(values that carry random numbers or are computed from them, values that are RNG state),
    walking the dataflow from each random op's results."""
    producers = fusion.producers()
    random: set[str] = set()
    state: set[str] = set()
    for op in fusion.ops:
        if op.kind not in RANDOM_RESULTS and opstable.spec(op.kind).random:
            raise KeyError(f"fd.ops.{op.kind} draws random numbers but has no entry in RANDOM_RESULTS (nvtp/dump/__init__.py)")
        if any(v.name in random for v in op.operands):
            random.update(v.name for v in op.outputs)
        elif op.kind in RANDOM_RESULTS:
            drawn, rng = RANDOM_RESULTS[op.kind](op, producers)
            random.update(op.outputs[i].name for i in drawn)
            state.update(op.outputs[i].name for i in rng)
    return random, state


def check_outputs(fusion: Fusion, actual: Sequence[Any], expected: Sequence[Any], *, backend: str = "reference") -> list[OutputCheck]:
    """Compare ``actual`` (a run on ``backend``) with ``expected`` (the float64 evaluation).

    The reference backend draws random numbers from the stream the evaluation restates, so every
    output is compared. nvFuser draws from its own Philox stream: its RNG state and every output
    that depends on a random op are reported as not compared (``OutputCheck.not_compared``)."""
    checks = []
    tol_float = tolerance(fusion)
    random, state = random_dependence(fusion) if backend != "reference" else (set(), set())
    for v, a, e in zip(fusion.outputs, actual, expected):
        if isinstance(v, ScalarValue) or not isinstance(a, torch.Tensor):
            continue
        why = RNG_STATE if v.name in state else RANDOM if v.name in random else ""
        if why:
            checks.append(OutputCheck(v.name, v.dtype, tuple(v.shape), math.nan, math.nan, math.nan, why))
            continue
        if v.dtype.is_float and isinstance(e, torch.Tensor) and e.numel() and not bool(torch.isfinite(e).any()):
            checks.append(OutputCheck(v.name, v.dtype, tuple(v.shape), math.nan, math.nan, math.nan, NOT_FINITE))
            continue
        if v.dtype.is_float:
            rel, mx = relative_error(a, e)
            tol = tol_float
        else:
            same = torch.equal(a.cpu(), e.to(a.dtype).cpu())
            rel, mx, tol = (0.0, 0.0, 0.0) if same else (math.inf, math.inf, 0.0)
        checks.append(OutputCheck(v.name, v.dtype, tuple(v.shape), rel, mx, tol))
    return checks


def check_inputs(fusion: Fusion, inputs: Sequence[Any], device: str | None = None) -> None:
    """Raise ``InputError`` unless ``inputs`` are what ``fusion``'s inputs declare (count,
    tensor or number, shape, dtype; all on ``device``, or on one device), naming the first
    that is not."""
    declared = fusion.inputs
    if len(inputs) != len(declared):
        raise InputError(f"{fusion.name} takes {len(declared)} inputs ({', '.join(v.name for v in declared)}), got {len(inputs)}")
    for i, (v, x) in enumerate(zip(declared, inputs)):
        what = f"input {i} ({fusion.label(v.name) or v.name}, {v.describe()})"
        if isinstance(v, TensorValue):
            if not isinstance(x, torch.Tensor):
                raise InputError(f"{what}: expected a tensor, got {type(x).__name__}")
            if tuple(x.shape) != tuple(v.shape) or x.dtype != v.dtype.torch:
                raise InputError(f"{what}: expected {v.dtype.value}{list(v.shape)}, got {str(x.dtype).replace('torch.', '')}{list(x.shape)}")
            if device is None:
                device = x.device.type
            elif x.device.type != device:
                raise InputError(f"{what}: expected a tensor on {device}, got one on {x.device}; move it with .to({device!r})")
        elif isinstance(x, torch.Tensor) and x.numel() != 1:
            raise InputError(f"{what}: expected a number, got a tensor of shape {list(x.shape)}")
        elif not isinstance(x, (bool, int, float, complex, torch.Tensor)):
            raise InputError(f"{what}: expected a number, got {type(x).__name__}")


def replay(fusion: Fusion, *, backend: str = "reference", seed: int = 0, check: bool = False, inputs: Sequence[Any] | None = None) -> ReplayReport:
    """Run ``fusion`` on random (or given) inputs; with ``check``, compare with ``nvtp.dump.eager`` (float64)."""
    if inputs is not None:
        check_inputs(fusion, inputs, "cuda" if backend == "nvfuser" else None)
    inputs = list(inputs) if inputs is not None else random_inputs(fusion, seed)
    start = time.perf_counter()
    if backend == "reference":
        outputs = reference.run(fusion, inputs, seed=seed)
    elif backend == "nvfuser":
        from nvtp.execute import nvfuser  # optional: nvfuser_direct (the nvFuser backend only)

        outputs = nvfuser.execute(fusion, inputs)
    else:
        raise ValueError(f"unknown backend {backend!r}; use reference or nvfuser")
    seconds = time.perf_counter() - start
    report = ReplayReport(outputs, seconds=seconds)
    if check:  # against an independent evaluation: eager PyTorch in float64, no reference-backend code
        expected = eager.evaluate(fusion, inputs, seed=seed)
        report.checks = check_outputs(fusion, outputs, expected, backend=backend)
    return report


def verdict(fusion: Fusion, report: ReplayReport) -> list[str]:
    """The check's verdict line, and with outputs left out, how to compare them too."""
    head = "check against an independent evaluation (eager PyTorch, float64): "
    left = [c for c in report.checks if not c.compared]
    word = "passed" if report.ok else "FAILED"
    if not left:
        return [head + word]
    compared = len(report.checks) - len(left)
    plural = {RNG_STATE: RNG_STATE, RANDOM: "depend on nvFuser's random numbers", NOT_FINITE: "with no finite value in the evaluation"}
    counts = [f"{n} {plural[why]}" for why in (RNG_STATE, RANDOM, NOT_FINITE) if (n := sum(c.not_compared == why for c in left))]
    lines = [head + f"{word if compared else 'nothing compared'}; {compared} of {len(report.checks)} outputs compared, "
             f"{len(left)} not compared ({', '.join(counts)})"]
    if any(c.not_compared == RANDOM for c in left):
        a = fusion.attrs
        how = (f"`nvtp dump --model {a['model']} --config {a['config']} --dtype {a['dtype']} --dropout 0 --out DIR`"
               if {"model", "config", "dtype"} <= set(a) else "`nvtp dump --dropout 0` (nvtp's models), or a fusion without random ops")
        lines.append(f"nvFuser's random numbers (Philox) are not torch's: to compare every numerical output, replay a dump without dropout, {how}")
    return lines
