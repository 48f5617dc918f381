"""Reading a checkpoint folder without running code from it.

A checkpoint folder may come from elsewhere (a shared file system, a copied bucket), and
its SHA256SUMS only proves that the files are the ones its writer committed, not that the
writer was honest. Every file of it is therefore read by a loader that builds data, never
calls what a pickle names:

- ``rng/rank-<r>.pt``: ``torch.load(weights_only=True)`` (tensors, tuples, ints), then
  checked for the shape `rng_state` writes;
- DCP's ``.metadata``: a pickle, read by an unpickler that resolves only DCP's own
  metadata classes, ``torch.Size``, dtypes and layouts (DCP's reader uses plain
  ``pickle.load``);
- DCP's non-tensor entries (an optimizer's ``lr``, ``step``): ``torch.load(weights_only=True)``
  (DCP's default planner passes ``weights_only=False``).

Anything else raises `UnsafeCheckpointFile`; `tandem.rl.core.checkpoint` turns it into one
line and exit 8.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class UnsafeCheckpointFile(Exception):
    """A checkpoint file that names code to run, or is not the data it should hold."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = getattr(torch, name, None) if module == "torch" else None
        dcp_class = getattr(dcp_metadata, name, None) if module == _METADATA_MODULE else None
        if (
            (isinstance(dcp_class, type) and dcp_class.__module__ == _METADATA_MODULE)
            or (module, name) in _ALLOWED
            or isinstance(dtype, torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpointFile(f"names {module}.{name}, which a checkpoint never holds")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with ``.metadata`` read by `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except UnsafeCheckpointFile as e:
                raise UnsafeCheckpointFile(f".metadata {e}") from None
            except Exception as e:  # noqa: BLE001  (any malformed pickle)
                raise UnsafeCheckpointFile(f".metadata is not DCP metadata ({e})") from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointFile(f".metadata holds a {type(metadata).__name__}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001  (UnpicklingError names the global it refused)
            raise UnsafeCheckpointFile(
                f"entry {read_item.dest_index.fqn} is not plain data ({_why(e)})"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_rng(path: str) -> dict[str, Any]:
    """The RNG state in ``path`` as `rng_state` wrote it (``python``: random's state tuple,
    ``torch``: a uint8 tensor, optionally ``cuda``: a list of them), read without running
    code; `UnsafeCheckpointFile` otherwise."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001  (UnpicklingError names the global it refused)
        raise UnsafeCheckpointFile(f"is not plain data ({_why(e)})") from None
    py = state.get("python") if isinstance(state, dict) else None
    ok = (
        isinstance(py, tuple)
        and len(py) == 3
        and isinstance(py[1], tuple)
        and all(type(x) is int for x in py[1])
        and _byte_tensor(state.get("torch"))
        and (
            "cuda" not in state
            or (isinstance(state["cuda"], list) and all(map(_byte_tensor, state["cuda"])))
        )
    )
    if not ok:
        raise UnsafeCheckpointFile("is not an RNG state written by this trainer")
    return state


def _byte_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1


def _why(e: Exception) -> str:
    """One line for a refused ``torch.load``: the global it names, else the first line."""
    m = re.search(r"GLOBAL ([\w.]+)", str(e))
    return f"names {m.group(1)}" if m else (str(e).strip().splitlines() or [type(e).__name__])[0]
