"""The communication nvFuser inserts itself into a sharded file: a *resharding expression*, an op
whose operand is not placed where the op, writing its results as the file places them, needs it.

nvFuser's own overlap tests (and nvtp's collective-matmul files, ``nvtp.sharding.collective_matmul``)
write ``y = linear(x, w)`` with ``x``'s rows split over the devices and ``y``'s rows whole (split
over streams only): nvFuser gathers ``x`` as part of the product. A file nvtp shards itself has a
``set`` for every communication, but a replay must run what nvFuser runs, so ``implicit_reshards``
finds each such op by the sharding rules (``nvtp.sharding.rules``: the decision that gives the
op's results their placements and reads the most operands as they are) and puts the ``set``
nvFuser would before it. On a 1-D mesh; where no decision gives an op's results the file's
placements, the op is left as written (the rules cannot say what nvFuser would do).
"""

from __future__ import annotations

from nvtp.ir.build import make_op
from nvtp.ir.graph import INPUT_KINDS, Fusion, Op, TensorValue, fresh_names
from nvtp.sharding.placements import DeviceMesh, Placement, is_partial
from nvtp.sharding.propagate import SUM, Decision, NONE, as_decision, implied, reshard_bytes
from nvtp.sharding.reshard import ReshardStep
from nvtp.sharding.rules import OpFactors, factors_of


def _decisions(op: Op, f: OpFactors, have: list[Placement], results: list[Placement], d: int) -> list[Decision]:
    """The decisions worth trying for ``op``: replicated, the ones its operands' and results'
    placements imply, each reduction factor split (a partial result), and a partial sum passed on."""
    found = [NONE]
    for axes, p in [*zip(f.operands, have), *zip(f.results, results)]:
        if axes is not None:
            dec = as_decision(axes, f, p, d)
            if dec is not None:
                found.append(dec)
    if any(is_partial(p) for p in results):
        found += [Decision(g) for g, kind in enumerate(f.kinds) if kind == "reduce" and f.sizes[g] % d == 0]
        partial = tuple(pos for pos, p in enumerate(have) if p == SUM)
        if partial:
            found += [Decision(None, 1, partial), *(Decision(None, 1, (pos,)) for pos in partial)]
    return list(dict.fromkeys(found))


def _needs(op: Op, placements: dict[str, Placement], d: int) -> list[tuple[str, Placement]]:
    """(operand, placement) for each operand nvFuser would reshard before ``op``; [] if none (or if
    no decision gives its results their placements)."""
    f = factors_of(op)
    operands = op.tensor_operands
    have = [placements[v.name] for v in operands]
    outs = [(axes, placements[v.name]) for axes, v in zip(f.results, op.outputs) if isinstance(v, TensorValue)]
    best: list[tuple[str, Placement]] | None = None
    for dec in _decisions(op, f, have, [p for _, p in outs], d):
        if any(implied(axes, f, dec, result=True) != p for axes, p in outs):
            continue
        wants = [implied(axes, f, dec, result=False, position=pos) for pos, axes in enumerate(f.operands)]
        wrong = [(v.name, w) for v, h, w in zip(operands, have, wants) if h != w]
        if best is None or len(wrong) < len(best):
            best = wrong
        if not wrong:
            break
    return list(dict.fromkeys(best or []))


def implicit_reshards(fusion: Fusion, placements: dict[str, Placement], mesh: DeviceMesh
                      ) -> tuple[Fusion, dict[str, Placement], dict[str, ReshardStep]]:
    """``fusion`` with a ``set`` before each resharding expression (placements on the 1-D ``mesh``),
    the placements of the new values, and the step each new ``set`` runs."""
    if mesh.ndim != 1 or mesh.size == 1:
        return fusion, placements, {}
    d = mesh.size
    names = fresh_names(fusion)
    ops: list[Op] = []
    placements = dict(placements)
    made: dict[str, ReshardStep] = {}
    converted: dict[tuple[str, Placement], str] = {}  # (value, placement) -> the set's result
    values = fusion.values
    for i, op in enumerate(fusion.ops):
        if op.kind in INPUT_KINDS or op.kind == "set" or not op.tensor_operands:
            ops.append(op)
            continue
        swap = {}
        for name, want in _needs(op, placements, d):
            key = (name, want)
            if key not in converted:
                v = values[name]
                step = ReshardStep(name, placements[name], want, (i,), v.nbytes, round(reshard_bytes(placements[name], want, v.nbytes, d)))
                step.kind  # noqa: B018 - refuses a conversion no collective makes, before anything runs
                set_op = make_op("set", (v,), {}, [next(names)])
                ops.append(set_op)
                converted[key] = set_op.outputs[0].name
                placements[converted[key]] = want
                made[converted[key]] = step
            swap[name] = converted[key]
        ops.append(op.renamed(lambda v: swap.get(v.name, v.name)) if swap else op)
    if not made:
        return fusion, placements, {}
    return fusion.with_ops(tuple(ops)), placements, made
