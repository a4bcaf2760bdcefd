"""A rank's lowered fusion compiled by torch's Inductor: the ``compile="inductor"`` mode.

``compile="kernels"`` runs each rank's fusion as a torch.fx module of one call per op, the groups
eager PyTorch runs as one kernel already replaced by it (``kernels.py``). This mode goes one step
further: the module is cut into *pieces* at every node that must run as Python on each call, and
each piece between them is traced to an aten graph (``make_fx``, real tensors) and compiled by
Inductor (``torch._inductor.compile``: its C++ kernels fuse the pointwise ops and reductions
around the matrix products). What stays Python, in its place and order:

* collectives: every ``set`` op the program did not take out (it moves data between ranks), and
  the scheduled start / wait / ring nodes of ``lower.lower`` (``meta["communicates"]``), so
  communication still overlaps compute as the schedule says;
* ops whose result depends on the call (``PER_CALL``: random draws, keyed by the call's seed; the
  attention backward, which runs a cp ring when the program says so);
* on an ep axis, the ops that run on the expert rows (``meta["experts"]``, ``EXPERT_ROWS``): each
  ``gather_mm`` / ``gather_mm_wgrad`` and the row-wise ops between them, which ``ep.Experts``
  runs on rows it dispatched by all-to-all along routes read from the routing index (an argsort,
  counts exchanged): communication and data-dependent indexing, op by op as the kernels pass
  leaves them. The rest of the fusion (attention, norms, the router, the dense MLPs) compiles.

A piece is traced with the context of the first call; what the compiled code bakes in from it
(local shapes, the global indices a rank holds, folded constants) is fixed per mesh position,
which is what the lowered module is cached by. A piece whose inputs arrive with other shapes or
strides than it was compiled for runs its Python instead, and so does a piece that cannot be
traced (a data-dependent read): counted in ``Compiled.python``, never silent.

``compile="auto"`` traces the pieces the same way on the first call, but compiles them only where
an earlier run did (all of them, on every rank), and otherwise leaves them to a background process
for the next run (``precompile.py``): a first run pays no compile, a later one a second or two.

Where the reference backend runs a fusion op by op anyway (``reference.run``: inputs of other
shapes or dtypes than declared, ``strict``, ``values``, ``compute_dtype``) nothing is compiled
either, and ``reference.run`` warns once per fusion that ``compile="inductor"`` was asked for and
not done, with why (``Compiled.python`` cannot count what was never cut).

Compiling is slow (Inductor's C++ build: tens of seconds for a small GPT's forward and backward
on one core); Inductor keeps what it compiled in its own cache on disk, keyed by the aten graph,
its inputs' shapes and strides and torch's version and configuration: the ranks of a job, and
later runs, compile from it. Under nvtp that cache is ``$NVTP_CACHE_DIR/inductor`` (unless
``TORCHINDUCTOR_CACHE_DIR`` is set), and Inductor's per-process check of the CPU's vector
instructions is answered from disk after its first run (``inductor_cache.py``).
"""

from __future__ import annotations

import operator
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.split_module import split_module

from nvtp.execute import inductor_cache
from nvtp.execute.lower import taking_list
from nvtp.ir.ops import RANDOM

# Op kinds whose implementation reads something of the call, not of the mesh position (why, per kind).
PER_CALL: dict[str, str] = {kind: "draws random numbers from the call's seed" for kind in RANDOM} | {
    "set": "moves data between ranks (a collective)",
    "sdpfa_bwd": "runs a cp ring's exchanges when the program says so",
}

SCHEDULED = "starts, waits for or rings a scheduled collective"  # why lower.py's communicating nodes stay Python
EXPERT_ROWS = "runs on the rows an ep axis moves to its experts' ranks (all-to-all, data-dependent routes)"  # meta["experts"]
MIN_OPS = 4  # a piece of fewer op calls runs as Python: compiling it would cost more than it saves


def inductor(graph: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[[list[torch.Tensor]], Any]:
    """Inductor's code for an aten graph traced on ``inputs``, called as ``code(xs)`` with a list
    of tensors like them, which it empties: each input is freed inside the code after its last
    use (the graph is compiled as taking one list, the placeholder marked ``steal_arg``: torch's
    boxed calling convention, as compiled autograd's graphs are; called with the tensors as
    arguments, Inductor's wrapper would hold every one of them to its end).

    Compiled inside a tracing context whose fake mode has a shape environment: Inductor's graph
    cache on disk is read and written only there ("Bypassing FX Graph Cache because 'No shape
    env'" otherwise), and without it every process generates and builds its C++ again."""
    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):
        return torch._inductor.compile(_taking_one_list(graph), [list(inputs)])


def _taking_one_list(graph: fx.GraphModule) -> fx.GraphModule:
    """``graph`` with its inputs taken from one list placeholder (``inputs[k]``), marked for
    Inductor to empty (``steal_arg``)."""
    g = fx.Graph()
    box = g.placeholder("inputs")
    box.meta["steal_arg"] = True
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    env = {p: g.call_function(operator.getitem, (box, k)) for k, p in enumerate(placeholders)}
    g.output(g.graph_copy(graph.graph, env))
    return fx.GraphModule(graph, g)


# What compiles a piece's aten graph: Inductor; its code is called with a list of the graph's inputs,
# which it may empty. The fast tests put the traced aten graph itself here (it runs what Inductor
# would compile, without its minutes of C++ builds), to check the cutting and tracing on their own.
compiler: Callable[[fx.GraphModule, list[torch.Tensor]], Callable[..., Any]] = inductor
_LOCK = threading.Lock()  # one trace and compile at a time (simulated ranks are threads of one process)


@dataclass
class Compiled:
    """A lowered module with its pieces compiled: ``run(ctx, *inputs)`` as the module's forward."""

    run: Callable[..., Any]
    pieces: int  # compiled by Inductor
    python: dict[str, int] = field(default_factory=dict)  # why a piece runs as Python -> how many
    seconds: float = 0.0  # tracing and compiling, on the first call
    # compile="auto": the records and queue (precompile.Ahead); None: compile="inductor",
    # each piece compiled on its first call
    ahead: Any = None
    traced: list["_Piece"] = field(default_factory=list)  # pieces traced on the first call, waiting for decide()
    decided: bool = False
    queued: int = 0  # pieces left to the background compile for a later run
    taking: Callable[[list[Any]], Any] | None = None  # run as run([ctx, *inputs]), the list emptied (lower.taking_list)

    def decide(self, comm: Any) -> None:
        """``compile="auto"``, after the module's first call: compile every traced piece now (from
        Inductor's cache) if an earlier run compiled all of them, on every rank of ``comm`` (so
        that replicated values are computed by the same code on each rank and stay equal), else
        none and queue the missing ones for the background compile (precompile.py)."""
        self.decided = True
        ready = all(p.graph is not None and p.warm for p in self.traced)
        flag = torch.tensor([1.0 if ready else 0.0])
        for axis in getattr(comm, "axes", None) or ([comm] if comm.size > 1 else []):
            flag = axis.all_reduce(flag, "min")  # every rank ready, or none compiles
        if flag.item() == 1.0:
            for p in self.traced:
                p.build()
        else:
            for p in self.traced:
                if p.graph is not None and not p.warm:
                    self.ahead.queue(p.key, p.graph, p.layout)
                    self.queued += 1
                p.graph = None
                p._python("left to the background compile, for a later run")
            self.ahead.start()
        self.traced.clear()


def _why_python(node: fx.Node) -> str | None:
    """Why ``node`` runs as Python on every call (a scheduled collective, or an op of ``PER_CALL``);
    None: it computes, and may be compiled."""
    if node.meta.get("communicates"):
        return SCHEDULED
    if node.meta.get("experts"):
        return EXPERT_ROWS
    op = node.meta.get("op")
    return PER_CALL.get(op.kind) if op is not None else None


def _stays_python(node: fx.Node) -> bool:
    return _why_python(node) is not None


def _pieces(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each computing node's piece: runs of compute get one number each, every node that stays
    Python (with the ``getitem``s of its results) one of its own, numbered in graph order."""
    part: dict[fx.Node, int] = {}
    k = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in part \
                and _stays_python(node.args[0]):
            part[node] = part[node.args[0]]
        elif _stays_python(node):
            k += 1
            part[node] = k
            k += 1
        else:
            part[node] = k
    return part


class _Piece:
    """A compute piece of the split module: its Inductor code where inputs match what it was
    compiled for, its Python (the submodule) otherwise."""

    def __init__(self, sub: fx.GraphModule, name: str, report: Compiled):
        self.sub, self.name, self.report = sub, name, report
        self.code: Callable[[list[torch.Tensor]], Any] | None = None  # Inductor's, called with a list it empties
        self.as_python: Callable[[list[Any]], Any] | None = None  # the submodule taking a list (lower.taking_list)
        self.tried = False
        self.ctx_at: int | None = None
        self.layout: list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]] = []
        self.spec: Any = None
        self.graph: fx.GraphModule | None = None  # the traced aten graph, until it is compiled
        self.key = ""  # compile="auto": the graph's key among precompile.py's records
        self.warm = False  # compile="auto": an earlier run compiled it

    def _python(self, why: str) -> None:
        self.report.python[why] = self.report.python.get(why, 0) + 1

    def _compile(self, args: tuple, out: Any) -> None:
        self.tried = True
        ops = sum(1 for n in self.sub.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
        if ops < MIN_OPS:
            self._python(f"fewer than {MIN_OPS} ops")
            return
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        others = [i for i in range(len(args)) if i not in tensors]
        if len(others) > 1:
            self._python("reads values that are not tensors")
            return
        self.ctx_at = others[0] if others else None
        ctx = args[self.ctx_at] if others else None
        xs = [args[i] for i in tensors]
        spec_box: list[Any] = []

        def flat(*ts):
            full = list(ts)
            if self.ctx_at is not None:
                full.insert(self.ctx_at, ctx)
            out, spec = pytree.tree_flatten(self.sub(*full))
            spec_box.append(spec)
            return out

        start = time.perf_counter()
        try:
            with _LOCK:
                graph = make_fx(flat, tracing_mode="real")(*xs)
            if not all(isinstance(o, torch.Tensor) for o in pytree.tree_leaves(out)):
                self._python("gives values that are not tensors")
                return
            self.graph, self.spec = graph, spec_box[-1]
            self.layout = [(tuple(x.shape), tuple(x.stride()), x.dtype) for x in xs]
            if self.report.ahead is None:
                self.build(xs)
                return
            ahead = self.report.ahead
            self.graph = graph = ahead.settled(graph)
            self.key = ahead.key(graph, self.layout)
            self.warm = ahead.done(self.key)
            self.report.traced.append(self)  # Compiled.decide compiles it, or queues it
        except Exception as e:  # noqa: BLE001 - an untraceable piece runs as Python (counted, warned once)
            self.graph = None
            self._python(f"not traced ({type(e).__name__})")
            if self.report.ahead is None:  # asked for (compile="inductor"): said; under "auto", counted in the report
                warnings.warn(f"nvtp compile='inductor': piece {self.name} runs op by op: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}", stacklevel=2)
        finally:
            self.report.seconds += time.perf_counter() - start

    def build(self, xs: list[torch.Tensor] | None = None) -> None:
        """Compile the traced graph (on inputs like ``xs``: by default new ones of its layouts)."""
        start = time.perf_counter()
        try:
            if xs is None:
                xs = [torch.empty_strided(shape, stride, dtype=dtype) for shape, stride, dtype in self.layout]
            with _LOCK:
                self.code = compiler(self.graph, xs)
        except Exception as e:  # noqa: BLE001 - a piece Inductor cannot compile runs as Python (counted, warned)
            self._python(f"not compiled ({type(e).__name__})")
            warnings.warn(f"nvtp compile='inductor': piece {self.name} runs op by op: Inductor: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}", stacklevel=2)
            return
        finally:
            self.graph = None
            self.report.seconds += time.perf_counter() - start
        self.report.pieces += 1

    def take(self, args: list[Any]) -> Any:
        """The piece on ``args`` (its inputs in order), a list it empties: each input is dropped
        after its last use, in the compiled code as in the Python."""
        if not self.tried:  # the first call runs the Python, which fills the context's per-position caches
            given = tuple(args)  # (held indices, local shapes), then compiles: the trace reads them as given
            args.clear()
            out = self.sub(*given)
            self._compile(given, out)
            return out
        xs = [a for i, a in enumerate(args) if i != self.ctx_at]
        if self.code is None or len(xs) != len(self.layout) or any(
                not isinstance(x, torch.Tensor) or (tuple(x.shape), tuple(x.stride()), x.dtype) != want
                for x, want in zip(xs, self.layout)):
            if self.as_python is None:  # not compiled, or another layout than compiled for: the piece's Python, exactly
                self.as_python = taking_list(self.sub)
            return self.as_python(args)
        args.clear()
        return pytree.tree_unflatten(list(self.code(xs)), self.spec)


def compile_module(module: fx.GraphModule, *, ahead: Any = None) -> Compiled:
    """``module`` (``lower.lower``'s GraphModule ``forward(ctx, *inputs)``, fused) cut into pieces
    at the nodes that stay Python; each compute piece is compiled on its first call (see the module
    docstring). Requires: every op node carries ``meta["op"]``, communicating nodes
    ``meta["communicates"]``. Ensures: ``Compiled.run(ctx, *inputs)`` gives what
    ``module.forward(ctx, *inputs)`` gives, the Python nodes run in their order on every call.
    ``ahead`` (``compile="auto"``: a ``precompile.Ahead``): pieces are traced on the first call and
    compiled by ``Compiled.decide`` after it, or left to the background compile (``precompile.py``)."""
    inductor_cache.prepare()
    module = _constants_inlined(module)
    part = _pieces(module.graph)
    stays = {k: _why_python(n) for n, k in part.items() if _stays_python(n)}
    split = split_module(module, module, lambda n: part[n], keep_original_order=True)
    report = Compiled(run=split.forward, pieces=0, ahead=ahead)
    # Each submodule called as a function, not a module: a fusion is no module of the user's, so
    # module hooks (torch's CommDebugMode / ModTracker) must not see its pieces.
    for node in list(split.graph.nodes):
        if node.op != "call_module":
            continue
        sub = split.get_submodule(node.target)
        why = stays.get(int(node.target.rsplit("_", 1)[-1]))
        if why is not None:
            report.python[why] = report.python.get(why, 0) + 1
        with split.graph.inserting_before(node):
            if why is not None:
                new = split.graph.call_function(_named(sub.forward, node.target), node.args, node.kwargs)
            else:  # its inputs handed over in a list the piece empties: none is held by this call to its end
                inputs = split.graph.call_function(_listed, node.args, name=f"inputs_{node.target}")
                new = split.graph.call_function(_named(_Piece(sub, node.target, report).take, node.target), (inputs,))
        node.replace_all_uses_with(new)
        split.graph.erase_node(node)
    split.recompile()
    report.run = split.forward
    report.taking = taking_list(split)
    return report


def _constants_inlined(module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``module`` whose constants (``get_attr``) are made by a node before each reader:
    ``split_module`` would pass them to the pieces as inputs, which ``make_fx`` traces as data
    (a folded scalar read as a number would then be a data-dependent read)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(module, node.target)
        for user in list(node.users):
            with graph.inserting_before(user):
                made = graph.call_function(_named(lambda value=value: value, node.target), ())
            made.meta = dict(node.meta)
            user.replace_input_with(node, made)
        graph.erase_node(node)
    return fx.GraphModule(module, graph)


def _listed(*values: Any) -> list[Any]:
    return list(values)


def _named(call: Callable[..., Any], name: str) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        return call(*args)

    run.__name__ = run.__qualname__ = name
    return run
