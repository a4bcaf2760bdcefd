"""Explicit plans: parameter-name globs (or module-name globs) to placements, ``"colwise"`` /
``"rowwise"``, or torch's ``ColwiseParallel()`` / ``RowwiseParallel()``; a per-input plan maps a
dumped fusion's value names (``T3``) to placements. ``check_plan`` refuses a plan before anything
is traced."""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Iterable, Mapping

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Placement, Replicate, Shard, _StridedShard, make_shard
from nvtp.sharding.plans.base import Annotations, Projection, projections
from nvtp.sharding.propagate import ShardingError

_PLACEMENT = re.compile(r"^\s*(?:(_?S)\((\d+)(?:\s*,\s*(\d+))?\)|(R)|(replicate)|(colwise)|(rowwise))\s*$", re.I)


def parse_placement(text: str) -> Any:
    """``S(0)``, ``S(2, 3)`` / ``_S(2, 3)``, ``R`` / ``replicate``, ``colwise``, ``rowwise``."""
    m = _PLACEMENT.match(text)
    if not m:
        raise ShardingError(f"unknown placement {text!r}; write S(dim), S(dim, split_factor), R, colwise or rowwise")
    if m.group(2) is not None:
        return make_shard(int(m.group(2)), int(m.group(3) or 1))
    if m.group(4) or m.group(5):
        return REPLICATE
    return "colwise" if m.group(6) else "rowwise"


def parse_plan_text(text: str) -> dict[str, Any]:
    """``glob=placement;glob=placement`` as written on the command line."""
    plan: dict[str, Any] = {}
    if "=" not in text:
        raise ShardingError(f"unknown plan {text!r}; use megatron, megatron-sp, replicate, or an explicit plan "
                            "'glob=placement;...' (placements S(d), S(d,k), R, colwise, rowwise)")
    for item in filter(None, (s.strip() for s in re.split(r"[;\n]", text))):
        if "=" not in item:
            raise ShardingError(f"plan entry {item!r} is not `name-or-glob=placement`")
        key, value = item.split("=", 1)
        plan[key.strip()] = parse_placement(value)
    return plan


PLAN_NAMES = ("megatron", "megatron-sp", "replicate", "none")


def check_plan(plan: str | Mapping[str, Any], names: Iterable[str], owner: str = "the module") -> None:
    """Refuse, before anything is traced, a plan that cannot apply to a module whose parameters,
    buffers and arguments are ``names``: an unknown plan name, an entry that is not a placement or
    a style, a glob that matches no name and no module (a name's prefix before its last dot).
    Entries naming fusion values (``T3``) are checked once the fusion exists."""
    if isinstance(plan, str):
        if plan in PLAN_NAMES:
            return
        plan = parse_plan_text(plan)
    if not isinstance(plan, Mapping):
        raise ShardingError(f"plan {plan!r} is neither a plan name ({', '.join(PLAN_NAMES[:3])}) nor a mapping of name globs to placements")
    names = sorted(set(names))
    modules = {n.rsplit(".", 1)[0] for n in names if "." in n}
    for pattern, raw in plan.items():
        _style(raw)
        if re.fullmatch(r"T\d+", pattern) or any(fnmatch.fnmatchcase(n, pattern) for n in [*names, *modules]):
            continue
        raise ShardingError(f"plan entry {pattern!r} matches no parameter or module of {owner}; correct the name or glob (globs "
                            f"match parameter or module names); parameters are: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''}")


def _style(value: Any) -> str | Placement:
    """A plan entry as a placement or 'colwise' / 'rowwise' (accepting torch's ParallelStyle objects)."""
    if isinstance(value, str):
        return parse_placement(value)
    if isinstance(value, (Shard, _StridedShard, Replicate)):
        return value
    name = type(value).__name__
    if name == "ColwiseParallel":
        return "colwise"
    if name == "RowwiseParallel":
        return "rowwise"
    raise ShardingError(f"plan entry {value!r} is not a placement, 'colwise', 'rowwise', ColwiseParallel() or RowwiseParallel()")


def explicit(fusion: Fusion, mesh: DeviceMesh, plan: Mapping[str, Any]) -> Annotations:
    """Placements from name globs. A glob may name parameters (``*.c_fc.weight``) or modules
    (``*.c_fc``: colwise/rowwise then set its weight and bias as torch's styles do). Inputs no
    glob names are replicated; globs that match nothing are an error."""
    labels = {fusion.label(v.name): v for v in fusion.inputs if isinstance(v, TensorValue)}
    tied = _tied_aliases(fusion)  # a tied parameter's other names (lm_head.weight for wte.weight): the same input
    labels |= {alias: labels[name] for alias, name in tied.items() if name in labels}
    by_value = {v.name: v for v in fusion.inputs if isinstance(v, TensorValue)}
    projs = {p.weight: p for p in projections(fusion)}
    placements: dict[str, Placement] = {v.name: REPLICATE for v in by_value.values()}
    placed_by: dict[str, str] = {}  # value -> the plan entry that placed it
    notes = []

    def place(v: TensorValue, placement: Placement, pattern: str) -> None:
        other = placed_by.get(v.name)
        label = fusion.label(v.name)
        if other is not None and placements[v.name] != placement and label in tied.values():
            # One tensor under two names, each placed its own way: the weight has one placement (the
            # first entry's), the other use gets it by a reshard; said in the notes, never a broken tie.
            also = ", ".join(a for a, n in tied.items() if n == label)
            notes.append(f"tied weight {label} (also {also}): entries {other!r} and {pattern!r} place it {placements[v.name]} and "
                         f"{placement}; kept {placements[v.name]} ({other!r}), the other use reshards")
            return
        if other is not None and placements[v.name] != placement:
            raise ShardingError(f"plan entries {other!r} and {pattern!r} both place {label} ({v.describe()}), as {placements[v.name]} "
                                f"and as {placement}; make the globs disjoint or give them the same placement")
        placements[v.name], placed_by[v.name] = placement, pattern

    for pattern, raw in plan.items():
        style = _style(raw)
        matched = [name for name in labels if fnmatch.fnmatchcase(name, pattern)]
        matched += [name for name in by_value if fnmatch.fnmatchcase(name, pattern) and name not in labels]
        modules = sorted({n.rsplit(".", 1)[0] for n in labels if "." in n and fnmatch.fnmatchcase(n.rsplit(".", 1)[0], pattern)})
        if not matched and not modules:
            known = ", ".join(sorted(labels)[:12])
            raise ShardingError(f"plan entry {pattern!r} matches no input of {fusion.name}; correct the name or glob "
                                f"(globs match parameter or module names); inputs are: {known}{', ...' if len(labels) > 12 else ''}")
        for name in matched:
            v = labels.get(name) or by_value[name]
            place(v, _resolve(style, v, fusion, projs, is_bias=name.endswith(".bias")), pattern)
        for module in modules:
            for suffix in ("weight", "bias"):
                v = labels.get(f"{module}.{suffix}")
                if v is not None:
                    place(v, _resolve(style, v, fusion, projs, is_bias=suffix == "bias"), pattern)
        notes.append(f"{pattern} -> {raw if isinstance(raw, str) else type(raw).__name__ if not isinstance(raw, (Shard, _StridedShard, Replicate)) else raw}")
    return Annotations(placements, notes)


def _tied_aliases(fusion: Fusion) -> dict[str, str]:
    """A tied parameter's other names -> the name its fusion input has (``nvtp.frontend.tied``)."""
    text = str(fusion.attrs.get("tied", ""))
    return dict(part.split("=", 1) for part in text.split(",") if "=" in part)


def _resolve(style: str | Placement, v: TensorValue, fusion: Fusion, projs: Mapping[str, Projection], *, is_bias: bool) -> Placement:
    if not isinstance(style, str):
        return style
    weight = _weight_of(v, fusion, projs) if is_bias else projs.get(v.name)
    sf = weight.split_factor if weight is not None else 1
    if style == "colwise":
        return make_shard(weight.out_axis if weight is not None and not is_bias else 0, sf)
    # rowwise: weights split along the input features, biases replicated
    return REPLICATE if is_bias or v.ndim == 1 else Shard(weight.in_axis if weight is not None else 1)


def _weight_of(bias: TensorValue, fusion: Fusion, projs: Mapping[str, Projection]) -> Projection | None:
    for p in projs.values():
        if p.bias == bias.name:
            return p
    return None


def per_input(fusion: Fusion, plan: Mapping[str, Any]) -> Annotations:
    """A dumped fusion's inputs placed by value name (``T3``) or label; the rest left to propagation."""
    names = {v.name for v in fusion.inputs}
    labels = {fusion.label(v.name): v.name for v in fusion.inputs}
    placements = {}
    for key, raw in plan.items():
        name = key if key in names else labels.get(key)
        if name is None:
            raise ShardingError(f"the plan places {key!r}, which is not an input of {fusion.name}")
        style = _style(raw)
        if isinstance(style, str):
            raise ShardingError(f"per-input plans take placements (S(d), R), not {style!r}")
        placements[name] = style
    return Annotations(placements)
