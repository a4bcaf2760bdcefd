"""nvtp's ops that nvFuser lacks, written with nvFuser's own ops.

``gather_mm`` and ``gather_mm_wgrad`` (``nvtp/ir/ops/moe.py``) are nvFuser's ``grouped_mm`` with
the grouping done in the fusion: a stable ``argsort`` of the rows by expert, the rows gathered in
that order (``index_select``), each expert's offset (the rows whose expert is at most it: a
compare with an ``iota`` and a ``sum``, no host synchronisation), ``grouped_mm``, and the rows put
back (``argsort`` of a permutation is its inverse). The class below is the one source: the nvFuser
backend calls it (nvfuser_direct is imported only when a method runs), and a dump that uses one of these ops carries its text (``nvtp.ir.printer``),
which the parser accepts only verbatim. docs/moe.md has what this costs and what nvFuser would need.
"""

from __future__ import annotations

import ast
import inspect
import textwrap


class nvtp_ops:  # noqa: N801 - the name a dump calls: nvtp_ops.gather_mm(fd, ...)
    """nvtp's ops that nvFuser lacks, written with nvFuser's ops (nvtp/ir/composites.py)."""

    @staticmethod
    def expert_offsets(fd, index, experts):
        # [E] Int32: for expert e, how many rows go to experts 0..e (where its rows end once sorted)
        from nvfuser_direct import DataType  # optional: nvfuser_direct (the nvFuser backend only)

        ids = fd.ops.broadcast(index, [False, True])
        zero, one = fd.define_scalar(0, dtype=DataType.Int), fd.define_scalar(1, dtype=DataType.Int)
        es = fd.ops.broadcast(fd.ops.iota(experts, zero, one, dtype=DataType.Int), [True, False])
        return fd.ops.sum(fd.ops.cast(fd.ops.le(ids, es), DataType.Int32), dims=[0], dtype=DataType.Int32)

    @staticmethod
    def gather_mm(fd, arg1, arg2, index):
        # y[s] = arg1[s] @ arg2[index[s]]: rows sorted by expert, grouped_mm, rows put back
        order = fd.ops.argsort(index, dim=0, descending=False, stable=True)
        offsets = nvtp_ops.expert_offsets(fd, index, fd.ops.size(arg2, 0))
        rows = fd.ops.grouped_mm(fd.ops.index_select(arg1, order, 0), arg2, offsets)
        return fd.ops.index_select(rows, fd.ops.argsort(order, dim=0, descending=False, stable=True), 0)

    @staticmethod
    def gather_mm_wgrad(fd, arg1, arg2, index, groups):
        # dw[e] = sum over the rows s of expert e of arg1[s]^T arg2[s]: grouped_mm over the sorted rows
        from nvfuser_direct import DataType  # optional: nvfuser_direct (the nvFuser backend only)

        order = fd.ops.argsort(index, dim=0, descending=False, stable=True)
        offsets = nvtp_ops.expert_offsets(fd, index, fd.define_scalar(groups, dtype=DataType.Int))
        rows = fd.ops.permute(fd.ops.index_select(arg1, order, 0), [1, 0])
        return fd.ops.grouped_mm(rows, fd.ops.index_select(arg2, order, 0), offsets)


COMPOSITES = frozenset({"gather_mm", "gather_mm_wgrad"})
NAME = nvtp_ops.__name__


def source() -> str:
    """The class's text, as a dump carries it."""
    return textwrap.dedent(inspect.getsource(nvtp_ops))


def is_source(node: ast.ClassDef) -> bool:
    """Whether a dump's class is this one, verbatim (the parser accepts no other code)."""
    return ast.dump(node) == ast.dump(ast.parse(source()).body[0])
