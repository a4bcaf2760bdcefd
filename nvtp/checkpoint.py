"""Sharded checkpoints of an ``nvtp.jit`` module and its optimizer.

Each rank writes only its shards (``rank<r>-of-<d>.pt``: parameters, optimizer state, RNG state)
and rank 0 a ``meta.json`` with every parameter's placement and whole shape. Loading on the same
mesh size reads one file per rank and resumes exactly; loading on another size reassembles each
tensor from all files and takes this rank's part under the new placement.

    model.compile(idx, targets)                 # so the parameters are placed
    step = nvtp.load_checkpoint(path, model, opt)

Nothing is lost to a killed run: every file is written to a temporary name, synced and renamed,
and rank 0 writes ``meta.json`` only after every rank's file is in place (a barrier), so a
directory with ``meta.json`` is a whole checkpoint. ``save_checkpoint(root / f"step-{n:06d}")``
every few steps with ``prune(root, keep=2)``, and ``latest_checkpoint(root)`` after a failure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from nvtp.execute import spmd
from nvtp.sharding.placements import axis_split

FORMAT = 1


def _placement_text(p) -> str:
    split = axis_split(p)
    return "R" if split is None else f"S({split[0]},{split[1]})"


def _placement_of(text: str):
    from nvtp.sharding.placements import REPLICATE, make_shard

    if text == "R":
        return REPLICATE
    dim, sf = text[2:-1].split(",")
    return make_shard(int(dim), int(sf))


def save_checkpoint(path: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None = None, *, step: int = 0) -> Path:
    """Write this rank's shards; every rank calls it. Returns the checkpoint directory."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n, _ in model.module.named_parameters()]
    rank, d = model.rank, model.mesh.size
    state = {
        "format": FORMAT,
        "step": step,
        "params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "rng": torch.get_rng_state(),
    }
    _write_atomically(out / f"rank{rank}-of-{d}.pt", lambda f: torch.save(state, f))  # never half-written
    if d > 1:
        model.comm.all_reduce(torch.zeros(1), "sum")  # a barrier: every rank's file is in place
    if rank == 0:  # meta.json marks the checkpoint whole
        meta = {"format": FORMAT, "devices": d, "step": step, "parameters": names,
                "placements": {n: _placement_text(model.placement(n)) for n in names},
                "shapes": {n: list(model.global_shape(n)) for n in names}}
        _write_atomically(out / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
    if d > 1:
        model.comm.all_reduce(torch.zeros(1), "sum")  # ... and every rank returns once it is
    return out


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
    if (root / "meta.json").exists():
        return root
    whole = sorted(p for p in root.glob("step-*") if (p / "meta.json").exists())
    return whole[-1] if whole else None


def prune(root: str | os.PathLike, keep: int = 2) -> None:
    """Delete all but the ``keep`` newest whole ``step-*`` checkpoints under ``root`` (and any
    unfinished one older than the newest whole one)."""
    import shutil

    root = Path(root)
    steps = sorted(root.glob("step-*"))
    whole = [p for p in steps if (p / "meta.json").exists()]
    if not whole:
        return
    keep_set = set(whole[-keep:]) if keep > 0 else set()
    for p in steps:
        if p not in keep_set and p < whole[-1]:
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load into ``model`` (and ``optimizer``) on this rank; returns the saved step. ``path`` is a
    checkpoint, or a directory of ``step-*`` checkpoints (the newest whole one is loaded)."""
    src = Path(path)
    found = latest_checkpoint(src) if src.is_dir() else None
    if found is None:
        raise FileNotFoundError(f"{src} holds no whole nvtp checkpoint (no meta.json, nor a step-* directory with one)")
    src = found
    meta = json.loads((src / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{src}: checkpoint format {meta.get('format')!r}, this nvtp reads format {FORMAT}")
    saved_d, rank, d = meta["devices"], model.rank, model.mesh.size
    missing = [f"rank{r}-of-{saved_d}.pt" for r in range(saved_d) if not (src / f"rank{r}-of-{saved_d}.pt").exists()]
    if missing:
        raise FileNotFoundError(f"{src}: checkpoint of {saved_d} ranks lacks {', '.join(missing)}")
    if saved_d == d:
        states = {rank: torch.load(src / f"rank{rank}-of-{d}.pt", weights_only=False)}
    else:
        states = {r: torch.load(src / f"rank{r}-of-{saved_d}.pt", weights_only=False) for r in range(saved_d)}
    params = dict(model.module.named_parameters())
    placements = {n: _placement_of(t) for n, t in meta["placements"].items()}

    def local(name: str, pieces: dict[int, torch.Tensor]) -> torch.Tensor:
        if saved_d == d:
            return pieces[rank]
        whole = spmd.assemble([pieces[r] for r in range(saved_d)], placements[name], meta["shapes"][name])
        return spmd.shard_tensor(whole, model.placement(name), model.mesh, rank)

    with torch.no_grad():
        for n in meta["parameters"]:
            t = local(n, {r: s["params"][n] for r, s in states.items()})
            if t.shape != params[n].shape:
                raise ValueError(f"{n}: checkpoint gives {list(t.shape)} for this rank, the model holds {list(params[n].shape)}; "
                                 "compile the model (model.compile(*inputs)) before loading")
            params[n].copy_(t)
    if optimizer is not None:
        opt_states = {r: s["optimizer"] for r, s in states.items()}
        state = opt_states[rank] if saved_d == d else _reassemble_optimizer(opt_states, meta, model, local)
        optimizer.load_state_dict(state)
    torch.set_rng_state(states[rank]["rng"] if rank in states else states[0]["rng"])
    return int(meta["step"])


def _reassemble_optimizer(opt_states: dict, meta: dict, model, local) -> dict:
    """Optimizer state saved on another mesh size: per-parameter tensors shaped like their
    parameter are reassembled and re-sharded like it; scalars are taken from rank 0."""
    names = meta["parameters"]
    first = opt_states[0]
    out = {"param_groups": first["param_groups"], "state": {}}
    for index, per_param in first["state"].items():
        name = names[index]
        new = {}
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                new[key] = local(name, {r: s["state"][index][key] for r, s in opt_states.items()})
            else:
                new[key] = value
        out["state"][index] = new
    return out
