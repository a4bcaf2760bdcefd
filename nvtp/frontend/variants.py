"""Which repeated blocks compute the same program: proven by one run on fake tensors, not assumed.

Regional compilation (``nvtp.frontend.regional``, ``nvtp.frontend.fx_regional``) traces one block
and copies its fusions to every layer. That is right only where every copy computes the same
program up to renaming. Blocks of one class with the same parameter shapes need not: a residual
scale ``1 / (i + 1)`` kept as a Python attribute, a config flag, a submodule of another type, a
sliding window on odd layers only: a splice of the first block's trace trains those silently
wrong (issue 33).

``record`` runs the model once on fake tensors (nothing is computed: no data, no memory; a small
Llama's 3 layers take 0.4 s, most of it the first call's warm-up) under a ``TorchFunctionMode``
that writes down every torch call, split into *segments*: before block 0 (the head, ending with
block 0's call), each block's own calls (ending with what it returns), between blocks i-1 and i
(ending with block i's call), and after the last block (the tail). A call is written as its
function, its non-tensor arguments exactly (floats by ``repr``, dtypes, sizes, slices, a
function by its code and closure, a dataclass by its fields) and each tensor argument by where
it comes from, up to renaming: produced by the n-th call of the same segment; the block's own
argument at a position; a parameter, buffer or tensor attribute by its name relative to the
block; a value of the head; the output of the block before; plus its shape, dtype,
``requires_grad``, contiguity and, when a custom ``autograd.Function`` made it, that class (whose
backward the run does not see).

Thunder and dynamo trace the same Python code, and what either records is the torch calls made,
with their arguments and the tensors' metadata: all in the record. So two blocks whose segments
are equal trace to one program up to renaming, and:

* ``Recording.variants``: the blocks grouped by their segment, each group traced once;
* ``Recording.call_variants``: as ``variants``, but blocks the model calls with different values
  (a sliding-window mask for some layers) are variants of their own too (the FX route);
* ``Recording.uniform``: the code between blocks is the same for every block (the model treats
  each alike: no scale by the block's index, no block-dependent argument); ``between_alike`` the
  same less the calls;
* ``Recording.outside_differs``: the head and tail equal those of the model the splice traces
  instead of the whole (the model without its blocks, or cut to 2 or 3): a forward that reads
  ``len(self.h)`` or does extra work per block is not spliced.

Why not trace two copies and compare (the other sound way): a trace is the cost regional
compilation saves (seconds a block with Thunder), and a comparison of two proves nothing of a
third. Why not compare attributes (what ``_signature`` and the FX route's ``_alike`` did): what
matters is what the code reads, which an attribute list cannot tell (a config object shared by
all blocks and indexed by ``layer_idx``; an attribute that differs but is never read); the run
records the reads by their effect. What is assumed: the program depends on Python state only
through the torch calls made (a Python-side effect, a global counter, is not seen), and code that
branches on ``torch.compiler.is_compiling()`` reads the same state either way.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch._subclasses.fake_tensor import FakeTensorMode

from nvtp.frontend.blocks import NotRepeatable, Repeated

_DEPTH = 4  # how deep a non-tensor argument (a closure, a dataclass, nested tuples) is compared before identity decides


@dataclass(frozen=True)
class Segment:
    """One stretch of the run: its calls, normalized (equal tuples: the same program up to renaming)."""

    calls: tuple[tuple, ...]

    def first_difference(self, other: "Segment") -> int:
        """The index of the first call that differs (the shorter length when one is a prefix)."""
        return next((k for k, (a, b) in enumerate(zip(self.calls, other.calls)) if a != b), min(len(self.calls), len(other.calls)))


@dataclass
class Recording:
    """A run of the model on fake tensors, cut at its blocks (see the module docstring)."""

    prefix: str
    before: list[Segment]  # before[0] the head; before[i] between blocks i-1 and i (ending with block i's call); before[L] the tail
    blocks: list[Segment]  # each block's calls, ending with its return
    calls: list[tuple[tuple, dict, Any]]  # each block's arguments and output (fake tensors), in block order
    chain: str  # "" when every block is called as x = block(x) with nothing between (the template splice's chain), else why not

    @property
    def count(self) -> int:
        return len(self.blocks)

    @property
    def carry(self) -> torch.Tensor:
        """Block 0's input (a fake tensor), when the blocks are a chain."""
        return self.calls[0][0][0]

    def variants(self) -> tuple[list[int], list[str]]:
        """(each block's variant, numbered by first appearance: block 0's is 0; and for each
        variant after the first, why its first block is not block 0's: the first call that differs)."""
        first: dict[Segment, int] = {}
        of, why = [], []
        for i, seg in enumerate(self.blocks):
            if seg not in first:
                first[seg] = len(first)
                if i:
                    why.append(f"block {i} {_differ(seg, self.blocks[0], 'block 0')}")
            of.append(first[seg])
        return of, why

    def call_variants(self) -> tuple[list[int], list[str]]:
        """As ``variants``, but two blocks are one variant only when the model also calls them alike
        (the same values of the head, the same numbers; the carry aside): a layer called with a
        sliding-window mask where block 0 gets the causal one is a variant of its own, even when the
        blocks' own code is one. For a splice whose copies read what the model passes each (the FX
        route's *invariants*): every copy of a variant reads what its first block reads."""
        calls = [self.before[i].calls[-1] for i in range(self.count)]
        firsts: list[int] = []
        of, why = [], []
        for i, seg in enumerate(self.blocks):
            k = next((k for k, j in enumerate(firsts) if seg == self.blocks[j] and _unlike_calls(calls[j], calls[i], "") is None), None)
            if k is None:
                k = len(firsts)
                firsts.append(i)
                if i and seg != self.blocks[0]:
                    why.append(f"block {i} {_differ(seg, self.blocks[0], 'block 0')}")
                elif i:
                    where, a, b = _unlike_calls(calls[0], calls[i], "")
                    why.append(f"the model calls block {i} with {where or 'its arguments'} {_show(b)} where block 0 gets {_show(a)}")
            of.append(k)
        return of, why

    def between_alike(self) -> str:
        """'' when the code between consecutive blocks, but for the call of the next block, is the
        same for every block (what ``uniform`` asks, less the calls: ``call_variants`` tells those apart)."""
        for i in range(2, self.count):
            if self.before[i].calls[:-1] != self.before[1].calls[:-1]:
                return (f"the model's code before block {i} of {self.prefix} "
                        f"{_differ(Segment(self.before[i].calls[:-1]), Segment(self.before[1].calls[:-1]), 'before block 1')}: "
                        "it does not treat every block alike")
        return ""

    def uniform(self) -> str:
        """'' when the model calls every block alike (block 0 with what it passes block 1, but the
        carry) and the code between consecutive blocks is the same for every block, else where not."""
        if self.count >= 2:
            first, second = self.before[0].calls[-1], self.before[1].calls[-1]
            unlike = _unlike_calls(first, second, "")
            if unlike is not None:
                where, a, b = unlike
                return (f"the model calls block 1 of {self.prefix} with {where or 'its arguments'} {_show(b)} where block 0 gets "
                        f"{_show(a)}: it does not call every block alike")
        for i in range(2, self.count):
            if self.before[i] != self.before[1]:
                return (f"the model's code before block {i} of {self.prefix} {_differ(self.before[i], self.before[1], 'before block 1')}: "
                        "it does not treat every block alike")
        return ""

    def outside_differs(self, other: "Recording", what: str) -> str:
        """'' when ``other`` (``what``: the model the splice traces instead) runs the same head, tail and
        code between blocks as this model, else where it does not."""
        pairs = [("before the blocks", self.before[0], other.before[0]), ("after the blocks", self.before[-1], other.before[-1])]
        pairs += [(f"before block {i}", self.before[i], other.before[i]) for i in range(1, other.count)]
        for where, mine, theirs in pairs:
            if mine != theirs:
                return f"{what} {_differ(theirs, mine, 'the whole model')} {where}"
        return ""


def _unlike_calls(first: Any, other: Any, where: str) -> tuple[str, Any, Any] | None:
    """None when block 0's call ``first`` passes what ``other`` (block i's) passes: the same values
    of the head (a mask, rotary tables) and numbers; where ``other`` passes a value computed since
    the block before (its output, the carry), any tensor of its shape and dtype. Else the first
    argument that differs: (where, block 0's, block i's)."""
    if _is_token(other) and (other[0] == "local" or (other[0] in ("output", "before", "block") and other[1] == -1)):
        same = _is_token(first) and first[-1][:2] == other[-1][:2]  # computed since block i-1: its like in block 0's call
        return None if same else (where, first, other)
    if _is_token(first) or _is_token(other) or not (isinstance(first, tuple) and isinstance(other, tuple)) or len(first) != len(other):
        return None if first == other else (where, first, other)
    if first[:1] == ("call",):
        return _unlike_calls(first[1], other[1], "") or _unlike_calls(first[2], other[2], "")
    if first[:1] in (("tuple",), ("list",)) and other[:1] == first[:1] and len(first[1]) == len(other[1]):
        for k, (a, b) in enumerate(zip(first[1], other[1])):
            found = _unlike_calls(a, b, f"{where}[{k}]" if where else f"argument {k}")
            if found:
                return found
        return None
    if first[:1] == ("dict",) and other[:1] == ("dict",) and [k for k, _ in first[1]] == [k for k, _ in other[1]]:
        for (k, a), (_, b) in zip(first[1], other[1]):
            found = _unlike_calls(a, b, f"{where}[{_show(k)}]" if where else (k[1] if k[0] == "str" else _show(k)))
            if found:
                return found
        return None
    return None if first == other else (where, first, other)


def _differ(seg: Segment, ref: Segment, name: str) -> str:
    k = seg.first_difference(ref)
    if k >= len(seg.calls):
        return f"stops after {k} calls where {name} goes on with `{describe(ref.calls[k])}`"
    if k >= len(ref.calls):
        return f"goes on after {k} calls with `{describe(seg.calls[k])}` where {name} stops"
    return f"differs at its call {k + 1}: `{describe(seg.calls[k])}` where {name} has `{describe(ref.calls[k])}`"


# -- the run ---------------------------------------------------------------------------------------

class _Recorder(TorchFunctionMode):
    """Writes down every torch call of a run, normalized, by segment (the module docstring)."""

    def __init__(self, module: torch.nn.Module, rep: Repeated):
        super().__init__()
        self.prefix = rep.prefix
        self.blocks = list(module.get_submodule(rep.prefix))
        self.state: dict[int, str] = {}  # id of a parameter, buffer or tensor attribute -> its name
        for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
            self.state.setdefault(id(t), name)
        for path, m in module.named_modules():
            for k, v in vars(m).items():
                if isinstance(v, torch.Tensor):
                    self.state.setdefault(id(v), f"{path}.{k}" if path else k)
        self.modules = {id(m): path for path, m in module.named_modules(remove_duplicate=False)}
        self.keep: list[Any] = []  # everything whose id is a key below stays alive (no id is reused)
        self.produced: dict[int, tuple[tuple, int]] = {}  # id -> (segment, position among the tensors it produced)
        self.outputs: dict[int, tuple[int, tuple]] = {}  # id of a block's output -> (block, place in its output)
        self.inputs: dict[int, tuple] = {}  # id of the model's argument -> its place
        self.arguments: dict[int, tuple] = {}  # id of the running block's argument -> its place
        self.segment: tuple = ("before", 0)
        self.made: dict[tuple, int] = {}
        self.records: dict[tuple, list[tuple]] = {("before", 0): []}
        self.order: list[int] = []
        self.calls: dict[int, tuple[tuple, dict, Any]] = {}
        self.nested = False
        self.quiet = False  # while a hook reads its tensors' metadata (itself torch calls): nothing is recorded

    # -- segments

    def base(self) -> int:
        return self.segment[1]

    def enter(self, i: int, args: tuple, kwargs: dict) -> None:
        if self.segment[0] == "block":
            self.nested = True
            return
        self.quiet = True
        self.records[self.segment].append(("call", self.norm(args), self.norm(kwargs)))
        self.order.append(i)
        self.segment = ("block", i)
        self.records.setdefault(self.segment, [])
        self.arguments = {}
        for path, t in _leaves_with_paths((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self.arguments.setdefault(id(t), path)
                self.keep.append(t)
        self.calls[i] = (args, kwargs, None)
        self.quiet = False

    def leave(self, i: int, out: Any) -> None:
        if self.segment != ("block", i):
            return
        self.quiet = True
        self.records[self.segment].append(("return", self.norm(out)))
        for path, t in _leaves_with_paths(out):
            if isinstance(t, torch.Tensor):
                self.outputs[id(t)] = (i, path)
                self.keep.append(t)
        self.calls[i] = (*self.calls[i][:2], out)
        self.arguments = {}
        self.segment = ("before", i + 1)
        self.records.setdefault(self.segment, [])
        self.quiet = False

    # -- normalizing

    def token(self, t: torch.Tensor) -> tuple:
        fn = getattr(t.grad_fn, "_forward_cls", None)  # a custom autograd.Function's output: its backward is its own
        meta = (tuple(t.shape), t.dtype, t.requires_grad, t.is_contiguous(), fn)
        i, base = id(t), self.base()
        if self.segment[0] == "block" and i in self.arguments:
            return ("argument", self.arguments[i], meta)
        if i in self.outputs:
            block, place = self.outputs[i]
            return ("output", block - base, place, meta)
        if i in self.produced:
            seg, k = self.produced[i]
            if seg == ("before", 0):  # a value of the head: the same for every block, and in the head itself
                return ("head", k, meta)
            if seg == self.segment:
                return ("local", k, meta)
            return (seg[0], seg[1] - base, k, meta)
        if i in self.state:
            return ("state", *self.relative(self.state[i]), meta)
        if i in self.inputs:
            return ("input", self.inputs[i], meta)
        self.keep.append(t)
        return ("other", i, meta)  # equal only to itself

    def relative(self, name: str) -> tuple:
        """A name inside block j as (j - the segment's block, the rest); any other name as it is."""
        if name.startswith(self.prefix + "."):
            idx, _, rest = name[len(self.prefix) + 1:].partition(".")
            if idx.isdigit():
                return (int(idx) - self.base(), rest)
        return (None, name)

    def norm(self, x: Any, depth: int = 0) -> Any:
        """``x`` as a hashable value equal for two calls exactly when they pass the same thing up to renaming."""
        if isinstance(x, torch.Tensor):
            return self.token(x)
        if x is None or x is Ellipsis or isinstance(x, (bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return (type(x).__name__, x)
        if isinstance(x, (float, complex)):
            return (type(x).__name__, repr(x))
        if isinstance(x, torch.Size):
            return ("Size", tuple(x))
        if isinstance(x, slice):
            return ("slice", self.norm(x.start), self.norm(x.stop), self.norm(x.step))
        if depth >= _DEPTH:
            return _identity(x)
        if isinstance(x, (tuple, list)):
            return (type(x).__name__, tuple(self.norm(a, depth + 1) for a in x))
        if isinstance(x, dict):
            return ("dict", tuple((self.norm(k, depth + 1), self.norm(v, depth + 1)) for k, v in x.items()))
        if isinstance(x, torch.nn.Module):
            path = self.modules.get(id(x))
            return ("module", self.relative(path)) if path is not None else _identity(x)
        if isinstance(x, types.FunctionType):
            cells = tuple(self.norm(_cell(c), depth + 1) for c in x.__closure__ or ())
            return ("function", x.__code__, cells, self.norm(x.__defaults__, depth + 1))
        if isinstance(x, types.MethodType):
            return ("method", self.norm(x.__func__, depth + 1), self.norm(x.__self__, depth + 1))
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return ("dataclass", type(x), tuple((f.name, self.norm(getattr(x, f.name), depth + 1)) for f in dataclasses.fields(x)))
        return _identity(x)

    # -- the mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.quiet:
            return func(*args, **kwargs)
        record = (func, self.norm(args), self.norm(kwargs))
        out = func(*args, **kwargs)
        self.records[self.segment].append(record)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in self.state:
                self.produced[id(t)] = (self.segment, self.made.get(self.segment, 0))
                self.made[self.segment] = self.made.get(self.segment, 0) + 1
                self.keep.append(t)
        return out


def _lent(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_() if t.is_floating_point() and not t.requires_grad else t


def _identity(x: Any) -> tuple:
    """An object compared by ``==`` when it is hashable (numbers, enums, a shared config), else by identity."""
    try:
        hash(x)
    except TypeError:
        return ("object", type(x).__qualname__, id(x))
    return ("object", type(x), x)


def _cell(c: Any) -> Any:
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return None


def _leaves_with_paths(tree: Any) -> list[tuple[tuple, Any]]:
    leaves, _ = pytree.tree_flatten_with_path(tree)
    return [(tuple(str(k) for k in path), leaf) for path, leaf in leaves]


def record(module: torch.nn.Module, rep: Repeated, args: tuple, kwargs: dict, what: str = "the model") -> Recording:
    """Run ``module`` (a meta copy: nothing is computed) on fake copies of ``args``/``kwargs`` and
    record it by segment (the module docstring). Raises ``NotRepeatable`` when it does not run on
    fake tensors (``what`` names it), or its blocks are not each called once, in order."""
    rec = _Recorder(module, rep)
    handles = []
    for i, b in enumerate(rec.blocks):
        handles.append(b.register_forward_pre_hook(lambda m, a, kw, i=i: rec.enter(i, a, kw), with_kwargs=True))
        handles.append(b.register_forward_hook(lambda m, a, kw, out, i=i: rec.leave(i, out), with_kwargs=True))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            # fake arguments: transformers skips its data-dependent checks for them (``is_tracing``), as under dynamo
            # a floating argument needs a gradient here, as every block's carry after the first does
            fargs, fkwargs = pytree.tree_map_only(torch.Tensor, lambda t: _lent(fake.from_tensor(t)), (tuple(args), dict(kwargs)))
            for path, t in _leaves_with_paths((fargs, fkwargs)):
                if isinstance(t, torch.Tensor):
                    rec.inputs[id(t)] = path
                    rec.keep.append(t)
            with rec:
                module(*fargs, **fkwargs)
    except NotRepeatable:
        raise
    except Exception as e:  # noqa: BLE001 - a model that does not run on fake tensors: nothing is proven, nothing spliced
        raise NotRepeatable(f"{what} did not run on fake tensors, so its blocks could not be compared "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from e
    finally:
        for h in handles:
            h.remove()
    count = len(rec.blocks)
    if rec.nested or rec.order != list(range(count)):
        raise NotRepeatable(f"the blocks of {rep.prefix} are not each called once, in order")
    segments = [Segment(tuple(rec.records.get(("before", i), ()))) for i in range(count + 1)]
    blocks = [Segment(tuple(rec.records[("block", i)])) for i in range(count)]
    calls = [rec.calls[i] for i in range(count)]
    return Recording(rep.prefix, segments, blocks, calls, _chain(segments, blocks, calls, rep.prefix))


def _chain(before: list[Segment], blocks: list[Segment], calls: list, prefix: str) -> str:
    """'' when each block is called as ``x = block(x)`` on one tensor, on the output of the block
    before, with nothing between and each block reading nothing but its argument and its own
    state; else the first reason it is not."""
    for i, (args, kwargs, out) in enumerate(calls):
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
            return f"block {i} of {prefix} is not called as x = block(x) on one tensor"
        if out.shape != args[0].shape or out.dtype != args[0].dtype:
            return f"block {i} of {prefix} changes its input's shape or dtype"
    for i in range(1, len(blocks)):
        between = before[i].calls
        carry = _tokens(between[0][1]) if len(between) == 1 else []
        if len(carry) != 1 or between[0][1][1][0] is not carry[0] or carry[0][:3] != ("output", -1, ()) or between[0][2] != ("dict", ()):
            return f"the model does more between blocks {i - 1} and {i} of {prefix} than call block {i} on block {i - 1}'s output"
    for i, seg in enumerate(blocks):
        for call in seg.calls:
            foreign = [t for t in _tokens(call) if t[0] not in ("local", "argument", "state")]
            if foreign:
                return f"block {i} of {prefix} reads a value of the model that is not its argument ({foreign[0][0]})"
    return ""


def _is_token(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) >= 3 and isinstance(x[0], str) and x[0] in _TOKEN_KINDS and isinstance(x[-1], tuple) \
        and len(x[-1]) == 5


def _tokens(x: Any) -> list[tuple]:
    """The tensor tokens inside a normalized call."""
    if _is_token(x):
        return [x]
    if isinstance(x, tuple):
        return [t for a in x for t in _tokens(a)]
    return []


_TOKEN_KINDS = {"argument", "output", "local", "head", "before", "block", "state", "input", "other"}


def variants_text(variant_of: list[int], why: list[str]) -> str:
    """``2 variants (blocks 0, 2; 1, 3: block 1 differs at its call 5: ...)``: the groups, and why each after the first is its own."""
    n = max(variant_of) + 1
    groups = "; ".join(", ".join(str(i) for i, k in enumerate(variant_of) if k == v) for v in range(n))
    return f"{n} variants (blocks {groups}: {'; '.join(why)})"


# -- messages --------------------------------------------------------------------------------------

def describe(call: tuple) -> str:
    """A recorded call as a reader would write it: ``mul(local 3 [2, 8, 32], 0.5)``."""
    if call[0] == "call":
        return f"call({_show(call[1])}{', ' + _show(call[2]) if call[2][1] else ''})"
    if call[0] == "return":
        return f"return {_show(call[1])}"
    func, args, kwargs = call
    text = ", ".join(x for x in (_show(args, bare=True), _show(kwargs, bare=True)) if x)
    return f"{_name(func)}({text})"


def _name(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and owner is not None:  # Tensor.shape.__get__: "shape"
        return getattr(owner, "__name__", repr(owner))
    return getattr(func, "__name__", repr(func))


def _show(x: Any, bare: bool = False) -> str:
    if not isinstance(x, tuple) or not x:
        return repr(x)
    kind = x[0]
    if _is_token(x):
        return f"{_tensor(x)}{list(x[-1][0])}"
    if kind in ("tuple", "list"):
        inner = ", ".join(_show(a) for a in x[1]) + ("," if kind == "tuple" and len(x[1]) == 1 and not bare else "")
        return inner if bare else f"({inner})" if kind == "tuple" else f"[{inner}]"
    if kind == "dict":
        inner = ", ".join(f"{k[1] if k[0] == 'str' else _show(k)}={_show(v)}" for k, v in x[1])
        return inner if bare else f"{{{inner}}}"
    if kind in ("bool", "int", "str", "NoneType", "ellipsis"):
        return repr(x[1])
    if kind in ("float", "complex"):
        return x[1]
    if kind == "slice":
        return ":".join("" if part == ("NoneType", None) else _show(part) for part in x[1:]).rstrip(":") or ":"
    if kind == "Size":
        return repr(list(x[1]))
    if kind in ("dtype", "device", "layout", "memory_format"):
        return str(x[1])
    if kind == "module":
        return f"module {x[1][1]}"
    if kind == "function":
        return f"function {x[1].co_name}"
    if kind == "method":
        return f"method {_show(x[1])}"
    if kind == "dataclass":
        return f"{x[1].__name__}({', '.join(f'{n}={_show(v)}' for n, v in x[2])})"
    if kind == "object":
        return repr(x[2]) if len(x) == 3 and not isinstance(x[1], str) else f"<{x[1]}>"
    return repr(x)


def _tensor(token: tuple) -> str:
    """A tensor token as a reader would name it: ``t7`` (the segment's 7th tensor), ``argument 0``, ``h.0.attn.q.weight``."""
    kind = token[0]
    if kind == "local":
        return f"t{token[1]}"
    if kind == "argument":
        path = token[1]
        where = path[1].strip("[]'") if len(path) > 1 else "?"
        return f"argument {where}{''.join(path[2:])}"
    if kind == "output":
        return f"the output{''.join(token[2])} of block {token[1]:+d}"
    if kind == "head":
        return f"t{token[1]} before the blocks"
    if kind == "state":
        rel, name = token[1], token[2]
        return name if rel in (None, 0) else f"block {rel:+d}'s {name}"
    if kind == "input":
        return f"the model's argument{''.join(token[1][1:])}"
    if kind in ("before", "block"):
        return f"t{token[2]} of {'block' if kind == 'block' else 'the code before block'} {token[1]:+d}"
    return "a tensor from elsewhere"
