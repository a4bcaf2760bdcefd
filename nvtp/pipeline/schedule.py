"""Pipeline schedules as data: each stage's list of actions, forward or backward of a microbatch.

    actions("1f1b", stage=0, stages=4, microbatches=8)   # [F0, F1, F2, F3, B0, F4, B1, ...]
    bubble("1f1b", stages=4, microbatches=8)              # (p - 1) / (m + p - 1) = 3/11
    in_flight("1f1b", stage=0, stages=4, microbatches=8)  # microbatches whose activations a stage holds at once

GPipe runs every forward, then every backward; 1F1B (PipeDream-Flush, Megatron's default) runs
p - s - 1 forwards to fill the pipe, then one forward and one backward in turn, then drains. Both
have the bubble (p - 1) / (m + p - 1) of a step's time; 1F1B holds at most p - s microbatches'
activations on stage s instead of m. These are the orders of torch.distributed.pipelining's
``ScheduleGPipe`` and ``Schedule1F1B`` (their ``_step_microbatches``); nvtp runs them itself
rather than through those classes, because a pipelining ``PipelineStage`` wraps an ``nn.Module``
run by autograd, sends one tensor tuple to the next stage only, and passes the batch's arguments
to the first stage only, while an nvtp stage is a pair of sharded fusions whose arguments (the
targets) may be read by any stage (docs/pipeline.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from nvtp.sharding.axes import MeshError

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def check(schedule: str) -> str:
    name = schedule.lower().replace("-", "")
    if name not in SCHEDULES:
        raise MeshError(f"schedule={schedule!r}: nvtp runs the pipeline schedules {', '.join(map(repr, SCHEDULES))}")
    return name


def actions(schedule: str, stage: int, stages: int, microbatches: int, backward: bool = True) -> list[Action]:
    """Stage ``stage``'s actions, in order (forwards only without ``backward``)."""
    schedule, m = check(schedule), microbatches
    if not backward:
        return [Action("F", i) for i in range(m)]
    if schedule == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    out = [Action("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        out += [Action("F", f), Action("B", b)]
        f, b = f + 1, b + 1
    out += [Action("B", i) for i in range(b, m)]
    return out


def in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """The most microbatches whose forward ran and backward did not yet, on ``stage``."""
    held = most = 0
    for a in actions(schedule, stage, stages, microbatches):
        held += 1 if a.kind == "F" else -1
        most = max(most, held)
    return most


def bubble(schedule: str, stages: int, microbatches: int) -> float:
    """The idle fraction of a step, (p - 1) / (m + p - 1), for GPipe and 1F1B alike (equal stages)."""
    check(schedule)
    return (stages - 1) / (microbatches + stages - 1)


def flights(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Each action of a pipeline stage, in order: ("F" or "B", the microbatches whose activations
    it holds then, the backwards done before it)."""
    out, held, done = [], 0, 0
    for a in actions(schedule, stage, stages, microbatches):
        if a.kind == "F":
            held += 1
            out.append(("F", held, done))
        else:
            out.append(("B", held, done))
            held, done = held - 1, done + 1
    return out


__all__ = ["Action", "actions", "bubble", "in_flight", "SCHEDULES", "check", "flights"]
