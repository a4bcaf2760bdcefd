"""nvFuser's loop domain of an op's result before scheduling: its logical axes, then the axes it
reduces (``OpSpec.loop_reduce``: sums, max, var_mean) or contracts (``OpSpec.loop_contract``:
linear, matmul). A device schedule's ``T.axis(i)`` and ``T.split(i, k)`` count in it."""

from __future__ import annotations

from nvtp.ir.graph import Op, TensorValue
from nvtp.ir.ops import norm_dim, spec


def loop_axes(op: Op, result: int) -> list[tuple[str, int]]:
    """nvFuser's loop domain of ``op``'s result ``result`` before scheduling: ("dim", i) for
    logical axis i, ("reduce", j) for a reduction over operand axis j."""
    v = op.outputs[result]
    dims = [("dim", i) for i in range(len(v.shape))]
    if result in spec(op.kind).loop_reduce:
        x = op.tensor_operands[0]
        if op.arg_dict.get("keepdim"):
            return dims
        red = op.arg("dims")
        red = set(range(x.ndim)) if red is None else {norm_dim(d, x.ndim) for d in red}
        out, k = [], 0
        for j in range(x.ndim):
            if j in red and x.shape[j] == 1:
                continue  # nvFuser squeezes a reduced broadcast (size-1) axis instead of reducing it
            if j in red:
                out.append(("reduce", j))
            else:
                out.append(("dim", k))
                k += 1
        return out
    if spec(op.kind).loop_contract:
        return dims + [("reduce", op.tensor_operands[0].ndim - 1)]
    return dims


def loop_extents(op: Op | None, result: int, v: TensorValue) -> list[int]:
    """The extent of each axis of ``loop_axes`` (``op`` None: an input, its logical axes)."""
    if op is None:
        return list(v.shape)
    sizes = []
    for kind, j in loop_axes(op, result):
        # a reduction axis: axis j of the first operand (for a matmul its last, contracted axis)
        sizes.append(v.shape[j] if kind == "dim" else op.tensor_operands[0].shape[j])
    return sizes
