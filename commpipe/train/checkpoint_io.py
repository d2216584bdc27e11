"""Reading checkpoint files without trusting them, and saying plainly when storage fails.

What a checkpoint is trusted for: its tensors (numbers) and its commpipe.json (plain JSON).
Neither may run code. DCP's own reader unpickles `.metadata` with `pickle.load`, which runs
whatever a crafted file asks for, so commpipe reads it with `SafeReader`: an unpickler that
admits only the classes DCP's metadata is made of (torch.distributed.checkpoint.metadata's
dataclasses, DCP's file-location record, torch.Size, dtypes and layouts, pathlib paths) and
refuses everything else before calling it. Entries must be tensors (DCP loads a "bytes" entry
with torch.load(weights_only=False), so one is refused) stored in files of the checkpoint
folder itself; the tensor files are read by DCP with torch.load(weights_only=True).

Storage failures come back from DCP as `CheckpointException ranks:dict_keys([1])` with the
cause buried in a per-rank traceback: `save_failure` and `load_failure` turn them into one line
naming the folder, the file and the OS's reason (No space left on device, ...).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from commpipe.files import StorageError, os_reason

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) pairs a commpipe checkpoint's .metadata refers to; BytesStorageMetadata is
# left out on purpose (see the module docstring)
ALLOWED = {(_DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                                         "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                         "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),      # torch.strided and friends, looked up by name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UntrustedMetadata(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UntrustedMetadata(f"it refers to {module}.{name}, which is not part of a DCP "
                                "checkpoint's metadata")


def read_metadata(path) -> Metadata:
    """The DCP metadata of checkpoint folder `path`, read by the restricted unpickler and
    checked: tensor entries only, each in an existing file of the folder that is long enough.
    Raises StorageError naming the file when it is refused or damaged."""
    path = Path(path)
    file = path / ".metadata"
    try:
        data = file.read_bytes()
    except OSError as e:
        raise damaged(path, ".metadata", f"cannot be read: {os_reason(e)}") from None
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except UntrustedMetadata as e:
        raise StorageError(f"refusing checkpoint {path}: {file.name} is not a checkpoint's "
                           f"metadata ({e}); loading it could run code. Resume only from "
                           "checkpoints you or your jobs wrote") from None
    except Exception as e:   # noqa: BLE001 - a truncated pickle fails in many ways
        raise damaged(path, ".metadata", f"cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise damaged(path, ".metadata", f"holds a {type(md).__name__}, not DCP metadata")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise StorageError(f"refusing checkpoint {path}: entry {key!r} of .metadata is a "
                               f"{type(entry).__name__}, commpipe checkpoints hold tensors only")
    ends: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or Path(name).name != name or name in (".", ".."):
            raise StorageError(f"refusing checkpoint {path}: .metadata points at {name!r}, "
                               "outside the checkpoint folder")
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        f = path / name
        if not f.is_file():
            raise damaged(path, name, "is missing")
        if f.stat().st_size < end:
            raise damaged(path, name, f"is truncated ({f.stat().st_size} bytes, .metadata "
                                      f"places data up to byte {end})")
    return md


class SafeReader(FileSystemReader):
    """DCP's file-system reader with `.metadata` read by `read_metadata` (no code runs)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise StorageError("per-rank DCP metadata files are not part of commpipe checkpoints")
        md = read_metadata(Path(self.path))
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def damaged(path: Path, file: str, why: str) -> StorageError:
    """'checkpoint DIR is damaged: FILE ...; resume from an earlier one' (naming it if any)."""
    path = Path(path)
    earlier = sorted(p for p in path.parent.glob("step_*")
                     if p.name < path.name and not p.name.endswith(".tmp")
                     and (p / ".metadata").is_file() and (p / "commpipe.json").is_file())
    hint = f": --resume {earlier[-1]}" if earlier else " (there is none in this folder)"
    return StorageError(f"checkpoint {path} is damaged: {file} {why}; resume from an earlier "
                        f"one{hint}")


def _causes(exc: BaseException):
    """`exc`, the per-rank errors inside a CheckpointException, and their causes."""
    seen, todo = set(), [(None, exc)]
    while todo:
        rank, e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield rank, e
        for r, pair in (getattr(e, "failures", None) or {}).items():
            todo.append((r, pair[0] if isinstance(pair, tuple) else pair))
        todo += [(rank, e.__cause__), (rank, e.__context__)]


def _is_storage(e: BaseException) -> bool:
    # a lost peer's connection error is not a storage failure
    return isinstance(e, OSError) and not isinstance(e, ConnectionError)


def save_failure(exc: BaseException, tmp: Path, last: Path | None) -> StorageError | None:
    """A StorageError for a save that failed on an OSError (disk full, quota, permissions), or
    None when `exc` is no storage failure."""
    for rank, e in _causes(exc):
        if _is_storage(e):
            who = f" on rank {rank}" if rank is not None else ""
            what = f" ({e.filename})" if e.filename else ""
            kept = f"the last complete checkpoint, {last}, is intact" if last else \
                "there is no earlier complete checkpoint"
            return StorageError(f"cannot save the checkpoint into {tmp}{what}{who}: "
                                f"{os_reason(e)}; {kept}. Free space there or give --out on a "
                                "file system with room")
    return None


def load_failure(exc: BaseException, path: Path) -> StorageError:
    """A StorageError for a DCP load that failed: the checkpoint is damaged (or unreadable)."""
    for _, e in _causes(exc):
        if isinstance(e, StorageError):
            return e
    for _, e in _causes(exc):
        if _is_storage(e):
            return damaged(path, e.filename or "a tensor file", f"cannot be read: {os_reason(e)}")
    inner = [e for _, e in _causes(exc) if e is not exc and not hasattr(e, "failures")]
    why = f"{type(inner[0]).__name__}: {inner[0]}" if inner else str(exc).splitlines()[0]
    return damaged(path, "a tensor file (__<rank>_0.distcp)", f"cannot be read ({why})")
