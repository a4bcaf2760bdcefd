"""Long fusion files in nvFuser's format, written as text (no nvtp code), for the scale tests.

    .venv/bin/python -m tests.long_fusions chain 100000 > /tmp/chain.py     # one weight, reused
    .venv/bin/python -m tests.long_fusions mlp 10000 > /tmp/mlp.py          # a weight pair per layer
    .venv/bin/python -m tests.long_fusions pointwise 100000 > /tmp/pw.py    # no weight at all

Each kind has about ``ops`` statements in its definition (inputs, ops and outputs together):

* ``chain``: ``x = tanh(linear(x, W))`` over and over with one parameter ``W`` ([C, C]), the
  shape of a recurrent cell unrolled (the megatron plan's partner search once took cubic time here);
* ``mlp``: ``x = x + linear(relu(linear(x, W1_i)), W2_i)`` per layer, each with its own pair
  (the megatron plan pairs every W1_i column-wise with its W2_i row-wise);
* ``pointwise``: ``x = tanh(x * 0.5 + 1.0)``, elementwise only: the parser, verifier and printer
  at depth with nothing to pair.

The files are what a user's own generator or an nvFuser repro script would give: the parser sees
them as it sees any dump (``nvtp explain FILE``, ``nvtp shard FILE``, ``nvtp replay FILE``).
"""

from __future__ import annotations

import sys

HEADER = '''# {kind} of {ops} ops, written by tests/long_fusions.py for the scale tests.
import torch
from nvfuser_direct import FusionDefinition, DataType

nvtp_info = {{
    "fusion": {{"role": "forward"}},
    "values": {{
{values}
    }},
}}

def nvfuser_fusion_id0(fd : FusionDefinition) -> None :
'''

FOOTER = '''
with FusionDefinition() as fd:
    nvfuser_fusion_id0(fd)

inputs = [
{inputs}
]
fd.execute(inputs)
'''


def _tensor(name: str, shape: tuple[int, ...]) -> str:
    contiguity = ", ".join("None" if n == 1 else "True" for n in shape)
    order = ", ".join(str(i) for i in range(len(shape) - 1, -1, -1))
    return (f"    {name} = fd.define_tensor(shape={list(shape)}, contiguity=[{contiguity}], dtype=DataType.Float, "
            f"is_cpu=False, stride_order=[{order}])")


def text(kind: str, ops: int, *, batch: int = 4, width: int = 8) -> str:
    """The file of ``kind`` (chain, mlp, pointwise) with about ``ops`` statements."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {sorted(KINDS)}")
    return KINDS[kind](ops, batch, width)


def _file(kind: str, n_ops: int, values: dict[str, tuple[str, str]], shapes: list[tuple[int, ...]], body: list[str]) -> str:
    info = "\n".join(f'        "{name}": {{"role": "{role}", "label": "{label}"}},' for name, (role, label) in values.items())
    inputs = "\n".join(f"    torch.testing.make_tensor({tuple(s)}, dtype=torch.float32, device='cuda:0')," for s in shapes)
    return HEADER.format(kind=kind, ops=n_ops, values=info) + "\n".join(body) + "\n" + FOOTER.format(inputs=inputs)


def _chain(ops: int, batch: int, width: int) -> str:
    body = [_tensor("T0", (batch, width)), _tensor("T1", (width, width))]
    values = {"T0": ("activation", "x"), "T1": ("parameter", "w")}
    x, k = "T0", 2
    while k < ops - 1:
        body.append(f"    T{k} = fd.ops.linear({x}, T1)")
        body.append(f"    T{k + 1} = fd.ops.tanh(T{k})")
        x, k = f"T{k + 1}", k + 2
    body.append(f"    fd.add_output({x})")
    values[x] = ("output", "y")
    return _file("chain", len(body), values, [(batch, width), (width, width)], body)


def _mlp(ops: int, batch: int, width: int) -> str:
    layers = max(1, (ops - 2) // 6)  # two weights and four ops a layer, and the output
    body = [_tensor("T0", (batch, width))]
    values = {"T0": ("activation", "x")}
    shapes = [(batch, width)]
    x, k = "T0", 1
    for i in range(layers):
        w1, w2 = f"T{k}", f"T{k + 1}"
        body += [_tensor(w1, (4 * width, width)), _tensor(w2, (width, 4 * width))]
        values[w1], values[w2] = ("parameter", f"h.{i}.fc.weight"), ("parameter", f"h.{i}.proj.weight")
        shapes += [(4 * width, width), (width, 4 * width)]
        body += [f"    T{k + 2} = fd.ops.linear({x}, {w1})", f"    T{k + 3} = fd.ops.relu(T{k + 2})",
                 f"    T{k + 4} = fd.ops.linear(T{k + 3}, {w2})", f"    T{k + 5} = fd.ops.add({x}, T{k + 4})"]
        x, k = f"T{k + 5}", k + 6
    body.append(f"    fd.add_output({x})")
    values[x] = ("output", "y")
    return _file("mlp", len(body), values, shapes, body)


def _pointwise(ops: int, batch: int, width: int) -> str:
    body = [_tensor("T0", (batch, width))]
    x, k = "T0", 1
    while k < ops - 2:
        body += [f"    T{k} = fd.ops.mul({x}, 0.5)", f"    T{k + 1} = fd.ops.add(T{k}, 1.0)", f"    T{k + 2} = fd.ops.tanh(T{k + 1})"]
        x, k = f"T{k + 2}", k + 3
    body.append(f"    fd.add_output({x})")
    return _file("pointwise", len(body), {"T0": ("activation", "x"), x: ("output", "y")}, [(batch, width)], body)


KINDS = {"chain": _chain, "mlp": _mlp, "pointwise": _pointwise}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in KINDS or not sys.argv[2].isdigit():
        raise SystemExit(f"usage: python -m tests.long_fusions {{{'|'.join(KINDS)}}} OPS > FILE")
    sys.stdout.write(text(sys.argv[1], int(sys.argv[2])))
