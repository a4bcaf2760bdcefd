"""Checkpoints nvtp will not load (nvtp/checkpoint_files.py): a crafted pickle does not run, a
corrupted file is refused naming it, another model's checkpoint (or one without the optimizer
state the load asks for) is refused in one line saying which keys and shapes differ; a normal
checkpoint still round-trips exactly, in one process (default tier) and on two gloo processes (slow)."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import nvtp
from nvtp.checkpoint_files import CheckpointError, manifest
from nvtp.execute.launch import spawn
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh

CFG = gpt.config("tiny")


def _model(layers: int = CFG.n_layer, seed: int = 0):
    torch.manual_seed(seed)
    return nvtp.jit(gpt.GPT(replace(CFG, n_layer=layers)), mesh=DeviceMesh.of_size(1))


def _trained(layers: int = CFG.n_layer):
    """A model and its AdamW after one step on random gradients (so the optimizer has state;
    nothing traced: the checkpoint is what is tested)."""
    model = _model(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict, dict]:
    """A checkpoint of the tiny GPT with AdamW at step 7; the model's and optimizer's state as saved."""
    path = tmp_path_factory.mktemp("ckpt") / "step-000007"
    model, opt = _trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        nvtp.save_checkpoint(path, model, opt, step=7)
    return path, {k: v.clone() for k, v in model.module.state_dict().items()}, opt.state_dict()


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _reseal(path: Path) -> None:
    """Write meta.json's checksums for the files as they are now (a forger who rewrites meta.json too)."""
    meta = json.loads((path / "meta.json").read_text())
    meta["files"] = manifest(path, meta["files"])
    (path / "meta.json").write_text(json.dumps(meta))


def _load(path: Path, layers: int = CFG.n_layer, with_optimizer: bool = True) -> int:
    model = _model(layers, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if with_optimizer else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nvtp.load_checkpoint(path, model, opt)


def test_a_checkpoint_round_trips_exactly_in_one_process_with_its_checksums(saved, tmp_path):
    path, weights, optim = saved
    files = json.loads((path / "meta.json").read_text())["files"]
    assert set(files) == {".metadata", *(f.name for f in path.glob("*.distcp"))} and all(len(e["sha256"]) == 64 for e in files.values())
    model = _model(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert any(not torch.equal(v, weights[k]) for k, v in model.module.state_dict().items())  # another start
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert nvtp.load_checkpoint(path, model, opt) == 7
    assert not [w for w in said if "checksum" in str(w.message)]  # a checkpoint with checksums loads without a word of them
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, weights[k]), k
    got = opt.state_dict()
    assert got["param_groups"] == optim["param_groups"]
    for i, s in optim["state"].items():
        for name, t in s.items():
            assert torch.equal(got["state"][i][name], t), (i, name)


class _Marker:
    """A pickle that creates a file when unpickled (what a crafted checkpoint would do)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("forged_manifest", [False, True])
def test_a_crafted_metadata_pickle_does_not_run_and_is_refused(saved, tmp_path, forged_manifest):
    """Without a forged meta.json the checksum refuses the file; with one, the unpickler refuses
    the first type that is not DCP metadata, naming it. Either way nothing ran."""
    marker = tmp_path / "ran"
    path = _copy(saved[0], tmp_path / "crafted")
    (path / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    if forged_manifest:
        _reseal(path)
    why = "os.system|posix.system" if forged_manifest else r"\.metadata: its contents differ from the checksum"
    with pytest.raises(CheckpointError, match=why) as e:
        _load(path)
    assert not marker.exists()
    assert "\n" not in str(e.value)


def test_a_crafted_entry_does_not_run_and_is_refused(tmp_path):
    """The step (a non-tensor entry, which DCP reads with torch.load(weights_only=False)) is read
    with weights_only=True: a pickled object in it is refused, naming the entry."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    model, opt = _trained()
    path = tmp_path / "evil"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nvtp.save_checkpoint(path, model, step=3)
        state = {"model": model.module.state_dict(), "step": _Marker(marker), "rng": torch.get_rng_state()}
        dcp.save(state, checkpoint_id=path)
    _reseal(path)
    with pytest.raises(CheckpointError, match="entry 'step': refers to (posix|os).system; nvtp reads only plain data there"):
        _load(path, with_optimizer=False)
    assert not marker.exists()


def test_flipped_bytes_in_a_data_file_are_refused_naming_the_file(saved, tmp_path):
    path = _copy(saved[0], tmp_path / "flipped")
    data = next(path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 4096] = bytes(b ^ 0xFF for b in raw[middle:middle + 4096])
    data.write_bytes(bytes(raw))
    model = _model(seed=1)
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{data.name}: its contents differ from the checksum written when it was saved"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nvtp.load_checkpoint(path, model)
    assert all(torch.equal(v, before[k]) for k, v in model.module.state_dict().items())  # nothing read into the model


def test_another_models_checkpoint_is_refused_saying_which_keys_and_shapes_differ(tmp_path):
    """A 2-layer GPT's checkpoint into a 1-layer GPT (which DCP loaded, ignoring layer 1), and
    back; a wider model's into the tiny one."""
    two, _ = _trained(layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nvtp.save_checkpoint(tmp_path / "two", two)
    with pytest.raises(CheckpointError, match=r"does not hold this model's state: \d+ key\(s\) in it the model does not have "
                                              r"\(model\.h\.1\.") as e:
        _load(tmp_path / "two", layers=1, with_optimizer=False)
    assert "\n" not in str(e.value)
    one, _ = _trained(layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nvtp.save_checkpoint(tmp_path / "one", one)
    with pytest.raises(CheckpointError, match=r"\d+ key\(s\) the model has are not in it \(model\.h\.1\."):
        _load(tmp_path / "one", layers=2, with_optimizer=False)
    torch.manual_seed(0)
    wide = nvtp.jit(gpt.GPT(replace(CFG, n_embd=2 * CFG.n_embd)), mesh=DeviceMesh.of_size(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nvtp.save_checkpoint(tmp_path / "wide", wide)
    with pytest.raises(CheckpointError, match=r"shape\(s\) differ \(model\..*: checkpoint \[\d+(, \d+)?\], model"):
        _load(tmp_path / "wide", with_optimizer=False)


def test_a_checkpoint_without_optimizer_state_is_refused_when_the_load_asks_for_it(tmp_path):
    model, _ = _trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nvtp.save_checkpoint(tmp_path / "weights", model)
    with pytest.raises(CheckpointError, match="saved without optimizer state, and the load asks for the optimizer's"):
        _load(tmp_path / "weights")
    assert _load(tmp_path / "weights", with_optimizer=False) == 0  # the weights alone load


def test_a_checkpoint_saved_before_checksums_loads_with_a_warning(saved, tmp_path):
    path = _copy(saved[0], tmp_path / "old")
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="has no checksums in meta.json"):
        assert nvtp.load_checkpoint(path, _model(seed=1)) == 7


def _two_ranks(rank: int, world: int, init_method: str, root: str, corrupt: bool) -> int:
    """Save a tiny GPT on 2 gloo ranks (megatron), load it into a fresh model; with ``corrupt``,
    rank 0 flips bytes of rank 1's data file between the two and both ranks must refuse."""
    import torch.distributed as dist

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    warnings.simplefilter("ignore")
    idx, tgt = gpt.example_tokens(CFG)
    torch.manual_seed(0)
    model = nvtp.jit(gpt.GPT(CFG), plan="megatron")  # the default group: DTensor parameters
    model(idx, tgt)
    path = nvtp.save_checkpoint(Path(root) / "ckpt", model, step=5)
    if corrupt and rank == 0:
        data = path / "__1_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[100:4196] = bytes(b ^ 0xFF for b in raw[100:4196])
        data.write_bytes(bytes(raw))
    dist.barrier()
    torch.manual_seed(1)
    fresh = nvtp.jit(gpt.GPT(CFG), plan="megatron")
    fresh.compile(idx, tgt)
    try:
        step = nvtp.load_checkpoint(path, fresh)
    except CheckpointError as e:
        (Path(root) / f"refused{rank}").write_text(str(e))
        return 3
    same = all(torch.equal(nvtp.full_tensor(a), nvtp.full_tensor(b)) for a, b in zip(model.parameters(), fresh.parameters()))
    (Path(root) / f"loaded{rank}").write_text(f"{step} {same}")
    dist.destroy_process_group()
    return 0


@pytest.mark.slow
def test_a_checkpoint_round_trips_on_two_gloo_ranks_and_a_corrupted_one_is_refused_on_both(tmp_path):
    assert spawn(_two_ranks, 2, str(tmp_path / "good"), False) == [0, 0]
    assert [(tmp_path / "good" / f"loaded{r}").read_text() for r in range(2)] == ["5 True", "5 True"]
    assert spawn(_two_ranks, 2, str(tmp_path / "bad"), True) == [3, 3]
    said = [(tmp_path / "bad" / f"refused{r}").read_text() for r in range(2)]
    assert said[0] == said[1] and "__1_0.distcp: its contents differ from the checksum" in said[0]
