"""What ``nvtp.load_checkpoint`` trusts in a checkpoint directory, and how it checks it first.

A checkpoint is torch.distributed.checkpoint's (DCP's) files plus nvtp's ``meta.json``. DCP reads
its ``.metadata`` with ``pickle.load`` and the non-tensor entries (the step, an optimizer's
hyperparameters) with ``torch.load(weights_only=False)``: a crafted file runs its code on load.
nvtp reads them its own way, through DCP's own seams (a ``FileSystemReader`` and a
``DefaultLoadPlanner``):

* ``.metadata`` by an unpickler that builds only DCP's metadata types, ``torch.Size``, dtypes
  and paths (``METADATA_TYPES``); anything else is refused, naming the type, before it is built;
* non-tensor entries with ``torch.load(weights_only=True)`` (tensors DCP already reads so);
* every file against the checksum (SHA-256) ``save_checkpoint`` wrote into ``meta.json``
  (``manifest``), each rank the files it will read, before any rank reads data into the model;
* the checkpoint's keys and shapes against the model's (and the optimizer's, when one is
  given): another model's checkpoint, or one saved without optimizer state, is refused in one
  line saying which keys and shapes differ.

Each refusal is a ``CheckpointError`` (a ``ValueError``), raised on every rank alike.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

METADATA = ".metadata"

# The globals a DCP .metadata file references (torch 2.10, read off files DCP wrote for a plain
# module, an optimizer and DTensors on a mesh): nothing here runs code when built.
METADATA_TYPES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name (torch.strided)
    "torch": frozenset({"Size"}),  # and the dtypes (``torch.float32``), checked by type
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class CheckpointError(ValueError):
    """A checkpoint nvtp will not load: which file or key, what is wrong, what to do."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_TYPES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path}: refers to {module}.{name}, which is not one of torch.distributed.checkpoint's "
                              "metadata types; nvtp does not build it (a crafted or foreign file: a pickle can run code). "
                              "Load only checkpoints you saved, or save this one again")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.path}: holds a persistent reference, which DCP metadata never does; nvtp does not follow it")


def read_metadata(directory: Path) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, built only from its metadata types (``METADATA_TYPES``)."""
    path = directory / METADATA
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e}); the checkpoint is incomplete") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read the pickle is the file's fault
        raise CheckpointError(f"{path}: not readable as DCP metadata ({type(e).__name__}: {e}); the file is damaged") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata; the file is damaged or foreign")
    return metadata


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def data_files(metadata: Metadata) -> list[str]:
    """The files DCP's metadata says hold the data, sorted."""
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()})


def manifest(directory: Path, files: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{file: {"sha256": ..., "bytes": ...}}`` of ``files`` in ``directory``."""
    return {name: {"sha256": sha256(directory / name), "bytes": (directory / name).stat().st_size} for name in files}


def verify(directory: Path, name: str, files: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse ``name`` unless it is in the manifest ``files`` with its contents' checksum."""
    path = directory / name
    entry = files.get(name)
    if entry is None:
        raise CheckpointError(f"{path}: the checkpoint's data, but not in meta.json's list of files with checksums; "
                              "the checkpoint was changed after it was saved: load another one")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e}); the checkpoint is incomplete") from None
    if size != entry.get("bytes") or sha256(path) != entry.get("sha256"):
        raise CheckpointError(f"{path}: its contents differ from the checksum written when it was saved ({size} bytes, "
                              f"{entry.get('bytes')} saved); the file is corrupted or was changed: restore it from a copy, "
                              "or load an older checkpoint (latest_checkpoint(root) lists the whole ones)")


class SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with ``read_metadata`` and checking every data file
    this rank will read against the manifest before the read phase starts on any rank
    (``prepare_local_plan`` runs in DCP's planning step, whose failures every rank raises)."""

    def __init__(self, path: Path, files: Mapping[str, Mapping[str, Any]] | None, metadata: Metadata | None = None):
        super().__init__(path)
        self.directory, self.files, self._metadata = Path(path), files, metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("nvtp checkpoints have one global .metadata")
        metadata = self._metadata if self._metadata is not None else read_metadata(self.directory)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def prepare_local_plan(self, plan):
        if self.files is not None:
            for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                verify(self.directory, name, self.files)
        return super().prepare_local_plan(plan)


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - weights_only refuses anything but plain data
            found = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", str(e))
            what = f"refers to {found.group(1)}" if found else f"cannot be read as plain data ({type(e).__name__})"
            raise CheckpointError(f"entry {read_item.dest_index.fqn!r}: {what}; nvtp reads only plain data there (numbers, "
                                  "strings, tensors) and does not unpickle it (a crafted file can run code). Load only "
                                  "checkpoints you saved, or save this one again") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _some(names: list[str], k: int = 4) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def differences(state: dict[str, Any], metadata: Metadata, all_model_keys: set[str] | None = None) -> str | None:
    """What keeps ``state`` (what this rank loads: {"model": ..., "optim": ...?, "step", "rng"})
    from loading ``metadata``'s checkpoint, in one line; None if nothing.

    Keys of the model missing from the checkpoint, model keys of the checkpoint the model lacks
    (``all_model_keys``: every rank's, where ranks hold different parts), shapes that differ, an
    optimizer state asked for but not saved, or optimizer keys missing."""
    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    mine = set(flat)
    model_keys = all_model_keys if all_model_keys is not None else {k for k in mine if k.startswith("model.")}
    problems = []
    if "optim" in state and not any(k.startswith("optim.") for k in saved):
        problems.append("it was saved without optimizer state, and the load asks for the optimizer's: load without the "
                        "optimizer (load_checkpoint(path, model)), or from a checkpoint saved with one")
        mine = {k for k in mine if not k.startswith("optim.")}
    missing = sorted(k for k in mine if k not in saved)
    extra = sorted(k for k in saved if k.startswith("model.") and k not in model_keys)
    shapes = []
    for key in sorted(mine & set(saved)):
        value, meta = flat[key], saved[key]
        tensor, saved_tensor = isinstance(value, torch.Tensor), isinstance(meta, TensorStorageMetadata)
        if tensor and saved_tensor and tuple(value.shape) != tuple(meta.size):
            shapes.append(f"{key}: checkpoint {list(meta.size)}, model {list(value.shape)}")
        elif tensor != saved_tensor:
            shapes.append(f"{key}: checkpoint {'a tensor ' + str(list(meta.size)) if saved_tensor else 'not a tensor'}, "
                          f"model {'a tensor ' + str(list(value.shape)) if tensor else 'not a tensor'}")
    if missing:
        problems.append(f"{len(missing)} key(s) the {'model' if all(k.startswith('model.') for k in missing) else 'load'} has are "
                        f"not in it ({_some(missing)})")
    if extra:
        problems.append(f"{len(extra)} key(s) in it the model does not have ({_some(extra)})")
    if shapes:
        problems.append(f"{len(shapes)} shape(s) differ ({_some(shapes, 3)})")
    if not problems:
        return None
    return "; ".join(problems)


def unwrap(error: BaseException) -> BaseException:
    """DCP reports a failure on any rank as a ``CheckpointException`` holding each rank's exception:
    the first ``CheckpointError`` among them (else ``error`` itself)."""
    for exc_and_trace in getattr(error, "failures", {}).values():
        exc = exc_and_trace[0] if isinstance(exc_and_trace, tuple) else exc_and_trace
        if isinstance(exc, CheckpointError):
            return exc
    return error
