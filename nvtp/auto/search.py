"""``plan="auto"``: the fastest plan that fits, chosen from every layout the axis strategies allow.

    choice = search(model, (idx, targets), devices=8, machine="h100-ib", memory="80GB")
    choice.best.candidate.text()      # "dp2 tp4 megatron-sp collective matmul"
    print(choice.as_text())           # the ranked table, and why the others lost

The search, in order:

1. **Bad input first**, before anything is traced: an unknown machine, a budget that is not a
   size, a device count no layout of the model takes (each axis's refusals are named), a
   budget that even the most split plan cannot meet (the smallest plan's need is named).
2. **Candidates** from the strategies (``nvtp.sharding.axes``): every factorisation of the
   devices into the axes nvtp knows, each extent an axis does not ``refuse``, the product of the
   axes' ``choices`` (plan and collective matmul on tp, FSDP on dp, microbatches and schedule on
   pp), with no axis in ``conflicts``, times the recompute modes.
3. **Pruned by memory before costing**: the weights, gradients and Adam state of the most any
   candidate can split them (tp x stages x, with FSDP, dp x cp) already over the budget.
4. **Costed** (``nvtp.auto.costing``): the model traced once (cut to three blocks, on the meta
   device), sharded once per program mesh and options through the compile driver, and each
   candidate priced from those programs; the fastest that fits wins (ties: the smaller).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from nvtp.auto.candidate import Candidate, layout
from nvtp.auto.costing import Costed, Costing
from nvtp.auto.sample import Facts, loss_only, model_facts, take
from nvtp.errors import InputError
from nvtp.frontend.recompute import MODES, layers_of, plan_recompute, sequence_of
from nvtp.sharding.cost import MACHINES, Machine, default_machine
from nvtp.sharding.propagate import ShardingError
from nvtp.execute import backends


class AutoError(InputError):
    """A planning problem nvtp refuses before any search: says what was wrong and what to pass."""


UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(memory: Any, machine: Machine) -> float:
    """A memory budget per device: bytes (a number), "80GB" / "80GiB", or None for the machine's."""
    if memory is None:
        return float(machine.memory_per_device)
    if isinstance(memory, bool):
        raise AutoError(f"memory={memory!r}: give bytes per device (a number) or a size such as '80GB'")
    if isinstance(memory, (int, float)):
        if memory <= 0:
            raise AutoError(f"memory={memory!r}: a budget per device must be positive")
        return float(memory)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", str(memory).lower())
    if m is None or float(m.group(1)) <= 0:
        raise AutoError(f"memory={memory!r}: give a size per device such as '80GB', '24GiB' or '512MB' (or bytes)")
    return float(m.group(1)) * UNITS[m.group(2) or ""]


def machine_of(machine: Any, backend: str) -> Machine:
    if machine is None:
        return default_machine(backend)
    if isinstance(machine, Machine):
        return machine
    if machine not in MACHINES:
        raise AutoError(f"unknown machine {machine!r}; nvtp's machine models are {', '.join(map(repr, MACHINES))} "
                        "(nvtp/sharding/cost.py: MACHINES)")
    return MACHINES[machine]


def size_text(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass
class Rejected:
    candidate: Candidate
    why: str
    costed: Costed | None = None  # None: pruned before costing, or refused by the compile driver
    need: float = 0.0  # bytes a rank: its memory (costed) or its weights, gradients and Adam state (pruned)


@dataclass
class Choice:
    """What ``plan="auto"`` chose, and the table it chose from."""

    facts: Facts
    best: Costed
    ranked: list[Costed]  # every candidate that fits, fastest first
    over_budget: list[Rejected]  # costed, but over the memory budget (``costed`` set), or pruned before costing
    refused: dict[str, str]  # what the strategies refused outright: "tp=16" -> why
    invalid: list[Rejected]  # candidates the compile driver refused (a plan that does not divide)
    seconds: float
    shardings: int
    model: str = ""

    @property
    def candidate(self) -> Candidate:
        return self.best.candidate

    def within(self, memory: Any) -> "Choice":
        """The choice under a smaller ``memory`` budget (bytes or "40GB"), re-ranked from the
        candidates already costed (a larger budget may admit candidates pruned before costing:
        search again). Raises ``AutoError`` when none fits."""
        budget = parse_memory(memory, self.facts.machine)
        if budget > self.facts.memory:
            raise AutoError(f"within({memory!r}): {size_text(budget)} is more than the {size_text(self.facts.memory)} this "
                            "choice was searched for; search again with that memory= budget")
        costed = self.ranked + [r.costed for r in self.over_budget if r.costed is not None]
        ranked, over = fitting(costed, [r for r in self.over_budget if r.costed is None], budget, self.invalid)
        return replace(self, facts=replace(self.facts, memory=budget), best=ranked[0], ranked=ranked, over_budget=over)

    def why_slower(self, c: Costed) -> str:
        """The term that makes ``c`` slower than the choice, most first."""
        # in the terms' own order (not a set's, which differs between processes), the first of equals
        diffs = {k: c.terms.get(k, 0.0) - self.best.terms.get(k, 0.0) for k in dict.fromkeys([*c.terms, *self.best.terms])}
        k = max(diffs, key=diffs.get)
        return f"{k} +{diffs[k] * 1e3:.2f} ms"

    def as_text(self, top: int = 10) -> str:
        f = self.facts
        b = self.best
        lines = [f"plan auto{' for ' + self.model if self.model else ''}: {f.devices} devices on {f.machine.name} "
                 f"({f.machine.devices_per_node} a node), {size_text(f.memory)} a device, {f.backend} backend; "
                 f"batch {f.batch}, sequence {f.sequence}, {f.blocks} blocks",
                 f"chosen: {b.candidate.text()}: {b.seconds * 1e3:.2f} ms a step, {size_text(b.total_memory)} a rank",
                 "  step: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in b.terms.items()),
                 "  memory: " + ", ".join(f"{k} {size_text(v)}" for k, v in b.memory.items())]
        notes = {}
        for s, _ in b.candidate.used():
            notes.update((k, v) for k, v in s.memory_terms(b).items() if k not in b.memory)  # the memory line names the rest
        if notes:
            lines.append("  " + ", ".join(f"{k} {size_text(v)}" for k, v in notes.items()))
        lines += ["", f"{'rank':>4}  {'candidate':<52} {'step ms':>10} {'memory':>10}  why not chosen"]
        for i, c in enumerate(self.ranked[:top]):
            why = "chosen" if c is b else f"slower: {self.why_slower(c)}"
            lines.append(f"{i + 1:>4}  {c.candidate.text():<52} {c.seconds * 1e3:>10.2f} {size_text(c.total_memory):>10}  {why}")
        if len(self.ranked) > top:
            lines.append(f"      ... {len(self.ranked) - top} more that fit, slower")
        costed_over = sorted((r for r in self.over_budget if r.costed is not None), key=lambda r: r.costed.total_memory)
        if costed_over:
            lines += ["", "over the memory budget (costed; the least memory first):"]
            for r in costed_over[:top]:
                lines.append(f"      {r.candidate.text():<52} {r.costed.seconds * 1e3:>10.2f} {size_text(r.costed.total_memory):>10}  {r.why}")
        pruned = [r for r in self.over_budget if r.costed is None]
        if pruned:
            lines.append(f"      {len(pruned)} more pruned before costing: their weights, gradients and Adam state alone exceed "
                         f"the budget (e.g. {pruned[0].candidate.text()}: {pruned[0].why})")
        if self.invalid:
            lines += ["", "refused by the compile driver:"]
            for r in self.invalid[:top]:
                lines.append(f"      {r.candidate.text():<52} {r.why}")
        if self.refused:
            lines += ["", "layouts (or their options) the axes refuse:"]
            for k, why in self.refused.items():
                lines.append(f"      {k}: {why}")
        lines.append(f"\nsearched {len(self.ranked) + len(self.over_budget) + len(self.invalid)} candidates in "
                     f"{self.seconds:.1f} s ({self.shardings} programs sharded)")
        return "\n".join(lines)

    def as_json(self, top: int = 20) -> dict[str, Any]:
        def one(c: Costed) -> dict[str, Any]:
            return c.candidate.as_json() | {"seconds": c.seconds, "terms": dict(c.terms), "memory": dict(c.memory)}
        return {"facts": {"devices": self.facts.devices, "machine": self.facts.machine.name, "memory": self.facts.memory,
                          "backend": self.facts.backend, "batch": self.facts.batch, "sequence": self.facts.sequence,
                          "blocks": self.facts.blocks},
                "chosen": one(self.best),
                "ranked": [one(c) | ({} if c is self.best else {"why": "slower: " + self.why_slower(c)}) for c in self.ranked[:top]],
                "over_budget": [r.candidate.as_json() | {"why": r.why} | ({"seconds": r.costed.seconds, "memory": dict(r.costed.memory)}
                                                          if r.costed else {}) for r in self.over_budget[:top]],
                "refused": dict(self.refused), "invalid": [r.candidate.as_json() | {"why": r.why} for r in self.invalid[:top]],
                "seconds": self.seconds, "shardings": self.shardings}


# ---------------------------------------------------------------------------------------------
# candidates


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(facts: Facts, modes: tuple[str, ...]) -> tuple[list[Candidate], dict[str, str]]:
    """Every candidate the strategies allow on ``facts.devices`` devices, and what they refused
    ("tp=16": why)."""
    order = layout()
    refused: dict[str, str] = {}
    out: list[Candidate] = []

    def extents(i: int, left: int, chosen: dict[str, int]):
        if i == len(order):
            if left == 1:
                yield dict(chosen)
            return
        s = order[i]
        for d in divisors(left):
            if d > 1:
                why = s.refuse(d, facts)
                if why is not None:
                    refused.setdefault(f"{s.name}={d}", why)
                    continue
            chosen[s.name] = d
            yield from extents(i + 1, left // d, chosen)
            del chosen[s.name]

    for ext in extents(0, facts.devices, {}):
        per_axis = [s.choices(ext[s.name], ext, facts) for s in order]
        for combo in itertools.product(*per_axis):
            options: dict[str, Any] = {}
            for o in combo:
                options.update(o)
            why = next((w for s in order if (w := s.conflicts(ext, options, facts)) is not None), None)
            if why is not None:  # one line per layout, each reason once
                key = " ".join(f"{k}{v}" for k, v in ext.items() if v > 1)
                if why not in refused.get(key, ""):
                    refused[key] = f"{refused[key]}; {why}" if key in refused else why
                continue
            for mode in modes:
                out.append(Candidate.of(ext, options, mode))
    return out, refused


def weight_bytes(model: torch.nn.Module) -> tuple[float, float]:
    """(bytes of the trainable weights, bytes of their gradients and Adam state) of the whole model."""
    weights = state = 0.0
    seen = set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        n = p.numel()
        weights += n * p.element_size()
        state += n * p.element_size() + n * (12 if p.element_size() < 4 else 8)
    return weights, state


def least_memory(c: Candidate, weights: float, state: float) -> float:
    """A lower bound of a candidate's memory per rank: its weights, gradients and Adam state split
    as far as any of its axes may split them (tp, the stages, and with FSDP dp and cp)."""
    ways = 1
    fsdp = any(c.opts.get(o) for s, _ in c.used() if s.splits_batch for o in s.options)  # weights split over the data axes too
    for s, n in c.used():
        if s.runs_plan or s.cuts_stages or (fsdp and not s.runs_plan):
            ways *= n
    return (weights + state) / ways


# ---------------------------------------------------------------------------------------------
# the search


def search(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None = None, *, devices: int, machine: Any = None,
           memory: Any = None, backend: str = "reference", recompute: tuple[str, ...] | None = None, frontend: str = "auto",
           model_name: str = "") -> Choice:
    """The fastest candidate that fits (see the module docstring). ``args``/``kwargs``: one call
    with the whole batch (every rank passes it; nvtp takes each data-parallel rank's part).
    ``recompute``: the modes to try (default: "none" alone). Runs with one torch thread (``one_thread``)."""
    with one_thread():
        return _search(model, args, kwargs, devices=devices, machine=machine, memory=memory, backend=backend, recompute=recompute,
                       frontend=frontend, model_name=model_name)


@contextlib.contextmanager
def one_thread():
    """torch's intra-op threads set to one while the planner runs: it computes on meta tensors, and
    on the CPU only index sets of a few hundred thousand entries (``placements.held``), for which a
    second thread costs more than it gives: on this project's loaded 2-core machine an op over 131K
    entries took 140 ms on two threads, 0.4 ms on one (2026-11-26)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _search(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None, *, devices: int, machine: Any, memory: Any,
            backend: str, recompute: tuple[str, ...] | None, frontend: str, model_name: str) -> Choice:
    start = time.perf_counter()
    kwargs = dict(kwargs or {})
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise AutoError(f"devices={devices!r}: plan='auto' needs the number of devices to plan for, a positive integer "
                        "(or a 1-D mesh of them)")
    m = machine_of(machine, backend)
    budget = parse_memory(memory, m)
    modes = tuple(recompute) if recompute is not None else MODES[:1]  # recomputation tried when asked (not yet checked against runs)
    for mode in modes:
        if mode not in MODES:
            raise AutoError(f"recompute mode {mode!r}: nvtp knows {', '.join(map(repr, MODES))}")
    facts = model_facts(model, args, kwargs, machine=m, memory=budget, backend=backend, devices=devices, loss_only=True)
    if facts.prefix is None:
        modes = tuple(x for x in modes if x != "block")
    all_candidates, refused = candidates(facts, modes)
    if not all_candidates:
        raise AutoError(f"no layout of {devices} devices fits this model: " + "; ".join(f"{k}: {v}" for k, v in refused.items())
                        + f". Plan for another number of devices (e.g. {_nearby(devices)})")
    weights, state = weight_bytes(model)
    need = min(least_memory(c, weights, state) for c in all_candidates)
    if need > budget:
        raise AutoError(f"no plan fits {size_text(budget)} a device: even the most split plan holds {size_text(need)} of weights, "
                        f"gradients and Adam state per device ({size_text(weights)} of weights over {devices} devices); "
                        "give more devices or a larger memory= budget")
    samples: dict[tuple, Any] = {}

    def sampler(key: tuple):
        if key not in samples:
            ring, split = key
            split_trace = samples.get((ring, True))
            if not split and split_trace is not None and not split_trace.traced.parts:  # no fused projection of unequal parts
                samples[key] = split_trace
            else:
                samples[key] = take(model, args, kwargs, facts, ring=ring, split_parts=split, frontend=frontend)
        return samples[key]

    first = sampler((False, True))
    facts = replace(facts, loss_only=loss_only(first.traced))
    costing = Costing(sampler, facts)
    # the plan's candidates again, with what the trace showed (a loss-only forward; recompute that changes nothing)
    useful = [x for x in modes if x == "none" or not plan_recompute(first.traced.forward, first.traced.backward, x, layers_of(first.traced),
                                                                      sequence_of(first.traced)).empty]
    all_candidates, refused = candidates(facts, tuple(useful))
    costed, pruned, invalid = [], [], []
    for c in all_candidates:
        floor = least_memory(c, weights, state)
        if floor > budget:
            pruned.append(Rejected(c, "", need=floor))
            continue
        try:
            costed.append(costing.evaluate(c))
        except ShardingError as e:
            invalid.append(Rejected(c, str(e).split(";")[0]))
    ranked, over = fitting(costed, pruned, budget, invalid)
    return Choice(facts, ranked[0], ranked, over, refused, invalid, time.perf_counter() - start, costing.shardings,
                  model_name or type(model).__name__)


def fitting(costed: list[Costed], pruned: list[Rejected], budget: float, invalid: list[Rejected] = ()) -> tuple[list[Costed], list[Rejected]]:
    """(the costed candidates that fit ``budget``, fastest first (ties: the smaller); the rest, each
    with how far over it is): ``pruned`` were left out before costing (their ``need``: weights,
    gradients and Adam state). Raises ``AutoError`` naming the smallest need when none fits."""
    ranked = sorted((c for c in costed if c.total_memory <= budget), key=lambda c: (round(c.seconds, 12), c.total_memory))
    over = [Rejected(c.candidate, f"does not fit: {size_text(c.total_memory)} a rank, over by {size_text(c.total_memory - budget)}",
                     c, c.total_memory) for c in costed if c.total_memory > budget]
    over += [Rejected(r.candidate, f"weights, gradients and Adam state alone {size_text(r.need)} a rank, over by "
                                   f"{size_text(r.need - budget)}", None, r.need) for r in pruned]
    if not ranked:
        if over:
            least = min(over, key=lambda r: r.need)
            raise AutoError(f"no plan fits {size_text(budget)} a device: the smallest needs {size_text(least.need)} a rank "
                            f"({least.candidate.text()}); give more devices or a larger memory= budget")
        raise AutoError("no candidate layout could be sharded: " + "; ".join(f"{r.candidate.text()}: {r.why}" for r in invalid[:5]))
    return ranked, over


def plan_auto(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any], *, devices: Any = None, mesh: Any = None,
              machine: Any = None, memory: Any = None, backend: str | None = None, given: Mapping[str, Any] | None = None) -> Choice:
    """``nvtp.plan(model, *args, plan="auto", mesh=N)``: the checks of its arguments, then ``search``.
    ``mesh``: a number of devices or a 1-D mesh (``devices`` the same); ``given``: the options
    ``plan="auto"`` chooses itself that the caller set (refused)."""
    chosen = dict(given or {})
    if chosen:
        raise AutoError(f"plan='auto' chooses the layout and its options itself; leave out "
                        f"{', '.join(f'{k}={v!r}' for k, v in chosen.items())}, or give a plan (megatron, megatron-sp) with them")
    n = devices_of(mesh if mesh is not None else devices)
    if backend is None:
        backend = backends.default_name(next((p.device.type for p in model.parameters()), "cpu"))
    return search(model, tuple(args), kwargs, devices=n, machine=machine, memory=memory, backend=backend)


def devices_of(mesh: Any) -> int:
    """The number of devices ``mesh`` names: a positive integer or a 1-D mesh (plan='auto' chooses the shape)."""
    if isinstance(mesh, int) and not isinstance(mesh, bool) and mesh >= 1:
        return mesh
    shape = tuple(getattr(mesh, "shape", ()) or ())
    if mesh is None or isinstance(mesh, bool) or len(shape) != 1:
        raise AutoError(f"plan='auto' plans for a number of devices and chooses the mesh's shape itself: pass mesh=N (or a 1-D "
                        f"mesh of N devices), got {mesh!r}")
    return int(shape[0])


def _nearby(devices: int) -> str:
    return ", ".join(str(n) for n in sorted({max(1, devices - 1), devices + 1, 2 ** round(math.log2(max(1, devices)))}) if n != devices)


__all__ = ["AutoError", "Choice", "Rejected", "search", "plan_auto", "devices_of", "fitting", "candidates", "parse_memory", "machine_of", "least_memory", "weight_bytes"]
