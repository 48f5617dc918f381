"""A checkpoint's integrity files: every file's sha256 in SHA256SUMS and the COMMITTED marker
that seals it (docs/fault-tolerance.md). Written while a save is staged (each rank records the
sums of the files it wrote, in the writing thread), merged and sealed at commit, and read back
before every load (tandem/rl/core/checkpoint.py)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Sequence

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tandem.rl.core.errors import EXIT_CHECKPOINT

MARKER = "COMMITTED"
SUMS = "SHA256SUMS"
_SUMS_DIR = "_sums"  # per-rank sums while a save is staged; merged into SUMS at commit
_HASH_CHUNK = 16 << 20


class CheckpointError(Exception):
    """A checkpoint folder that cannot be used as asked (damaged, or an earlier run's
    checkpoints in the way of a fresh start). ``str()`` is one line; train.py exits
    with ``exit_status`` (EXIT_CHECKPOINT)."""

    exit_status = EXIT_CHECKPOINT


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def record_sums(folder: str, names: Sequence[str], tag: str) -> None:
    """Write ``<folder>/_sums/<tag>`` with the sha256 of each of ``names`` (relative paths)."""
    lines = "".join(f"{sha256(os.path.join(folder, n))}  {n}\n" for n in sorted(names))
    out = os.path.join(folder, _SUMS_DIR)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, tag + ".tmp"), "w") as f:
        f.write(lines)
    os.replace(os.path.join(out, tag + ".tmp"), os.path.join(out, tag))


class HashingWriter(dcp.FileSystemWriter):
    """DCP's file writer, also recording the sha256 of every file it writes right after
    writing it (in the writing thread: the background one for asynchronous saves),
    while the bytes are likely still in the page cache."""

    def write_data(self, plan, planner):  # noqa: ANN001, ANN201  (DCP's signature)
        fut = super().write_data(plan, planner)
        names = {r.storage_data.relative_path for r in fut.wait()}  # written: the future is done
        record_sums(
            str(self.path),
            sorted(names),
            f"shards-{dist.get_rank() if dist.is_initialized() else 0}",
        )
        return fut

    def finish(self, metadata, results) -> None:  # noqa: ANN001  (coordinator only, after every write)
        super().finish(metadata, results)
        record_sums(str(self.path), [".metadata"], "metadata")


def write_sums(staging: str) -> str:
    """Merge the ranks' sums, add rng/ and trainer.json, write SUMS; returns SUMS's sha256."""
    sums_dir = os.path.join(staging, _SUMS_DIR)
    lines = []
    for tag in sorted(os.listdir(sums_dir)):
        with open(os.path.join(sums_dir, tag)) as f:
            lines += f.read().splitlines()
    rng = [os.path.join("rng", n) for n in sorted(os.listdir(os.path.join(staging, "rng")))]
    lines += [f"{sha256(os.path.join(staging, n))}  {n}" for n in [*rng, "trainer.json"]]
    with open(os.path.join(staging, SUMS), "w") as f:
        f.write("".join(sorted(line + "\n" for line in lines)))
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(sums_dir)
    return sha256(os.path.join(staging, SUMS))


def read_marker(path: str, step: int) -> dict[str, str]:
    """The marker's fields; CheckpointError unless it is one this module wrote for ``step``."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            fields = dict(kv.split("=", 1) for kv in f.read().split())
        ok = (
            fields["step"] == str(step)
            and fields["world"].isdigit()
            and fields["model_only"] in ("0", "1")
            and re.fullmatch(r"[0-9a-f]{64}", fields["sha256sums"]) is not None
        )
    except (OSError, UnicodeDecodeError, ValueError, KeyError):
        ok = False
    if not ok:
        raise CheckpointError(f"{MARKER} is missing or not one written for step {step}")
    return fields


def read_manifest(path: str, step: int) -> tuple[str | None, list[tuple[str, str]]]:
    """(why the marker or SUMS cannot be trusted, or None; [(relative path, sha256)])."""
    try:
        marker = read_marker(path, step)
    except CheckpointError as e:
        return str(e), []
    sums = os.path.join(path, SUMS)
    if not os.path.isfile(sums):
        return f"{SUMS} is missing (a checkpoint written before checksums, or damaged)", []
    if sha256(sums) != marker["sha256sums"]:
        return f"{SUMS} differs from its sha256 in {MARKER}", []
    files = []
    with open(sums, encoding="utf-8") as f:
        for line in f.read().splitlines():
            digest, _, name = line.partition("  ")
            files.append((name, digest))
    names = {n for n, _ in files}
    if ".metadata" not in names or "trainer.json" not in names:
        return f"{SUMS} lists no .metadata or trainer.json", []
    return None, files
