"""Regional compilation on the FX route: a transformers model's decoder layers traced once.

dynamo's export and Thunder's trace of a transformers model both take time per layer (``nvtp.jit``
of a small Llama: about 6 s a layer on this CPU), so a 32- or 80-layer model would take minutes to
plan. As the Thunder route does (``nvtp.frontend.regional``), this route traces one layer and the
model without its layers, and splices L copies of the layer's fusions into the model's: still ONE
forward and ONE backward fusion, computing what the whole trace computes (tests/test_fx_regional.py
compares outputs and every gradient, bit for bit, fp32 and bf16). The steps:

1. ``blocks.find_repeated`` finds the repeated layers (``model.layers`` of a ``LlamaForCausalLM``:
   the outermost ``nn.ModuleList`` of 2 or more blocks of one class and parameter shapes), and
   ``prove`` groups them into *variants* by a run of the model on fake tensors
   (``nvtp.frontend.variants``, ``Recording.call_variants``): two layers are one variant when they
   compute the same program and the model calls them with the same values (the same mask, the
   same rotary tables), so a layer called with a sliding-window mask is a variant of its own; the
   code between layers must be the same for every layer, and the model cut to ``keep`` layers must
   run as the whole does outside them.
2. dynamo exports the model cut to its first ``keep`` layers (``blocks.truncated``): 2 when all are
   one variant, else up to the first layer of each variant and the second of layer 0's; one graph,
   whatever the depth (``fx.export_graph``; the rewrites of the FX route are done on it).
3. ``cut`` finds each layer's nodes by dynamo's ``nn_module_stack`` (the node ran inside
   ``<prefix>.<i>``) and checks that layer 0 and the next layer of its variant are one
   computation on a chain: the latter's nodes are layer 0's, node for node (the same ops, the same
   literals, parameters of the same relative names), where layer 0 reads a value ``x`` of the
   model the latter reads the layer before's one output (the *carry*, the residual stream), and
   every other value of the model the two read is the same (an *invariant*: the rotary tables
   ``cos`` and ``sin``, an attention mask). Every later layer reads the layer before's output as
   its carry, and model values (its own invariants: another mask); nothing but the next layer
   reads a layer, nothing but the rest of the model reads the last one's output.
4. From that graph the graph modules: the *skeleton*, the model with the layers replaced by
   ``carry * MARK`` (``template.Boundary``'s marker, another factor) that also returns the
   invariants; and a *block* for each variant, its first layer's nodes reading the carry and the
   invariants it reads as arguments and its parameters by their names in the layer. Each has its
   constants folded (``fx_constants.fold_constants``) and, when asked, its fused projections split
   (``fx._split_parts``; a block's parts are named per layer).
5. Thunder traces each (``capture``), and ``template.splice_template`` builds the L-layer fusions:
   the skeleton's, its marker replaced by L copies, each of its variant's block (parameters named
   ``<prefix>.<i>.<name>``, the carry chained, every copy reading the skeleton's invariants; a
   constant a block folded is one input that every copy reads). The skeleton's extra outputs go
   again, but for those a block's backward saves.

Anything that does not fit (a piece Thunder cannot trace alone included) raises ``NotRepeatable``
with the reason, and ``trace`` traces the whole model, saying why in ``Captured.regional``
(``Traced.how``): e.g. a model whose layer 0 is the only one of its variant (Qwen2 with
``max_window_layers=1``: no second layer to tell layer 0's carry from its other inputs). A splice
of several variants says in ``how`` which layers share which variant, and why each is its own.
"""

from __future__ import annotations

import operator
import re
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import thunder

from nvtp.frontend import fx as fxroute
from nvtp.frontend.capture import CaptureError, Captured, MissingOpError, capture, parameter_names
from nvtp.frontend.fx_constants import fold_constants
from nvtp.frontend.fused import Part
from nvtp.frontend.blocks import NotRepeatable, Repeated, find_repeated, truncated
from nvtp.frontend.template import splice_template
from nvtp.frontend.regional import described
from nvtp.frontend.variants import record, variants_text
from nvtp.frontend.moe import gather_mm_experts
from nvtp.gcpause import paused
from nvtp.ir.verify import verify

CARRY = "nvtp_carry"  # the block graph's first argument; its others are nvtp_invariant_<k>
# The skeleton's boundary ``carry * MARK``: a factor no model multiplies its residual stream by
# (Granite's embedding multiplier is 1.0 in small configs: ``x * 1.0`` would be found twice).
MARK = 1.0009765625


# -- 3. the cut ------------------------------------------------------------------------------------

def _module_path(stack_path: str) -> str:
    """dynamo's ``L['self'].model.layers[0].mlp`` (or ``.layers.0.``) as ``model.layers.0.mlp``."""
    p = re.sub(r"^L\['self'\]", "", stack_path)
    p = re.sub(r"\._modules\['([^']+)'\]", r".\1", p)
    p = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", p)
    return p.lstrip(".")


def _block_of(node: fx.Node, prefix: str) -> int | None:
    """The block a node of the graph belongs to (by the module dynamo traced it in), or None."""
    if node.op == "get_attr":
        label = node.target
    else:
        stack = node.meta.get("nn_module_stack") or {}
        label = next((p for p in (_module_path(v[0]) + "." for v in stack.values()) if p.startswith(prefix + ".")), "")
    rest = label[len(prefix) + 1:] if label.startswith(prefix + ".") else ""
    idx = rest.partition(".")[0]
    return int(idx) if idx.isdigit() else None


@dataclass
class Cut:
    """The exported graph of the model cut to its first k blocks, cut into a skeleton and blocks."""

    blocks: list[list[fx.Node]]  # the nodes of blocks 0 .. k-1, in graph order
    carry: fx.Node  # the model's value block 0 reads as its carry
    outputs: list[fx.Node]  # each block's one output
    invariants: list[fx.Node]  # the model's other values the blocks read (each block reads some: ``reads``)
    reads: list[list[int]]  # for each block, the invariants it reads (indices into ``invariants``), in the order first read

    def carry_of(self, p: int) -> fx.Node:
        """The value block ``p`` reads as its carry: the model's for block 0, else the block before's output."""
        return self.carry if p == 0 else self.outputs[p - 1]


@dataclass(frozen=True)
class _In:
    """A node of the block itself, by its position in the block."""

    index: int


@dataclass(frozen=True)
class _Model:
    """A node of the model outside the blocks."""

    node: fx.Node


@dataclass(frozen=True)
class _Out:
    """The carry from the block before (its output)."""


@dataclass(frozen=True)
class _Other:
    """A node of another block (equal to nothing of the other block compared)."""

    node: fx.Node


def _shape(arg: Any, own: dict[fx.Node, int], outside: Any) -> Any:
    """A node's arguments with each node as ``_In`` (of the block) or ``outside(node)``."""
    return fx.node.map_aggregate(arg, lambda a: (_In(own[a]) if a in own else outside(a)) if isinstance(a, fx.Node) else a)


def cut(g: fx.Graph, prefix: str, attrs: dict[str, Any] | None = None, variant_of: list[int] | None = None) -> Cut:
    """Blocks 0 .. k-1 of ``g`` (the model cut to its first k blocks; ``variant_of``: their variants,
    proven by ``prove``, default two of one) and how they read the rest (step 3 of the module
    docstring): block 0 is compared node for node with the next block of its variant, which tells
    its carry from the invariants; every other block reads the block before's output as its carry.
    ``attrs``: the graph's get_attr values; a subgraph of a higher-order op (an autograd.Function's
    ``fwd_body_0``) belongs to the block whose nodes alone read it."""
    attrs = attrs or {}
    variant_of = variant_of if variant_of is not None else [0, 0]
    k = len(variant_of)
    of = {node: _block_of(node, prefix) for node in g.nodes}
    for node in g.nodes:
        if node.op == "get_attr" and of[node] is None and isinstance(attrs.get(node.target), torch.nn.Module):
            readers = {of[u] for u in node.users}
            of[node] = readers.pop() if len(readers) == 1 else None
    blocks: list[list[fx.Node]] = [[] for _ in range(k)]
    for node in g.nodes:
        b = of[node]
        if b is not None:
            if b >= k:
                raise NotRepeatable(f"the graph of the model cut to {k} blocks has nodes of {prefix}.{b}")
            blocks[b].append(node)
    for i, nodes in enumerate(blocks):
        if not nodes:
            raise NotRepeatable(f"dynamo's graph names no nodes of {prefix}.{i} (nn_module_stack)")
    members = [set(b) for b in blocks]
    outputs = []
    for i, nodes in enumerate(blocks):
        leaving = [n for n in nodes if any(u not in members[i] for u in n.users)]
        if len(leaving) != 1:
            raise NotRepeatable(f"block {i} of {prefix} gives the rest of the model {len(leaving)} values, not 1")
        readers = {u for u in leaving[0].users if u not in members[i]}
        if i + 1 < k and not readers <= members[i + 1]:
            raise NotRepeatable(f"the model reads block {i}'s output of {prefix} outside the next block")
        if i + 1 == k and any(of[u] is not None for u in readers):
            raise NotRepeatable(f"block {i} of {prefix} is read by an earlier block")
        outputs.append(leaving[0])
    own = [{n: j for j, n in enumerate(b)} for b in blocks]

    def outside(p: int):
        """How block ``p`` sees a node that is not its own."""
        return lambda n: _Out() if p and n is outputs[p - 1] else _Model(n) if of[n] is None else _Other(n)

    carries: set[fx.Node] = set()
    invariants: dict[fx.Node, None] = {}
    q = next((i for i in range(1, k) if variant_of[i] == variant_of[0]), None)
    if q is None:
        raise NotRepeatable(f"block 0 of {prefix} is the only one of its variant, so its carry cannot be told from what it "
                            "reads besides")
    if len(blocks[0]) != len(blocks[q]):
        raise NotRepeatable(f"blocks 0 and {q} of {prefix} are {len(blocks[0])} and {len(blocks[q])} nodes: they differ")

    def compare(x: Any, y: Any, where: fx.Node) -> None:
        """Block 0's argument ``x`` against block q's ``y`` (both in ``_shape`` form)."""
        if isinstance(x, (tuple, list)) and type(x) is type(y) and len(x) == len(y):
            for a, b in zip(x, y):
                compare(a, b, where)
        elif isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys():
            for key in x:
                compare(x[key], y[key], where)
        elif isinstance(x, _Model) and isinstance(y, _Out):
            carries.add(x.node)
        elif isinstance(x, _Model) and x == y:
            invariants.setdefault(x.node)
        elif type(x) is not type(y) or x != y:
            raise NotRepeatable(f"block {q} of {prefix} differs from block 0 at `{where.format_node()}`")

    def same_attr(a: fx.Node, b: fx.Node) -> bool:
        x, y = attrs.get(a.target), attrs.get(b.target)
        if isinstance(x, fx.GraphModule) and isinstance(y, fx.GraphModule):  # a subgraph: the same code
            return x.code == y.code
        return _in_block(a.target, prefix) == _in_block(b.target, prefix)  # a parameter: the same name in the block

    for a, b in zip(blocks[0], blocks[q]):
        if a.op != b.op or (a.op == "get_attr" and not same_attr(a, b)) or (a.op != "get_attr" and a.target != b.target):
            raise NotRepeatable(f"block {q} of {prefix} differs from block 0 at `{a.format_node()}`")
        compare(_shape((a.args, a.kwargs), own[0], outside(0)), _shape((b.args, b.kwargs), own[q], outside(q)), a)
    if len(carries) != 1:
        raise NotRepeatable(f"block {q} of {prefix} reads block {q - 1}'s output where block 0 reads {len(carries)} values, not 1 "
                            "(the carry)")
    carry = carries.pop()
    if carry in invariants:
        raise NotRepeatable(f"block 0 of {prefix} reads its input {carry.name} also where block {q} does not read block {q - 1}'s output")
    reads = []
    for p, nodes in enumerate(blocks):
        read: dict[fx.Node, None] = {}
        own_carry = carry if p == 0 else outputs[p - 1]
        for node in nodes:
            for a in node.all_input_nodes:
                if a in members[p] or a is own_carry:
                    continue
                if of[a] is not None:
                    raise NotRepeatable(f"block {p} of {prefix} reads `{a.format_node()}` of block {of[a]}")
                read.setdefault(a)
        if p and outputs[p - 1] not in {a for n in nodes for a in n.all_input_nodes}:
            raise NotRepeatable(f"block {p} of {prefix} does not read block {p - 1}'s output")
        for a in read:
            invariants.setdefault(a)
        reads.append([list(invariants).index(a) for a in read])
    return Cut(blocks, carry, outputs, list(invariants), reads)


# -- 4. the skeleton and the block -----------------------------------------------------------------

def _example(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def skeleton_graph(g: fx.Graph, c: Cut) -> fx.Graph:
    """The model's graph with its blocks replaced by ``carry * MARK``, returning the invariants after its outputs."""
    new = fx.Graph()
    new._codegen = fx.graph.CodeGen()
    env: dict[fx.Node, fx.Node] = {}
    inside = set().union(*c.blocks)
    for node in g.nodes:
        if node.op == "output":
            outs = fx.node.map_arg(node.args[0], lambda n: env[n])
            new.output(type(outs)(list(outs) + [env[n] for n in c.invariants]))
        elif node is c.outputs[-1]:
            marker = new.call_function(operator.mul, (env[c.carry], MARK))
            marker.meta = dict(c.carry.meta)
            env[node] = marker
        elif node not in inside:
            env[node] = new.node_copy(node, lambda n: env[n])
    return new


def _in_block(target: str, prefix: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``self_attn.q_proj.weight``; a target not of a block as it is."""
    idx, _, rest = target[len(prefix) + 1:].partition(".") if target.startswith(prefix + ".") else ("", "", "")
    return rest if idx.isdigit() else target


def block_graph(c: Cut, prefix: str, p: int = 0) -> fx.Graph:
    """Block ``p``'s nodes, reading its carry and the invariants it reads as arguments
    (``nvtp_invariant_<j>``, j its index in ``c.invariants``) and its parameters by their names in
    the block (``self_attn.q_proj.weight``)."""
    new = fx.Graph()
    new._codegen = fx.graph.CodeGen()
    env: dict[fx.Node, fx.Node] = {}
    for name, node in [(CARRY, c.carry_of(p))] + [(f"nvtp_invariant_{j}", c.invariants[j]) for j in c.reads[p]]:
        env[node] = new.placeholder(name)
        env[node].meta = dict(node.meta)
    for node in c.blocks[p]:
        if node.op == "get_attr":
            env[node] = new.get_attr(_in_block(node.target, prefix))
            env[node].meta = dict(node.meta)
        else:
            env[node] = new.node_copy(node, lambda n: env[n])
    new.output([env[c.outputs[p]]])
    return new


def _meta_like(node: fx.Node) -> torch.Tensor:
    """A meta tensor like a node's example value (shape, strides, dtype, requires_grad)."""
    ex = _example(node)
    if not isinstance(ex, torch.Tensor):
        raise NotRepeatable(f"the blocks read {node.name}, which is not a tensor ({type(ex).__name__})")
    t = torch.empty_strided(tuple(ex.shape), tuple(ex.stride()), dtype=ex.dtype, device="meta")
    return t.requires_grad_(ex.requires_grad)


# -- 5. trace and splice ---------------------------------------------------------------------------

def _returned(captured: Captured) -> list[Any]:
    """The flat leaves the skeleton's Thunder trace returns (proxies or constants)."""
    ret = thunder.last_traces(captured.jitted)[-1].bound_symbols[-1].args[0]
    output = ret.get("output") if isinstance(ret, dict) else ret
    return list(output) if isinstance(output, (tuple, list)) else pytree.tree_flatten(output)[0]


def _value_of(captured: Captured, proxy: Any) -> str | None:
    """The skeleton forward fusion's value (an output it computes, or an input) for a returned proxy; None if neither."""
    f, fc = captured.forward, captured.forward_callable
    name = getattr(proxy, "name", None)
    for v, p in zip(f.outputs, fc.output_proxies):
        if p == name:
            return v.name
    for v, p in zip(f.inputs, fc.input_proxies):
        if p == name:
            return v.name
    return None


@dataclass
class _Pieces:
    """The skeleton and one block of each variant as graph modules, ready for Thunder."""

    skeleton: fx.GraphModule
    blocks: list[fx.GraphModule]  # variant v's: the first block of that variant
    reads: list[list[int]]  # the invariants each variant's block reads (indices into ``invariants``)
    carry: torch.Tensor  # meta, like the carry block 0 reads
    invariants: list[torch.Tensor]  # meta, like the invariants
    constants: dict[str, torch.Tensor]  # the skeleton's folded constants, then the blocks'
    block_constants: set[str]
    parts: dict[str, Part]  # the skeleton's, and the blocks' per layer


def pieces(exported: fxroute.Exported, rep: Repeated, split_parts: bool, variant_of: list[int] | None = None, k: int = 2) -> _Pieces:
    """Steps 3 and 4 of the module docstring on the graph of the model cut to its first ``k``
    blocks (``variant_of``: every block's variant, default all one)."""
    variant_of = variant_of or [0] * rep.count
    c = cut(exported.graph, rep.prefix, exported.attrs, variant_of[:k])
    carry, invariants = _meta_like(c.carry), [_meta_like(n) for n in c.invariants]
    if any(t.requires_grad for t in invariants):
        raise NotRepeatable(f"the blocks of {rep.prefix} read a value that needs a gradient besides their carry")
    skeleton = exported.module(skeleton_graph(exported.graph, c))
    constants = fold_constants(skeleton, {})
    firsts = [variant_of.index(v) for v in range(max(variant_of) + 1)]
    blocks, block_constants = [], {}
    for p in firsts:
        read = {_in_block(n.target, rep.prefix): exported.attrs[n.target] for n in c.blocks[p] if n.op == "get_attr"}
        block = fx.GraphModule(read, block_graph(c, rep.prefix, p))
        block_constants |= fold_constants(block, {}, first=len(constants) + len(block_constants))
        blocks.append(block)
    parts: dict[str, Part] = {}
    if split_parts:
        skeleton, parts = fxroute._split_parts(skeleton)
        block_parts = []
        for v, block in enumerate(blocks):
            blocks[v], found = fxroute._split_parts(block)
            block_parts.append(found)
        for i, v in enumerate(variant_of):
            for part in block_parts[v].values():
                q = Part(f"{rep.prefix}.{i}.{part.weight}", part.start, part.stop)
                parts[q.label] = q
    return _Pieces(skeleton, blocks, [c.reads[p] for p in firsts], carry, invariants, constants | block_constants,
                   set(block_constants), parts)


def _capture(gm: fx.GraphModule, what: str, *args: Any, outputs: bool = True) -> Captured:
    """Thunder's trace of one piece; a failure is ``NotRepeatable`` (the whole trace then says what fails, and where)."""
    try:
        return capture(gm, *args, outputs=outputs)
    except MissingOpError as e:  # the whole model holds the same op: no other trace would do
        raise type(e)(fxroute.model_lines(gm, str(e))) from None
    except CaptureError as e:
        raise NotRepeatable(f"{what} did not trace ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e


def _splice(skel: Captured, blocks: list[Captured], variant_of: list[int], n_invariants: int, block_constants: set[str],
            carry: torch.Tensor, rep: Repeated):
    """Step 5: the L-layer fusions, and the model's outputs among the spliced forward's user outputs."""
    returned = _returned(skel)
    n_out = len(returned) - n_invariants
    block_in = {block.forward.label(v.name) for block in blocks for v in block.forward.inputs}
    # Each invariant a copy reads: a value of the skeleton's forward fusion, or an input of the
    # model the skeleton does not read itself (a folded constant: the causal mask).
    reads, shared, extras = {}, {label: label for label in block_constants}, set()
    inputs = parameter_names(skel.jitted)
    for k, proxy in enumerate(returned[n_out:]):
        label, value = f"nvtp_invariant_{k}", _value_of(skel, proxy)
        if value is None and getattr(proxy, "name", None) in inputs:
            shared[label] = inputs[proxy.name]
        elif label in block_in:
            if value is None:
                raise NotRepeatable(f"an invariant the blocks read ({getattr(proxy, 'name', proxy)}) is not a value of the "
                                    "skeleton's forward fusion")
            reads[label] = value
            extras.add(value)
    spliced = splice_template(skel.forward, skel.backward, [(b.forward, b.backward) for b in blocks], variant_of, carry, rep.prefix,
                              carry_label=CARRY, reads=reads, shared=shared, extras=extras, mark=MARK)
    verify(spliced.forward)
    if spliced.backward is not None:
        verify(spliced.backward)
    user = [v.name for v in spliced.forward.outputs if spliced.forward.role(v.name) == "output"]
    output_map = []
    for leaf in returned[:n_out]:
        if getattr(leaf, "name", None) is None:  # a number the model returns
            output_map.append(("const", leaf))
            continue
        name = _value_of(skel, leaf)
        if name is None or name not in spliced.renamed:
            raise NotRepeatable(f"the model returns {getattr(leaf, 'name', leaf)!r}, which the spliced forward does not compute")
        output_map.append(("out", user.index(spliced.renamed[name])))
    return spliced, output_map


@dataclass
class Proof:
    """What ``prove`` established: each block's variant, why each variant after the first is its
    own, and how many blocks the cut model keeps (one of each variant, and a second of block 0's)."""

    variant_of: list[int]
    why: list[str]
    keep: int


def prove(module: torch.nn.Module, rep: Repeated, args: tuple, kwargs: dict) -> Proof:
    """Step 1: the blocks grouped by what they compute and what the model calls each with
    (``Recording.call_variants``: a layer called with another mask is another variant), the code
    between blocks the same for every block, and the model cut to its first ``keep`` blocks running
    as the whole does outside them (a run of each on fake tensors, ``nvtp.frontend.variants``).
    ``keep``: up to the first block of every variant and the second of block 0's (whose comparison
    with block 0 tells block 0's carry from its invariants). ``NotRepeatable`` where that fails."""
    with gather_mm_experts(module):  # MoE experts as they are exported (transformers' grouped_mm fails on fake fp32, logging it)
        rec = record(module, rep, args, kwargs)
    variant_of, why = rec.call_variants()
    differs = rec.between_alike()
    if differs:
        raise NotRepeatable(differs)
    second = next((i for i in range(1, rep.count) if variant_of[i] == 0), None)
    if second is None:
        raise NotRepeatable(f"block 0 of {rep.prefix} is the only block of its variant ({variants_text(variant_of, why)}), so its "
                            "carry cannot be told from what it reads besides")
    keep = max(second, *(variant_of.index(v) for v in range(max(variant_of) + 1))) + 1
    cut = f"the model cut to {keep} blocks of {rep.prefix}"
    with gather_mm_experts(module):
        differs = rec.outside_differs(record(truncated(module, rep.prefix, keep), Repeated(rep.prefix, keep), args, kwargs, cut), cut)
    if differs:
        raise NotRepeatable(differs)
    return Proof(variant_of, why, keep)


def _export_cut(module: torch.nn.Module, rep: Repeated, keep: int, args: tuple, kwargs: dict) -> fxroute.Exported:
    """Step 2; a cut model dynamo cannot export is traced whole (where the real error, if any, shows in the user's terms)."""
    try:
        return fxroute.export_graph(truncated(module, rep.prefix, keep), args, kwargs)
    except Exception as e:  # noqa: BLE001 - whatever fails here fails again, or not, in the whole trace
        raise NotRepeatable(f"the model cut to {keep} blocks of {rep.prefix} did not export ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:160] if str(e) else ''})") from e


def trace(module: torch.nn.Module, args: tuple, kwargs: dict, *, split_parts: bool = True) -> tuple[fxroute.Program, Captured]:
    """``fx.trace``, by splicing one traced block per variant when the model has repeated blocks
    (the module docstring); else the whole trace. ``Captured.regional`` says which, and why."""
    start = time.perf_counter()
    try:
        rep = find_repeated(module)
        with paused():
            proof = prove(module, rep, args, kwargs)
            exported = _export_cut(module, rep, proof.keep, args, kwargs)
            p = pieces(exported, rep, split_parts, proof.variant_of, proof.keep)
            export_seconds = time.perf_counter() - start
            leaves = pytree.tree_flatten((tuple(args), dict(kwargs)))[0]
            skel = _capture(p.skeleton, f"the model without the blocks of {rep.prefix}", *leaves, outputs=False)  # hands invariants on
            firsts = [proof.variant_of.index(v) for v in range(len(p.blocks))]
            blocks = [_capture(b, f"block {j} of {rep.prefix} alone", p.carry, *(p.invariants[i] for i in read))
                      for b, j, read in zip(p.blocks, firsts, p.reads)]
            traced_seconds = time.perf_counter() - start - export_seconds
            spliced, output_map = _splice(skel, blocks, proof.variant_of, len(p.invariants), p.block_constants, p.carry, rep)
    except NotRepeatable as e:
        program, captured = fxroute.trace(module, args, kwargs, split_parts=split_parts)
        return program, replace(captured, regional=f"whole trace: {e}")
    seconds = time.perf_counter() - start
    program = fxroute.Program(exported.in_spec, exported.out_spec, exported.arg_names, p.constants, output_map, p.parts,
                              graph_module=p.skeleton, export_seconds=export_seconds)
    one = len(blocks) == 1
    how = (f"spliced: {rep.count} blocks of {rep.prefix} from {described(proof.variant_of, proof.why)} ({seconds:.1f} s: the proof "
           f"and dynamo's export of {proof.keep} blocks {export_seconds:.1f} s, Thunder's traces of the model without its blocks and "
           f"of {'one block' if one else f'{len(blocks)} blocks'} {traced_seconds:.1f} s, the splice "
           f"{seconds - export_seconds - traced_seconds:.1f} s)")
    return program, replace(skel, forward=spliced.forward, backward=spliced.backward, trace_seconds=seconds, regional=how,
                            layers=spliced.layer)
