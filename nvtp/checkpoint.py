"""Sharded checkpoints of an ``nvtp.jit`` module and its optimizer.

Each rank writes only its shards (``rank<r>-of-<d>.pt``: parameters, optimizer state, RNG state)
and rank 0 a ``meta.json`` with every parameter's placement and whole shape. Loading on the same
mesh size reads one file per rank and resumes exactly; loading on another size reassembles each
tensor from all files and takes this rank's part under the new placement.

    model.compile(idx, targets)                 # so the parameters are placed
    step = nvtp.load_checkpoint(path, model, opt)
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
    tmp = out / f".rank{rank}-of-{d}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, out / f"rank{rank}-of-{d}.pt")  # a killed save never leaves a half-written file
    if rank == 0:
        meta = {"format": FORMAT, "devices": d, "step": step, "parameters": names,
                "placements": {n: _placement_text(model.placement(n)) for n in names},
                "shapes": {n: list(model.global_shape(n)) for n in names}}
        (out / "meta.json.tmp").write_text(json.dumps(meta, indent=1))
        os.replace(out / "meta.json.tmp", out / "meta.json")
    if d > 1:
        model.comm.all_reduce(torch.zeros(1), "sum")  # a barrier: the checkpoint is whole when this returns
    return out


def load_checkpoint(path: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load into ``model`` (and ``optimizer``) on this rank; returns the saved step."""
    src = Path(path)
    meta_path = src / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{src} holds no nvtp checkpoint (no meta.json)")
    meta = json.loads(meta_path.read_text())
    saved_d, rank, d = meta["devices"], model.rank, model.mesh.size
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
