"""Regional compilation on Thunder's route: trace a deep model's repeated block once, not once per layer.

Thunder's trace costs seconds a layer (its bytecode interpreter: about 2 s for a GPT-2 block on
this CPU), so ``nvtp.jit`` of a 12-layer GPT would spend most of its start-up tracing twelve copies
of one block. Instead, ``capture_regional`` finds the repeated blocks (``blocks.find_repeated``: an
``nn.ModuleList`` whose children have one class and the same parameters) and builds the L-layer
forward and backward fusions by splicing dataflow graphs: still ONE forward and ONE backward
fusion, which nvtp shards and runs as any other.

First it proves what it will splice (``nvtp.frontend.variants``): one run of the model on fake
tensors records every torch call, by block, so that blocks computing different programs (a
residual scale ``1 / (i + 1)`` kept as an attribute, a config flag, a submodule of another type, a
sliding window on odd layers) are told apart and grouped into *variants*, and code outside the
blocks that treats them unalike (or reads how many there are) is seen. Then two ways, the first
that fits:

1. **One traced block per variant** (``capture_template``, splice in ``nvtp.frontend.template``):
   when the blocks are a chain, ``x = block(x)`` each once, in order, on one tensor, with nothing
   between and nothing outside reading a block's output but the last's (the recording says so), the
   model without its blocks (the *skeleton*) is traced once, and one block of each variant alone.
   The recording of the skeleton must equal the model's outside its blocks.
2. **A trace of ``TRACED`` blocks (3)** (``nvtp.frontend.splice``), for chains the first way does
   not take (a block called with more than the carry, a model reading block outputs outside the
   chain), when all blocks are one variant and the model cut to 3 blocks runs as the whole does
   outside them.

Anything that does not fit (no repeated ModuleList, a model that does not run on fake tensors,
code between blocks that differs from block to block, a region that reads a block other than its
neighbour, a unit whose second copy does not match the first) raises ``NotRepeatable`` with the
reason; ``capture_regional`` then tries the next way, and at last traces the whole model, saying
why in ``Captured.regional`` (``Traced.how``, ``nvtp explain``). A splice of several variants says
how many and why (the first call where each differs from block 0).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import replace
from typing import Any

import torch

from nvtp.frontend.blocks import NotRepeatable, Repeated, every_block, find_repeated, truncated
from nvtp.frontend.capture import MissingOpError, capture, check_gradients
from nvtp.frontend.splice import splice
from nvtp.frontend.template import Spliced, Boundary, markers, splice_template
from nvtp.frontend.variants import Recording, record, variants_text
from nvtp.gcpause import paused
from nvtp.ir.simplify import dead_code
from nvtp.ir.verify import verify

TRACED = 3  # blocks traced: a head, two units to match against each other, and a tail


def capture_template(module: torch.nn.Module, rep: Repeated, rec: Recording, variant_of: list[int], *args: Any, **kwargs: Any):
    """The model's fusions from traces that do not grow with depth: the skeleton (the model with its
    chain of blocks replaced by ``Boundary``) and one block of each variant alone (``variant_of``:
    each block's, from ``rec.variants()``); ``NotRepeatable`` if the model is not such a chain or
    the skeleton does not run as the model does outside its blocks."""
    if rec.chain:
        raise NotRepeatable(rec.chain)
    skeleton = truncated(module, rep.prefix, 0)
    parent = skeleton.get_submodule(rep.prefix.rpartition(".")[0]) if "." in rep.prefix else skeleton
    parent._modules[rep.prefix.rpartition(".")[2]] = torch.nn.ModuleList([Boundary()])
    differs = rec.outside_differs(record(skeleton, Repeated(rep.prefix, 1), args, kwargs, "the model without its blocks"),
                                  "the model without its blocks")
    if differs:
        raise NotRepeatable(differs)
    c = rec.carry
    carry = torch.empty_strided(tuple(c.shape), tuple(c.stride()), dtype=c.dtype, device="meta")
    try:
        skel = capture(skeleton, *args, **kwargs)
        lent: list[str] = []
        reaches = skel.backward is not None and markers(skel.backward, carry, False)
        if not reaches and _has_parameters(module.get_submodule(f"{rep.prefix}.0")):
            # Nothing before the blocks needs a gradient (no embedding: the chain starts at a
            # floating argument), so the skeleton's backward, if any, stops short of the chain and
            # cannot bring the loss's gradient to the blocks. Trace it with its floating arguments
            # needing a gradient, so it reaches the chain, and drop their gradients after the splice.
            args, kwargs, lent = _needing_grad(module, args, kwargs)
            if lent:
                skel = capture(skeleton, *args, **kwargs)
    except MissingOpError:  # the whole model holds the same op: no other trace would do
        raise
    except Exception as e:  # noqa: BLE001 - a forward that needs its blocks (indexes them, reads their attributes)
        raise NotRepeatable(f"the model without its blocks did not trace ({type(e).__name__})") from e
    carry.requires_grad_(skel.backward is not None)
    firsts = [variant_of.index(k) for k in range(max(variant_of) + 1)]  # the block traced for each variant
    blocks = []
    for j in firsts:
        try:
            blocks.append(capture(module.get_submodule(f"{rep.prefix}.{j}"), carry))
        except MissingOpError:
            raise
        except Exception as e:  # noqa: BLE001 - a block that does not trace alone: the other splice decides
            raise NotRepeatable(f"block {j} of {rep.prefix} did not trace alone ({type(e).__name__})") from e
    if skel.backward is None and any(b.backward is not None for b in blocks):
        # A splice into no backward would give the blocks' parameters no gradient at all.
        raise NotRepeatable("the model without its blocks has no backward (only the blocks have parameters, and no "
                            "floating argument carries a gradient to them), so it cannot carry the blocks' gradients")
    differentiable = skel.differentiable + _differentiable(blocks, variant_of, rep.prefix)
    spliced = splice_template(skel.forward, skel.backward, [(b.forward, b.backward) for b in blocks], variant_of, carry, rep.prefix)
    bwd = spliced.backward
    if lent and bwd is not None:  # the arguments' gradients were only lent to the trace: eager computes none
        bwd = dead_code(bwd.with_ops(bwd.ops, tuple(v for v in bwd.outputs if bwd.grad_of(v.name) not in lent)))
        differentiable = tuple(label for label in differentiable if label not in lent)
    return replace(skel, differentiable=differentiable), replace(spliced, backward=bwd)


def _differentiable(blocks: list, variant_of: list[int], prefix: str) -> tuple[str, ...]:
    """The labels every copy differentiates: each block's parameters its variant's trace differentiates, named for the block."""
    out: dict[str, None] = {}
    for i, k in enumerate(variant_of):
        f = blocks[k].forward
        params = {f.label(v.name) for v in f.inputs if f.role(v.name) == "parameter"}
        out.update(dict.fromkeys(f"{prefix}.{i}.{label}" for label in blocks[k].differentiable if label in params))
    return tuple(out)


def _has_parameters(block: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in block.parameters())


def _needing_grad(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[str]]:
    """``args``/``kwargs`` with each floating tensor that needs no gradient replaced by a meta
    tensor that does, and the argument names (the fusions' labels) of those replaced."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return args, kwargs, []
    lent: list[str] = []

    def lend(name: str, a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and not a.requires_grad:
            lent.append(name)
            return torch.empty_like(a, device="meta").requires_grad_()
        return a

    args = tuple(lend(n, a) for n, a in zip(names, args)) + tuple(args[len(names):])
    kwargs = {k: lend(k, a) for k, a in kwargs.items()}
    return args, kwargs, lent


def described(variant_of: list[int], why: list[str]) -> str:
    """What a splice of ``variant_of`` traced: "one traced block", or one per variant, which, and why."""
    if max(variant_of) == 0:
        return "one traced block"
    return f"{max(variant_of) + 1} traced blocks, one per variant: {variants_text(variant_of, why)}"


# -- capture ---------------------------------------------------------------------------------------

def capture_regional(module: torch.nn.Module, *args: Any, traced: int = TRACED, template: bool = True, **kwargs: Any):
    """``capture(module, *args)``, by splicing one traced block per variant (``template``) or a
    trace of ``traced`` blocks when ``module`` has a chain of repeated blocks proven to compute
    what they are spliced as; else (or when the splices do not fit) the whole trace. The returned
    ``Captured.regional`` says which, and why."""
    with paused():
        return _capture_regional(module, args, kwargs, traced, template)


def _capture_regional(module: torch.nn.Module, args: tuple, kwargs: dict, traced: int, template: bool):
    start = time.perf_counter()
    try:
        rep = find_repeated(module)
        rec = record(module, rep, args, kwargs)
        uneven = rec.uniform()
        if uneven:
            raise NotRepeatable(uneven)
    except NotRepeatable as e:
        return replace(capture(module, *args, **kwargs), regional=f"whole trace: {e}")
    variant_of, why = rec.variants()
    reasons = []
    if template:
        try:
            skel, spliced = capture_template(module, rep, rec, variant_of, *args, **kwargs)
        except NotRepeatable as e:
            reasons.append(str(e))
        else:
            return _spliced(skel, spliced, rep, f"from {described(variant_of, why)}", time.perf_counter() - start)
    if max(variant_of) > 0:
        reasons.append(f"a splice of several traced blocks repeats one block, and the blocks of {rep.prefix} are "
                       f"{variants_text(variant_of, why)}")
        return replace(capture(module, *args, **kwargs), regional="whole trace: " + "; ".join(reasons))
    if rep.count <= traced:
        reasons.append(f"{rep.count} blocks in {rep.prefix}, no more than the {traced} a splice of several traced blocks traces")
    # Block 0's backward may differ from the others' (Thunder recomputes the embedding for it): then
    # trace a 4th block and keep block 0's backward whole.
    for blocks, first_in_tail in ((traced, False), (traced + 1, True)):
        if blocks >= rep.count:
            break
        cut = truncated(module, rep.prefix, blocks)
        try:
            what = f"the model cut to {blocks} blocks"
            differs = rec.outside_differs(record(cut, Repeated(rep.prefix, blocks), args, kwargs, what), what)
            if differs:
                raise NotRepeatable(differs)
            part = capture(cut, *args, **kwargs)
            fwd, bwd = splice(part.forward, part.backward, rep.prefix, blocks, rep.count, first_in_tail)
        except NotRepeatable as e:
            reasons.append(str(e) if not first_in_tail else f"with a 4th block: {e}")
            if not str(e).startswith("the backward"):
                break
        except MissingOpError:
            raise
        except Exception as e:  # noqa: BLE001 - the cut model may not trace (e.g. a forward indexing block n-1): trace it whole
            reasons.append(f"the model cut to {blocks} blocks of {rep.prefix} did not trace ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})")
            break
        else:
            differentiable = every_block(part.differentiable, rep.prefix, rep.count)
            kept = "; block 0's backward kept whole" if first_in_tail else ""
            why_not = f"; not from one traced block: {reasons[0]}" if template and reasons else ""
            seconds = time.perf_counter() - start
            return _spliced(replace(part, differentiable=differentiable), Spliced(fwd, bwd, {}, {}), rep,
                            f"from a trace of {blocks}{kept}", seconds, why_not)
    return replace(capture(module, *args, **kwargs), regional="whole trace: " + "; ".join(reasons))


def _spliced(captured, spliced: Spliced, rep: Repeated, how: str, seconds: float, why_not: str = ""):
    """``captured`` with the spliced fusions, checked (a splice that broke the graph is nvtp's bug: said here, not in a pass later)."""
    verify(spliced.forward)
    if spliced.backward is not None:
        verify(spliced.backward)
    check_gradients(spliced.backward, captured.differentiable, f"spliced {how}")
    return replace(captured, forward=spliced.forward, backward=spliced.backward, trace_seconds=seconds,
                   layers=spliced.layer or captured.layers,
                   regional=f"spliced: {rep.count} blocks of {rep.prefix} {how} ({seconds:.1f} s){why_not}")
