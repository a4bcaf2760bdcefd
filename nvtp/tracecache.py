"""Traces kept on disk: a model traced once is not traced again, by the other ranks of its job or
by a later run.

Tracing is most of ``nvtp.jit``'s first call (Thunder's interpreter, or dynamo's export and
Thunder's trace of it: 4-20 s for a 2-layer model on a CPU core), and every process of a job and
every run of a script paid it again. ``trace`` keeps each ``Traced`` in a directory of its own under
``$NVTP_CACHE_DIR`` (default ``~/.cache/nvtp/traces``; ``NVTP_CACHE=0`` turns the cache off),
named by a key of everything the trace depends on:

* nvtp's own source (every file of the package), and the versions of torch, Thunder and transformers;
* the module's tree: each submodule's name, class, training flag, the whole source file of its
  class, and its plain Python state (``vars``: numbers, strings, configs, functions by their source
  file, tensors by their bytes), its hooks, its parameters' shapes, dtypes and ``requires_grad``,
  and its buffers' bytes (a per-layer scale or window, as in issue 33's differing blocks, is another
  key);
* the call's structure (every argument's shape, dtype, device and ``requires_grad``; other values
  by ``repr``), the grad mode and default dtype, and the trace's options.

State the key cannot describe (an object of an unknown class) makes the call uncacheable: traced,
never guessed. Code the key does not see (a helper in another file of the user's that the forward
calls) is covered by the first-call check: a cached trace is used where ``nvtp.guard`` compares
the program with the model run eagerly before it runs (``checked``), so a stale entry is refused
there, never run silently. A program the check cannot compare (dropout draws) is read only when
every source file of the user's own that is loaded (outside Python, the installed packages and
nvtp: the script included) is as it was when the entry was written (``_user_code``).

The entry is written in nvtp's own formats, read back without running code: the forward and
backward as nvFuser definition files (``nvtp.ir.parser``), the rest as JSON (the FX route's call
structure as torch's ``treespec_dumps``), folded constants by ``torch.load(weights_only=True)``.
Ranks that start together wait for the first to write (a file lock; each waits up to
``WAIT_SECONDS``, then traces itself). A damaged entry is reported and traced anew. The entries
together stay under ``NVTP_CACHE_MAX_MB`` (default 2048): after each write the least recently used
(written or read) are removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import functools
import hashlib
import inspect
import json
import os
import shutil
import site
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import thunder
import torch
import torch.utils._pytree as pytree

from nvtp import cachedir
from nvtp.frontend.fused import Part
from nvtp.frontend.fx import Binding
from nvtp.frontend.outputs import Leaf
from nvtp.ir.parser import parse
from nvtp.ir.printer import format_file
from nvtp.traced import Traced

WAIT_SECONDS = 900.0
_FORMAT = 1  # bumped when an entry's layout changes


class Uncacheable(Exception):
    """The key cannot describe what the trace depends on."""


def limit_bytes() -> int:
    """The most the entries may take together (``NVTP_CACHE_MAX_MB``, default 2048 MB)."""
    raw = os.environ.get("NVTP_CACHE_MAX_MB", "2048")
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"NVTP_CACHE_MAX_MB={raw!r} is not a number of megabytes (e.g. 2048)") from None
    return int(mb * 2**20)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def evict(root: Path, limit: int) -> list[Path]:
    """Entries removed, least recently used first (an entry is used when written or read: its
    ``traced.json``'s modification time), until the rest take at most ``limit`` bytes."""
    entries = []
    for p in root.iterdir():
        marker = p / "traced.json"
        if p.is_dir() and not p.name.startswith(".") and marker.exists():
            entries.append((marker.stat().st_mtime, p, _size(p)))
    total = sum(n for _, _, n in entries)
    removed = []
    for _, p, n in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        shutil.rmtree(p, ignore_errors=True)
        with contextlib.suppress(OSError):
            (root / f"{p.name}.lock").unlink()
        total -= n
        removed.append(p)
    return removed


def directory() -> Path | None:
    """Where entries live, or None when the cache is off (``NVTP_CACHE=0``)."""
    root = cachedir.root()
    return None if root is None else root / "traces"


# -- the key ---------------------------------------------------------------------------------------


@functools.cache
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _source_of(obj: Any) -> str:
    """The digest of the file that defines ``obj`` (a class or function); the qualified name when it has none."""
    try:
        path = inspect.getsourcefile(obj) or inspect.getfile(obj)
        st = os.stat(path)
    except (TypeError, OSError):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}@{_file_digest(path, st.st_mtime_ns, st.st_size)}"


@functools.cache
def _versions() -> str:
    package = Path(__file__).parent  # nvtp/
    h = hashlib.sha256()
    for p in sorted(package.rglob("*.py")):
        h.update(str(p.relative_to(package)).encode())
        h.update(p.read_bytes())
    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = None
    return repr((_FORMAT, h.hexdigest(), torch.__version__, getattr(thunder, "__version__", "?"), hf))


def _user_code() -> str:
    """A digest of the source of every module loaded from outside Python, the installed packages and
    nvtp (which ``_versions`` covers): the user's own code, the script (``__main__``) included."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(), site.getusersitepackages(),
             str(Path(__file__).parent)]
    skip = tuple(os.path.realpath(p) + os.sep for p in paths)
    files = sorted({os.path.realpath(f) for m in list(sys.modules.values())
                    if isinstance(f := getattr(m, "__file__", None), str) and f.endswith(".py")} - {""})
    h = hashlib.sha256()
    for f in files:
        if not f.startswith(skip) and os.path.exists(f):
            st = os.stat(f)
            h.update(f"{f}:{_file_digest(f, st.st_mtime_ns, st.st_size)}".encode())
    return h.hexdigest()


def _tensor(t: torch.Tensor, values: bool) -> tuple:
    head = ("tensor", tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad)
    if not values or t.device.type == "meta":
        return head
    try:
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError) as e:  # a tensor subclass or layout without plain bytes
        raise Uncacheable(f"a {type(t).__name__} whose bytes cannot be read ({e})") from None
    return (*head, hashlib.sha256(data).hexdigest())


# Attributes whose values differ from process to process for the same object, and no forward reads.
_VOLATILE = {
    "_original_object_hash": "transformers' GenerationConfig: hash() of itself (Python's hashes are salted per process)",
}


def _describe(x: Any, where: str, seen: dict[int, tuple[int, Any]], depth: int = 0) -> Any:
    """Plain data that equals for two objects the trace cannot tell apart; ``Uncacheable`` where unsure."""
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return repr(x)
    if isinstance(x, (torch.dtype, torch.device, torch.Size, enum.Enum, range, slice)):
        return repr(x)
    if isinstance(x, torch.Tensor):
        return _tensor(x, values=True)
    if depth > 12:
        raise Uncacheable(f"{where} nests too deep to describe")
    if id(x) in seen:
        return ("seen", seen[id(x)][0])
    seen[id(x)] = (len(seen), x)  # held: a transient object's id (``vars(x)``'s dict) is not reused while described
    if isinstance(x, torch.nn.Module):
        return ("module", _source_of(type(x)))  # its own state is described where it sits in the tree
    if isinstance(x, (list, tuple, set, frozenset)):
        items = [_describe(e, where, seen, depth + 1) for e in x]
        return (type(x).__name__, sorted(items, key=repr) if isinstance(x, (set, frozenset)) else items)
    if isinstance(x, Mapping):
        return ("map", [(repr(k), _describe(v, f"{where}[{k!r}]", seen, depth + 1)) for k, v in x.items() if k not in _VOLATILE])
    if isinstance(x, functools.partial):
        return ("partial", _describe(x.func, where, seen, depth + 1), _describe(x.args, where, seen, depth + 1),
                _describe(x.keywords, where, seen, depth + 1))
    if isinstance(x, types.MethodType):
        return ("method", _describe(x.__func__, where, seen, depth + 1), _describe(x.__self__, where, seen, depth + 1))
    if isinstance(x, types.FunctionType):
        cells = [_cell(c) for c in x.__closure__ or ()]
        cells = [c for c in cells if c is not x]
        return ("function", _source_of(x), x.__code__.co_firstlineno,
                _describe(x.__defaults__, where, seen, depth + 1), _describe(cells, f"{where} (closure)", seen, depth + 1))
    if isinstance(x, (types.BuiltinFunctionType, types.ModuleType, type)) or callable(x) and hasattr(x, "__qualname__"):
        return ("named", getattr(x, "__module__", None) or getattr(x, "__name__", "?"), getattr(x, "__qualname__", None),
                _source_of(x) if isinstance(x, type) else None)
    if dataclasses.is_dataclass(x) or hasattr(x, "__dict__"):
        return ("object", _source_of(type(x)), _describe(vars(x), where, seen, depth + 1))
    raise Uncacheable(f"{where} is a {type(x).__module__}.{type(x).__qualname__}, which the trace cache cannot describe")


def _cell(c: types.CellType) -> Any:
    try:
        return c.cell_contents
    except ValueError:  # a cell not yet filled
        return "<empty cell>"


_MODULE_SLOTS = ("_parameters", "_buffers", "_modules")


def key(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    """The entry's name: a digest of everything the trace depends on (the module docstring).
    Raises ``Uncacheable`` when something cannot be described."""
    return hashlib.sha256(key_text(module, args, kwargs, options).encode()).hexdigest()[:40]


def key_text(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    """What ``key`` digests, as text (two keys that differ: compare their texts)."""
    seen: dict[int, tuple[int, Any]] = {}
    tree = []
    for name, m in module.named_modules(remove_duplicate=False):
        state = {k: v for k, v in vars(m).items() if k not in _MODULE_SLOTS}
        tree.append((name, _source_of(type(m)), m.training,
                     [(k, None if p is None else _tensor(p, values=False)) for k, p in m._parameters.items()],
                     [(k, None if b is None else _tensor(b, values=True)) for k, b in m._buffers.items()],
                     _describe(state, f"{name or type(m).__name__}'s attributes", seen)))
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    call = (str(spec), [_tensor(a, values=False) if isinstance(a, torch.Tensor) else repr(a) for a in leaves])
    glob = (torch.is_grad_enabled(), str(torch.get_default_dtype()))
    opts = sorted((k, "the module" if isinstance(v, torch.nn.Module) else repr(v)) for k, v in options.items())
    return repr((_versions(), tree, call, glob, opts)).replace("), (", "),\n(")


# -- an entry --------------------------------------------------------------------------------------


def _plain(x: Any) -> Any:
    """JSON for the few value kinds an output map or a declined list holds; ``Uncacheable`` else."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        return [_plain(e) for e in x]
    raise Uncacheable(f"a {type(x).__name__} in the trace's call structure")


def _write(path: Path, traced: Traced) -> None:
    captured = traced.captured
    tree = getattr(captured, "output_tree", None)
    if tree is not None:
        leaves, spec = pytree.tree_flatten(tree)
        if not all(isinstance(leaf, Leaf) or leaf is None or isinstance(leaf, (bool, int, float, str)) for leaf in leaves):
            raise Uncacheable("the model's output holds values other than tensors and plain numbers")
        tree = {"spec": pytree.treespec_dumps(spec), "leaves": [["leaf", v.label] if isinstance(v, Leaf) else ["value", v] for v in leaves]}
    call = None
    constants: dict[str, torch.Tensor] = {}
    if traced.call is not None:
        b = traced.call.binding()
        if any(k == "const" and isinstance(v, torch.Tensor) for k, v in b.output_map):
            raise Uncacheable("a tensor constant among the outputs")
        constants = dict(b.constants)
        call = {"in_spec": pytree.treespec_dumps(b.in_spec), "out_spec": pytree.treespec_dumps(b.out_spec),
                "arg_names": list(b.arg_names), "output_map": [[k, _plain(v)] for k, v in b.output_map],
                "parts": {label: [p.weight, p.start, p.stop] for label, p in b.parts.items()}}
    meta = {"route": traced.route, "how": traced.how, "arguments": list(traced.arguments),
            "weights": None if traced.weights is None else sorted(traced.weights), "boundary": traced.boundary,
            "tied": dict(traced.tied), "seconds": traced.seconds, "split_parts": traced.split_parts,
            "declined": _plain(list(traced.declined)), "layers": dict(getattr(captured, "layers", None) or {}),
            "regional": getattr(captured, "regional", ""), "output_tree": tree, "call": call,
            "backward": traced.backward is not None, "user_code": _user_code()}
    path.mkdir(parents=True)
    (path / "forward.py").write_text(format_file(traced.forward))
    if traced.backward is not None:
        (path / "backward.py").write_text(format_file(traced.backward))
    if constants:
        torch.save({k: v.detach().cpu() for k, v in constants.items()}, path / "constants.pt")
    (path / "traced.json").write_text(json.dumps(meta))  # last: its presence marks the entry whole


def _read(path: Path) -> tuple[Traced, str]:
    """The entry's ``Traced``, and the digest of the user's code when it was written (``_user_code``)."""
    meta = json.loads((path / "traced.json").read_text())
    forward = parse((path / "forward.py").read_text(), str(path / "forward.py")).fusion
    backward = parse((path / "backward.py").read_text(), str(path / "backward.py")).fusion if meta["backward"] else None
    tree = meta["output_tree"]
    if tree is not None:
        leaves = [Leaf(v) if kind == "leaf" else v for kind, v in tree["leaves"]]
        tree = pytree.tree_unflatten(leaves, pytree.treespec_loads(tree["spec"]))
    call = None
    if meta["call"] is not None:
        c = meta["call"]
        constants = torch.load(path / "constants.pt", weights_only=True) if (path / "constants.pt").exists() else {}
        call = Binding(pytree.treespec_loads(c["in_spec"]), pytree.treespec_loads(c["out_spec"]), list(c["arg_names"]), constants,
                       [(k, tuple(v) if isinstance(v, list) else v) for k, v in c["output_map"]],
                       {label: Part(w, a, b) for label, (w, a, b) in c["parts"].items()})
    captured = types.SimpleNamespace(output_tree=tree, layers=dict(meta["layers"]), regional=meta["regional"])
    return Traced(forward, backward, meta["route"], f"from the trace cache ({path}); traced as: {meta['how']}", captured, call,
                  list(meta["arguments"]), None if meta["weights"] is None else frozenset(meta["weights"]), meta["boundary"],
                  dict(meta["tied"]), meta["seconds"], meta["split_parts"], list(meta["declined"])), meta["user_code"]


@contextlib.contextmanager
def _locked(lock: Path, wait: float):
    """The entry's lock, held while one caller traces and writes; after ``wait`` seconds a caller
    goes on without it (it traces itself, and does not write)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def trace(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None, options: Mapping[str, Any],
          trace_fn: Callable[[], Traced], checked: Callable[[Traced], bool]) -> Traced:
    """``trace_fn()``'s ``Traced``, from the cache when an entry for this module, call and
    ``options`` exists and either ``checked(traced)`` says the first-call check will compare its
    program with eager, or none of the user's source files changed since the entry was written;
    else traced, and kept for the next caller."""
    root = directory()
    if root is None:
        return trace_fn()
    limit = limit_bytes()  # a bad NVTP_CACHE_MAX_MB is refused before the trace
    try:
        name = key(module, args, kwargs or {}, options)
    except Uncacheable:
        return trace_fn()
    path = root / name
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / f"{name}.lock").touch()
    except OSError as e:  # a read-only or missing home: the trace stands, the cache says why it is not used
        warnings.warn(f"nvtp: the trace cache cannot use {root} ({e}); tracing without it. Set NVTP_CACHE_DIR to a "
                      "writable directory, or NVTP_CACHE=0")
        return trace_fn()
    with _locked(root / f"{name}.lock", WAIT_SECONDS) as held:
        stale = False
        if (path / "traced.json").exists():
            try:
                start = time.perf_counter()
                traced, user_code = _read(path)
                traced.seconds = time.perf_counter() - start
            except Exception as e:  # noqa: BLE001 - a damaged entry: said, removed, traced anew
                warnings.warn(f"nvtp: the trace cache's entry {path} cannot be read ({type(e).__name__}: {e}); tracing anew")
                shutil.rmtree(path, ignore_errors=True)
            else:
                # the first-call check stands behind it, or (a program it cannot check: dropout) none of the
                # user's own source files changed since it was written
                if checked(traced) or user_code == _user_code():
                    with contextlib.suppress(OSError):
                        os.utime(path / "traced.json")  # used: the last to be evicted
                    return traced
                stale = True
        traced = trace_fn()
        if held and (stale or not path.exists()):
            try:
                if stale:
                    shutil.rmtree(path)
                tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
                tmp.rmdir()
                _write(tmp, traced)
                tmp.rename(path)
                evict(root, limit)
            except Uncacheable:
                shutil.rmtree(tmp, ignore_errors=True)
            except OSError as e:  # a full or read-only disk: the trace stands, the cache says why it kept nothing
                shutil.rmtree(tmp, ignore_errors=True)
                warnings.warn(f"nvtp: the trace cache could not keep this trace in {root} ({e}); set NVTP_CACHE_DIR or NVTP_CACHE=0")
        return traced
