"""The op table: every op nvtp knows, with nvFuser's signature and its shape/dtype inference.

One ``OpSpec`` per op, registered from families, one module each (``inputs``, ``elementwise``,
``reductions``, ``shapes``, ``matmul``, ``factories``, ``indexing``, ``moe``). A spec's parameters use
nvFuser's Python names; the first ``positional`` of them print positionally, the rest as keywords
(omitted when equal to their default). ``infer`` returns one ``Out`` per result. The spec also
holds every fact a pass reads about the op (operand dtypes, linearity, layout, randomness, loop
domain: ``OpSpec``), each set in one place, ``facts.py``, after every family has registered.

A new op goes into its family's module (or a new family module imported below) and its facts
into ``facts.py``; ``tests/test_ops.py`` fails if it lacks one.

Other concerns keep their own tables keyed by the same op names: sharding rules
(``nvtp.sharding.rules``), torch implementations (``nvtp.execute.reference``), nvFuser emission
(``nvtp.ir.printer``, ``nvtp.execute.nvfuser``), Thunder translation (``nvtp.frontend.translate``).
"""

from nvtp.ir.ops.table import (
    OPS, REQUIRED, IRError, OpSpec, Out, Param, bind, broadcast_shapes, dtype_of, infer, norm_dim, register, spec,
)
from nvtp.ir.ops import inputs  # noqa: F401  (each family registers its ops on import, in this order)
from nvtp.ir.ops.elementwise import (
    BINARY, BINARY_ARITH, BINARY_FLOAT, COMPARE, COMPUTE_IN_FLOAT, POINTWISE, UNARY, UNARY_FLOAT, UNARY_PREDICATE,
    UNARY_SAME,
)
from nvtp.ir.ops.reductions import REDUCTION
from nvtp.ir.ops.shapes import pad_pairs, slice_bounds
from nvtp.ir.ops.matmul import matmul_shape
from nvtp.ir.ops import factories, indexing, moe  # noqa: F401
from nvtp.ir.ops.facts import DTYPE_HINTS, DTYPE_RULES, OPERAND_RULES, RANDOM, check_operand_dtypes

__all__ = [
    "BINARY", "BINARY_ARITH", "BINARY_FLOAT", "COMPARE", "COMPUTE_IN_FLOAT", "DTYPE_HINTS", "DTYPE_RULES", "IRError",
    "OPERAND_RULES", "OPS", "OpSpec", "Out", "POINTWISE", "Param", "RANDOM", "REDUCTION", "REQUIRED", "UNARY",
    "UNARY_FLOAT", "UNARY_PREDICATE", "UNARY_SAME", "bind", "broadcast_shapes", "check_operand_dtypes", "dtype_of",
    "infer", "matmul_shape", "norm_dim", "pad_pairs", "register", "slice_bounds", "spec",
]
