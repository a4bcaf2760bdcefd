"""The IR's own contracts: the verifier catches malformed fusions, nvFuser's printed definitions
parse, and the simplification passes never change a result."""

from __future__ import annotations

import pytest
import torch

from nvtp.execute import reference
from nvtp.ir import DType, FusionBuilder, IRError, format_file, verify
from nvtp.ir.graph import Fusion, Op, TensorValue
from nvtp.ir.parser import DumpError, parse
from nvtp.ir.simplify import common_subexpressions, fold_casts, unpad_gathers


def test_nvfusers_own_printout_parses_and_computes_the_same():
    """`print(fd)` is nvFuser's translation of its IR back to Python (`tv0`, scalars as `c12`,
    `welford` for var_mean): nvtp reads it and computes what nvtp's original computed."""
    from nvtp.execute.nvfuser import build_definition

    b = FusionBuilder()
    x = b.define_tensor([4, 8], DType.Float)
    w = b.define_tensor([6, 8], DType.Float)
    y = b.op("linear", x, w)
    var, mean = b.op("var_mean", y, dims=[1], correction=0)
    b.add_output(b.op("mul", y, 0.5))
    b.add_output(var)
    b.add_output(mean)
    original = verify(b.build())
    printed = str(build_definition(original))
    assert "fd.ops.welford" in printed and "tv0" in printed
    text = "import torch\nfrom nvfuser_direct import FusionDefinition, DataType\n" + printed + \
        "\nwith FusionDefinition() as fd:\n    nvfuser_fusion(fd)\n"
    parsed = parse(text).fusion
    inputs = [torch.randn(4, 8, dtype=torch.float64).float(), torch.randn(6, 8).float()]
    for got, want in zip(reference.run(parsed, inputs), reference.run(original, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _fusion(ops, outputs):
    return Fusion(tuple(ops), tuple(outputs))


def test_the_verifier_names_what_is_wrong():
    b = FusionBuilder()
    x = b.define_tensor([2, 3], DType.Float)
    y = b.op("exp", x)
    b.add_output(y)
    good = b.build()
    verify(good)
    wrong_shape = TensorValue(y.name, (3, 2), y.dtype)
    bad = good.with_ops((good.ops[0], Op("exp", good.ops[1].args, (wrong_shape,))), (wrong_shape,))
    with pytest.raises(IRError, match=r"result T1: Float\[3, 2\] should be Float\[2, 3\]"):
        verify(bad)
    undefined = TensorValue("T9", (2, 3), DType.Float)
    with pytest.raises(IRError, match="T9 is used before it is defined"):
        verify(good.with_ops((good.ops[0], Op("exp", (("arg", undefined),), (y,)))))
    with pytest.raises(IRError, match="defined twice"):
        verify(good.with_ops(good.ops + (good.ops[1],)))


def _refused(kind: str, dtypes: list[DType], **kwargs):
    b = FusionBuilder()
    args = [b.define_tensor([4, 4], dt) for dt in dtypes]
    r = b.op(kind, *args, **kwargs)
    b.add_output(r[0] if isinstance(r, tuple) else r)
    return b.build()


# Operand dtypes nvFuser refuses though the op table infers a result for them: one per rule of
# the op table (``OpSpec.dtypes`` and ``typed``), with what the error says.
_REFUSED = [
    ("erf", [DType.ComplexFloat], {}, r"fd.ops.erf takes no complex operands"),
    ("neg", [DType.Bool], {}, r"fd.ops.neg takes no Bool operands"),
    ("sub", [DType.Bool, DType.Bool], {}, r"fd.ops.sub takes numeric \(not only Bool\) operands"),
    ("frac", [DType.Int], {}, r"fd.ops.frac takes floating-point \(Half, BFloat16, Float or Double\) operands"),
    ("var", [DType.Int], {"dims": [1]}, r"fd.ops.var takes floating-point or complex operands"),
    ("bitwise_and", [DType.Float, DType.Float], {}, r"fd.ops.bitwise_and takes integer or Bool operands"),
    ("matmul", [DType.Float, DType.Half], {}, r"fd.ops.matmul takes same-typed operands"),
    ("where", [DType.Float, DType.Float, DType.Float], {}, r"fd.ops.where needs DataType.Bool values \(condition\)"),
    ("take_along_axis", [DType.Float, DType.Int32], {"dim": 1}, r"fd.ops.take_along_axis needs DataType.Int indices \(index\)"),
    ("gather", [DType.Float, DType.Float], {"dim": 1}, r"fd.ops.gather needs DataType.Int or DataType.Int32 indices \(index\)"),
]


@pytest.mark.parametrize("kind, dtypes, kwargs, message", _REFUSED, ids=[c[0] for c in _REFUSED])
def test_verify_refuses_the_operand_dtypes_the_parser_refuses(kind, dtypes, kwargs, message):
    """A fusion built in Python is held to the same operand dtypes as one read from a file:
    verify() and the parser both refuse it, with the same message (before the op table held
    these rules, only the parser applied them and verify() passed every case here)."""
    fusion = _refused(kind, dtypes, **kwargs)
    with pytest.raises(IRError, match=message):
        verify(fusion)
    with pytest.raises(DumpError, match=message):
        parse(format_file(fusion))


def test_printed_numbers_are_exact():
    b = FusionBuilder()
    x = b.define_tensor([3], DType.Float)
    b.add_output(b.op("mul", x, 1 / 3))
    b.add_output(b.op("maximum", x, float("-inf")))
    f = verify(b.build())
    text = format_file(f)
    assert "0.3333333333333333" in text and '-float("inf")' in text
    assert parse(text).fusion == f


def _random_casts(seed):
    g = torch.Generator().manual_seed(seed)
    chain = [DType.Float, DType.BFloat16, DType.Half, DType.Double]
    b = FusionBuilder()
    x = b.define_tensor([64], [DType.BFloat16, DType.Half, DType.Float][seed % 3])
    v = x
    outs = []
    for _ in range(6):
        dt = chain[int(torch.randint(0, 4, (1,), generator=g))]
        v = b.op("cast", v, dtype=dt) if v.dtype != dt else v
        if torch.rand(1, generator=g) < 0.4:
            outs.append(v)
    outs.append(b.op("cast", v, dtype=x.dtype) if v.dtype != x.dtype else b.op("set", v))
    for o in outs:
        b.add_output(o)
    return verify(b.build()), x.dtype


@pytest.mark.parametrize("seed", range(12))
def test_cast_folding_is_bit_exact(seed):
    f, dt = _random_casts(seed)
    folded = verify(fold_casts(f))
    assert len(list(folded.compute_ops())) <= len(list(f.compute_ops()))
    x = (torch.randn(64) * 100).to(dt.torch)
    for a, b in zip(reference.run(f, [x]), reference.run(folded, [x])):
        assert torch.equal(a, b)


def test_common_subexpressions_merge_equal_ops_but_not_random_ones():
    b = FusionBuilder()
    x = b.define_tensor([8], DType.Float)
    b.add_output(b.op("add", b.op("exp", x), b.op("exp", x)))
    u1 = b.op("uniform", 0.0, 1.0, shape=[8], dtype=DType.Float)
    u2 = b.op("uniform", 0.0, 1.0, shape=[8], dtype=DType.Float)
    b.add_output(b.op("sub", u1, u2))
    f = verify(b.build())
    merged = verify(common_subexpressions(f))
    kinds = [op.kind for op in merged.compute_ops()]
    assert kinds.count("exp") == 1 and kinds.count("uniform") == 2


def test_unpadding_thunders_ignore_index_trick_is_exact():
    """take_along_axis(pad(x, one zero column), where(valid, t, C)) == where(valid, x[t], 0)."""
    b = FusionBuilder()
    x = b.define_tensor([5, 7], DType.Float)
    t = b.define_tensor([5, 1], DType.Int)
    valid = b.op("ne", t, -100)
    index = b.op("where", valid, t, 7)
    padded = b.op("pad", x, [0, 1, 0, 0], 0.0)
    b.add_output(b.op("take_along_axis", padded, index, 1))
    f = verify(b.build())
    rewritten = verify(unpad_gathers(f))
    assert "pad" not in [op.kind for op in rewritten.compute_ops()]
    xs = torch.randn(5, 7)
    ts = torch.tensor([[0], [6], [-100], [3], [-100]])
    assert torch.equal(reference.run(f, [xs, ts])[0], reference.run(rewritten, [xs, ts])[0])


def test_a_truncated_file_is_refused_with_its_line(tmp_path):
    b = FusionBuilder()
    x = b.define_tensor([3], DType.Float)
    b.add_output(b.op("exp", x))
    text = format_file(verify(b.build()))
    cut = text[: text.index("fd.ops.exp(") + len("fd.ops.exp(T")]  # mid-call
    with pytest.raises(DumpError, match=r"<dump>:\d+: not valid Python"):
        parse(cut)


def test_a_renamed_op_changes_only_names_and_keeps_its_template():
    """``Op.renamed`` gives the same op on renamed values; it remembers the op it was copied from
    (the root, through copies of copies), which equality ignores, and any other change drops it."""
    from dataclasses import replace

    from nvtp.ir.build import make_op

    x, y = TensorValue("T0", (4, 8), DType.Float), TensorValue("T1", (4, 8), DType.Float)
    op = make_op("add", (x, y), {}, ["T2"])
    copy = op.renamed(lambda v: v.name + "b", lambda v: "T9")
    again = copy.renamed(lambda v: "A" if v.name == "T0b" else v.name)
    assert [(v.name, v.shape, v.dtype) for v in copy.operands] == [("T0b", (4, 8), DType.Float), ("T1b", (4, 8), DType.Float)]
    assert copy.outputs == (TensorValue("T9", (4, 8), DType.Float),) and again.outputs == copy.outputs
    assert [v.name for v in again.operands] == ["A", "T1b"]
    assert op.template is None and copy.template is op and again.template is op
    assert again == Op("add", again.args, again.outputs) and hash(again) == hash(Op("add", again.args, again.outputs))
    assert replace(copy, outputs=(TensorValue("T9", (2, 8), DType.Float),)).template is None
    flip = make_op("permute", (x,), {"dims": (1, 0)}, ["T3"]).renamed(lambda v: "T5")
    assert flip.template is not None and flip.with_args(dims=(0, 1)).template is None
