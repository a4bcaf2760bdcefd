"""``plan="auto"``: the compiler chooses the parallel layout from a cost and memory model.

    choice = nvtp.auto.search(model, (idx, targets), devices=8, machine="h100-ib", memory="80GB")
    print(choice.as_text())                          # the chosen plan, a ranked table, why the others lost
    sm = nvtp.jit(model, plan="auto", mesh=world)    # plans on the first call, then trains with the choice

* ``search.py``     the search: bad input first, candidates from the axis strategies, pruned by memory, costed
* ``candidate.py``  a candidate: each axis's extent, the options, the recompute mode
* ``sample.py``     the model as the planner traces it: cut to three blocks, ops placed in blocks
* ``costing.py``    the cost and memory model, in one place (docs/auto.md)
* ``runtime.py``    ``nvtp.jit(plan="auto")``: every rank passes the whole batch

Everything axis-specific is asked of the strategies (``refuse``, ``choices``, ``conflicts``,
``cost_terms``, ``memory_terms``); no module here names an axis.
"""

from nvtp.auto.candidate import Candidate
from nvtp.auto.costing import Costed, Costing
from nvtp.auto.search import AutoError, Choice, parse_memory, search

__all__ = ["AutoError", "Candidate", "Choice", "Costed", "Costing", "parse_memory", "search"]
