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
import zlib
from pathlib import Path

import safetensors.torch
import torch

from core.checksum import checksum, checksum_matches
from core.config import RecipeError

_NON_NEGATIVE = ("exp_avg_sq", "max_exp_avg_sq", "square_avg")  # optimizer averages of squares
FORMAT = "torch-dist-recipes/2"  # /2: checksums in every file
CKPT_NAME = re.compile(r"step-(\d+)\.safetensors")
TEMPORARY = re.compile(r"\..+\.tmp-\d+")  # what atomic_write names its temporary file


def header_checksum(header: dict) -> str:
    """CRC32 of the header in a canonical form, without its own `header_checksum` field."""
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if k != "header_checksum"}
    canonical = json.dumps({**header, "__metadata__": meta}, sort_keys=True, separators=(",", ":"))
    return f"crc32:{zlib.crc32(canonical.encode()):08x}"


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call `write(file)` on a temporary file, fsync, then rename over `path`.

    Readers see the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb", buffering=0) as f:  # large writes go straight to the kernel
            write(f)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # a write to an open file names none: the disk-full line names this one's folder
        raise err if err.filename else OSError(err.errno, err.strerror, str(tmp)) from None
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` survive a power cut (a failure raises OSError: the run ends, the descriptor too)."""
    fd = os.open(folder, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the `.NAME.tmp-PID` files an interrupted atomic_write left in run_dir and run_dir/ckpt.

    Only those, by name: the caller holds the run's lock, so no write of ours is in flight (the `lock` feature, for
    that reason)."""
    removed = []
    for folder in (Path(run_dir), Path(run_dir) / "ckpt"):
        for path in folder.glob(".*.tmp-*"):  # none in a folder that does not exist
            if TEMPORARY.fullmatch(path.name) and path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def write_safetensors(
    f, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, *, checksum_of=checksum
) -> None:
    """The safetensors format, with the checksums in its header, written straight from the tensors' memory.

    The tensors are on the CPU and contiguous; `f` is an open file. safetensors.torch.save_file first copies
    every tensor into a bytes object; at checkpoint sizes that copy halves the write speed, so the (simple,
    documented) format is written here.
    """
    header, offset = {"__metadata__": dict(metadata or {})}, 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": _dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if checksum_of is not None:  # None: no checksums (bench/bench_ckpt.py measures what they cost)
        header["__metadata__"]["checksums"] = json.dumps({key: checksum_of(t) for key, t in tensors.items()})
        header["__metadata__"]["header_checksum"] = header_checksum(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes with spaces
    _write_all(f, memoryview(struct.pack("<Q", len(encoded)) + encoded))
    for tensor in tensors.values():
        if tensor.numel():
            _write_all(f, tensor.reshape(-1).view(torch.uint8).numpy().data)  # no copy: the tensor's own bytes


def write_plain(f, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """write_safetensors' file through safetensors' own writer, which copies every tensor once more: what a
    standalone copy takes (`cp --with fast_writer` keeps the other). The same checksums, read back the same."""
    meta = {**(metadata or {}), "checksums": json.dumps({key: checksum(t) for key, t in tensors.items()})}
    data = safetensors.torch.save(tensors, meta)  # its layout sets the offsets the header checksum covers
    meta["header_checksum"] = header_checksum(json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]]))
    view = memoryview(safetensors.torch.save(tensors, meta))  # the same header, with its checksum
    while view:  # an unbuffered write may take less than it was given
        view = view[f.write(view) :]


def _dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of a dtype: F32, BF16, I64, U8, BOOL, ..."""
    if dtype == torch.bool:
        return "BOOL"
    kind = "BF" if dtype == torch.bfloat16 else "F" if dtype.is_floating_point else "U" if dtype == torch.uint8 else "I"
    return f"{kind}{dtype.itemsize * 8}"


def _write_all(f, view: memoryview) -> None:
    while view:  # an unbuffered write may take less than it was given (Linux: at most ~2 GB a call)
        view = view[f.write(view) :]


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
    if meta.get("header_checksum") != header_checksum(header):
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


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints in a folder, oldest first (temporary files of an interrupted write are ignored)."""
    found = {int(m[1]): p for p in Path(ckpt_dir).glob("step-*.safetensors") if (m := CKPT_NAME.fullmatch(p.name))}
    return [found[step] for step in sorted(found)]
