"""Every sharding rule, checked against the unsharded result by simulating the ranks.

For each op of each sample fusion (``tests/op_samples.py``, plus ``EXTRA`` below: more shapes for
the rules whose factors depend on them) and each mesh size, the op is cut
out into a one-op fusion fed with the values its operands have in an unsharded run of the
sample. Then, for every decision the op's rule allows (nothing split, or one factor split with
inner split factor 1, 2, 3 or 4; at most MAX_CASES per op and mesh size), the operands are
sharded as the rule implies (``propagate.implied``), every rank runs the op on its parts
(threads with ``ThreadComm``, through ``spmd.run_rank``), and the results, put back together as
the rule says they are placed (shards in place, partial sums added or max-ed, replicated values
equal on every rank), must equal the op's unsharded result: exactly for integers and booleans,
within a relative error of 1e-5 for float32/float64 and of the type's own rounding for 16-bit
floats (``nvtp.dump.TOLERANCE``). Random ops are no exception: the reference backend draws random
tensors whole from the seeded generator and slices them, so a sharded run draws the same numbers.

The partial sums propagation lets pass through an op unresolved (the op table's ``OpSpec.linear``) are
claims of the same kind and are checked the same way, each rank holding random parts of the sum.

A case's id names it: ``<sample>:<op>@<op index>-d<mesh size>-<decision>-<operands>-><results>``,
e.g. ``linear:linear@3-d2-f2x1-T0=S(2),T1=S(1),T2=R->T3=P(sum)``: factor 2 of the rule split with
inner split factor 1 (``none``: nothing split; ``partial0``: operand 0 a partial sum passing through).
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from nvtp.dump import TOLERANCE, relative_error
from nvtp.execute import reference, spmd
from nvtp.execute.collectives import ThreadComm, ThreadGroup
from nvtp.ir import DType, Fusion, FusionBuilder, Op, TensorValue
from nvtp.ir import ops as opstable
from nvtp.ir.graph import INPUT_KINDS
from nvtp.sharding import propagate, rules
from nvtp.sharding.placements import (
    REPLICATE, DeviceMesh, Partial, Placement, Shard, _StridedShard, axis_split, divisibility_error, is_partial, local_shape,
)
from nvtp.sharding.propagate import NONE, SUM, Decision, as_decision, implied
from nvtp.sharding.rules import OpFactors, factors_of, tensor_operands
from tests.op_samples import SAMPLES, SAMPLES_BY_NAME, Sample

MESH_SIZES = (2, 4)
SPLITS = (1, 2, 3, 4)  # inner split factors tried for each factor (as_decision's are small divisors)
MAX_CASES = 12  # per op and mesh size, after removing decisions with the same placements
SEED = 1234
INPUT_SEED = 0


# ---------------------------------------------------------------------------------------------
# more shapes for the rules whose factor mappings depend on them (the op samples have one each)


def _extra(name: str, operands: list[tuple[tuple[int, ...], DType]], make, inputs=None) -> Sample:
    """A one-op sample: tensor inputs ``operands`` (standard normal, or ``inputs(generator)``) and
    the op ``make(builder, *inputs)`` adds."""
    def build() -> Fusion:
        b = FusionBuilder(f"sample_{name}")
        result = make(b, *[b.define_tensor(shape, dt) for shape, dt in operands])
        for v in result if isinstance(result, tuple) else (result,):
            b.add_output(v)
        return b.build()

    def draw(g: torch.Generator) -> list[torch.Tensor]:
        return inputs(g) if inputs else [torch.randn(shape, generator=g).to(dt.torch) for shape, dt in operands]

    return Sample(name, build, draw)


F32 = DType.Float


def _reshape(src: tuple[int, ...], dst: tuple[int, ...]) -> Sample:
    name = f"x_reshape_{'x'.join(map(str, src))}_to_{'x'.join(map(str, dst))}"
    return _extra(name, [(src, F32)], lambda b, x: b.op("reshape", x, new_shape=list(dst)))


EXTRA: list[Sample] = [
    _reshape((2, 1, 8), (16,)),  # a size-1 axis disappears in a merge
    _reshape((2, 8), (2, 1, 8)),  # one appears
    _reshape((8, 6), (4, 12)),  # a common refinement [4, 2, 6] across both axes
    _reshape((2, 3, 4), (6, 4)),
    _reshape((24,), (3, 8)),
    _reshape((6, 4), (4, 6)),  # no common refinement: the operand stays whole
    _reshape((4, 6), (8, 3)),
    _extra("x_slice_aligned_chunk", [((2, 16), F32)], lambda b, x: b.op("slice", x, start_indices=[0, 8], end_indices=[2, 16])),
    _extra("x_slice_unaligned", [((4, 16), F32)], lambda b, x: b.op("slice", x, start_indices=[0, 3], end_indices=[4, 11])),
    _extra("x_pad_both_sides", [((4, 8), F32)], lambda b, x: b.op("pad", x, pad_widths=[2, 2, 0, 0])),
    _extra("x_cat_equal_rows", [((4, 8), F32)] * 3, lambda b, *ts: b.op("cat", list(ts), dim=0)),
    _extra("x_matmul_vec_vec", [((16,), F32), ((16,), F32)], lambda b, x, y: b.op("matmul", x, y)),
    _extra("x_matmul_mat_vec", [((8, 16), F32), ((16,), F32)], lambda b, x, y: b.op("matmul", x, y)),
    _extra("x_matmul_vec_batched", [((16,), F32), ((2, 16, 8), F32)], lambda b, x, y: b.op("matmul", x, y)),
    _extra("x_matmul_broadcast_batch", [((1, 8, 16), F32), ((4, 16, 8), F32)], lambda b, x, y: b.op("matmul", x, y)),
    _extra("x_matmul_3d_2d", [((2, 8, 16), F32), ((16, 4), F32)], lambda b, x, y: b.op("matmul", x, y)),
    _extra("x_linear_vector_weight", [((2, 8, 16), F32), ((16,), F32), ((), F32)], lambda b, x, w, c: b.op("linear", x, w, c)),
    _extra("x_linear_scalar_bias", [((8, 16), F32), ((4, 16), F32), ((), F32)], lambda b, x, w, c: b.op("linear", x, w, c)),
    _extra("x_min_partial", [((4, 8), F32)], lambda b, x: b.op("min", x, dims=[-1])),
    _extra("x_max_keepdim_all", [((4, 8), F32)], lambda b, x: b.op("max", x, dims=[0, 1], keepdim=True)),
    _extra("x_sum_int_partial", [((4, 8), DType.Int)], lambda b, x: b.op("sum", x, dims=[0]),
           lambda g: [torch.randint(-9, 9, (4, 8), generator=g)]),
]
ALL_SAMPLES: list[Sample] = SAMPLES + EXTRA
BY_NAME: dict[str, Sample] = {s.name: s for s in ALL_SAMPLES}


# ---------------------------------------------------------------------------------------------
# one op on its own


def one_op_fusion(fusion: Fusion, op: Op) -> Fusion:
    """``op`` alone: an input per operand (same names), and the op's tensor results as outputs.

    Scalar operands defined as constants stay constants; symbolic or computed scalars become
    scalar inputs."""
    producers = fusion.producers()
    b = FusionBuilder(f"{fusion.name}_{op.outputs[0].name}")
    seen: set[str] = set()
    for v in op.operands:
        if v.name in seen:
            continue
        seen.add(v.name)
        if isinstance(v, TensorValue):
            b.define_tensor(v.shape, v.dtype, name=v.name)
        else:
            source = producers.get(v.name)
            constant = source.arg("value") if source is not None and source.kind == "define_scalar" else None
            b.define_scalar(constant, v.dtype, name=v.name)
    b.ops.append(op)
    for v in op.outputs:
        if isinstance(v, TensorValue):
            b.add_output(v)
    return b.build()


@dataclass(frozen=True)
class Prepared:
    """A sample op cut out, with its operand values and its unsharded results."""

    fusion: Fusion  # the one-op fusion
    op: Op
    inputs: list[Any]
    expected: list[torch.Tensor]
    in_sample: list[torch.Tensor]  # the same values, as the whole sample computed them


@functools.cache
def sample_values(name: str) -> dict[str, Any]:
    """Every value of an unsharded run of sample ``name``."""
    s = BY_NAME[name]
    values: dict[str, Any] = {}
    reference.run(s.build(), s.inputs(torch.Generator().manual_seed(INPUT_SEED)), seed=SEED, values=values)
    return values


@functools.cache
def prepared(name: str, op_index: int) -> Prepared:
    fusion = BY_NAME[name].build()
    op = fusion.ops[op_index]
    one = one_op_fusion(fusion, op)
    values = sample_values(name)
    inputs = [values[v.name] for v in one.inputs]
    expected = reference.run(one, inputs, seed=SEED)
    return Prepared(one, op, inputs, expected, [values[v.name] for v in one.outputs])


# ---------------------------------------------------------------------------------------------
# the cases: decisions and the placements they imply


def decisions(f: OpFactors, d: int) -> list[Decision]:
    """NONE, then every valid split of every factor that is not blocked (split factor 1 first)."""
    found = [NONE]
    for split in SPLITS:
        for g, (size, kind) in enumerate(zip(f.sizes, f.kinds)):
            if kind != "blocked" and size % (split * d) == 0:
                found.append(Decision(g, split))
    return found


def partial_decisions(fusion: Fusion, op: Op, d: int) -> list[Decision]:
    """The decisions that let partial sums pass through ``op`` unresolved, as propagation offers
    them when every tensor operand is a partial sum (``OpSpec.linear``: all operands
    partial, one of them, or the first). Each is a claim about the op, checked like a rule.
    Booleans are left out: they cannot be split into summands."""
    if not opstable.spec(op.kind).linear or any(t.dtype is DType.Bool for t in tensor_operands(op)):
        return []
    sums = {t.name: SUM for t in tensor_operands(op)}
    offered = propagate._Propagator(one_op_fusion(fusion, op), DeviceMesh.of_size(d), sums, {}).candidates(op, factors_of(op))
    return [c for c in offered if c.partial]


def representable(p: Placement, v: TensorValue, d: int) -> bool:
    split = axis_split(p)
    return split is None or (split[0] < v.ndim and divisibility_error(v.shape[split[0]], p, d) is None)


def placements(op: Op, f: OpFactors, dec: Decision, d: int) -> tuple[tuple, tuple] | None:
    """(operand placements, result placements) by value name under ``dec``; None when a tensor
    cannot hold its placement or one value is used twice with different placements."""
    operands: dict[str, Placement] = {}
    for pos, (axes, v) in enumerate(zip(f.operands, tensor_operands(op))):
        p = implied(axes, f, dec, result=False, position=pos)
        if not representable(p, v, d) or operands.setdefault(v.name, p) != p:
            return None
    results: dict[str, Placement] = {}
    for axes, v in zip(f.results, op.outputs):
        if isinstance(v, TensorValue):
            p = implied(axes, f, dec, result=True)
            if not representable(p, v, d):
                return None
            results[v.name] = p
    return tuple(operands.items()), tuple(results.items())


def decision_label(f: OpFactors, dec: Decision) -> str:
    if dec.partial:
        return "partial" + "".join(str(p) for p in dec.partial)
    if dec.factor is None:
        return "none"
    return f"f{dec.factor}x{dec.split}"


@dataclass(frozen=True)
class Case:
    sample: str
    op_index: int
    kind: str
    d: int
    decision: Decision
    label: str
    operands: tuple[tuple[str, Placement], ...]
    results: tuple[tuple[str, Placement], ...]

    def __str__(self) -> str:
        ops = ",".join(f"{n}={p}" for n, p in self.operands)
        res = ",".join(f"{n}={p}" for n, p in self.results)
        return f"{self.sample}:{self.kind}@{self.op_index}-d{self.d}-{self.label}-{ops}->{res}"

    @property
    def shardings(self) -> dict[str, tuple[Placement, ...]]:
        return {name: (p,) for name, p in self.operands + self.results}


def _sample_name(f: Fusion) -> str:
    return f.name.removeprefix("sample_")


def op_cases(fusion: Fusion, op_index: int, d: int) -> tuple[list[Case], int]:
    """The cases of one op on ``d`` devices: at most MAX_CASES splits (decisions with the same
    placements count once), then every partial-sum pass; and how many splits were left out."""
    op = fusion.ops[op_index]
    sample = _sample_name(fusion)
    f = factors_of(op)

    def cases_of(decs: list[Decision], seen: set[tuple]) -> list[Case]:
        out = []
        for dec in decs:
            found = placements(op, f, dec, d)
            if found is not None and found not in seen:
                seen.add(found)
                out.append(Case(sample, op_index, op.kind, d, dec, decision_label(f, dec), *found))
        return out

    seen: set[tuple] = set()
    splits = cases_of(decisions(f, d), seen)
    return splits[:MAX_CASES] + cases_of(partial_decisions(fusion, op, d), seen), max(0, len(splits) - MAX_CASES)


def checked_ops() -> list[tuple[Fusion, int]]:
    """(sample fusion, op index) of every compute op with a tensor result."""
    found = []
    for s in ALL_SAMPLES:
        fusion = s.build()
        for i, op in enumerate(fusion.ops):
            if op.kind not in INPUT_KINDS and any(isinstance(v, TensorValue) for v in op.outputs):
                found.append((fusion, i))
    return found


OPS = checked_ops()
CASES: list[Case] = []
LEFT_OUT = 0
for _fusion, _i in OPS:
    for _d in MESH_SIZES:
        _cases, _more = op_cases(_fusion, _i, _d)
        CASES += _cases
        LEFT_OUT += _more


# ---------------------------------------------------------------------------------------------
# running the ranks and comparing


@dataclass
class OneOpSharded:
    """What ``spmd.run_rank`` needs of a sharded fusion: the fusion, mesh, shardings and the steps
    of its ``set`` ops (none here: the reference backend works a step out by ``reshard_kind``)."""

    fusion: Fusion
    mesh: DeviceMesh
    shardings: dict[str, tuple[Placement, ...]]
    set_steps = {}
    options = {}  # the axis options the passes planned with (ShardedFusion.options): none

    @property
    def source(self) -> Fusion:
        return self.fusion

    def placement(self, name: str) -> Placement:
        return self.shardings.get(name, (REPLICATE,))[0]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.uint64:
        a, b = a.view(torch.int64), b.view(torch.int64)
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def assemble(v: TensorValue, p: Placement, parts: list[torch.Tensor], d: int) -> torch.Tensor:
    """The whole of ``v`` from each rank's part; checks the parts' shapes, and that replicated
    parts agree (a rank that computed something else is a wrong rule as much as a wrong sum)."""
    want = local_shape(v.shape, (p,), DeviceMesh.of_size(d))
    for rank, part in enumerate(parts):
        assert tuple(part.shape) == want, f"{v.name} ({p}): rank {rank} holds {list(part.shape)}, the placement says {list(want)}"
    if not axis_split(p) and not is_partial(p):
        for rank, part in enumerate(parts[1:], 1):
            assert _same(part, parts[0]), f"{v.name} is {p}, but rank {rank}'s copy differs from rank 0's"
    return spmd.assemble(parts, p, v.shape)


def tolerance(dt: DType) -> float:
    """1e-5 for float32 and float64; a 16-bit float's own rounding (nvtp.dump.TOLERANCE) otherwise."""
    return 1e-5 if dt.itemsize >= 4 else TOLERANCE[dt]


def compare(v: TensorValue, got: torch.Tensor, want: torch.Tensor, what: str, tol: float | None = None) -> None:
    assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype), \
        f"{what}: {v.name} came out {got.dtype}{list(got.shape)}, unsharded {want.dtype}{list(want.shape)}"
    if v.dtype.is_float or v.dtype.is_complex:
        rel, worst = relative_error(got, want)
        tol = max(tolerance(v.dtype), tol or 0.0)
        assert rel <= tol, f"{what}: {v.name} relative error {rel:.3g} (max abs {worst:.3g}) > {tol}"
    else:
        assert _same(got, want), f"{what}: {v.name} differs from the unsharded result in {int((got != want).sum())} entries"


def split_sum(x: torch.Tensor, d: int, g: torch.Generator) -> list[torch.Tensor]:
    """``d`` random parts that add up to ``x``: a partial sum as ranks really hold one (not the
    whole on rank 0 and zeros elsewhere, which an op could get right by accident)."""
    if x.is_floating_point():
        scale = float(x.double().abs().mean()) or 1.0
        noise = [(torch.randn(x.shape, generator=g, dtype=torch.float64) * scale).to(x.dtype) for _ in range(d - 1)]
    else:
        noise = [torch.randint(-5, 6, x.shape, generator=g).to(x.dtype) for _ in range(d - 1)]
    first = x - sum(noise) if noise else x
    return [first] + noise


def rank_inputs(sharded: OneOpSharded, inputs: list[Any]) -> list[list[Any]]:
    """Each rank's inputs, from the whole ones: shards, or random parts of a partial sum."""
    d = sharded.mesh.size
    g = torch.Generator().manual_seed(SEED)
    per_rank: list[list[Any]] = [[] for _ in range(d)]
    for v, x in zip(sharded.fusion.inputs, inputs):
        if not isinstance(v, TensorValue):
            parts = [x] * d
        elif is_partial(sharded.placement(v.name)):
            parts = split_sum(x, d, g)
        else:
            parts = [spmd.shard_tensor(x, sharded.placement(v.name), sharded.mesh, r) for r in range(d)]
        for r in range(d):
            per_rank[r].append(parts[r])
    return per_rank


def run_ranks(sharded: OneOpSharded, per_rank: list[list[Any]]) -> list[list[Any]]:
    """Every rank as a thread (``ThreadComm``), each on its own inputs; each rank's outputs."""
    d = sharded.mesh.size
    group = ThreadGroup(d, timeout=30.0)
    outputs: list[Any] = [None] * d
    errors: list[BaseException | None] = [None] * d

    def body(r: int) -> None:
        try:
            outputs[r] = spmd.run_rank(sharded, per_rank[r], ThreadComm(group, r), seed=SEED)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e
            group.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"rule-rank{r}") for r in range(d)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is not None or any(errors):
        raise first or next(e for e in errors if e is not None)
    return outputs


def check_sharded(one: Fusion, inputs: list[Any], expected: list[Any], case: Case, what: str) -> None:
    """Run ``one`` on every rank as ``case`` places its values, reassemble, compare with ``expected``."""
    sharded = OneOpSharded(one, DeviceMesh.of_size(case.d), case.shardings)
    per_rank = run_ranks(sharded, rank_inputs(sharded, inputs))
    # A partial operand's random parts are rounded in its own type: a 16-bit one widens the tolerance.
    partial = [tolerance(v.dtype) for v in one.inputs if is_partial(sharded.placement(v.name)) and v.dtype.is_float]
    for i, v in enumerate(one.outputs):
        got = assemble(v, sharded.placement(v.name), [r[i] for r in per_rank], case.d)
        compare(v, got, expected[i], what, max(partial, default=None))


def run_case(case: Case) -> None:
    """Shard, run every rank, reassemble and compare with the unsharded op; raises on a mismatch."""
    prep = prepared(case.sample, case.op_index)
    check_sharded(prep.fusion, prep.inputs, prep.expected, case, f"{prep.op} on {case.d} devices, {case.label}: {describe_case(case)}")


def describe_case(case: Case) -> str:
    ops = ", ".join(f"{n} {p}" for n, p in case.operands)
    res = ", ".join(f"{n} {p}" for n, p in case.results)
    return f"operands {ops or '-'} -> results {res}"


# ---------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rule_matches_unsharded(case: Case):
    run_case(case)


@pytest.mark.parametrize("sample, op_index", [pytest.param(_sample_name(f), i, id=f"{_sample_name(f)}:{f.ops[i].kind}@{i}") for f, i in OPS])
def test_one_op_fusion_reproduces_the_sample(sample: str, op_index: int):
    """The cut-out op computes what it computed inside its sample (so the cases test that op)."""
    prep = prepared(sample, op_index)
    for v, got, want in zip(prep.fusion.outputs, prep.expected, prep.in_sample):
        assert _same(got, want), f"{prep.op}: {v.name} alone differs from {v.name} in sample {sample}"


def test_the_cases_cover_every_rule_the_samples_use():
    """Every op kind in the samples is checked, and sharded somewhere unless its rule blocks every factor."""
    ops = [f.ops[i] for f, i in OPS]
    kinds = {op.kind for op in ops}
    split = {c.kind for c in CASES if c.decision.factor is not None}
    never = sorted(k for k in kinds - split if any(kind != "blocked" for op in ops if op.kind == k for kind in factors_of(op).kinds))
    assert not never, f"ops whose rule allows a split but no case splits them: {never}"
    assert len(CASES) > 1000 and LEFT_OUT < len(CASES) // 10, (len(CASES), LEFT_OUT)


def _partial_passes_the_table_implies(op: Op) -> int:
    """How many partial-sum passes the op table's ``OpSpec.linear`` promises for ``op``, from the
    table's styles and the algebra alone: "all" operands partial together (once), "one" of them
    at a time (one per floating-point tensor operand), or the "first" (once); none for a result that is not
    floating point (integer division truncates, a cast to integers rounds), for a boolean
    operand, for a number added to or subtracted from a partial sum (it would be added on every
    rank), or for a number divided by one (2 / (a + b) is not 2 / a + 2 / b)."""
    style = opstable.spec(op.kind).linear
    tensors = tensor_operands(op)
    if not style or not op.outputs[0].dtype.is_float or any(t.dtype is DType.Bool for t in tensors):
        return 0
    if op.kind == "cast" and not tensors[0].dtype.is_float:
        return 0
    if op.kind in ("add", "sub", "div") and not isinstance(op.arg("lhs"), TensorValue):
        return 0
    if op.kind in ("add", "sub") and not isinstance(op.arg("rhs"), TensorValue):
        return 0
    one = sum(t.dtype.is_float for t in tensors)  # an integer operand (gather_mm's expert index) selects: no sum passes it
    return {"all": 1, "one": one, "first": 1}[style]


def test_the_partial_sum_cases_are_those_the_table_implies():
    """Each op with an ``OpSpec.linear`` that a sample uses gets its partial-sum cases, on each
    mesh size: a renamed or emptied table, or a pass propagation stops offering, drops them."""
    got: dict[tuple[str, int], int] = {}
    for c in CASES:
        if c.decision.partial:
            got[c.sample, c.op_index] = got.get((c.sample, c.op_index), 0) + 1
    want = {(_sample_name(f), i): n * len(MESH_SIZES) for f, i in OPS if (n := _partial_passes_the_table_implies(f.ops[i]))}
    assert got == want
    # The ops linear in the operands the table names (sums, products with one factor partial,
    # the dividend, layout ops, sum): the table must hold each, and each must have cases.
    linear = {"add", "sub", "cat", "mul", "matmul", "div", "neg", "cast", "reshape", "permute", "broadcast_in_dim",
              "expand", "squeeze", "set", "segment_set", "stride_order", "sum", "slice", "gather_mm", "gather_mm_wgrad"}
    assert {name for name, s in opstable.OPS.items() if s.linear} == linear
    assert {c.kind for c in CASES if c.decision.partial} == linear
    assert sum(want.values()) == 122  # as counted when written (114, and 8 with the MoE samples): a sample added or removed changes it


# -- the check can fail ------------------------------------------------------------------------


def _cases_of(sample: str, kind: str) -> list[Case]:
    fusion = SAMPLES_BY_NAME[sample].build()
    return [c for i, op in enumerate(fusion.ops) if op.kind == kind for d in MESH_SIZES for c in op_cases(fusion, i, d)[0]]


def test_a_reduce_factor_marked_pass_is_caught(monkeypatch):
    """sum with its reduced axis as a pass factor: each rank's partial sum would pass as the whole."""
    right = rules.RULES["sum"]

    def wrong(op: Op) -> OpFactors:
        f = right(op)
        f.kinds = ["pass" if k == "reduce" else k for k in f.kinds]
        return f

    fusion = SAMPLES_BY_NAME["sum"].build()  # sum over axis 1 of [2, 8, 16]
    reduced = {g for g, k in enumerate(factors_of(fusion.ops[1]).kinds) if k == "reduce"}
    monkeypatch.setitem(rules.RULES, "sum", wrong)
    monkeypatch.setattr(rules, "_BY_STRUCTURE", {})  # factors cached by structure would serve the right rule's
    monkeypatch.setattr(rules, "_FACTORS", {})
    cases = _cases_of("sum", "sum")
    assert any(c.decision.factor in reduced for c in cases)
    for c in cases:
        if c.decision.factor in reduced:
            with pytest.raises(AssertionError, match=r"T1 is R, but rank 1's copy differs from rank 0's"):
                run_case(c)
        else:
            run_case(c)  # the rest of the wrong rule is right


def test_a_permute_rule_with_swapped_axes_is_caught(monkeypatch):
    """permute mapping result axes through the inverse permutation: placements land on the wrong axis."""
    right = rules.RULES["permute"]

    def wrong(op: Op) -> OpFactors:
        f = right(op)
        dims = op.arg("dims")
        inverse = [dims.index(i) for i in range(len(dims))]
        f.results = [[f.operands[0][i] for i in inverse]]
        return f

    monkeypatch.setitem(rules.RULES, "permute", wrong)
    monkeypatch.setattr(rules, "_BY_STRUCTURE", {})  # factors cached by structure would serve the right rule's
    monkeypatch.setattr(rules, "_FACTORS", {})
    failed = 0
    for c in _cases_of("permute", "permute"):
        if c.decision.factor is None:
            continue
        with pytest.raises(AssertionError):
            run_case(c)
        failed += 1
    assert failed >= 3


# ---------------------------------------------------------------------------------------------
# targeted rules: placements the samples may not reach, checked by name and by running them


def _single(operands: list[tuple[tuple[int, ...], DType]], make) -> tuple[Fusion, Op]:
    """(fusion, op) of a one-op sample built as ``_extra`` builds them."""
    f = _extra("single", operands, make).build()
    return f, f.ops[-1]


def check_targeted(f: Fusion, op: Op, operand: int | None, placement: Placement, d: int, inputs: list[torch.Tensor]) -> Case:
    """The decision that places tensor operand ``operand`` (None: the first result) as
    ``placement``, checked by simulation; returns the case (its placements) to assert on."""
    rule = factors_of(op)
    axes = rule.results[0] if operand is None else rule.operands[operand]
    dec = as_decision(axes, rule, placement, d)
    assert dec is not None and dec != NONE, f"{op}: no decision places {'its result' if operand is None else f'operand {operand}'} {placement}"
    found = placements(op, rule, dec, d)
    assert found is not None, f"{op}: decision {dec} cannot be placed"
    case = Case(f.name, f.ops.index(op), op.kind, d, dec, decision_label(rule, dec), *found)
    one = one_op_fusion(f, op)
    check_sharded(one, inputs, reference.run(one, inputs, seed=SEED), case, f"{op} ({describe_case(case)})")
    return case


def _randn(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(math.prod(shape))).to(dtype)


@pytest.mark.parametrize("d", MESH_SIZES)
def test_reshape_merging_a_split_axis_gives_a_strided_shard(d):
    f, op = _single([((2, 8, 16), F32)], lambda b, x: b.op("reshape", x, new_shape=[16, 16]))  # [2, 8] -> [16]
    case = check_targeted(f, op, 0, Shard(1), d, [_randn(2, 8, 16)])
    assert dict(case.results) == {op.output.name: _StridedShard(0, split_factor=2)}


@pytest.mark.parametrize("d", MESH_SIZES)
def test_reshape_splitting_a_split_axis_keeps_the_outer_part_split(d):
    f, op = _single([((2, 8, 16), F32)], lambda b, x: b.op("reshape", x, new_shape=[2, 8, 4, 4]))  # [16] -> [4, 4]
    case = check_targeted(f, op, 0, Shard(2), d, [_randn(2, 8, 16)])
    assert dict(case.results) == {op.output.name: Shard(2)}


def test_reshape_of_an_inner_split_gives_the_inner_axis():
    """[2, 8, 16] -> [2, 8, 4, 4] with axis 2 split in its inner part (_S(2, 4)): axis 3 is split."""
    f, op = _single([((2, 8, 16), F32)], lambda b, x: b.op("reshape", x, new_shape=[2, 8, 4, 4]))
    case = check_targeted(f, op, 0, _StridedShard(2, split_factor=4), 2, [_randn(2, 8, 16)])
    assert dict(case.results) == {op.output.name: Shard(3)}


@pytest.mark.parametrize("d", MESH_SIZES)
def test_slice_of_one_chunk_of_a_strided_shard_is_a_shard(d):
    """[2, 24] as [3, 8] split in the 8s: slicing out the middle chunk leaves it split plainly."""
    f, op = _single([((2, 24), F32)], lambda b, x: b.op("slice", x, start_indices=[0, 8], end_indices=[2, 16]))
    case = check_targeted(f, op, 0, _StridedShard(1, split_factor=3), d, [_randn(2, 24)])
    assert dict(case.results) == {op.output.name: Shard(1)}


@pytest.mark.parametrize("d", MESH_SIZES)
def test_cat_of_three_equal_shards_is_a_strided_shard(d):
    f, op = _single([((2, 8), F32)] * 3, lambda b, *ts: b.op("cat", list(ts), dim=1))
    case = check_targeted(f, op, 0, Shard(1), d, [_randn(2, 8) + i for i in range(3)])
    assert all(p == Shard(1) for _, p in case.operands) and len(case.operands) == 3
    assert dict(case.results) == {op.output.name: _StridedShard(1, split_factor=3)}


@pytest.mark.parametrize("d", MESH_SIZES)
def test_linear_split_on_the_contracted_axis_is_a_partial_sum_with_the_bias_once(d):
    f, op = _single([((2, 8, 16), F32), ((32, 16), F32), ((32,), F32)], lambda b, x, w, bias: b.op("linear", x, w, bias))
    x, w, bias = _randn(2, 8, 16), _randn(32, 16), _randn(32) + 10.0  # a large bias: added twice would show
    case = check_targeted(f, op, 0, Shard(2), d, [x, w, bias])
    x_, w_, b_ = (v.name for v in tensor_operands(op))
    assert dict(case.operands) == {x_: Shard(2), w_: Shard(1), b_: REPLICATE}
    assert dict(case.results) == {op.output.name: Partial("sum")}


@pytest.mark.parametrize("d", MESH_SIZES)
def test_amax_over_a_split_axis_is_a_partial_max(d):
    f, op = _single([((2, 8, 16), F32)], lambda b, x: b.op("max", x, dims=[2]))
    case = check_targeted(f, op, 0, Shard(2), d, [_randn(2, 8, 16)])
    assert dict(case.results) == {op.output.name: Partial("max")}


@pytest.mark.parametrize("d", MESH_SIZES)
def test_embedding_with_the_vocabulary_split_is_a_partial_sum(d):
    f, op = _single([((2, 8), DType.Int), ((32, 16), F32)], lambda b, i, w: b.op("embedding_fwd", i, w))
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    case = check_targeted(f, op, 1, Shard(0), d, [idx, _randn(32, 16)])
    assert dict(case.operands) == {tensor_operands(op)[0].name: REPLICATE, tensor_operands(op)[1].name: Shard(0)}
    assert dict(case.results) == {op.output.name: Partial("sum")}


@pytest.mark.parametrize("d", MESH_SIZES)
def test_reshape_without_a_common_refinement_splits_its_result_from_a_whole_operand(d):
    """[6, 4] -> [4, 6]: no factor is shared, so the operand stays whole and each rank keeps its
    rows of the reshaped result (the reference computes the whole result and slices it)."""
    f, op = _single([((6, 4), F32)], lambda b, x: b.op("reshape", x, new_shape=[4, 6]))
    case = check_targeted(f, op, None, Shard(0), d, [_randn(6, 4)])
    assert dict(case.operands) == {tensor_operands(op)[0].name: REPLICATE}


@pytest.mark.parametrize("d", MESH_SIZES)
def test_cat_of_unequal_parts_splits_its_result_from_whole_operands(d):
    f, op = _single([((2, 4), F32), ((2, 12), F32)], lambda b, x, y: b.op("cat", [x, y], dim=1))
    case = check_targeted(f, op, None, Shard(1), d, [_randn(2, 4), _randn(2, 12)])
    assert all(p == REPLICATE for _, p in case.operands)


@pytest.mark.parametrize("d", MESH_SIZES)
def test_a_number_divided_by_a_partial_sum_is_not_offered(d):
    """2 / (a + b) is not 2 / a + 2 / b: only a dividend may be a partial sum."""
    f, op = _single([((2, 8), F32)], lambda b, x: b.op("div", 2.0, x))
    assert partial_decisions(f, op, d) == []


def test_the_factor_and_type_caches_do_not_keep_ops_alive():
    """factors_of and verify remember ops by identity, weakly: an op no fusion holds is gone from
    both, so a long process that compiles many models does not keep every op it ever saw."""
    import gc
    import sys

    from nvtp.ir.graph import Fusion, TensorValue
    from nvtp.ir.build import make_op
    from nvtp.sharding import rules

    checked = sys.modules["nvtp.ir.verify"]
    x = TensorValue("T0", (4, 8), DType.Float)
    define = make_op("define_tensor", (), {"shape": (4, 8), "contiguity": (True, True), "dtype": DType.Float,
                                            "is_cpu": False, "stride_order": (1, 0)}, ["T0"])
    op = make_op("neg", (x,), {}, ["T1"])
    checked.verify(Fusion((define, op), (op.outputs[0],)))
    rules.factors_of(op)
    key = id(op)
    assert rules._FACTORS[key][1] is rules.factors_of(op) and checked._TYPED.get(key) is op
    del op
    gc.collect()
    assert key not in rules._FACTORS and checked._TYPED.get(key) is None


def test_a_renamed_copy_shares_its_templates_factors_and_type_check():
    """A spliced block's ops are renamed copies of the traced block's: factors_of and verify work
    each template out once, so a deep model's passes do not redo the rules per layer."""
    import sys

    from nvtp.ir.build import make_op
    from nvtp.ir.graph import TensorValue
    from nvtp.sharding import rules

    checked = sys.modules["nvtp.ir.verify"]
    x = TensorValue("T0", (4, 8), DType.Float)
    op = make_op("permute", (x,), {"dims": (1, 0)}, ["T1"])
    copies = [op.renamed(lambda v, i=i: f"{v.name}_{i}", lambda v, i=i: f"{v.name}_{i}") for i in range(3)]
    calls = []
    rules._BY_STRUCTURE.clear()  # an earlier test's permute of this structure would be served from the cache
    real = rules._factors_of
    rules._factors_of = lambda o: calls.append(o) or real(o)
    try:
        got = [rules.factors_of(c) for c in copies]
    finally:
        rules._factors_of = real
    assert calls == [op] and all(f is got[0] for f in got) and got[0].results == [[(1,), (0,)]]
    checked._verify_op(copies[0], {"T0_0": copies[0].operands[0]})
    assert checked._TYPED.get(id(op)) is op
