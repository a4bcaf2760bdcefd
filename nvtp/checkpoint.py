"""Checkpoints of an ``nvtp.jit`` module and its optimizer: thin wrappers over
``torch.distributed.checkpoint`` (DCP).

The parameters of an ``nvtp.jit`` module on a mesh of processes are DTensors (``nvtp/dtensor.py``),
so DCP saves each rank's parts and loads them onto any mesh size, resharding as it reads; these
functions add only the step, the RNG state and a marker that says the checkpoint is whole:

    model.compile(idx, targets)                 # so the parameters are placed
    step = nvtp.load_checkpoint(path, model, opt)

is ``dcp.load`` of ``{"model": get_model_state_dict(model.module), "optim":
get_optimizer_state_dict(model.module, opt), "step", "rng"}`` followed by ``set_model_state_dict``
and ``set_optimizer_state_dict``; call DCP yourself the same way if you prefer (docs/usage.md).
On a pipeline mesh (``nvtp.pipeline``) each rank's state is its stage's parameters under the
model's own names, DTensors on the stage's (dp, tp) sub-mesh (``PipelineModule.checkpoint_state``),
so a checkpoint saved on one (pp, dp, tp) shape loads on another, or into a plain module; the
optimizer's state is not saved there.

Nothing untrusted runs, and nothing wrong loads (``nvtp/checkpoint_files.py``): DCP's ``.metadata``
is read by an unpickler that builds only DCP's metadata types, the step and other non-tensor
entries with ``torch.load(weights_only=True)``; every file is checked against the SHA-256 written
into ``meta.json`` at save; and a checkpoint whose keys or shapes are not the model's (another
model, more layers), or saved without optimizer state when the load asks for it, is refused in
one line before anything is read into the model (docs/faults.md).

Nothing is lost to a killed run: DCP writes every rank's data before its ``.metadata``, and rank 0
writes ``meta.json`` (atomically) only after ``dcp.save`` has returned, so a directory with
``meta.json`` is a whole checkpoint. ``save_checkpoint(root / f"step-{n:06d}")`` every few steps
with ``prune(root, keep=2)``, and ``latest_checkpoint(root)`` after a failure.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
import shutil

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from nvtp import checkpoint_files as files

FORMAT = 2  # 1 was nvtp's own per-rank .pt files; 2 is torch.distributed.checkpoint
MARKER = "meta.json"


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _state(model, optimizer: torch.optim.Optimizer | None) -> dict:
    """The DCP state dict: the wrapped module's own keys (DTensors on a mesh) and the optimizer's."""
    if hasattr(model, "checkpoint_state"):  # a pipeline (nvtp.pipeline.runtime): each rank its stage's parameters
        if optimizer is not None:
            raise ValueError("a pipeline's checkpoint holds the model's parameters only; its optimizer state is not built "
                             "(docs/pipeline.md): call save_checkpoint(path, model) / load_checkpoint(path, model) without it")
        return {"model": model.checkpoint_state(), "step": 0, "rng": torch.get_rng_state()}
    if model.mesh.size > 1 and not model.uses_dtensor:
        raise ValueError("checkpoints need the parameters as DTensors, on torch.distributed's own group; "
                         "this module runs on a simulated mesh (comm=), whose ranks are threads of one process")
    state = {"model": get_model_state_dict(model.module), "step": 0, "rng": torch.get_rng_state()}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model.module, optimizer)
    return state


def save_checkpoint(path: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None = None, *, step: int = 0) -> Path:
    """Save ``model`` (and ``optimizer``) with DCP; every rank calls it. Returns the checkpoint directory."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = _state(model, optimizer)
    state["step"] = step
    if model.rank == 0:  # overwriting: not whole until written again (no rank writes before dcp.save's first collective)
        (out / MARKER).unlink(missing_ok=True)
    dcp.save(state, checkpoint_id=out)  # returns once every rank's data and the .metadata are written
    checksums = _checksums(out)
    if model.rank == 0:
        meta = {"format": FORMAT, "devices": model.layout.size if hasattr(model, "layout") else model.mesh.size, "step": step,
                "files": checksums}
        _write_atomically(out / MARKER, lambda f: f.write(json.dumps(meta, indent=1).encode()))
    if _dist_ready():
        dist.barrier()  # every rank returns once the checkpoint is whole
    return out


def _checksums(out: Path) -> dict:
    """The manifest of the files DCP wrote (``checkpoint_files.manifest``): each rank hashes its
    share of them, and every rank gets the whole (rank 0 writes it)."""
    names = [files.METADATA, *files.data_files(files.read_metadata(out))]
    if not _dist_ready():
        return files.manifest(out, names)

    world, rank = dist.get_world_size(), dist.get_rank()
    shares: list = [None] * world
    dist.all_gather_object(shares, files.manifest(out, names[rank::world]))
    return {name: entry for share in shares for name, entry in sorted(share.items())}


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """``root`` itself if it is a whole checkpoint, else its newest whole ``step-*`` checkpoint
    (one whose ``meta.json`` exists: a save that was killed half-way is skipped), or None."""
    root = Path(root)
    if (root / MARKER).exists():
        return root
    whole = sorted(p for p in root.glob("step-*") if (p / MARKER).exists())
    return whole[-1] if whole else None


def prune(root: str | os.PathLike, keep: int = 2) -> None:
    """Delete all but the ``keep`` newest whole ``step-*`` checkpoints under ``root`` (and any
    unfinished one older than the newest whole one)."""
    root = Path(root)
    steps = sorted(root.glob("step-*"))
    whole = [p for p in steps if (p / MARKER).exists()]
    if not whole:
        return
    keep_set = set(whole[-keep:]) if keep > 0 else set()
    for p in steps:
        if p not in keep_set and p < whole[-1]:
            shutil.rmtree(p, ignore_errors=True)


def _checked(src: Path, meta: dict, state: dict):
    """DCP's metadata of ``src``, after checking (every rank, agreeing) its checksum and that
    ``state`` is what it holds (``checkpoint_files.differences``); refuses with a
    ``CheckpointError`` on every rank otherwise. Warns of a checkpoint without checksums."""
    problem, metadata = None, None
    manifest = meta.get("files")
    try:
        if manifest is None:
            warnings.warn(f"{src} has no checksums in {MARKER} (saved by an older nvtp): corrupted files cannot be detected; "
                          "save it again to add them", stacklevel=3)
        else:
            files.verify(src, files.METADATA, manifest)
        metadata = files.read_metadata(src)
    except files.CheckpointError as e:
        problem = str(e)
    keys = {f"model.{k}" for k in state["model"]}
    if _dist_ready():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (problem, sorted(keys)))  # a pipeline rank holds its stage's keys only
        problem = next((p for p, _ in everyone if p is not None), None)
        keys = {k for _, ks in everyone for k in ks}
    if problem is None:
        why = files.differences(state, metadata, keys)
        if why is not None:
            problem = f"{src} does not hold this model's state: {why}"
    if problem is not None:
        raise files.CheckpointError(problem)
    return metadata


def load_checkpoint(path: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load into ``model`` (and ``optimizer``) with DCP, on any mesh size; every rank calls it.
    Returns the saved step. ``path`` is a checkpoint, or a directory of ``step-*`` checkpoints (the
    newest whole one is loaded)."""
    src = Path(path)
    found = latest_checkpoint(src) if src.is_dir() else None
    if found is None:
        raise FileNotFoundError(f"{src} holds no whole nvtp checkpoint (no {MARKER}, nor a step-* directory with one)")
    src = found
    meta = json.loads((src / MARKER).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{src}: checkpoint format {meta.get('format')!r}, this nvtp reads format {FORMAT} "
                         "(torch.distributed.checkpoint); format 1 was nvtp's own per-rank .pt files")
    pipeline = hasattr(model, "checkpoint_state")
    if not pipeline and model.mesh.size > 1 and model.uses_dtensor and not model._placements:
        raise ValueError("compile the model (model.compile(*inputs)) before loading: its parameters are not placed yet")
    state = _state(model, optimizer)
    metadata = _checked(src, meta, state)
    try:
        dcp.load(state, storage_reader=files.SafeReader(src, meta.get("files"), metadata), planner=files.SafePlanner())
    except BaseException as e:  # DCP raises a CheckpointException (a BaseException) holding every rank's failure
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise files.unwrap(e) from None
    if pipeline:  # read in place into each DTensor's local part, the parameter's own storage
        model.restore(state["model"])
    else:
        set_model_state_dict(model.module, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model.module, optimizer, state["optim"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])
