"""A fusion lowered to a torch.fx GraphModule: straight-line Python, one call per op.

``lower`` writes one fx node per op, named after the value it makes (``T19 =
fd_ops_rsqrt(ctx, T18)``), whose target is the op's one implementation as ``call_for(op)``
gives it (the reference backend passes ``execute_op`` bound to the op). Constants, and ops the
caller folded, enter as module attributes. fx's own code generation then gives straight-line
code that drops each value after its last use (``T18 = None``).

Before the ops are bound, ``patterns.fuse`` may replace op subgraphs (LayerNorm, tanh-GELU,
softmax) by torch's fused kernels: while matching, each op node's target is one function per op
kind (``kind_target``) and its arguments are its operands, so fx's ``SubgraphMatcher`` compares
graphs of op kinds. This module knows nothing of the implementations; the reference backend
(``reference.run``) owns them and the cache of lowered modules.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from nvtp.ir.graph import Fusion, Op, is_value

# Arguments a pattern compares even when they are literals (``add(T19, 1e-05)``); every other
# argument takes part in matching only when it holds values.
_POSITIONAL = ("arg", "lhs", "rhs", "condition", "x", "y")


@functools.cache
def kind_target(kind: str) -> Callable[..., Any]:
    """The stand-in target of every ``kind`` op node while patterns are matched."""

    def target(*args):
        raise RuntimeError(f"fd.ops.{kind} was not bound to its implementation")

    target.__name__ = target.__qualname__ = f"fd_ops_{kind}"
    return target


def _holds_value(a: Any) -> bool:
    return is_value(a) or (isinstance(a, tuple) and any(is_value(e) for e in a))


def value_args(op: Op) -> list[str]:
    """The names of ``op``'s arguments that hold values: the node's arguments at run time, in order."""
    return [name for name, a in op.args if _holds_value(a)]


def _wait(handles: list[Any], k: int) -> Any:
    """The result of the ``k``-th collective a start node began: blocks until it is done."""
    return handles[k].wait()


class _TakesList(fx.graph.CodeGen):
    """Code taking its inputs in one list, which it empties: ``forward(self, inputs)``. A
    function's arguments live until it returns, so a module called as ``forward(ctx, *inputs)``
    holds every input to its end; from a list it drops each after its last use, as fx drops its
    own values (a backward frees each activation the forward saved once it has read it, as
    eager autograd does). The boxed calling convention of torch's compiled autograd."""

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, **kwargs: Any) -> str:
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        head = f"def {self._func_name}(self, inputs){maybe_return_annotation}:"
        if not names:
            return head
        return f"{head}\n    {', '.join(names)}, = inputs\n    inputs.clear()"


def taking_list(module: fx.GraphModule) -> Callable[[list[Any]], Any]:
    """``module``'s code as ``run(inputs)``, ``inputs`` the list of what ``module.forward``
    takes (``[ctx, *values]``): emptied on entry, each input dropped after its last use."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    graph.set_codegen(_TakesList())
    return fx.GraphModule(module, graph, class_name=type(module).__name__).forward


def _complete(handles: list[Any]) -> None:
    """Block until the collective a start node began is done, freeing its buffers; each result
    is still taken where its ``set`` stands (``Issue.done``)."""
    handles[0].complete()


def lower(
    fusion: Fusion,
    call_for: Callable[[Op], Callable[..., Any]],
    constants: Mapping[str, Any],
    *,
    rewrite: Callable[[fx.Graph], Any] | None = None,
    all_values: bool = False,
    starts: Mapping[int, list[Any]] | None = None,
    start_for: Callable[[Any, list[Op]], Callable[..., Any]] | None = None,
    rings: Sequence[Any] = (),
    ring_for: Callable[[Any, Op, list[Op]], Callable[..., Any]] | None = None,
) -> Callable[..., Any]:
    """``fusion`` as a GraphModule ``forward(ctx, *inputs)`` returning its outputs; with
    ``all_values``, the same graph run by fx's Interpreter, returning every value by name. Ops
    whose results are all in ``constants`` are left out; ``rewrite(graph)`` runs on the matching
    form (see the module docstring).

    ``starts`` (op index -> the ``nvtp.sharding.overlap.Issue``s started after that op; -1:
    before the first) schedule collectives: after the op, one node ``start_for(issue, set ops)(ctx,
    *their operands)`` starts them and gives one handle per ``set``; each ``set`` op becomes a node
    that waits for its handle where the op stood. An issue with a ``done`` is first waited for as
    a whole after that op (before the issues starting there).

    ``rings`` (``nvtp.sharding.overlap.Ring``s): each runs its ``set`` and ``linear``s as one node
    ``ring_for(ring, set op, linear ops)(ctx, x, *(weight, bias) of each linear)``, where the
    ``set`` stands; it gives the ``set``'s result (and, for a gather, each linear's).

    Start, wait and ring nodes carry ``meta["communicates"]`` (``inductor.py`` keeps them out of
    what it compiles); every op node keeps its ``Op`` in ``meta["op"]``."""
    g = fx.Graph()
    ctx = g.placeholder("ctx")
    env: dict[str, fx.Node] = {}
    root = torch.nn.Module()
    for v in fusion.inputs:
        env[v.name] = g.create_node("placeholder", v.name, name=v.name)
        env[v.name].meta["value"] = v
    for name, c in constants.items():
        attr = f"const_{name}"
        setattr(root, attr, c)
        env[name] = g.get_attr(attr)
        env[name].meta["value"] = fusion.values[name]

    def arg(a: Any) -> Any:
        if is_value(a):
            return env[a.name]
        if isinstance(a, tuple) and any(is_value(e) for e in a):
            return tuple(arg(e) for e in a)
        return a

    set_ops = {op.outputs[0].name: op for op in fusion.ops if op.kind == "set" and op.outputs}
    handles: dict[str, tuple[fx.Node, int]] = {}

    done_at: dict[int, list[Any]] = {}
    for issue in (i for at_issues in (starts or {}).values() for i in at_issues):
        if issue.done is not None:
            done_at.setdefault(issue.done, []).append(issue)

    def start(at: int) -> None:
        for issue in done_at.get(at, ()):
            node = g.call_function(_complete, (handles[issue.sets[0]][0],), name=f"done_{issue.sets[0]}")
            node.meta["communicates"] = True
        for issue in (starts or {}).get(at, ()):
            ops = [set_ops[name] for name in issue.sets]
            node = g.call_function(start_for(issue, ops), (ctx, *(env[op.operands[0].name] for op in ops)),
                                   name=f"start_{issue.sets[0]}")
            node.meta["communicates"] = True
            handles.update((name, (node, k)) for k, name in enumerate(issue.sets))

    ring_at = {r.at: r for r in rings}
    in_rings = {k for r in rings for c in r.chains for k in c}
    values = fusion.values

    def ring(r: Any, op: Op) -> None:
        products = [fusion.ops[k] for k in r.linears]
        made = [fusion.ops[c[-1]].outputs[0] for c in r.chains]  # what each product's chain hands on
        weights = tuple(a for p in products for a in (arg(p.operands[1]), arg(p.arg("bias")) if p.kind == "linear" else None))
        node = g.call_function(ring_for(r, op, products), (ctx, env[values[r.x].name], *weights), name=f"ring_{op.outputs[0].name}")
        node.meta["communicates"] = True
        if r.kind != "allgather-linear":
            env[op.outputs[0].name] = node
            node.meta["value"] = op.outputs[0]
            return
        for k, v in enumerate([op.outputs[0]] + made):
            env[v.name] = g.call_function(operator.getitem, (node, k), name=v.name)
            env[v.name].meta["value"] = v

    start(-1)
    for index, op in enumerate(fusion.ops):
        if op.kind in ("define_tensor", "define_scalar") or all(v.name in constants for v in op.outputs):
            start(index)
            continue
        if index in in_rings:  # a ring's linear: computed by its ring (a gather's) or inside it (a reduce-scatter's)
            start(index)
            continue
        if index in ring_at:
            ring(ring_at[index], op)
            start(index)
            continue
        if op.outputs and op.outputs[0].name in handles:  # a scheduled set: wait for it here
            node, k = handles[op.outputs[0].name]
            env[op.outputs[0].name] = g.call_function(_wait, (node, k), name=op.outputs[0].name)
            env[op.outputs[0].name].meta["value"] = op.outputs[0]
            env[op.outputs[0].name].meta["communicates"] = True
            start(index)
            continue
        args = tuple(arg(a) for name, a in op.args if name in _POSITIONAL or _holds_value(a))
        if len(op.outputs) == 1:
            node = env[op.outputs[0].name] = g.call_function(kind_target(op.kind), args, name=op.outputs[0].name)
            node.meta["value"] = op.outputs[0]
        else:
            node = g.call_function(kind_target(op.kind), args, name="_".join(v.name for v in op.outputs))
            for i, v in enumerate(op.outputs):
                env[v.name] = g.call_function(operator.getitem, (node, i), name=v.name)
                env[v.name].meta["value"] = v
        node.meta["op"] = op
        start(index)
    if all_values:
        g.output({name: node for name, node in env.items()})
    else:
        g.output([env[v.name] for v in fusion.outputs])
    if rewrite is not None:
        rewrite(g)
    for node in list(g.nodes):  # constants only folded ops read
        if node.op == "get_attr" and not node.users:
            g.erase_node(node)
    for node in g.nodes:  # bind each op node to its implementation; its arguments: the values it reads
        op = node.meta.get("op")
        if op is not None:
            names = [name for name, a in op.args if name in _POSITIONAL or _holds_value(a)]
            node.target = call_for(op)
            node.args = (ctx,) + tuple(a for name, a in zip(names, node.args) if _holds_value(op.arg(name)))
    g.lint()
    if all_values:  # a debugging run: fx's Interpreter runs the graph without generating code first
        return fx.Interpreter(root, graph=g).run
    return fx.GraphModule(root, g, class_name=f"{fusion.name or 'Fusion'}")
