"""Pipeline stages cut by the compiler from the traced program, at block boundaries.

    staged = cut_stages(traced, prefix="h", blocks=4, stages=2)      # balanced by cost
    staged = cut_stages(traced, prefix="h", blocks=4, stages=2, cut=(1,))  # blocks [0, 1) and [1, 4)
    staged.stages[0].traced       # stage 0's forward and backward fusions, a ``nvtp.traced.Traced``
    staged.transfers              # what crosses each cut: point-to-point on the pp axis, with its bytes

Input: the *whole* traced forward and backward fusions (``driver.trace``, tied weights left as
one input per name, so each use's gradient is its own output). Every op gets the stage it runs
in, by the same dataflow reading ``nvtp.frontend.regional`` uses to find blocks, with no model
names:

* forward: an op's block is the highest block among the block parameters it depends on; it runs
  in that block's stage. An op depending on no block parameter (the embedding, a mask, an
  ``arange``) is *free*: it runs in every stage that needs it (recomputed, never sent).
* backward: a value's stage is the lowest stage among the forward values and parameters it
  depends on (a saved value counts in the last stage that holds it in the forward, so a block's
  input, received from the stage before, counts in the block's stage). So every backward op runs
  where its forward ran, gradients flow from the last stage to the first, and an op reading only
  the loss's gradient is free as above.

A value one stage makes and a later stage reads is a ``Transfer`` (a point-to-point send on the
pp axis, in the forward; its gradient goes back in the backward). Anything that does not fit (a
backward op reading a value its stage does not hold, a parameter two stages read that is not a
tie) raises ``StageError`` naming it. Each stage becomes a ``Traced`` of its own fusions, whose
arguments are the caller's and the values it receives: the compile driver shards it over the
stage's (dp, tp) sub-mesh like any module.

Costs (``Cost``): flops (2mnk per matmul, 4·q·k per attention, one per element written for the
rest) and bytes written, forward and backward, per block; the balance picks the contiguous split
of blocks minimising the largest stage's flops (then bytes), the head (embedding) counted with
block 0 and the tail (final norm, head, loss) with the last block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from nvtp.ir.graph import Fusion, Op, TensorValue, ValueInfo, defines_input
from nvtp.ir.simplify import dead_code
from nvtp.sharding.propagate import ShardingError
from nvtp.traced import Traced


class StageError(ShardingError):
    """A cut nvtp cannot make; says what and how to fix it (bad input: refused before any work)."""


@dataclass(frozen=True)
class Cost:
    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


@dataclass(frozen=True)
class Transfer:
    """One value crossing a cut, per microbatch: sent by stage ``src``, received by ``dst``."""

    phase: str  # "forward" (an activation) or "backward" (its gradient)
    src: int
    dst: int
    value: str  # its name in the whole traced fusion of that phase
    label: str  # its label in both stages' fusions
    shape: tuple[int, ...]
    dtype: str
    nbytes: int  # the whole microbatch's (a dp rank sends its 1/dp)


@dataclass
class Stage:
    index: int
    blocks: tuple[int, ...]
    traced: object  # nvtp.traced.Traced: this stage's fusions
    parameters: list[str]  # labels of the parameters it reads
    cost: Cost = field(default_factory=Cost)


@dataclass
class Staged:
    stages: list[Stage]
    transfers: list[Transfer]
    block_costs: list[Cost]
    prefix: str
    blocks: int
    chosen: str  # "balanced" or "explicit"

    def owners(self, label: str) -> list[int]:
        """The stages that hold parameter ``label``."""
        return [s.index for s in self.stages if label in s.parameters]


def _block_index(label: str, prefix: str) -> int | None:
    if not label.startswith(prefix + "."):
        return None
    idx = label[len(prefix) + 1:].split(".", 1)[0]
    return int(idx) if idx.isdigit() else None


def op_cost(op: Op) -> Cost:
    """Flops and bytes written of one op (whole shapes)."""
    outs = [v for v in op.outputs if isinstance(v, TensorValue)]
    written = sum(v.nbytes for v in outs)
    if op.kind in ("linear", "matmul"):
        a, b = op.operands[:2]
        n = b.shape[0] if op.kind == "linear" else b.shape[-1]
        return Cost(2 * math.prod(a.shape) * n, written)
    if op.kind in ("sdpfa_fwd", "sdpfa_bwd"):
        q, k = op.arg("query"), op.arg("key")
        return Cost(4 * math.prod(q.shape) * k.shape[-2] * (2.5 if op.kind == "sdpfa_bwd" else 1.0), written)
    return Cost(sum(v.numel for v in outs), written)


# -- the assignment ------------------------------------------------------------------------------

@dataclass
class _Assignment:
    fwd: dict[int, set[int]]  # forward op index -> stages it runs in
    bwd: dict[int, set[int]]
    pstage: dict[str, set[int]]  # parameter label -> stages reading it (forward)
    fstage: dict[str, int | None]  # forward value -> its producing stage (None: free)
    bstage: dict[str, int | None]


def _sink(f: Fusion, tag: dict[str, int | None], layers: dict[str, int]) -> None:
    """Move parameter-free ops forward to the stage that reads them, where that sends nothing new.

    The forward tag (the highest block among the parameters an op depends on) puts a block's
    parameter-free first ops in the block before: an RMSNorm's ``rsqrt(mean(x**2) + eps)`` of
    block k depends on block k-1's output only. Unfixed, stage s+1's backward reads stage s's
    statistics and the cut is refused. A splice's ``layers`` record pins them where the model
    computes them; a whole trace has no such record, so here an op that reads no block parameter
    itself moves to the lowest stage among its consumers when each of its operands is already
    there: made in that stage (by an op moved with it), free, or sent to that stage anyway (read
    there by an op that does not move). Ops are moved optimistically, then those whose operands
    would be sent only for them are put back, to a fixed point; tags only grow, never past a
    consumer's. Edits ``tag`` in place; the GPT's spliced trace (every block op in ``layers``)
    has nothing to move."""
    consumers: dict[str, list[int]] = {}
    producer: dict[str, int] = {}
    up: dict[int, int | None] = {}
    cand: list[int] = []
    for k, op in enumerate(f.ops):
        if defines_input(op):
            continue
        for v in op.outputs:
            producer[v.name] = k
        for v in op.operands:
            consumers.setdefault(v.name, []).append(k)
        up[k] = next((tag[v.name] for v in op.outputs if tag.get(v.name) is not None), None)
    for k, t in up.items():
        op = f.ops[k]
        reads_param = any(f.role(v.name) == "parameter" and tag.get(v.name) is not None for v in op.operands)
        if t is None or reads_param or any(v.name in layers or f.role(v.name) == "output" for v in op.outputs):
            continue
        cand.append(k)
    if not cand:
        return
    cands = set(cand)
    new = dict(up)
    alive = set(cand)
    while True:
        for k in reversed(cand):  # the lowest stage among the consumers, moved ones included
            if k not in alive:
                new[k] = up[k]
                continue
            cons = [new[c] for v in f.ops[k].outputs for c in consumers.get(v.name, []) if new.get(c) is not None]
            new[k] = max(min(cons), up[k]) if cons else up[k]
        reverted = False
        for k in cand:  # each operand already in the new stage, or sent there anyway
            t = new[k]
            if t == up[k]:
                continue
            for u in f.ops[k].operands:
                p = producer.get(u.name)
                if p is None or new.get(p) is None or new[p] >= t:
                    continue
                if any(c not in cands or new[c] == up[c] for c in consumers[u.name] if up.get(c) == t):
                    continue
                alive.discard(k)
                new[k] = up[k]
                reverted = True
                break
        if not reverted:
            break
    for k in cand:
        if new[k] != up[k]:
            for v in f.ops[k].outputs:
                tag[v.name] = new[k]


def _assign(f: Fusion, b: Fusion | None, prefix: str, stage_of: Sequence[int], layers: dict[str, int] | None = None) -> _Assignment:
    """Which stage runs each op, with block ``i`` in stage ``stage_of[i]`` (see the module docstring).
    ``layers``: the splice's own record of which block copy computes each forward value
    (``Captured.layers``), which places a block's parameter-free first ops (a layer norm's
    statistics) in the block, not in the block before."""
    layers = layers or {}
    last = max(stage_of)
    # forward: the highest block among the block parameters an op depends on
    tag: dict[str, int | None] = {}
    for op in f.ops:
        if defines_input(op):
            v = op.outputs[0]
            i = _block_index(f.label(v.name), prefix) if f.role(v.name) == "parameter" else None
            tag[v.name] = None if i is None else stage_of[i]
            continue
        t = max((tag[v.name] for v in op.operands if tag.get(v.name) is not None), default=None)
        block = next((layers[v.name] for v in op.outputs if v.name in layers), None)
        if block is not None:
            t = max(stage_of[block], t if t is not None else 0)
        for v in op.outputs:
            tag[v.name] = t
    _sink(f, tag, layers)
    producer = {v.name: k for k, op in enumerate(f.ops) for v in op.outputs}
    outputs_needed: dict[str, set[int]] = {}
    for v in f.outputs:
        if f.role(v.name) == "output":
            outputs_needed.setdefault(v.name, set()).add(last if tag.get(v.name) is None else tag[v.name])

    def needs(extra: dict[str, set[int]]) -> dict[str, set[int]]:
        need: dict[str, set[int]] = {n: set(s) for n, s in extra.items()}
        for op in reversed(f.ops):
            if defines_input(op):
                continue
            here = set()
            for v in op.outputs:
                if tag[v.name] is not None:
                    here = {tag[v.name]}
                    break
                here |= need.get(v.name, set())
            for v in op.operands:
                need.setdefault(v.name, set()).update(here)
        return need

    need = needs(outputs_needed)
    pstage = {f.label(v.name): set(need.get(v.name, set())) for v in f.inputs if f.role(v.name) == "parameter"}
    for v in f.inputs:  # a block parameter lives in its block's stage even if unread
        if f.role(v.name) == "parameter" and tag[v.name] is not None:
            pstage[f.label(v.name)] = {tag[v.name]}
    # the last forward stage holding each tagged value (its own, or a later one that reads it)
    holder: dict[str, int] = {}
    for op in f.ops:
        if defines_input(op):
            continue
        st = next((tag[v.name] for v in op.outputs if tag[v.name] is not None), None)
        for v in op.operands:
            if tag.get(v.name) is not None and st is not None:
                holder[v.name] = max(holder.get(v.name, tag[v.name]), st)
    bstage: dict[str, int | None] = {}
    bwd_ops: dict[int, set[int]] = {}
    if b is not None:
        # A buffer or folded constant (an input with no gradient: a causal mask, a rotary table) is
        # read-only state every stage that reads it holds: it ties a backward op to no stage.
        trained = {b.grad_of(v.name) for v in b.outputs}
        for op in b.ops:
            if defines_input(op):
                v = op.outputs[0]
                info = b.info.get(v.name)
                t = None
                if info is not None and info.role == "parameter":
                    st = pstage.get(info.label)
                    t = min(st) if st and info.label in trained else None
                elif info is not None and info.role == "saved":
                    src = info.source
                    if src in tag and tag[src] is not None:
                        t = holder.get(src, tag[src])
                    elif src in tag and f.role(src) == "parameter" and f.label(src) in trained:
                        st = pstage.get(f.label(src))
                        t = min(st) if st else None
                bstage[v.name] = t
                continue
            t = min((bstage[v.name] for v in op.operands if bstage.get(v.name) is not None), default=None)
            for v in op.outputs:
                bstage[v.name] = t
        # free backward ops: where their consumers run (a parameter's gradient: where it lives)
        bneed: dict[str, set[int]] = {}
        for v in b.outputs:
            if bstage.get(v.name) is None:
                st = pstage.get(b.grad_of(v.name), set())
                bneed.setdefault(v.name, set()).update(st or {last})
        for k in range(len(b.ops) - 1, -1, -1):
            op = b.ops[k]
            if defines_input(op):
                continue
            st = next((bstage[v.name] for v in op.outputs if bstage[v.name] is not None), None)
            here = {st} if st is not None else set().union(*(bneed.get(v.name, set()) for v in op.outputs))
            bwd_ops[k] = here
            for v in op.operands:
                bneed.setdefault(v.name, set()).update(here)
        b_out_names = {v.name for v in b.outputs}
        # A parameter's gradient is made where the parameter lives: a bias's gradient, the sum of
        # the residual stream's gradient the next stage sends, is summed here, not there.
        for k, op in enumerate(b.ops):
            for v in op.outputs:
                lives = pstage.get(b.grad_of(v.name)) if v.name in b_out_names else None
                if k in bwd_ops and lives and len(lives) == 1 and bwd_ops[k] != lives:
                    bwd_ops[k] = set(lives)
                    bstage[v.name] = min(lives)
        # A one-operand op (a reshape, a permute of the residual stream's gradient) whose every
        # consumer runs in an earlier stage runs there: the cut then sends the gradient as the
        # activation's shape, not a reshaped copy of it.
        users: dict[str, list[int]] = {}
        for k, op in enumerate(b.ops):
            for v in op.operands:
                users.setdefault(v.name, []).append(k)
        outs_b = {v.name for v in b.outputs}
        for k in range(len(b.ops) - 1, -1, -1):
            op = b.ops[k]
            if k not in bwd_ops or len(op.operands) != 1 or any(v.name in outs_b for v in op.outputs):
                continue
            st = bwd_ops[k]
            later = set().union(*(bwd_ops.get(u, set()) for v in op.outputs for u in users.get(v.name, [])))
            if later and len(st) == 1 and max(later) < min(st):
                bwd_ops[k] = later
                for v in op.outputs:
                    bstage[v.name] = None
        # a free forward value a backward stage saves: recomputed in that stage's forward
        extra = {n: set(s) for n, s in outputs_needed.items()}
        for k, op in enumerate(b.ops):
            if not defines_input(op):
                continue
            v = op.outputs[0]
            info = b.info.get(v.name)
            if info is not None and info.role == "saved" and info.source in tag and tag[info.source] is None \
                    and info.source in producer and not defines_input(f.ops[producer[info.source]]):
                extra.setdefault(info.source, set()).update(bneed.get(v.name, set()))
        need = needs(extra)
    fwd_ops = {}
    for k, op in enumerate(f.ops):
        if defines_input(op):
            continue
        st = next((tag[v.name] for v in op.outputs if tag[v.name] is not None), None)
        fwd_ops[k] = {st} if st is not None else set().union(*(need.get(v.name, set()) for v in op.outputs))
    return _Assignment(fwd_ops, bwd_ops, pstage, {n: t for n, t in tag.items()}, bstage)


# -- building a stage's fusions --------------------------------------------------------------------

def _define(v: TensorValue) -> Op:
    n = len(v.shape)
    return Op("define_tensor", (("shape", tuple(v.shape)), ("contiguity", tuple(None if d == 1 else True for d in v.shape)), ("dtype", v.dtype), ("is_cpu", False),
                                ("stride_order", tuple(range(n - 1, -1, -1)))), (v,))


def _act_label(src: int, name: str) -> str:
    return f"stage{src}.{name}"


def _split(f: Fusion, b: Fusion | None, a: _Assignment, stages: int, arguments: Sequence[str]):
    """Each stage's (forward, backward) fusions and the transfers between them."""
    producer_b = {} if b is None else {v.name: k for k, op in enumerate(b.ops) for v in op.outputs}
    transfers: list[Transfer] = []
    out = []
    f_inputs = {v.name for v in f.inputs}
    # forward crossings: (src, dst, value)
    crossing: dict[tuple[int, int], list[str]] = {}
    for k, op in a.fwd.items():
        for dst in a.fwd[k]:
            for v in f.ops[k].operands:
                if v.name in f_inputs:
                    continue
                src = a.fstage.get(v.name)
                if src is not None and src != dst:
                    if src > dst:
                        raise StageError(f"{f.ops[k]}: stage {dst} reads {v.name} of stage {src}, a later one; cut elsewhere")
                    lst = crossing.setdefault((src, dst), [])
                    if v.name not in lst:
                        lst.append(v.name)
    bcross: dict[tuple[int, int], list[str]] = {}
    if b is not None:
        b_inputs = {v.name for v in b.inputs}
        for k, st in a.bwd.items():
            for dst in st:
                for v in b.ops[k].operands:
                    if v.name in b_inputs:
                        continue
                    src = a.bstage.get(v.name)
                    if src is not None and src != dst:
                        if src < dst:
                            raise StageError(f"backward {b.ops[k]}: stage {dst} reads {v.name} of stage {src}, an earlier one")
                        lst = bcross.setdefault((src, dst), [])
                        if v.name not in lst:
                            lst.append(v.name)
    # a backward crossing dst<-src is the gradient of a forward crossing dst->src: pair them by shape, in order
    grad_label: dict[tuple[int, int, str], str] = {}  # (src, dst, backward value) -> label of the forward value received by src
    for (src, dst), names in bcross.items():
        fw = list(crossing.get((dst, src), []))
        for name in names:
            shape = b.value(name).shape
            match = next((n for n in fw if f.value(n).shape == shape), None)
            if match is None:
                raise StageError(f"the backward sends {b.value(name).describe()} from stage {src} to stage {dst}, which is the "
                                 f"gradient of no activation stage {dst} sends to stage {src} ({', '.join(fw) or 'none'}); "
                                 "cut at other block boundaries")
            fw.remove(match)
            grad_label[(src, dst, name)] = _act_label(dst, match)
    for (src, dst), names in sorted(crossing.items()):
        for n in names:
            v = f.value(n)
            transfers.append(Transfer("forward", src, dst, n, _act_label(src, n), tuple(v.shape), v.dtype.value, v.nbytes))
    for (src, dst, name), label in sorted(grad_label.items()):
        v = b.value(name)
        transfers.append(Transfer("backward", src, dst, name, f"grad({label})", tuple(v.shape), v.dtype.value, v.nbytes))

    for s in range(stages):
        # backward first: what it reads of the forward decides the forward's saved outputs
        bfus = None
        saved_sources: list[str] = []
        if b is not None:
            ops_k = [k for k, st in sorted(a.bwd.items()) if s in st]
            read = {v.name for k in ops_k for v in b.ops[k].operands}
            new_inputs, info = [], {}
            for op in b.ops:
                if defines_input(op) and op.outputs[0].name in read:
                    v = op.outputs[0]
                    new_inputs.append(op)
                    info[v.name] = b.info[v.name]
                    if b.info[v.name].role == "saved":
                        saved_sources.append(b.info[v.name].source)
            received = [(src, name) for (src, dst), names in sorted(bcross.items()) if dst == s for name in names]
            for src, name in received:
                fwd_label = grad_label[(src, s, name)]
                fwd_name = fwd_label.split(".", 1)[1]
                new_inputs.append(_define(b.value(name)))
                info[name] = ValueInfo("grad", f"grad({fwd_label})", source=fwd_name)
            outs = []
            for v in b.outputs:
                k = producer_b[v.name]
                if s in a.bwd.get(k, set()) and b.grad_of(v.name):
                    outs.append(v)
                    info[v.name] = b.info[v.name]
            for (src, dst), names in sorted(bcross.items()):
                if src == s:
                    for name in names:
                        if all(o.name != name for o in outs):
                            outs.append(b.value(name))
                            lab = grad_label[(src, dst, name)]
                            info[name] = ValueInfo("grad", f"grad({lab})", grad_of=lab)
            bfus = Fusion(tuple(new_inputs) + tuple(b.ops[k] for k in ops_k), tuple(outs), f"{b.name}_stage{s}", info, dict(b.attrs))
            bfus = dead_code(bfus)
        # forward
        ops_k = [k for k, st in sorted(a.fwd.items()) if s in st]
        made = {v.name for k in ops_k for v in f.ops[k].outputs}
        read = {v.name for k in ops_k for v in f.ops[k].operands}
        recv = [n for (src, dst), names in sorted(crossing.items()) if dst == s for n in names]
        new_inputs, info = [], {}
        for op in f.ops:
            v = op.outputs[0] if op.outputs else None
            if defines_input(op) and (v.name in read or (v.name in saved_sources)):
                new_inputs.append(op)
                if v.name in f.info:
                    info[v.name] = f.info[v.name]
        for n in recv:
            new_inputs.append(_define(f.value(n)))
            info[n] = ValueInfo("activation", f"stage{a.fstage[n]}.{n}")
        outs = []
        for v in f.outputs:
            if f.role(v.name) == "output" and v.name in made and (a.fstage.get(v.name) in (s, None)):
                outs.append(v)
                info[v.name] = f.info[v.name]
        for (src, dst), names in sorted(crossing.items()):
            if src == s:
                for n in names:
                    if all(o.name != n for o in outs):
                        outs.append(f.value(n))
                        info[n] = ValueInfo("output", _act_label(s, n))
        have = made | {op.outputs[0].name for op in new_inputs}
        for src_name in saved_sources:
            if src_name not in have:
                raise StageError(f"stage {s}'s backward reads {f.value(src_name).describe()}, which stage {s}'s forward neither "
                                 f"computes nor receives (it is stage {a.fstage.get(src_name)}'s); cut at other block boundaries")
            if src_name in made and all(o.name != src_name for o in outs):
                outs.append(f.value(src_name))
                info[src_name] = ValueInfo("saved")
        ffus = Fusion(tuple(new_inputs) + tuple(f.ops[k] for k in ops_k), tuple(outs), f"{f.name}_stage{s}", info, dict(f.attrs))
        ffus = dead_code(ffus)
        out.append((ffus, bfus))
    return out, transfers


def _cost_by_stage(f: Fusion, b: Fusion | None, a: _Assignment, stages: int) -> list[Cost]:
    costs = [Cost() for _ in range(stages)]
    for k, st in a.fwd.items():
        c = op_cost(f.ops[k])
        for s in st:
            costs[s] = costs[s] + c
    if b is not None:
        for k, st in a.bwd.items():
            c = op_cost(b.ops[k])
            for s in st:
                costs[s] = costs[s] + c
    return costs


def balance(costs: Sequence[Cost], stages: int) -> tuple[int, ...]:
    """Cut points (block indices where stages 1.. start) of the contiguous split minimising the
    largest stage's (flops, bytes); of several such splits, the one whose cuts come first. By dynamic
    programming (``least[s][i]``: the least largest stage splitting blocks i.. into s stages),
    O(stages * blocks^2): the planner cuts GPT-3's 96 blocks into up to 64 stages."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"{n} blocks cannot be cut into {stages} stages of at least one block each")
    seg = [[(0.0, 0.0)] * (n + 1) for _ in range(n + 1)]  # seg[i][j]: blocks i..j-1, summed in order
    for i in range(n):
        c = Cost()
        for j in range(i + 1, n + 1):
            c = c + costs[j - 1]
            seg[i][j] = (c.flops, c.bytes)
    least = [[None] * (n + 1) for _ in range(stages + 1)]
    least[1][:n] = [seg[i][n] for i in range(n)]
    for s in range(2, stages + 1):
        for i in range(n - s + 1):
            least[s][i] = min(max(seg[i][e], least[s - 1][e]) for e in range(i + 1, n - s + 2))
    worst = least[stages][0]
    cuts, start = [], 0
    for left in range(stages, 1, -1):
        start = next(e for e in range(start + 1, n - left + 2) if max(seg[start][e], least[left - 1][e]) <= worst)
        cuts.append(start)
    return tuple(cuts)


@dataclass(frozen=True)
class BlockOps:
    """Which block each op of a traced model runs in, read as the cut reads it (one block per
    stage): the head (embedding) with block 0, the tail (final norm, head, loss) with the last; an
    op several blocks need (a rotary table) with the first of them."""

    forward: dict[int, int]  # forward op index -> block
    backward: dict[int, int]
    parameters: dict[str, int]  # parameter label -> the block holding it


def block_ops(traced, prefix: str, blocks: int) -> BlockOps:
    """``BlockOps`` of ``traced`` (a whole model of ``blocks`` blocks named ``prefix.<i>``)."""
    layers = getattr(traced.captured, "layers", None) or {}
    a = _assign(traced.forward, traced.backward, prefix, list(range(blocks)), layers)

    def first(stages: set[int]) -> int:
        return min(stages) if stages else 0
    return BlockOps({k: first(st) for k, st in a.fwd.items()}, {k: first(st) for k, st in a.bwd.items()},
                    {label: first(st) for label, st in a.pstage.items()})


def cut_stages(traced, prefix: str, blocks: int, stages: int, cut: Sequence[int] | None = None) -> Staged:
    """The stages of ``traced`` (see the module docstring). ``cut``: the first block of each stage
    after the first (``(2,)``: blocks [0, 2) and [2, L)); None: balanced by cost. Raises
    ``StageError`` for fewer blocks than stages or a cut that is not increasing inside [1, L)."""
    if blocks < stages:
        raise StageError(f"the model has {blocks} blocks ({prefix}.0 .. {prefix}.{blocks - 1}) but the pp axis has {stages} stages; "
                         f"each stage holds at least one block: use pp <= {blocks}, or a model with at least {stages} blocks")
    f, b = traced.forward, traced.backward
    # the cost of each block: the same assignment at one block per stage
    layers = getattr(traced.captured, "layers", None) or {}
    per_block = _assign(f, b, prefix, list(range(blocks)), layers)
    block_costs = _cost_by_stage(f, b, per_block, blocks)
    if cut is None:
        cuts, chosen = balance(block_costs, stages), "balanced"
    else:
        cuts, chosen = tuple(int(c) for c in cut), "explicit"
        if len(cuts) != stages - 1 or list(cuts) != sorted(set(cuts)) or (cuts and (cuts[0] < 1 or cuts[-1] >= blocks)):
            raise StageError(f"cut={list(cuts)}: give the first block of each stage after the first, {stages - 1} increasing "
                             f"numbers in 1..{blocks - 1} (e.g. cut={[blocks * (i + 1) // stages for i in range(stages - 1)]})")
    bounds = (0, *cuts, blocks)
    stage_of = [next(s for s in range(stages) if bounds[s] <= i < bounds[s + 1]) for i in range(blocks)]
    a = _assign(f, b, prefix, stage_of, layers)
    parts, transfers = _split(f, b, a, stages, traced.arguments)
    costs = _cost_by_stage(f, b, a, stages)
    out = []
    for s, (ff, bf) in enumerate(parts):
        labels = [ff.label(v.name) for v in ff.inputs]
        params = [lab for v, lab in zip(ff.inputs, labels) if ff.role(v.name) == "parameter"]
        if bf is not None:  # a parameter only the backward reads
            params += [bf.label(v.name) for v in bf.inputs if bf.role(v.name) == "parameter" and bf.label(v.name) not in params]
        args = [n for n in traced.arguments if n in labels] + [ff.label(v.name) for v in ff.inputs if ff.role(v.name) == "activation"]
        st = Traced(ff, bf, "pipeline", f"stage {s} of {stages}: blocks {bounds[s]}..{bounds[s + 1] - 1} of {prefix}",
                    arguments=args, weights=traced.weights, boundary=True, tied={}, seconds=0.0)
        out.append(Stage(s, tuple(range(bounds[s], bounds[s + 1])), st, params, costs[s]))
    for s_, (ff, bf) in enumerate(parts):  # every gradient lands in a stage holding its parameter
        if bf is not None:
            for v in bf.outputs:
                g = bf.grad_of(v.name)
                if g and not g.startswith("stage") and g not in out[s_].parameters:
                    raise StageError(f"stage {s_}'s backward makes the gradient of {g}, which stage {s_} does not hold; "
                                     "cut at other block boundaries")
    trained = set() if b is None else {b.grad_of(v.name) for v in b.outputs}
    for label, st in a.pstage.items():
        holders = [s.index for s in out if label in s.parameters]
        if len(holders) > 1 and label in trained:  # a buffer (no gradient: a rotary table) is read where needed
            raise StageError(f"parameter {label} is read by stages {holders}; nvtp holds a parameter in one stage "
                             "(a weight tied across stages is one parameter under two names, each read by one stage)")
    return Staged(out, transfers, block_costs, prefix, blocks, chosen)


__all__ = ["BlockOps", "block_ops", "cut_stages", "Staged", "Stage", "Transfer", "Cost", "StageError", "balance", "op_cost"]
