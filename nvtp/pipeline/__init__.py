"""Pipeline parallelism: a (pp, dp, tp) mesh laid out as Megatron lays it out (issue 26).

* ``stages.py``   stages cut by the compiler from the traced program at block boundaries, balanced by cost
* the layout of ranks and groups (Megatron's order: tp fastest, then dp, then pp) is the pp axis's strategy: ``nvtp.sharding.axes.pp``
* ``schedule.py`` GPipe and 1F1B as lists of actions; bubble and in-flight microbatches
* ``program.py``  ``PipelineProgram``: each stage's Program, the p2p steps with bytes, the report
* ``runtime.py``  ``nvtp.jit`` on a "pp" mesh: this rank's stage, the schedule, p2p on gloo/NCCL
* ``demo.py``, ``cli.py``  ``nvtp demo --mesh PPxDPxTP``, ``nvtp explain --mesh PPxDPxTP``

The compile driver (``nvtp.driver.compile_pipeline``) does all tracing and sharding.
"""

from __future__ import annotations

from typing import Any


def plan(model, *example_args, plan: Any = "megatron", mesh: Any = None, microbatches: int = 1, schedule: str = "1f1b",
         cut: Any = None, backend: str = "reference", **example_kwargs):
    """The ``PipelineProgram`` ``nvtp.jit(model, plan=plan, mesh=mesh, microbatches=...)`` runs for
    one rank's batch ``example_args`` (nothing computed; the model's parameters untouched):
    ``.as_text()`` is what ``nvtp explain --mesh PPxDPxTP`` prints, ``.as_data()`` the same as data."""
    from nvtp import driver  # lazy: loads Thunder; CLI file commands load this module without it

    return driver.compile_pipeline(model, *example_args, plan=plan, mesh=mesh, microbatches=microbatches, schedule=schedule,
                                   cut=cut, backend=backend, **example_kwargs)


__all__ = ["plan"]
