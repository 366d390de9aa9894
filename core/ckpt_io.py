"""The safetensors files of core.ckpt: atomic writes, checksums written in, verified on read.

Every file carries, in its header metadata, `checksums` (JSON: tensor name -> "xxh3:16 hex digits",
see core.checksum) and `header_checksum` (CRC32 over the whole header but that
one field: tensor names, dtypes, shapes, offsets and every metadata string, progress
included). Hashing runs at memory speed, a few percent of a write (bench/bench_ckpt.py).
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import torch

from core.checksum import checksum_matches
from core.kernel.job import RecipeError
from core.kernel.store import checksum

_NON_NEGATIVE = ("exp_avg_sq", "max_exp_avg_sq", "square_avg")  # optimizer averages of squares


def atomic_write(path: Path, write) -> None:
    """Call `write(file)` on a temporary file, fsync, rename it over `path`: readers see the old file or the new one,
    never half of one (core/kernel/store.py's write_tensors does the same for the kernel's files)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # a write to an open file names none: the disk-full line names this one's folder
        raise err if err.filename else OSError(err.errno, err.strerror, str(tmp)) from None
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)  # the rename itself survives a power cut


def savable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing storage (safetensors refuses tied weights)."""
    out, seen = {}, set()
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        out[key] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The checkpoints of a folder, oldest first (the temporary files of an interrupted write are not)."""
    found = {
        int(m[1]): p
        for p in ckpt_dir.glob("step-*.safetensors")
        if (m := re.fullmatch(r"step-(\d+)\.safetensors", p.name))
    }
    return [found[step] for step in sorted(found)]


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` survive a power cut (a failure raises OSError: the run ends, the descriptor too)."""
    fd = os.open(folder, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def read_header(path: str | os.PathLike) -> dict:
    """The raw JSON header of a safetensors file (the caller has checked that it parses)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def verify(path: Path, header: dict, tensors: dict[str, torch.Tensor], *, fix: str = "") -> None:
    """One RecipeError line naming the tensor (or the header) that fails its checksum or holds a bad value
    (check_values)."""
    fix = fix or f"resume from an older checkpoint in {path.parent} (--resume auto skips damaged ones)"
    meta = header.get("__metadata__", {})
    if meta.get("header_checksum") != checksum(header):
        raise RecipeError(f"{path}: the header does not match its checksum (edited or damaged); {fix}")
    sums = json.loads(meta["checksums"])
    for key, tensor in tensors.items():
        if not checksum_matches(tensor, sums.get(key, "")):  # the old checksums too (a copy: --with old_checksums)
            raise RecipeError(f"{path}: tensor {key} does not match its checksum (the file is damaged); {fix}")
        check_values(path, key, tensor, fix=fix)


def check_values(path: Path, key: str, tensor: torch.Tensor, *, fix: str) -> None:
    """A value no training state can hold, its checksum right (a diverged run's checkpoint): a non-finite weight or
    optimizer state, a negative average of squares."""
    if key.startswith(("model/", "optim/")) and tensor.is_floating_point():
        if not bool(torch.isfinite(tensor).all()):
            raise RecipeError(
                f"{path}: tensor {key} holds a non-finite value (NaN or inf); the run had "
                f"diverged or the file is damaged; {fix}"
            )
        if key.rsplit("/", 1)[-1] in _NON_NEGATIVE and bool((tensor < 0).any()):
            raise RecipeError(f"{path}: tensor {key} holds a negative value (an average of squares cannot); {fix}")
