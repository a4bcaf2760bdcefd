"""Every sharding rule, checked against the unsharded result by simulating the ranks.

For each op of each sample fusion (``tests/op_samples.py``) and each mesh size, the op is cut
out into a one-op fusion fed with the values its operands have in an unsharded run of the
sample. Then, for every decision the op's rule allows (nothing split, or one factor split with
inner split factor 1, 2, 3 or 4), the operands are sharded as the rule implies
(``propagate.implied``), every rank runs the op on its parts (threads, ``spmd.run_simulated``),
and the results, put back together as the rule says they are placed (shards in place, partial
sums added or max-ed, replicated values equal on every rank), must equal the op's unsharded
result: exactly for integers and booleans, within a relative error of 1e-5 (2e-2 for 16-bit
floats) otherwise. Random ops are no exception: the reference backend draws random tensors whole
from the seeded generator and slices them, so a sharded run draws the same numbers.

A case's id names it: ``<sample>:<op>@<index>-d<mesh size>-<decision>-<operand placements>-><result placements>``,
e.g. ``linear:linear@3-d2-f2x1-T0=S(2),T1=S(1),T2=R->T3=P(sum)`` (factor 2 of the rule split, inner
split factor 1).
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
from nvtp.ir.graph import INPUT_KINDS
from nvtp.sharding import propagate, rules
from nvtp.sharding.placements import (
    REPLICATE, DeviceMesh, Partial, Placement, Shard, _StridedShard, axis_split, divisibility_error, is_partial, local_shape,
)
from nvtp.sharding.propagate import NONE, Decision, as_decision, implied
from nvtp.sharding.rules import OpFactors, factors_of, tensor_operands
from tests.op_samples import SAMPLES, SAMPLES_BY_NAME

MESH_SIZES = (2, 4)
SPLITS = (1, 2, 3, 4)  # inner split factors tried for each factor (as_decision's are small divisors)
MAX_CASES = 12  # per op and mesh size, after removing decisions with the same placements
SEED = 1234
INPUT_SEED = 0


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
    s = SAMPLES_BY_NAME[name]
    values: dict[str, Any] = {}
    reference.run(s.build(), s.inputs(torch.Generator().manual_seed(INPUT_SEED)), seed=SEED, values=values)
    return values


@functools.cache
def prepared(name: str, op_index: int) -> Prepared:
    fusion = SAMPLES_BY_NAME[name].build()
    op = fusion.ops[op_index]
    one = one_op_fusion(fusion, op)
    values = sample_values(name)
    inputs = [values[v.name] for v in one.inputs]
    expected = reference.run(one, inputs, seed=SEED)
    return Prepared(one, op, inputs, expected, [values[v.name] for v in one.outputs])


# ---------------------------------------------------------------------------------------------
# the cases: decisions and the placements they imply


# Ops a partial sum may pass through unresolved (propagate.PARTIAL_PASS: "all" operands partial,
# "one" of them, or the "first"); each such decision is a claim about the op checked like a rule.
PARTIAL_PASS: dict[str, str] = getattr(propagate, "PARTIAL_PASS", {})


def decisions(op: Op, f: OpFactors, d: int) -> list[Decision]:
    """NONE, every valid split of every factor that is not blocked (split factor 1 first), then
    the partial sums the op lets pass (only numbers can be partial sums, and a cast only between
    floating-point types, as propagation allows)."""
    found = [NONE]
    for split in SPLITS:
        for g, (size, kind) in enumerate(zip(f.sizes, f.kinds)):
            if kind != "blocked" and size % (split * d) == 0:
                found.append(Decision(g, split))
    style = PARTIAL_PASS.get(op.kind)
    ts = tensor_operands(op)
    numeric = all(t.dtype is not DType.Bool for t in ts) and all(v.dtype is not DType.Bool for v in op.outputs)
    if style and ts and numeric and (op.kind != "cast" or (ts[0].dtype.is_float and op.arg("dtype").is_float)):
        options = {"all": [tuple(range(len(ts)))], "one": [(pos,) for pos in range(len(ts))], "first": [(0,)]}[style]
        found += [Decision(None, 1, positions) for positions in options]
    return found


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


def op_cases(sample: str, op_index: int, op: Op, d: int) -> tuple[list[Case], int]:
    """The cases of one op on ``d`` devices (at most MAX_CASES) and how many more were left out."""
    f = factors_of(op)
    cases: list[Case] = []
    seen: set[tuple] = set()
    for dec in decisions(op, f, d):
        found = placements(op, f, dec, d)
        if found is None or found in seen:
            continue
        seen.add(found)
        cases.append(Case(sample, op_index, op.kind, d, dec, decision_label(f, dec), *found))
    return cases[:MAX_CASES], max(0, len(cases) - MAX_CASES)


def checked_ops() -> list[tuple[str, int, Op]]:
    """(sample, op index, op) of every compute op with a tensor result."""
    found = []
    for s in SAMPLES:
        for i, op in enumerate(s.build().ops):
            if op.kind not in INPUT_KINDS and any(isinstance(v, TensorValue) for v in op.outputs):
                found.append((s.name, i, op))
    return found


OPS = checked_ops()
CASES: list[Case] = []
LEFT_OUT = 0
for _name, _i, _op in OPS:
    for _d in MESH_SIZES:
        _cases, _more = op_cases(_name, _i, _op, _d)
        CASES += _cases
        LEFT_OUT += _more


# ---------------------------------------------------------------------------------------------
# running the ranks and comparing


@dataclass
class OneOpSharded:
    """What ``spmd.run_simulated`` needs of a sharded fusion."""

    fusion: Fusion
    mesh: DeviceMesh
    shardings: dict[str, tuple[Placement, ...]]

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


def compare(v: TensorValue, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype), \
        f"{what}: {v.name} came out {got.dtype}{list(got.shape)}, unsharded {want.dtype}{list(want.shape)}"
    if v.dtype.is_float or v.dtype.is_complex:
        rel, worst = relative_error(got, want)
        assert rel <= tolerance(v.dtype), f"{what}: {v.name} relative error {rel:.3g} (max abs {worst:.3g}) > {tolerance(v.dtype)}"
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
    for i, v in enumerate(one.outputs):
        got = assemble(v, sharded.placement(v.name), [r[i] for r in per_rank], case.d)
        compare(v, got, expected[i], what)


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


@pytest.mark.parametrize("sample, op_index", [pytest.param(s, i, id=f"{s}:{op.kind}@{i}") for s, i, op in OPS])
def test_one_op_fusion_reproduces_the_sample(sample: str, op_index: int):
    """The cut-out op computes what it computed inside its sample (so the cases test that op)."""
    prep = prepared(sample, op_index)
    for v, got, want in zip(prep.fusion.outputs, prep.expected, prep.in_sample):
        assert _same(got, want), f"{prep.op}: {v.name} alone differs from {v.name} in sample {sample}"


def test_the_cases_cover_every_rule_the_samples_use():
    """Every op kind in the samples is checked, and sharded somewhere unless its rule blocks every factor."""
    kinds = {op.kind for _, _, op in OPS}
    split = {c.kind for c in CASES if c.decision.factor is not None}
    never = sorted(k for k in kinds - split
                   if any(kind != "blocked" for _, _, op in OPS if op.kind == k for kind in factors_of(op).kinds))
    assert not never, f"ops whose rule allows a split but no case splits them: {never}"
    assert len(CASES) > 1000 and LEFT_OUT < len(CASES) // 10, (len(CASES), LEFT_OUT)


# -- the check can fail ------------------------------------------------------------------------


def _cases_of(sample: str, kind: str) -> list[Case]:
    fusion = SAMPLES_BY_NAME[sample].build()
    out = []
    for i, op in enumerate(fusion.ops):
        if op.kind == kind:
            for d in MESH_SIZES:
                out += op_cases(sample, i, op, d)[0]
    return out


def test_a_reduce_factor_marked_pass_is_caught(monkeypatch):
    """sum with its reduced axis as a pass factor: each rank's partial sum would pass as the whole."""
    right = rules.RULES["sum"]

    def wrong(op: Op) -> OpFactors:
        f = right(op)
        f.kinds = ["pass" if k == "reduce" else k for k in f.kinds]
        return f

    monkeypatch.setitem(rules.RULES, "sum", wrong)
    cases = [c for c in _cases_of("sum", "sum") if c.decision.factor is not None]
    caught = []
    for c in cases:
        try:
            run_case(c)
        except AssertionError as e:
            caught.append(str(e))
    assert caught, "a rule that forgets a partial sum went unnoticed"
    assert any("replicated" in m.lower() or "differs" in m or "relative error" in m for m in caught), caught


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
    """A fusion of tensor inputs ``operands`` and the op ``make(builder, *inputs)`` adds; (fusion, op)."""
    b = FusionBuilder("single")
    result = make(b, *[b.define_tensor(shape, dt) for shape, dt in operands])
    for v in result if isinstance(result, tuple) else (result,):
        b.add_output(v)
    f = b.build()
    return f, f.ops[-1]


def check_targeted(f: Fusion, op: Op, operand: int, placement: Placement, d: int, inputs: list[torch.Tensor]) -> Case:
    """The decision tensor operand ``operand`` placed ``placement`` implies, checked by simulation;
    returns the case (its placements) for the caller to assert on."""
    rule = factors_of(op)
    dec = as_decision(rule.operands[operand], rule, placement, d)
    assert dec is not None and dec is not NONE, f"{op}: no decision gives operand {operand} {placement}"
    found = placements(op, rule, dec, d)
    assert found is not None, f"{op}: decision {dec} cannot be placed"
    case = Case(f.name, f.ops.index(op), op.kind, d, dec, decision_label(rule, dec), *found)
    one = one_op_fusion(f, op)
    check_sharded(one, inputs, reference.run(one, inputs, seed=SEED), case, f"{op} ({describe_case(case)})")
    return case


def _randn(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(math.prod(shape))).to(dtype)


F32 = DType.Float


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
